"""LagKV in one kernel: lag-relative scores (LagKV §2.2, Eqs. 5–9; ``docs/algorithms.md`` §1.5), their
within-partition ranks, and — in budget, paper and recursive mode — the kept tokens themselves.

A row of T tokens is cut, after its S sinks, into P = ⌊(T−S)/L⌋ partitions of L tokens,
π_j = [S + jL, S + (j+1)L). Partitions 0 … P−2 are each scored against the *raw* next one: for
Z ∈ {K, V}, the per-channel min/max of π_{j+1} min–max normalise π_j (range floored at ε), each
token's std over channels (divisor d−1) goes through a softmax over the partition's tokens, and
score = φ_K + φ_V. The rank ρ ∈ 0 … L−1 orders a partition (higher is better; equal scores give
the lower index the higher rank).

**Non-finite inputs.** A token whose key or value holds a NaN or ±inf scores NaN (rank: lowest of
its partition, the lower index first among such tokens). Every statistic over tokens leaves it out:
the reference min/max of the previous partition and the softmax normaliser of its own, so every
other token scores as if it were absent. A reference partition without any finite token leaves the
channels unnormalised (lo = 0, range 1).

**Closed-form selection.** Ranks are a permutation of 0 … L−1 in every partition, so keeping the top
b tokens by ρ/L over the P−1 scored partitions (ties to the lower index) keeps exactly
q_j = ⌊b/(P−1)⌋ + [j < b mod (P−1)] of partition j — those of rank ≥ L − q_j — and they land in the
dense output at S + Σ_{i<j} q_i. Paper mode is q_j = m = ⌊rL⌋. So one kernel scores, ranks and
writes each partition's kept indices and K/V rows straight into the output: no score buffer, no
top-k.

**The kernel.** Grid (runs + ⌈(S + tail)/BLOCK_T⌉, B·H_kv). Program c < runs takes a run of consecutive partitions of
one row and walks it from the last to the first, so the min/max of π_j is gathered while π_j is
scored and every partition is read once (plus the reference of the run's last partition). A
partition is one ``[BLOCK_L, BLOCK_D]`` tile per tensor (K and V, cast to fp32 after the load): the
per-channel min/max is one cross-warp reduction per partition, the per-token std one within-warp
reduction, the two softmaxes share their cross-warp reductions, and the rank is one ``[BLOCK_L,
BLOCK_L]`` comparison of int64 keys (score bits above the reversed index, so ties need no second
test). The min/max needs the tokens' finiteness in both K and V, known only after both stds, so the
tiles are loaded again for it rather than held (one fp32 tile live at a time: no spills at 128
registers); the kept rows are re-read as well and stored bit for bit. Both re-reads should hit L1/L2:
the program read those rows a moment before. Partitions too large for registers (L·d > 16K) go through
``BLOCK_T``-token chunks and an fp32 scratch row instead.

**Tilings.** At the default shape one 16-warp program fills an SM (128 registers) and walks its partitions one
after another; each is a chain of dependent loads and ~20 block-wide barriers, so the kernel is bound by
latency, not bytes or issue (H100: ~17 µs a partition against ~4 µs of issue). ``tile``/``warps`` (``TILINGS``,
timed by ``benchmarks/gpu_session.sh tuning``) run the chunked path with chunks of 4–16 tokens and 1–4 warps, so
that 3–16 programs — partitions in flight — share an SM. They give the default's bits: the softmax sums over tokens
are in fixed point (``_sum_fixed``: the same whatever the order), min/max and ranks are exact, and a tiling is
refused unless a token's channels keep the default's layout (``_channels``), i.e. its std sums keep their order
(K/V not 16-byte aligned load scalars, a token over up to 4 warps: at D = 128 only 4 warps or more keep it).

The last programs of each row write the protected tokens, BLOCK_T each (no serial loop of small chunks): +inf
scores, or the sinks and the tail copied. On the CPU (outside the interpreter) the ops run
``_lagkv_torch``/``_compress_torch``: the same steps on all partitions at once.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import (INTERPRET, cdiv, check_int, check_kv_tensor, host_cache, launch, next_pow2, pdl_wait,
                      row_major, triton_op, use_triton)

# the kernel's MODE: raw scores, ranks ρ/L, or the kept tokens
RAW, RANK, SELECT = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
WHOLE_TILE = 16384  # largest BLOCK_L·BLOCK_D kept in registers as one tile per tensor
# min and max as one tuple reduction (``_lohi``) on a GPU; the interpreter runs a reduction with a combine function
# of its own element by element in Python (~10x the rest of the kernel), built-in ``tl.min``/``tl.max`` in NumPy
_JOINT_MINMAX = tl.constexpr(not INTERPRET)


@triton.jit
def _std(z, lo, inv, dmask, D):
    """Per-token std over channels (divisor D−1) of ``z`` normalised as (z − lo)·inv; NaN for a token
    holding a non-finite value (an inf becomes inf − inf in the deviations)."""
    zn = tl.where(dmask[None, :], (z - lo[None, :]) * inv[None, :], 0.0)
    dev = tl.where(dmask[None, :], zn - (tl.sum(zn, 1) / D)[:, None], 0.0)
    return tl.sqrt(tl.sum(dev * dev, 1) / (D - 1))


@triton.jit
def _lohi(lo_a, hi_a, lo_b, hi_b):
    """Combine of a joint (min, max) reduction."""
    return tl.minimum(lo_a, lo_b), tl.maximum(hi_a, hi_b)


@triton.jit
def _minmax(z, ok, lo, hi):
    """Per-channel min/max over the tokens ``ok`` (finite ones; the others +inf in ``z``), folded into
    ``lo``/``hi``: one reduction for both (``_JOINT_MINMAX``), or in the interpreter ``tl.min`` and ``tl.max`` (the
    same values: no NaN reaches them, and the sign of a zero min does not reach the stds)."""
    zhi = tl.where(ok[:, None], z, float("-inf"))
    if _JOINT_MINMAX:
        zlo, zhi = tl.reduce((z, zhi), 0, _lohi)
    else:
        zlo, zhi = tl.min(z, 0), tl.max(zhi, 0)
    return tl.minimum(lo, zlo), tl.maximum(hi, zhi)


@triton.jit
def _minmax_kv(kp, vp, ok, dmask, lo_k, hi_k, lo_v, hi_v):
    """K and V at ``kp``/``vp`` (a tile loaded a moment before: L1/L2) folded into the min/max over the
    tokens ``ok``, K then V. Loading them again holds one fp32 tile at a time rather than both across the stds;
    masked by ``ok``, the loads are not merged with the first ones."""
    m = ok[:, None] & dmask[None, :]
    lo_k, hi_k = _minmax(tl.load(kp, mask=m, other=float("inf")).to(tl.float32), ok, lo_k, hi_k)
    lo_v, hi_v = _minmax(tl.load(vp, mask=m, other=float("inf")).to(tl.float32), ok, lo_v, hi_v)
    return lo_k, hi_k, lo_v, hi_v


@triton.jit
def _tile(krow, vrow, src, skn, svn, tm, dd, D, nlo_k, inv_k, nlo_v, inv_v, lo_k, hi_k, lo_v, hi_v):
    """Tokens ``src`` (``tm``: in the partition) of K and V: their stds against the reference (nlo, inv),
    which of them are finite (``ok``), and the min/max folded over those."""
    m = tm[:, None] & (dd < D)[None, :]
    kp = krow + src * skn + dd[None, :]
    vp = vrow + src * svn + dd[None, :]
    sd_k = _std(tl.load(kp, mask=m, other=0.0).to(tl.float32), nlo_k, inv_k, dd < D, D)
    sd_v = _std(tl.load(vp, mask=m, other=0.0).to(tl.float32), nlo_v, inv_v, dd < D, D)
    ok = tm & (sd_k == sd_k) & (sd_v == sd_v)
    lo_k, hi_k, lo_v, hi_v = _minmax_kv(kp, vp, ok, dd < D, lo_k, hi_k, lo_v, hi_v)
    return sd_k, sd_v, ok, lo_k, hi_k, lo_v, hi_v


@triton.jit
def _norm(lo, hi, eps):
    """(lo, 1/max(hi − lo, ε)) of a reference; (0, 1) where it had no finite token."""
    has = lo < float("inf")
    return tl.where(has, lo, 0.0), 1.0 / tl.where(has, tl.maximum(hi - lo, eps), 1.0)


@triton.jit
def _phi(sd_k, sd_v, ok):
    """φ_K + φ_V (Eqs. 8–9): softmaxes over the tokens ``ok``; NaN elsewhere."""
    # K and V side by side ([BLOCK, 2]): one cross-warp reduction for both softmaxes' max and sum
    sd = tl.join(sd_k, sd_v)
    e = tl.where(ok[:, None], tl.exp(sd - tl.max(tl.where(ok[:, None], sd, float("-inf")), 0)[None, :]), 0.0)
    ek, ev = tl.split(e / _sum_fixed(e)[None, :])
    return tl.where(ok, ek + ev, float("nan"))


@triton.jit
def _sum_fixed(e):
    """Σ over axis 0 of ``e`` ∈ [0, 1] (fp32) in fixed point: each term truncated to a multiple of 2⁻⁴⁰ (int64),
    the integers summed exactly, the sum rounded once to fp32. An fp32 sum's order follows the layout (tile
    and warps); this one is the same bits whatever the order, within n·2⁻⁴⁰ of the exact sum (n ≤ 2²² terms)."""
    return tl.sum((e * 1099511627776.0).to(tl.int64), 0).to(tl.float32) * (1.0 / 1099511627776.0)


@triton.jit
def _key(s, i, BLOCK: tl.constexpr):
    """Scores ``s`` (≥ 0, or −inf for NaN) of tokens ``i`` < BLOCK as int64 keys in the order of (s, −i):
    the fp32 bits (ordered as integers for s ≥ 0, negative for −inf) above the reversed index."""
    return s.to(tl.int32, bitcast=True).to(tl.int64) * BLOCK + (BLOCK - 1 - i)


@triton.jit
def _beaten(ki, kj):
    """For each token i: #{j : key_j > key_i}, i.e. s_j > s_i, or s_j == s_i and j < i. Tokens past the
    partition must come as −inf: then they beat no token (their index exceeds every i)."""
    return tl.sum((kj[None, :] > ki[:, None]).to(tl.int32), 1)


@triton.jit
def _copy_rows(krow, vrow, skn, svn, pos, keep, idx_ptr, ko_ptr, vo_ptr, dst, dd, D):
    """Kept tokens ``pos`` → output rows ``dst``: the index and the K/V rows, bit for bit."""
    src = pos.to(tl.int64)[:, None]
    m = keep[:, None] & (dd < D)[None, :]
    kr = tl.load(krow + src * skn + dd[None, :], mask=m)
    vr = tl.load(vrow + src * svn + dd[None, :], mask=m)
    tl.store(idx_ptr + dst, pos.to(tl.int64), mask=keep)
    o = dst.to(tl.int64)[:, None] * D + dd[None, :]
    tl.store(ko_ptr + o, kr, mask=m)
    tl.store(vo_ptr + o, vr, mask=m)


@triton.jit
def _emit(nb, pos, tm, quota_j, dst0, out_ptr, orow, lag, krow, vrow, skn, svn, ko_ptr, vo_ptr, dd, D,
          MODE: tl.constexpr):
    """Tokens ``pos`` (``tm``: in the partition), ``nb`` tokens beating each: their ranks stored as ρ/L
    (RANK), or those of rank ≥ L − q_j copied to the output from row ``dst0`` on (SELECT). Returns how
    many were kept."""
    keep = tm & (nb < quota_j)
    kk = keep.to(tl.int32)
    if MODE == RANK:
        tl.store(out_ptr + orow + pos, (lag - 1 - nb).to(tl.float32) / lag, mask=tm)
    else:
        _copy_rows(krow, vrow, skn, svn, pos, keep, out_ptr, ko_ptr, vo_ptr, dst0 + tl.cumsum(kk, 0) - kk, dd, D)
    return tl.sum(kk, 0)


@triton.jit(do_not_specialize=["N", "n_scored", "parts", "n_runs", "quota", "rem", "n_out", "window"])
def _lagkv_kernel(k_ptr, v_ptr, out_ptr, ko_ptr, vo_ptr, tmp_ptr, H, skb, skh, skn, svb, svh, svn, N,
                  D: tl.constexpr, sink, lag: tl.constexpr, n_scored, parts, n_runs, quota, rem, n_out, window, eps,
                  BLOCK_L: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_J: tl.constexpr,
                  MODE: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    # MODE RAW/RANK: out_ptr fp32 scores [R, N]. MODE SELECT: out_ptr int64 indices [R, n_out], ko/vo [R, n_out, D].
    # D and lag are compile-time: with D = BLOCK_D and lag = BLOCK_L the masks of the tiles fold away.
    # window: the protected tokens after the sinks ([N - window, N)); n_out = sink + window + the quotas.
    eps = tl.cast(eps, tl.float32)  # torch.compile passes Python floats as fp64: keep the arithmetic fp32
    c = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    krow = k_ptr + (r // H) * skb + (r % H) * skh
    vrow = v_ptr + (r // H) * svb + (r % H) * svh
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < D
    tt = tl.arange(0, BLOCK_T)
    if MODE == SELECT:
        orow = r * n_out
    else:
        orow = r * N

    if c >= n_runs:  # BLOCK_T of the protected tokens [0, sink) and [N - window, N) (a program each: no serial loop)
        t = (c - n_runs) * BLOCK_T + tt
        tm = t < sink + window
        pos = tl.where(t < sink, t, N - window + t - sink)
        if MODE == SELECT:
            _copy_rows(krow, vrow, skn, svn, pos, tm, out_ptr, ko_ptr, vo_ptr,
                       orow + tl.where(t < sink, t, n_out - window + t - sink), dd, D)
        else:
            tl.store(out_ptr + orow + pos, float("inf"), mask=tm)
        return

    j_lo = c * parts
    j_hi = tl.minimum(j_lo + parts, n_scored)
    # per-channel min/max (Eqs. 5-6) over the finite tokens of the reference of the run's last partition
    lo_k = tl.full([BLOCK_D], float("inf"), tl.float32)
    hi_k = tl.full([BLOCK_D], float("-inf"), tl.float32)
    lo_v, hi_v = lo_k, hi_k
    for t0 in range(0, lag, BLOCK_T):
        t = t0 + tt
        src = (sink + j_hi * lag + t).to(tl.int64)[:, None]
        m = (t < lag)[:, None] & dmask[None, :]
        kp = krow + src * skn + dd[None, :]
        vp = vrow + src * svn + dd[None, :]
        ok = (t < lag) & (tl.sum(tl.load(kp, mask=m, other=0.0).to(tl.float32) * 0.0, 1) == 0.0)  # x·0 is NaN
        ok = ok & (tl.sum(tl.load(vp, mask=m, other=0.0).to(tl.float32) * 0.0, 1) == 0.0)  # iff x is not finite
        lo_k, hi_k, lo_v, hi_v = _minmax_kv(kp, vp, ok, dmask, lo_k, hi_k, lo_v, hi_v)

    trow = tmp_ptr + r * (2 * N)  # scratch (chunked partitions only): sd_K at [0, N), sd_V at [N, 2N)
    for q in tl.range(j_lo, j_hi, num_stages=STAGES):
        j = j_hi - 1 - (q - j_lo)  # the run is walked from its last partition down
        start = sink + j * lag
        nlo_k, inv_k = _norm(lo_k, hi_k, eps)
        nlo_v, inv_v = _norm(lo_v, hi_v, eps)
        lo_k = tl.full([BLOCK_D], float("inf"), tl.float32)
        hi_k = tl.full([BLOCK_D], float("-inf"), tl.float32)
        lo_v, hi_v = lo_k, hi_k
        quota_j = quota + (j < rem).to(tl.int32)
        off = orow + sink + j * quota + tl.minimum(j, rem)  # output row of the partition's first kept token
        if BLOCK_T == BLOCK_L:
            # the whole partition in registers: stds, min/max, softmax and ranks in one pass; the kept
            # rows are then re-read (L2) rather than held: holding the raw tiles too spills
            tm = tt < lag
            src = (start + tt).to(tl.int64)[:, None]
            sd_k, sd_v, ok, lo_k, hi_k, lo_v, hi_v = _tile(krow, vrow, src, skn, svn, tm, dd, D, nlo_k, inv_k,
                                                           nlo_v, inv_v, lo_k, hi_k, lo_v, hi_v)
            s = _phi(sd_k, sd_v, ok)
            if MODE == RAW:
                tl.store(out_ptr + orow + start + tt, s, mask=tm)
            else:
                key = _key(tl.where(ok, s, float("-inf")), tt, BLOCK_L)  # NaN ranks lowest
                _emit(_beaten(key, key), start + tt, tm, quota_j, off, out_ptr, orow, lag, krow, vrow, skn,
                      svn, ko_ptr, vo_ptr, dd, D, MODE)
        else:
            # chunks of BLOCK_T tokens: per-token stds through the scratch row, kept rows re-read
            for t0 in range(0, lag, BLOCK_T):
                t = t0 + tt
                tm = t < lag
                src = (start + t).to(tl.int64)[:, None]
                sd_k, sd_v, ok, lo_k, hi_k, lo_v, hi_v = _tile(krow, vrow, src, skn, svn, tm, dd, D, nlo_k, inv_k,
                                                               nlo_v, inv_v, lo_k, hi_k, lo_v, hi_v)
                tl.store(trow + start + t, sd_k, mask=tm)
                tl.store(trow + N + start + t, sd_v, mask=tm)
            tl.debug_barrier()
            ll = tl.arange(0, BLOCK_L)
            sd_k = tl.load(trow + start + ll, mask=ll < lag, other=float("nan"))
            sd_v = tl.load(trow + N + start + ll, mask=ll < lag, other=float("nan"))
            ok = (sd_k == sd_k) & (sd_v == sd_v)
            s = _phi(sd_k, sd_v, ok)
            tl.debug_barrier()
            if MODE == RAW:
                tl.store(out_ptr + orow + start + ll, s, mask=ll < lag)
            else:
                tl.store(trow + start + ll, tl.where(ok, s, float("-inf")), mask=ll < lag)
                tl.debug_barrier()
                base = off
                for t0 in range(0, lag, BLOCK_T):
                    t = t0 + tt
                    tm = t < lag
                    ki = _key(tl.load(trow + start + t, mask=tm, other=0.0), t, BLOCK_L)
                    nb = tl.zeros([BLOCK_T], dtype=tl.int32)
                    for j0 in range(0, lag, BLOCK_J):
                        jj = j0 + tl.arange(0, BLOCK_J)
                        kj = _key(tl.load(trow + start + jj, mask=jj < lag, other=float("-inf")), jj, BLOCK_L)
                        nb += _beaten(ki, kj)
                    base += _emit(nb, start + t, tm, quota_j, base, out_ptr, orow, lag, krow, vrow, skn, svn, ko_ptr,
                                  vo_ptr, dd, D, MODE)


def _channels(block_t: int, block_d: int, vec: int, warps: int) -> tuple[int, int, int]:
    """How Triton's coalescing spreads a token's channels in a ``[block_t, block_d]`` load over ``warps`` warps:
    (elements per thread, lanes, warps) along the channels — a ``vec``-element vector per thread (16 bytes when the
    launch is ``_aligned``, else 1) unless the tile has fewer elements per thread. It fixes the order of the
    per-token sums over channels (the std); ``benchmarks/lagkv_tilings.py --layouts`` checks it on the TTGIR."""
    vec = max(1, min(vec, block_d, block_t * block_d // (32 * warps)))
    lanes = min(32, block_d // vec)
    return vec, lanes, max(1, min(warps, block_d // (vec * lanes)))


def _aligned(*ts: torch.Tensor) -> bool:
    """Whether a launch over K/V ``ts`` is specialised as 16-byte aligned pointers and strides (of the first
    three dims) divisible by 16 — what lets Triton load a token's channels as 16-byte vectors. The pointer from
    the storage offset (allocations start 16-byte aligned; it also holds for tensors without data, as traced)."""
    return all(x % 16 == 0 for t in ts for x in (t.storage_offset() * t.element_size(), *t.stride()[:3]))


@host_cache(1024)  # pure; called on every launch (the result is shared: read only)
def _tiling(lag: int, d: int, itemsize: int, tile: int = 0, warps: int = 0, aligned: bool = True):
    """(BLOCK_L, BLOCK_T, BLOCK_D, BLOCK_J, num_warps) for partitions of ``lag`` tokens of ``d`` channels:
    ``tile`` tokens per chunk (BLOCK_T = min(tile, BLOCK_L); BLOCK_L: whole partitions) and ``warps`` per
    program, 0 = the default. Every tiling gives the same bits: the sums over tokens are in fixed point
    (``_sum_fixed``), min/max and ranks are exact, and the per-token std sums over channels keep the default's
    order — a tiling whose channel layout (``_channels``; ``aligned``: the launch's, ``_aligned``) differs is
    refused (ValueError); with ``tile`` and no ``warps``, the warps nearest 32 fp32 per thread and tensor that
    keep it."""
    block_l, block_d = next_pow2(lag), next_pow2(d)
    if block_l <= 128 and block_l * block_d <= WHOLE_TILE:
        # whole partition: K and V as fp32 [BLOCK_L, BLOCK_D] tiles, one live at a time; 128 x 128 fits
        # 16 warps at 128 registers without spills (8 warps: ~190 registers, one 8-warp program per SM)
        block_t, w = block_l, max(4, min(16, block_l * block_d // 1024))
    else:
        block_t, w = max(1, min(block_l, 4096 // block_d)), 8
    vec = 16 // itemsize if aligned else 1
    default = _channels(block_t, block_d, vec, w)  # the GPU default's, under the interpreter too
    if tile or warps:
        block_t = min(tile, block_l) if tile else block_t
        same = [x for x in (1, 2, 4, 8, 16) if _channels(block_t, block_d, vec, x) == default]
        if not same or (warps and warps not in same):
            raise ValueError(f"tile {tile} / warps {warps}: a [{block_t}, {block_d}] tile lays a token's channels "
                             f"out (per thread, lanes, warps) unlike the default {default} with "
                             f"{'any warps' if not same else f'{warps} warps (these keep it: {same})'}"
                             f"{'' if aligned else ' (inputs not 16-byte aligned: scalar loads)'}, so its stds "
                             f"would round differently")
        aim = max(1, min(16, block_t * block_d // 1024)).bit_length()  # 32 fp32 per thread and tensor
        w = warps or min(same, key=lambda x: (abs(x.bit_length() - aim), x))
    elif INTERPRET:  # ~0.5 ms per program and per op: whole-partition tiles
        block_t, w = block_l, 4
    return block_l, block_t, block_d, max(1, min(block_l, 4096 // block_t)), w


# Tilings the GPU session times against the default (``benchmarks/gpu_session.sh tuning``), as (tile, warps):
# token chunks small enough that several programs share an SM — 3, 8, 12 and 16 on an H100 with Triton 3.6
# (benchmarks/results/lagkv_tilings.md) — to hide each partition's chain of dependent loads and barriers (module
# docstring). (0, 0) is the default.
TILINGS = ((0, 0), (16, 4), (8, 2), (8, 1), (4, 1))
# Software-pipelined stages of a program's walk over its partitions (``tl.range(num_stages=)``): with 2 the next
# partition's K/V tiles are read (cp.async into shared memory) while this one is ranked. Timed by the same tuning
# part; 1 (not pipelined) until a GPU run says otherwise. The default tiling at 2 takes ~213 KB of shared memory:
# it fits an H100's 227 KB, not an A100's 163 KB.
STAGES = 1


def _blocks(lag: int, d: int, itemsize: int, n_scored: int, rows: int, parts: int, tile: int = 0, warps: int = 0,
            aligned: bool = True):
    """(parts per program, BLOCK_L, BLOCK_T, BLOCK_D, BLOCK_J, num_warps). The blocks depend on
    (lag, d, dtype, tile, warps, alignment) only, so a partition's result does not depend on where it sits, how
    long the row is or the grid."""
    block_l, block_t, block_d, block_j, w = _tiling(lag, d, itemsize, tile, warps, aligned)
    if INTERPRET:  # one program per row
        return parts or max(n_scored, 1), block_l, block_t, block_d, block_j, w
    # runs of consecutive partitions, so that each partition is read about once (a run re-reads only
    # its last partition's reference): one wave, ~132 programs at one 16-warp program per SM (smaller
    # programs: as many more as fit 16 warps), runs of at most 32. An H100 run (Triton 3.6,
    # ``benchmarks/gpu_session.sh tuning``, 8 rows, CUDA graph), µs by parts: 4K (30 scored a row): 1: 60.2,
    # 2: 49.8, 4: 77.3; 32K (254): 8: 276.6, 16: 266.0, 32: 489.5; 128K (1022): 16: 992.6, 32: 971.8. This
    # picks 2, 16 and 32, the fastest at each (the former ~264 programs picked 1, 8 and 16).
    parts = parts or max(1, min(32, cdiv(n_scored * rows, 132 * (max(1, 16 // w) if tile or warps else 1))))
    return parts, block_l, block_t, block_d, block_j, w


def num_partitions(n: int, sink: int, lag: int) -> int:
    """P = ⌊(n − sink)/lag⌋ when n ≥ sink + 2·lag (something can be scored), else 0."""
    return (n - sink) // lag if n >= sink + 2 * lag else 0


def _run(keys, values, out, ko, vo, mode: int, sink: int, lag: int, eps: float, parts: int, quota: int = 0,
         rem: int = 0, window: int = 0, tile: int = 0, warps: int = 0) -> None:
    """One launch of ``_lagkv_kernel`` over every row: scored partitions plus the protected program."""
    B, H, N, D = keys.shape
    R = B * H
    n_scored = max(num_partitions(N, sink, lag) - 1, 0)
    parts, BLOCK_L, BLOCK_T, BLOCK_D, BLOCK_J, warps = _blocks(lag, D, keys.element_size(), n_scored, R, parts,
                                                               tile, warps, _aligned(keys, values))
    n_runs = cdiv(n_scored, parts)
    chunked = BLOCK_T < BLOCK_L and n_scored > 0
    tmp = torch.empty((R, 2, N) if chunked else (1,), dtype=torch.float32, device=keys.device)
    n_out = ko.shape[2] if mode == SELECT.value else 0
    launch(_lagkv_kernel, (n_runs + max(1, cdiv(sink + window, BLOCK_T)), R), keys, values, out, ko, vo, tmp, H,
           keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
           N, D, sink, lag, n_scored, parts, n_runs, quota, rem, n_out, window, eps,
           BLOCK_L=BLOCK_L, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, BLOCK_J=BLOCK_J, MODE=mode, STAGES=STAGES,
           num_warps=warps)


# ------------------------------------------------------------------------------------------------
# PyTorch bodies (CPU outside the interpreter)

def _lagkv_phi(z: torch.Tensor, ok: torch.Tensor, eps: float) -> torch.Tensor:
    """φ_Z of Eqs. 5–8 for every scored partition at once: ``z`` fp32 ``[B, H, P, L, D]`` (P ≥ 2
    partitions), ``ok`` bool ``[B, H, P, L]`` (finite tokens) -> ``[B, H, P−1, L]``. Partition j is
    min–max normalised by the finite tokens of partition j+1 (lo = 0, range 1 when there is none),
    then each token's std over channels (divisor D−1, two-pass: the mean, then the norm of the
    deviations / √(D−1)), then a softmax over the partition's finite tokens (0 elsewhere)."""
    ref, okr = z[:, :, 1:], ok[:, :, 1:, :, None]
    lo = torch.where(okr, ref, float("inf")).amin(dim=3, keepdim=True)
    hi = torch.where(okr, ref, float("-inf")).amax(dim=3, keepdim=True)
    has = lo < float("inf")
    rng = torch.where(has, (hi - lo).clamp_min(eps), 1.0)
    dev = (z[:, :, :-1] - torch.where(has, lo, 0.0)).div_(rng)  # one temporary, then in place
    dev.sub_(dev.sum(-1, keepdim=True) / z.shape[-1])
    sd = torch.linalg.vector_norm(dev, dim=-1) / math.sqrt(z.shape[-1] - 1)
    own = ok[:, :, :-1]
    e = torch.where(own, torch.exp(sd - torch.where(own, sd, float("-inf")).amax(-1, keepdim=True)), 0.0)
    return e / e.sum(-1, keepdim=True)


def _scored_torch(keys, values, sink: int, lag: int, eps: float):
    """φ_K + φ_V of the P−1 scored partitions, fp32 ``[B, H, P−1, L]`` (NaN on tokens with a
    non-finite key or value), or None when nothing is scored."""
    B, H, N, D = keys.shape
    P = num_partitions(N, sink, lag)
    if P < 2 or B * H == 0:
        return None
    span = slice(sink, sink + P * lag)
    k, v = (z[:, :, span].float().reshape(B, H, P, lag, D) for z in (keys, values))
    ok = torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1)
    s = _lagkv_phi(k, ok, eps) + _lagkv_phi(v, ok, eps)
    return torch.where(ok[:, :, :-1], s, float("nan"))


def _ranks_torch(s: torch.Tensor) -> torch.Tensor:
    """Within-partition ranks ρ (int64, same shape as ``s [..., L]``): one stable ascending sort of
    the partition read backwards (NaN first as −inf; among equal scores the higher index sorts first,
    so the lower index gets the higher rank), the sort positions scattered back to the tokens."""
    lag = s.shape[-1]
    order = torch.sort(torch.where(torch.isnan(s), float("-inf"), s).flip(-1), dim=-1, stable=True).indices
    pos = torch.arange(lag, device=s.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, lag - 1 - order, pos)


def _lagkv_torch(keys: torch.Tensor, values: torch.Tensor, sink: int, lag: int, eps: float,
                 rank: bool) -> torch.Tensor:
    """The score op's CPU body: φ_K + φ_V (or ρ/L with ``rank``) on the scored partitions, +inf elsewhere."""
    B, H, N, D = keys.shape
    out = torch.full((B, H, N), float("inf"), dtype=torch.float32, device=keys.device)
    s = _scored_torch(keys, values, sink, lag, eps)
    if s is not None:
        if rank:
            s = _ranks_torch(s).float() / lag
        out[:, :, sink:sink + s.shape[2] * lag] = s.reshape(B, H, -1)
    return out


def _compress_torch(keys, values, n_out: int, sink: int, lag: int, eps: float, quota: int, rem: int,
                    window: int):
    """The compress op's CPU body: partition j keeps its tokens of rank ρ ≥ L − q_j; the kept positions
    come out ascending from one sort (kept tokens keyed by position, the others pushed past N)."""
    B, H, N, D = keys.shape
    dev = keys.device
    parts = [torch.arange(sink, device=dev).expand(B, H, sink)]
    s = _scored_torch(keys, values, sink, lag, eps)
    if s is not None:
        n_scored = s.shape[2]
        q = quota + (torch.arange(n_scored, device=dev) < rem).to(torch.int64)
        keep = (_ranks_torch(s) >= lag - q[:, None]).reshape(B, H, -1)
        pos = torch.arange(sink, sink + n_scored * lag, device=dev)
        parts.append(torch.where(keep, pos, pos + N).sort(-1).values[..., :n_out - sink - window])
    parts.append(torch.arange(N - window, N, device=dev).expand(B, H, window))
    idx = torch.cat(parts, -1)
    g = idx[..., None].expand(B, H, n_out, D)
    return keys.gather(2, g), values.gather(2, g), idx


# ------------------------------------------------------------------------------------------------
# the ops

@triton_op("tritonkv::lagkv_score", mutates_args=())
def lagkv_score_op(keys: torch.Tensor, values: torch.Tensor, sink: int, lag: int, eps: float,
                   rank: bool, parts: int, tile: int = 0, warps: int = 0) -> torch.Tensor:
    """The raw op: keys/values ``[B, H, N, D]`` (last dim unit-stride) -> fp32 ``[B, H, N]``.
    ``parts`` (partitions per program), ``tile`` and ``warps`` (``_tiling``; 0 = automatic) never change the
    result."""
    if not use_triton(keys):
        return _lagkv_torch(keys, values, sink, lag, eps, rank)
    B, H, N, D = keys.shape
    out = torch.empty((B, H, N), dtype=torch.float32, device=keys.device)
    if B * H > 0 and N > 0:
        sink = min(sink, N)
        tail = N - sink - max(num_partitions(N, sink, lag) - 1, 0) * lag
        _run(keys, values, out, keys, values, (RANK if rank else RAW).value, sink, lag, eps, parts, window=tail,
             tile=tile, warps=warps)
    return out


@triton_op("tritonkv::lagkv_compress", mutates_args=())
def lagkv_compress_op(keys: torch.Tensor, values: torch.Tensor, n_out: int, sink: int, lag: int, eps: float,
                      quota: int, rem: int, window: int, parts: int, tile: int = 0,
                      warps: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The raw op: keys/values ``[B, H, N, D]`` (last dim unit-stride) -> kept keys/values
    ``[B, H, n_out, D]`` and int64 indices ``[B, H, n_out]``: the sinks ``[0, sink)``, q_j =
    ``quota`` + [j < ``rem``] tokens of each scored partition j, the last ``window`` tokens."""
    if not use_triton(keys):
        return _compress_torch(keys, values, n_out, sink, lag, eps, quota, rem, window)
    B, H, N, D = keys.shape
    ko = torch.empty((B, H, n_out, D), dtype=keys.dtype, device=keys.device)
    vo = torch.empty((B, H, n_out, D), dtype=values.dtype, device=values.device)
    idx = torch.empty((B, H, n_out), dtype=torch.int64, device=keys.device)
    if B * H > 0 and n_out > 0:
        _run(keys, values, idx, ko, vo, SELECT.value, sink, lag, eps, parts, quota, rem, window, tile, warps)
    return ko, vo, idx


# ------------------------------------------------------------------------------------------------
# public functions

def _check(keys, values, sink, lag, eps) -> None:
    check_kv_tensor("keys", keys)
    check_kv_tensor("values", values)
    if values.shape != keys.shape:
        raise ValueError(f"values must have the shape of keys {tuple(keys.shape)}, got {tuple(values.shape)}")
    if values.dtype != keys.dtype:
        raise TypeError(f"values must have the dtype of keys ({keys.dtype}), got {values.dtype}")
    if keys.shape[-1] < 2:
        raise ValueError(f"keys: LagKV's std over channels needs a head dim >= 2, got {keys.shape[-1]}")
    if isinstance(sink, bool) or not isinstance(sink, int) or sink < 0:
        raise ValueError(f"sink must be a non-negative int, got {sink!r}")
    if isinstance(lag, bool) or not isinstance(lag, int) or lag < 1:
        raise ValueError(f"lag must be a positive int, got {lag!r}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")


def _check_tiling(keys, values, lag: int, parts, tile, warps) -> None:
    """``parts``, ``tile`` and ``warps`` ints >= 0, ``tile`` a power of two, ``warps`` one of 1 … 16, and a
    tiling that gives the default's bits (``_tiling``; while traced the strides and storage offset are not
    readable, so the launch checks it — the same ``ValueError``, when the compiled graph first runs)."""
    for name, v in (("parts", parts), ("tile", tile), ("warps", warps)):
        check_int(name, v)
    if tile & (tile - 1):
        raise ValueError(f"tile must be 0 or a power of two, got {tile}")
    if warps not in (0, 1, 2, 4, 8, 16):
        raise ValueError(f"warps must be 0 or a power of two up to 16, got {warps}")
    if not torch.compiler.is_compiling():
        _tiling(lag, keys.shape[-1], keys.element_size(), tile, warps, _aligned(keys, values))


def lagkv_scores(keys: torch.Tensor, values: torch.Tensor, *, sink: int = 16, lag: int = 128,
                 eps: float = 1e-6, rank: bool = True, parts: int = 0, tile: int = 0, warps: int = 0) -> torch.Tensor:
    """LagKV scores, fp32 ``[B, H, N]`` (higher = keep).

    Scored partitions get φ_K + φ_V, or with ``rank`` their within-partition rank ρ/L; sinks, the
    tail and rows with N < sink + 2·lag get +inf; a token with a non-finite key or value gets NaN
    (rank: the lowest of its partition). ``parts`` (partitions per program), ``tile`` (tokens per chunk of
    a partition, a power of two) and ``warps`` (per program), each 0 = automatic, are tuning knobs: they change
    the grid and the program, never the result (a tiling that could is refused).
    """
    _check(keys, values, sink, lag, eps)
    keys, values = row_major(keys), row_major(values)
    _check_tiling(keys, values, lag, parts, tile, warps)
    return lagkv_score_op(keys, values, sink, lag, float(eps), bool(rank), int(parts), int(tile), int(warps))


def lagkv_compress(keys: torch.Tensor, values: torch.Tensor, k: int, *, sink: int, lag: int, quota: int,
                   rem: int = 0, window: int, eps: float = 1e-6, parts: int = 0, tile: int = 0, warps: int = 0):
    """LagKV's kept tokens in one launch: ``(keys, values, indices)``, ``[B, H, k, D]`` and int64
    ``[B, H, k]`` in ascending original order — the first ``sink`` tokens, the top q_j = ``quota`` +
    [j < ``rem``] by rank of each scored partition j (ties and NaN as in ``lagkv_scores``), and the
    last ``window`` tokens. ``k`` must equal sink + window + Σ q_j; ``sink`` is also where the
    partitions start. (Budget mode: ``divmod(k − S − |tail|, P − 1)``; paper mode: ``quota`` = m.)
    ``parts``, ``tile`` and ``warps``: as in ``lagkv_scores`` (never change the result)."""
    _check(keys, values, sink, lag, eps)
    keys, values = row_major(keys), row_major(values)
    _check_tiling(keys, values, lag, parts, tile, warps)
    N = keys.shape[2]
    for name, v in (("k", k), ("quota", quota), ("rem", rem), ("window", window)):
        check_int(name, v)
    n_scored = max(num_partitions(N, sink, lag) - 1, 0)
    if quota > lag or (quota == lag and rem) or rem > n_scored or (n_scored == 0 and (quota or rem)):
        raise ValueError(f"quota {quota} (+1 in the first rem = {rem}) per partition must fit the {n_scored} "
                         f"scored partitions of lag {lag}")
    if sink + window > N or (n_scored and sink + n_scored * lag > N - window):
        raise ValueError(f"window {window} must lie within the {N} tokens after the sink {sink} and the scored "
                         f"partitions")
    if k != sink + window + quota * n_scored + rem:
        raise ValueError(f"k must be sink + window + quota·(P−1) + rem = "
                         f"{sink + window + quota * n_scored + rem}, got {k}")
    return lagkv_compress_op(keys, values, k, sink, lag, float(eps), quota, rem, window, parts, tile, warps)
