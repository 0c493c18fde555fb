"""KeyDiff: negative cosine similarity of each key to the anchor (KeyDiff §3.2, Eqs. 7–8,
App. B.1; ``docs/algorithms.md`` §1.2).

    k̂_i = k_i / max(‖k_i‖, 1e-12)
    a   = (1/n) Σ_i k̂_i                      ("normalized", default)   or   (1/n) Σ_i k_i   ("raw")
    s_i = −(a·k_i) / max(‖a‖·‖k_i‖, 1e-8)    clamped to [−1, 1]

Non-finite keys never poison a row: a key with a NaN or ±inf element scores NaN (ranks lowest) and
is left out of the anchor, whose sums and count n run over the finite keys only, so every other
score is what it would be with that token absent.

The anchor is a reduction over the whole row, so scoring takes two launches on the same grid
(token chunks, B·H_kv rows), which lets a long row split over many programs:

1. ``_keydiff_anchor_kernel``: each chunk writes its partial sum of (normalised) finite keys and
   their count to an fp32 ``[R, C, D + 1]`` buffer — no float atomics, so the result does not
   depend on program order;
2. ``_keydiff_score_kernel``: each program sums the row's C partials in a fixed order (every
   program of a row gets the same anchor, bit for bit), then scores its chunk. It walks the grid
   backwards, so it starts on the chunks the first launch read last (still in L2 on the GPU).

The kernel boundary is the row-wide barrier. Keys are read twice; scores are fp32 ``[B, H, N]``.
With ``protect=(sink, window)`` the second launch also writes the shared select's first radix pass
over its scores (``select.hist0_of_chunk``, on a 1-D re-read of the chunk's stored scores), returned
as a ``select.Hist0``: the select that follows runs one launch fewer. ``CHUNK`` and ``C`` are runtime
arguments: a new N compiles nothing. On the CPU (outside the interpreter) the op runs
``_keydiff_torch``, the same formula in PyTorch.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import cdiv, finite_rows, launch, pdl_wait, row_major, triton_op, use_triton
from . import knorm
from .knorm import _check_keys, _load_keys, hist_tile, nonfinite, score_hist0, token_blocks
from .select import NB, hist0_of_chunk

ANCHORS = ("normalized", "raw")


@triton.jit(do_not_specialize=["C", "CHUNK"])
def _keydiff_anchor_kernel(k_ptr, part_ptr, H, skb, skh, skn, N, D, C, CHUNK,
                           TILE: tl.constexpr, BLOCK_D: tl.constexpr, STAGES: tl.constexpr, NORMALIZE: tl.constexpr,
                           PDL: tl.constexpr):
    pdl_wait(PDL)
    c = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    acc = tl.zeros([TILE, BLOCK_D], dtype=tl.float32)  # reduced over tokens once, at the end
    n = tl.zeros([TILE], dtype=tl.float32)
    for t0 in tl.range(0, CHUNK, TILE, num_stages=STAGES):
        k, offs, mask = _load_keys(k_ptr, r, H, skb, skh, skn, N, D, c, t0, CHUNK, TILE, BLOCK_D)
        finite = mask & (nonfinite(k) == 0)  # NaN != 0: non-finite keys stay out of the anchor
        k = tl.where(finite[:, None], k, 0.0)
        if NORMALIZE:
            k = k / tl.maximum(tl.sqrt_rn(tl.sum(k * k, 1)), 1e-12)[:, None]
        acc += k
        n += finite.to(tl.float32)
    d = tl.arange(0, BLOCK_D)
    row = part_ptr + (r * C + c) * (D + 1)
    tl.store(row + d, tl.sum(acc, 0), mask=d < D)
    tl.store(row + D, tl.sum(n, 0))


@triton.jit(do_not_specialize=["C", "CHUNK", "sink", "window"])
def _keydiff_score_kernel(k_ptr, part_ptr, out_ptr, h0_ptr, H, skb, skh, skn, N, D, C, CHUNK, sink, window,
                          TILE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
                          HIST: tl.constexpr, NB: tl.constexpr, HIST_TILE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    c = tl.num_programs(0) - 1 - tl.program_id(0)
    r = (tl.num_programs(1) - 1 - tl.program_id(1)).to(tl.int64)
    # the anchor: the row's chunk partials summed in a fixed order, then the mean over finite keys
    d = tl.arange(0, BLOCK_D)
    a = tl.zeros([BLOCK_D], dtype=tl.float32)
    n = tl.zeros([BLOCK_C], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cc = c0 + tl.arange(0, BLOCK_C)
        row = part_ptr + (r * C + cc) * (D + 1)
        p = tl.load(row[:, None] + d[None, :], mask=(cc < C)[:, None] & (d < D)[None, :], other=0.0)
        a += tl.sum(p, 0)
        n += tl.load(row + D, mask=cc < C, other=0.0)
    a = a / tl.maximum(tl.sum(n, 0), 1.0)
    a_norm = tl.sqrt_rn(tl.sum(a * a, 0))
    # The next tile is loaded before this one is scored (a tile in flight while one is reduced). Not Triton's
    # pipelining (``STREAM_STAGES``): from a shared-memory tile it loads the keys a second time, in the anchor's
    # layout, for the dot product (Triton 3.6: 188 registers, 1333 instructions a step against 80 and 418).
    end = tl.minimum(N, (c + 1) * CHUNK)  # the prefetch past the chunk's last tile reads nothing
    nxt, _, _ = _load_keys(k_ptr, r, H, skb, skh, skn, end, D, c, 0, CHUNK, TILE, BLOCK_D)
    for t0 in range(0, CHUNK, TILE):
        k = nxt
        offs = c * CHUNK + t0 + tl.arange(0, TILE)
        mask = offs < N
        nxt, _, _ = _load_keys(k_ptr, r, H, skb, skh, skn, end, D, c, t0 + TILE, CHUNK, TILE, BLOCK_D)
        dot = tl.sum(k * a[None, :], 1)
        k_norm = tl.sqrt_rn(tl.sum(k * k, 1))
        s = 0.0 - dot / tl.maximum(a_norm * k_norm, 1e-8)  # 0.0 - x: a zero key scores +0
        s = tl.minimum(tl.maximum(s, -1.0, propagate_nan=tl.PropagateNan.ALL), 1.0,
                       propagate_nan=tl.PropagateNan.ALL) + nonfinite(k)  # a non-finite key scores NaN
        tl.store(out_ptr + r * N + offs, s, mask=mask)
    if HIST:  # the select's pass 0 over the scores just stored, on a 1-D layout
        tl.debug_barrier()
        hist0_of_chunk(out_ptr + r * N, out_ptr, h0_ptr, r, c, C, N, CHUNK, sink, window, HIST_TILE, NB, False)


def _keydiff_torch(keys: torch.Tensor, normalize: bool) -> torch.Tensor:
    """The op's CPU body, in fp32: per-key norms (one reduction over D), the anchor as one batched
    mat-vec ``Σ_i w_i k_i / n`` over the n finite keys (w_i = 1 / max(‖k_i‖, 1e-12), or 1 for the raw
    anchor; non-finite keys weigh 0), the dot products ``k_i·a`` as another, then the kernel's
    ``0 − dot / max(‖a‖·‖k_i‖, 1e-8)`` clamped to [−1, 1]; a key with a non-finite element scores NaN;
    a zero key +0."""
    k = keys.float()
    k_norm = torch.linalg.vector_norm(k, dim=-1)  # [B, H, N]
    finite, every = finite_rows(k, k_norm)  # [B, H, N]
    if not every:  # some key is not finite: zero it, for the norms and the anchor
        k = torch.where(finite[..., None], k, 0.0)
        k_norm = torch.linalg.vector_norm(k, dim=-1)
    w = 1.0 / k_norm.clamp_min(1e-12) if normalize else torch.ones_like(k_norm)
    w = w if every else torch.where(finite, w, 0.0)
    n = finite.sum(-1, keepdim=True).clamp_min(1).to(torch.float32)[..., None]  # [B, H, 1, 1]
    a = (w.unsqueeze(-2) @ k) / n  # [B, H, 1, D]
    dot = (k @ a.transpose(-1, -2)).squeeze(-1)  # [B, H, N]
    a_norm = torch.linalg.vector_norm(a, dim=-1)  # [B, H, 1]
    s = (0.0 - dot / (a_norm * k_norm).clamp_min(1e-8)).clamp(-1.0, 1.0)
    return s if every else torch.where(finite, s, float("nan"))


@triton_op("tritonkv::keydiff_score", mutates_args={"hist0"})
def keydiff_score_op(keys: torch.Tensor, normalize: bool, chunk: int, hist0: Optional[torch.Tensor], sink: int,
                     window: int) -> torch.Tensor:
    """The raw op: keys ``[B, H, N, D]`` (last dim unit-stride) -> fp32 ``[B, H, N]``. ``hist0``: None,
    or an int32 ``[B·H, 1 + C, NB]`` (C = the launch's chunks per row) that the kernels fill with the
    select's first radix pass (``sink``/``window`` protected); the PyTorch body leaves it alone."""
    if not use_triton(keys):
        return _keydiff_torch(keys, normalize)
    B, H, N, D = keys.shape
    R = B * H
    out = torch.empty((B, H, N), dtype=torch.float32, device=keys.device)
    if N > 0 and R > 0:
        cfg = token_blocks(N, R, D, chunk)
        C = cdiv(N, cfg["CHUNK"])
        part = torch.empty((R, C, D + 1), dtype=torch.float32, device=keys.device)
        strides = (keys.stride(0), keys.stride(1), keys.stride(2))
        launch(_keydiff_anchor_kernel, (C, R), keys, part, H, *strides, N, D, C, NORMALIZE=normalize,
               STAGES=knorm.STREAM_STAGES, **cfg)
        launch(_keydiff_score_kernel, (C, R), keys, part, out, out if hist0 is None else hist0, H, *strides, N, D, C,
               sink=sink, window=window, BLOCK_C=max(1, 4096 // cfg["BLOCK_D"]), HIST=hist0 is not None, NB=NB,
               HIST_TILE=hist_tile(cfg["num_warps"]), **cfg)
    return out


def keydiff_scores(keys: torch.Tensor, *, anchor: str = "normalized", chunk: int = 0, protect=None):
    """KeyDiff scores ``−cos(k_i, a)``, fp32 ``[B, H_kv, N]`` in [−1, 1] (higher = keep: the keys
    least like the anchor are kept); NaN for a key with a non-finite element.

    ``anchor``: ``"normalized"`` (mean of the unit keys, the default as in Table 15 and kvpress) or
    ``"raw"`` (mean of the keys themselves, §3.2). The anchor spans the row's finite keys.
    ``chunk`` (tokens per program, 0 = automatic) changes the grid; the anchor's fp32 summation
    order follows it, so scores may move in the last bits. ``protect=(sink, window)``: returns
    ``(scores, hist0)`` where ``hist0`` is the shared select's first radix pass over these scores
    with those tokens protected (a ``select.Hist0`` for ``select_kv(..., hist0=)``), or None where
    the kernels do not run (the PyTorch body, tracing).
    """
    _check_keys(keys)
    if anchor not in ANCHORS:
        raise ValueError(f"anchor must be one of {ANCHORS}, got {anchor!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise ValueError(f"chunk must be a non-negative int (0 = automatic), got {chunk!r}")
    keys = row_major(keys)
    cfg = token_blocks(keys.shape[2], keys.shape[0] * keys.shape[1], keys.shape[3], chunk)
    h0 = score_hist0(keys, protect, cfg)
    out = keydiff_score_op(keys, anchor == "normalized", chunk, None if h0 is None else h0.hist,
                           *((h0.sink, h0.window) if h0 else (0, 0)))
    return out if protect is None else (out, h0)
