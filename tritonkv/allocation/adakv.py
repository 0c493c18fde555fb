"""AdaKV head budgets within a layer (docs/algorithms.md §2.3), from any policy's scores.

Exact mode (default, the kvpress construction), per batch row over scores ``[H, avail]``:

1. ``f = ⌊α·b⌋`` (α = 0.2); force each head's top-``f`` tokens;
2. take the global top ``H·b`` of the flattened ``[H·avail]`` scores, forced tokens first, ties to
   the lower flat index ``h·avail + j``;
3. ``b_h`` = the winners in head ``h`` (they are also that head's selection).

Paper mode (FFY0/AdaKV code): ``c_h`` = head ``h``'s winners in the *unforced* global top ``H·b``,
``b_h = round_half_even(c_h·(1 − α) + ⌊α·b⌋)``.

Both top-k steps are the shared select kernel on the device; nothing is read back to the host.
"""
from __future__ import annotations

import dataclasses

import torch

from ..kernels.select import select_mask
from .base import Allocator, check_int, check_mode, check_positive, check_tensor, floor_eps, register_allocator

MODES = ("exact", "paper")


def adakv_budgets(scores: torch.Tensor, b: int, *, alpha: float = 0.2, mode: str = "exact") -> torch.Tensor:
    """int32 ``[B, H]`` selectable budgets from ``scores [B, H, avail]`` (selectable tokens only).

    Rows of the batch are independent; NaN scores rank lowest (as in selection).
    """
    if not isinstance(scores, torch.Tensor) or scores.dim() != 3:
        raise ValueError("scores must be a [B, H_kv, avail] tensor of the selectable tokens")
    check_tensor("scores", scores)
    check_int("b", b)
    check_positive("alpha", alpha, 0.0, strict=False)
    if alpha > 1:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    check_mode(mode, MODES)
    B, H, M = scores.shape
    if b >= M or b <= 0:
        return torch.full((B, H), max(min(b, M), 0), dtype=torch.int32, device=scores.device)
    s = scores.to(torch.float32).contiguous()
    f = min(floor_eps(alpha * b), b)
    flat = s.view(B, H * M)
    if mode == "paper":
        won = select_mask(flat, H * b).view(B, H, M)
        c = won.sum(-1).to(torch.float64)
        return torch.round(c * (1 - alpha) + f).clamp(f, M).to(torch.int32)
    forced = select_mask(s.view(B * H, M), f) if f > 0 else None
    won = select_mask(flat, H * b, forced=None if forced is None else forced.view(B, H * M))
    return won.view(B, H, M).sum(-1).to(torch.int32)


@register_allocator
@dataclasses.dataclass
class AdaKV(Allocator):
    """AdaKV: a layer's total ``H·b`` goes to the heads whose tokens score highest, with a safeguard
    of ``⌊α·b⌋`` per head."""

    name = "adakv"

    alpha: float = 0.2
    mode: str = "exact"

    def __post_init__(self):
        check_positive("alpha", self.alpha, 0.0, strict=False)
        if self.alpha > 1:
            raise ValueError(f"alpha must lie in [0, 1], got {self.alpha}")
        check_mode(self.mode, MODES)

    def allocate(self, scores, ctx, **inputs):
        if scores is None:
            raise ValueError("scores: adakv allocates from the policy's scores [B, H_kv, N]")
        return adakv_budgets(self.selectable(scores, ctx), ctx["b"], alpha=self.alpha, mode=self.mode)
