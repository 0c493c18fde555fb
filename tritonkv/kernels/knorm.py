"""Knorm: the negated L2 norm of each key (Devoto et al.; ``docs/algorithms.md`` §1.1).

    s_i = −‖k_i‖₂      (accumulated in fp32: a bf16 norm ties distinct tokens)

A key with a non-finite element (NaN, ±inf) scores NaN, which ranks lowest.

One launch on a grid (token chunks, B·H_kv rows), so a long row splits over many programs. Each
program streams its chunk in ``[TILE, BLOCK_D]`` tiles of the strided ``[B, H, N, D]`` keys (last
dim unit-stride, int64 offsets) and writes fp32 scores ``[B, H, N]``. With ``protect=(sink,
window)`` each program then re-reads its chunk's scores (L1/L2) in 1-D tiles and writes the shared
select's first radix pass for them (``select.hist0_of_chunk``), returned as a ``select.Hist0`` for
``select_kv(..., hist0=)``: the select then runs one launch fewer. ``CHUNK`` is a runtime argument:
a new N compiles nothing. On the CPU (outside the interpreter) the op runs ``_knorm_torch``, the
same formula in PyTorch.

``token_blocks``, ``_load_keys`` and ``nonfinite`` are shared with the KeyDiff kernels
(``kernels/keydiff.py``).
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from typing import Optional

from ._common import (INTERPRET, cdiv, check_kv_tensor, host_cache, launch, next_pow2, pdl_wait, row_major,
                      triton_op, use_triton)
from .select import NB, Hist0, hist0_buffer, hist0_of_chunk


@triton.jit
def _load_keys(k_ptr, r, H, skb, skh, skn, N, D, c, t0, CHUNK, TILE: tl.constexpr, BLOCK_D: tl.constexpr):
    """One fp32 tile ``[TILE, BLOCK_D]`` of row ``r`` (int64) at tokens ``c·CHUNK + t0 + [0, TILE)``;
    zeros outside the row. Returns ``(tile, token offsets, token mask)``."""
    offs = c * CHUNK + t0 + tl.arange(0, TILE)
    mask = offs < N
    d = tl.arange(0, BLOCK_D)
    ptr = k_ptr + (r // H) * skb + (r % H) * skh + offs.to(tl.int64)[:, None] * skn + d[None, :]
    k = tl.load(ptr, mask=mask[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
    return k, offs, mask


@triton.jit
def nonfinite(k):
    """Per token of an fp32 tile ``[TILE, BLOCK_D]``: NaN where the key has a non-finite element, else 0
    (``k·0`` is NaN exactly for ±inf and NaN): added to a score, it makes that score NaN."""
    return tl.sum(k * 0.0, 1)


@triton.jit(do_not_specialize=["CHUNK", "C0", "sink", "window"])
def _knorm_kernel(k_ptr, out_ptr, h0_ptr, H, skb, skh, skn, N, D, CHUNK, C0, sink, window,
                  TILE: tl.constexpr, BLOCK_D: tl.constexpr, STAGES: tl.constexpr, HIST: tl.constexpr,
                  NB: tl.constexpr, HIST_TILE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    c = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    for t0 in tl.range(0, CHUNK, TILE, num_stages=STAGES):
        k, offs, mask = _load_keys(k_ptr, r, H, skb, skh, skn, N, D, c, t0, CHUNK, TILE, BLOCK_D)
        s = 0.0 - tl.sqrt_rn(tl.sum(k * k, 1)) + nonfinite(k)
        tl.store(out_ptr + r * N + offs, s, mask=mask)
    if HIST:  # the select's pass 0 over the scores just stored, on a 1-D layout
        tl.debug_barrier()
        hist0_of_chunk(out_ptr + r * N, out_ptr, h0_ptr, r, c, C0, N, CHUNK, sink, window, HIST_TILE, NB, False)


# Software-pipelined stages of the key-streaming loops (``tl.range(num_stages=)``): the loads of the next
# STREAM_STAGES - 1 tiles are in flight (cp.async into shared memory) while a tile is reduced. Without it (1) a
# program has one 16 KB tile in flight, issued at the top of each step, and two programs per SM keep too few bytes
# in flight to stream HBM (the H100 run of 2026-11-26: Knorm's kernel at ~1.9 TB/s of ~3).
STREAM_STAGES = 3


@host_cache(1024)  # pure; called on every launch (the result is shared: read only)
def token_blocks(n: int, rows: int, d: int, chunk: int = 0) -> dict:
    """Launch configuration of a token-streaming kernel: ``CHUNK`` tokens per program (a power of
    two; a runtime argument of the kernels), ``TILE`` tokens per loop step, ``BLOCK_D`` = next_pow2(d), ``num_warps``.

    Under the interpreter (~0.5 ms per program, one numpy call per op) one program per row with
    whole-row tiles; on the GPU ~64·128-element tiles and enough chunks for about two waves of 132
    SMs when rows are few (B·H_kv = 8 is the common case). ``chunk`` (> 0) forces the chunk size.
    """
    block_d = next_pow2(d)
    if INTERPRET:
        tile = min(next_pow2(n), max(16, 4096 * 128 // block_d))
        chunk = chunk or tile
    else:
        tile = max(16, 8192 // block_d)
        if not chunk:
            want = max(1, -(-264 // max(rows, 1)))
            chunk = min(max(next_pow2(-(-n // want)), tile), 16384)
    chunk = next_pow2(chunk)
    return dict(CHUNK=chunk, TILE=min(tile, chunk), BLOCK_D=block_d,
                num_warps=4 if min(tile, chunk) * block_d <= 4096 else 8)


def _check_keys(keys) -> None:
    check_kv_tensor("keys", keys)
    if keys.shape[-1] < 1:
        raise ValueError(f"keys must have a head dim >= 1, got shape {tuple(keys.shape)}")


def _knorm_torch(keys: torch.Tensor) -> torch.Tensor:
    """The op's CPU body: ``0 − ‖k_i‖₂`` as one fp32 reduction over D (the keys cast to fp32 first,
    squares summed without rescaling, as the kernel: a finite key whose square overflows scores
    −inf; a key with a NaN or ±inf element NaN; a zero key +0)."""
    s = 0.0 - torch.linalg.vector_norm(keys, dim=-1, dtype=torch.float32)
    return torch.where(torch.isfinite(keys).all(-1), s, float("nan"))


def hist_tile(num_warps: int) -> int:
    """Elements per step of a scoring kernel's pass-0 histogram: four per thread (a 1-D tile is
    never replicated), a whole row under the interpreter."""
    return 4096 if INTERPRET else 128 * num_warps


def score_hist0(keys: torch.Tensor, protect, cfg: dict) -> Optional[Hist0]:
    """A ``Hist0`` buffer for a scoring launch of ``cfg`` (``token_blocks``) that should count the
    select's first pass with ``protect=(sink, window)``, or None: no protection asked for, the
    PyTorch body runs, or the call is traced (the select then counts the pass itself)."""
    if (protect is None or not use_triton(keys) or torch.compiler.is_compiling() or type(keys) is not torch.Tensor
            or keys.numel() == 0):
        return None
    R, N = keys.shape[0] * keys.shape[1], keys.shape[2]
    return Hist0(hist0_buffer(R, -(-N // cfg["CHUNK"]), keys.device), *protect)


@triton_op("tritonkv::knorm_score", mutates_args={"hist0"})
def knorm_score_op(keys: torch.Tensor, chunk: int, hist0: Optional[torch.Tensor], sink: int,
                   window: int) -> torch.Tensor:
    """The raw op: keys ``[B, H, N, D]`` (last dim unit-stride) -> fp32 ``[B, H, N]``. ``hist0``: None,
    or an int32 ``[B·H, 1 + C, NB]`` (C = the launch's chunks per row) that the kernel fills with the
    select's first radix pass (``sink``/``window`` protected); the PyTorch body leaves it alone."""
    if not use_triton(keys):
        return _knorm_torch(keys)
    B, H, N, D = keys.shape
    out = torch.empty((B, H, N), dtype=torch.float32, device=keys.device)
    if N > 0 and B * H > 0:
        cfg = token_blocks(N, B * H, D, chunk)
        C = cdiv(N, cfg["CHUNK"])
        launch(_knorm_kernel, (C, B * H), keys, out, out if hist0 is None else hist0, H,
               keys.stride(0), keys.stride(1), keys.stride(2), N, D, C0=C, sink=sink, window=window,
               HIST=hist0 is not None, NB=NB, HIST_TILE=hist_tile(cfg["num_warps"]), STAGES=STREAM_STAGES, **cfg)
    return out


def knorm_scores(keys: torch.Tensor, *, chunk: int = 0, protect=None):
    """Knorm scores ``−‖k_i‖₂``, fp32 ``[B, H_kv, N]`` (higher = keep, so small-norm keys are kept);
    NaN for a key with a non-finite element.

    ``keys`` ``[B, H_kv, N, D]`` in fp32/fp16/bf16, any strides. ``chunk`` (tokens per program,
    0 = automatic) changes the grid, never the result. ``protect=(sink, window)``: returns
    ``(scores, hist0)`` where ``hist0`` is the shared select's first radix pass over these scores
    with those tokens protected (a ``select.Hist0`` for ``select_kv(..., hist0=)``), or None where
    the kernels do not run (the PyTorch body, tracing).
    """
    _check_keys(keys)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise ValueError(f"chunk must be a non-negative int (0 = automatic), got {chunk!r}")
    keys = row_major(keys)
    cfg = token_blocks(keys.shape[2], keys.shape[0] * keys.shape[1], keys.shape[3], chunk)
    h0 = score_hist0(keys, protect, cfg)
    out = knorm_score_op(keys, chunk, None if h0 is None else h0.hist, *((h0.sink, h0.window) if h0 else (0, 0)))
    return out if protect is None else (out, h0)
