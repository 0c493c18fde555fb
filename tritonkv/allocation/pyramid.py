"""PyramidKV layer budgets (docs/algorithms.md §2.2): a linear ramp from ``max`` at layer 0 down to
``min`` at the last layer, with mean ``b``.

Float rule (exact mode, the default)::

    min = b/β;  max = 2b − min                      (β = 20)
    if max > avail: max = avail; min = 2b − max
    b_l = max − l·(max − min)/(L − 1)

then largest remainder to ``Σ_l b_l = L·b`` (ties to the lower layer keep the ramp non-increasing).
Paper mode (KVCache-Factory / AdaKV ``pyram_mode``) uses the integer ``min = ⌊b/β⌋``, the clamp
``max ≥ avail`` and an integer step ``⌊(max − min)/(L − 1)⌋``; its total lies in
``[L·b, L·b + L(L−1)/2]``. ``b ≥ avail`` keeps everything; ``L = 1`` is uniform. Budgets depend only
on static ints, so they are built on the host and moved to the device (no device read).
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from .base import Allocator, check_budget, check_int, check_mode, check_positive, floor_eps, register_allocator
from .rounding import largest_remainder

MODES = ("exact", "paper")


def pyramid_budgets(num_layers: int, b: int, avail: int, *, beta: float = 20.0, mode: str = "exact",
                    device="cpu") -> torch.Tensor:
    """int32 ``[L]`` selectable budget of each layer (shared by the layer's heads)."""
    L = check_int("num_layers", num_layers, 1)
    check_budget(b, avail)
    check_positive("beta", beta, 1.0, strict=False)  # 1: uniform; below 1 the ramp rises
    check_mode(mode, MODES)
    if b >= avail:
        return torch.full((L,), max(avail, 0), dtype=torch.int32, device=device)
    if b <= 0 or L == 1:
        return torch.full((L,), max(b, 0), dtype=torch.int32, device=device)
    if mode == "paper":
        lo = floor_eps(b / beta)
        hi = 2 * b - lo
        if hi >= avail:
            hi = avail
            lo = 2 * b - hi
        step = (hi - lo) // (L - 1)
        out = [min(max(hi - l * step, 0), avail) for l in range(L)]
        return torch.tensor(out, dtype=torch.int32, device=device)
    lo = b / beta
    hi = 2 * b - lo
    if hi > avail:
        hi = float(avail)
        lo = 2 * b - hi
    x = torch.tensor([hi - l * (hi - lo) / (L - 1) for l in range(L)], dtype=torch.float64, device=device)
    return largest_remainder(x, L * b, cap=avail)


@register_allocator
@dataclasses.dataclass
class Pyramid(Allocator):
    """PyramidKV: more tokens in lower layers (reads only shapes, ``layer`` and ``num_layers``)."""

    name = "pyramid"
    cross_layer = True
    tp_mode = "replicated"  # every head's budget from shapes and replicated inputs: no collective
    needs = ("layer", "num_layers")

    beta: float = 20.0
    mode: str = "exact"

    def __post_init__(self):
        check_positive("beta", self.beta, 1.0, strict=False)
        check_mode(self.mode, MODES)

    def host(self, ctx, **inputs):
        """The layer's budget, an int: the table depends on host ints only (computed once per setting)."""
        if ctx["num_layers"] is None:
            raise ValueError("num_layers: pyramid needs the model's layer count (pass num_layers=)")
        layer = self.need_layer(ctx, ctx["num_layers"])
        return _table(ctx["num_layers"], ctx["b"], ctx["avail"], self.beta, self.mode)[layer]

    def allocate(self, scores, ctx, **inputs):
        return torch.tensor(self.host(ctx), dtype=torch.int32)


@torch.compiler.assume_constant_result
def _table(num_layers: int, b: int, avail: int, beta: float, mode: str) -> tuple:
    """Every layer's budget (host ints from host ints): torch.compile calls it rather than tracing its tensor ops,
    whose ``tolist()`` would give data-dependent sizes."""
    return _cached_table(num_layers, b, avail, beta, mode)


@functools.lru_cache(maxsize=256)
def _cached_table(num_layers: int, b: int, avail: int, beta: float, mode: str) -> tuple:
    return tuple(pyramid_budgets(num_layers, b, avail, beta=beta, mode=mode).tolist())
