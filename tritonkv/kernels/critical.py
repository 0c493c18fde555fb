"""CriticalKV's projected-value norms (CriticalKV §3.4; ``docs/algorithms.md`` §1.6).

For KV head h with query heads G(h) = {h·G, …, h·G + G − 1} and ``o_proj`` weight W_O
``[D_model, H_q·d]`` (nn.Linear layout: attention output o = x W_Oᵀ with x = concat of heads)::

    n_j = (1/G) Σ_{q∈G(h)} ‖ W_O[:, q·d:(q+1)·d] · v_j ‖₁         (the group mean of ‖v_j W_O^q‖₁)

One launch covers every (batch row, KV head) as a tiled GEMM per KV head, ``[N, d] x [d, G·D_model]``
with K = d, on a grid (token tiles, rows): a program loads its tile of values ``[BLOCK_N, d]`` once and
walks all G·⌈D_model/BLOCK_M⌉ column tiles of its group's W_O in one loop, each a ``[BLOCK_N, d] x
[d, BLOCK_M]`` ``tl.dot`` (the whole head dimension in one product) whose absolute values it sums over
the columns in fp32; the W_O tiles stream in through the software pipeline (cp.async, a few tiles
ahead). Rows run KV head by KV head (batch rows inner), so the programs running together share a
KV head and hit the same W_O tiles in L2: W_O is fetched from HBM about once, and each tile a
program fetches from L2 serves 2·BLOCK_N flops per byte. On the GPU, fp16/bf16 operands of one
dtype go to the tensor cores as they are (products exact, fp32 accumulation); otherwise (fp32,
mixed dtypes, the interpreter, whose bf16 ``tl.dot`` is wrong) both are cast to fp32 and multiplied
in IEEE fp32 (no TF32). Work: 2·B·H_q·N·d·D_model flops (1.1 TFLOP at B = 1, H_q = 32, N = 32K,
d = 128, D_model = 4096), so the floor is the tensor cores' peak, not memory.

On the CPU (outside the interpreter) the op runs ``_value_norms_torch``: the same projections as
batched fp32 matmuls over token chunks.

**CriticalKV's stage 2** (both norms, ``_stage2_epilogue``): given the base scores s, a kernel writes
(s + ε)·n instead of n (the same fp32 add and multiply as PyTorch's, so the same bits), and, given a
``hist0`` buffer, the stage-2 select's first radix pass over what it wrote, with the sink, the window
and the stage-1 tokens (``forced``) protected: no torch op and no select launch of its own. A program
counts its own token tile, so only tiles of at least ``FUSED_MIN_CHUNK`` tokens do, at most
``FUSED_MAX_SLOTS`` a row (each adds a 1 KB slot that the select's next pass sums); the PyTorch bodies
combine (s + ε)·n as PyTorch ops.

**Non-finite values** (``docs/contracts.md``): a token whose value has a NaN or ±inf element gets a
NaN norm (it ranks lowest), in both norms, on the kernels and the PyTorch bodies alike; the flag
comes from the tile each program has loaded anyway (no extra pass over the values).

**The L2 option** (``norm="l2"``): n_j = (1/G) Σ_q ‖W_O^q v_j‖₂. With W_O^q = Q_q R_q (QR, R_q
``[d, d]`` triangular), ‖W_O^q v‖₂ = ‖R_q v‖₂ and R_qᵀ R_q = (W_O^q)ᵀ W_O^q is the head's Gram
matrix: per token G·d² multiply-adds instead of G·d·D_model (d = 128, D_model = 4096, G = 4,
N = 32K, H_kv = 8: about 34 GFLOP instead of 1.1 TFLOP). The factor, not the Gram matrix itself,
because ‖u R_qᵀ‖² is a sum of squares (the quadratic form u Γ uᵀ cancels in fp32 where W_O^q is
ill-conditioned) and needs no second pass over u. ``head_factors`` computes R_qᵀ for every query
head in float64 (once per call: 2·D_model·d² flops per head), ``split_factors`` stores it as two
bf16 halves hi + lo. ``_value_norm_l2_kernel`` (grid: token chunks, rows) scales each token by the
power of two at the top of its largest magnitude (exact; keeps the squares in fp32 range for any
finite value), splits u into bf16 hi (its first 8 significant bits, exact) + lo, and forms
u R_qᵀ ≈ u_hi·hi + u_hi·lo + u_lo·hi on the tensor cores with fp32 accumulation (u_lo = 0 for
bf16 values, so two products), in 32-channel slices of u and 64-column blocks of the product
(‖p‖² summed over the blocks; on the GPU 128 tokens a program); the interpreter runs the same bf16
operands multiplied in fp32. Error: |Δ‖p‖| ≤ (3d·ε₃₂ + 5·2⁻¹⁶)·‖|u| |R_qᵀ|‖ + (d + 4)·ε₃₂·‖p‖ per head
(measured ~10⁻⁵ relative on random heads; the L1 kernel's is ~10⁻⁶). The L2 norm is a different criterion from the paper's L1 norm: see
``tritonkv.policies.criticalkv`` for what it changes in the selection.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import (FLOAT_DTYPES, INTERPRET, cdiv, check_kv_tensor, launch, next_pow2, pdl_wait, row_major,
                      triton_op, use_triton)
from .select import NB, Hist0, hist0_buffer, hist0_of_chunk


@triton.jit
def _stage2_epilogue(out_ptr, s_ptr, f_ptr, h0_ptr, n, r, c, offs, nmask, N, eps, C0, sink, window,
                     BLOCK_N: tl.constexpr, HAS_S: tl.constexpr, HAS_FORCED: tl.constexpr, HIST: tl.constexpr,
                     NB: tl.constexpr, HIST_TILE: tl.constexpr):
    """Stores the norms ``n`` of tokens ``offs`` of row r (int64, = b·H + h), or with ``HAS_S`` CriticalKV's
    stage-2 scores (s + ε)·n (the base scores s read here); ``HIST``: then the stage-2 select's first radix pass
    over what was stored (``select.hist0_of_chunk``: chunk c of ``BLOCK_N`` tokens, ``sink``/``window`` and, with
    ``HAS_FORCED``, the stage-1 tokens of ``f_ptr`` protected), re-read from L1/L2 after a barrier."""
    if HAS_S:
        s = tl.load(s_ptr + r * N + offs, mask=nmask, other=0.0)
        n = (s + tl.cast(eps, tl.float32)) * n
    tl.store(out_ptr + r * N + offs, n, mask=nmask)
    if HIST:
        tl.debug_barrier()
        hist0_of_chunk(out_ptr + r * N, f_ptr + r * N, h0_ptr, r, c, C0, N, BLOCK_N, sink, window, HIST_TILE, NB,
                       HAS_FORCED)


@triton.jit(do_not_specialize=["C0", "sink", "window"])
def _value_norm_kernel(v_ptr, w_ptr, out_ptr, s_ptr, f_ptr, h0_ptr, B, H, G, N, D, DM, svb, svh, svn, swm, swc,
                       eps, C0, sink, window,
                       BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                       NATIVE_DOT: tl.constexpr, HAS_S: tl.constexpr, HAS_FORCED: tl.constexpr, HIST: tl.constexpr,
                       NB: tl.constexpr, HIST_TILE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    # rows in (KV head, batch row) order: the programs of the rows sharing a KV head, which read the
    # same W_O columns, run one after another, so W_O^h is fetched from HBM once and then hit in L2
    c = tl.program_id(0)
    r = tl.program_id(1)
    h = r // B
    b = r - h * B
    offs = c * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs < N
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    src = b.to(tl.int64) * svb + h.to(tl.int64) * svh + offs.to(tl.int64)[:, None] * svn + d[None, :]
    v = tl.load(v_ptr + src, mask=nmask[:, None] & dmask[None, :], other=0.0)
    if not NATIVE_DOT:
        v = v.to(tl.float32)
    finite = tl.sum(tl.where(v * 0.0 == 0.0, 0, 1), 1) == 0  # per token, from the tile loaded (x·0 = 0 iff finite)
    m = tl.arange(0, BLOCK_M)
    mt = tl.cdiv(DM, BLOCK_M)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    # one flat loop over the group's G·⌈D_model/BLOCK_M⌉ column tiles of W_O (the pipeliner prefetches
    # across query heads): p = v_tile · W_O^q[m0:m0+BLOCK_M]ᵀ, one [BLOCK_N, BLOCK_D] x [BLOCK_D, BLOCK_M]
    # product, then |p| summed over its columns; rows of W_O past D_model load as 0 and add |0|
    for t in range(0, G * mt):
        q = t // mt
        rows = (t - q * mt) * BLOCK_M + m
        col = (h * G + q) * D + d  # columns of query head q in W_O
        # w[c, m] = W_O[m0 + m, q·d + c]: a [BLOCK_D, BLOCK_M] tile of W_O^q transposed
        w = tl.load(w_ptr + rows.to(tl.int64)[None, :] * swm + col.to(tl.int64)[:, None] * swc,
                    mask=dmask[:, None] & (rows < DM)[None, :], other=0.0)
        if NATIVE_DOT:
            p = tl.dot(v, w)
        else:
            p = tl.dot(v, w.to(tl.float32), input_precision="ieee")
        acc += tl.sum(tl.abs(p), 1)
    _stage2_epilogue(out_ptr, s_ptr, f_ptr, h0_ptr, tl.where(finite, acc / G, float("nan")), (b * H + h).to(tl.int64),
                     c, offs, nmask, N, eps, C0, sink, window, BLOCK_N, HAS_S, HAS_FORCED, HIST, NB, HIST_TILE)


def _blocks(n: int, d: int, dm: int, native: bool):
    """(BLOCK_N, BLOCK_D, BLOCK_M, num_warps, num_stages); tl.dot needs every block >= 16.

    A program holds a tile of BLOCK_N tokens and streams its group's W_O^q column tiles from L2
    (cp.async, num_stages deep): each W_O byte it fetches serves 2·BLOCK_N flops, so the token tile
    is tall. Tensor cores (fp16/bf16), d <= 128: 256 tokens x 64 columns over 8 warps, the whole
    head dimension in one product (on sm_90 each warpgroup issues m64n64k16 wgmma from shared
    memory); at d = 128 (Triton 3.6 / 3.9) sm_90: 98 / 108 registers, 112 KB shared, no spill,
    2 programs per SM (one's |p| row sums overlap the other's products); sm_80: 159 / 167
    registers, 98 KB, 1 program. 128-column tiles took 172-184 registers on sm_90 (1 program per
    SM) and 249 on sm_80. IEEE fp32 products (fp32 or mixed dtypes) run on the FMA units:
    [32, 32] tiles over 4 warps (54-90 registers; [64, 64] spilled kilobytes)."""
    block_d = max(next_pow2(d), 16)
    if INTERPRET:  # ~0.5 ms per program: one program per row, whole W_O^q blocks
        return max(min(next_pow2(n), 1024), 16), block_d, max(min(next_pow2(dm), 1024), 16), 4, 1
    block_m = max(min(next_pow2(dm), 64 if native else 32), 16)
    if not native:
        return 32, block_d, block_m, 4, 2
    if block_d <= 128:
        return 256, block_d, block_m, 8, 3
    return 64, block_d, block_m, 8, 2


#: elements of the fp32 ``[B, H, G, chunk, D_model]`` projection block of ``_value_norms_torch``
#: (64 MiB): it sets the token chunk, so memory stays bounded whatever N and D_model are
TORCH_BLOCK = 1 << 24


def _value_norms_torch(values: torch.Tensor, o_proj: torch.Tensor) -> torch.Tensor:
    """The op's CPU body: for each token chunk, the projections of its values by every query head
    of their group, ``[B, H, 1, n, d] @ [H, G, d, D_model]`` (W_O^q transposed, a view) in fp32,
    then the L1 norm over D_model (one fused reduction) and the mean over the G heads. The chunk
    n keeps that block under ``TORCH_BLOCK`` elements; the chunk count depends only on shapes.
    IEEE fp32 throughout; a token whose value has a non-finite element gets NaN."""
    B, H, N, D = values.shape
    DM = o_proj.shape[0]
    G = o_proj.shape[1] // (H * D)
    w = o_proj.float().reshape(DM, H, G, D).permute(1, 2, 3, 0)  # [H, G, d, D_model]
    v = values.float().unsqueeze(2)  # [B, H, 1, N, d]
    chunk = max(1, TORCH_BLOCK // max(B * H * G * DM, 1))
    out = torch.empty((B, H, N), dtype=torch.float32, device=values.device)
    for t0 in range(0, N, chunk):
        p = v[:, :, :, t0:t0 + chunk] @ w  # [B, H, G, n, D_model]
        n = torch.linalg.vector_norm(p, ord=1, dim=-1).sum(2) / G
        out[:, :, t0:t0 + chunk] = torch.where(torch.isfinite(v[:, :, 0, t0:t0 + chunk]).all(-1), n, float("nan"))
    return out


def _stage2_torch(n: torch.Tensor, scores: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """The PyTorch bodies' epilogue: the norms, or with ``scores`` the stage-2 scores (s + ε)·n shaped like them."""
    return n if scores is None else ((scores.view(n.shape) + eps) * n).view(scores.shape)


def _stage2_launch(out, scores, forced, hist0, eps: float, sink: int, window: int, n: int, block_n: int,
                   warps: int) -> tuple:
    """``(tensors, scalars, constexprs)`` of a norm kernel's ``_stage2_epilogue``; absent tensors are passed as
    ``out`` (never read: the flags switch them off). ``hist0`` must have one slot per program (``block_n``
    tokens)."""
    if hist0 is not None and hist0.shape[1] - 1 != cdiv(n, block_n):
        raise ValueError(f"hist0 must have 1 + {cdiv(n, block_n)} slots (one per {block_n} tokens), "
                         f"got {tuple(hist0.shape)}")
    args = (out if scores is None else scores, out if forced is None else forced, out if hist0 is None else hist0)
    scalars = (float(eps), 0 if hist0 is None else hist0.shape[1] - 1, sink, window)
    tile = block_n if INTERPRET else max(block_n, 32 * warps)  # at least one key per thread (no replicated layout)
    flags = dict(HAS_S=scores is not None, HAS_FORCED=forced is not None, HIST=hist0 is not None, NB=NB,
                 HIST_TILE=tile)
    return args, scalars, flags


# no default on a mutated argument: torch < 2.12 drops trailing arguments equal to their default before it
# indexes the mutated ones by position (IndexError under a dispatch mode, torch.compile or export)
@triton_op("tritonkv::value_norms", mutates_args={"hist0"})
def value_norms_op(values: torch.Tensor, o_proj: torch.Tensor, scores: Optional[torch.Tensor],
                   forced: Optional[torch.Tensor], hist0: Optional[torch.Tensor], eps: float = 0.0,
                   sink: int = 0, window: int = 0) -> torch.Tensor:
    """The raw op: values ``[B, H, N, d]`` (last dim unit-stride), o_proj ``[D_model, H_q·d]``
    -> fp32 ``[B, H, N]``: the norms n, or with ``scores`` (fp32, contiguous, B·H·N elements) CriticalKV's
    stage-2 scores (s + ``eps``)·n, shaped like ``scores``. ``hist0`` (only with the kernel, its size from
    ``fused_chunk``; the PyTorch body leaves it alone): the int32 ``[B·H, 1 + chunks, NB]`` that the kernel
    fills with the stage-2 select's first radix pass, ``sink``/``window`` and the nonzero bytes of ``forced``
    (uint8, B·H·N, contiguous) protected."""
    if not use_triton(values):
        return _stage2_torch(_value_norms_torch(values, o_proj), scores, eps)
    B, H, N, D = values.shape
    DM = o_proj.shape[0]
    G = o_proj.shape[1] // (H * D)
    out = torch.empty((B, H, N) if scores is None else scores.shape, dtype=torch.float32, device=values.device)
    if B * H * N > 0:
        native = _native(values, o_proj)
        BLOCK_N, BLOCK_D, BLOCK_M, warps, stages = _blocks(N, D, DM, native)
        args, scalars, flags = _stage2_launch(out, scores, forced, hist0, eps, sink, window, N, BLOCK_N, warps)
        launch(_value_norm_kernel, (triton.cdiv(N, BLOCK_N), B * H), values, o_proj, out, *args, B, H, G, N, D, DM,
               values.stride(0), values.stride(1), values.stride(2), o_proj.stride(0), o_proj.stride(1), *scalars,
               BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, NATIVE_DOT=native, num_warps=warps,
               num_stages=stages, **flags)
    return out


def _native(values: torch.Tensor, o_proj: torch.Tensor) -> bool:
    """The L1 kernel multiplies fp16/bf16 operands of one dtype on the tensor cores (not when interpreting)."""
    return (not INTERPRET) and values.dtype == o_proj.dtype and values.dtype != torch.float32


@triton.jit(do_not_specialize=["C0", "sink", "window"])
def _value_norm_l2_kernel(v_ptr, f_ptr, out_ptr, s_ptr, m_ptr, h0_ptr, H, G, N, D, svb, svh, svn, sfs,
                          eps, C0, sink, window,
                          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
                          BLOCK_C: tl.constexpr, SPLIT_U: tl.constexpr, NATIVE_DOT: tl.constexpr,
                          HAS_S: tl.constexpr, HAS_FORCED: tl.constexpr, HIST: tl.constexpr,
                          NB: tl.constexpr, HIST_TILE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    c = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    h = r % H
    offs = c * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs < N
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    row = v_ptr + (r // H) * svb + h * svh + offs.to(tl.int64)[:, None] * svn
    v = tl.load(row + d[None, :], mask=nmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    # u = v / m, m the power of two at the top of the token's largest magnitude: exact (u has the
    # bits of v), and |u| < 2 keeps ‖u R_qᵀ‖² in range whatever the value's scale
    nan = tl.sum(tl.where(v != v, 1, 0), 1) > 0
    e = (tl.max(tl.abs(v), 1).to(tl.int32, bitcast=True) >> 23) & 0xFF
    inf = e == 0xFF
    m = tl.where((e > 0) & (e < 0xFF), (e << 23).to(tl.float32, bitcast=True), 1.0)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    cc = tl.arange(0, BLOCK_C)
    for q in range(G):
        fq = f_ptr + (h * G + q) * D * D
        # p = u R_qᵀ, BLOCK_C output channels at a time (the [BLOCK_N, BLOCK_C] accumulator is what
        # sets the registers), each over BLOCK_K-channel slices of u (re-read from L1/L2 per column
        # block); R_qᵀ = f_hi + f_lo (bf16) and u = u_hi + u_lo: u_hi its first 8 significant bits
        # (exact in bf16), u_lo the rest rounded to bf16 (zero for bf16 values: SPLIT_U = 0);
        # p = u_hi f_hi + u_hi f_lo (+ u_lo f_hi), fp32 accumulation; ‖p‖² summed over the blocks
        sq = tl.zeros([BLOCK_N], dtype=tl.float32)
        for c0 in range(0, BLOCK_D, BLOCK_C):
            col = c0 + cc
            cmask = col < D
            p = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
            for k0 in range(0, BLOCK_D, BLOCK_K):
                kmask = (k0 + kk) < D
                uk = tl.math.div_rn(tl.load(row + k0 + kk[None, :], mask=nmask[:, None] & kmask[None, :],
                                            other=0.0).to(tl.float32), m[:, None])
                u_hi = (uk.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)
                fk = fq + (k0 + kk).to(tl.int64)[:, None] * D + col[None, :]
                fmask = kmask[:, None] & cmask[None, :]
                f_hi = tl.load(fk, mask=fmask, other=0.0)
                f_lo = tl.load(fk + sfs, mask=fmask, other=0.0)
                if NATIVE_DOT:
                    a_hi = u_hi.to(tl.bfloat16)
                else:  # the interpreter: the same bf16 operands, multiplied in fp32 (products of bf16 are exact)
                    a_hi = u_hi
                    f_hi = f_hi.to(tl.float32)
                    f_lo = f_lo.to(tl.float32)
                p = tl.dot(a_hi, f_hi, p, out_dtype=tl.float32)
                p = tl.dot(a_hi, f_lo, p, out_dtype=tl.float32)
                if SPLIT_U:
                    a_lo = (uk - u_hi).to(tl.bfloat16)
                    if not NATIVE_DOT:
                        a_lo = a_lo.to(tl.float32)
                    p = tl.dot(a_lo, f_hi, p, out_dtype=tl.float32)
            sq += tl.sum(p * p, 1)
        acc += tl.sqrt(sq)
    _stage2_epilogue(out_ptr, s_ptr, m_ptr, h0_ptr, tl.where(nan | inf, float("nan"), acc * m / G), r, c, offs,
                     nmask, N, eps, C0, sink, window, BLOCK_N, HAS_S, HAS_FORCED, HIST, NB, HIST_TILE)


def _blocks_l2(n: int, d: int):
    """(BLOCK_N, BLOCK_D, BLOCK_K, BLOCK_C, num_warps) of the L2 kernel; tl.dot needs every block >= 16."""
    block_d = max(next_pow2(d), 16)
    if INTERPRET:  # ~0.5 ms per program: one program per row, one channel slice, one column block
        return max(min(next_pow2(n), 1024), 16), block_d, block_d, block_d, 4
    # Each program reads its group's factors (G·2·d² bf16 = 256 KB at G = 4, d = 128) from L2, so
    # the token tile is as tall as registers allow: 128 tokens over 8 warps, with the output channels
    # 64 at a time (the [128, 64] fp32 accumulator is 32 registers a thread). sm_90 at d = 128 (triton
    # 3.9): 122 registers, no spill, 8 KB shared, 2 CTAs/SM = 25 %; sm_80: 126, 25 %. The whole
    # [BLOCK_N, 128] accumulator took 168 registers at 64 tokens / 4 warps (18.8 %), 255 on sm_80;
    # 64 tokens and 32-channel blocks at 4 warps reach 31 % (95 registers) but read the factors twice
    # as often and split each u slice four times.
    return 128, block_d, min(block_d, 32), min(block_d, 64), 8


#: elements of W_O factorised per float64 QR in ``head_factors`` (bounds the float64 copy of W_O
#: to 64 MiB whatever its size)
FACTOR_BLOCK = 1 << 23


def head_factors(o_proj, head_dim: int) -> torch.Tensor:
    """R_qᵀ for every query head q, float64 ``[H_q, d, d]``: R_q the triangular factor of the QR
    decomposition of W_O^q = W_O[:, q·d:(q+1)·d] (zero rows appended when D_model < d), so that
    ‖W_O^q v‖₂ = ‖R_q v‖₂ and R_qᵀ R_q = (W_O^q)ᵀ W_O^q, the head's Gram matrix. Computed in float64,
    a few heads at a time."""
    w = o_proj_weight(o_proj).detach()
    DM, HD = w.shape
    hq = HD // head_dim
    out = torch.zeros((hq, head_dim, head_dim), dtype=torch.float64, device=w.device)
    step = max(1, FACTOR_BLOCK // max(DM * head_dim, 1))
    for q0 in range(0, hq, step):
        q1 = min(q0 + step, hq)
        blk = w[:, q0 * head_dim:q1 * head_dim].double().reshape(DM, q1 - q0, head_dim).transpose(0, 1)
        rf = torch.linalg.qr(blk, mode="r").R  # [heads, min(DM, d), d]
        out[q0:q1, :, :rf.shape[1]] = rf.transpose(1, 2)
    return out


def split_factors(factors: torch.Tensor) -> torch.Tensor:
    """bf16 ``[2, H_q, d, d]``: F ≈ hi + lo with hi = bf16(F), lo = bf16(F − hi), so hi + lo is F to
    about 2⁻¹⁶ of each entry (two roundings to 8 significant bits; the sum is exact in fp32), and both go to the tensor cores as bf16."""
    hi = factors.to(torch.bfloat16)
    return torch.stack([hi, (factors - hi.to(factors.dtype)).to(torch.bfloat16)])


def _value_norms_l2_torch(values: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """The L2 op's CPU body: R_qᵀ = hi + lo in fp32, the kernel's scaling by a power of two, u R_qᵀ
    as batched fp32 matmuls (no split of u) over token chunks of at most ``TORCH_BLOCK`` elements of
    ``[B, H, G, n, d]``, the norm, the group mean, and NaN for a value with a non-finite element."""
    B, H, N, D = values.shape
    G = factors.shape[1] // H
    f = (factors[0].float() + factors[1].float()).reshape(H, G, D, D)
    out = torch.empty((B, H, N), dtype=torch.float32, device=values.device)
    chunk = max(1, TORCH_BLOCK // max(B * H * G * D, 1))
    for t0 in range(0, N, chunk):
        v = values[:, :, t0:t0 + chunk].float()
        nan = torch.isnan(v).any(-1)
        e = (v.abs().amax(-1).view(torch.int32) >> 23) & 0xFF
        inf = e == 0xFF
        m = torch.where((e > 0) & (e < 0xFF), (e << 23).view(torch.float32), 1.0).unsqueeze(-1)
        p = (v / m).unsqueeze(2) @ f  # [B, H, G, n, d]
        n = torch.linalg.vector_norm(p, dim=-1).sum(2) * m.squeeze(-1) / G
        out[:, :, t0:t0 + chunk] = torch.where(nan | inf, float("nan"), n)
    return out


@triton_op("tritonkv::value_norms_l2", mutates_args={"hist0"})
def value_norms_l2_op(values: torch.Tensor, factors: torch.Tensor, scores: Optional[torch.Tensor],
                      forced: Optional[torch.Tensor], hist0: Optional[torch.Tensor], eps: float = 0.0,
                      sink: int = 0, window: int = 0) -> torch.Tensor:
    """The raw L2 op: values ``[B, H, N, d]`` (last dim unit-stride), factors bf16 contiguous
    ``[2, H_q, d, d]`` (``split_factors(head_factors(W_O, d))``) -> fp32 ``[B, H, N]``; ``scores``,
    ``forced``, ``hist0``, ``eps``, ``sink``, ``window`` as for ``value_norms_op``."""
    if not use_triton(values):
        return _stage2_torch(_value_norms_l2_torch(values, factors), scores, eps)
    B, H, N, D = values.shape
    G = factors.shape[1] // H
    out = torch.empty((B, H, N) if scores is None else scores.shape, dtype=torch.float32, device=values.device)
    if B * H * N > 0:
        BLOCK_N, BLOCK_D, BLOCK_K, BLOCK_C, warps = _blocks_l2(N, D)
        args, scalars, flags = _stage2_launch(out, scores, forced, hist0, eps, sink, window, N, BLOCK_N, warps)
        launch(_value_norm_l2_kernel, (triton.cdiv(N, BLOCK_N), B * H), values, factors, out, *args, H, G, N, D,
               values.stride(0), values.stride(1), values.stride(2), factors.stride(0), *scalars,
               BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, BLOCK_K=BLOCK_K, BLOCK_C=BLOCK_C,
               SPLIT_U=values.dtype != torch.bfloat16,
               NATIVE_DOT=not INTERPRET, num_warps=warps, num_stages=1, **flags)
    return out


def o_proj_weight(o_proj) -> torch.Tensor:
    """The W_O tensor from a tensor or an ``nn.Linear``-like module (its ``.weight``)."""
    w = getattr(o_proj, "weight", o_proj)
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"o_proj must be the output projection weight W_O (a tensor or an nn.Linear), "
                        f"got {type(o_proj).__name__}")
    return w


NORMS = ("l1", "l2")


#: a norm kernel counts the stage-2 select's first radix pass when its programs hold at least
#: ``FUSED_MIN_CHUNK`` tokens and a row has at most ``FUSED_MAX_SLOTS`` of them: each program writes one 1 KB
#: slot, and every program of the select's next pass sums its row's. 8192 slots (N = 2M at 256 tokens: 8 MB
#: a program, from L2) is small next to the norm GEMM's N·H_q·d·D_model multiply-adds, and keeps every context
#: a model meets on one set of compiled kernels (a cap at 32K made N = 40K compile other variants)
FUSED_MIN_CHUNK = 128
FUSED_MAX_SLOTS = 8192


def fused_chunk(values: torch.Tensor, o_proj: torch.Tensor, norm: str) -> Optional[int]:
    """Tokens per program of the norm kernel that ``value_norms`` would launch when it may also count the
    stage-2 select's first radix pass (one ``hist0`` slot per program), else None: the PyTorch body, a
    traced call, programs of fewer than ``FUSED_MIN_CHUNK`` tokens (outside the interpreter) or more than
    ``FUSED_MAX_SLOTS`` of them a row (the select then counts its own first pass)."""
    if not use_triton(values) or torch.compiler.is_compiling() or type(values) is not torch.Tensor:
        return None
    B, H, N, D = values.shape
    if norm == "l2":
        block = _blocks_l2(N, D)[0]
    else:
        block = _blocks(N, D, o_proj.shape[0], _native(values, o_proj))[0]
    if cdiv(N, block) > FUSED_MAX_SLOTS or not (INTERPRET or block >= FUSED_MIN_CHUNK):
        return None
    return block


def value_norms(values: torch.Tensor, o_proj, *, norm: str = "l1", scores: Optional[torch.Tensor] = None,
                eps: float = 0.0, forced: Optional[torch.Tensor] = None, protect=None):
    """CriticalKV's n_j = (1/G) Σ_{q∈G(h)} ‖W_O[:, q·d:(q+1)·d] · v_j‖₁, fp32 ``[B, H_kv, N]``.

    ``values`` ``[B, H_kv, N, d]``; ``o_proj`` W_O ``[D_model, H_q·d]`` (nn.Linear layout, or the
    module itself) with H_q = G·H_kv: query head q belongs to KV head q // G. ``norm="l2"``: the
    group mean of ‖W_O^q v_j‖₂ instead, through the per-head Gram matrices (module docstring).

    CriticalKV's stage 2, in the same kernel: ``scores`` (the base scores s, fp32, B·H_kv·N elements,
    contiguous) returns (s + ``eps``)·n_j instead, shaped like them, and ``protect=(sink, window)`` returns
    ``(stage-2 scores, hist0)``, ``hist0`` the shared select's first radix pass over them with those tokens
    and the tokens of ``forced`` (a bool or uint8 mask of B·H_kv·N elements, such as the stage-1 selection)
    protected: a ``select.Hist0`` for ``select_kv(..., forced=forced, hist0=)``, or None where the kernel
    does not count it (``fused_chunk``).
    """
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    check_kv_tensor("values", values)
    w = o_proj_weight(o_proj)
    B, H, N, D = values.shape
    if w.dim() != 2 or w.dtype not in FLOAT_DTYPES or w.shape[1] == 0 or w.shape[1] % (H * D) != 0:
        raise ValueError(f"o_proj must be a float W_O [D_model, H_q * d] with H_q a multiple of H_kv = {H} "
                         f"and d = {D}, got {tuple(w.shape)} {w.dtype}")
    if w.device != values.device:
        raise ValueError(f"o_proj must be on the device of values ({values.device}), got {w.device}")
    s = None if scores is None else _stage2_input("scores", scores, values, (torch.float32,))
    f = None if forced is None else _stage2_input("forced", forced, values, (torch.bool, torch.uint8))
    if f is not None and (s is None or protect is None):
        raise ValueError("forced is read only with scores and protect (the stage-2 select's first radix pass)")
    h0 = None
    if protect is not None:
        if s is None:
            raise ValueError("protect needs scores: the first radix pass is counted over the stage-2 scores")
        chunk = fused_chunk(values, w, norm)
        if chunk is not None and B * H * N > 0:
            h0 = Hist0(hist0_buffer(B * H, cdiv(N, chunk), values.device), *protect, forced)
    if f is not None and f.dtype == torch.bool:
        f = f.view(torch.uint8)
    op, second = (value_norms_l2_op, split_factors(head_factors(w, D))) if norm == "l2" else (value_norms_op,
                                                                                               w.detach())
    out = op(row_major(values), second, s, None if h0 is None else f, None if h0 is None else h0.hist, float(eps),
             *((h0.sink, h0.window) if h0 else (0, 0)))
    return out if protect is None else (out, h0)


def _stage2_input(name: str, t, values: torch.Tensor, dtypes: tuple) -> torch.Tensor:
    """``scores``/``forced`` of ``value_norms`` checked: a contiguous tensor of one of ``dtypes`` with B·H·N
    elements on the device of ``values``."""
    if not isinstance(t, torch.Tensor) or t.dtype not in dtypes:
        raise TypeError(f"{name} must be a tensor of {' or '.join(str(d) for d in dtypes)}, "
                        f"got {getattr(t, 'dtype', type(t).__name__)}")
    if t.numel() != values.shape[0] * values.shape[1] * values.shape[2] or not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous with B * H_kv * N = {values.shape[:3].numel()} elements, "
                         f"got {tuple(t.shape)}")
    if t.device != values.device:
        raise ValueError(f"{name} must be on the device of values ({values.device}), got {t.device}")
    return t
