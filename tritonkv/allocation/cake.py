"""CAKE layer preference (docs/algorithms.md §2.7, optional).

Per layer, from the window attention ``A [B, H, W, n]`` (W window queries over the prefix keys)::

    H_l = −Σ A·log(A + 1e-10)                   spatial dispersion
    V_l = Σ_{heads,keys} Var_{window rows}(A)    temporal shift (population variance)
    P_l = H_l^(1/τ₁) · V_l^(1/τ₂)
    B_l = B_total · P_l / ΣP                     B_total = L·b, a per-head count shared by the layer

Exact mode rounds by largest remainder (cap ``avail``); paper mode uses CAKE's ``adjust_budgets``.
The variance divisor does not matter: it scales every P_l alike, and scaling P changes nothing.
"""
from __future__ import annotations

import dataclasses

import torch

from .base import Allocator, check_budget, check_mode, check_positive, check_tensor, host_row, register_allocator
from .rounding import adjust_budgets, largest_remainder

MODES = ("exact", "paper")


def cake_preference(attn: torch.Tensor, *, tau1: float = 1.0, tau2: float = 1.0, process_group=None) -> torch.Tensor:
    """float64 ``[B]`` preference ``P_l`` of one layer from its window attention ``[B, H, W, n]``.

    Both sums run per head first, then over the heads in order; with a ``process_group`` (heads split over the
    ranks, ``tritonkv.distributed``) each rank's per-head sums are gathered (one collective) before the sum over
    the layer's heads, so every rank gets the single-process ``P_l``."""
    if not isinstance(attn, torch.Tensor) or attn.dim() != 4:
        raise ValueError("attn must be the window attention [B, H, W, n]")
    check_tensor("attn", attn)
    check_positive("tau1", tau1)
    check_positive("tau2", tau2)
    a = attn.to(torch.float64)
    ent = -(a * torch.log(a + 1e-10)).sum((2, 3))  # [B, H]
    var = a.var(dim=2, correction=0).sum(2)  # [B, H]
    from ..distributed import group_info

    tp = group_info(process_group)
    if tp is not None:
        ent, var = (torch.cat(g.unbind(0), dim=1) for g in tp.gather(ent, var))
    ent, var = ent.sum(1), var.sum(1)
    return ent.clamp_min(0.0) ** (1.0 / tau1) * var ** (1.0 / tau2)


def cake_budgets(preference: torch.Tensor, b: int, avail: int, *, mode: str = "exact") -> torch.Tensor:
    """int32 ``[B, L]`` per-head budget of each layer from ``preference`` ``[L]`` or ``[L, B]``."""
    check_tensor("preference", preference, (1, 2), floating=False)
    check_budget(b, avail)
    check_mode(mode, MODES)
    p = preference.to(torch.float64)
    p = (p[:, None] if p.dim() == 1 else p).transpose(0, 1).clamp_min(0.0)  # [B, L]
    L = p.shape[1]
    if b >= avail or b <= 0:
        return torch.full(p.shape, max(min(b, avail), 0), dtype=torch.int32, device=p.device)
    total = L * b
    s = p.sum(-1, keepdim=True)
    x = torch.where(s > 0, total * p / torch.where(s > 0, s, 1.0), float(b))
    if mode == "paper":
        return adjust_budgets(x, total, avail)
    return largest_remainder(x, total, cap=avail, weights=p)


@register_allocator
@dataclasses.dataclass
class Cake(Allocator):
    """CAKE: layer budgets ∝ dispersion × temporal shift (input ``layer_preference`` ``[L]`` or
    ``[L, B]``, from ``cake_preference`` on each layer), the same for all heads of a layer."""

    name = "cake"
    cross_layer = True
    tp_mode = "replicated"  # every head's budget from shapes and replicated inputs: no collective
    needs = ("layer_preference", "layer")

    mode: str = "exact"

    def __post_init__(self):
        check_mode(self.mode, MODES)

    def host(self, ctx, layer_preference=None, **inputs):
        """The layer's budgets ``[B or 1][1]``, the table computed once per preference tensor and setting (on the
        CPU; preferences on the device are read back once)."""
        key = ("cake", ctx["B"], ctx["b"], ctx["avail"], self.mode)
        return host_row(self, ctx, layer_preference, key,
                        lambda c, src: self.allocate(None, c, layer_preference=src, table=True))

    def allocate(self, scores, ctx, layer_preference=None, table=False, **inputs):
        if layer_preference is None:
            raise ValueError("layer_preference: cake needs every layer's preference P_l ([L] or [L, B])")
        try:
            p = torch.as_tensor(layer_preference)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"layer_preference must be a tensor [L] or [L, B] of every layer's preference, got "
                            f"{type(layer_preference).__name__}") from None
        p = check_tensor("layer_preference", p, floating=False).to(ctx["device"])
        if p.device.type == "cpu" and not bool(torch.isfinite(p).all()):  # the host table's copy (Cake.host)
            raise ValueError("layer_preference must be finite (no NaN or inf): the layers share the budget in "
                             "proportion to it")
        if p.dim() not in (1, 2) or (p.dim() == 2 and p.shape[1] not in (1, ctx["B"])):
            raise ValueError(f"layer_preference must be [L] or [L, B={ctx['B']}], got {tuple(p.shape)}")
        out = cake_budgets(p, ctx["b"], ctx["avail"], mode=self.mode).transpose(0, 1)[:, :, None]  # [L, B, 1]
        return out if table else out[self.need_layer(ctx, p.shape[0])]


@dataclasses.dataclass
class Fixed(Allocator):
    """Precomputed selectable budgets (``[L, H]`` or ``[L, B, H]``), e.g. from ``score_budgets``;
    each layer's row is returned, clamped to ``[0, avail]``. The table is the allocation: ``compress``'s
    budget does not scale it (it sets only the policy's protected tokens, which every head keeps beside
    its entry)."""

    name = "fixed"
    tp_mode = "replicated"  # every head's budget from shapes and replicated inputs: no collective
    needs = ("layer",)

    budgets: torch.Tensor = None

    def __post_init__(self):
        if self.budgets is None:
            raise ValueError("the fixed allocator needs its budgets: pass allocation=tritonkv.allocation.Fixed("
                             "budgets=<int tensor [L, H] or [L, B, H] of selectable budgets>), not the name 'fixed'")
        if not isinstance(self.budgets, torch.Tensor) or self.budgets.dim() not in (2, 3) \
                or self.budgets.dtype.is_floating_point or self.budgets.dtype == torch.bool:
            raise ValueError("budgets must be an int tensor [L, H] or [L, B, H] of selectable budgets")

    def host(self, ctx, **inputs):
        """The layer's row (a table on the device is read back once)."""
        self._row(ctx)  # the checks
        return host_row(self, ctx, self.budgets, ("fixed", ctx["avail"]), lambda c, src: src.clamp(0, c["avail"]))

    def allocate(self, scores, ctx, **inputs):
        return self._row(ctx).to(ctx["device"]).clamp(0, ctx["avail"])

    def _row(self, ctx):
        row = self.budgets[self.need_layer(ctx, self.budgets.shape[0])]
        if tuple(row.shape) not in ((ctx["H"],), (ctx["B"], ctx["H"]), (1, ctx["H"])):
            raise ValueError(f"budgets must be [L, H_kv] or [L, B, H_kv] with H_kv = {ctx['H']} and B = {ctx['B']}, "
                             f"got {tuple(self.budgets.shape)}")
        return row


register_allocator(Fixed)
