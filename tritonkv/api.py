"""``tritonkv.compress``: the front door, usable inside any custom model.

    kept = tritonkv.compress((keys, values), "keydiff", 0.25)
    kept.keys, kept.values, kept.indices          # [B, H_kv, k, D], [B, H_kv, k, D], int64 [B, H_kv, k]

With one budget for every head the result is dense (``Compressed``); with an ``allocation``
(per-head budgets) it is a ``RaggedKV`` that stores each head's kept tokens without padding.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
from typing import NamedTuple

import torch

from ._names import SHARED_NAMES, suggest
from .kernels._common import FLOAT_DTYPES, check_kv_tensor
from .policies import POLICIES, get_policy

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
              "transformers integration keeps a padded row's first real tokens with it)",
    "process_group": "tensor parallel: the torch.distributed group (or DeviceMesh) over which the layer's KV heads "
                     "are split; each rank passes its own heads and keeps exactly what one process would keep of "
                     "them (tritonkv.distributed; None = one process)",
}
_PARAMS = ("kv", "policy", "budget", "allocation")  # compress()'s own parameters


class Compressed(NamedTuple):
    """Dense result: kept keys/values ``[B, H_kv, k, D]`` and their original positions (int64)."""

    keys: torch.Tensor
    values: torch.Tensor
    indices: torch.Tensor


def resolve_budget(budget, n: int) -> int:
    """Tokens kept per (batch row, KV head): an int as is, a float f in (0, 1] as max(1, floor(f·n)).

    (kvpress's ``compression_ratio`` is the fraction *removed*: ``budget = 1 - compression_ratio``.)
    """
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


def _names(x) -> tuple[str, ...]:
    """``needs``/``accepts`` of a policy or allocator (object or class; a class's property reads as none)."""
    out = ()
    for attr in ("needs", "accepts"):
        v = getattr(x, attr, ())
        if isinstance(v, (tuple, list, set, frozenset)):
            out += tuple(n for n in v if isinstance(n, str))
    return out


def accepted_inputs(policy=None, allocation=None) -> set[str]:
    """The input names ``compress()`` accepts (with this policy and allocator objects)."""
    from .allocation import ALLOCATORS

    known = set(INPUTS)
    for x in (*POLICIES.values(), *ALLOCATORS.values(), policy, allocation):
        if x is not None:
            known.update(_names(x))
    return known


def _short(v) -> str:
    """``v`` for a message: numbers and strings as written, anything else as ``...``."""
    return repr(v) if v is None or isinstance(v, (str, numbers.Number)) else "..."


def _ctor(cls, package: str) -> str:
    """How a user writes ``cls``: ``tritonkv.policies.SnapKV`` when exported there, else its name."""
    import importlib

    try:
        if getattr(importlib.import_module(package), cls.__name__, None) is cls:
            return f"{package}.{cls.__name__}"
    except Exception:
        pass
    return cls.__qualname__


def _settings(cls) -> list[str]:
    """The settings a user passes to the class (its init fields)."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        return []
    return [f.name for f in dataclasses.fields(cls) if f.init]


def _unknown_input(name: str, value, pol, alloc, known) -> str:
    """Why ``compress(..., name=value)`` is not accepted, and what was probably meant."""
    from .allocation import ALLOCATORS

    v = _short(value)
    if name == "compression_ratio":
        here = ""
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and 0 <= float(value) < 1:
            here = f" (here {1 - float(value):.6g}: compress(kv, policy, {1 - float(value):.6g}))"
        return (f"'compression_ratio' (kvpress's compression_ratio is the fraction removed; tritonkv's budget is "
                f"the fraction kept: budget = 1 - compression_ratio{here})")
    pcls = type(pol) if pol is not None else None
    if pcls is not None and name in _settings(pcls):
        return (f"{name!r} ({name}={v} is a setting of the policy {pol.name!r}, not an input of compress(): pass "
                f"{_ctor(pcls, 'tritonkv.policies')}({name}={v}) as the policy)")
    base = getattr(pol, "base", None)
    if dataclasses.is_dataclass(pol) and name in (f.name for f in dataclasses.fields(pol)):
        if base is not None and name in _settings(type(base)):  # CriticalKV/SCORE mirror their base's sink/window
            return (f"{name!r} ({name}={v} is a setting of the base policy of {pol.name!r}, not an input of "
                    f"compress(): pass {_ctor(pcls, 'tritonkv.policies')}(base="
                    f"{_ctor(type(base), 'tritonkv.policies')}({name}={v})) as the policy)")
    acls = type(alloc) if alloc is not None else None
    if acls is not None and name in _settings(acls):
        return (f"{name!r} ({name}={v} is a setting of the allocator {alloc.name!r}, not an input of compress(): "
                f"pass allocation={_ctor(acls, 'tritonkv.allocation')}({name}={v}))")
    pols = [n for n, c in POLICIES.items() if name in _settings(c)]  # registry order: snapkv before h2o
    allocs = [n for n, c in ALLOCATORS.items() if name in _settings(c)]
    if pols or allocs:
        parts = []
        if pols:
            ex = _ctor(POLICIES[pols[0]], "tritonkv.policies")
            parts.append(f"of the policies {', '.join(pols)} (e.g. {ex}({name}={v}), passed as the policy)")
        if allocs:
            ex = _ctor(ALLOCATORS[allocs[0]], "tritonkv.allocation")
            parts.append(f"of the allocators {', '.join(allocs)} (e.g. allocation={ex}({name}={v}))")
        mine = "" if pol is None else (f"; the policy {pol.name!r} has no setting {name!r}: its settings are "
                                       f"{', '.join(_settings(pcls)) or 'none'}")
        return f"{name!r} ({name}={v} is a setting {' and '.join(parts)}, not an input of compress(){mine})"
    s = suggest(name, sorted(known) + list(_PARAMS))
    return f"{name!r}" + (f" (did you mean {s!r}?)" if s else "")


def check_input_names(inputs: dict, policy=None, allocation=None) -> None:
    """A TypeError naming every keyword in ``inputs`` that ``compress()`` would not use (with the near
    match or, for a policy/allocator setting or kvpress's ``compression_ratio``, what to do instead).
    ``policy``/``allocation`` may be names or objects; the transformers integration can call this when a
    cache is built so that a wrong keyword fails before the first forward."""
    pol = get_policy(policy) if policy is not None else None
    alloc = None
    if allocation is not None:
        from .allocation import get_allocator

        alloc = get_allocator(allocation)
    known = accepted_inputs(pol, alloc)
    bad = [n for n in inputs if n not in known]
    if not bad:
        return
    why = [_unknown_input(n, inputs[n], pol, alloc, known) for n in bad]
    what = "an unexpected keyword argument" if len(bad) == 1 else "unexpected keyword arguments"
    raise TypeError(f"compress() got {what} " + "; ".join(why)
                    + f". The inputs compress() accepts: {', '.join(sorted(known))}")


def _check_layout(keys, inputs: dict) -> None:
    """Layout mistakes that shapes alone reveal: keys with more heads than tokens (a warning: a short
    cache can be legitimate) and queries whose head count does not divide by the keys' (an error)."""
    B, H, N, D = keys.shape
    if H > N:
        warnings.warn(
            f"keys have more heads than tokens (H_kv = {H} > N = {N}): compress() reads keys and values as "
            f"[B, H_kv, N, D] (transformers' cache layout), so keys in [B, N, H_kv, D] are read as {H} heads of "
            f"{N} tokens; pass keys.transpose(1, 2) and values.transpose(1, 2) if so (and ignore this warning "
            f"if the cache really holds fewer tokens than KV heads)", UserWarning, stacklevel=3)
    q = inputs.get("queries")
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[0] != B or q.shape[3] != D or H == 0:
        return  # the plain checks below name what is wrong
    if q.shape[1] % H:
        hint = ""
        if q.shape[2] % H == 0:
            hint = (f"; queries look like [B, W, H_q, D] (W = {q.shape[1]} tokens of H_q = {q.shape[2]} heads): "
                    f"pass queries.transpose(1, 2)")
        elif H > N:
            hint = f"; the keys look like [B, N, H_kv, D] (see the warning): pass keys.transpose(1, 2)"
        raise ValueError(f"queries must be [B={B}, H_q, W, D={D}] with H_q a multiple of the keys' H_kv = {H} "
                         f"(grouped-query attention), got {tuple(q.shape)}: H_q = {q.shape[1]} is not a multiple "
                         f"of {H}. compress() expects keys/values [B, H_kv, N, D] and queries [B, H_q, W, D] "
                         f"(transformers' layouts after .transpose(1, 2)){hint}")


def _check_inputs(keys, inputs: dict) -> None:
    """Shape/device checks of the named extra inputs that several policies share."""
    B, H, N, D = keys.shape
    q = inputs.get("queries")
    if q is not None:
        check_kv_tensor("queries", q)
        if q.shape[0] != B or q.shape[3] != D or q.shape[1] % H != 0:
            raise ValueError(f"queries must be [B={B}, H_q (a multiple of H_kv={H}), W, D={D}], got {tuple(q.shape)}")
        if q.device != keys.device:
            raise ValueError(f"queries must be on the device of keys ({keys.device}), got {q.device}")
    w = inputs.get("o_proj")
    if w is not None:
        w = getattr(w, "weight", w)  # an nn.Linear or its weight
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            raise ValueError("o_proj must be the output projection weight W_O [D_model, H_q * D] (nn.Linear layout)")
        if w.dtype not in FLOAT_DTYPES:
            raise TypeError(f"o_proj must be float32, float16 or bfloat16, got {w.dtype}")
        width = None if q is None else q.shape[1] * D
        if (width is not None and w.shape[1] != width) or w.shape[1] == 0 or w.shape[1] % (H * D):
            want = f"H_q * D = {width}" if width is not None else f"a multiple of H_kv * D = {H * D}"
            hint = ""
            if q is not None and w.shape[1] == q.shape[2] * D:
                hint = (f"; its columns fit H_q = {q.shape[2]} heads, the queries' third dimension: queries look "
                        f"like [B, W, H_q, D], pass queries.transpose(1, 2)")
            raise ValueError(f"o_proj must be W_O [D_model, H_q * D] with {want} columns, got {tuple(w.shape)}"
                             + hint)
        if w.device != keys.device:
            raise ValueError(f"o_proj must be on the device of keys ({keys.device}), got {w.device}")


def compress(kv, policy, budget, *, allocation=None, **inputs):
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
            kvpress's ``compression_ratio``). ValueError: a missing input, a budget out of range,
            queries whose head count is not a multiple of the keys'. A ``UserWarning`` when keys have
            more heads than tokens (probably ``[B, N, H_kv, D]``, not ``[B, H_kv, N, D]``).

    Returns:
        ``Compressed(keys, values, indices)`` with ``[B, H_kv, k, D]`` tensors and int64 original
        positions in ascending order; the input tensors themselves (and ``arange`` indices) when
        ``k >= N``. With ``allocation``: a ``tritonkv.RaggedKV``.
    """
    keys, values = _split_kv(kv)
    pol = get_policy(policy)
    check_input_names(inputs, pol, allocation)
    _resolve_group(inputs)
    B, H, N, D = keys.shape
    k = resolve_budget(budget, N)
    missing = pol.missing(inputs)
    if missing:
        note = f" (the {SHARED_NAMES[pol.name]})" if pol.name in SHARED_NAMES else ""
        raise ValueError(f"policy {pol.name!r} needs the input(s) {missing}; pass them to compress() by name{note}")
    _check_layout(keys, inputs)
    _check_inputs(keys, inputs)
    if allocation is None and k >= N:
        idx = torch.arange(N, device=keys.device).expand(B, H, N)
        return Compressed(keys, values, idx)
    kk = min(k, N)
    sink, window = pol.protected(N, kk)
    if sink + window > kk:
        raise ValueError(f"budget {k} is smaller than the protected tokens of {pol.name!r} "
                         f"(sink {sink} + window {window}); raise the budget or lower sink/window")
    if allocation is None:
        scores, hist0 = pol.score_and_hist0(keys, values, sink=sink, window=window, budget=kk, **inputs)
        kout, vout, idx, _ = pol.select(scores, kk, keys, values, sink=sink, window=window, k_max=kk,
                                        budget=kk, **inputs, **({} if hist0 is None else {"hist0": hist0}))
        return Compressed(kout, vout, idx)
    scores = pol.score(keys, values, budget=kk, **inputs)
    return _compress_allocated(pol, allocation, scores, keys, values, kk, sink, window, inputs)


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
    from .allocation import get_allocator

    alloc = get_allocator(allocation)
    missing = [n for n in getattr(alloc, "needs", ()) if inputs.get(n) is None]
    if missing:
        raise ValueError(f"allocation {getattr(alloc, 'name', alloc)!r} needs the input(s) {missing}")
    local, every = alloc.split(scores=scores, budget=budget - sink - window, sink=sink, window=window, **inputs)
    same = every is local
    local = local.to(torch.int32) + (sink + window)
    return local, (local if same else every.to(torch.int32) + (sink + window))


def _compress_allocated(pol, allocation, scores, keys, values, k, sink, window, inputs):
    from .cache import RaggedKV

    budgets, every = _budgets(allocation, scores, k, sink=sink, window=window, **inputs)
    # The ragged storage is sized to what is actually kept: one read-back of two ints per
    # compression (never per decode step), so that per-head budgets free memory for real.
    # Tensor parallel: the rank's own total and longest row, and the layer's longest row (every rank computed
    # every head's budget), so that a later padded view spans the same N on every rank.
    if every is budgets:
        total, k_max = torch.stack([budgets.sum(), budgets.max()]).tolist()
        return RaggedKV.from_policy(pol, scores, budgets, keys, values, sink=sink, window=window,
                                    total=int(total), k_max=int(k_max), **inputs)
    from .distributed import TPRaggedKV

    total, k_max, longest = torch.stack([budgets.sum(), budgets.max(), every.max()]).tolist()
    n = keys.shape[2]
    out = TPRaggedKV.from_policy(pol, scores, budgets, keys, values, sink=sink, window=window, total=int(total),
                                 k_max=int(k_max), **inputs)
    out.extra = max(min(int(longest), n) - min(int(k_max), n), 0)
    return out
