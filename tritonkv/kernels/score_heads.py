"""SCORE's head budgets within a layer (SCORE §3.3, Eqs. 10–12; ``docs/algorithms.md`` §2.6) in one launch.

From the keep-mask U ``[B, H, M]`` of the layer's global top-``B_l`` selection (written by the shared select over
each batch row's ``H·M`` selectable scores), KV-head distinctness HD ``[B, H]`` and the layer totals ``B_l``
(int32 ``[B]``)::

    T_h     = Σ_j U[h, j]                                 the head's share of the global top-B_l
    w_h     = HD_h · T_h;   x_h = B_l · w_h / Σ_h' w_h'   (x_h = T_h when Σ w = 0)
    B_{l,h} = largest remainder of x with total min(B_l, H·M), each head capped at M

where the largest remainder (``allocation/rounding.py``, exact mode) water-fills the excess above the caps in
proportion to w (then evenly over the heads of zero weight), takes floors and gives one more to the largest
fractional parts (compared in fp32, ties to the lower head).

One program per batch row holds its H heads in one block (``BLOCK_H``, H <= ``MAX_HEADS``): it counts T over
``[BLOCK_H, BLOCK_M]`` tiles of U (byte loads), then runs the rounding as PyTorch does, in float64 and operation
by operation: the water level from the breakpoints ``(cap − x)/w`` by evaluating the row sum at each of them
(a ``[BLOCK_H, BLOCK_H]`` tile), the ranks of the fractional parts by pairwise counting. The launch turns FMA
contraction off, so every product, quotient and sum is rounded as PyTorch's separate ops round it; only sums over
heads may add in another order (a tree here), a last-bit difference of a float64 that changes a budget only for
shares within that noise of a rounding boundary: equal heads compute equal shares either way, an integer share
computed just below itself gets its unit back as the largest remainder, and the remainders are compared in fp32.
The tests compare the budgets exactly with the PyTorch formula and the NumPy oracle, ties and degenerate
distances included. Nothing is read back to the host, so the op can be captured in a CUDA graph.

On the CPU (outside the interpreter), and for more than ``MAX_HEADS`` heads, the op runs ``_score_heads_torch``,
the same formula in PyTorch (about 130 device ops).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, launch, next_pow2, pdl_wait, triton_op, use_triton

MAX_HEADS = 128  # heads per batch row held in one program (the pairwise tiles are BLOCK_H²)
_TILE = 4096  # elements of a [BLOCK_H, BLOCK_M] mask tile
_TOL = tl.constexpr(1e-9)  # rounding.waterfill's relative tolerance
_HD_DTYPES = FLOAT_DTYPES + (torch.float64,)


@triton.jit
def _waterfill(x, w, cap, total, tol, BLOCK_H: tl.constexpr):
    """``rounding.waterfill`` of one row: ``min(cap, x + λ·w)`` with the smallest λ >= 0 that brings the row sum
    to ``total`` (float64 ``[BLOCK_H]`` x and w, zero in the padding lanes; scalar cap, total and tol)."""
    pos = w > 0
    bp = tl.where(pos, tl.maximum((cap - x) / tl.where(pos, w, 1.0), 0.0), float("inf"))
    cand = tl.where(pos, bp, 0.0)
    # the row sum at each candidate level (rows of the tile: candidates; columns: heads)
    filled = tl.sum(tl.minimum(cap, x[None, :] + cand[:, None] * w[None, :]), 1)
    ok = filled <= total + tol
    lam0 = tl.maximum(tl.max(tl.where(ok, cand, 0.0), 0), 0.0)  # level 0 is a candidate too
    f0 = tl.sum(tl.minimum(cap, x + lam0 * w), 0)
    slope = tl.sum(tl.where(bp > lam0, w, 0.0), 0)
    gap = total - f0
    step = tl.where((slope > 0) & (gap > tol), gap / tl.where(slope > 0, slope, 1.0), 0.0)
    return tl.minimum(cap, x + (lam0 + step) * w)


@triton.jit
def _score_heads_kernel(u_ptr, hd_ptr, lb_ptr, out_ptr, H, M, shb, shh, slb,
                        BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, HD_F64: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    valid = h < H
    # T: the head's tokens among the batch row's global top-B_l
    t = tl.zeros([BLOCK_H], dtype=tl.int32)
    row = u_ptr + b * H * M + h.to(tl.int64)[:, None] * M
    for m0 in range(0, M, BLOCK_M):
        j = m0 + tl.arange(0, BLOCK_M)
        u = tl.load(row + j[None, :], mask=valid[:, None] & (j < M)[None, :], other=0)
        t += tl.sum(u.to(tl.int32), 1)
    tf = t.to(tl.float64)
    hd = tl.load(hd_ptr + b * shb + h * shh, mask=valid, other=0.0)
    if HD_F64:
        hd = hd.to(tl.float64)
    else:
        hd = hd.to(tl.float32).to(tl.float64)
    bl = tl.load(lb_ptr + b * slb).to(tl.float64)
    w = hd * tf
    s = tl.sum(w, 0)
    x = tl.where(s > 0, bl * w / tl.where(s > 0, s, 1.0), tf)
    # largest remainder with every head capped at M (rounding.largest_remainder)
    x = tl.where(x < 0, 0.0, x)
    w = tl.where(w < 0, 0.0, w)
    cap = tl.cast(M, tl.float64)
    total = tl.minimum(bl, cap * H)
    tol = _TOL * tl.maximum(tl.abs(total), 1.0)
    x = _waterfill(x, w, cap, total, tol, BLOCK_H)
    x = _waterfill(x, tl.where(valid & (w <= 0), 1.0, 0.0).to(tl.float64), cap, total, tol, BLOCK_H)
    fl = tl.floor(x)
    rem = tl.maximum(total - tl.sum(fl, 0), 0.0)  # an integer: the total less a sum of floors
    key = tl.where(valid & (fl < cap), (x - fl).to(tl.float32), float("-inf"))
    # rank in the order (key desc, head asc), by counting the heads before each (rows: others, columns: heads)
    before = (key[:, None] > key[None, :]) | ((key[:, None] == key[None, :]) & (h[:, None] < h[None, :]))
    rank = tl.sum(before.to(tl.int32), 0)
    out = fl + tl.where(rank.to(tl.float64) < rem, 1.0, 0.0)
    tl.store(out_ptr + b * H + h, out.to(tl.int32), mask=valid)


def _score_heads_torch(mask: torch.Tensor, hd: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """The op's PyTorch body: the formula of the module docstring as ``allocation.rounding`` evaluates it."""
    from ..allocation.rounding import largest_remainder  # the allocation package imports this module

    B, H = hd.shape
    M = mask.shape[1] // max(H, 1)
    t = mask.view(B, H, M).sum(-1).to(torch.float64)
    w = hd.to(torch.float64) * t
    s = w.sum(-1, keepdim=True)
    bl = total.to(torch.float64).reshape(B, 1)
    x = torch.where(s > 0, bl * w / torch.where(s > 0, s, 1.0), t)
    return largest_remainder(x, total, cap=M, weights=w)


@triton_op("tritonkv::score_heads", mutates_args=())
def score_heads_op(mask: torch.Tensor, hd: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """The raw op: mask bool or int8 ``[B, H·M]`` (contiguous; head h's tokens at ``[h·M, (h+1)·M)``), hd ``[B, H]``
    (fp32/fp16/bf16/fp64, any strides), total int32 ``[B]`` (any stride) -> int32 ``[B, H]``."""
    B, H = hd.shape
    M = mask.shape[1] // max(H, 1)
    if not use_triton(mask) or H > MAX_HEADS:
        return _score_heads_torch(mask, hd, total)
    out = torch.empty((B, H), dtype=torch.int32, device=mask.device)
    if B > 0 and H > 0:
        BLOCK_H = next_pow2(H)
        BLOCK_M = max(min(next_pow2(M), _TILE // BLOCK_H), 16)
        launch(_score_heads_kernel, (B,), mask, hd, total, out, H, M, hd.stride(0), hd.stride(1), total.stride(0),
               BLOCK_H=BLOCK_H, BLOCK_M=BLOCK_M, HD_F64=hd.dtype == torch.float64,
               num_warps=4 if BLOCK_H <= 32 else 8, enable_fp_fusion=False)
    return out


def score_heads(mask: torch.Tensor, hd: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """SCORE's int32 head budgets ``[B, H]`` (see the module docstring).

    ``mask``: U, bool or int8 ``[B, H, M]`` (1 = among the batch row's global top-``total``); ``hd``: HD
    ``[B, H]`` (a float tensor, finite, >= 0); ``total``: ``B_l``, an integer tensor of ``B`` entries. All on one
    device. Each row sums to ``min(B_l, H·M)`` (0 where ``B_l <= 0``), each budget in ``[0, M]``.
    """
    if not isinstance(mask, torch.Tensor) or mask.dtype not in (torch.int8, torch.bool) or mask.dim() != 3:
        raise TypeError(f"mask must be an int8 or bool tensor [B, H, M], got {getattr(mask, 'dtype', type(mask))} "
                        f"{tuple(getattr(mask, 'shape', ()))}")
    B, H, M = mask.shape
    if not isinstance(hd, torch.Tensor) or not hd.dtype.is_floating_point or hd.shape != (B, H):
        raise TypeError(f"hd must be a float tensor [B, H] = {[B, H]}, got "
                        f"{getattr(hd, 'dtype', type(hd))} {tuple(getattr(hd, 'shape', ()))}")
    if (not isinstance(total, torch.Tensor) or total.dtype.is_floating_point or total.dtype.is_complex
            or total.dtype == torch.bool or total.numel() != B):
        raise TypeError(f"total must be an integer tensor of B = {B} entries, got "
                        f"{getattr(total, 'dtype', type(total))} {tuple(getattr(total, 'shape', ()))}")
    for name, t in (("hd", hd), ("total", total)):
        if t.device != mask.device:
            raise ValueError(f"{name} must be on the device of mask ({mask.device}), got {t.device}")
    return heads(mask.reshape(B, H * M), hd, total.reshape(B))


def heads(mask: torch.Tensor, hd: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """``score_heads`` on checked arguments, the mask as ``[B, H·M]`` and the totals as ``[B]`` (the allocator's
    entry point: the shared select's mask as it comes)."""
    if hd.dtype not in _HD_DTYPES:
        hd = hd.to(torch.float32)  # exact: a narrower float type
    return score_heads_op(mask.contiguous(), hd, total.to(torch.int32))
