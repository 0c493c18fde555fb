"""SCORE redundancy-penalised selection (SCORE §3.4, Eq. 13; ``docs/algorithms.md`` §1.7).

A wrapper over an attention-like base policy (default: the SnapKV-family window mean without
pooling, κ = 1, the scores SCORE's allocator reads). Per layer, with base scores A ≥ 0, head
budgets b_h and head distinctness HD_h > 0 (input ``hd``, from the SCORE allocator, §2.6), the
scores of tokens that other heads also pick are lowered before the shared top-k::

    parallel (default):
        U_h    = select(A[h], b_h)                       unpenalised, the shared kernel
        r_h[j] = Σ_{h'≠h} U_h'[j]                         a sum over heads minus the own one
        Ã[h,j] = A[h,j] · exp(−(α / HD_h) · r_h[j])
        kept_h = select(Ã[h], b_h)

        r and Ã are one launch (``kernels/score.py``), which also counts the final select's first
        radix pass: nine launches in all and no host read (with ``attn_lse`` given: the default
        base's window score, the unpenalised select's four, the penalty, the final select's three).

    sequential ("greedy"): heads in order of descending HD (ties to the lower h); r[j] counts the
        final selections of the heads already visited. The visiting order is computed on the
        device (a rank by pairwise comparison, no sort, no host read); the loop over the H visits
        is in Python because each visit depends on the previous ones, and each visit is one call
        of the shared select on that head's row of every batch element.

Protected tokens are in every U_h and every kept set, so their penalty never matters. α = 0 is
plain top-k; the default α = 0.004 (the paper's choice in [0.001, 0.01]) only reorders near-ties.
"""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch

from ..distributed import group_info
from ..kernels import _plan, select as _select
from ..kernels._common import check_device, check_int, on_host
from ..kernels.score import _penalty
from .base import Policy, register_policy
from .criticalkv import _check_fraction, check_base, row_budgets

MODES = ("parallel", "sequential")


def _default_base() -> Policy:
    from .snapkv import SnapKV

    return SnapKV(kernel_size=1)


def head_distinctness(hd, batch: int, heads: int, device) -> torch.Tensor:
    """``hd`` ([H_kv] or [B, H_kv], > 0) as fp32 ``[B, H_kv]`` on ``device`` (a view where it already is fp32
    there; not clamped: the penalty clamps it to ≥ 1e-6, as the allocator does).

    Values are checked on the host only where they already are there (a list or a plain CPU tensor, outside
    torch.compile/export; one read of the few values, no tensor ops); elsewhere nothing is read back.
    """
    if hd is None:
        raise ValueError("score needs the input hd: head distinctness HD > 0 per KV head, [H_kv] or "
                         "[B, H_kv] (from the SCORE allocator)")
    if not isinstance(hd, torch.Tensor):
        try:
            hd = torch.tensor(hd, dtype=torch.float64)
        except (TypeError, ValueError):
            raise TypeError(f"hd must be a float tensor [H_kv] or [B, H_kv], got {type(hd).__name__}") from None
    if hd.dtype == torch.bool or hd.is_complex():
        raise TypeError(f"hd must be a real float tensor, got {hd.dtype}")
    check_device("hd", hd, device, "keys", cpu_ok=True)
    if hd.shape != (heads,) and hd.shape != (batch, heads):
        raise ValueError(f"hd must have shape [H_kv] = [{heads}] or [B, H_kv] = [{batch}, {heads}], "
                         f"got {tuple(hd.shape)}")
    if on_host(hd):
        _plan.host_check(_check_hd_values, hd)
    return hd.to(device=device, dtype=torch.float32).expand(batch, heads)


def _check_hd_values(hd: torch.Tensor) -> None:
    if not all(v > 0 and v < math.inf for v in hd.reshape(-1).tolist()):
        raise ValueError(f"hd must be finite and > 0 (head distinctness), got {hd.tolist()}")


def _unpenalised_mask(s: torch.Tensor, budgets, k_max: int, sink: int, window: int) -> torch.Tensor:
    """int8 keep-mask ``[B, H, N]`` of the plain selection of ``s`` (fp32, contiguous): ``select.select_mask``
    without its conversions (one call of the shared select, whose index output is scratch)."""
    B, H, N = s.shape
    R, k_max = B * H, min(check_int("k_max", k_max), N)
    dev = s.device
    b, bi = _select._budget_args(budgets, R, dev)
    mask = torch.empty((B, H, N), dtype=torch.int8, device=dev)
    if R == 0 or N == 0:
        return mask
    idx = torch.empty(R * k_max, dtype=torch.int64, device=dev)  # written, never read
    lengths = torch.empty(R, dtype=torch.int32, device=dev)
    _select.select_into(s.view(R, N), b, None, None, None, None, idx, lengths, mask.view(R, N), None, None, None,
                        sink, window, k_max, bi, _select._full_rows(budgets, N, k_max), 0, work_p1=None,
                        work_cnt=None, work_cand=None)
    return mask


def _sequential_order(hd: torch.Tensor) -> torch.Tensor:
    """``perm[b, i]`` = the head visited i-th in batch row b: descending HD, ties to the lower head."""
    B, H = hd.shape
    h = torch.arange(H, device=hd.device)
    before = (hd[:, None, :] > hd[:, :, None]) | ((hd[:, None, :] == hd[:, :, None]) & (h[None, :] < h[:, None]))
    rank = before.sum(-1)  # [B, H]: heads visited before h
    return torch.empty_like(rank).scatter_(1, rank, h.expand(B, H).contiguous())


@register_policy
@dataclasses.dataclass(kw_only=True)
class ScoreSelect(Policy):
    """SCORE's redundancy-penalised selection over ``base`` (default ``SnapKV(kernel_size=1)``).

    ``alpha`` is the penalty strength α (≥ 0), ``mode`` ``"parallel"`` (r counts the other heads'
    unpenalised picks) or ``"sequential"`` (greedy in descending HD). Needs the base's inputs plus
    ``hd``. Protected tokens are the base's (``sink``/``window`` mirror it and are not settable).
    Non-finite base scores stay as they are under the penalty (a factor in (0, 1]): NaN ranks lowest and,
    never picked, adds no penalty to other heads (``docs/contracts.md``, non-finite inputs).
    """

    name: ClassVar[str] = "score"
    nonnegative: ClassVar[bool] = True

    sink: int = dataclasses.field(default=0, init=False)
    window: int = dataclasses.field(default=0, init=False)
    base: Policy = dataclasses.field(default_factory=_default_base)
    alpha: float = 0.004
    mode: str = "parallel"

    def __post_init__(self):
        check_base("ScoreSelect", self.base)
        _check_fraction("alpha", self.alpha, 0.0, math.inf)
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        self.sink, self.window = self.base.sink, self.base.window
        super().__post_init__()

    @property
    def needs(self) -> tuple[str, ...]:
        """The base's inputs plus ``hd`` (an instance property: it depends on the base)."""
        return tuple(self.base.needs) + tuple(n for n in ("hd",) if n not in self.base.needs)

    def protected(self, n: int, budget: int) -> tuple[int, int]:
        return self.base.protected(n, budget)

    def score(self, keys: torch.Tensor, values: torch.Tensor, **inputs) -> torch.Tensor:
        """The base scores A (what the allocator sees); the penalty is applied in ``select``."""
        return self.base.score(keys, values, **inputs)

    def penalised(self, scores: torch.Tensor, budgets, hd, *, sink: int, window: int, k_max: int,
                  process_group=None) -> torch.Tensor:
        """Ã ``[B, H, N]``: the scores whose plain top-k is SCORE's selection.

        Tensor parallel (``process_group``; these are this rank's heads, ``hd`` theirs): ``"parallel"`` gathers
        each rank's per-token pick counts (one collective; integer sums, exact in any order), ``"sequential"``
        the scores, budgets and HD of every head (one collective) and runs the greedy over all heads."""
        return self._penalised(scores, budgets, hd, sink, window, k_max, process_group, None)[0]

    def _penalised(self, scores, budgets, hd, sink: int, window: int, k_max: int, process_group, protect):
        """``(Ã, hist0)``: ``hist0`` the final select's first pass over Ã with ``protect=(sink, window)``
        where the penalty kernel counts it (parallel mode, Triton), else None."""
        tp = None if process_group is None else group_info(process_group)
        B, H, N = scores.shape
        s = scores.to(torch.float32)
        hd = head_distinctness(hd, B, H, s.device)
        if self.mode == "sequential":
            b = row_budgets(budgets, s, k_max).view(B, H)
            hd = hd.clamp_min(1e-6)
            if tp is None:
                return self._sequential(s, b, hd, sink, window), None
            gs, gb, ghd = tp.gather(s, b, hd)  # [world, B, H, ...] in head order
            s, b, hd = (torch.cat(g.unbind(0), dim=1) for g in (gs, gb, ghd))
            return self._sequential(s, b, hd, sink, window)[:, tp.heads(H)].contiguous(), None
        s = s.contiguous()
        u = _unpenalised_mask(s, budgets, k_max, sink, window)
        picks = None
        if tp is not None:  # every head's picks per token (counts: exact)
            picks = tp.gather(u.sum(1, dtype=torch.float32))[0].sum(0)
        out = _penalty(s, u, hd, float(self.alpha), picks, 0, protect)
        return out if protect is not None else (out, None)

    def _sequential(self, s, b, hd, sink, window):
        B, H, N = s.shape
        rate = (self.alpha / hd)[..., None]  # [B, H, 1]
        perm = _sequential_order(hd)
        taken = torch.zeros((B, N), dtype=torch.float32, device=s.device)  # final picks of visited heads
        out = torch.empty_like(s)
        for i in range(H):
            h = perm[:, i:i + 1]  # [B, 1]
            row = s.gather(1, h[..., None].expand(B, 1, N))[:, 0] * torch.exp(-rate.gather(1, h[..., None])[:, 0] * taken)
            out.scatter_(1, h[..., None].expand(B, 1, N), row[:, None])
            taken += _select.select_mask(row, b.gather(1, h)[:, 0], sink=sink, window=window).to(torch.float32)
        return out

    def select(self, scores, budgets, keys, values, *, sink: int, window: int, k_max: int, out=None, forced=None,
               hd=None, **inputs):
        """Penalised selection through the shared kernel (see the module docstring); ``forced`` tokens are
        kept like protected ones in the final selection (the penalty does not see them)."""
        B, H, N = keys.shape[:3]
        pen, h0 = self._penalised(scores.reshape(B, H, N), budgets, hd, sink, window, k_max,
                                  inputs.get("process_group"), None if forced is not None else (sink, window))
        return _select.select_kv(pen, budgets, keys, values, k_max, sink=sink, window=window, forced=forced,
                                 out=out, hist0=h0)
