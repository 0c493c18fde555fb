"""Decode-attention benchmark: split-K GQA attention over a RaggedKV, and the memory it frees.

    python -m benchmarks.decode_attention                                       # writes <device>-decode_attention.*
    TRITON_INTERPRET=1 python -m benchmarks.decode_attention --smoke --out /tmp/bench   # a tiny case on the CPU

Cases, columns and floors: docs/benchmarks.md ("Speed: how it is measured"). ``benchmarks/speed.py`` runs the same
cases as its ``decode_attention`` part.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from benchmarks.common import RESULTS, copy_bandwidth, describe, device_tag, gpu_time, run_info, table, write_results
from tritonkv.cache import RaggedKV, ragged_append
from tritonkv.kernels import select as _select
from tritonkv.kernels.decode_attention import decode_attention, plan

# (B, H_kv, G, D, mean tokens kept per head)
CASES = [(1, 8, 4, 128, 1024), (1, 8, 4, 128, 8192), (1, 8, 4, 128, 32768), (8, 8, 4, 128, 4096),
         (1, 3, 3, 64, 1024)]  # the last: SmolLM2-135M's attention shape
SMOKE_CASES = [(1, 3, 2, 16, 24)]
#: the Markdown table's columns
COLUMNS = ["B", "H_kv", "G", "D", "mean", "max", "ragged_us", "padded_us", "dense_us", "sdpa_us", "x_sdpa", "floor_us",
           "pct_copy_bw", "append_us", "recopy_us", "mem_ragged_MB", "mem_padded_MB", "mem_saved_pct", "ok"]


def bench(fn, cuda: bool, graph: bool = False) -> float:
    """Median microseconds of ``fn()``, to 0.01 (``benchmarks.common.gpu_time``; on the CPU after one warm-up call)."""
    fn()
    return gpu_time(fn, cuda, graph)["us"]


def adakv_budgets(B: int, H: int, mean: int) -> torch.Tensor:
    """int32 [B*H]: one heavy head per batch row (rotating), the rest share the remainder."""
    heavy = min(4.0, (H + 1) / 2)
    rest = (H - heavy) / (H - 1) if H > 1 else 0.0
    w = torch.full((B, H), rest)
    w[torch.arange(B), torch.arange(B) % H] = heavy
    return (w * mean).round().clamp(min=1).to(torch.int32).flatten()


def reference(q, keys, values, lengths):
    """fp32 attention of ``q [B, H_q, 1, D]`` over the first ``lengths [B, H]`` tokens of padded K/V."""
    B, H, cap, D = keys.shape
    G = q.shape[1] // H
    mask = torch.arange(cap, device=q.device)[None, None, :] < lengths[:, :, None]  # [B, H, cap]
    mask = mask.repeat_interleave(G, dim=1)[:, :, None, :]
    k = keys.float().repeat_interleave(G, dim=1)
    v = values.float().repeat_interleave(G, dim=1)
    return F.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask)


def rel_err(out, ref) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def mem_delta(build, cuda: bool):
    """(object, bytes it holds): ``memory_allocated`` delta on the GPU, tensor bytes on the CPU."""
    if cuda:
        torch.cuda.synchronize()
        m0 = torch.cuda.memory_allocated()
        obj = build()
        torch.cuda.synchronize()
        return obj, torch.cuda.memory_allocated() - m0
    obj = build()
    ts = [obj.keys, obj.values, obj.positions, obj.row_start, obj.length] if isinstance(obj, RaggedKV) else obj
    return obj, sum(t.numel() * t.element_size() for t in ts)


def run_case(B, H, G, D, mean, *, cuda: bool, copy_GBps: float, dtype=torch.bfloat16, seed=0):
    dev = "cuda" if cuda else "cpu"
    gen = torch.Generator().manual_seed(seed)
    budgets = adakv_budgets(B, H, mean)
    N = int(budgets.max())
    total = int(budgets.sum())  # the allocator's static total
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(dev, dtype)  # noqa: E731
    keys, values = rnd(B, H, N, D), rnd(B, H, N, D)
    scores = torch.randn(B, H, N, generator=gen).to(dev)
    q = rnd(B, H * G, 1, D)
    b_dev = budgets.to(dev)

    ragged, mem_ragged = mem_delta(lambda: RaggedKV.from_selection(scores, b_dev, keys, values, total=total), cuda)
    (Kp, Vp, _, lens), mem_padded = mem_delta(lambda: _select.select_kv(scores, b_dev, keys, values, N), cuda)
    mem_full = 2 * keys.numel() * keys.element_size()

    # correctness first, against fp32 attention over the same tokens
    ref = reference(q, Kp, Vp, lens)
    out_r = decode_attention(q, ragged)
    out_p = decode_attention(q, (Kp, Vp), lens)
    row = dict(B=B, H_kv=H, G=G, D=D, mean=mean, max=N, total_tokens=total, dtype=str(dtype).replace("torch.", ""),
               rel_err_ragged=rel_err(out_r, ref), rel_err_padded=rel_err(out_p, ref))
    cap_d = total // (B * H)  # dense cache with the same total tokens
    Kd, Vd = rnd(B, H, cap_d, D), rnd(B, H, cap_d, D)
    sdpa = lambda: F.scaled_dot_product_attention(q, Kd, Vd, enable_gqa=True)  # noqa: E731
    row["rel_err_dense_vs_sdpa"] = rel_err(decode_attention(q, (Kd, Vd)), sdpa().float())

    times = dict(ragged_us=lambda: decode_attention(q, ragged), padded_us=lambda: decode_attention(q, (Kp, Vp), lens),
                 dense_us=lambda: decode_attention(q, (Kd, Vd)), sdpa_us=sdpa)
    row.update({name: bench(fn, cuda, graph=cuda) for name, fn in times.items()})
    row["ragged_eager_us"] = bench(times["ragged_us"], cuda)

    # in-place append vs the whole-cache re-copy of an AdaKV-style flat cache
    k1, v1 = q[:, ::G][:, :H].contiguous(), q[:, ::G][:, :H].contiguous()
    len0 = ragged.length.clone()

    def reset():
        ragged.length.copy_(len0)

    def append():
        reset()
        ragged_append(k1, v1, ragged.keys, ragged.values, ragged.positions, ragged.row_start, ragged.length,
                      ragged.next_position, H)

    row["append_us"] = round(max(bench(append, cuda, graph=cuda) - bench(reset, cuda, graph=cuda), 0.0), 2)
    row["recopy_us"] = bench(lambda: (ragged.keys.clone(), ragged.values.clone()), cuda, graph=cuda)
    reset()

    elt = keys.element_size()
    fbytes = 2 * total * D * elt + 2 * q.numel() * elt  # kept K+V read once, q read, out written
    floor_us = fbytes / (copy_GBps * 1e3)
    split, _, S = plan(ragged.max_capacity, ragged.keys.shape[0], None, D)
    row.update(split_tokens=split, max_splits=S, floor_bytes=fbytes, floor_us=round(floor_us, 2),
               achieved_TBps=round(fbytes / row["ragged_us"] / 1e6, 3),
               pct_copy_bw=round(100 * floor_us / row["ragged_us"], 1), x_floor=round(row["ragged_us"] / floor_us, 2),
               x_sdpa=round(row["ragged_us"] / row["sdpa_us"], 2),
               mem_full_MB=round(mem_full / 2 ** 20, 2), mem_ragged_MB=round(mem_ragged / 2 ** 20, 2),
               mem_padded_MB=round(mem_padded / 2 ** 20, 2),
               mem_saved_pct=round(100 * (1 - mem_ragged / mem_padded), 1))
    row["ok"] = max(row["rel_err_ragged"], row["rel_err_padded"], row["rel_err_dense_vs_sdpa"]) < 2e-2
    for k in ("rel_err_ragged", "rel_err_padded", "rel_err_dense_vs_sdpa"):
        row[k] = float(f"{row[k]:.3g}")
    return row


def run(args):
    cuda = torch.cuda.is_available() and not args.smoke
    copy_GBps = copy_bandwidth(cuda, (1 << 30) if cuda else (1 << 20))
    rows = []
    for case in SMOKE_CASES if args.smoke else CASES:
        rows.append(run_case(*case, cuda=cuda, copy_GBps=copy_GBps))
        print(json.dumps(rows[-1]), flush=True)
        if cuda:
            torch.cuda.empty_cache()
    return dict(run_info(cuda), copy_GBps=round(copy_GBps, 1), rows=rows)


def write(result, out_dir):
    md = [f"{describe(result)}; copy {result['copy_GBps']} GB/s", ""] + table(result["rows"], COLUMNS)
    return write_results(os.path.join(out_dir, f"{device_tag(result)}-decode_attention"), result, "\n".join(md) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="a tiny case on the CPU, to check the program")
    p.add_argument("--out", default=RESULTS)
    a = p.parse_args(argv)
    res = run(a)
    print("wrote", write(res, a.out))
    return res


if __name__ == "__main__":
    main()
