"""SurfaceLogicKV fixed + dynamic budgets (docs/algorithms.md §2.5, a reconstruction of Eq. 6).

With an INF profile ``[L, H] >= 0`` (query-head profiles are averaged over each group),
ρ = 1.351 (the "allocation ratio") and a floor of 0.01 on layer importance::

    fixed = b − ⌊b/ρ⌋,  pool = ⌊b/ρ⌋·L·H
    I_l   = Σ_h INF_{l,h} / Σ INF;   I'_l = max(I_l, 0.01)
    I_lh  = INF_{l,h} / Σ_h INF_{l,h}   (1/H if the layer sums to 0)
    b_{l,h} = fixed + pool · Ĩ_l · I_lh

Strict mode (default): ``Ĩ = I'/ΣI'`` and largest remainder to ``L·H·b`` (cap ``avail``). Paper
mode: ``Ĩ = I'`` (the total overshoots by ``pool·Σ_l max(0, 0.01 − I_l)``, as the paper says)
and each budget is rounded. Without a profile the shipped one is loaded by name
(``tritonkv.allocation.profiler.load_profile``).
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Optional

import torch

from ..kernels._common import on_host
from .base import (Allocator, check_budget, check_mode, check_nonnegative, check_positive, check_profile,
                   check_query_width, host_row, query_heads, register_allocator)
from .headkv import profile_budgets

MODES = ("strict", "paper")
DEFAULT_PROFILE = "smollm2-135m-instruct-infsc"  # tritonkv/data/<name>.json, written by the profiler


def surfacelogic_shares(inf: torch.Tensor, *, floor: float = 0.01, mode: str = "strict") -> torch.Tensor:
    """``Ĩ_l · I_lh`` as float64 ``[L, H]``."""
    inf = check_profile("profile", inf)
    if on_host(inf):  # a profile on the device is not read back
        check_nonnegative("profile", inf)
    inf = inf.clamp_min(0.0)
    L, H = inf.shape
    layer = inf.sum(1)
    tot = layer.sum()
    imp = torch.where(tot > 0, layer / torch.where(tot > 0, tot, 1.0), 1.0 / L).clamp_min(floor)
    if mode == "strict":
        imp = imp / imp.sum()
    within = torch.where(layer[:, None] > 0, inf / torch.where(layer > 0, layer, 1.0)[:, None], 1.0 / H)
    return imp[:, None] * within


def surfacelogic_budgets(inf: torch.Tensor, b: int, avail: int, *, rho: float = 1.351, floor: float = 0.01,
                         mode: str = "strict") -> torch.Tensor:
    """int32 ``[L, H]`` selectable budgets of every (layer, head), on the profile's device. A profile on the host
    must be finite and non-negative (one on the device is not read back to check it)."""
    check_budget(b, avail)
    check_positive("rho", rho, 1.0, strict=False)
    check_positive("floor", floor, 0.0, strict=False)
    check_mode(mode, MODES)
    share = surfacelogic_shares(inf, floor=floor, mode=mode)
    return profile_budgets(share, b, avail, rho, "exact" if mode == "strict" else "paper")


def _profile(name: str) -> torch.Tensor:
    """The profile ``profile_name`` names: a shipped one read once per process, a file read again when it changes."""
    stamp = None
    try:
        from .profiler import is_path, profile_path

        if isinstance(name, str) and is_path(name):
            st = os.stat(profile_path(name))
            stamp = (st.st_mtime_ns, st.st_size)
    except (ImportError, OSError):  # _shipped says why
        pass
    return _shipped(name, stamp)


@functools.lru_cache(maxsize=8)
def _shipped(name: str, stamp=None) -> torch.Tensor:
    """``load_profile(name)``, checked; ``stamp`` (a file's mtime and size) keys a path's cache entry."""
    try:
        from .profiler import load_profile
    except ImportError as e:
        raise ValueError(f"profile: surfacelogic needs an INF profile [L, H]; none was given and the shipped "
                         f"profile {name!r} cannot be loaded ({e})") from None
    try:
        prof = load_profile(name)
    except (OSError, KeyError, ValueError, TypeError) as e:
        raise ValueError(f"profile: surfacelogic needs an INF profile [L, H]; none was given and profile_name "
                         f"{name!r} cannot be loaded: {e}") from None
    return check_nonnegative("profile", check_profile("profile", prof))


@register_allocator
@dataclasses.dataclass
class SurfaceLogic(Allocator):
    """SurfaceLogicKV: fixed share per head + a pool split by layer and head INF importance.

    The profile is the field ``profile``, the input ``profile=``, or else the profile ``profile_name``: a shipped
    one (``tritonkv/data/<name>.json``) or a path to a ``.json`` profile (read again when the file changes).
    """

    name = "surfacelogic"
    cross_layer = True
    tp_mode = "replicated"  # every head's budget from shapes and replicated inputs: no collective
    needs = ("layer",)

    profile: Optional[torch.Tensor] = None
    profile_name: str = DEFAULT_PROFILE
    rho: float = 1.351
    floor: float = 0.01
    mode: str = "strict"

    def __post_init__(self):
        check_positive("rho", self.rho, 1.0, strict=False)
        check_positive("floor", self.floor, 0.0, strict=False)
        check_mode(self.mode, MODES)
        if self.profile is not None:
            self.profile = check_nonnegative("profile", check_profile("profile", self.profile))

    def host(self, ctx, profile=None, **inputs):
        """The layer's row, the table computed once per profile and setting (on the CPU; a profile on the device
        is read back once)."""
        profile = self.profile if profile is None else profile
        if profile is None:
            profile = _profile(self.profile_name)
        check_query_width("profile", profile, ctx, inputs)
        key = ("surfacelogic", ctx["H"], ctx["b"], ctx["avail"], self.rho, self.floor, self.mode)
        return host_row(self, ctx, profile, key, lambda c, src: self.allocate(None, c, profile=src, table=True))

    def allocate(self, scores, ctx, profile=None, table=False, **inputs):
        profile = self.profile if profile is None else profile
        if profile is None:
            profile = _profile(self.profile_name)
        p = check_profile("profile", profile, ctx["H"], query_heads(ctx, inputs))
        if on_host(p):  # an input profile is checked where it already is (no device read)
            check_nonnegative("profile", p)
        p = p.to(ctx["device"])
        out = surfacelogic_budgets(p, ctx["b"], ctx["avail"], rho=self.rho, floor=self.floor, mode=self.mode)
        return out if table else out[self.need_layer(ctx, p.shape[0])]
