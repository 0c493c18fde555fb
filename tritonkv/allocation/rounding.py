"""Integer budgets from real-valued shares, on the device with no host read (docs/algorithms.md §2).

``largest_remainder`` is the exact mode of every allocator:

1. cap: entries above their cap are set to it and the excess is spread over the uncapped entries in
   proportion to their weights, repeatedly, until nothing exceeds (entries of zero weight share
   what is left evenly once every weighted entry is full). This is water-filling, computed in
   closed form: uncapped entries end at ``x + λ·w`` with ``Σ min(cap, x + λ·w) = total``;
2. take floors;
3. add 1 to the ``total - Σ floors`` largest fractional parts, ties to the lower flat index. The
   fractional parts are compared in fp32, so float noise far below 2^-24 cannot reorder
   mathematically equal remainders. The order is a rank by pairwise counting over the M <= L·H
   entries of a row (a rounding step over heads, not a token selection: tokens are only ever
   selected by the shared select kernel).

``adjust_budgets`` is CAKE's paper-mode rounding (§2.7), also used by SCORE's paper mode.
"""
from __future__ import annotations

import torch

_TOL = 1e-9  # relative gap below which the water level is left where it is


def _as_rows(v, lead, device) -> torch.Tensor:
    return torch.as_tensor(v, dtype=torch.float64, device=device).expand(lead)


def waterfill(x: torch.Tensor, w: torch.Tensor, cap: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """``min(cap, x + λ·w)`` with the smallest λ >= 0 that brings the row sum to ``total``.

    Rows are the leading dims of ``x``/``w``/``cap`` (``[..., M]``, float64); ``total`` is ``[...]``.
    When the row cannot reach ``total`` (every entry with ``w > 0`` is full) those entries end at
    their caps. λ is found from the breakpoints ``(cap - x)/w`` by evaluating the piecewise-linear
    row sum at each of them (O(M²) per row, M = layers × heads at most).
    """
    pos = w > 0
    bp = torch.where(pos, ((cap - x) / torch.where(pos, w, 1.0)).clamp_min(0.0), torch.inf)
    cand = torch.cat([torch.zeros_like(bp[..., :1]), torch.where(pos, bp, 0.0)], dim=-1)  # [..., M+1]
    filled = torch.minimum(cap.unsqueeze(-2), x.unsqueeze(-2) + cand.unsqueeze(-1) * w.unsqueeze(-2)).sum(-1)
    tol = _TOL * total.abs().clamp_min(1.0)
    ok = filled <= (total + tol).unsqueeze(-1)
    lam0 = torch.where(ok, cand, 0.0).amax(-1)
    f0 = torch.minimum(cap, x + lam0.unsqueeze(-1) * w).sum(-1)
    slope = torch.where(bp > lam0.unsqueeze(-1), w, 0.0).sum(-1)
    gap = total - f0
    step = torch.where((slope > 0) & (gap > tol), gap / torch.where(slope > 0, slope, 1.0), 0.0)
    return torch.minimum(cap, x + (lam0 + step).unsqueeze(-1) * w)


def largest_remainder(x: torch.Tensor, total, cap=None, weights=None) -> torch.Tensor:
    """int32 budgets from real shares ``x [..., M]`` summing (per row) to ``total``.

    Args:
        x: the ideal real-valued budgets, ``[..., M]`` (negative entries count as 0).
        total: the exact row total, an int or an int tensor of shape ``x.shape[:-1]``; it is lowered
            to ``Σ cap`` when that is smaller.
        cap: per-entry maximum (an int, or a tensor broadcastable to ``x``); ``None`` means none.
        weights: how the excess above the caps is spread (default ``x``).

    Returns int32 ``[..., M]`` with each row summing to ``min(total, Σ cap)``, every entry within
    ``[floor(y), floor(y) + 1]`` of its water-filled share ``y`` and at most its cap.
    """
    _check_shares(x, total, cap)
    x = x.to(torch.float64).clamp_min(0.0)
    lead, dev = x.shape[:-1], x.device
    if x.numel() == 0:
        return torch.zeros(x.shape, dtype=torch.int32, device=dev)
    total = _as_rows(total, lead, dev)
    if cap is None:
        cap = torch.full_like(x, torch.inf)
    else:
        cap = torch.as_tensor(cap, dtype=torch.float64, device=dev).expand(x.shape)
        total = torch.minimum(total, cap.sum(-1))
        w = x if weights is None else weights.to(torch.float64).clamp_min(0.0).expand(x.shape)
        x = waterfill(x, w, cap, total)
        x = waterfill(x, (w <= 0).to(torch.float64), cap, total)  # zero-weight entries share the rest
    fl = torch.floor(x)
    rem = (total - fl.sum(-1)).round().clamp_min(0).to(torch.int32)
    key = torch.where(fl < cap, x - fl, -torch.inf).to(torch.float32)
    add = _rank(key) < rem.unsqueeze(-1)
    return (fl + add.to(torch.float64)).to(torch.int32)


def _check_shares(x, total, cap) -> None:
    """``x`` a real tensor with at least one dimension; ``total`` and ``cap``, when plain numbers, >= 0."""
    if not isinstance(x, torch.Tensor) or x.dtype == torch.bool or x.dtype.is_complex:
        raise TypeError(f"x must be a real tensor [..., M] of shares, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() < 1:
        raise ValueError(f"x must have at least one dimension [..., M], got shape {tuple(x.shape)}")
    for name, v in (("total", total), ("cap", cap)):
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not v >= 0:
            raise ValueError(f"{name} must be >= 0, got {v!r}")


def _rank(key: torch.Tensor) -> torch.Tensor:
    """Position of each entry in the order (key desc, index asc), by counting the entries before it."""
    idx = torch.arange(key.shape[-1], device=key.device)
    kj, ki = key.unsqueeze(-1), key.unsqueeze(-2)  # [..., j, i]
    before = (kj > ki) | ((kj == ki) & (idx[:, None] < idx[None, :]))
    return before.sum(-2)


def adjust_budgets(x: torch.Tensor, total, cap) -> torch.Tensor:
    """CAKE's ``adjust_budgets`` on real shares ``x [..., L]`` (paper mode, §2.7).

    Truncate; cap at ``cap`` and spread the summed excess evenly over the uncapped entries
    (remainders to the lowest indices); then spread the shortfall to ``total`` the same way. A
    final clamp to ``[0, cap]`` (CAKE has none) can only lower a total the single pass overfilled.
    """
    _check_shares(x, total, cap)
    x = x.to(torch.float64).clamp_min(0.0)
    dev = x.device
    total = torch.as_tensor(total, dtype=torch.int64, device=dev).expand(x.shape[:-1])
    cap = torch.as_tensor(cap, dtype=torch.int64, device=dev)
    b = torch.floor(x).to(torch.int64)

    def spread(b, amount):
        valid = b < cap
        nv = valid.sum(-1)
        nv1 = nv.clamp_min(1)
        per = torch.div(amount, nv1, rounding_mode="floor")
        extra = amount - per * nv1
        rank = torch.cumsum(valid.to(torch.int64), -1) - 1
        add = per.unsqueeze(-1) + (rank < extra.unsqueeze(-1)).to(torch.int64)
        return b + torch.where(valid & (nv > 0).unsqueeze(-1), add, 0)

    excess = (b - cap).clamp_min(0).sum(-1)
    b = spread(torch.minimum(b, cap), excess)
    b = spread(b, total - b.sum(-1))
    return torch.minimum(b.clamp_min(0), cap).to(torch.int32)
