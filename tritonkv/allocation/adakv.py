"""AdaKV head budgets within a layer (docs/algorithms.md §2.3), from any policy's scores.

Exact mode (default, the kvpress construction), per batch row over scores ``[H, avail]``:

1. ``f = ⌊α·b⌋`` (α = 0.2); force each head's top-``f`` tokens;
2. take the global top ``H·b`` of the flattened ``[H·avail]`` scores, forced tokens first, ties to
   the lower flat index ``h·avail + j``;
3. ``b_h`` = the winners in head ``h`` (they are also that head's selection).

So in exact mode the allocation and the selection are one: ``adakv_kept`` runs the two top-k steps over whole
rows (each head's protected tokens forced with its top-``f``) and its winners *are* the kept tokens, from which
``RaggedKV.from_kept`` builds the cache with no further selection (``compress`` does so for policies whose
selection is the plain top-k). Its sizes are static: each batch row keeps exactly ``H·(b + sink + window)``.

Paper mode (FFY0/AdaKV code): ``c_h`` = head ``h``'s winners in the *unforced* global top ``H·b``,
``b_h = round_half_even(c_h·(1 − α) + ⌊α·b⌋)``.

Both top-k steps are the shared select kernel on the device; nothing is read back to the host. Paper mode's
totals depend on the rounding; ``AdaKV.bound`` gives a static bound (at most ``H/2`` tokens per batch row above).

Tensor parallel (heads split over ranks): the global top ``H·b`` takes at most ``min(avail, H·b)`` tokens of one
head, so each rank contributes its heads' top ``min(avail, H·b)`` scores (in index order) to one all-gather and
every rank runs the same arithmetic on those rows (``adakv_budgets_tp``): the single-process budgets exactly.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional, Union

import torch

from ..kernels._common import use_triton
from ..kernels.select import _composite_keys, select_indices, select_mask
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
    _check_alpha(alpha)
    check_mode(mode, MODES)
    return _from_rows(scores.to(torch.float32).contiguous(), b, scores.shape[2], alpha, mode)


def _check_alpha(alpha) -> None:
    check_positive("alpha", alpha, 0.0, strict=False)
    if alpha > 1:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")


def _from_rows(s: torch.Tensor, b: int, avail: int, alpha: float, mode: str) -> torch.Tensor:
    """The allocation on rows ``s [B, H, c]`` that hold every head's full selectable row (``c = avail``) or, in
    index order, at least its top ``min(avail, H·b)`` (all the global top ``H·b`` can take from one head)."""
    B, H, M = s.shape
    if b >= avail or b <= 0:
        return torch.full((B, H), max(min(b, avail), 0), dtype=torch.int32, device=s.device)
    f = min(floor_eps(alpha * b), b)
    flat = s.view(B, H * M)
    if mode == "paper":
        won = select_indices(flat, H * b, H * b, with_mask=True)[2].view(B, H, M)
        c = won.sum(-1).to(torch.float64)
        return torch.round(c * (1 - alpha) + f).clamp(f, avail).to(torch.int32)
    forced = select_indices(s.view(B * H, M), f, f, with_mask=True)[2].view(torch.uint8) if f > 0 else None
    won = select_indices(flat, H * b, H * b, forced=None if forced is None else forced.view(B, H * M),
                         with_mask=True)[2]
    return won.view(B, H, M).sum(-1).to(torch.int32)


def adakv_kept(scores: torch.Tensor, b: int, *, sink: int = 0, window: int = 0, alpha: float = 0.2,
               hist0=None) -> torch.Tensor:
    """int64 ``[B, H·(b + sink + window)]``: each batch row's kept tokens in exact mode, as ascending flat indices
    ``h·N + j`` into ``scores [B, H, N]``, for a selectable budget ``0 < b < avail = N − sink − window``.

    One global top-``H·(b + sink + window)`` of the row's ``H·N`` scores with each head's protected tokens and
    top-``⌊α·b⌋`` selectable ones forced (found by one per-head select): head ``h``'s entries are its protected
    tokens and its ``adakv_budgets`` winners, in the same order (``RaggedKV.from_kept`` turns them into rows).
    ``hist0``: the scoring kernel's first radix pass of ``scores`` with this sink and window (a
    ``kernels.select.Hist0``), which the per-head select then reuses."""
    B, H, N = scores.shape
    p = sink + window
    if not 0 < b < N - p:
        raise ValueError(f"b must lie in (0, avail = {N - p}) (a budget that keeps a part of every row), got {b}")
    f = min(floor_eps(alpha * b), b)
    s = scores.to(torch.float32).contiguous()
    if not use_triton(s):
        return _kept_torch(s, H * (b + p), f + p, sink, window)
    forced = None
    if f + p > 0:  # each head's protected tokens and its top f
        forced = select_indices(s, f + p, f + p, sink=sink, window=window, with_mask=True, hist0=hist0)[2]
        forced = forced.view(torch.uint8).view(B, H * N)
    k = H * (b + p)
    return select_indices(s.view(B, H * N), k, k, forced=forced)[0]


def _kept_torch(s: torch.Tensor, k: int, first: int, sink: int, window: int) -> torch.Tensor:
    """``adakv_kept`` in PyTorch: the two top-k steps on one set of keys, the select's own (``_composite_keys`` of
    the flat row: ties to the lower flat index, which is the lower index within a head), the forced tokens of each
    step raised above every other key: both steps keep all of them, so ties among them do not matter. ``first``:
    each head's forced tokens (its protected ones and top ``⌊α·b⌋``); ``k``: the row's kept tokens."""
    B, H, N = s.shape
    top = torch.iinfo(torch.int64).max
    key = _composite_keys(s.view(B, H * N), s.new_empty(0), 0, 0)
    if first > 0:  # each head's top ``first``, its protected tokens above the rest
        head = key.view(B * H, N)
        if sink + window:
            j = torch.arange(N, device=s.device)
            head = head.masked_fill((j < sink) | (j >= N - window), top)
        forced = head >= torch.topk(head, first, dim=1).values[:, -1:]
        key = key.masked_fill(forced.view(B, H * N), top)
    return torch.topk(key, k, dim=1, sorted=False).indices.sort(dim=1).values


def candidates(scores: torch.Tensor, c: int) -> torch.Tensor:
    """fp32 ``[B, H, min(c, avail)]``: each row's top ``c`` scores (the select kernel's order: NaN lowest, ties to
    the lower index) in their original index order; the rows as they are when ``c >= avail``."""
    B, H, M = scores.shape
    s = scores.to(torch.float32)
    if c >= M:
        return s.contiguous()
    idx, _ = select_indices(s, c, c)
    return s.gather(-1, idx).contiguous()


def adakv_budgets_tp(scores: torch.Tensor, b: int, tp, *, alpha: float = 0.2, mode: str = "exact",
                     rank_cap: Optional[float] = None) -> torch.Tensor:
    """int32 ``[B, H]`` selectable budgets of *every* head of a layer split over the ranks of ``tp``
    (``tritonkv.distributed.TPGroup``), from this rank's ``scores [B, H_l, avail]``; ``H = world·H_l``.

    One collective: each head's top ``c = min(avail, H·b)`` selectable scores in index order (a head cannot win
    more of the global top ``H·b``; its forced top ``⌊α·b⌋`` are among them), gathered over the ranks in head
    order. Every rank then runs ``adakv_budgets``'s arithmetic on the same ``[B, H, c]`` rows: the order of the
    candidates (value, then head, then position) is the order of the full flattened layer, so the budgets equal
    the single-process ones. No collective when ``b >= avail`` (every head keeps everything).

    ``rank_cap`` (exact mode; None = the exact global allocation): each rank's share of the layer total is capped
    at ``⌊rank_cap·H_l·b⌋`` tokens; what a capped rank gives up goes to the other ranks' next-best tokens (the
    greedy on the global order, skipping a capped rank's tokens, which is optimal for per-rank caps). ``1.0``
    balances exactly: every rank keeps ``H_l·b``, i.e. AdaKV within each rank.
    """
    B, Hl, M = scores.shape
    H = Hl * tp.world
    if b >= M or b <= 0:
        return torch.full((B, H), max(min(b, M), 0), dtype=torch.int32, device=scores.device)
    c = min(M, H * b)
    cand = tp.cat_heads(candidates(scores, c), 1)  # [B, H, c]
    if rank_cap is None:
        return _from_rows(cand, b, M, alpha, mode)
    return _capped(cand, b, alpha, tp.world, Hl, rank_cap)


def _capped(s: torch.Tensor, b: int, alpha: float, world: int, Hl: int, rank_cap: float) -> torch.Tensor:
    """Greedy top ``H·b`` of the candidate rows ``s [B, H, c]`` (forced first, then value, NaN lowest, then flat
    index) taking at most ``⌊rank_cap·H_l·b⌋`` tokens from each rank's ``H_l`` consecutive heads."""
    B, H, M = s.shape
    f = min(floor_eps(alpha * b), b)
    forced = select_mask(s.view(B * H, M), f).view(B, H * M) if f > 0 else torch.zeros(B, H * M, dtype=torch.bool,
                                                                                         device=s.device)
    v = s.reshape(B, H * M)
    nan = torch.isnan(v)
    order = torch.sort(torch.where(nan, float("-inf"), v), dim=1, descending=True, stable=True).indices
    order = order.gather(1, torch.sort(nan.gather(1, order).to(torch.int8), dim=1, stable=True).indices)
    order = order.gather(1, torch.sort((~forced.gather(1, order)).to(torch.int8), dim=1, stable=True).indices)
    rank = order // (Hl * M)  # [B, H·M] the rank owning each entry, in the global order
    within = torch.zeros_like(order)
    for r in range(world):  # 1-based position of each entry among its rank's entries
        mine = rank == r
        within = torch.where(mine, mine.to(torch.int64).cumsum(1), within)
    cap = max(floor_eps(rank_cap * Hl * b), Hl * b)
    ok = within <= cap
    take = ok & (ok.to(torch.int64).cumsum(1) <= H * b)
    heads = order // M
    return torch.zeros(B, H, dtype=torch.int64, device=s.device).scatter_add_(1, heads, take.to(torch.int64)) \
        .to(torch.int32)


class Kept(NamedTuple):
    """An allocation that is also the selection: each batch row's kept tokens (``adakv_kept``) and a static
    bound on a row's length (protected tokens included)."""

    indices: torch.Tensor
    longest: int


@register_allocator
@dataclasses.dataclass
class AdaKV(Allocator):
    """AdaKV: a layer's total ``H·b`` goes to the heads whose tokens score highest, with a safeguard
    of ``⌊α·b⌋`` per head.

    Tensor parallel: one collective per layer (``adakv_budgets_tp``), the same budgets as one process.
    ``balance_ranks`` (exact mode) caps each rank's share of the layer total: ``True`` (= 1.0) keeps every rank at
    ``H_l·b`` tokens (equal memory per rank: AdaKV within each rank), a float ``x > 1`` at ``⌊x·H_l·b⌋`` with the
    remainder redistributed to the other ranks; ``False`` is the exact global allocation. It changes nothing in
    one process.
    """

    name = "adakv"
    tp_mode = "custom"

    alpha: float = 0.2
    mode: str = "exact"
    balance_ranks: Union[bool, float] = False

    def __post_init__(self):
        _check_alpha(self.alpha)
        check_mode(self.mode, MODES)
        br = self.balance_ranks
        if not isinstance(br, bool) and (not isinstance(br, (int, float)) or math.isnan(br) or br < 1):
            raise ValueError(f"balance_ranks must be True/False or a cap >= 1 (a multiple of each rank's fair share "
                             f"H_l·b), got {br!r}")
        if br is not False and self.mode != "exact":
            raise ValueError("balance_ranks applies to the exact mode (mode='exact')")

    @property
    def rank_cap(self) -> Optional[float]:
        br = self.balance_ranks
        return None if br is False else (1.0 if br is True else float(br))

    def host(self, ctx, **inputs):
        """A budget that keeps every selectable token (or none) is the same for every head."""
        b, avail = ctx["b"], ctx["avail"]
        return max(min(b, avail), 0) if b >= avail or b <= 0 else None

    def kept(self, scores, ctx, hist0=None, **inputs) -> Optional[Kept]:
        """Exact mode in one process: the kept tokens themselves (``adakv_kept``; ``hist0``: the scoring kernel's
        first radix pass, for its per-head select), else None."""
        b, avail, p = ctx["b"], ctx["avail"], ctx["sink"] + ctx["window"]
        if self.mode != "exact" or ctx["tp"] is not None or not 0 < b < avail:
            return None
        f = min(floor_eps(self.alpha * b), b)
        return Kept(adakv_kept(scores, b, sink=ctx["sink"], window=ctx["window"], alpha=self.alpha, hist0=hist0),
                    p + min(avail, ctx["H"] * b - (ctx["H"] - 1) * f))

    def bound(self, ctx, **inputs):
        """Static sizes in one process: exact mode keeps ``H·b`` per batch row, a head at most
        ``H·b − (H−1)·⌊α·b⌋``; paper mode at most ``H·b·(1−α) + H·⌊α·b⌋ + H/2`` (each head rounds once)."""
        if ctx["tp"] is not None:
            return None
        B, H, b, avail = ctx["B"], ctx["H"], ctx["b"], ctx["avail"]
        f = min(floor_eps(self.alpha * b), b)
        if self.mode == "exact":
            return B * H * b, min(avail, H * b - (H - 1) * f)
        return B * min(H * avail, floor_eps(H * b * (1 - self.alpha) + H * f + H / 2)), avail

    def allocate(self, scores, ctx, **inputs):
        if scores is None:
            raise ValueError("scores: adakv allocates from the policy's scores [B, H_kv, N]")
        s = self.selectable(scores, ctx)
        if ctx["tp"] is None:
            return adakv_budgets(s, ctx["b"], alpha=self.alpha, mode=self.mode)
        return adakv_budgets_tp(s, ctx["b"], ctx["tp"], alpha=self.alpha, mode=self.mode, rank_cap=self.rank_cap)
