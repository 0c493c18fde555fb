"""CPU speed of ``tritonkv.compress`` against a plain PyTorch pipeline doing the same work.

    python -m benchmarks.cpu_speed              # N = 4096 and 32768: benchmarks/results/cpu_speed.{json,md}
    python -m benchmarks.cpu_speed --smoke      # tiny N, one timed run: checks the program (writes only with --out)

Inputs, timing and the agreement columns: docs/benchmarks.md ("Speed: how it is measured").
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import tritonkv
from benchmarks import baselines
from benchmarks.common import RESULTS, cpu_times, describe, random_case, run_info, table, write_results
from tritonkv.kernels._common import INTERPRET, cpu_kernels

B, H, D, G, W = 1, 8, 128, 4, baselines.W
D_MODEL = 1024  # W_O [D_model, H_q·D] = [1024, 4096] (a Llama-3-8B layer has 4096: --d-model 4096, 4x the time)
KEEP = 0.25
SIZES = (4096, 32768)
SMOKE_SIZES = (1024,)
SMOKE_D_MODEL = 256
SLOW_S = (2.0, 10.0)  # a case whose warm-up call takes longer gets 3 (1) timed runs


def timed(f):
    t0 = time.perf_counter()
    out = f()
    return out, time.perf_counter() - t0


def agreement(a, b) -> tuple[float, float]:
    """(fraction of rows whose kept index sets agree, mean fraction of a row's kept tokens in both)."""
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    same = (a.sort(-1).values == b.sort(-1).values).all(-1).float().mean()
    n = int(max(a.max(), b.max())) + 1
    hit = torch.zeros(a.shape[0], n).scatter_(1, a, 1.0).gather(1, b).mean()
    return float(same), float(hit)


def ms(t):
    return round(1e3 * t, 2)


def run_case(name, n, runs, d_model=D_MODEL, slow=SLOW_S):
    """One policy at one N: the warm-up calls also give the kept sets compared; a case whose warm-up
    call takes more than ``slow[0]`` (``slow[1]``) seconds gets 3 (1) timed runs."""
    keys, values, pool = random_case(n, B, H, G, D, W, d_model=d_model)
    pol = tritonkv.get_policy(name)
    inputs = {x: pool[x] for x in pol.needs}
    k = tritonkv.resolve_budget(KEEP, n)
    ours = lambda: tritonkv.compress((keys, values), name, KEEP, **inputs)  # noqa: E731
    ref = baselines.pipeline(name, keys, values, k, inputs)
    (out, t_ours), (want, t_ref) = timed(ours), timed(ref)
    assert out.indices.shape == (B, H, k) and want[2].shape == (B, H, k), (name, out.indices.shape, want[2].shape)
    same, overlap = agreement(out.indices, want[2])
    t = max(t_ours, t_ref)
    runs = min(runs, 1 if t > slow[1] else 3 if t > slow[0] else runs)
    ta, tb = cpu_times([ours, ref], runs)
    a, b = statistics.median(ta), statistics.median(tb)
    return dict(policy=name, N=n, k=k, runs=runs, tritonkv_ms=ms(a), plain_ms=ms(b), ratio=round(a / b, 2),
                ratio_of_min=round(min(ta) / min(tb), 2),
                tritonkv_min_ms=ms(min(ta)), tritonkv_max_ms=ms(max(ta)), plain_min_ms=ms(min(tb)),
                plain_max_ms=ms(max(tb)), same_kept=round(same, 3), overlap=round(overlap, 4))


def markdown(res) -> str:
    m = res["machine"]
    rows = [[r["policy"], r["N"], f"error: {r['error']}"] + [""] * 6 if "error" in r else
            [r[c] for c in ("policy", "N", "tritonkv_ms", "plain_ms", "ratio", "ratio_of_min", "runs", "same_kept",
                            "overlap")] for r in res["rows"]]
    lines = ["# CPU speed: tritonkv.compress vs a plain PyTorch pipeline",
             "",
             f"{describe(m)} ({m['torch_threads']} torch threads). Command: `{m['command']}` ({res['wall_s']:.0f} s; "
             f"load average {m['load_avg_before'][0]} before, {m['load_avg_after'][0]} after).",
             "",
             f"K/V fp32 [{B}, {H}, N, {D}], keep {KEEP:.0%}, the native CPU path (the ops' PyTorch bodies). Window "
             f"policies read W = {W} queries, H_q = {G * H}; CriticalKV's W_O is [{res['d_model']}, {G * H * D}]. "
             f"Median of {res['runs']} alternating runs (3 where a call takes over {SLOW_S[0]:g} s, 1 over "
             f"{SLOW_S[1]:g} s: the runs column) after a warm-up, "
             f"in ms. ratio = tritonkv / plain of the medians (target ≤ 1.5), min ratio = of the fastest runs "
             f"(less sensitive to other processes on a shared machine). same_kept = fraction of rows with the same "
             f"kept set, overlap = mean fraction of kept tokens in both (ties go to the lower index in tritonkv, "
             f"anywhere in torch.topk).",
             ""]
    lines += table(rows, None, ["policy", "N", "tritonkv ms", "plain ms", "ratio", "min ratio", "runs", "same_kept",
                                "overlap"], right=True)
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help=f"N = {SMOKE_SIZES}, D_model = {SMOKE_D_MODEL}, one timed "
                                                        f"run; writes only with --out")
    p.add_argument("--runs", type=int, help="timed runs per side (default 5; 1 with --smoke)")
    p.add_argument("--d-model", type=int, help=f"rows of CriticalKV's W_O (default {D_MODEL}; {SMOKE_D_MODEL} "
                                               f"with --smoke)")
    p.add_argument("--out", help=f"output folder (default {RESULTS}; none with --smoke)")
    args = p.parse_args(argv)
    sizes = SMOKE_SIZES if args.smoke else SIZES
    runs = args.runs or (1 if args.smoke else 5)
    d_model = args.d_model or (SMOKE_D_MODEL if args.smoke else D_MODEL)
    rows = []
    load = [round(x, 2) for x in os.getloadavg()]
    t0 = time.perf_counter()
    with cpu_kernels("torch"), torch.no_grad():
        for n in sizes:
            for name in sorted(tritonkv.POLICIES):
                try:
                    rows.append(run_case(name, n, runs, d_model))
                except Exception as e:  # noqa: BLE001 (reported in the table, the run goes on)
                    rows.append(dict(policy=name, N=n, error=f"{type(e).__name__}: {e}"[:300]))
                print(json.dumps(rows[-1]), flush=True)
    machine = dict(run_info(argv=argv), load_avg_before=load, load_avg_after=[round(x, 2) for x in os.getloadavg()])
    res = dict(machine=machine, wall_s=round(time.perf_counter() - t0, 1), triton_interpret=INTERPRET, runs=runs,
               sizes=list(sizes), keep=KEEP, d_model=d_model, rows=rows)
    out = args.out or (None if args.smoke else RESULTS)
    if out:
        write_results(os.path.join(out, "cpu_speed"), res, markdown(res))
    return res


if __name__ == "__main__":
    res = main()
    sys.exit(1 if any("error" in r for r in res["rows"]) else 0)
