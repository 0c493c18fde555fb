"""KeyDiff: negative cosine similarity of each key to the anchor (KeyDiff §3.2, Eqs. 7–8,
App. B.1; ``docs/algorithms.md`` §1.2).

    k̂_i = k_i / max(‖k_i‖, 1e-12)
    a   = (1/n) Σ_i k̂_i                      ("normalized", default)   or   (1/n) Σ_i k_i   ("raw")
    s_i = −(a·k_i) / max(‖a‖·‖k_i‖, 1e-8)    clamped to [−1, 1]

The anchor is a reduction over the whole row, so scoring takes two launches on the same grid
(token chunks, B·H_kv rows), which lets a long row split over many programs:

1. ``_keydiff_anchor_kernel``: each chunk writes its partial sum of (normalised) keys to an fp32
   ``[R, C, D]`` buffer — no float atomics, so the result does not depend on program order;
2. ``_keydiff_score_kernel``: each program sums the row's C partials in a fixed order (every
   program of a row gets the same anchor, bit for bit), then scores its chunk. It walks the grid
   backwards, so it starts on the chunks the first launch read last (still in L2 on the GPU).

The kernel boundary is the row-wide barrier. Keys are read twice; scores are fp32 ``[B, H, N]``.
With ``protect=(sink, window)`` the first launch also zeroes a select histogram and the second
counts the select's first radix pass into it (``select.score_hist0``), registered with the scores
(``select.remember_pass0``): the select that follows runs one pass fewer and needs no zero-fill.
``CHUNK`` and ``C`` are runtime arguments: a new N compiles nothing.
On the CPU (outside the interpreter) the op runs ``_keydiff_torch``, the same formula in PyTorch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import launch, row_major, triton_op, use_triton
from .knorm import _check_keys, _load_keys, pass0_wanted, token_blocks
from .select import NB, add_hist0, pass0_buffer, remember_pass0, score_hist0, zero_hist

ANCHORS = ("normalized", "raw")


@triton.jit(do_not_specialize=["C", "CHUNK"])
def _keydiff_anchor_kernel(k_ptr, part_ptr, hist_ptr, H, skb, skh, skn, N, D, C, CHUNK,
                           TILE: tl.constexpr, BLOCK_D: tl.constexpr, NORMALIZE: tl.constexpr,
                           HIST: tl.constexpr, NB: tl.constexpr):
    c = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    if HIST:  # the select histogram the next launch adds into
        zero_hist(hist_ptr, r, c, C, NB, 256)
    acc = tl.zeros([TILE, BLOCK_D], dtype=tl.float32)  # reduced over tokens once, at the end
    for t0 in range(0, CHUNK, TILE):
        k, offs, mask = _load_keys(k_ptr, r, H, skb, skh, skn, N, D, c, t0, CHUNK, TILE, BLOCK_D)
        if NORMALIZE:
            k = k / tl.maximum(tl.sqrt_rn(tl.sum(k * k, 1)), 1e-12)[:, None]
        acc += k
    d = tl.arange(0, BLOCK_D)
    tl.store(part_ptr + (r * C + c) * D + d, tl.sum(acc, 0), mask=d < D)


@triton.jit(do_not_specialize=["C", "CHUNK", "sink", "window"])
def _keydiff_score_kernel(k_ptr, part_ptr, out_ptr, hist_ptr, H, skb, skh, skn, N, D, C, CHUNK, sink, window,
                          TILE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
                          HIST: tl.constexpr, NB: tl.constexpr):
    c = tl.num_programs(0) - 1 - tl.program_id(0)
    r = (tl.num_programs(1) - 1 - tl.program_id(1)).to(tl.int64)
    # the anchor: the row's chunk partials summed in a fixed order, then the mean
    d = tl.arange(0, BLOCK_D)
    a = tl.zeros([BLOCK_D], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cc = c0 + tl.arange(0, BLOCK_C)
        p = tl.load(part_ptr + (r * C + cc)[:, None] * D + d[None, :],
                    mask=(cc < C)[:, None] & (d < D)[None, :], other=0.0)
        a += tl.sum(p, 0)
    a = a / N
    a_norm = tl.sqrt_rn(tl.sum(a * a, 0))
    acc = tl.zeros([NB], dtype=tl.int32)
    for t0 in range(0, CHUNK, TILE):
        k, offs, mask = _load_keys(k_ptr, r, H, skb, skh, skn, N, D, c, t0, CHUNK, TILE, BLOCK_D)
        dot = tl.sum(k * a[None, :], 1)
        k_norm = tl.sqrt_rn(tl.sum(k * k, 1))
        s = 0.0 - dot / tl.maximum(a_norm * k_norm, 1e-8)  # 0.0 - x: a zero key scores +0
        s = tl.minimum(tl.maximum(s, -1.0, propagate_nan=tl.PropagateNan.ALL), 1.0,
                       propagate_nan=tl.PropagateNan.ALL)  # a NaN score stays NaN
        tl.store(out_ptr + r * N + offs, s, mask=mask)
        if HIST:
            acc += score_hist0(s, offs, mask, N, sink, window, NB)
    if HIST:
        add_hist0(hist_ptr, r, acc, NB)


def _keydiff_torch(keys: torch.Tensor, normalize: bool) -> torch.Tensor:
    """The op's CPU body, in fp32: per-key norms (one reduction over D), the anchor as one batched
    mat-vec ``Σ_i w_i k_i / N`` (w_i = 1 / max(‖k_i‖, 1e-12), or 1 for the raw anchor), the dot
    products ``k_i·a`` as another, then the kernel's ``0 − dot / max(‖a‖·‖k_i‖, 1e-8)`` clamped to
    [−1, 1]. NaN propagates as in the kernel: a NaN or ±inf key (inf·0 = NaN in the anchor) makes
    the whole row NaN; a zero key scores +0."""
    k = keys.float()
    k_norm = torch.linalg.vector_norm(k, dim=-1)  # [B, H, N]
    w = 1.0 / k_norm.clamp_min(1e-12) if normalize else torch.ones_like(k_norm)
    a = (w.unsqueeze(-2) @ k) / keys.shape[2]  # [B, H, 1, D]
    dot = (k @ a.transpose(-1, -2)).squeeze(-1)  # [B, H, N]
    a_norm = torch.linalg.vector_norm(a, dim=-1)  # [B, H, 1]
    s = 0.0 - dot / (a_norm * k_norm).clamp_min(1e-8)
    return s.clamp(-1.0, 1.0)  # clamp keeps NaN


@triton_op("tritonkv::keydiff_score", mutates_args={"hist"})
def keydiff_score_op(keys: torch.Tensor, normalize: bool, chunk: int, hist: torch.Tensor, sink: int,
                     window: int) -> torch.Tensor:
    """The raw op: keys ``[B, H, N, D]`` (last dim unit-stride) -> fp32 ``[B, H, N]``. ``hist``: empty,
    or an int32 ``[B·H, 3, NB]`` (any contents) that the kernels zero and into which they add the
    select's first radix pass (``sink``/``window`` protected); the PyTorch body leaves it alone."""
    if not use_triton(keys):
        return _keydiff_torch(keys, normalize)
    B, H, N, D = keys.shape
    R = B * H
    out = torch.empty((B, H, N), dtype=torch.float32, device=keys.device)
    if N > 0 and R > 0:
        cfg = token_blocks(N, R, D, chunk)
        C = triton.cdiv(N, cfg["CHUNK"])
        part = torch.empty((R, C, D), dtype=torch.float32, device=keys.device)
        strides = (keys.stride(0), keys.stride(1), keys.stride(2))
        has_hist = hist.numel() > 0
        launch(_keydiff_anchor_kernel, (C, R), keys, part, hist, H, *strides, N, D, C, NORMALIZE=normalize,
               HIST=has_hist, NB=NB, **cfg)
        launch(_keydiff_score_kernel, (C, R), keys, part, out, hist, H, *strides, N, D, C, sink=sink, window=window,
               BLOCK_C=max(1, 4096 // cfg["BLOCK_D"]), HIST=has_hist, NB=NB, **cfg)
    return out


def keydiff_scores(keys: torch.Tensor, *, anchor: str = "normalized", chunk: int = 0, protect=None) -> torch.Tensor:
    """KeyDiff scores ``−cos(k_i, a)``, fp32 ``[B, H_kv, N]`` in [−1, 1] (higher = keep: the keys
    least like the anchor are kept).

    ``anchor``: ``"normalized"`` (mean of the unit keys, the default as in Table 15 and kvpress) or
    ``"raw"`` (mean of the keys themselves, §3.2). The anchor spans all N tokens of the row.
    ``chunk`` (tokens per program, 0 = automatic) changes the grid; the anchor's fp32 summation
    order follows it, so scores may move in the last bits. ``protect=(sink, window)``: the kernels
    also count the shared select's first radix pass with those tokens protected, for the next
    ``select_kv`` of the returned scores with the same sink and window (it then skips that pass; the
    kept tokens are the same either way).
    """
    _check_keys(keys)
    if anchor not in ANCHORS:
        raise ValueError(f"anchor must be one of {ANCHORS}, got {anchor!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise ValueError(f"chunk must be a non-negative int (0 = automatic), got {chunk!r}")
    keys = row_major(keys)
    if not pass0_wanted(keys, protect):
        return keydiff_score_op(keys, anchor == "normalized", chunk, keys.new_empty(0, dtype=torch.int32), 0, 0)
    sink, window = protect
    hist = pass0_buffer(keys.shape[0] * keys.shape[1], keys.device, zeroed=False)  # the anchor kernel zeroes it
    out = keydiff_score_op(keys, anchor == "normalized", chunk, hist, sink, window)
    remember_pass0(out, hist, sink, window)
    return out
