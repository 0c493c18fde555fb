"""LagKV's lag-relative score (LagKV §2.2, Eqs. 5–9; ``docs/algorithms.md`` §1.5).

A row of T tokens is cut, after its S sinks, into P = ⌊(T−S)/L⌋ partitions of L tokens,
π_j = [S + jL, S + (j+1)L). Partitions 0 … P−2 are each scored against the *raw* next one: for
Z ∈ {K, V}, the per-channel min/max of π_{j+1} min–max normalise π_j (range floored at ε), each
token's std over channels (divisor d−1) goes through a softmax over the partition's tokens, and
score = φ_K + φ_V. With ``rank`` the score becomes the within-partition rank ρ/L (ρ ∈ 0 … L−1,
higher is better, equal scores give the lower index the higher rank), counted in the kernel.
Sinks, the tail [S + (P−1)L, T) and rows too short to score (T < S + 2L) get +inf.

One program handles a run of consecutive partitions of one row, walking them from the last to
the first, so the min/max of π_j is gathered while π_j is being scored and each partition is read
once (plus the reference of the run's last partition). Per partition: pass 1 streams the tokens
in [BLOCK_T, D, 2] tiles (K and V joined, so each statistic is one reduction for both) and writes
the per-token stds of K and V to ``out``/``tmp`` (scratch); the softmax and the rank then read
them back as [BLOCK_L] vectors (``tl.debug_barrier`` orders the round trip between the program's
threads). On the CPU (outside the interpreter) the op runs ``_lagkv_torch``: the same steps on all
partitions at once.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import INTERPRET, check_kv_tensor, launch, next_pow2, row_major, triton_op, use_triton


@triton.jit(do_not_specialize=["n_scored", "parts"])  # a new N compiles nothing new
def _lagkv_score_kernel(k_ptr, v_ptr, out_ptr, tmp_ptr, H, skb, skh, skn, svb, svh, svn, N, D,
                        sink, lag, n_scored, parts, eps,
                        BLOCK_L: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_J: tl.constexpr, RANK: tl.constexpr):
    # K and V travel together as one [BLOCK_T, BLOCK_D, 2] tile (tl.join(K, V)), so every statistic
    # is one reduction for both (under the interpreter each reduction costs ~3 ms). Helpers are
    # inlined for the same reason: every @triton.jit call costs ~2 ms there.
    eps = tl.cast(eps, tl.float32)  # torch.compile passes Python floats as fp64: keep the arithmetic fp32
    c = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    krow = k_ptr + (r // H) * skb + (r % H) * skh
    vrow = v_ptr + (r // H) * svb + (r % H) * svh
    orow = out_ptr + r * N
    trow = tmp_ptr + r * N
    j_lo = c * parts
    j_hi = tl.minimum(j_lo + parts, n_scored)
    t2 = tl.arange(0, BLOCK_T)[:, None]
    d2 = tl.arange(0, BLOCK_D)[None, :]
    z2 = tl.arange(0, 2)[None, :]  # 0 = K, 1 = V
    sd_row = tl.where(z2 == 0, orow, trow)  # per-token stds of K -> out, of V -> tmp
    ll = tl.arange(0, BLOCK_L)
    lmask = ll < lag

    # per-channel min/max (Eqs. 5-6) of the reference of the run's last partition
    lo = tl.full([BLOCK_D, 2], float("inf"), tl.float32)
    hi = tl.full([BLOCK_D, 2], float("-inf"), tl.float32)
    ref = sink + j_hi * lag
    for t0 in range(0, lag, BLOCK_T):
        pos = (ref + t0 + t2).to(tl.int64)
        m2 = ((t0 + t2) < lag) & (d2 < D)
        m = m2[:, :, None]
        zz = tl.join(tl.load(krow + pos * skn + d2, mask=m2, other=0.0).to(tl.float32),
                     tl.load(vrow + pos * svn + d2, mask=m2, other=0.0).to(tl.float32))
        nan = tl.sum(tl.where(m & (zz != zz), zz, 0.0), 0)  # NaN where a channel holds one
        lo = tl.minimum(lo, tl.min(tl.where(m, zz, float("inf")), 0) + nan, propagate_nan=tl.PropagateNan.ALL)
        hi = tl.maximum(hi, tl.max(tl.where(m, zz, float("-inf")), 0) + nan, propagate_nan=tl.PropagateNan.ALL)

    for q in range(j_lo, j_hi):
        start = sink + (j_hi - 1 - (q - j_lo)) * lag  # the run is walked from its last partition down
        # pass 1: per-token std over channels (divisor D-1) of K and V min-max normalised by the
        # reference (Eq. 7) -> out (K) and tmp (V); meanwhile the min/max of this partition
        rng = tl.maximum(hi - lo, eps)[None, :, :]
        lo3 = lo[None, :, :]
        lo = tl.full([BLOCK_D, 2], float("inf"), tl.float32)
        hi = tl.full([BLOCK_D, 2], float("-inf"), tl.float32)
        for t0 in range(0, lag, BLOCK_T):
            pos = (start + t0 + t2).to(tl.int64)
            m2 = ((t0 + t2) < lag) & (d2 < D)
            m = m2[:, :, None]
            zz = tl.join(tl.load(krow + pos * skn + d2, mask=m2, other=0.0).to(tl.float32),
                         tl.load(vrow + pos * svn + d2, mask=m2, other=0.0).to(tl.float32))
            zn = tl.where(m, (zz - lo3) / rng, 0.0)
            dev = tl.where(m, zn - (tl.sum(zn, 1) / D)[:, None, :], 0.0)
            sd = tl.sqrt(tl.sum(dev * dev, 1) / (D - 1))  # [BLOCK_T, 2]
            tl.store(sd_row + start + t0 + t2, sd, mask=((t0 + t2) < lag) & (z2 < 2))
            nan = tl.sum(tl.where(m & (zz != zz), zz, 0.0), 0)
            lo = tl.minimum(lo, tl.min(tl.where(m, zz, float("inf")), 0) + nan, propagate_nan=tl.PropagateNan.ALL)
            hi = tl.maximum(hi, tl.max(tl.where(m, zz, float("-inf")), 0) + nan, propagate_nan=tl.PropagateNan.ALL)
        tl.debug_barrier()
        # Eqs. 8-9: softmax over the partition's tokens of each std, then K score + V score
        sd = tl.load(sd_row + start + ll[:, None], mask=lmask[:, None] & (z2 < 2), other=float("-inf"))
        e = tl.exp(sd - tl.max(sd, 0)[None, :])
        s = tl.sum(e / tl.sum(e, 0)[None, :], 1)  # [BLOCK_L]
        tl.debug_barrier()
        if RANK:
            # rank rho_i = #{j: s_j < s_i} + #{j > i: s_j == s_i}
            s = tl.where(s != s, float("-inf"), s)  # NaN ranks lowest (ties: the lower index ranks higher)
            tl.store(trow + start + ll, s, mask=lmask)
            tl.debug_barrier()
            rank = tl.zeros([BLOCK_L], dtype=tl.int32)
            for j0 in range(0, lag, BLOCK_J):
                jj = j0 + tl.arange(0, BLOCK_J)
                sj = tl.load(trow + start + jj, mask=jj < lag, other=0.0)
                below = (sj[None, :] < s[:, None]) | ((sj[None, :] == s[:, None]) & (jj[None, :] > ll[:, None]))
                rank += tl.sum((below & (jj < lag)[None, :]).to(tl.int32), 1)
            s = rank.to(tl.float32) / lag
        tl.store(orow + start + ll, s, mask=lmask)


def _blocks(lag: int, d: int, n_scored: int, rows: int, parts: int):
    """(parts per program, BLOCK_L, BLOCK_T, BLOCK_D, BLOCK_J). The blocks depend on (lag, d) only,
    so a partition's scores do not depend on where it sits, how long the row is or the grid."""
    block_l, block_d = next_pow2(lag), next_pow2(d)
    if INTERPRET:  # ~0.5 ms per program and per op: one program per row, whole-partition tiles
        return parts or max(n_scored, 1), block_l, block_l, block_d, block_l
    # [BLOCK_T, BLOCK_D] tiles of 1024 elements: 4 per thread at 8 warps. The per-channel min/max
    # vectors (old and new, K and V: four [BLOCK_D, 2] values) live in the slice of the tile's layout
    # over tokens, replicated across the threads that tile the token axis, so they cost as much as
    # the tile width per thread: at 2048-element tiles (8 per thread) they alone held 64 registers and
    # the kernel 172-210 (1 CTA/SM); at 1024 it is 118 (sm_90). The rank's [BLOCK_L, BLOCK_J]
    # comparison is kept at 4096 elements for the same reason.
    block_t = max(1, min(block_l, 1024 // block_d))
    block_j = max(1, min(block_l, 4096 // block_l))
    # >= ~4 programs per SM, and each partition read about once (runs of consecutive partitions)
    parts = parts or max(1, min(16, (n_scored * rows) // 528))
    return parts, block_l, block_t, block_d, block_j


def num_partitions(n: int, sink: int, lag: int) -> int:
    """P = ⌊(n − sink)/lag⌋ when n ≥ sink + 2·lag (something can be scored), else 0."""
    return (n - sink) // lag if n >= sink + 2 * lag else 0


def _lagkv_phi(z: torch.Tensor, eps: float) -> torch.Tensor:
    """φ_Z of Eqs. 5–8 for every scored partition at once: ``z`` fp32 ``[B, H, P, L, D]`` (P ≥ 2
    partitions) -> ``[B, H, P−1, L]``. Partition j is min–max normalised by partition j+1 (amin/amax
    propagate NaN, like the kernel and the oracle), then each token's std over channels (divisor
    D−1, two-pass: the mean, then the norm of the deviations / √(D−1)), then a softmax over the
    partition's tokens written out (max, exp, sum) so NaN and +inf behave as in the kernel. One
    full-size temporary; the rest in place."""
    ref = z[:, :, 1:]
    lo, hi = ref.amin(dim=3, keepdim=True), ref.amax(dim=3, keepdim=True)
    dev = (z[:, :, :-1] - lo).div_((hi - lo).clamp_min(eps))  # one temporary, then in place
    dev.sub_(dev.sum(-1, keepdim=True) / z.shape[-1])
    sd = torch.linalg.vector_norm(dev, dim=-1) / math.sqrt(z.shape[-1] - 1)
    e = torch.exp(sd - sd.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def _lagkv_torch(keys: torch.Tensor, values: torch.Tensor, sink: int, lag: int, eps: float,
                 rank: bool) -> torch.Tensor:
    """The op's CPU body: the P partitions of every row as one fp32 ``[B, H, P, L, D]`` view per
    tensor, φ_K + φ_V on the first P−1 of them (``_lagkv_phi``), +inf elsewhere. With ``rank``
    each score becomes its within-partition rank ρ/L: one stable ascending sort of the partition
    read backwards (NaN first as −inf; among equal scores the higher index sorts first, so the
    lower index gets the higher rank), the sort positions scattered back to the tokens."""
    B, H, N, D = keys.shape
    out = torch.full((B, H, N), float("inf"), dtype=torch.float32, device=keys.device)
    P = num_partitions(N, sink, lag)
    if P < 2 or B * H == 0:
        return out
    span = slice(sink, sink + P * lag)
    k, v = (z[:, :, span].float().reshape(B, H, P, lag, D) for z in (keys, values))
    s = _lagkv_phi(k, eps) + _lagkv_phi(v, eps)
    if rank:
        s = torch.where(torch.isnan(s), float("-inf"), s).flip(-1)
        order = torch.sort(s, dim=-1, stable=True).indices  # positions in the flipped partition
        pos = torch.arange(lag, device=keys.device, dtype=torch.float32).expand_as(s)
        s = torch.empty_like(s).scatter_(-1, lag - 1 - order, pos) / lag
    out[:, :, sink:sink + (P - 1) * lag] = s.reshape(B, H, (P - 1) * lag)
    return out


@triton_op("tritonkv::lagkv_score", mutates_args=())
def lagkv_score_op(keys: torch.Tensor, values: torch.Tensor, sink: int, lag: int, eps: float,
                   rank: bool, parts: int) -> torch.Tensor:
    """The raw op: keys/values ``[B, H, N, D]`` (last dim unit-stride) -> fp32 ``[B, H, N]``.
    ``parts``: partitions per program (0 = automatic); it never changes the result."""
    if not use_triton(keys):
        return _lagkv_torch(keys, values, sink, lag, eps, rank)
    B, H, N, D = keys.shape
    out = torch.full((B, H, N), float("inf"), dtype=torch.float32, device=keys.device)
    n_scored = num_partitions(N, sink, lag) - 1
    if n_scored >= 1 and B * H > 0:
        tmp = torch.empty_like(out)
        parts, BLOCK_L, BLOCK_T, BLOCK_D, BLOCK_J = _blocks(lag, D, n_scored, B * H, parts)
        launch(_lagkv_score_kernel, (triton.cdiv(n_scored, parts), B * H), keys, values, out, tmp, H,
               keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
               N, D, sink, lag, n_scored, parts, eps,
               BLOCK_L=BLOCK_L, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, BLOCK_J=BLOCK_J, RANK=rank,
               num_warps=8 if BLOCK_T * BLOCK_D >= 1024 else 4)
    return out


def lagkv_scores(keys: torch.Tensor, values: torch.Tensor, *, sink: int = 16, lag: int = 128,
                 eps: float = 1e-6, rank: bool = True, parts: int = 0) -> torch.Tensor:
    """LagKV scores, fp32 ``[B, H, N]`` (higher = keep).

    Scored partitions get φ_K + φ_V, or with ``rank`` their within-partition rank ρ/L; sinks, the
    tail and rows with N < sink + 2·lag get +inf. ``parts`` (partitions per program, 0 = automatic)
    changes the grid, never the result.
    """
    check_kv_tensor("keys", keys)
    check_kv_tensor("values", values)
    if values.shape != keys.shape:
        raise ValueError(f"values must have the shape of keys {tuple(keys.shape)}, got {tuple(values.shape)}")
    if keys.shape[-1] < 2:
        raise ValueError(f"keys: LagKV's std over channels needs a head dim >= 2, got {keys.shape[-1]}")
    if isinstance(sink, bool) or not isinstance(sink, int) or sink < 0:
        raise ValueError(f"sink must be a non-negative int, got {sink!r}")
    if isinstance(lag, bool) or not isinstance(lag, int) or lag < 1:
        raise ValueError(f"lag must be a positive int, got {lag!r}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")
    return lagkv_score_op(row_major(keys), row_major(values), sink, lag, float(eps), bool(rank), int(parts))
