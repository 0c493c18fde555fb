"""Per-rank memory under tensor parallelism, and what balancing it across ranks costs.

    python -m benchmarks.tp_memory                 # both parts, results in benchmarks/results/tp_memory.{json,md}
    python -m benchmarks.tp_memory --quick         # smaller prompt, fewer configurations (a smoke run)
    python -m benchmarks.tp_memory --part llama    # only the random Llama (or --part smollm2)

Every rank is a process of its own, gloo on the CPU: SnapKV with one budget per head, exact AdaKV and AdaKV
``balance_ranks``, the bytes each rank holds and the attention error of its kept tokens. Method and columns:
docs/benchmarks.md, "Tensor-parallel memory (tp_memory.py)".
"""
from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import socket
import tempfile
import time

import torch

from benchmarks.common import RESULTS, in_processes, random_llama, run_info, table, write_results

LLAMA = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=16,
             num_key_value_heads=8, head_dim=32, max_position_embeddings=8192)
ALLOCS = [("uniform", None), ("adakv", {}), ("adakv balance 1.5", dict(balance_ranks=1.5)),
          ("adakv balance 1.25", dict(balance_ranks=1.25)), ("adakv balance 1.0", dict(balance_ranks=True))]


# -- worker side -------------------------------------------------------------------------------------------------
def capture(model, ids):
    """Per layer ``(q [B, H_q, T, D], k [B, H_kv, T, D], v)`` of one uncompressed forward (RoPE applied)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    rec = {}

    def record(module, query, key, value, attention_mask, **kwargs):
        rec[module.layer_idx] = (query.detach().clone(), key.detach().clone(), value.detach().clone())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("tp_record", record)
    AttentionMaskInterface.register("tp_record", sdpa_mask)
    old = model.config._attn_implementation
    model.set_attn_implementation("tp_record")
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    model.set_attn_implementation(old)
    return [rec[i] for i in sorted(rec)]


def attn_error(q, k, v, kept) -> float:
    """mean over query heads and queries of |o − ô|₁/|o|₁: ``q [B, Hq, Q, D]`` attends over the prompt ``k, v [B, H,
    N, D]`` (o) and over the kept tokens of ``kept`` (ô; a ``Compressed`` or a ``RaggedKV``)."""
    from tritonkv.api import Compressed

    B, Hq, Q, D = q.shape
    H = k.shape[1]
    scale = D ** -0.5
    qq = q.float().reshape(B, H, Hq // H * Q, D)
    o = torch.softmax(qq @ k.float().transpose(-1, -2) * scale, -1) @ v.float()
    if isinstance(kept, Compressed):
        kk, vv, lengths = kept.keys, kept.values, torch.full((B, H), kept.keys.shape[2])
    else:
        kk, vv, lengths = kept.to_padded(int(kept.length.max()))
    mask = torch.arange(kk.shape[2])[None, None, :] < lengths[..., None]  # [B, H, cap]
    s = (qq @ kk.float().transpose(-1, -2) * scale).masked_fill(~mask[:, :, None, :], float("-inf"))
    oh = torch.softmax(s, -1) @ vv.float()
    err = (o - oh).abs().sum(-1) / o.abs().sum(-1).clamp_min(1e-30)  # [B, H, G·Q]
    return float(err.mean())


def compress_layers(layers, N, W, budget, alloc, pg, policy):
    """Compress each layer's prompt prefix on this rank; (bytes, kept, mean error, seconds)."""
    import tritonkv
    from tritonkv.allocation import AdaKV
    from tritonkv.api import Compressed

    allocation = None if alloc is None else AdaKV(**alloc)
    tot_b = tot_k = 0
    errs = []
    t = 0.0
    for li, (q, k, v) in enumerate(layers):
        kp, vp = k[:, :, :N].contiguous(), v[:, :, :N].contiguous()
        t0 = time.perf_counter()
        kept = tritonkv.compress((kp, vp), policy, budget, allocation=allocation, queries=q[:, :, N - W:N],
                                 process_group=pg, layer=li, num_layers=len(layers))
        t += time.perf_counter() - t0
        dense = isinstance(kept, Compressed)
        tot_b += sum(x.numel() * x.element_size() for x in kept) if dense else kept.nbytes
        tot_k += int(kept.indices.numel()) if dense else int(kept.length.sum())
        errs.append(attn_error(q[:, :, N:], kp, vp, kept))
    return tot_b, tot_k, sum(errs) / len(errs), t


def rank_inputs(spec: dict, rank: int, world: int):
    """``(model, ids, layers)`` of this rank: the random Llama loaded with ``tp_plan="auto"``, its prompt and the
    per-layer Q/K/V of its heads (part ``llama``), or ``(None, None, layers)`` with this rank's share of the heads
    of SmolLM2's captured Q/K/V (part ``smollm2``)."""
    if spec["part"] == "smollm2":
        data = torch.load(spec["tensors"])
        Hkv = data["layers"][0][1].shape[1]
        Hl, G = Hkv // world, data["layers"][0][0].shape[1] // Hkv
        hs, qs = slice(rank * Hl, (rank + 1) * Hl), slice(rank * Hl * G, (rank + 1) * Hl * G)
        return None, None, [(q[:, qs], k[:, hs], v[:, hs]) for q, k, v in data["layers"]]
    from transformers import AutoModelForCausalLM

    try:
        from transformers import DistributedConfig

        model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32,
                                                     distributed_config=DistributedConfig(tp_plan="auto"))
    except (ImportError, TypeError):
        model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32, tp_plan="auto")
    ids = torch.randint(0, LLAMA["vocab_size"], (1, spec["n"] + spec["q"]), generator=torch.Generator().manual_seed(0))
    return model.eval(), ids, capture(model, ids)


def worker(spec: dict) -> dict:
    """One rank: per budget and allocation, the rank's cache after the prompt (part ``llama``) and its compressed
    layers, as ``{"rows": [...]}``."""
    import torch.distributed as dist

    from tritonkv.allocation import AdaKV
    from tritonkv.integrations import transformers as tt
    from tritonkv.policies import SnapKV

    rank, world, N = spec["rank"], spec["world"], spec["n"]
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    pg = dist.group.WORLD
    model, ids, layers = rank_inputs(spec, rank, world)
    policy = SnapKV()
    rows = []
    for frac in spec["budgets"]:
        for name, alloc in ALLOCS:
            row, timed = dict(part=spec["part"], budget=frac, allocation=name, rank=rank), {}
            if model is not None:
                cache = tt.make_cache(model, policy, frac, mode="after_prefill", prompt_length=N,
                                      allocation=None if alloc is None else AdaKV(**alloc), process_group=pg)
                t0 = time.perf_counter()
                tt.prefill(model, ids[:, :N], cache)
                timed["prefill_s"] = round(time.perf_counter() - t0, 3)
                row.update(cache_bytes=cache.nbytes, cache_kept=int(sum(int(x.sum()) for x in cache.kept_tokens())))
            b, k, err, t = compress_layers(layers, N, policy.window, frac, alloc, pg, policy)
            rows.append(dict(row, kept_bytes=b, kept=k, attn_err=err, compress_s=round(t, 4), **timed))
    dist.destroy_process_group()
    return dict(rows=rows)


# -- driver side -------------------------------------------------------------------------------------------------
def launch(world: int, spec: dict, timeout: float = 900) -> list[dict]:
    """``world`` ranks of ``spec``, each a fresh process (spawned; gloo over a free local port, one thread, no
    TRITON_INTERPRET: the native CPU op bodies); their rows in rank order."""
    os.environ.pop("TRITON_INTERPRET", None)  # read by the ranks when they start
    os.environ["OMP_NUM_THREADS"] = "1"
    with socket.socket() as s:  # a free local port
        s.bind(("127.0.0.1", 0))
        spec = dict(spec, world=world, port=s.getsockname()[1])
    ranks = in_processes(multiprocessing.get_context("spawn"), worker, [dict(spec, rank=r) for r in range(world)],
                         timeout)
    for r in ranks:
        if "error" in r:
            raise SystemExit(f"rank {r['rank']}: {r['error']}")
    return [row for r in ranks for row in r["rows"]]


def smollm2_tensors(path: str, n: int, q: int) -> None:
    from tritonkv.integrations.model import load_smollm2
    from tritonkv.integrations.needle import haystack_text

    model, tok = load_smollm2()
    ids = tok(haystack_text(), return_tensors="pt", add_special_tokens=False).input_ids[:, :n + q]
    layers = capture(model.eval(), ids)
    torch.save(dict(N=n, layers=layers), path)


def summarise(rows: list[dict]) -> list[dict]:
    """One row per (part, budget, allocation): per-rank bytes, imbalance, error, error minus exact AdaKV's."""
    groups = {}
    for r in sorted(rows, key=lambda r: r["rank"]):
        groups.setdefault((r["part"], r["budget"], r["allocation"]), []).append(r)
    res = []
    for (part, budget, alloc), ranks in groups.items():
        world = len(ranks)
        field = "cache_bytes" if "cache_bytes" in ranks[0] else "kept_bytes"
        by = [r[field] for r in ranks]
        err = sum(r["attn_err"] for r in ranks) / world  # every rank has the same number of query heads
        res.append(dict(part=part, budget=budget, allocation=alloc, world=world, bytes_field=field, bytes=by,
                        kept=[r["kept"] for r in ranks], kept_bytes=[r["kept_bytes"] for r in ranks],
                        imbalance=max(by) / (sum(by) / world), attn_err=err,
                        compress_s=max(r["compress_s"] for r in ranks)))
    exact = {(r["part"], r["budget"]): r["attn_err"] for r in res if r["allocation"] == "adakv"}
    for r in res:
        r["err_vs_exact"] = r["attn_err"] - exact[r["part"], r["budget"]]
    return res


def markdown(summary: list[dict], meta: dict) -> str:
    m = meta["machine"]
    lines = ["# Per-rank memory under tensor parallelism (`python -m benchmarks.tp_memory`)", "",
             f"{m['date']}, commit {m['commit']}{' (tritonkv modified)' if m['tritonkv_dirty'] else ''}, torch "
             f"{m['torch']}, transformers {m['transformers']}, gloo on {m['cores']} CPU cores. "
             f"Command: `{meta['command']}`.", ""]
    for part, title in (("llama", f"Random Llama, 2 ranks (tp_plan=\"auto\"), N = {meta['llama_n']}: "
                                  f"`TritonKVCache.nbytes` per rank after the prompt"),
                        ("smollm2", f"SmolLM2-135M-Instruct, 3 ranks (one KV head each), N = {meta['smollm2_n']}: "
                                    f"kept `RaggedKV` bytes per rank, summed over the 30 layers")):
        rows = [[f"{r['budget']:g}", r["allocation"], " / ".join(f"{b / 2**10:.0f} KiB" for b in r["bytes"]),
                 f"{r['imbalance']:.3f}", " / ".join(map(str, r["kept"])), f"{r['attn_err']:.4f}",
                 f"{r['err_vs_exact']:+.4f}"] for r in summary if r["part"] == part]
        if not rows:
            continue
        lines += [f"## {title}", "", "SnapKV scoring (W = 32, κ = 7); attention error of the next 64 queries over "
                  "the prompt, mean over layers and query heads.", ""]
        lines += table(rows, None, ["budget", "allocation", "bytes per rank", "max / mean", "tokens per rank",
                                    "attn err", "vs exact AdaKV"]) + [""]
    lines += ["`balance_ranks=x` caps each rank's share of a layer's total at ⌊x·H_l·b⌋ tokens and gives the rest "
              "to the other ranks' next-best tokens; 1.0 keeps every rank at exactly H_l·b (AdaKV within each rank; "
              "with one KV head per rank, uniform budgets). Exact AdaKV keeps the single-process tokens.", ""]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("llama", "smollm2", "both"), default="both")
    ap.add_argument("--quick", action="store_true", help="N = 512, budget 0.25 only")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args()
    n = 512 if args.quick else 2048
    spec = dict(n=n, q=64, budgets=[0.25] if args.quick else [0.1, 0.25])
    rows = []
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        if args.part in ("llama", "both"):
            d = os.path.join(tmp, "llama")
            random_llama(**LLAMA).save_pretrained(d)
            rows += launch(2, dict(spec, part="llama", model_dir=d))
            print(f"llama done ({time.time() - t0:.0f} s)", flush=True)
        if args.part in ("smollm2", "both"):
            path = os.path.join(tmp, "smollm2.pt")
            smollm2_tensors(path, n, 64)
            rows += launch(3, dict(spec, part="smollm2", tensors=path))
            print(f"smollm2 done ({time.time() - t0:.0f} s)", flush=True)
    summary = summarise(rows)
    info = run_info()
    meta = dict(machine=dict(info, backend="gloo (CPU)"), command=info["command"],
                llama_n=n, smollm2_n=n, seconds=round(time.time() - t0, 1))
    md = markdown(summary, meta)
    write_results(os.path.join(args.out, "tp_memory"), dict(meta=meta, summary=summary, rows=rows), md)
    print(md)


if __name__ == "__main__":
    main()
