"""SCORE's redundancy penalty (SCORE §3.4, Eq. 13; ``docs/algorithms.md`` §1.7) in one launch.

From fp32 base scores A ``[B, H, N]``, the int8 keep-mask U of their unpenalised selection (written by
the shared select), head distinctness HD ``[B, H]`` and α::

    r[h, j] = Σ_{h'} U[h', j] − U[h, j]                 the other heads' picks of token j
    Ã[h, j] = A[h, j] · exp(−(α / max(HD_h, 1e-6)) · r[h, j])

Tensor parallel, ``picks`` ``[B, N]`` (Σ over every rank's heads, gathered by the caller) replaces the
sum over this rank's H heads.

One launch on the grid (token chunks, B·H rows), chunked like the shared select. Each program sums the
H mask rows of its batch row over its chunk (int8 loads), writes its chunk of Ã, and, with
``protect=(sink, window)``, the select's first radix pass over what it wrote (``select.hist0_of_chunk``),
returned as a ``select.Hist0`` for ``select_kv(..., hist0=)``: the final select then runs three launches.

The arithmetic is PyTorch's for the same formula, operation by operation: ``α / HD`` as the correctly
rounded reciprocal times α, ``exp`` of ``(−rate)·r``, one product. On the GPU ``exp`` is libdevice's
``expf`` (what PyTorch's CUDA ``exp`` calls; ``tl.exp`` is an approximation), so Ã, and the kept set,
match the PyTorch formula bit for bit (up to flushed subnormal factors); the interpreter, which has no
libdevice, uses ``tl.exp`` (NumPy's ``exp``: a last-bit difference from PyTorch's CPU ``exp`` at most).
On the CPU (outside the interpreter) the op runs ``_score_penalty_torch``, that formula in PyTorch.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ._common import FLOAT_DTYPES, INTERPRET, cdiv, launch, pdl_wait, triton_op, use_triton
from .select import NB, Hist0, _blocks, hist0_buffer, hist0_of_chunk


@triton.jit(do_not_specialize=["CHUNK", "C0", "sink", "window"])
def _score_penalty_kernel(s_ptr, u_ptr, p_ptr, hd_ptr, out_ptr, h0_ptr, H, shb, shh, alpha, N, CHUNK, C0, sink,
                          window, TILE: tl.constexpr, HAS_PICKS: tl.constexpr, PRECISE_EXP: tl.constexpr,
                          HIST: tl.constexpr, NB: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    c = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    b = r // H
    hd = tl.load(hd_ptr + b * shb + (r % H) * shh).to(tl.float32)
    hd = tl.maximum(hd, 1e-6, propagate_nan=tl.PropagateNan.ALL)
    neg_rate = -(tl.math.div_rn(1.0, hd) * alpha)  # PyTorch's alpha / hd: the reciprocal, then the product
    for t0 in range(0, CHUNK, TILE):
        offs = c * CHUNK + t0 + tl.arange(0, TILE)
        mask = offs < N
        own = tl.load(u_ptr + r * N + offs, mask=mask, other=0).to(tl.float32)
        if HAS_PICKS:
            picks = tl.load(p_ptr + b * N + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            n = tl.zeros([TILE], dtype=tl.int32)
            for g in range(H):
                n += tl.load(u_ptr + (b * H + g) * N + offs, mask=mask, other=0).to(tl.int32)
            picks = n.to(tl.float32)
        x = neg_rate * (picks - own)
        if PRECISE_EXP:
            e = libdevice.exp(x)
        else:
            e = tl.exp(x)
        s = tl.load(s_ptr + r * N + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + r * N + offs, s * e, mask=mask)
    if HIST:  # the select's pass 0 over the scores just stored
        tl.debug_barrier()
        hist0_of_chunk(out_ptr + r * N, out_ptr, h0_ptr, r, c, C0, N, CHUNK, sink, window, TILE, NB, False)


def _score_penalty_torch(scores, mask, picks, hd, alpha: float) -> torch.Tensor:
    """The op's CPU body: the formula above as PyTorch evaluates it (U as 0/1 fp32, the picks summed over
    heads, ``(alpha / hd)`` broadcast over tokens)."""
    u = mask.to(torch.float32)
    picks = u.sum(1, keepdim=True) if picks is None else picks[:, None]
    rate = (alpha / hd.to(torch.float32).clamp_min(1e-6))[..., None]
    return scores.to(torch.float32) * torch.exp(-rate * (picks - u))


@triton_op("tritonkv::score_penalty", mutates_args={"hist0"})
def score_penalty_op(scores: torch.Tensor, mask: torch.Tensor, picks: Optional[torch.Tensor], hd: torch.Tensor,
                     alpha: float, chunk: int, hist0: Optional[torch.Tensor], sink: int, window: int) -> torch.Tensor:
    """The raw op: scores ``[B, H, N]`` (fp32/fp16/bf16) and mask int8 ``[B, H, N]`` (contiguous), picks None
    or fp32 ``[B, N]`` (contiguous), hd ``[B, H]`` (fp32/fp16/bf16, any strides) -> Ã fp32 ``[B, H, N]``. ``hist0``: None, or
    an int32 ``[B·H, 1 + C, NB]`` (C = the launch's chunks per row) that the kernel fills with the
    select's first radix pass (``sink``/``window`` protected); the PyTorch body leaves it alone."""
    if not use_triton(scores):
        return _score_penalty_torch(scores, mask, picks, hd, alpha)
    B, H, N = scores.shape
    out = torch.empty((B, H, N), dtype=torch.float32, device=scores.device)
    if N > 0 and B * H > 0:
        CHUNK, TILE = _blocks(N, B * H, chunk or None)
        C = cdiv(N, CHUNK)
        launch(_score_penalty_kernel, (C, B * H), scores, mask, mask if picks is None else picks, hd, out,
               out if hist0 is None else hist0, H, hd.stride(0), hd.stride(1), alpha, N, CHUNK, C, sink, window,
               TILE=TILE, HAS_PICKS=picks is not None, PRECISE_EXP=not INTERPRET, HIST=hist0 is not None, NB=NB)
    return out


def score_penalty(scores: torch.Tensor, mask: torch.Tensor, hd: torch.Tensor, alpha: float, *,
                  picks: Optional[torch.Tensor] = None, chunk: int = 0, protect=None):
    """SCORE's penalised scores Ã, fp32 ``[B, H, N]`` (see the module docstring).

    ``scores`` ``[B, H, N]`` (fp32/fp16/bf16) and ``mask`` (U, int8 or bool ``[B, H, N]``, 1 = picked by
    the unpenalised selection) on one device; ``hd`` ``[B, H]`` (fp32/fp16/bf16, > 0; clamped to ≥ 1e-6);
    ``alpha`` ≥ 0; ``picks`` (optional, fp32 ``[B, N]``): every head's picks per token, to use instead of
    the sum over these heads (tensor parallel). ``chunk`` (tokens per program, 0 = automatic) changes the
    grid, never the result. ``protect=(sink, window)``: returns ``(Ã, hist0)`` where ``hist0`` is the
    shared select's first radix pass over Ã with those tokens protected (a ``select.Hist0`` for
    ``select_kv(..., hist0=)``), or None where the kernel does not run (the PyTorch body, tracing).
    """
    if not isinstance(scores, torch.Tensor) or scores.dtype not in FLOAT_DTYPES or scores.dim() != 3:
        raise TypeError(f"scores must be a float32/float16/bfloat16 tensor [B, H, N], got {getattr(scores, 'dtype', type(scores))} "
                        f"{tuple(getattr(scores, 'shape', ()))}")
    B, H, N = scores.shape
    if not isinstance(mask, torch.Tensor) or mask.dtype not in (torch.int8, torch.bool) or mask.shape != scores.shape:
        raise TypeError(f"mask must be an int8 or bool tensor shaped like scores {(B, H, N)}, got "
                        f"{getattr(mask, 'dtype', type(mask))} {tuple(getattr(mask, 'shape', ()))}")
    if not isinstance(hd, torch.Tensor) or hd.dtype not in FLOAT_DTYPES or hd.shape != (B, H):
        raise TypeError(f"hd must be a float32/float16/bfloat16 tensor [B, H] = {[B, H]}, got {getattr(hd, 'dtype', type(hd))} "
                        f"{tuple(getattr(hd, 'shape', ()))}")
    if picks is not None and (not isinstance(picks, torch.Tensor) or picks.shape != (B, N)):
        raise ValueError(f"picks must be a tensor [B, N] = {[B, N]}, got {tuple(getattr(picks, 'shape', ()))}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha >= 0:
        raise ValueError(f"alpha must be a float >= 0, got {alpha!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise ValueError(f"chunk must be a non-negative int (0 = automatic), got {chunk!r}")
    for name, t in (("mask", mask), ("hd", hd), ("picks", picks)):
        if t is not None and t.device != scores.device:
            raise ValueError(f"{name} must be on the device of scores ({scores.device}), got {t.device}")
    return _penalty(scores.contiguous(), mask.view(torch.int8).contiguous(), hd, float(alpha),
                    None if picks is None else picks.to(torch.float32).contiguous(), chunk, protect)


def _penalty(scores, mask, hd, alpha: float, picks, chunk: int, protect):
    """``score_penalty`` on checked arguments (contiguous scores, mask and picks): the policy's entry point."""
    h0 = None
    if (protect is not None and use_triton(scores) and not torch.compiler.is_compiling()
            and type(scores) is torch.Tensor and scores.numel() > 0):
        B, H, N = scores.shape
        h0 = Hist0(hist0_buffer(B * H, cdiv(N, _blocks(N, B * H, chunk or None)[0]), scores.device), *protect)
    out = score_penalty_op(scores, mask, picks, hd, alpha, chunk, None if h0 is None else h0.hist,
                           *(protect or (0, 0)))
    return out if protect is None else (out, h0)
