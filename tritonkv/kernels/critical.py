"""CriticalKV's projected-value norms (CriticalKV §3.4; ``shared/notes/algorithms.md`` §1.6).

For KV head h with query heads G(h) = {h·G, …, h·G + G − 1} and ``o_proj`` weight W_O
``[D_model, H_q·d]`` (nn.Linear layout: attention output o = x W_Oᵀ with x = concat of heads)::

    n_j = (1/G) Σ_{q∈G(h)} ‖ W_O[:, q·d:(q+1)·d] · v_j ‖₁         (the group mean of ‖v_j W_O^q‖₁)

One launch covers every (batch row, KV head) on a grid (token chunks, rows): a program loads its
tile of values ``[BLOCK_N, d]`` once, then for each query head of the group walks D_model in
blocks of BLOCK_M, forms ``[BLOCK_N, BLOCK_M]`` projections with ``tl.dot`` and accumulates their
absolute values in fp32. On the GPU, fp16/bf16 operands of one dtype go to the tensor cores as
they are (products exact, fp32 accumulation); otherwise (fp32, mixed dtypes, the interpreter,
whose bf16 ``tl.dot`` is wrong) both are cast to fp32 and multiplied in IEEE fp32 (no TF32).

On the CPU (outside the interpreter) the op runs ``_value_norms_torch``: the same projections as
batched fp32 matmuls over token chunks.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, INTERPRET, check_kv_tensor, launch, next_pow2, row_major, triton_op, use_triton


@triton.jit
def _value_norm_kernel(v_ptr, w_ptr, out_ptr, H, G, N, D, DM, svb, svh, svn, swm, swc,
                       BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                       NATIVE_DOT: tl.constexpr):
    c = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    h = r % H
    offs = c * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs < N
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    src = (r // H) * svb + h * svh + offs.to(tl.int64)[:, None] * svn + d[None, :]
    v = tl.load(v_ptr + src, mask=nmask[:, None] & dmask[None, :], other=0.0)
    if not NATIVE_DOT:
        v = v.to(tl.float32)
    m = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for q in range(G):
        col = (h * G + q) * D + d  # columns of query head q in W_O
        for m0 in range(0, DM, BLOCK_M):
            rows = m0 + m
            # w[c, m] = W_O[m0 + m, q·d + c]: a [BLOCK_D, BLOCK_M] tile of W_O^q transposed
            w = tl.load(w_ptr + rows.to(tl.int64)[None, :] * swm + col.to(tl.int64)[:, None] * swc,
                        mask=dmask[:, None] & (rows < DM)[None, :], other=0.0)
            if NATIVE_DOT:
                p = tl.dot(v, w)
            else:
                p = tl.dot(v, w.to(tl.float32), input_precision="ieee")
            # padded W_O rows are zeros: an infinite value times 0 is NaN there, so mask them out
            acc += tl.sum(tl.where((rows < DM)[None, :], tl.abs(p), 0.0), 1)
    tl.store(out_ptr + r * N + offs, acc / G, mask=nmask)


def _blocks(n: int, d: int, dm: int, native: bool):
    """(BLOCK_N, BLOCK_D, BLOCK_M, num_warps); tl.dot needs every block >= 16. Each program
    re-reads its group's W_O (from L2), so the token tile is as tall as registers allow."""
    block_d = max(next_pow2(d), 16)
    if INTERPRET:  # ~0.5 ms per program: one program per row, whole W_O^q blocks
        return max(min(next_pow2(n), 1024), 16), block_d, max(min(next_pow2(dm), 1024), 16), 4
    block_m = max(min(next_pow2(dm), 8192 // block_d), 16)
    block_n = 128 if native and block_d <= 128 else 64
    return block_n, block_d, block_m, 4 if block_d <= 64 else 8


#: elements of the fp32 ``[B, H, G, chunk, D_model]`` projection block of ``_value_norms_torch``
#: (64 MiB): it sets the token chunk, so memory stays bounded whatever N and D_model are
TORCH_BLOCK = 1 << 24


def _value_norms_torch(values: torch.Tensor, o_proj: torch.Tensor) -> torch.Tensor:
    """The op's CPU body: for each token chunk, the projections of its values by every query head
    of their group, ``[B, H, 1, n, d] @ [H, G, d, D_model]`` (W_O^q transposed, a view) in fp32,
    then the L1 norm over D_model (one fused reduction) and the mean over the G heads. The chunk
    n keeps that block under ``TORCH_BLOCK`` elements; the chunk count depends only on shapes.
    IEEE fp32 throughout: a NaN value gives NaN, an infinite one +inf (NaN where it meets an exact
    zero of W_O)."""
    B, H, N, D = values.shape
    DM = o_proj.shape[0]
    G = o_proj.shape[1] // (H * D)
    w = o_proj.float().reshape(DM, H, G, D).permute(1, 2, 3, 0)  # [H, G, d, D_model]
    v = values.float().unsqueeze(2)  # [B, H, 1, N, d]
    chunk = max(1, TORCH_BLOCK // max(B * H * G * DM, 1))
    out = torch.empty((B, H, N), dtype=torch.float32, device=values.device)
    for t0 in range(0, N, chunk):
        p = v[:, :, :, t0:t0 + chunk] @ w  # [B, H, G, n, D_model]
        out[:, :, t0:t0 + chunk] = torch.linalg.vector_norm(p, ord=1, dim=-1).sum(2) / G
    return out


@triton_op("tritonkv::value_norms", mutates_args=())
def value_norms_op(values: torch.Tensor, o_proj: torch.Tensor) -> torch.Tensor:
    """The raw op: values ``[B, H, N, d]`` (last dim unit-stride), o_proj ``[D_model, H_q·d]``
    -> fp32 ``[B, H, N]``."""
    if not use_triton(values):
        return _value_norms_torch(values, o_proj)
    B, H, N, D = values.shape
    DM = o_proj.shape[0]
    G = o_proj.shape[1] // (H * D)
    out = torch.empty((B, H, N), dtype=torch.float32, device=values.device)
    if B * H * N > 0:
        native = (not INTERPRET) and values.dtype == o_proj.dtype and values.dtype != torch.float32
        BLOCK_N, BLOCK_D, BLOCK_M, warps = _blocks(N, D, DM, native)
        launch(_value_norm_kernel, (triton.cdiv(N, BLOCK_N), B * H), values, o_proj, out, H, G, N, D, DM,
               values.stride(0), values.stride(1), values.stride(2), o_proj.stride(0), o_proj.stride(1),
               BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, NATIVE_DOT=native, num_warps=warps)
    return out


def o_proj_weight(o_proj) -> torch.Tensor:
    """The W_O tensor from a tensor or an ``nn.Linear``-like module (its ``.weight``)."""
    w = getattr(o_proj, "weight", o_proj)
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"o_proj must be the output projection weight W_O (a tensor or an nn.Linear), "
                        f"got {type(o_proj).__name__}")
    return w


def value_norms(values: torch.Tensor, o_proj) -> torch.Tensor:
    """CriticalKV's n_j = (1/G) Σ_{q∈G(h)} ‖W_O[:, q·d:(q+1)·d] · v_j‖₁, fp32 ``[B, H_kv, N]``.

    ``values`` ``[B, H_kv, N, d]``; ``o_proj`` W_O ``[D_model, H_q·d]`` (nn.Linear layout, or the
    module itself) with H_q = G·H_kv: query head q belongs to KV head q // G.
    """
    check_kv_tensor("values", values)
    w = o_proj_weight(o_proj)
    B, H, N, D = values.shape
    if w.dim() != 2 or w.dtype not in FLOAT_DTYPES or w.shape[1] == 0 or w.shape[1] % (H * D) != 0:
        raise ValueError(f"o_proj must be a float W_O [D_model, H_q * d] with H_q a multiple of H_kv = {H} "
                         f"and d = {D}, got {tuple(w.shape)} {w.dtype}")
    if w.device != values.device:
        raise ValueError(f"o_proj must be on the device of values ({values.device}), got {w.device}")
    return value_norms_op(row_major(values), w.detach())
