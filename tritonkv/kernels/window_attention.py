"""Window attention: the score kernel of SnapKV, TOVA, H2O-style and SurfaceLogicKV selection
(``docs/algorithms.md`` §1.4).

The last W queries Q_w ``[B, H_q, W, D]`` (positions p_i = N − W + i, RoPE applied) attend to all
keys ``[B, H_kv, N, D]``, causally inside the window:

    P[q,i,j] = exp(τ·q_i·k_j − lse[q,i])   for j ≤ p_i       (τ = 1/√D unless ``scale`` is given)
    u[q,j]   = (1/W) Σ_i P[q,i,j]                            (``row_reduce="sum"``: Σ_i, H2O)
    u[h,j]   = mean_{q∈G(h)} u[q,j]                          (``head_reduce="max"``: max;
                                                              ``"layer"``: mean over all H_q heads)
    s[h,·]   = pool_κ(u[h,·]) over [0, N−W), stride 1, padding κ//2

``pool="max"`` ignores the padding, ``pool="avg"`` counts it as zeros (divides by κ). The G query
heads are reduced *before* pooling. Window positions [N−W, N) keep their unpooled u (the attention
they receive from the window rows that see them); policies protect them. Query rows at negative
positions (W > N) see no key and add nothing.

Non-finite inputs (``docs/contracts.md``): a key with a NaN or ±inf element is masked out of every
softmax (P = 0) and its u is NaN, a hole in its neighbours' pool; a query row with one (or with a
non-finite given LSE) is left out: the row mean divides by the rows left in of its head, the group
mean by the heads with a row left in. The kernels flag a key from the logits they compute anyway: with
a finite query, q·k is finite exactly when k is (x·0 = 0 only for finite x), so no reduction over a key
tile is needed. Given ``values`` (a policy that reads them: CriticalKV's base), the same kernels
load each key tile's values too and treat a token with a non-finite value as a non-finite key.
The row weights, with the means folded in, come from the query block in registers when one block
holds a head's rows (else ``row_weights``, ``[B, H_q, W]``: small torch ops), and
P·w = exp(τ·q·k − (lse − ln w)), so the reductions cost nothing per key.

Per (key, row) entry the kernels do as little as they can: they work in base 2 (``tl.exp2`` is one MUFU
``ex2.approx.ftz``; ``tl.exp`` is a multiply and ``ex2.approx`` with a four-instruction denormal fix-up),
with τ·log2 e applied in the FFMA that subtracts the LSE; a row left out is a zeroed query with an LSE of
+inf (its entries are 0, or NaN at a non-finite key, whose u is NaN anyway) instead of a select per entry;
and the causal mask is applied to the key tiles reaching past N − W only (every window row sees the keys
before), a uniform branch in the score kernel and a second loop in the LSE kernel.

Kernels, each on a grid (key chunks, B·H_kv) so a long row splits over many programs; one program
holds all G·W query rows of its KV head (in blocks of GB heads × BW rows when there are many):

1. ``_window_lse_kernel`` (only without ``attn_lse``): per chunk and query row, the partial
   ln Σ_j exp(τ·q_i·k_j) over the chunk's visible keys (online max/sum);
2. ``_window_score_kernel``: combines the partial LSEs (or reads ``attn_lse``, natural log, from
   the prefill attention: then K is read once), and writes u[h, j] reduced over rows and heads;
3. ``_window_pool_kernel`` (only for κ > 1 or ``head_reduce="layer"``): the layer mean and the
   pooling, which needs neighbours across chunk borders, over the reduced ``[B, H_kv, N]`` rows.

Asked (``protect``), the kernel that writes the final scores (the pooling kernel, else the score kernel) also
counts the select's first radix pass over them: no launch of its own.

``tl.dot`` takes the native fp16/bf16 operands on the GPU (fp32 accumulation) and fp32 operands
under the interpreter, whose bf16 arithmetic is wrong, or for fp32 inputs
(then with ``input_precision="ieee"``, not TF32).

On the CPU (outside the interpreter) the op runs ``_window_attention_torch``: the same two passes
(LSE, then scores) and the pooling, vectorised in PyTorch over token chunks, in base 2 as well (``exp2``:
PyTorch's CPU ``exp`` takes a slow path, ~10x slower, for each element whose result is subnormal or zero, as
far-off and masked logits are; its ``exp2`` does not).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import (INTERPRET, LOG2E, cdiv, check_kv_tensor, check_positive_float, finite_rows, host_cache,
                      launch, next_pow2, on_host, pdl_wait, row_major, triton_op, use_triton)
from .select import NB, Hist0, hist0_buffer, hist0_of_chunk

#: key tiles the score kernel keeps in flight when it reads no values (a launch argument, read at each launch): at
#: B·H_kv = 8 rows its grid places at most two programs on an SM, so the loads one program has in flight are what
#: the SM has; a third stage costs no registers there (sm_90) and 16 KB of shared memory a program. With values
#: read, and in the LSE kernel, a third stage takes a CTA per SM (registers): 2
SCORE_STAGES = 3
#: keys per step of the select's first pass in the pooling or score kernel (a step over a smaller chunk is masked)
HIST_TILE = 4096 if INTERPRET else 512

POOLS = ("max", "avg")
ROW_REDUCE = ("mean", "sum")
HEAD_REDUCE = ("mean", "max", "layer")


@triton.jit
def _rows(g0, w0, G, W, N, GB: tl.constexpr, BW: tl.constexpr):
    """Query rows m = g·BW + i of the block starting at head g0, row w0: (head, row, position, valid)."""
    m = tl.arange(0, GB * BW)
    g = g0 + m // BW
    i = w0 + m % BW
    pos = N - W + i
    return g, i, pos, (g < G) & (i < W) & (pos >= 0)


@triton.jit
def _load_q(q_ptr, qbase, sqh, sqw, g, i, valid, d, D, CAST_FP32: tl.constexpr):
    m = valid[:, None] & (d < D)[None, :]
    q = tl.load(q_ptr + qbase + g.to(tl.int64)[:, None] * sqh + i.to(tl.int64)[:, None] * sqw + d[None, :],
                mask=m, other=0.0)
    if CAST_FP32:
        q = q.to(tl.float32)
    return q


@triton.jit
def _load_kt(k_ptr, kbase, skn, j, N, d, D, CAST_FP32: tl.constexpr):
    """Keys j as a [BLOCK_D, BLOCK_N] tile (transposed for the dot)."""
    m = (d < D)[:, None] & (j < N)[None, :]
    kt = tl.load(k_ptr + kbase + j.to(tl.int64)[None, :] * skn + d[:, None], mask=m, other=0.0)
    if CAST_FP32:
        kt = kt.to(tl.float32)
    return kt


@triton.jit
def _load_k(k_ptr, kbase, skn, j, N, d, D, CAST_FP32: tl.constexpr):
    """Keys j as a [BLOCK_N, BLOCK_D] tile."""
    m = (j < N)[:, None] & (d < D)[None, :]
    k = tl.load(k_ptr + kbase + j.to(tl.int64)[:, None] * skn + d[None, :], mask=m, other=0.0)
    if CAST_FP32:
        k = k.to(tl.float32)
    return k


@triton.jit
def _value_nan(v_ptr, vbase, svn, j, N, DV, BLOCK_DV: tl.constexpr, HAS_V: tl.constexpr):
    """Per key j (``HAS_V``: the values are read with the keys): NaN where the token's value has a non-finite
    element, else ±0."""
    if HAS_V:
        dv = tl.arange(0, BLOCK_DV)
        v = tl.load(v_ptr + vbase + j.to(tl.int64)[:, None] * svn + dv[None, :],
                    mask=(j < N)[:, None] & (dv < DV)[None, :], other=0.0).to(tl.float32)
        z = tl.sum(v * 0.0, 1)  # x·0 is ±0 for a finite x, NaN for ±inf and NaN
    else:
        z = tl.zeros(j.shape, tl.float32)  # not read
    return z


@triton.jit
def _load_w(w_ptr, wbase, W, g, i, valid):
    """Per query row: its weight in the reduction (0 for a row left out) and ln of it."""
    w = tl.load(w_ptr + wbase + g.to(tl.int64) * W + i, mask=valid, other=0.0)
    return w, tl.log(w)


@triton.jit
def _hoisted_w(q, lse, g, i, pos, G, W, GB: tl.constexpr, BW: tl.constexpr, HAS_LSE: tl.constexpr,
               ROW_MEAN: tl.constexpr, HEAD_MEAN: tl.constexpr):
    """``row_weights`` of the one row block that holds every row of a KV head's group (heads 0..GB, rows
    0..BW), from its queries and LSEs already in registers: no pass of its own and no launch."""
    ok = (g < G) & (i < W) & (tl.sum(tl.where(q * 0.0 == 0.0, 0, 1), 1) == 0)
    if HAS_LSE:  # a given LSE: −inf is right only for a row at a negative position (it sees no key)
        ok = ok & ((lse * 0.0 == 0.0) | (pos < 0))
    w = ok.to(tl.float32)
    cnt = tl.sum(tl.reshape(w, [GB, BW]), 1)  # rows left in, per head
    if ROW_MEAN:
        w = w / tl.reshape(tl.broadcast_to(tl.maximum(cnt, 1.0)[:, None], [GB, BW]), [GB * BW])
    if HEAD_MEAN:
        w = w / tl.maximum(tl.sum((cnt > 0).to(tl.float32), 0), 1.0)
    return w, tl.log(w)


@triton.jit
def _load_lse(lse_ptr, lbase, slc, slg, slw, NC, g, i, valid):
    """ln Σ over all keys per row, combined from NC partial LSEs (NC = 1: ``attn_lse`` as given)."""
    offs = lbase + g.to(tl.int64) * slg + i.to(tl.int64) * slw
    mx = tl.full(g.shape, float("-inf"), tl.float32)
    for c in range(NC):
        mx = tl.maximum(mx, tl.load(lse_ptr + offs + c * slc, mask=valid, other=float("-inf")).to(tl.float32))
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    tot = tl.zeros(g.shape, tl.float32)
    for c in range(NC):
        tot += tl.exp(tl.load(lse_ptr + offs + c * slc, mask=valid, other=float("-inf")).to(tl.float32) - mx)
    return mx + tl.log(tl.where(valid, tot, 1.0))


@triton.jit
def _visible_tiles(c, CHUNK, N, W, n_chunk, BLOCK_N: tl.constexpr):
    """Keys of chunk c in whole tiles that every window row sees (all before N − W + 1): the tiles after them
    need the causal mask (all of them when W > N: rows at negative positions see nothing)."""
    return tl.minimum(tl.maximum(N - W + 1 - c * CHUNK, 0) // BLOCK_N * BLOCK_N, n_chunk)


@triton.jit
def _lse_tile(mx, tot, q, j, pos, c2, k_ptr, kbase, skn, N, d, D, v_ptr, vbase, svn, DV, CAUSAL: tl.constexpr,
              CAST_FP32: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_V: tl.constexpr):
    """The online max (base 2, of τ·log2 e·q·k) and sum of the rows of ``q`` over the keys j."""
    kt = _load_kt(k_ptr, kbase, skn, j, N, d, D, CAST_FP32)
    vz = _value_nan(v_ptr, vbase, svn, j, N, DV, BLOCK_DV, HAS_V)
    s = tl.dot(q, kt, input_precision=DOT_PREC)  # raw logits: τ·log2 e is applied in the FFMA below
    # a non-finite key makes s non-finite in every row whose query is finite: masked out (a token with a non-finite
    # value too, when the values are read); rows at positions < 0 see no key (the causal mask), padded ones are not
    # stored
    s = tl.where(tl.abs(s + vz[None, :] if HAS_V else s) < float("inf"), s, float("-inf"))
    if CAUSAL:
        s = tl.where(j[None, :] <= pos[:, None], s, float("-inf"))
    new = tl.maximum(mx, tl.max(s, 1) * c2)  # rounding is monotone: max(s)·c = max(s·c)
    safe = tl.where(new == float("-inf"), 0.0, new)
    return new, tot * tl.exp2(mx - safe) + tl.sum(tl.exp2(s * c2 - safe[:, None]), 1)


@triton.jit(do_not_specialize=["C", "CHUNK"])
def _window_lse_kernel(k_ptr, q_ptr, v_ptr, part_ptr, H, G, N, W, D, skb, skh, skn, sqb, sqh, sqw,
                       DV, svb, svh, svn, C, scale,
                       CHUNK, BLOCK_N: tl.constexpr, GB: tl.constexpr, BW: tl.constexpr,
                       BLOCK_D: tl.constexpr, CAST_FP32: tl.constexpr, DOT_PREC: tl.constexpr,
                       BLOCK_DV: tl.constexpr, HAS_V: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    c2 = tl.cast(scale, tl.float32) * 1.4426950408889634  # τ·log2 e (fp32: torch.compile passes fp64 floats)
    c = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    kbase = (r // H) * skb + (r % H) * skh
    vbase = (r // H) * svb + (r % H) * svh
    qbase = (r // H) * sqb + (r % H) * G * sqh
    d = tl.arange(0, BLOCK_D)
    n_chunk = tl.minimum(CHUNK, N - c * CHUNK)  # keys of this chunk
    n_seen = _visible_tiles(c, CHUNK, N, W, n_chunk, BLOCK_N)
    for g0 in range(0, G, GB):
        for w0 in range(0, W, BW):
            g, i, pos, valid = _rows(g0, w0, G, W, N, GB, BW)
            q = _load_q(q_ptr, qbase, sqh, sqw, g, i, valid, d, D, CAST_FP32)
            mx = tl.full([GB * BW], float("-inf"), tl.float32)
            tot = tl.zeros([GB * BW], tl.float32)
            for t0 in range(0, n_seen, BLOCK_N):
                mx, tot = _lse_tile(mx, tot, q, c * CHUNK + t0 + tl.arange(0, BLOCK_N), pos, c2, k_ptr, kbase, skn, N,
                                    d, D, v_ptr, vbase, svn, DV, False, CAST_FP32, DOT_PREC, BLOCK_DV, HAS_V)
            for t0 in range(n_seen, n_chunk, BLOCK_N):
                mx, tot = _lse_tile(mx, tot, q, c * CHUNK + t0 + tl.arange(0, BLOCK_N), pos, c2, k_ptr, kbase, skn, N,
                                    d, D, v_ptr, vbase, svn, DV, True, CAST_FP32, DOT_PREC, BLOCK_DV, HAS_V)
            # no visible key: -inf; a NaN total (an overflowing τ·q·k: inf − inf) makes the LSE NaN
            part = tl.where(tot > 0, (mx + tl.log2(tl.where(tot > 0, tot, 1.0))) * 0.6931471805599453,
                            tl.where(tot == tot, float("-inf"), tot))
            tl.store(part_ptr + ((r * C + c) * G + g) * W + i, part, mask=(g < G) & (i < W))


@triton.jit
def _probs(k, q_t, c2, l2, pos, j, vz, causal, DOT_PREC: tl.constexpr, HAS_V: tl.constexpr):
    """exp(τ·k·q − lse), [BLOCK_N, rows], of the keys j of the tile ``k`` [BLOCK_N, BLOCK_D] and the rows of a row
    block, as 2^(c2·k·q − l2) with c2 = τ·log2 e and ``l2`` = lse·log2 e (``_log2_lse``: +inf for a row left out,
    whose query in ``q_t`` [BLOCK_D, rows] is zeroed, so its entries are 0): one FFMA and one MUFU an entry. 0 where
    a row does not see the key (only a tile reaching past N − W holds such keys: ``causal``, the mask is applied to
    it alone), NaN for a non-finite key (its raw logit is not finite; a zeroed query gives 0·±inf = NaN too) or,
    ``HAS_V``, value (``vz`` NaN). Keys first: on Hopper the queries are the dot's shared-memory operand (no
    registers held across the key loop) and a key's sum over rows adds up mostly a thread's own registers."""
    s = tl.dot(k, q_t, input_precision=DOT_PREC)
    p = tl.exp2(s * c2 - l2[None, :])  # exp2 lowers to ex2.approx.ftz: no denormal fix-up around the MUFU
    if causal:  # keys the window's causal mask hides from its first rows
        p = tl.where(j[:, None] <= pos[None, :], p, 0.0)
    # + ±0, or NaN for a non-finite key or value (its u is NaN: no column reduction): x·0 is ±0 for a finite x only
    return p + (s * 0.0 + vz[:, None] if HAS_V else s * 0.0)


@triton.jit
def _log2_lse(lse, valid):
    """The rows' ln-normalisers (row weights folded in) in base 2 for ``_probs``: +inf for a row left out."""
    return tl.where(valid, lse * 1.4426950408889634, float("inf"))


@triton.jit
def _group_reduce(acc, hs, GROUP_MAX: tl.constexpr):
    """acc combined with the head sums ``hs`` [BLOCK_N, GB] of a group block: sum, or (``GROUP_MAX``) max."""
    if GROUP_MAX:  # padded heads add zeros; u >= 0. tl.max skips NaN: a NaN head makes the max NaN
        hsum = tl.sum(hs, 1)
        acc = tl.maximum(acc, tl.where(hsum == hsum, tl.max(hs, 1), hsum), propagate_nan=tl.PropagateNan.ALL)
    else:
        acc += tl.sum(hs, 1)
    return acc


@triton.jit(do_not_specialize=["slb", "slh", "slc", "NC", "CHUNK", "sink", "window"])
def _window_score_kernel(k_ptr, q_ptr, v_ptr, lse_ptr, u_ptr, H, G, N, W, D, skb, skh, skn, sqb, sqh, sqw,
                         DV, svb, svh, svn, slb, slh, slc, slg, slw, NC, w_ptr, scale, h0_ptr, sink, window,
                         CHUNK, BLOCK_N: tl.constexpr, GB: tl.constexpr, BW: tl.constexpr,
                         BLOCK_D: tl.constexpr, GROUP_MAX: tl.constexpr, HOIST: tl.constexpr,
                         CAST_FP32: tl.constexpr, DOT_PREC: tl.constexpr, HAS_LSE: tl.constexpr,
                         ROW_MEAN: tl.constexpr, HEAD_MEAN: tl.constexpr, BLOCK_DV: tl.constexpr,
                         HAS_V: tl.constexpr, HIST: tl.constexpr, NB: tl.constexpr, HIST_TILE: tl.constexpr,
                         PDL: tl.constexpr):
    """u[r, j] for the keys of chunk c; ``HIST`` (the scores are final: no pooling kernel follows), then the
    select's first radix pass over them (``select.hist0_of_chunk``, ``sink``/``window`` protected)."""
    pdl_wait(PDL)
    c2 = tl.cast(scale, tl.float32) * 1.4426950408889634  # τ·log2 e (fp32: torch.compile passes fp64 floats)
    c = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    kbase = (r // H) * skb + (r % H) * skh
    vbase = (r // H) * svb + (r % H) * svh
    qbase = (r // H) * sqb + (r % H) * G * sqh
    lbase = (r // H) * slb + (r % H) * slh
    wbase = r * G * W  # row weights [B, H_q, W], contiguous
    d = tl.arange(0, BLOCK_D)
    n_chunk = tl.minimum(CHUNK, N - c * CHUNK)  # keys of this chunk
    if HOIST:  # a single row block: queries (shared memory, for the dot), LSEs and weights loaded once
        g_h, i_h, pos_h, valid_h = _rows(0, 0, G, W, N, GB, BW)
        q_h = _load_q(q_ptr, qbase, sqh, sqw, g_h, i_h, (g_h < G) & (i_h < W), d, D, CAST_FP32)
        lse_h = _load_lse(lse_ptr, lbase, slc, slg, slw, NC, g_h, i_h, valid_h)
        w_h, lw_h = _hoisted_w(q_h, lse_h, g_h, i_h, pos_h, G, W, GB, BW, HAS_LSE, ROW_MEAN, HEAD_MEAN)
        valid_h = valid_h & (w_h > 0)
        l2_h = _log2_lse(lse_h - lw_h, valid_h)
        q_t = tl.trans(tl.where(valid_h[:, None], q_h, 0.0))
    n_seen = _visible_tiles(c, CHUNK, N, W, n_chunk, BLOCK_N)
    for t0 in range(0, n_chunk, BLOCK_N):  # one loop (two, as in the LSE kernel, took more registers on sm_80)
        j = c * CHUNK + t0 + tl.arange(0, BLOCK_N)
        causal = t0 >= n_seen  # a uniform branch: only the last tiles of a row need the causal mask
        k = _load_k(k_ptr, kbase, skn, j, N, d, D, CAST_FP32)
        vz = _value_nan(v_ptr, vbase, svn, j, N, DV, BLOCK_DV, HAS_V)
        if HOIST:  # straight-line code: a loop over the one row block kept its loop-invariant masks in registers
            p = _probs(k, q_t, c2, l2_h, pos_h, j, vz, causal, DOT_PREC, HAS_V)
            if GROUP_MAX:
                acc = _group_reduce(tl.zeros([BLOCK_N], tl.float32), tl.sum(tl.reshape(p, [BLOCK_N, GB, BW]), 2),
                                    GROUP_MAX)
            else:  # the block holds every row of the group (the weights hold the means): one sum over its rows
                acc = tl.sum(p, 1)
        else:
            acc = tl.zeros([BLOCK_N], tl.float32)
            for g0 in range(0, G, GB):
                hs = tl.zeros([BLOCK_N, GB], tl.float32)  # per-head sums over the window rows
                for w0 in range(0, W, BW):
                    g, i, pos, valid = _rows(g0, w0, G, W, N, GB, BW)
                    q = _load_q(q_ptr, qbase, sqh, sqw, g, i, valid, d, D, CAST_FP32)
                    w, lw = _load_w(w_ptr, wbase, W, g, i, valid)
                    valid = valid & (w > 0)
                    l2 = _log2_lse(_load_lse(lse_ptr, lbase, slc, slg, slw, NC, g, i, valid) - lw, valid)
                    p = _probs(k, tl.trans(tl.where(valid[:, None], q, 0.0)), c2, l2, pos, j, vz, causal, DOT_PREC,
                               HAS_V)
                    hs += tl.sum(tl.reshape(p, [BLOCK_N, GB, BW]), 2)
                acc = _group_reduce(acc, hs, GROUP_MAX)
        tl.store(u_ptr + r * N + j, acc, mask=j < N)
    if HIST:  # re-read from L1/L2 on a 1-D layout of at least one key per thread
        tl.debug_barrier()
        hist0_of_chunk(u_ptr + r * N, u_ptr, h0_ptr, r, c, tl.num_programs(0), N, CHUNK, sink, window, HIST_TILE,
                       NB, False)


@triton.jit
def _head_value(u_ptr, r, j, m, H, N, LAYER: tl.constexpr):
    """u[r, j], or with LAYER the mean over the H heads of r's batch row."""
    if LAYER:
        first = (r // H) * H
        v = tl.zeros(j.shape, tl.float32)
        for h in range(H):
            v += tl.load(u_ptr + (first + h) * N + j, mask=m, other=0.0)
        v = v / H
    else:
        v = tl.load(u_ptr + r * N + j, mask=m, other=0.0)
    return v


@triton.jit(do_not_specialize=["C0", "sink", "window"])
def _window_pool_kernel(u_ptr, out_ptr, h0_ptr, H, N, n_pool, C0, sink, window, KSIZE: tl.constexpr,
                        POOL_MAX: tl.constexpr, LAYER: tl.constexpr, BLOCK: tl.constexpr, HIST: tl.constexpr,
                        NB: tl.constexpr, HIST_TILE: tl.constexpr, PDL: tl.constexpr):
    """Pools ``BLOCK`` scores of row r; ``HIST``: then the select's first radix pass over them
    (``select.hist0_of_chunk``, chunk = this program's block, ``sink``/``window`` protected)."""
    pdl_wait(PDL)
    c = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    j = c * BLOCK + tl.arange(0, BLOCK)
    res = _head_value(u_ptr, r, j, j < N, H, N, LAYER)  # NaN: a non-finite key, kept as it is
    if KSIZE > 1:
        if POOL_MAX:
            acc = tl.full([BLOCK], float("-inf"), tl.float32)
        else:
            acc = tl.zeros([BLOCK], tl.float32)
        for t in tl.static_range(KSIZE):
            jj = j - KSIZE // 2 + t
            v = _head_value(u_ptr, r, jj, (jj >= 0) & (jj < n_pool), H, N, LAYER)
            m = (jj >= 0) & (jj < n_pool) & (v == v)  # a NaN neighbour (non-finite key) is a hole, like padding
            if POOL_MAX:
                acc = tl.maximum(acc, tl.where(m, v, float("-inf")))
            else:
                acc += tl.where(m, v, 0.0)  # padding and holes count as zero
        if not POOL_MAX:
            acc = acc / KSIZE
        res = tl.where((j < n_pool) & (res == res), acc, res)
    tl.store(out_ptr + r * N + j, res, mask=j < N)
    if HIST:  # re-read from L1/L2 on a 1-D layout of at least one key per thread
        tl.debug_barrier()
        hist0_of_chunk(out_ptr + r * N, out_ptr, h0_ptr, r, c, C0, N, BLOCK, sink, window, HIST_TILE, NB, False)


@host_cache(1024)  # pure; called on every launch (the result is shared: read only)
def _config(N: int, G: int, W: int, D: int, chunk: int) -> dict:
    """Block sizes. Rows: GB heads × BW window rows per block (≥ 16 rows for ``tl.dot``)."""
    block_d = max(16, next_pow2(D))
    if INTERPRET:  # ~0.5 ms per program: one program per row, large tiles
        bw, gb = next_pow2(W), next_pow2(G)
        while gb * bw < 16:
            bw *= 2
        block_n = max(16, min(next_pow2(N), 2 ** 16 // (gb * bw)))
        chunk = chunk or max(block_n, next_pow2(N))
        warps = 4
    else:
        bw = min(next_pow2(W), 128)
        gb = min(next_pow2(G), max(1, 128 // bw))
        while gb * bw < 16:
            bw *= 2
        block_n = 64 if block_d <= 128 else 32
        if not chunk:  # ~32 chunks a row (two waves of 132 SMs at 8 rows), from N alone: a tensor-parallel
            # rank (fewer rows) then splits a row exactly as one process does, so its LSEs are bit-identical
            chunk = max(block_n, next_pow2(-(-N // 32)))
        warps = 8 if gb * bw * block_n >= 8192 else 4
    chunk = next_pow2(chunk)
    # key tiles double-buffered (cp.async): at 128 rows × 64 keys × D 128 the hoisted queries and two bf16 key
    # tiles take 66 KB of shared memory; a third stage costs CTAs per SM in the LSE kernel and with values (Triton
    # 3.6: 184 and 136 registers), so only the score kernel without values takes one (``SCORE_STAGES``)
    return dict(CHUNK=chunk, BLOCK_N=min(block_n, chunk), GB=gb, BW=bw, BLOCK_D=block_d, num_warps=warps,
                num_stages=2)


#: elements of one fp32 ``[B, H_kv, G·W, n]`` logit block of ``_window_attention_torch`` (128 MiB):
#: it sets the token chunk n, so memory stays bounded whatever N is
TORCH_BLOCK = 1 << 25


def row_weights(queries: torch.Tensor, attn_lse: Optional[torch.Tensor], N: int, H: int, row_reduce: str,
                head_reduce: str) -> torch.Tensor:
    """fp32 ``[B, H_q, W]``: each query row's weight in u, the row and head reductions folded in.

    A row whose query holds a non-finite element, or whose given LSE is not finite (−inf is right
    only for a row at a negative position, W > N, which sees no key and still counts), is left out
    (weight 0); the mean over rows divides by the rows left in of that head, the mean over the group
    by the heads with a row left in (``"max"``: no division). All rows finite: 1/(W·G) (``"sum"``: 1/G)."""
    B, Hq, W = queries.shape[:3]
    ok = torch.isfinite(queries).all(-1)
    if attn_lse is not None and attn_lse.numel() > 0:
        ok &= torch.isfinite(attn_lse) | (torch.arange(N - W, N, device=queries.device) < 0)
    w = ok.to(torch.float32)
    rows = w.sum(-1, keepdim=True)  # [B, H_q, 1] rows left in
    if row_reduce == "mean":
        w = w / rows.clamp(min=1)
    if head_reduce != "max":
        heads = (rows > 0).view(B, H, Hq // max(H, 1)).sum(-1, keepdim=True)  # [B, H, 1] heads left in
        w = (w.view(B, H, -1) / heads.clamp(min=1)).view(B, Hq, W)
    return w.contiguous()


@host_cache(64)
def _unit_weight(W: int, G: int, row_reduce: str, head_reduce: str) -> float:
    """``row_weights``' entry when every query row is finite and no LSE is given (then the same for every row)."""
    return row_weights(torch.zeros(1, G, W, 1), None, W, 1, row_reduce, head_reduce)[0, 0, 0].item()


@host_cache(64)
def _hidden(G: int, W: int, ahead: int, n: int, device: torch.device) -> torch.Tensor:
    """bool ``[G·W, n]``: key column m hidden from window row i (i % W is the row's place in the window), for
    columns that start ``ahead`` keys after the window's first position: ``ahead + m > i % W``. Cached (small)."""
    return torch.arange(ahead, ahead + n, device=device) > torch.arange(W, device=device).repeat(G)[:, None]


def pool_torch(u: torch.Tensor, n_pool: int, kernel_size: int, pool: str, no_nan: bool = False) -> torch.Tensor:
    """``_window_pool_kernel``'s pooling over [0, n_pool) of rows ``[..., N]``: output j covers
    [j − κ//2, j − κ//2 + κ); max ignores the padding, avg counts it as zeros, a NaN neighbour (a
    non-finite key) is a hole like the padding, a NaN entry stays NaN; entries from n_pool on are
    copied. ``no_nan``: the caller knows ``u`` holds no NaN (the NaN masks are then identities)."""
    if kernel_size <= 1 or n_pool <= 0:
        return u.contiguous()
    pad = kernel_size // 2
    fill = float("-inf") if pool == "max" else 0.0
    own = u[..., :n_pool]
    holes = own if no_nan else torch.where(own == own, own, fill)
    win = torch.nn.functional.pad(holes, (pad, kernel_size - 1 - pad), value=fill).unfold(-1, kernel_size, 1)
    pooled = win.amax(-1) if pool == "max" else win.sum(-1) / kernel_size
    return torch.cat([pooled if no_nan else torch.where(own == own, pooled, own), u[..., n_pool:]], dim=-1).contiguous()


def _lse_from(mx: torch.Tensor, tot: torch.Tensor) -> torch.Tensor:
    """mx + log2(tot) (base 2, as every LSE of ``_window_attention_torch``) with the kernel's rules: −inf where
    tot = 0 (no visible key), NaN where tot is NaN (a NaN logit, or +inf: inf − inf), as the oracle's max-shifted
    sum gives."""
    return torch.where(tot > 0, mx + torch.log2(torch.where(tot > 0, tot, 1.0)),
                       torch.where(tot == tot, float("-inf"), tot))


def _combine_lse(parts: torch.Tensor) -> torch.Tensor:
    """log2 Σ_c 2^parts[c] over dim 0, as the kernel combines its per-chunk LSEs (and reads a
    given ``attn_lse``: one part, unchanged when finite, NaN for +inf)."""
    mx = parts.amax(0)
    return _lse_from(mx, torch.exp2(parts - torch.where(mx == float("-inf"), 0.0, mx)).sum(0))


def _window_attention_torch(keys, queries, attn_lse, values, scale: float, kernel_size: int, pool: str,
                            row_reduce: str, head_reduce: str) -> torch.Tensor:
    """The op's CPU body, in fp32.

    The G·W query rows of KV head h are one ``[G·W, D]`` matrix (a view of the queries: no
    ``repeat_kv``); per token chunk their logits ``τ·q·kᵀ`` are one batched matmul ``[B, H, G·W, n]``
    (n keeps the block under ``TORCH_BLOCK`` elements), in base 2: the queries are scaled by τ·log2 e, so
    the logits and LSEs are base-2 and every exp an ``exp2`` (PyTorch's CPU ``exp`` is ~10x slower on the
    many entries whose result is subnormal or zero). Every row sees the keys up to N − W; only
    the last W − 1 keys need the causal mask (key j visible to row i iff j ≤ N − W + i), applied in
    place; keys with a non-finite element are masked out like invisible ones, and rows left out
    (``row_weights``: a non-finite query or given LSE) see nothing (their query is zeroed first).
    Then, in place on the block (no second one is allocated):

    * one chunk, no ``attn_lse``: e = 2^(logit − row max), the row's LSE from Σ e, and the head
      sums Σ_i r_i·e_ij with r_i = w_i·2^(row max − LSE_i) as one batched mat-vec per head;
    * otherwise: pass 1 the partial LSE of every chunk (or ``attn_lse``·log2 e), combined as the kernel
      does; pass 2 recomputes each chunk's logits, e = 2^(logit − LSE), r = w.

    Entries of keys a row does not see are 0, also when r is not finite (the last W − 1 keys are
    summed again elementwise with them zeroed), as in the kernel. Then the reduction over the G
    heads (sum or max; the row weights w hold the means), NaN at non-finite keys, the layer mean and
    ``pool_torch``; window positions keep their unpooled u."""
    B, H, N, D = keys.shape
    Hq, W = queries.shape[1], queries.shape[2]
    G = Hq // max(H, 1)
    dev = keys.device
    if B * H == 0 or N == 0:
        return torch.empty((B, H, N), dtype=torch.float32, device=dev)
    # eagerly on the CPU, every query row finite and no LSE given (the usual call): the weights are one number and
    # every row is left in (one host read of a sum: a non-finite element makes it non-finite)
    host = on_host(keys)
    rows_in = host and attn_lse.numel() == 0 and bool(torch.isfinite(queries.sum()))
    if rows_in:
        w = torch.full((B, H, G * W, 1), _unit_weight(W, G, row_reduce, head_reduce), device=dev)
        left_in = None
    else:
        w = row_weights(queries, attn_lse, N, H, row_reduce, head_reduce).view(B, H, G * W, 1)
        left_in = w > 0
    if rows_in and values.numel() == 0 and bool(torch.isfinite(keys.sum())):  # likewise every key finite
        kfin, keys_in, every_in, rows_all = None, True, True, True
    else:
        kfin, keys_in = finite_rows(keys)  # [B, H, N]; every key finite (read eagerly on the host)
        if values.numel() > 0:  # a token with a non-finite value counts as a non-finite key
            vfin, every_v = finite_rows(values)
            kfin, keys_in = kfin & vfin, keys_in and every_v
        rows_all = rows_in or (host and bool(left_in.all()))  # eagerly: every query row left in (traced: unknown)
        every_in = keys_in and rows_all  # eagerly: nothing to mask
    if left_in is None and not every_in:  # a non-finite key: the row mask is read with the key mask
        left_in = w > 0
    q = queries.float().reshape(B, H, G * W, D)  # rows of KV head h
    q = (q if every_in else torch.where(left_in, q, 0.0)) * (scale * LOG2E)  # base-2 logits
    first = max(N - W + 1, 0)  # keys before this one are visible to every row
    columns = _hidden if host else _hidden.__wrapped__  # cached eagerly; traced: built in the graph
    chunk = max(1, TORCH_BLOCK // (B * H * G * W))
    spans = [(t0, min(t0 + chunk, N)) for t0 in range(0, N, chunk)]
    # eagerly, the tokens masked out (a non-finite key or value) get their −inf from a bias that the logits' GEMM
    # adds, their keys zeroed so that the logits it adds to are 0 (the rows' queries are finite): masked_fill_ with a
    # mask broadcast over the rows is several times slower on the CPU (traced, Inductor fuses either)
    bias = None if keys_in or not host else \
        torch.zeros((B, H, 1, N), device=dev).masked_fill_(~kfin[:, :, None], float("-inf"))

    def logits(t0: int, t1: int):
        """Base-2 logits of keys [t0, t1), −inf where not visible; (block, c, columns c… hidden from each row)."""
        if bias is None:
            s = q @ keys[:, :, t0:t1].float().transpose(-1, -2)  # [B, H, G·W, n]
        else:  # bias + q·kᵀ in one op: the bias is 0 or −inf, so the same numbers as adding it after
            n = t1 - t0
            k = keys[:, :, t0:t1].nan_to_num(0.0, 0.0, 0.0).float()
            s = torch.baddbmm(bias[..., t0:t1].reshape(B * H, 1, n), q.reshape(B * H, G * W, D),
                              k.reshape(B * H, n, D).transpose(-1, -2)).view(B, H, G * W, n)
        if bias is None and not keys_in:
            s.masked_fill_(~kfin[:, :, None, t0:t1], float("-inf"))  # broadcast over the rows: no [G·W, n] mask
        if not rows_all:
            s.masked_fill_(~left_in, float("-inf"))
        c = min(max(first - t0, 0), t1 - t0)
        hidden = columns(G, W, t0 + c - (N - W), t1 - t0 - c, dev)  # [G·W, n − c]
        s[..., c:].masked_fill_(hidden, float("-inf"))
        return s, c, hidden

    def head_sums(e, r, c, hidden, exact_zeros: bool):
        """Σ_i r_i·e_ij over each head's W rows, [B, H, G, n]; columns c… summed again with the
        entries of invisible keys zeroed (a non-finite r_i must not reach them; ``exact_zeros``: r is finite and
        those entries of e are 0, so they are zero already)."""
        n = e.shape[-1]
        hs = (r.view(B, H, G, 1, W) @ e.view(B, H, G, W, n)).squeeze(-2)
        tail = e[..., c:] * r
        if not exact_zeros:
            tail.masked_fill_(hidden, 0.0)
        hs[..., c:] = tail.view(B, H, G, W, n - c).sum(3)
        return hs

    once, plain = None, False
    if attn_lse.numel() > 0:
        lse = _combine_lse(attn_lse.float().reshape(1, B, H, G * W, 1) * LOG2E)
    elif len(spans) == 1 and rows_all and N >= W:  # one chunk, every row in (non-finite keys masked) and seeing a key
        s, c, hidden = logits(0, N)
        mx = s.amax(-1, keepdim=True)
        # every row max finite (no overflow): the masks and the combination of one part below are identities
        plain = bool(torch.isfinite(mx).all())
        if plain:
            e = s.sub_(mx).exp2_()
            once, lse = (e, mx, c, hidden), mx + torch.log2(e.sum(-1, keepdim=True))  # tot >= 1: _lse_from's value
        else:
            shift = torch.where(mx == float("-inf"), 0.0, mx)
            e = s.sub_(shift).exp2_()
            once = e, shift, c, hidden
            lse = _combine_lse(_lse_from(mx, e.sum(-1, keepdim=True))[None])
    else:
        parts = []
        for t0, t1 in spans:
            s, c, hidden = logits(t0, t1)
            mx = s.amax(-1, keepdim=True)
            shift = torch.where(mx == float("-inf"), 0.0, mx)
            e = s.sub_(shift).exp2_()
            parts.append(_lse_from(mx, e.sum(-1, keepdim=True)))
            if len(spans) == 1:
                once = e, shift, c, hidden
        lse = _combine_lse(torch.stack(parts))  # [B, H, G·W, 1]
    if not plain:
        left_in = w > 0 if left_in is None else left_in
        lse = torch.where(left_in & (lse > float("-inf")), lse, 0.0)  # rows that see no finite key: e = 0
    u = torch.empty((B, H, N), dtype=torch.float32, device=dev)
    for t0, t1 in spans:
        if once is not None:
            e, shift, c, hidden = once
            r = torch.exp2(shift - lse) * w
            r = r if plain else torch.where(left_in, r, 0.0)
        else:
            s, c, hidden = logits(t0, t1)
            e, r = s.sub_(lse).exp2_(), w
        hs = head_sums(e, r, c, hidden, plain)
        red = hs.amax(2) if head_reduce == "max" else hs.sum(2)
        u[:, :, t0:t1] = red if every_in else torch.where(kfin[:, :, t0:t1], red, float("nan"))
    if head_reduce == "layer":
        u = (u.sum(1, keepdim=True) / H).expand(B, H, N)
    return pool_torch(u, max(N - W, 0), kernel_size, pool, no_nan=plain and every_in)


# no default on a mutated argument: torch < 2.12 drops trailing arguments equal to their default before it
# indexes the mutated ones by position (IndexError under a dispatch mode, torch.compile or export)
@triton_op("tritonkv::window_attention_score", mutates_args={"hist0"})
def window_attention_op(keys: torch.Tensor, queries: torch.Tensor, attn_lse: Optional[torch.Tensor],
                        values: torch.Tensor, scale: float, kernel_size: int, pool: str, row_reduce: str,
                        head_reduce: str, chunk: int, hist0: Optional[torch.Tensor], sink: int = 0,
                        window: int = 0) -> torch.Tensor:
    """The raw op: keys ``[B, H, N, D]``, queries ``[B, G·H, W, D]`` (last dims unit-stride),
    ``attn_lse`` ``[B, G·H, W]``, or None or empty (computed here), ``values`` ``[B, H, N, D_v]`` (last dim
    unit-stride) or empty (not read) -> fp32 ``[B, H, N]``. ``chunk``: keys per program (0 =
    automatic); it changes the grid, not the result beyond rounding. ``hist0``: None, or the int32
    ``[B·H, 1 + chunks, NB]`` that the kernel writing the scores fills with the select's first radix
    pass (``sink``/``window`` protected): the pooling kernel (its chunks), or without pooling the score
    kernel (its chunks); left alone by the PyTorch body."""
    if not use_triton(keys):
        lse = attn_lse if attn_lse is not None else torch.empty(0, dtype=torch.float32, device=keys.device)
        return _window_attention_torch(keys, queries, lse, values, scale, kernel_size, pool, row_reduce, head_reduce)
    given = attn_lse is not None and attn_lse.numel() > 0
    B, H, N, D = keys.shape
    Hq, W = queries.shape[1], queries.shape[2]
    G = Hq // H
    R = B * H
    dev = keys.device
    out = torch.empty((B, H, N), dtype=torch.float32, device=dev)
    if R == 0 or N == 0:
        return out
    cfg = _config(N, G, W, D, chunk)
    C = cdiv(N, cfg["CHUNK"])
    cast = INTERPRET or keys.dtype == torch.float32 or queries.dtype != keys.dtype
    has_v = values.numel() > 0
    vt = values if has_v else keys  # not read without values
    common = dict(CAST_FP32=cast, DOT_PREC="ieee", BLOCK_DV=max(16, next_pow2(vt.shape[3])), HAS_V=has_v, **cfg)
    kq = (H, G, N, W, D, keys.stride(0), keys.stride(1), keys.stride(2),
          queries.stride(0), queries.stride(1), queries.stride(2),
          vt.shape[3], vt.stride(0), vt.stride(1), vt.stride(2))
    if given:
        lse, NC = attn_lse, 1
        lstr = (attn_lse.stride(0), G * attn_lse.stride(1), 0, attn_lse.stride(1), attn_lse.stride(2))
    else:
        lse, NC = torch.empty((B, H, C, G, W), dtype=torch.float32, device=dev), C
        lstr = (H * C * G * W, C * G * W, G * W, W, 1)
        launch(_window_lse_kernel, (C, R), keys, queries, vt, lse, *kq, C, scale, **common)
    pooled = kernel_size > 1 or head_reduce == "layer"
    u = torch.empty_like(out) if pooled else out
    hoist = G <= cfg["GB"] and W <= cfg["BW"]  # one row block: the kernel derives the row weights itself
    w = out if hoist else row_weights(queries, attn_lse, N, H, row_reduce, head_reduce)
    hist = hist0 is not None and not pooled  # the score kernel's scores are final: it counts the first pass
    launch(_window_score_kernel, (C, R), keys, queries, vt, lse, u, *kq, *lstr, NC, w, scale,
           hist0 if hist else out, sink, window, GROUP_MAX=head_reduce == "max", HOIST=hoist, HAS_LSE=given,
           ROW_MEAN=row_reduce == "mean", HEAD_MEAN=head_reduce != "max", HIST=hist, NB=NB, HIST_TILE=HIST_TILE,
           **dict(common, num_stages=cfg["num_stages"] if has_v else SCORE_STAGES))
    if pooled:
        block = _pool_block(N)
        launch(_window_pool_kernel, (cdiv(N, block), R), u, out, out if hist0 is None else hist0, H, N, max(N - W, 0),
               cdiv(N, block), sink, window, KSIZE=kernel_size, POOL_MAX=pool == "max", LAYER=head_reduce == "layer",
               BLOCK=block, HIST=hist0 is not None, NB=NB, HIST_TILE=min(block, HIST_TILE))
    return out


def _pool_block(n: int) -> int:
    """Tokens per program of the pooling kernel (its chunk, for the select's first pass too)."""
    return min(next_pow2(n), 4096 if INTERPRET else 1024)


def _choice(name: str, value, options) -> str:
    if value not in options:
        raise ValueError(f"{name} must be one of {options}, got {value!r}")
    return value


def window_attention_scores(keys: torch.Tensor, queries: torch.Tensor, *, attn_lse: Optional[torch.Tensor] = None,
                            scale: Optional[float] = None, kernel_size: int = 1, pool: str = "max",
                            row_reduce: str = "mean", head_reduce: str = "mean", chunk: int = 0,
                            values: Optional[torch.Tensor] = None, protect=None):
    """Window-attention scores, fp32 ``[B, H_kv, N]`` (higher = keep).

    Args:
        keys: ``[B, H_kv, N, D]`` with RoPE applied.
        queries: the last W queries ``[B, H_q, W, D]`` (H_q a multiple of H_kv; query head q reads
            KV head q // G), at positions N − W … N − 1, RoPE applied.
        attn_lse: optional ``[B, H_q, W]`` natural-log softmax normalisers of those queries over
            their visible keys (from the prefill attention, at the same ``scale``); saves a pass
            over the keys. Computed here when absent.
        scale: attention scale τ (default 1/√D).
        kernel_size, pool: 1-D pooling (κ, ``"max"`` or ``"avg"``) over the positions before the window.
        row_reduce: ``"mean"`` (SnapKV, TOVA) or ``"sum"`` (H2O column sums) over the window rows.
        head_reduce: over the G query heads of each KV head, ``"mean"`` or ``"max"``; ``"layer"`` is
            the mean over all H_q heads, the same scores for every KV head (TOVA).
        chunk: keys per program (0 = automatic); changes the grid only.
        values: optional ``[B, H_kv, N, D_v]``, for a policy that also reads values (CriticalKV's
            base): a token whose value has a non-finite element is treated as one whose key has
            (masked out of every softmax, NaN score). The kernels read them with the keys.
        protect: ``(sink, window)``: returns ``(scores, hist0)``, ``hist0`` the shared select's first
            radix pass over these scores with those tokens protected (a ``select.Hist0`` for
            ``select_kv(..., hist0=)``) counted by the kernel that writes the scores (the pooling
            kernel, or the score kernel where none runs: ``kernel_size`` 1 without
            ``head_reduce="layer"``), or None where the PyTorch body runs or the call is traced.
    """
    check_kv_tensor("keys", keys)
    check_kv_tensor("queries", queries)
    B, H, N, D = keys.shape
    if queries.shape[0] != B or queries.shape[3] != D or queries.shape[1] % max(H, 1) or queries.shape[1] == 0 \
            or queries.shape[2] == 0:
        raise ValueError(f"queries must be [B={B}, H_q (a positive multiple of H_kv={H}), W >= 1, D={D}], "
                         f"got {tuple(queries.shape)}")
    if queries.device != keys.device:
        raise ValueError(f"queries must be on the device of keys ({keys.device}), got {queries.device}")
    if values is None:
        values = torch.empty(0, dtype=keys.dtype, device=keys.device)
    else:
        check_kv_tensor("values", values)
        if values.shape[:3] != keys.shape[:3] or values.device != keys.device:
            raise ValueError(f"values must be [B={B}, H_kv={H}, N={N}, D_v] on {keys.device} like the keys, "
                             f"got {tuple(values.shape)} on {values.device}")
        values = row_major(values)
    if attn_lse is not None:
        if not isinstance(attn_lse, torch.Tensor) or not attn_lse.dtype.is_floating_point:
            raise TypeError(f"attn_lse must be a float tensor, got {getattr(attn_lse, 'dtype', type(attn_lse))}")
        if tuple(attn_lse.shape) != tuple(queries.shape[:3]):
            raise ValueError(f"attn_lse must be [B, H_q, W] = {tuple(queries.shape[:3])} like the queries, "
                             f"got {tuple(attn_lse.shape)}")
        if attn_lse.device != keys.device:
            raise ValueError(f"attn_lse must be on the device of keys ({keys.device}), got {attn_lse.device}")
        attn_lse = attn_lse.to(torch.float32)
    scale = 1.0 / math.sqrt(D) if scale is None else check_positive_float("scale", scale, "the attention scale")
    if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1:
        raise ValueError(f"kernel_size must be a positive int, got {kernel_size!r}")
    head_reduce = _choice("head_reduce", head_reduce, HEAD_REDUCE)
    h0 = None
    if protect is not None and use_triton(keys) and not torch.compiler.is_compiling() \
            and type(keys) is torch.Tensor and keys.numel() > 0:
        # slots per row: the chunks of the pooling kernel, or (no pooling) of the score kernel
        pooled = kernel_size > 1 or head_reduce == "layer"
        chunks = cdiv(N, _pool_block(N) if pooled else _config(N, queries.shape[1] // H, queries.shape[2], D,
                                                                   int(chunk))["CHUNK"])
        h0 = Hist0(hist0_buffer(B * H, chunks, keys.device), *protect)
    out = window_attention_op(row_major(keys), row_major(queries), attn_lse, values, float(scale), kernel_size,
                              _choice("pool", pool, POOLS), _choice("row_reduce", row_reduce, ROW_REDUCE),
                              head_reduce, int(chunk), None if h0 is None else h0.hist,
                              *((h0.sink, h0.window) if h0 else (0, 0)))
    return out if protect is None else (out, h0)
