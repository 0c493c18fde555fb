"""CriticalKV perturbation-constrained selection (CriticalKV §3.4, Algorithms 1–2;
``docs/algorithms.md`` §1.6).

A wrapper over an attention-like base policy (SnapKV by default). Per row, with base scores s ≥ 0,
protected tokens P and selectable budget b = budget − |P| (which may differ per head, e.g. from
AdaKV)::

    S1   = top-⌊α·b⌋ non-protected tokens by s                       (stage 1)
    S2   = top-(b − |S1|) of the rest by (s + ε)·n_j,  n_j = ‖v_j W_O‖₁ (group mean, ``kernels/critical.py``)
    kept = P ∪ S1 ∪ S2

as a score transform over the shared select kernel: a selection with budget |P| + ⌊α·b⌋ on s
marks S1, then a selection with the row budgets on (s + ε)·n keeps S1 forced like protected
tokens. ⌊α·b⌋ is ⌊α·b + 10⁻⁶⌋ in float64 (the library's rounding of fractional budgets, so that
0.29·100 gives 29), on the host for one int budget, else on the device from the budgets tensor. The
norm kernel writes (s + ε)·n and the stage-2 select's first radix pass; a window-attention base's
pooling kernel counts stage 1's. α = 1 is the base selection, α = 0 pure (s + ε)·n selection.

α applies to the selectable part (the AdaKV-codebase convention), not to the whole budget as in
kvpress; the two differ when the window is comparable to α·k.

``norm="l2"`` (not in the paper) replaces n_j by the group mean of ‖v_j W_O^q‖₂, computed through
W_O^q's QR factor R_q (R_qᵀ R_q is the head's Gram matrix; ``kernels/critical.py``): G·d² instead
of G·d·D_model multiply-adds per token (~34 GFLOP instead of 1.1 TFLOP at d = 128, D_model = 4096,
N = 32K, H_kv = 8), with norms accurate to ~10⁻⁵ instead of ~10⁻⁶. Measured against the exact
L1 norm on SmolLM2-135M (native CPU path): a 2048-token context of this repository's docs
(docs/algorithms.md, architecture.md, contracts.md from token 1000), SnapKV base with the last 32
context queries, layers 0, 3, 7, 11, 15, 19, 23, 27, 29, uniform budgets of 10 % and 25 %: the two
norms' per-head Spearman rank correlation is 0.993 on average (0.977 at worst, layer 0); the kept
sets share 99.3 % (10 %) and 99.2 % (25 %) of their tokens at α = 0.5 (98.0 % at worst), 99.2 % /
99.0 % at α = 0; the attention-output error after W_O on the 64 following queries,
‖y − ŷ‖₁/‖y‖₁ with y = concat_heads(o)·W_Oᵀ, averages 0.3794 (L1) vs 0.3801 (L2) at 10 % and
0.2134 vs 0.2124 at 25 % (α = 0.5), the L2 norm lower on 3 and 4 of the 9 layers: no measurable
change in quality on this model, one prompt. SmolLM2's heads are small (d = 64, D_model = 576), so
its saving is D_model/d = 9x in flops, 32x at d = 128, D_model = 4096. Not timed on a GPU.
"""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch

from ..kernels import select as _select
from ..kernels._common import use_triton
from ..kernels.critical import NORMS, value_norms
from .base import Policy, register_policy
from .snapkv import WindowAttentionPolicy


def _default_base() -> Policy:
    from .snapkv import SnapKV

    return SnapKV()


def check_base(owner: str, base) -> None:
    """A score-transform wrapper's base must be a plain policy whose scores are attention-like (≥ 0)."""
    if not isinstance(base, Policy):
        raise TypeError(f"base must be a tritonkv Policy instance, got {type(base).__name__}")
    if not base.nonnegative:
        raise ValueError(f"base: {owner} needs non-negative (attention-like) base scores; "
                         f"{type(base).__name__} gives signed scores (its nonnegative flag is False)")
    if type(base).select is not Policy.select:
        raise ValueError(f"base: {owner} needs a plain scoring policy, got {type(base).__name__}, "
                         f"which is itself a selection transform")


def row_budgets(budgets, scores: torch.Tensor, k_max: int) -> torch.Tensor:
    """int32 ``[R]`` budgets as the select kernel applies them: min(budget, N, k_max), ≥ 0."""
    R, N = scores.numel() // max(scores.shape[-1], 1), scores.shape[-1]
    b = _select.budget_tensor(budgets, R, scores.device)
    return b.clamp(min=0, max=max(min(int(k_max), N), 0))


def _check_fraction(name: str, v, lo: float, hi: float) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi or math.isnan(v):
        raise ValueError(f"{name} must be a float in [{lo}, {hi}], got {v!r}")


@register_policy
@dataclasses.dataclass(kw_only=True)
class CriticalKV(Policy):
    """CriticalKV over ``base`` (default ``SnapKV()``: window 32, max-pool 7): stage-1 fraction
    ``alpha`` of the selectable budget by the base scores, the rest by (s + ``eps``)·‖v W_O‖₁
    (``norm="l1"``, the paper) or (s + ``eps``)·‖v W_O‖₂ (``norm="l2"``: cheaper, see the module
    docstring for what it changes).

    Needs the base's inputs plus ``o_proj`` (W_O ``[D_model, H_q·d]``, nn.Linear layout, or the
    module). Protected tokens are the base's (``sink``/``window`` mirror it and are not settable).

    Non-finite inputs (``docs/contracts.md``): a token whose key or value has a NaN or ±inf element
    ranks lowest in both stages (score NaN, norm NaN), and the others are scored as if it were
    absent: a window-attention base (SnapKV, TOVA, H2O, SurfaceLogicKV) reads the values in the
    kernels that read the keys and treats a token with a non-finite value as one with a non-finite
    key (no pass of its own over K or V); the norm kernel flags the value from the tile it loads.
    Another base gets the keys with such a token's key made NaN (one elementwise pass over K and V).
    """

    name: ClassVar[str] = "criticalkv"
    nonnegative: ClassVar[bool] = True

    sink: int = dataclasses.field(default=0, init=False)
    window: int = dataclasses.field(default=0, init=False)
    base: Policy = dataclasses.field(default_factory=_default_base)
    alpha: float = 0.5
    eps: float = 1e-4
    norm: str = "l1"

    def __post_init__(self):
        check_base("CriticalKV", self.base)
        _check_fraction("alpha", self.alpha, 0.0, 1.0)
        _check_fraction("eps", self.eps, 0.0, math.inf)
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS} (l1: the paper's ‖v W_O‖₁; l2: ‖v W_O‖₂ through "
                             f"W_O's per-head Gram matrices), got {self.norm!r}")
        self.sink, self.window = self.base.sink, self.base.window
        super().__post_init__()

    @property
    def needs(self) -> tuple[str, ...]:
        """The base's inputs plus ``o_proj`` (an instance property: it depends on the base)."""
        return tuple(self.base.needs) + tuple(n for n in ("o_proj",) if n not in self.base.needs)

    def protected(self, n: int, budget: int) -> tuple[int, int]:
        return self.base.protected(n, budget)

    def score(self, keys: torch.Tensor, values: torch.Tensor, **inputs) -> torch.Tensor:
        """The base scores s (what allocators such as AdaKV see; NaN where the value is not finite);
        the transform is in ``select``."""
        if isinstance(self.base, WindowAttentionPolicy):  # its kernels read the values with the keys
            return self.base.score(keys, values, read_values=True, **inputs)
        if isinstance(values, torch.Tensor) and values.shape[:3] == keys.shape[:3]:
            keys = torch.where(torch.isfinite(values).all(-1, keepdim=True), keys, float("nan"))
        return self.base.score(keys, values, **inputs)

    def score_and_hist0(self, keys: torch.Tensor, values: torch.Tensor, *, sink: int, window: int, **inputs):
        """The base scores and, where the base's kernels count it (a window-attention base), the stage-1
        select's first radix pass over them (``select(..., hist0=)``)."""
        if isinstance(self.base, WindowAttentionPolicy):  # its kernels read the values with the keys
            return self.base.score_and_hist0(keys, values, sink=sink, window=window, read_values=True, **inputs)
        return self.score(keys, values, **inputs), None

    def stage1_budgets(self, budgets: torch.Tensor, protected: int) -> torch.Tensor:
        """|P| + ⌊α·b⌋ per row, b = budget − |P| (int32, on the device)."""
        sel = (budgets.to(torch.float64) - protected).clamp(min=0)
        return (protected + torch.floor(sel * self.alpha + 1e-6)).to(torch.int32)

    def stage1_budget(self, budget: int, protected: int) -> int:
        """``stage1_budgets`` of one budget for every row, on the host (the same float64 arithmetic)."""
        return protected + math.floor(max(budget - protected, 0) * self.alpha + 1e-6)

    def select(self, scores, budgets, keys, values, *, sink: int, window: int, k_max: int, out=None,
               forced=None, o_proj=None, hist0=None, **inputs):
        """Two-stage selection through the shared kernel (see the module docstring). ``hist0``: the first
        radix pass of ``scores`` from ``score_and_hist0``, which serves stage 1 (it has no ``forced`` tokens)."""
        if o_proj is None:
            raise ValueError("criticalkv needs the input o_proj: the output projection weight W_O "
                             "[D_model, H_q * D] (nn.Linear layout)")
        s = _select._scores_2d(scores)  # fp32 [R, N], as both selects read it
        R, n = s.shape
        if isinstance(budgets, int) and not isinstance(budgets, bool):  # one budget: stage 1's is a host int
            b1 = self.stage1_budget(max(min(budgets, n, max(k_max, 0)), 0), sink + window)
        else:
            b1 = self.stage1_budgets(row_budgets(budgets, scores, k_max), sink + window)
        # one scratch for both selects (the PyTorch bodies need none)
        work = _select.workspace(R, n, s.device) if R * n > 0 and use_triton(s) else None
        # ``forced`` tokens count as protected in stage 1, the stage-1 tokens (the forced ones among them) in stage 2
        stage1 = _select.keep_mask(s, b1, sink=sink, window=window, forced=forced, hist0=hist0, work=work)
        # the norm kernel writes (s + ε)·n and counts stage 2's first radix pass (stage-1 tokens protected)
        s2, h2 = value_norms(values, o_proj, norm=self.norm, scores=s, eps=self.eps, forced=stage1,
                             protect=(sink, window))
        return _select.select_kv(s2, budgets, keys, values, k_max, sink=sink, window=window, forced=stage1, out=out,
                                 hist0=h2, work=work)
