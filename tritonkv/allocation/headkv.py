"""HeadKV-style budgets from an offline profile (docs/algorithms.md §2.4).

With a profile ``p [L, H] >= 0`` (a query-head profile is averaged over each group), β = 1.5, τ = 1::

    p ← p/Σp;  p ← p^τ;  p ← p/Σp
    fixed = b − ⌊b/β⌋,  pool = ⌊b/β⌋·L·H,  b_{l,h} = fixed + p_{l,h}·pool

Exact mode: largest remainder to ``L·H·b`` with a cap at ``avail`` (excess spread in proportion to
``p``). Paper mode: round each budget (half to even) and clamp to ``[0, avail]``. Larger β means a
*smaller* pool; β → ∞ is uniform. An all-zero profile counts as uniform.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..kernels._common import on_host
from .base import (Allocator, check_budget, check_mode, check_nonnegative, check_positive, check_profile,
                   check_query_width, floor_eps, host_row, query_heads, register_allocator)
from .rounding import largest_remainder

MODES = ("exact", "paper")


def normalise(p: torch.Tensor) -> torch.Tensor:
    """``p / Σp`` over the whole tensor (uniform when the sum is 0)."""
    s = p.sum()
    return torch.where(s > 0, p / torch.where(s > 0, s, 1.0), 1.0 / p.numel())


def profile_budgets(share: torch.Tensor, b: int, avail: int, ratio: float, mode: str) -> torch.Tensor:
    """``fixed + share·pool`` rounded (shared by HeadKV and SurfaceLogicKV): ``fixed = b − ⌊b/ratio⌋``,
    ``pool = ⌊b/ratio⌋·L·H``; ``share [L, H]`` sums to 1 except in SurfaceLogicKV's paper mode."""
    L, H = share.shape
    if b >= avail or b <= 0:
        return torch.full((L, H), max(min(b, avail), 0), dtype=torch.int32, device=share.device)
    small = floor_eps(b / ratio)
    fixed, pool = b - small, small * L * H
    x = fixed + share * pool
    if mode == "paper":
        return torch.round(x).clamp(0, avail).to(torch.int32)
    return largest_remainder(x.reshape(-1), L * H * b, cap=avail, weights=share.reshape(-1)).view(L, H)


def headkv_budgets(profile: torch.Tensor, b: int, avail: int, *, beta: float = 1.5, tau: float = 1.0,
                   mode: str = "exact") -> torch.Tensor:
    """int32 ``[L, H]`` selectable budgets of every (layer, head), on the profile's device. A profile on the host
    must be finite and non-negative (one on the device is not read back to check it)."""
    check_budget(b, avail)
    check_positive("beta", beta, 1.0, strict=False)
    check_positive("tau", tau)
    check_mode(mode, MODES)
    p = check_profile("profile", profile)
    if on_host(p):  # a profile on the device is not read back
        check_nonnegative("profile", p)
    p = normalise(p.clamp_min(0.0))
    if tau != 1.0:  # p^1 renormalised is p: skip the no-op so τ = 1 is bit-exact
        p = normalise(p ** tau)
    return profile_budgets(p, b, avail, beta, mode)


@register_allocator
@dataclasses.dataclass
class HeadKV(Allocator):
    """HeadKV: a fixed share per head plus a pool split by an offline head-importance profile.

    The profile is the field ``profile`` or the input ``profile=`` (``[L, H_kv]`` or ``[L, H_q]``).
    """

    name = "headkv"
    cross_layer = True
    tp_mode = "replicated"  # every head's budget from shapes and replicated inputs: no collective

    profile: Optional[torch.Tensor] = None
    beta: float = 1.5
    tau: float = 1.0
    mode: str = "exact"

    def __post_init__(self):
        check_positive("beta", self.beta, 1.0, strict=False)
        check_positive("tau", self.tau)
        check_mode(self.mode, MODES)
        if self.profile is not None:
            self.profile = check_nonnegative("profile", check_profile("profile", self.profile))

    @property
    def needs(self):
        return ("layer",) if self.profile is not None else ("layer", "profile")

    def host(self, ctx, profile=None, **inputs):
        """The layer's row, the table computed once per profile and setting (on the CPU; a profile on the device
        is read back once)."""
        profile = self.profile if profile is None else profile
        check_query_width("profile", profile, ctx, inputs)
        key = ("headkv", ctx["H"], ctx["b"], ctx["avail"], self.beta, self.tau, self.mode)
        return host_row(self, ctx, profile, key, lambda c, src: self.allocate(None, c, profile=src, table=True))

    def allocate(self, scores, ctx, profile=None, table=False, **inputs):
        profile = self.profile if profile is None else profile
        if profile is None:
            raise ValueError("profile: headkv needs an offline head profile [L, H] (field or input profile=)")
        p = check_profile("profile", profile, ctx["H"], query_heads(ctx, inputs))
        if on_host(p):  # an input profile is checked where it already is (no device read)
            check_nonnegative("profile", p)
        p = p.to(ctx["device"])
        out = headkv_budgets(p, ctx["b"], ctx["avail"], beta=self.beta, tau=self.tau, mode=self.mode)
        return out if table else out[self.need_layer(ctx, p.shape[0])]
