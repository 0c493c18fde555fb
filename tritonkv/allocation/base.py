"""The allocator protocol, the registry and the checks every allocator shares.

An allocator object is a small dataclass of settings with a ``name``, a ``needs`` declaration
(the extra inputs it reads, checked by ``compress()``) and ``__call__``:

    alloc(scores=<fp32 [B, H, N]>, budget=<selectable b per head>, sink=, window=, layer=,
          num_layers=, **inputs) -> int32 [B, H] selectable budgets on the scores' device

The selectable region of a row is tokens ``[sink, N - window)`` (``avail = N - sink - window``
of them); callers add the protected count ``sink + window`` back. Allocators that depend only on
shapes never read score values (``scores`` may then be replaced by ``shape=(B, H, N)``).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import weakref
from typing import ClassVar, NamedTuple, Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..kernels import _plan
from ..kernels._common import check_int  # noqa: F401  (the library's one integer check; allocators import it here)

ALLOCATORS: dict[str, type["Allocator"]] = {}

EPS_FLOOR = 1e-6  # floor(x + 1e-6): the library's convention for floors of float products (docs/algorithms.md §0)


def register_allocator(cls):
    """Class decorator: make ``cls`` reachable by its ``name`` in ``compress(allocation=...)``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    ALLOCATORS[cls.name] = cls
    return cls


def get_allocator(allocation) -> "Allocator":
    """An allocator object from a name, a class or an object (objects pass through).

    An unknown name is a ValueError with the near match (``'AdaKV'`` → ``'adakv'``) or, for a
    policy's name (``'snapkv'``), the note that it is a policy. ``'score'`` and ``'surfacelogic'``
    name an allocator *and* a policy: here they are the allocators (SCORE's layer/head budgets;
    SurfaceLogicKV's INF-profile budgets), not the policies of the same name.
    """
    if isinstance(allocation, Allocator):
        return allocation
    if isinstance(allocation, str):
        try:
            return ALLOCATORS[allocation]()
        except KeyError:
            from .._names import unknown_name
            from ..policies import POLICIES

            raise ValueError(unknown_name("allocation", allocation, ALLOCATORS, "policy", POLICIES)) from None
    if isinstance(allocation, type) and issubclass(allocation, Allocator):
        return allocation()
    raise TypeError(f"allocation must be a name ({sorted(ALLOCATORS)}) or a tritonkv.allocation.Allocator, "
                    f"got {type(allocation).__name__}")


def floor_eps(x: float) -> int:
    """``floor(x + 1e-6)``: floors of float products such as α·b or b/β (0.29·100 gives 29)."""
    return math.floor(x + EPS_FLOOR)


def check_tensor(name: str, t, ndim=None, *, floating: bool = True) -> torch.Tensor:
    """A TypeError naming ``name`` unless ``t`` is a real (float, or with ``floating=False`` also
    integer) tensor; a ValueError unless it has ``ndim`` dimensions (an int or a tuple of ints)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype == torch.bool or t.dtype.is_complex or (floating and not t.dtype.is_floating_point):
        raise TypeError(f"{name} must be a {'float' if floating else 'real'} tensor, got {t.dtype}")
    dims = (ndim,) if isinstance(ndim, int) else ndim
    if dims is not None and t.dim() not in dims:
        raise ValueError(f"{name} must have {' or '.join(map(str, dims))} dimensions, got shape {tuple(t.shape)}")
    return t


def check_budget(b, avail) -> None:
    """The selectable budget ``b`` and the selectable row length ``avail`` of a budget function: ints >= 0."""
    check_int("b", b)
    check_int("avail", avail)


def check_mode(mode: str, modes: tuple[str, ...]) -> str:
    if mode not in modes:
        raise ValueError(f"mode must be one of {modes}, got {mode!r}")
    return mode


def check_positive(name: str, v, lo: float = 0.0, strict: bool = True, hi: Optional[float] = None) -> float:
    """A finite real number (Python's or NumPy's) above ``lo`` (``strict``) or at least ``lo``, and at most ``hi``."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or \
            (v <= lo if strict else v < lo) or (hi is not None and v > hi):
        rng = f"{'>' if strict else '>='} {lo}" + ("" if hi is None else f" and <= {hi}")
        raise ValueError(f"{name} must be a finite number {rng}, got {v!r}")
    return float(v)


def check_profile(name: str, profile, num_heads: Optional[int] = None,
                  num_query_heads: Optional[int] = None) -> torch.Tensor:
    """A float ``[L, H]`` profile; a query-head profile ``[L, G·H]`` is averaged over each group. With
    ``num_query_heads`` (H_q, when the caller knows it) the width must be ``H`` or ``H_q``."""
    if not isinstance(profile, torch.Tensor):
        try:
            profile = torch.as_tensor(profile, dtype=torch.float64)
        except Exception:
            raise TypeError(f"{name} must be an [L, H] tensor of non-negative floats, got {type(profile).__name__}") from None
    if profile.dim() != 2 or profile.shape[0] < 1 or profile.shape[1] < 1:
        raise ValueError(f"{name} must be an [L, H] tensor (layers x heads), got shape {tuple(profile.shape)}")
    if profile.dtype == torch.bool or profile.dtype.is_complex:
        raise TypeError(f"{name} must hold real numbers, got {profile.dtype}")
    profile = profile.to(torch.float64)
    if num_heads is not None and profile.shape[1] != num_heads:
        check_profile_width(name, profile.shape[1], num_heads, num_query_heads)
        profile = profile.view(profile.shape[0], num_heads, -1).mean(-1)
    return profile


def check_profile_width(name: str, width: int, num_heads: int, num_query_heads: Optional[int] = None) -> None:
    """A ValueError unless a profile of ``width`` heads per layer fits ``num_heads`` KV heads: ``H_kv`` itself, or
    ``H_q`` (``num_query_heads``) when known, else any multiple of ``H_kv``."""
    if width == num_heads or (width == num_query_heads if num_query_heads else width % num_heads == 0):
        return
    if num_query_heads:
        raise ValueError(f"{name} has {width} heads per layer: expected H_kv = {num_heads} or H_q = "
                         f"{num_query_heads} (query heads, averaged over each group)")
    raise ValueError(f"{name} has {width} heads per layer: expected H_kv = {num_heads} or a "
                     f"multiple of it (query heads, averaged over each group)")


def query_heads(ctx: dict, inputs: dict) -> Optional[int]:
    """The model's query heads H_q when the inputs show them (``queries`` ``[B, H_q, W, D]``; under tensor
    parallelism a rank's queries hold its share, ``H_q / world``), else None."""
    q = inputs.get("queries")
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        return None
    tp = ctx.get("tp")
    return int(q.shape[1]) * (1 if tp is None else tp.world)


def check_query_width(name: str, profile, ctx: dict, inputs: dict) -> None:
    """``check_profile_width`` of an ``[L, W]`` profile against ``ctx``'s KV heads and the H_q that ``inputs`` show
    (a shape check: no value is read); nothing to check without queries."""
    hq = query_heads(ctx, inputs)
    if hq is None or profile is None:
        return
    if not isinstance(profile, torch.Tensor):
        try:
            profile = torch.as_tensor(profile, dtype=torch.float64)
        except Exception:
            return  # check_profile says what is wrong with it
    if profile.dim() == 2:
        check_profile_width(name, profile.shape[1], ctx["H"], hq)


def check_nonnegative(name: str, t: torch.Tensor) -> torch.Tensor:
    """Host-side value check, done once when a profile is given to an allocator object."""
    bad = t.detach().cpu()
    if not torch.isfinite(bad).all() or (bad < 0).any():
        raise ValueError(f"{name} must be finite and non-negative (no NaN or inf)")
    return t


class Plan(NamedTuple):
    """An allocation and what the host knows of it without reading the device (``Allocator.plan``)."""

    local: torch.Tensor  # int32 [B, H_l]: this rank's selectable budgets (every head's with no process group)
    every: torch.Tensor  # int32 [B, H]: every head's (``local`` itself with no process group)
    total: Optional[int]  # >= the sum of ``local`` (exact for host budgets), or None: unknown without a read-back
    longest: Optional[int]  # >= the largest entry of ``local``, or None
    layer_longest: Optional[int]  # the largest entry of ``every`` (exact), or None


_MEMO: dict = {}  # (ids of the tensors, their versions, key) -> (weak references to them, value)


def _content(x):
    """The bytes of a small host tensor (None for another), read out of sight of a plan being recorded
    (``kernels/_plan.py``): outside dispatch modes and through the base class's ``numpy``, so that the recording
    call finds the table the call before it cached, and no replay repeats the read."""
    if not (x.is_cpu and x.numel() <= 4096):
        return None
    with _disable_current_modes():
        return torch._C.TensorBase.numpy(x.detach().reshape(-1).view(torch.uint8)).tobytes()


def memo(t, key, fn):
    """``fn()``, cached per (the tensor object ``t`` as it is now, ``key``): a table computed from a model-level
    input that every layer passes again (a profile, CAKE's preferences, SCORE's head means) is computed once. An
    in-place change of ``t`` bumps its version and misses the cache; so does a new object. ``t`` may also be a
    list or tuple of tensors (SCORE's head means, one per layer): cached per those objects as they are. A write
    that bumps no version (through a NumPy view or ``.data``) misses it too in small host tensors (up to 4096
    elements, such as a profile or CAKE's preferences), whose values are part of the key. Not cached: anything
    else, and inference-mode tensors (they have no version counter)."""
    if torch.compiler.is_compiling():  # traced: the table is part of the graph
        return fn()
    many = isinstance(t, (list, tuple))
    parts = tuple(t) if many else (t,)
    try:
        k = (tuple(map(id, parts)), tuple(x._version for x in parts), key, tuple(map(_content, parts)))
    except (AttributeError, RuntimeError, TypeError):
        return fn()
    if not many:
        _plan.depends_on(t)  # a plan recorded now holds for this object as it is now
    hit = _MEMO.get(k)
    if hit is not None and all(ref() is x for ref, x in zip(hit[0], parts)):
        return hit[1]
    value = fn()
    if len(_MEMO) >= 64:
        _MEMO.pop(next(iter(_MEMO)))
    _MEMO[k] = (tuple(map(weakref.ref, parts)), value)
    return value


def host_row(alloc: "Allocator", ctx: dict, source, key, table):
    """``Allocator.host`` of an allocator whose whole table (``[L, ...]``, one row per layer) follows from one
    model-level input ``source`` (a profile, CAKE's preferences): the layer's row of ``table(ctx on the CPU,
    source on the CPU)`` as nested lists of ints, the table computed once per ``source`` object and ``key``. A
    ``source`` on the device is read back once for it (not once per layer). None while tracing (torch.compile)."""
    if source is None or torch.compiler.is_compiling():
        return None

    def compute():
        src = source.cpu() if isinstance(source, torch.Tensor) else source
        return table(dict(ctx, device=torch.device("cpu")), src).tolist()
    full = memo(source, key, compute)
    return full[alloc.need_layer(ctx, len(full))]


def host_rows(known, ctx: dict) -> list:
    """``Allocator.host``'s answer (an int, or nested lists broadcastable to ``[B, H]``) as ``B`` lists of every
    head's selectable budget, capped at the row's avail when the allocator's table was read at a longer sequence."""
    B, H, avail = ctx["B"], ctx["H"], ctx["row_avail"]
    cap = (lambda v: min(v, avail)) if ctx["avail"] != avail else (lambda v: v)
    if isinstance(known, int):
        return [[cap(known)] * H] * B
    rows = known if isinstance(known[0], list) else [known]
    rows = [[cap(int(v)) for v in (r * H if len(r) == 1 else r)] for r in rows]
    if len(rows) != B and len(rows) != 1 or any(len(r) != H for r in rows):
        raise ValueError(f"budgets of shape [{len(rows)}, {len(rows[0])}] do not fit [B, H_kv] = [{B}, {H}]")
    return rows * B if len(rows) == 1 else rows


@dataclasses.dataclass
class Allocator:
    """Base class: subclasses set ``name``/``needs`` and implement ``allocate``.

    Tensor parallel (``process_group=``, ``tritonkv.distributed``): ``scores`` hold this rank's ``H_l`` heads of a
    layer of ``H = world·H_l``; ``ctx["H"]`` is then the layer's ``H`` and ``allocate`` returns every head's
    budgets (the same on every rank), of which each rank keeps its own. ``tp_mode`` says how scores reach it:
    ``"replicated"`` (the budgets read no scores, only shapes and replicated inputs: no collective), ``"gather"``
    (the default, for allocators that read scores across heads: the scores ``[B, H, N]`` of all ranks, gathered
    in one collective) or ``"custom"`` (``allocate`` reads ``ctx["tp"]`` and communicates itself).
    """

    name: ClassVar[str] = ""
    #: names of the extra inputs the allocator reads (``compress()`` checks they are present)
    needs: ClassVar[tuple[str, ...]] = ()
    #: how the allocator runs under tensor parallelism (see the class docstring)
    tp_mode: ClassVar[str] = "gather"
    #: the budgets come from one table over every layer (pyramid, headkv, surfacelogic, cake, score): with a
    #: ``seq_len`` input the table is computed at the sequence's length, the same in every layer, and each row is
    #: then capped at the layer's own ``avail`` (block-wise, a layer's view is shorter than the sequence)
    cross_layer: ClassVar[bool] = False

    def __call__(self, scores=None, budget=None, sink: int = 0, window: int = 0, layer=None, num_layers=None,
                 shape=None, process_group=None, **inputs) -> torch.Tensor:
        """int32 ``[B, H]`` selectable budgets (each in ``[0, avail]``) on the scores' device (with a
        ``process_group``: this rank's heads, ``[B, H_l]``)."""
        return self.split(scores, budget, sink, window, layer, num_layers, shape, process_group, **inputs)[0]

    def split(self, scores=None, budget=None, sink: int = 0, window: int = 0, layer=None, num_layers=None,
              shape=None, process_group=None, seq_len=None, **inputs):
        """``(this rank's budgets [B, H_l], every head's [B, H])``, int32; with no process group both are the
        same ``[B, H]`` tensor.

        ``seq_len``: tokens of the sequence so far, the same in every layer (the transformers integration passes
        them). A ``cross_layer`` allocator computes its table at ``seq_len - sink - window`` rather than at this
        layer's ``avail`` and caps the row at ``avail``: otherwise layers whose views differ in length (block-wise
        prefill with per-head budgets) would each read their own table, and the budgets held over all layers
        would drift above ``L·H·b``."""
        if scores is not None:
            if not isinstance(scores, torch.Tensor) or scores.dim() != 3:
                raise ValueError("scores must be a [B, H_kv, N] tensor")
            shape, device = scores.shape, scores.device
        elif shape is not None:
            device = torch.device(inputs.pop("device", "cpu"))
        else:
            raise ValueError(f"allocation {self.name!r}: pass scores [B, H_kv, N] (or shape=(B, H_kv, N))")
        ctx = self.context(shape, device, budget, sink, window, layer=layer, num_layers=num_layers,
                           process_group=process_group, seq_len=seq_len)
        return self.plan(ctx, scores, **inputs)[:2]

    def context(self, shape, device, budget, sink: int = 0, window: int = 0, *, layer=None, num_layers=None,
                process_group=None, seq_len=None) -> dict:
        """The checked settings of one call (``allocate``'s ``ctx``) for scores of ``shape`` ``(B, H_kv, N)`` on
        ``device`` (see ``split`` for the arguments)."""
        B, H, N = (int(x) for x in shape)
        b = check_int("budget", budget)
        sink, window = check_int("sink", sink), check_int("window", window)
        avail = N - sink - window
        if avail < 0:
            raise ValueError(f"sink + window ({sink} + {window}) exceed the row length N = {N}")
        table = avail  # the avail the allocator computes at
        if seq_len is not None:
            seq_len = check_int("seq_len", seq_len)
            if self.cross_layer:
                table = max(avail, seq_len - sink - window)
        if layer is not None:
            check_int("layer", layer)
        if num_layers is not None:
            check_int("num_layers", num_layers, 1)
            if layer is not None and layer >= num_layers:
                raise ValueError(f"layer must be < num_layers = {num_layers}, got {layer}")
        tp = None
        if process_group is not None:
            from ..distributed import group_info

            tp = group_info(process_group)
        Hg = H if tp is None else H * tp.world
        return dict(B=B, H=Hg, H_local=H, N=N, avail=table, row_avail=avail, b=min(b, table), sink=sink,
                    window=window, device=device, layer=layer, num_layers=num_layers, tp=tp)

    def plan(self, ctx: dict, scores=None, **inputs) -> "Plan":
        """The budgets of ``ctx`` (from ``context``) and what the host knows of them without reading the device
        (``Plan``). Budgets that follow from host values (``host``) are built from host ints: nothing is read
        back and their sizes are exact; otherwise ``allocate`` runs on the device and ``bound`` gives what static
        sizes the allocator knows."""
        B, Hg, H, avail, tp = ctx["B"], ctx["H"], ctx["H_local"], ctx["row_avail"], ctx["tp"]
        known = self.host(ctx, **inputs)
        if known is not None:
            from ..cache import upload

            every = host_rows(known, ctx)
            mine = every if tp is None else [r[tp.heads(H)] for r in every]
            flat = tuple(v for r in mine for v in r)
            local = upload(flat, ctx["device"]).view(B, H)
            out = local if tp is None else upload(tuple(v for r in every for v in r), ctx["device"]).view(B, Hg)
            return Plan(local, out, sum(flat), max(flat, default=0), max((max(r) for r in every), default=0))
        if tp is not None and self.tp_mode == "gather":
            if scores is None:
                raise ValueError(f"allocation {self.name!r} reads the scores of every head: pass scores")
            scores = tp.cat_heads(scores.to(torch.float32), 1)
        out = self.allocate(scores, ctx, **inputs).to(device=ctx["device"], dtype=torch.int32)
        if out.shape != (B, Hg):
            out = out.expand(B, Hg)
        out = (out.clamp(max=avail) if ctx["avail"] != avail else out).contiguous()
        local = out if tp is None else out[:, tp.heads(H)].contiguous()
        total, longest = self.bound(ctx, **inputs) or (None, None)
        return Plan(local, out, total, longest, None)

    def host(self, ctx: dict, **inputs):
        """Every head's selectable budgets when they follow from host values (shapes, settings, model-level
        inputs read once): an int (the same for every head) or nested lists of ints broadcastable to ``[B, H]``;
        None (the default) when they need the device (scores): then ``allocate`` runs there."""
        return None

    def bound(self, ctx: dict, **inputs):
        """``(total, longest)``: static host ints bounding the sum of this rank's selectable budgets (all ``B``
        rows) and any one of them, for budgets ``allocate`` computes on the device; None (the default) when only
        a read-back can tell (the caller then reads the two numbers back once)."""
        return None

    def allocate(self, scores, ctx: dict, **inputs) -> torch.Tensor:
        """Budgets broadcastable to ``[B, H]``; ``ctx`` holds B, H, N, avail, b (<= avail), sink,
        window, device, layer, num_layers (a ``cross_layer`` allocator given ``seq_len`` sees the sequence's avail;
        ``split`` caps its result at the row's), and under tensor parallelism ``tp`` (a ``TPGroup``, else None) and ``H_local`` (this rank's heads; ``H`` is then the
        layer's, ``world·H_local``)."""
        raise NotImplementedError

    @staticmethod
    def selectable(scores: torch.Tensor, ctx: dict) -> torch.Tensor:
        """fp32 scores of the selectable tokens ``[B, H, avail]`` (protected positions excluded)."""
        if ctx["sink"] or ctx["window"]:
            scores = scores[:, :, ctx["sink"]: ctx["N"] - ctx["window"]]
        return scores.to(torch.float32)

    @staticmethod
    def need_layer(ctx: dict, num_layers: Optional[int] = None) -> int:
        """The layer index (checked against ``num_layers`` when the allocator knows it)."""
        layer = ctx["layer"]
        if layer is None:
            raise ValueError("layer: this allocator needs the layer index (pass layer= to compress())")
        if num_layers is not None:
            if ctx["num_layers"] is not None and ctx["num_layers"] != num_layers:
                raise ValueError(f"num_layers = {ctx['num_layers']} disagrees with the profile's {num_layers} layers")
            if layer >= num_layers:
                raise ValueError(f"layer must be < {num_layers} (the profile's layers), got {layer}")
        return layer
