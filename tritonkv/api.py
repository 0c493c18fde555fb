"""``tritonkv.compress``: the front door, usable inside any custom model.

    kept = tritonkv.compress((keys, values), "keydiff", 0.25)
    kept.keys, kept.values, kept.indices          # [B, H_kv, k, D], [B, H_kv, k, D], int64 [B, H_kv, k]

With one budget for every head the result is dense (``Compressed``); with an ``allocation``
(per-head budgets) it is a ``RaggedKV`` that stores each head's kept tokens without padding.

The module reads top-down: ``compress()``, then the checks it runs (cheap on success; the messages of a
failure are built in ``tritonkv.diagnostics``), then the allocated path.
"""
from __future__ import annotations

import math
import numbers
import warnings
from typing import NamedTuple, Optional

import torch

from ._names import SHARED_NAMES
from .kernels import _common, _plan
from .kernels._common import FLOAT_DTYPES, check_kv_tensor
from .policies import POLICIES, get_policy
from .policies.snapkv import WindowAttentionPolicy

#: The extra inputs ``compress()`` accepts, by name, and what reads them. A policy or allocator
#: adds its own through its ``needs`` declaration (and optional ones through an ``accepts`` tuple);
#: any other keyword is a TypeError, so a misspelt input is never silently ignored.
INPUTS = {
    "queries": "the last window of queries [B, H_q, W, D], RoPE applied (snapkv, tova, h2o, surfacelogic; "
               "criticalkv and score over them)",
    "attn_lse": "[B, H_q, W] natural-log softmax normalisers of those queries' prefill attention (optional, "
                "the window-attention policies)",
    "o_proj": "the output projection W_O [D_model, H_q * D] or its nn.Linear (criticalkv)",
    "hd": "head distinctness HD > 0 per KV head [H_kv] (the score policy)",
    "layer": "the layer index (the allocators pyramid, headkv, surfacelogic, score, cake, fixed)",
    "num_layers": "the model's layer count (the pyramid allocator)",
    "profile": "an offline [L, H] head profile (the headkv and surfacelogic allocators)",
    "head_means": "every layer's mean vectors [L, B, H_q, n] (the score allocator)",
    "layer_preference": "every layer's preference P_l, [L] or [L, B] (the cake allocator)",
    "positions": "int64 [B, H_kv, N] original positions of the cached tokens (the transformers integration "
                 "passes it; no built-in policy reads it)",
    "seq_len": "int: tokens of the sequence so far, the same in every layer (the transformers integration passes "
               "it): the allocators over every layer (pyramid, headkv, surfacelogic, cake, score) compute their "
               "table at this length, so that layers whose views differ in length read the same table",
    "forced": "bool [B, H_kv, N]: tokens kept like the protected ones, inside the budget (Policy.select; the "
              "transformers integration keeps a padded row's first real tokens with it); more than the budget "
              "leaves beside the sink and window: a ValueError with an allocation; a dense compress (which reads "
              "nothing back) keeps the lowest-index protected tokens, the window's newest lost first",
    "process_group": "tensor parallel: the torch.distributed group (or DeviceMesh) over which the layer's KV heads "
                     "are split; each rank passes its own heads and keeps exactly what one process would keep of "
                     "them (tritonkv.distributed; None = one process)",
}
PARAMS = ("kv", "policy", "budget", "allocation")  # compress()'s own parameters


class _Required:
    def __repr__(self):
        return "<required>"


_REQUIRED = _Required()  # compress()'s budget has no default: a sentinel so that a missing one is explained


class Compressed(NamedTuple):
    """Dense result: kept keys/values ``[B, H_kv, k, D]`` and their original positions (int64)."""

    keys: torch.Tensor
    values: torch.Tensor
    indices: torch.Tensor


def compress(kv, policy, budget=_REQUIRED, *, allocation=None, **inputs):
    """Evict tokens from one layer's KV cache.

    Args:
        kv: ``(keys, values)``, each ``[B, H_kv, N, D]`` (fp32/fp16/bf16, keys with RoPE applied).
        policy: a name (``"keydiff"``, ``"snapkv"``, ... — see ``tritonkv.POLICIES``) or a policy object
            such as ``tritonkv.policies.SnapKV(window=32, kernel_size=7)``. Settings (``window``,
            ``sink``, ``kernel_size``, ...) belong to the policy object, not to ``compress()``.
        budget: tokens kept per (batch row, KV head) as an int, or the fraction kept as a float in
            (0, 1] (Python or NumPy numbers). Protected tokens (the policy's sink and recent window)
            count inside it. kvpress's ``compression_ratio`` is the fraction *removed*:
            ``budget = 1 - compression_ratio``.
        allocation: optional allocator (a name such as ``"adakv"``/``"pyramid"`` or an allocator
            object) that spreads the same total over heads (and layers: pass ``layer=`` and
            ``num_layers=``); the result is then a ``RaggedKV``. ``"score"`` and ``"surfacelogic"``
            name both a policy and an allocator: ``allocation="score"`` is SCORE's budget allocator,
            ``policy="score"`` SCORE's redundancy-penalised selection (likewise SurfaceLogicKV's
            INF-profile allocator and its window-attention policy).
        **inputs: what the policy or allocator reads, named after what it is (``tritonkv.api.INPUTS``):
            ``queries`` (the last window of queries, ``[B, H_q, W, D]``), ``attn_lse``, ``o_proj``
            (W_O), ``hd``, ``layer``, ``num_layers``, ``profile``, ``head_means``,
            ``layer_preference``, ``positions``, ``forced``, and any name a policy or allocator declares in its
            ``needs`` (or ``accepts``, for optional inputs). Any other keyword is a TypeError naming it.
            ``process_group`` (a ``torch.distributed`` group or DeviceMesh): tensor parallel, the layer's KV
            heads split over the ranks; every rank passes its own heads' slice (and its query heads' queries)
            and keeps exactly the tokens one process would keep of those heads. Cross-head allocators and
            cross-head policies communicate once per layer; see ``tritonkv.distributed`` for the contract.

    Raises:
        TypeError: an unknown keyword (with the near match, or what to do for a policy setting or
            kvpress's ``compression_ratio``, also when it replaces the budget). ValueError: a missing input, a
            budget out of range, queries that are not ``[B, H_q, W, D]`` with ``H_q`` a multiple of the keys'
            ``H_kv`` (or that ``o_proj``'s width, ``attn_lse``'s shape or the policy's window show to be
            ``[B, W, H_q, D]``). A ``UserWarning`` when keys have
            more heads than tokens (probably ``[B, N, H_kv, D]``, not ``[B, H_kv, N, D]``).

    Returns:
        ``Compressed(keys, values, indices)`` with ``[B, H_kv, k, D]`` tensors and int64 original
        positions in ascending order; the input tensors themselves (and ``arange`` indices) when
        ``k >= N``. With ``allocation``: a ``tritonkv.RaggedKV``. The selection is not differentiable: no
        output requires grad (but the input itself), and inputs that require grad cost no more than others.
    """
    if _plan.on():  # the call repeated from its plan (kernels/_plan.py)
        got = _plan_key(kv, policy, budget, allocation, inputs)
        if got is not None:
            key, tensors, known, kv, inputs = got
            return _plan.call(key, tensors, lambda: _compress(kv, policy, budget, allocation, inputs), known)
    return _compress(kv, policy, budget, allocation, inputs)


def compress_kept(kv, policy, budget, *, allocation, **inputs):
    """``compress`` with an allocator, for a caller that lays the kept tokens out itself: where ``compress`` would
    copy an allocator's own selection into rows (AdaKV's exact winners, ``RaggedKV.from_kept``), that selection
    (``allocation.adakv.Kept``, flat indices ``h·N + j`` per batch row) with nothing copied; else what ``compress``
    returns. Not planned (``kernels/_plan.py``): the transformers integration calls it on the CPU's PyTorch path."""
    return _compress(kv, policy, budget, allocation, inputs, kept_only=True)


_KEY_TYPES = frozenset({int, float, bool, str, type(None)})


def _allocators() -> dict:
    from .allocation import ALLOCATORS

    return ALLOCATORS


def _config(obj, names: dict = POLICIES, tensors: Optional[list] = None):
    """A hashable stand-in for a policy (or allocator: ``names``, their registry) given by name, class or object
    (its type and attributes), or None when one of its attributes is not a plain value (or such an object). With
    ``tensors`` (a plan's tensor list), a tensor attribute (e.g. ``Fixed``'s budgets) is appended to it and stands
    in by its metadata: the plan reads it as one of the call's tensors."""
    if type(obj) is str:
        return obj, names.get(obj)  # the class the name maps to now
    if isinstance(obj, type):
        return obj
    items = getattr(obj, "__dict__", None)
    if items is None:
        return None
    out = [type(obj)]
    for name, v in items.items():
        if type(v) not in _KEY_TYPES:
            if type(v) is torch.Tensor and tensors is not None and not v.requires_grad:
                tensors.append(v)
                v = ("tensor", _plan.tensor_key(v))
            else:
                v = _config(v, names, tensors) if hasattr(v, "__dataclass_fields__") else None
            if v is None:
                return None
        out.append((name, v))
    return tuple(out)


# inputs that allocators read on the host (model-level tables): small CPU ones enter the plan key by value, so that
# calls reading them can be planned (any other value read keeps a call off plans)
_BY_VALUE = frozenset({"profile", "layer_preference", "hd"})


_PARAMETER = torch.nn.Parameter


def _by_value(name: str, t: torch.Tensor) -> bool:
    return name in _BY_VALUE and t.is_cpu and t.numel() <= 4096


def _plan_key(kv, policy, budget, allocation, inputs: dict):
    """``(key, tensors, known, kv, inputs)``: what an eager ``compress`` call's every decision depends on, the call's
    tensors (keys, values, the policy's and allocator's tensor attributes, then the tensor inputs in order), the
    positions among them of those whose values the key holds, and the call's ``kv`` and ``inputs`` with every tensor
    that requires grad detached (a call is not differentiable: its kernels run without autograd and no output requires
    grad, but for the input itself returned when nothing is dropped, so keys and values that require grad are then
    kept off plans); None when the key cannot be told from metadata and small host tensors' values (traced, under
    autocast, tensor subclasses, inputs that are not tensors or plain values).

    Taken as ``compress`` reads them: ``kv`` as a list, NumPy numbers (a budget, a layer index), a module's
    ``nn.Parameter`` and W_O as an ``nn.Linear`` (its weight, which is all ``compress`` reads of it)."""
    if type(kv) not in (tuple, list) or len(kv) != 2 or type(budget) not in (int, float) and not _number(budget):
        return None
    if allocation is not None and inputs.get("forced") is not None:  # its rows' counts size the budgets: read each call
        return None
    keys, values = kv
    if type(kv) is list:
        kv = keys, values
    if (type(keys) is not torch.Tensor or type(values) is not torch.Tensor or not _common.use_triton(keys)
            or not _common._eager((), None)
            or torch.is_autocast_enabled(keys.device.type)):  # a replayed op would be cast again, not as recorded
        return None
    if keys.requires_grad or values.requires_grad:
        if allocation is None and not _drops(budget, keys.shape[2]):
            return None
        kv = keys, values = keys.detach(), values.detach()
    tensors, known = [keys, values], []
    pk = _config(policy, POLICIES, tensors)
    ak = None if allocation is None else _config(allocation, _allocators(), tensors)
    if pk is None or allocation is not None and ak is None:
        return None
    tensor_key = _plan.tensor_key
    parts = [pk, ak, type(budget), budget, tensor_key(keys), tensor_key(values), _common._cpu[0],
             torch.get_default_dtype()]
    for name, v in inputs.items():
        t = type(v)
        if t is not torch.Tensor and (t is _PARAMETER or name == "o_proj" and isinstance(v, torch.nn.Linear)):
            v = getattr(v, "weight", v)
            if type(v) not in (torch.Tensor, torch.nn.Parameter):
                return None
            v = v.detach()  # a plain tensor, the same values (the call reads no more of the module)
            inputs = {**inputs, name: v}
            t = torch.Tensor
        if t is torch.Tensor:
            if v.requires_grad:
                v = v.detach()
                inputs = {**inputs, name: v}  # the loop goes on over the caller's dict
            held = None
            if _by_value(name, v):
                known.append(len(tensors))
                held = tuple((v if v.dim() == 1 else v.reshape(-1)).tolist())
            tensors.append(v)
            parts.append((name, tensor_key(v), held))
        elif t in _KEY_TYPES or _number(v):
            parts.append((name, t, v))
        else:
            return None
    # which inputs are one object (keys is values, say): a plan records each object as one slot, so it may
    # serve only calls whose inputs coincide the same way
    ids = [id(t) for t in tensors]
    parts.append(None if len(set(ids)) == len(ids) else tuple(map(ids.index, ids)))
    return tuple(parts), tuple(tensors), tuple(known), kv, inputs


def _number(v) -> bool:
    """A NumPy (or other registered) real number, which a plan key holds by type and value like a Python one."""
    return isinstance(v, numbers.Real) and not isinstance(v, torch.Tensor)


def _drops(budget, n: int) -> bool:
    """A dense ``compress`` of a row of ``n`` tokens with this budget keeps fewer than ``n`` (False for a budget
    ``compress`` refuses)."""
    try:
        return resolve_budget(budget, n) < n
    except (TypeError, ValueError):
        return False


def _compress(kv, policy, budget, allocation, inputs: dict, kept_only: bool = False):
    keys, values = _split_kv(kv)
    pol = get_policy(policy)
    if budget is _REQUIRED:
        from .diagnostics import missing_budget

        raise missing_budget(inputs)
    check_input_names(inputs, pol, allocation)
    _resolve_group(inputs)
    B, H, N, D = keys.shape
    k = resolve_budget(budget, N)
    missing = pol.missing(inputs)
    if missing:
        note = f" (the {SHARED_NAMES[pol.name]})" if pol.name in SHARED_NAMES else ""
        raise ValueError(f"policy {pol.name!r} needs the input(s) {missing}; pass them to compress() by name{note}")
    _check_inputs(keys, inputs, pol)
    if allocation is None and k >= N:
        idx = torch.arange(N, device=keys.device).expand(B, H, N)
        return Compressed(keys, values, idx)
    kk = min(k, N)
    sink, window = pol.protected(N, kk)
    if sink + window > kk:
        raise ValueError(f"budget {k} is smaller than the protected tokens of {pol.name!r} "
                         f"(sink {sink} + window {window}); raise the budget or lower sink/window")
    if allocation is None:
        fused = getattr(pol, "compress_dense", None)  # a policy's closed form of score + select (LagKV), or None
        out = None if fused is None else fused(keys, values, kk, sink=sink, window=window, **inputs)
        if out is not None:
            return Compressed(*out)
        scores, hist0 = pol.score_and_hist0(keys, values, sink=sink, window=window, budget=kk, **inputs)
        kout, vout, idx, _ = pol.select(scores, kk, keys, values, sink=sink, window=window, k_max=kk,
                                        budget=kk, **inputs, **({} if hist0 is None else {"hist0": hist0}))
        return Compressed(kout, vout, idx)
    if B * H == 0:  # per-head rows: an empty batch or no heads has none (dense, both give empty results)
        raise ValueError(f"keys: compress() with an allocation needs at least one batch row and one KV head, got "
                         f"B = {B}, H_kv = {H}")
    return _compress_allocated(pol, allocation, keys, values, kk, sink, window, inputs, kept_only, table_budget=k)


def resolve_budget(budget, n: int) -> int:
    """Tokens kept per (batch row, KV head): an int as is, a float f in (0, 1] as max(1, floor(f·n)).

    (kvpress's ``compression_ratio`` is the fraction *removed*: ``budget = 1 - compression_ratio``.)
    """
    if type(budget) is float and 0.0 < budget <= 1.0:  # the common cases first, without the ABC checks
        return max(1, math.floor(budget * n + 1e-6))
    if type(budget) is int and budget > 0:
        return budget
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real):
        raise TypeError(f"budget must be an int (tokens kept per head) or a float in (0, 1] (fraction kept), "
                        f"got {type(budget).__name__}")
    if isinstance(budget, numbers.Integral):  # int, numpy integers
        if budget <= 0:
            raise ValueError(f"budget must be a positive number of tokens, got {budget}")
        return int(budget)
    dtype = getattr(budget, "dtype", None)  # numpy float16/float32: the number the user wrote (0.7, not 0.69999999)
    budget = float(str(budget)) if getattr(dtype, "itemsize", 8) < 8 else float(budget)
    if not (0.0 < budget <= 1.0) or math.isnan(budget):
        raise ValueError(f"budget as a float is the fraction of tokens kept and must lie in (0, 1], got {budget}")
    return max(1, math.floor(budget * n + 1e-6))


def _split_kv(kv):
    if isinstance(kv, (tuple, list)) and len(kv) == 2:
        keys, values = kv
    elif hasattr(kv, "keys") and hasattr(kv, "values") and isinstance(getattr(kv, "keys"), torch.Tensor):
        keys, values = kv.keys, kv.values
    else:
        raise TypeError("kv must be a (keys, values) pair of [B, H_kv, N, D] tensors")
    check_kv_tensor("keys", keys)
    check_kv_tensor("values", values)
    if values.shape != keys.shape:
        raise ValueError(f"values must have the shape of keys {tuple(keys.shape)}, got {tuple(values.shape)}")
    if values.dtype != keys.dtype:
        raise TypeError(f"values must have the dtype of keys ({keys.dtype}), got {values.dtype}")
    if values.device != keys.device:
        raise ValueError(f"values must be on the device of keys ({keys.device}), got {values.device}")
    if keys.shape[2] == 0:
        raise ValueError("keys: the cache is empty (N = 0); there is nothing to compress")
    return keys, values


_ACCEPTED: set = set()  # (policy type, allocator type, input names) that passed check_input_names


def check_input_names(inputs: dict, policy=None, allocation=None, caller: str = "compress()") -> None:
    """A TypeError naming every keyword in ``inputs`` that ``compress()`` would not use (with the near
    match or, for a policy/allocator setting or kvpress's ``compression_ratio``, what to do instead).
    ``policy``/``allocation`` may be names or objects; the transformers integration can call this when a
    cache is built so that a wrong keyword fails before the first forward (``caller``: the call the error names).

    Memoised per (policy type, allocator type, input names) for the names every object of those types accepts
    (a policy's ``needs`` may depend on its settings: names accepted only through them are checked each call)."""
    pol = get_policy(policy) if policy is not None else None
    alloc = None
    if allocation is not None:
        from .allocation import get_allocator

        alloc = get_allocator(allocation)
    key = (type(pol), type(alloc), frozenset(inputs))
    if key in _ACCEPTED:
        return
    from .diagnostics import accepted_inputs, unknown_inputs

    known = accepted_inputs(pol, alloc)
    if not known.issuperset(inputs):
        raise unknown_inputs(inputs, pol, alloc, known, caller)
    if accepted_inputs(type(pol), type(alloc)).issuperset(inputs) and not torch.compiler.is_compiling():
        _ACCEPTED.add(key)  # not while tracing: a side effect that torch.export warns of


def _check_inputs(keys, inputs: dict, pol) -> None:
    """Shape/device checks of the named extra inputs that several policies share, and the layout mistakes that
    shapes reveal: keys with more heads than tokens (a warning: a short cache can be legitimate), queries that are
    not ``[B, H_q, W, D]`` (an error: recognised from the keys' ``H_kv``, ``o_proj``'s width, ``attn_lse``'s shape
    and the policy's window)."""
    B, H, N, D = keys.shape
    if H > N:
        _plan.spoil()  # a plan would not warn again
        warnings.warn(
            f"keys have more heads than tokens (H_kv = {H} > N = {N}): compress() reads keys and values as "
            f"[B, H_kv, N, D] (transformers' cache layout), so keys in [B, N, H_kv, D] are read as {H} heads of "
            f"{N} tokens; pass keys.transpose(1, 2) and values.transpose(1, 2) if so (and ignore this warning "
            f"if the cache really holds fewer tokens than KV heads)", UserWarning, stacklevel=3)
    q, w = inputs.get("queries"), inputs.get("o_proj")
    if q is None and w is None:
        return
    if q is not None:
        check_kv_tensor("queries", q)
        if q.device != keys.device:
            raise ValueError(f"queries must be on the device of keys ({keys.device}), got {q.device}")
    if w is not None:
        w = getattr(w, "weight", w)  # an nn.Linear or its weight
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            raise ValueError("o_proj must be the output projection weight W_O [D_model, H_q * D] (nn.Linear layout)")
        if w.dtype not in FLOAT_DTYPES:
            raise TypeError(f"o_proj must be float32, float16 or bfloat16, got {w.dtype}")
        if w.device != keys.device:
            raise ValueError(f"o_proj must be on the device of keys ({keys.device}), got {w.device}")
        if q is None:
            if w.shape[1] == 0 or w.shape[1] % (H * D):
                raise ValueError(f"o_proj must be W_O [D_model, H_q * D] with a multiple of H_kv * D = {H * D} "
                                 f"columns, got {tuple(w.shape)}")
            return
    lse = inputs.get("attn_lse")
    lse = lse.shape if isinstance(lse, torch.Tensor) else None
    a, b = q.shape[1], q.shape[2]
    lse_hw = tuple(lse[1:]) if lse is not None and len(lse) == 3 else None
    window = _query_window(pol)
    # the plain reading [B, H_q = a, W = b, D] unless W_O's width, attn_lse [B, H_q, W] or the policy's window
    # (more queries than it reads, as many heads as its window) say the heads are in the third dimension
    plain = (q.shape[0] == B and q.shape[3] == D and a > 0 and a % H == 0 and (w is None or w.shape[1] == a * D)
             and not (lse_hw == (b, a) and a != b))
    # the policy's window alone is a hint, not proof: a model may have as many query heads as the window
    hinted = w is None and lse_hw != (a, b) and window is not None and a == window < b
    if plain and not hinted:
        return
    from .diagnostics import queries_layout

    msg = queries_layout(keys.shape, q.shape, lse, None if w is None else w.shape, window)
    if not plain:
        raise ValueError(msg)
    _plan.spoil()
    warnings.warn(msg + f" (a warning, not an error: H_q = {a} may equal the policy's window by chance; pass attn_lse "
                  "or the last W queries to make the layout unambiguous)", UserWarning, stacklevel=3)


def _query_window(pol):
    """How many of the last queries ``pol`` reads (its window, or its base policy's), or None when unknown."""
    while not isinstance(pol, WindowAttentionPolicy):
        pol = getattr(pol, "base", None)
        if pol is None:
            return None
    return pol.q_window or pol.window


def _resolve_group(inputs: dict) -> None:
    """Replace ``inputs["process_group"]`` by its ``TPGroup`` (checked once), or drop it when there is nothing to
    communicate (None, or a group of one process): policies and allocators then run as in one process. A W_O
    that is a DTensor (transformers' TP plan shards ``o_proj`` by input columns) is read as this rank's columns."""
    w = inputs.get("o_proj")
    w = getattr(w, "weight", w)
    if w is not None and hasattr(w, "to_local") and hasattr(w, "placements"):  # a torch.distributed DTensor
        inputs["o_proj"] = w.to_local()
    if "process_group" not in inputs:
        return
    from .distributed import group_info

    tp = group_info(inputs["process_group"])
    if tp is None:
        del inputs["process_group"]
    else:
        inputs["process_group"] = tp


def layer_budgets(allocation, scores, budget: int, *, sink: int, window: int, **inputs) -> torch.Tensor:
    """Per-head budgets (protected tokens included), int32 ``[B, H_kv]`` on the device (with a
    ``process_group``: this rank's heads)."""
    return _budgets(allocation, scores, budget, sink=sink, window=window, **inputs)[0]


def _budgets(allocation, scores, budget: int, *, sink: int, window: int, **inputs):
    """``(this rank's budgets, every head's budgets)`` (the same tensor without a process group)."""
    alloc = _allocator(allocation, inputs)
    local, every = alloc.split(scores=scores, budget=budget - sink - window, sink=sink, window=window, **inputs)
    same = every is local
    local = local.to(torch.int32) + (sink + window)
    return local, (local if same else every.to(torch.int32) + (sink + window))


def _allocator(allocation, inputs: dict):
    from .allocation import get_allocator

    alloc = get_allocator(allocation)
    missing = [n for n in getattr(alloc, "needs", ()) if inputs.get(n) is None]
    if missing:
        raise ValueError(f"allocation {getattr(alloc, 'name', alloc)!r} needs the input(s) {missing}")
    return alloc


_CONTEXT = ("layer", "num_layers", "process_group", "seq_len")  # inputs that Allocator.context reads


def _forced_reserve(forced, room: int, process_group=None) -> int:
    """The most tokens ``forced`` marks in one row (a host int: read back once when it is on a device; under tensor
    parallelism the most over every rank's rows, one collective, so that every rank sizes its budgets alike), which
    every head's budget then holds beside its share of the allocation, as it holds the sink and window: a head the
    allocator gives few tokens still keeps its forced ones. A head's budget is capped at its row (N), so where a
    head's share plus the reserve exceeds the row the layer keeps fewer than its total (never more). A ValueError
    when they exceed ``room`` (the budget less the sink and window)."""
    if forced is None:
        return 0
    most = forced.sum(-1).amax() if forced.numel() else torch.zeros((), dtype=torch.int64, device=forced.device)
    if process_group is not None:
        from .distributed import group_info

        tp = group_info(process_group)
        if tp is not None:
            most = tp.gather(most)[0].amax()
    f = int(most)
    if f > room:
        raise ValueError(f"forced: a row marks {f} tokens, more than the {room} the budget leaves beside the sink and "
                         f"window; with an allocation every head keeps its forced tokens")
    return f


def _compress_allocated(pol, allocation, keys, values, k, sink, window, inputs, kept_only: bool = False,
                        table_budget: Optional[int] = None):
    """Per-head budgets into a ``RaggedKV`` sized from host ints: nothing is read back to the host when the
    allocator knows its sizes statically, so the whole call can be captured in a CUDA graph. ``k``: the budget
    capped at the row length; ``table_budget``: as given (default ``k``), the mean the allocator's table is computed
    at (``Allocator.context`` caps it at the table's own length: ``seq_len``'s for an allocator over all layers, so
    a layer whose view holds fewer tokens than the budget reads the same table as the others).

    * budgets from host values (``Allocator.host``: uniform, pyramid, HeadKV, SurfaceLogicKV, CAKE, fixed, and
      any allocator when ``b`` keeps all or nothing): one budget for every head is a dense select into rows at
      ``r·cap`` (with the scoring kernel's first radix pass); per-head budgets lay the rows out on the host;
    * AdaKV (exact mode, a plain top-k policy, one process): its winners are the kept tokens, copied into rows
      (``RaggedKV.from_kept``) with no further selection;
    * budgets from the device: ``select`` with the budget tensor into storage of the allocator's static total
      (``Allocator.bound``: AdaKV exactly, its paper mode a bound, SCORE from its layer totals read back once per
      ``head_means`` tensor or list); without one (a custom allocator) the total and the longest row are read back
      once.

    Tensor parallel: each rank's rows, and the layer's longest row (``TPRaggedKV.extra``) so that a later padded
    view spans the same N on every rank; from host tables, or read back once for AdaKV and SCORE."""
    from .cache import RaggedKV
    from .policies.base import Policy

    alloc = _allocator(allocation, inputs)
    B, H, N, _ = keys.shape
    # a budget that keeps every token keeps the forced ones: nothing to reserve (nor to read back)
    f = 0 if k >= N else _forced_reserve(inputs.get("forced"), k - sink - window, inputs.get("process_group"))
    p = sink + window + f  # tokens every head keeps beside its share of the allocation
    ctx = alloc.context((B, H, N), keys.device, (k if table_budget is None else table_budget) - p, sink, window,
                        **{n: inputs[n] for n in _CONTEXT if n in inputs})
    rest = {n: v for n, v in inputs.items() if n not in _CONTEXT}
    plain = type(pol).select is Policy.select and inputs.get("forced") is None

    def score(hist: bool):
        """The policy's scores, and its selects' inputs (with the scoring kernel's first radix pass when the
        select that follows is a plain top-k of these scores: ``hist``)."""
        if not (hist and plain):
            return pol.score(keys, values, budget=k, **inputs), inputs
        scores, hist0 = pol.score_and_hist0(keys, values, sink=sink, window=window, budget=k, **inputs)
        return scores, (inputs if hist0 is None else dict(inputs, hist0=hist0))

    known = alloc.host(ctx, **rest)
    tp = ctx["tp"]
    cls = RaggedKV
    if tp is not None:
        from .distributed import TPRaggedKV as cls
    if known is not None:  # host ints: the layout is static, nothing is read back
        from .allocation.base import host_rows

        every = [[min(v, N - p) for v in r] for r in host_rows(known, ctx)] if f else host_rows(known, ctx)
        longest = max(max(r) for r in every)
        scores, sel = score(True)
        if longest == min(min(r) for r in every):  # one budget for every head: rows at r·cap, as dense rows
            return cls.from_policy(pol, scores, longest + p, keys, values, sink=sink, window=window,
                                   k_max=longest + p, **sel)
        mine = every if tp is None else [r[tp.heads(H)] for r in every]
        budgets = tuple(v + p for r in mine for v in r)
        out = cls.from_policy(pol, scores, budgets, keys, values, sink=sink, window=window, **sel)
        if tp is not None:
            out.extra = max(min(longest + p, N) - min(max(budgets), N), 0)
        return out
    kept = getattr(alloc, "kept", None)
    scores, sel = score(True)
    if plain and kept is not None and tp is None:  # the first radix pass serves the allocator's per-head select
        kept = kept(scores, ctx, **rest, **({} if sel.get("hist0") is None else {"hist0": sel["hist0"]}))
        if kept is not None:
            if kept_only:  # the caller lays the rows out (``compress_kept``)
                return kept
            return RaggedKV.from_kept(kept.indices, keys, values, longest=kept.longest)
    plan = alloc.plan(ctx, scores, **rest)
    budgets = plan.local.to(torch.int32)
    if f:
        budgets = budgets.clamp(max=N - p)
    if p:
        budgets = budgets + p
    R = budgets.numel()
    if tp is None:
        if plan.total is None:  # only the device knows the sum: one read-back of two ints
            total, k_max = torch.stack([budgets.sum(), budgets.max()]).tolist()
        else:
            total, k_max = plan.total + R * p, min(plan.longest + p, N)  # with forced tokens: a bound
        return RaggedKV.from_policy(pol, scores, budgets, keys, values, sink=sink, window=window,
                                    total=int(total), k_max=int(k_max), **sel)
    # tensor parallel, budgets from the device (AdaKV, SCORE): this rank's total and longest row and the layer's
    # longest row, read back once (a rank's share of the layer total depends on the scores)
    every = plan.every.to(torch.int32).clamp(max=N - p) + p
    total, k_max, longest = torch.stack([budgets.sum(), budgets.max(), every.max()]).tolist()
    out = cls.from_policy(pol, scores, budgets, keys, values, sink=sink, window=window, total=int(total),
                          k_max=int(k_max), **sel)
    out.extra = max(min(int(longest), N) - min(int(k_max), N), 0)
    return out
