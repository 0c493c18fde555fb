"""Knorm: the negated L2 norm of each key (Devoto et al.; ``docs/algorithms.md`` §1.1).

    s_i = −‖k_i‖₂      (accumulated in fp32: a bf16 norm ties distinct tokens)

One launch on a grid (token chunks, B·H_kv rows), so a long row splits over many programs. Each
program streams its chunk in ``[TILE, BLOCK_D]`` tiles of the strided ``[B, H, N, D]`` keys (last
dim unit-stride, int64 offsets) and writes fp32 scores ``[B, H, N]``. With ``protect=(sink,
window)`` it also counts the shared select's first radix pass (``select.score_hist0``) and
registers it with the scores (``select.remember_pass0``), so the select that follows runs one pass
fewer. ``CHUNK`` is a runtime argument: a new N compiles nothing. On the CPU (outside the
interpreter) the op runs ``_knorm_torch``, the same formula in PyTorch.

``token_blocks`` and ``_load_keys`` are shared with the KeyDiff kernels (``kernels/keydiff.py``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INTERPRET, check_kv_tensor, launch, next_pow2, row_major, triton_op, use_triton
from .select import NB, add_hist0, pass0_buffer, remember_pass0, score_hist0


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


@triton.jit(do_not_specialize=["CHUNK", "sink", "window"])
def _knorm_kernel(k_ptr, out_ptr, hist_ptr, H, skb, skh, skn, N, D, CHUNK, sink, window,
                  TILE: tl.constexpr, BLOCK_D: tl.constexpr, HIST: tl.constexpr, NB: tl.constexpr):
    c = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    acc = tl.zeros([NB], dtype=tl.int32)
    for t0 in range(0, CHUNK, TILE):
        k, offs, mask = _load_keys(k_ptr, r, H, skb, skh, skn, N, D, c, t0, CHUNK, TILE, BLOCK_D)
        s = 0.0 - tl.sqrt_rn(tl.sum(k * k, 1))
        tl.store(out_ptr + r * N + offs, s, mask=mask)
        if HIST:
            acc += score_hist0(s, offs, mask, N, sink, window, NB)
    if HIST:
        add_hist0(hist_ptr, r, acc, NB)


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
    squares summed without rescaling, as the kernel: a key whose square overflows scores −inf; a
    NaN scores NaN; a zero key +0)."""
    return 0.0 - torch.linalg.vector_norm(keys, dim=-1, dtype=torch.float32)


@triton_op("tritonkv::knorm_score", mutates_args={"hist"})
def knorm_score_op(keys: torch.Tensor, chunk: int, hist: torch.Tensor, sink: int, window: int) -> torch.Tensor:
    """The raw op: keys ``[B, H, N, D]`` (last dim unit-stride) -> fp32 ``[B, H, N]``. ``hist``: empty,
    or a zeroed int32 ``[B·H, 3, NB]`` into which the kernels add the select's first radix pass
    (``sink``/``window`` protected); the PyTorch body leaves it alone."""
    if not use_triton(keys):
        return _knorm_torch(keys)
    B, H, N, D = keys.shape
    out = torch.empty((B, H, N), dtype=torch.float32, device=keys.device)
    if N > 0 and B * H > 0:
        cfg = token_blocks(N, B * H, D, chunk)
        launch(_knorm_kernel, (triton.cdiv(N, cfg["CHUNK"]), B * H), keys, out, hist, H,
               keys.stride(0), keys.stride(1), keys.stride(2), N, D, sink=sink, window=window,
               HIST=hist.numel() > 0, NB=NB, **cfg)
    return out


def pass0_wanted(keys: torch.Tensor, protect) -> bool:
    """Whether a scoring call with ``protect`` should count the select's first pass: the Triton
    kernels run, eagerly, on a non-empty cache."""
    return (protect is not None and use_triton(keys) and not torch.compiler.is_compiling()
            and type(keys) is torch.Tensor and keys.numel() > 0)


def knorm_scores(keys: torch.Tensor, *, chunk: int = 0, protect=None) -> torch.Tensor:
    """Knorm scores ``−‖k_i‖₂``, fp32 ``[B, H_kv, N]`` (higher = keep, so small-norm keys are kept).

    ``keys`` ``[B, H_kv, N, D]`` in fp32/fp16/bf16, any strides. ``chunk`` (tokens per program,
    0 = automatic) changes the grid, never the result. ``protect=(sink, window)``: the kernel also
    counts the shared select's first radix pass with those tokens protected, for the next
    ``select_kv`` of the returned scores with the same sink and window (it then skips that pass;
    the kept tokens are the same either way).
    """
    _check_keys(keys)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise ValueError(f"chunk must be a non-negative int (0 = automatic), got {chunk!r}")
    keys = row_major(keys)
    if not pass0_wanted(keys, protect):
        return knorm_score_op(keys, chunk, keys.new_empty(0, dtype=torch.int32), 0, 0)
    sink, window = protect
    hist = pass0_buffer(keys.shape[0] * keys.shape[1], keys.device)
    out = knorm_score_op(keys, chunk, hist, sink, window)
    remember_pass0(out, hist, sink, window)
    return out
