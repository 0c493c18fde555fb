"""SCORE redundancy allocation (docs/algorithms.md §2.6; SCORE §3.2–3.3, Eqs. 4–12).

Statistics, from each query head's normalised mean attention row over sampled positions
(``m_q = (1/K) Σ_s a_q^(s)/‖a_q^(s)‖₂``, a vector over the context)::

    D(i, j) = 1 − ⟨m_i, m_j⟩                      cosine head distance, in [0, 1], symmetric
    IR_l    = mean_{q,q'} D((l,q),(l,q'))          (diagonal included, as printed)
    μ_l     = mean_{q,q'} D((l,q),(l−1,q'))
    TD_0 = E_0 = IR_0;  TD_l = |μ_l − E_{l−1}|;  E_l = γE_{l−1} + (1−γ)μ_l      (γ = 0.5)
    HD_lq   = (1/2H')[Σ_q' D((l,q),(l,q')) + Σ_q' D((l,q),(l−1,q'))];  HD_0q = mean_q' D((0,q),(0,q'))

clamped to HD >= 1e-6 and averaged over each KV head's query group. Budgets::

    N_l = λ₁·IR_l + λ₂·TD_l;   B_l = B_total·N_l/ΣN   (B_total = L·H·b, cap H·avail)
    T_h = |global top-B_l of the layer's scores [H, avail] ∩ head h|
    B_{l,h} = B_l·HD_h·T_h / Σ_h' HD_h'·T_h'     (T_h when the sum is 0; cap avail)

Exact mode rounds both levels by largest remainder; paper mode rounds the layer level with CAKE's
``adjust_budgets``. This is the non-cascaded reference mode (allocate once, after prefill).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence, Union

import torch

from ..kernels import score_heads
from ..kernels.select import select_mask
from .base import Allocator, check_budget, check_int, check_mode, check_positive, check_tensor, memo, register_allocator
from .rounding import adjust_budgets, largest_remainder

MODES = ("exact", "paper")
HD_MIN = 1e-6


# -- sampling and head means -----------------------------------------------------------------------
def sample_positions(n: int, k: int = 200, window: int = 32, seed: int = 0) -> torch.Tensor:
    """``k`` query positions drawn uniformly without replacement from ``[window, n − window)`` with a
    seeded generator (all of them when fewer exist; empty when none). int64 CPU tensor."""
    check_int("n", n)
    check_int("k", k)
    check_int("window", window)
    lo, hi = window, n - window
    if hi <= lo:
        return torch.empty(0, dtype=torch.int64)
    g = torch.Generator().manual_seed(int(seed))
    return torch.randperm(hi - lo, generator=g)[:k] + lo


def head_means(rows: torch.Tensor) -> torch.Tensor:
    """``m = mean_s a^(s)/‖a^(s)‖₂`` from attention rows ``[..., K, n]`` (zero rows count as zero)."""
    if check_tensor("rows", rows, floating=False).dim() < 2:
        raise ValueError(f"rows must be attention rows [..., K, n], got shape {tuple(rows.shape)}")
    a = rows.to(torch.float32)
    norm = torch.linalg.vector_norm(a, dim=-1, keepdim=True)
    return (a / torch.where(norm > 0, norm, 1.0)).mean(-2)


def head_means_from_queries(queries: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                            scale: Optional[float] = None, chunk: int = 32) -> torch.Tensor:
    """Per query head ``m`` ``[B, H_q, N]`` from the queries at ``positions`` (``[B, H_q, K, D]``,
    RoPE applied) and the layer's keys ``[B, H_kv, N, D]``: causal softmax rows (zero beyond each
    position), normalised and averaged. Query head q reads KV head q // G (no repeat_kv)."""
    B, Hq, K, D = check_tensor("queries", queries, 4).shape
    H, N = check_tensor("keys", keys, 4).shape[1:3]
    if keys.shape[0] != B or keys.shape[3] != D:
        raise ValueError(f"keys must be [B={B}, H_kv, N, D={D}] like the queries, got {tuple(keys.shape)}")
    if Hq % H:
        raise ValueError(f"queries must have a multiple of H_kv = {H} heads, got {Hq}")
    if positions.numel() != K:
        raise ValueError(f"positions must have {K} entries (one per query), got {positions.numel()}")
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    q = queries.to(torch.float32).reshape(B, H, Hq // H, K, D)
    k = keys.to(torch.float32)
    pos = positions.to(keys.device)
    cols = torch.arange(N, device=keys.device)
    acc = torch.zeros(B, H, Hq // H, N, dtype=torch.float32, device=keys.device)
    for s0 in range(0, K, chunk):
        logits = torch.einsum("bhgkd,bhnd->bhgkn", q[:, :, :, s0:s0 + chunk], k) * scale
        future = cols[None, :] > pos[s0:s0 + chunk, None]
        rows = torch.softmax(logits.masked_fill(future, -torch.inf), dim=-1)
        acc += (rows / torch.linalg.vector_norm(rows, dim=-1, keepdim=True).clamp_min(1e-30)).sum(-2)
    return (acc / max(K, 1)).reshape(B, Hq, N)


# -- statistics --------------------------------------------------------------------------------------
def head_distance(ma: torch.Tensor, mb: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``D = 1 − ⟨m_i, m_j⟩`` ``[..., H_a, H_b]`` clamped to [0, 1]; ``mb=None`` means ``mb = ma``
    (then D is made exactly symmetric)."""
    ma = ma.to(torch.float64)
    if mb is None:
        d = 1.0 - ma @ ma.transpose(-1, -2)
        d = 0.5 * (d + d.transpose(-1, -2))
    else:
        d = 1.0 - ma @ mb.to(torch.float64).transpose(-1, -2)
    return d.clamp(0.0, 1.0)


def _stack(t: Union[torch.Tensor, Sequence[torch.Tensor]], name: str, ndim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        t = torch.stack(list(t))
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions (layers first), got shape {tuple(t.shape)}")
    return t


def redundancy(head_means: Union[torch.Tensor, Sequence[torch.Tensor]], gamma: float = 0.5):
    """``(IR [B, L], TD [B, L], HD [L, B, H_q])`` from ``head_means [L, B, H_q, n]`` (float64)."""
    m = _stack(head_means, "head_means", 4)
    L, _, Hq, _ = m.shape
    ir, td, hd = [], [], []
    ema = None
    for l in range(L):
        dll = head_distance(m[l])
        ir.append(dll.mean((-1, -2)))
        if l == 0:
            td.append(ir[0])
            ema = ir[0]
            hd.append(dll.mean(-1))
        else:
            dx = head_distance(m[l], m[l - 1])
            mu = dx.mean((-1, -2))
            td.append((mu - ema).abs())
            ema = gamma * ema + (1 - gamma) * mu
            hd.append((dll.sum(-1) + dx.sum(-1)) / (2 * Hq))
    return torch.stack(ir, -1), torch.stack(td, -1), torch.stack(hd).clamp_min(HD_MIN)


def kv_head_distance(hd: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Query-head HD ``[..., H_q]`` → KV-head HD ``[..., H_kv]`` (mean over each group)."""
    if hd.shape[-1] % num_kv_heads:
        raise ValueError(f"head_means has {hd.shape[-1]} heads: expected a multiple of H_kv = {num_kv_heads}")
    return hd.reshape(*hd.shape[:-1], num_kv_heads, -1).mean(-1)


# -- budgets -------------------------------------------------------------------------------------------
def score_layer_budgets(ir: torch.Tensor, td: torch.Tensor, b: int, num_heads: int, avail: int, *,
                        lambda1: float = 1.0, lambda2: float = 1.0, mode: str = "exact") -> torch.Tensor:
    """int32 ``[B, L]`` layer totals ``B_l`` (summed over the layer's heads), each <= H·avail."""
    check_mode(mode, MODES)
    check_budget(b, avail)
    check_int("num_heads", num_heads, 1)
    B, L = check_tensor("ir", ir, 2).shape
    if check_tensor("td", td, 2).shape != ir.shape:
        raise ValueError(f"td must have the shape of ir {tuple(ir.shape)}, got {tuple(td.shape)}")
    total = L * num_heads * b
    n = lambda1 * ir.to(torch.float64) + lambda2 * td.to(torch.float64)
    s = n.sum(-1, keepdim=True)
    x = torch.where(s > 0, total * n / torch.where(s > 0, s, 1.0), total / L)
    cap = num_heads * avail
    if mode == "paper":
        return adjust_budgets(x, total, cap)
    return largest_remainder(x, total, cap=cap, weights=n)


def score_head_budgets(scores: torch.Tensor, layer_budget: torch.Tensor, hd: torch.Tensor) -> torch.Tensor:
    """int32 ``[B, H]`` head budgets of one layer from its selectable scores ``[B, H, avail]``, its
    total ``layer_budget`` (int ``[B]``; lowered to H·avail when above) and KV-head distances ``hd [B, H]``."""
    B, H, M = check_tensor("scores", scores, 3).shape
    if check_tensor("layer_budget", layer_budget, floating=False).numel() != B:
        raise ValueError(f"layer_budget must hold one total per batch row (B = {B}), "
                         f"got shape {tuple(layer_budget.shape)}")
    if tuple(check_tensor("hd", hd).shape) != (B, H):
        raise ValueError(f"hd must be [B, H_kv] = [{B}, {H}], got {tuple(hd.shape)}")
    layer_budget = layer_budget.to(torch.int32)
    if layer_budget.shape != (B,) or not layer_budget.is_contiguous():  # the kernels read it as flat memory
        layer_budget = layer_budget.reshape(B).contiguous()
    won = select_mask(scores.to(torch.float32).reshape(B, H * M), layer_budget)  # head h's tokens at [h·M, (h+1)·M)
    return score_heads.heads(won, hd, layer_budget)


def score_budgets(head_means, layer_scores, b: int, avail: int, *, gamma: float = 0.5, lambda1: float = 1.0,
                  lambda2: float = 1.0, mode: str = "exact"):
    """All layers at once: ``(budgets int32 [L, B, H], hd fp32 [L, B, H])``.

    ``head_means``: ``[L, B, H_q, n]`` (or a list of ``[B, H_q, n]``), or ``None`` when no position
    could be sampled (then layers are uniform and HD = 1). ``layer_scores``: each layer's scores of
    the selectable tokens, ``[L, B, H, avail]`` or a list of ``[B, H, avail]``.
    """
    check_budget(b, avail)
    a = _stack(layer_scores, "layer_scores", 4)
    L, B, H, M = a.shape
    if M != avail:
        raise ValueError(f"layer_scores must cover the avail = {avail} selectable tokens, got {M}")
    lb, hd = _layer_totals(head_means, L, B, H, b, avail, gamma, lambda1, lambda2, mode, a.device)
    if b >= avail or b <= 0:
        return torch.full((L, B, H), max(min(b, avail), 0), dtype=torch.int32, device=a.device), hd
    out = torch.stack([score_head_budgets(a[l], lb[:, l], hd[l]) for l in range(L)])
    return out, hd


def _layer_totals(head_means, L, B, H, b, avail, gamma, lambda1, lambda2, mode, device):
    """``(B_l int32 [B, L], KV-head HD fp32 [L, B, H])``."""
    if head_means is None:
        lb = torch.full((B, L), H * max(min(b, avail), 0), dtype=torch.int32, device=device)
        return lb, torch.ones(L, B, H, dtype=torch.float32, device=device)
    m = _stack(head_means, "head_means", 4).to(device)
    if m.shape[0] != L or m.shape[1] != B:
        raise ValueError(f"head_means must be [L={L}, B={B}, H_q, n], got {tuple(m.shape)}")
    ir, td, hdq = redundancy(m, gamma)
    hd = kv_head_distance(hdq, H).to(torch.float32)
    return score_layer_budgets(ir, td, b, H, avail, lambda1=lambda1, lambda2=lambda2, mode=mode), hd


@register_allocator
@dataclasses.dataclass
class Score(Allocator):
    """SCORE: layer totals from attention redundancy across all layers, head budgets ∝ HD·T within
    the layer. Reads ``head_means`` (``[L, B, H_q, n]``, every layer's ``m`` vectors, see
    ``head_means_from_queries``), ``layer`` and this layer's scores. ``hd(...)`` gives the KV-head
    distances the SCORE selection policy needs (pass them to compress() as ``hd=``)."""

    name = "score"
    cross_layer = True
    needs = ("head_means", "layer")
    tp_mode = "gather"  # the layer's scores of every head, gathered once; head_means are the whole model's

    gamma: float = 0.5
    lambda1: float = 1.0
    lambda2: float = 1.0
    mode: str = "exact"

    def __post_init__(self):
        check_positive("gamma", self.gamma, 0.0, strict=False, hi=1.0)  # a moving average's weight
        check_positive("lambda1", self.lambda1, 0.0, strict=False)
        check_positive("lambda2", self.lambda2, 0.0, strict=False)
        check_mode(self.mode, MODES)

    def hd(self, head_means, num_kv_heads: int) -> torch.Tensor:
        """KV-head distances fp32 ``[L, B, H_kv]``."""
        return kv_head_distance(redundancy(head_means, self.gamma)[2], check_int("num_kv_heads", num_kv_heads, 1)
                                ).to(torch.float32)

    def allocate(self, scores, ctx, head_means=None, **inputs):
        if scores is None:
            raise ValueError("scores: score allocates from the policy's scores [B, H_kv, N]")
        if head_means is None:
            raise ValueError("head_means: score needs every layer's m vectors [L, B, H_q, n]")
        m = _stack(head_means, "head_means", 4)
        L = m.shape[0]
        layer = self.need_layer(ctx, L)
        q = inputs.get("queries")
        if ctx["tp"] is not None and isinstance(q, torch.Tensor) and q.dim() == 4 \
                and m.shape[2] != q.shape[1] * ctx["tp"].world:
            raise ValueError(f"head_means must hold the whole model's query heads under tensor parallelism "
                             f"(H_q = {q.shape[1] * ctx['tp'].world}: {ctx['tp'].world} ranks x {q.shape[1]}), got "
                             f"{m.shape[2]}; gather them once with tritonkv.distributed.gather_heads(m, "
                             f"process_group, dim=2)")
        lbs, hd = self._totals(head_means, lambda: m, ctx)[2:]
        return score_head_budgets(self.selectable(scores, ctx), lbs[layer], hd[layer])

    def host(self, ctx, **inputs):
        """A budget that keeps every selectable token (or none) is the same for every head."""
        b, avail = ctx["b"], ctx["avail"]
        return max(b, 0) if b >= avail or b <= 0 else None

    def _totals(self, head_means, stacked, ctx):
        """``(B_l int32 [B, L], the same as host lists or None, B_l int32 [L, B], KV-head HD [L, B, H])`` from every
        layer's head means (``stacked()``: them as one tensor): computed once per ``head_means`` tensor or list of
        tensors (and its totals read back once), not once per layer."""
        B, H, b, avail = ctx["B"], ctx["H"], ctx["b"], ctx["avail"]

        def compute():
            m = stacked()
            if not torch.compiler.is_compiling() and not bool(torch.isfinite(m).all()):  # once per head_means
                raise ValueError("head_means must be finite (no NaN or inf): the layers' redundancy is computed from "
                                 "every value")
            lb, hd = _layer_totals(m, m.shape[0], B, H, b, avail, self.gamma, self.lambda1, self.lambda2, self.mode,
                                   ctx["device"])
            host = None if torch.compiler.is_compiling() else lb.tolist()
            return lb, host, lb.t().contiguous(), hd  # a layer's totals: a contiguous row
        key = ("score", B, H, b, avail, self.gamma, self.lambda1, self.lambda2, self.mode, str(ctx["device"]))
        return memo(head_means, key, compute)

    def bound(self, ctx, head_means=None, **inputs):
        """The layer's totals as host ints (read back once per ``head_means`` tensor or list, ``_totals``): each batch
        row keeps ``min(B_l, H·avail)``, a head at most ``min(B_l, avail)``."""
        if ctx["tp"] is not None or not (isinstance(head_means, torch.Tensor) or isinstance(head_means, (list, tuple))
                                        and all(isinstance(x, torch.Tensor) for x in head_means)):
            return None
        host = self._totals(head_means, lambda: _stack(head_means, "head_means", 4), ctx)[1]
        if host is None:
            return None
        lb = [row[ctx["layer"]] for row in host]
        avail = ctx["row_avail"]
        return sum(min(v, ctx["H"] * avail) for v in lb), min(max(lb), avail)
