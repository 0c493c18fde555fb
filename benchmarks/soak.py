"""Soak: memory stays flat over a long decode and a server-style stream of requests (a program, not a test).

1. **Long decode.** A seeded random Llama (2 layers, hidden 64, 4 query / 2 KV heads, vocab 1000) reads a
   512-token prompt into a ``TritonKVCache`` in decoding mode, then decodes ``--steps`` (10,000) tokens one
   forward at a time, for three caches: dense (KeyDiff, 128 tokens per head), per-head (KeyDiff with the
   AdaKV allocation, ragged rows) and LagKV (its recursive partitions, ratio 0.25). Every ``--every`` steps it
   records the process's resident memory (RSS, after ``malloc_trim``) and the cache's tensor bytes
   (``cache.nbytes``). Growth = (largest reading after warm-up − reading at the end of warm-up) / that
   reading; warm-up is the first ``--warmup`` steps (every buffer reaches its steady size there).
2. **Server loop.** ``--requests`` (300) requests through ``tritonkv.integrations.transformers.generate``, each
   with a random batch size (1–3, left-padded rows of random lengths 8–600), policy, mode, budget (an int or a
   fraction), allocation (where the combination is valid) and answer length; every exception is counted.
   RSS is read after each request; growth as above, after the first ``--warmup-requests``.

Single-threaded (``torch.set_num_threads(1)``) so the numbers do not depend on a busy machine's cores.
Writes ``benchmarks/results/soak.json`` and ``soak.md``.

    python -m benchmarks.soak                      # the committed results
    python -m benchmarks.soak --steps 500 --requests 20 --out /tmp/soak   # a quick look
    python -m benchmarks.soak --render             # rewrite soak.md from soak.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
import traceback

import torch

import tritonkv
from benchmarks.common import RESULTS, malloc_trim, random_llama, rss_kb, run_info, table, write_results
from tritonkv.integrations import transformers as tt

def rss_mib() -> float:
    """Resident memory of this process, MiB, after returning freed heap pages to the system."""
    gc.collect()
    malloc_trim()
    return rss_kb() / 1024


def growth(values: list[float], warm: int) -> float:
    """(max after warm-up − value at warm-up) / value at warm-up; values[warm] is the reference."""
    base = values[warm]
    return (max(values[warm:]) - base) / base if base else 0.0


def beyond_cache(samples: list[dict], warm: int) -> float:
    """The RSS growth after warm-up less the cache's own tensor growth, relative to the RSS at warm-up
    (what LagKV, whose cache grows by design, must keep flat)."""
    r0, b0 = samples[warm]["rss_mib"], samples[warm]["cache_bytes"]
    return max((s["rss_mib"] - r0 - (s["cache_bytes"] - b0) / 2**20) for s in samples[warm:]) / r0


#: the three long-decode caches: (label, policy, budget, allocation)
DECODE_CACHES = (("dense (keydiff, 128/head)", "keydiff", 128, None),
                 ("per-head (keydiff + adakv, 128/head)", "keydiff", 128, "adakv"),
                 ("lagkv (recursive, ratio 0.25)", "lagkv", 0.25, None))


@torch.no_grad()
def long_decode(model, policy, budget, allocation, steps: int, every: int, warmup: int, prompt: int = 512) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 1000, (1, prompt), generator=g)
    cache = tt.make_cache(model, policy, budget, mode="decoding", allocation=allocation)
    logits = tt.prefill(model, ids, cache)[:, -1]
    samples, t0 = [], time.perf_counter()
    with tt.use_tritonkv(model):
        for i in range(steps + 1):
            if i % every == 0:
                samples.append({"step": i, "rss_mib": round(rss_mib(), 3), "cache_bytes": cache.nbytes,
                                "slots": cache.stored_tokens()})
            if i == steps:
                break
            nxt = logits.argmax(-1, keepdim=True)
            pos = torch.full((1, 1), prompt + i, dtype=torch.long)
            logits = model(input_ids=nxt, position_ids=pos, use_cache=True,
                           **{tt.cache_kwarg(model): cache}).logits[:, -1]
    wall = time.perf_counter() - t0
    w = warmup // every
    rss = [s["rss_mib"] for s in samples]
    nb = [float(s["cache_bytes"]) for s in samples]
    return {"steps": steps, "wall_s": round(wall, 1), "ms_per_step": round(1000 * wall / steps, 2),
            "rss_growth": growth(rss, w), "cache_bytes_growth": growth(nb, w),
            "rss_growth_beyond_cache": beyond_cache(samples, w), "slots_at_end": samples[-1]["slots"],
            "rss_mib_at_warmup": rss[w], "rss_mib_max_after": max(rss[w:]),
            "cache_bytes_at_warmup": int(nb[w]), "cache_bytes_max_after": int(max(nb[w:])),
            "samples": samples}


def random_request(rng: random.Random):
    """(policy, budget, mode, allocation, batch lengths, new tokens, cache kwargs) of one valid request:
    combinations the library refuses by design with a named ValueError are redrawn (recursive LagKV with
    an allocation or a padded batch; a budget below the protected tokens in any row, which for LagKV are its
    sinks and last partition, up to 16 + 255 tokens)."""
    while True:
        policy = rng.choice(sorted(tritonkv.POLICIES))
        mode = rng.choice(["after_prefill", "blockwise", "decoding"])
        allocation = rng.choice([None, None, "uniform", "adakv", "pyramid"])
        lengths = [rng.randint(8, 600) for _ in range(rng.randint(1, 3))]
        budget = rng.choice([round(rng.uniform(0.1, 0.9), 3), rng.randint(40, 400)])
        if policy == "lagkv" and mode == "decoding" and (allocation is not None or len(lengths) > 1):
            continue
        p = tritonkv.get_policy(policy)
        need = 16 + 255 if policy == "lagkv" and mode != "decoding" else p.sink + p.window
        # a float budget is a fraction of each row's own prompt (a padded batch compresses every row as if it ran
        # alone); per-head allocations (pyramid) give some layers a fraction of the average: keep a margin
        if any(kept < 2 * need + 8 and kept < n for n in lengths for kept in [tritonkv.resolve_budget(budget, n)]):
            continue
        kwargs = {"hd": torch.ones(2)} if policy == "score" else {}
        return policy, budget, mode, allocation, lengths, rng.randint(1, 12), kwargs


def server_loop(model, requests: int, warmup: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    errors, rss, log = [], [], []
    t0 = time.perf_counter()
    for r in range(requests):
        policy, budget, mode, allocation, lengths, new, kwargs = random_request(rng)
        T = max(lengths)
        ids = torch.zeros((len(lengths), T), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, n in enumerate(lengths):
            ids[b, T - n:] = torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed * 1000 + r))
            mask[b, T - n:] = 1
        desc = dict(policy=policy, budget=budget, mode=mode, allocation=allocation, lengths=lengths, new=new)
        try:
            out = tt.generate(model, ids, attention_mask=mask, policy=policy, budget=budget, mode=mode,
                              allocation=allocation, block_size=rng.choice([32, 64, 128]), max_new_tokens=new,
                              do_sample=False, pad_token_id=0, cache_kwargs=kwargs)
            if out.shape[0] != len(lengths) or out.shape[1] > T + new:
                raise RuntimeError(f"unexpected output shape {tuple(out.shape)}")
            del out
        except Exception as e:  # counted, with the request that raised it
            errors.append({**desc, "error": f"{type(e).__name__}: {e}"[:300],
                           "where": traceback.format_exc().splitlines()[-3][:200]})
        rss.append(round(rss_mib(), 3))
        log.append(desc)
    wall = time.perf_counter() - t0
    return {"requests": requests, "exceptions": len(errors), "errors": errors, "wall_s": round(wall, 1),
            "rss_growth": growth(rss, warmup), "rss_mib_at_warmup": rss[warmup], "rss_mib_max_after": max(rss[warmup:]),
            "rss_mib": rss, "policies": sorted({d["policy"] for d in log}),
            "modes": sorted({d["mode"] for d in log}),
            "allocations": sorted({str(d["allocation"]) for d in log}),
            "batch_sizes": sorted({len(d["lengths"]) for d in log})}


def markdown(res: dict) -> str:
    m = res["machine"]
    lines = ["# Soak: memory over a long decode and a server-style loop", "",
             f"Command: `{res['command']}` (commit {res['commit']}, {res['date']}).", "",
             f"Machine: {m['cpu']}, {m['cores']} cores shared with other jobs, run single-threaded "
             f"(torch.set_num_threads(1)); torch {m['torch']}, transformers {m['transformers']}, Python "
             f"{m['python']}; CPU only (no GPU in this run).", "",
             "Model: a seeded random Llama (2 layers, hidden 64, 4 query / 2 KV heads, vocab 1000). Growth = "
             "(largest reading after warm-up − reading at the end of warm-up) / that reading; RSS read after "
             "gc.collect() and malloc_trim(0). Target: growth < 2 %, 0 exceptions. The times (ms/step, wall) come "
             "from a machine loaded by other jobs: they are not speed measurements.", "",
             f"## Long decode: {res['decode_steps']} steps in decoding mode (512-token prompt, warm-up "
             f"{res['decode_warmup']} steps, a reading every {res['decode_every']} steps)", ""]
    lines += table([[label, r["ms_per_step"], f"{r['rss_mib_at_warmup']:.1f}", f"{r['rss_mib_max_after']:.1f}",
                     f"{100 * r['rss_growth']:.2f} %", r["cache_bytes_at_warmup"], r["cache_bytes_max_after"],
                     f"{100 * r['cache_bytes_growth']:.2f} %", r["slots_at_end"],
                     f"{100 * r['rss_growth_beyond_cache']:.2f} %"] for label, r in res["decode"].items()], None,
                   ["cache", "ms/step", "RSS at warm-up (MiB)", "RSS max after", "RSS growth", "cache bytes at warm-up",
                    "cache bytes max after", "cache growth", "slots at the end", "RSS growth beyond the cache's"],
                   right=True)
    lines += ["", "LagKV has no budget: its recursive form keeps the ratio r of every partition of L tokens "
              "(plus sinks and the last partition), so its cache grows by design with r·tokens seen (about "
              "r·10,000 slots per layer here); what must stay flat for it is the process's memory beyond those "
              "slots (the last column: RSS growth less the cache's own). The dense and per-head "
              "caches are bounded (budget + decode slack)."]
    s = res["server"]
    lines += ["", f"## Server loop: {s['requests']} requests", "",
              f"Random batch sizes {s['batch_sizes']} (left-padded rows of 8–600 tokens), policies "
              f"{', '.join(s['policies'])}, modes {', '.join(s['modes'])}, allocations "
              f"{', '.join(s['allocations'])}, int or fractional budgets, 1–12 new tokens; greedy "
              f"`tritonkv.integrations.transformers.generate`.", "",
              f"- exceptions: **{s['exceptions']}** of {s['requests']}",
              f"- RSS after request {res['server_warmup']}: {s['rss_mib_at_warmup']:.1f} MiB, largest after it: "
              f"{s['rss_mib_max_after']:.1f} MiB, growth **{100 * s['rss_growth']:.2f} %**",
              f"- wall time {s['wall_s']} s", ""]
    for e in s["errors"]:
        lines.append(f"  - {e}")
    ok = all(r["rss_growth"] < 0.02 and (r["cache_bytes_growth"] < 0.02 or "lagkv" in label)
             and r["rss_growth_beyond_cache"] < 0.02 for label, r in res["decode"].items()) \
        and s["exceptions"] == 0 and s["rss_growth"] < 0.02
    lines += ["", f"Targets met: **{'yes' if ok else 'no'}**.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10_000, help="decode steps per cache (default 10000)")
    p.add_argument("--every", type=int, default=250, help="steps between memory readings (default 250)")
    p.add_argument("--warmup", type=int, default=1000, help="warm-up steps (default 1000)")
    p.add_argument("--requests", type=int, default=300, help="server-loop requests (default 300)")
    p.add_argument("--warmup-requests", type=int, default=30, help="server-loop warm-up requests (default 30)")
    p.add_argument("--out", default=os.path.join(RESULTS, "soak"), help="output path without suffix")
    p.add_argument("--render", action="store_true", help="only rewrite OUT.md from OUT.json")
    a = p.parse_args(argv)
    if a.render:
        with open(a.out + ".json") as f:
            res = json.load(f)
        for r in res["decode"].values():
            r["rss_growth_beyond_cache"] = beyond_cache(r["samples"], res["decode_warmup"] // res["decode_every"])
            r.pop("bytes_per_slot_growth", None)
        write_results(a.out, res, markdown(res))
        return 0
    if a.warmup % a.every or a.warmup >= a.steps or a.warmup_requests >= a.requests:
        p.error("--warmup must be a multiple of --every below --steps, --warmup-requests below --requests")
    torch.set_num_threads(1)
    model = random_llama(max_positions=32768, pad_token_id=0)
    info = run_info(argv=argv)
    res = {"command": info["command"], "commit": info["commit"], "date": info["date"],
           "machine": {k: info[k] for k in ("cpu", "cores", "torch", "transformers", "python")} | {"gpu": None},
           "decode_steps": a.steps, "decode_warmup": a.warmup, "decode_every": a.every,
           "server_warmup": a.warmup_requests, "decode": {}}
    for label, policy, budget, allocation in DECODE_CACHES:
        r = long_decode(model, policy, budget, allocation, a.steps, a.every, a.warmup)
        res["decode"][label] = r
        print(f"{label}: {r['ms_per_step']} ms/step, RSS growth {100 * r['rss_growth']:.2f} %, cache bytes growth "
              f"{100 * r['cache_bytes_growth']:.2f} %", flush=True)
    res["server"] = server_loop(model, a.requests, a.warmup_requests)
    s = res["server"]
    print(f"server: {s['exceptions']} exceptions in {s['requests']} requests, RSS growth {100 * s['rss_growth']:.2f} %",
          flush=True)
    write_results(a.out, res, markdown(res))
    print("wrote", a.out + ".json", a.out + ".md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
