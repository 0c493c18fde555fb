"""CPU speed of ``tritonkv.compress`` against a plain PyTorch pipeline doing the same work (issue 13.6).

    python benchmarks/cpu_speed.py              # N = 4096 and 32768: benchmarks/results/cpu_speed.{json,md}
    python benchmarks/cpu_speed.py --smoke      # tiny N, one timed run: checks the program (writes only with --out)

For every registered policy, ``tritonkv.compress`` of fp32 K/V ``[1, 8, N, 128]`` keeping 25 % on the CPU
(the ops' vectorised PyTorch bodies; no Triton interpreter: the block runs under ``cpu_kernels("torch")``)
is timed against a plain PyTorch pipeline timed in the same run: the same policy's scores written directly
in torch, ``torch.topk`` of the kept count, a sort of the kept indices and a gather of K/V (``plain_*``
below; each forces the policy's protected tokens the way a user would, with +inf or by construction).
Policies that read queries get the last W = 32 queries with H_q = 4·H_kv = 32; CriticalKV a random W_O
``[D_model, H_q·128] = [1024, 4096]``; SCORE random head distinctness. CriticalKV's ‖v W_O^q‖₁ costs
N·H_q·128·D_model multiply-adds (0.27 TFLOP at 32K: ~20 s a call on 2 cores), in tritonkv and in the plain
pipeline alike; a Llama-3-8B layer (``--d-model 4096``) takes 4x as long and the whole run ~15 minutes.

Timing: wall clock (``time.perf_counter``), one warm-up call of each side (their kept sets are compared),
then ``--runs`` (default 5; 3 where a warm-up call took over 2 s, 1 over 10 s: CriticalKV at 32K)
alternating runs (tritonkv, plain, tritonkv, ...) so both see the same machine load; the median is reported
with the min and max, and the ratio of the minima beside the ratio of the medians (on a machine shared
with other processes the minimum is the less disturbed estimate); the load average before and after. ``ratio`` = tritonkv / plain (target ≤ 1.5). ``same_kept`` is the fraction of (batch, head)
rows whose kept index sets agree between the two, ``overlap`` the mean fraction of a row's kept tokens
kept by both: ties (max pooling repeats a value over up to κ positions; LagKV's ranks) go to the lower
index in tritonkv and anywhere in ``torch.topk``, and fp32 near-ties may fall either way.

Output: JSON (machine: CPU model, cores, torch threads; torch version, commit, date, the command; one row
per policy and N) and a Markdown table, ``<out>/cpu_speed.{json,md}``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import tritonkv
from tritonkv.kernels._common import INTERPRET, cpu_kernels

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
B, H, D, G, W = 1, 8, 128, 4, 32
D_MODEL = 1024  # W_O [D_model, H_q·D] = [1024, 4096] (a Llama-3-8B layer has 4096: --d-model 4096, 4x the time)
KEEP = 0.25
SIZES = (4096, 32768)
SMOKE_SIZES = (1024,)
SMOKE_D_MODEL = 256
SLOW_S = (2.0, 10.0)  # a case whose warm-up call takes longer gets 3 (1) timed runs
INF = float("inf")


# ---------------------------------------------------------------------------------------------
# plain PyTorch pipelines: scores, topk, sort, gather


def gather(keys, values, idx):
    """Kept K/V at ``idx`` [B, H, k] (ascending)."""
    g = idx[..., None].expand(-1, -1, -1, keys.shape[-1])
    return keys.gather(2, g), values.gather(2, g), idx


def topk_sorted(s, k):
    return s.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values


def window_scores(keys, queries, w, *, kernel_size=1, rows="mean"):
    """Softmax of the last ``w`` queries over the keys (causal inside the window), reduced over the
    window rows (mean or sum) and the query group (mean), max-pooled over the prefix."""
    b, h, n, d = keys.shape
    q = queries[:, :, -w:]
    g = q.shape[1] // h
    logits = q.reshape(b, h, g * w, d) @ keys.transpose(-1, -2) / math.sqrt(d)
    causal = torch.arange(n) > (n - w + torch.arange(w)).repeat(g)[:, None]
    p = logits.masked_fill(causal, -INF).softmax(-1).view(b, h, g, w, n)
    u = (p.sum(3) if rows == "sum" else p.mean(3)).mean(2)
    if kernel_size > 1:
        pooled = F.max_pool1d(u[..., :n - w], kernel_size, 1, kernel_size // 2)[..., :n - w]
        u = torch.cat([pooled, u[..., n - w:]], dim=-1)
    return u


def protect_window(s, w):
    s[..., s.shape[-1] - w:] = INF
    return s


def value_norms(values, o_proj, block=1 << 24):
    """mean over the group of ‖W_O^q v_j‖₁, in token chunks (a [B, H, G, n, D_model] block of ≤ 64 MiB)."""
    b, h, n, d = values.shape
    dm = o_proj.shape[0]
    g = o_proj.shape[1] // (h * d)
    w = o_proj.view(dm, h, g, d).permute(1, 2, 3, 0)
    step = max(1, block // (b * h * g * dm))
    return torch.cat([(values[:, :, None, t:t + step] @ w).abs().sum(-1).mean(2) for t in range(0, n, step)], -1)


def lagkv_indices(keys, values, k, sink=16, lag=128):
    """LagKV budget mode: per scored partition the top ⌊b/(P−1)⌋ (one more in the first b mod (P−1)) by
    φ_K + φ_V against the next partition, plus the sinks and the tail."""
    b_, h, n, d = keys.shape
    p = (n - sink) // lag
    tail = n - sink - (p - 1) * lag

    def phi(t):
        z = t[:, :, sink:sink + p * lag].reshape(b_, h, p, lag, d)
        lo, hi = z[:, :, 1:].amin(3, keepdim=True), z[:, :, 1:].amax(3, keepdim=True)
        return ((z[:, :, :-1] - lo) / (hi - lo).clamp_min(1e-6)).std(-1).softmax(-1)

    q, rem = divmod(k - sink - tail, p - 1)
    top = (phi(keys) + phi(values)).topk(q + 1, dim=-1).indices + sink + lag * torch.arange(p - 1)[:, None]
    take = (torch.arange(q + 1) < q) | (torch.arange(p - 1)[:, None] < rem)  # [P−1, q+1], the same for every row
    return torch.cat([torch.arange(sink).expand(b_, h, sink), top[:, :, take],
                      torch.arange(n - tail, n).expand(b_, h, tail)], -1).sort(-1).values


def plain(name, keys, values, k, inputs):
    """The plain PyTorch pipeline of policy ``name``: a zero-argument function returning (K, V, indices)."""
    n = keys.shape[2]
    q = inputs.get("queries")
    if name == "knorm":
        return lambda: gather(keys, values, topk_sorted(-keys.norm(dim=-1), k))
    if name == "keydiff":
        def run():
            a = F.normalize(keys, dim=-1).mean(2, keepdim=True)
            return gather(keys, values, topk_sorted(-F.cosine_similarity(keys, a, dim=-1), k))
        return run
    if name == "streaming_llm":
        idx = torch.cat([torch.arange(4), torch.arange(n - (k - 4), n)]).expand(B, H, k)
        return lambda: gather(keys, values, idx)
    if name == "lagkv":
        return lambda: gather(keys, values, lagkv_indices(keys, values, k))
    if name in ("snapkv", "surfacelogic", "h2o", "tova"):
        w = 1 if name == "tova" else W
        opts = dict(kernel_size=7 if name == "snapkv" else 1, rows="sum" if name == "h2o" else "mean")
        return lambda: gather(keys, values, topk_sorted(protect_window(window_scores(keys, q, w, **opts), w), k))
    if name == "criticalkv":  # stage 1: top ⌊α·b⌋ by SnapKV scores; stage 2: the rest by (s + ε)·‖v W_O‖₁
        def run():
            s = window_scores(keys, q, W, kernel_size=7)
            first = s[..., :n - W].topk(math.floor(0.5 * (k - W) + 1e-6), dim=-1).indices
            s2 = protect_window((s + 1e-4) * value_norms(values, inputs["o_proj"]), W).scatter(-1, first, INF)
            return gather(keys, values, topk_sorted(s2, k))
        return run
    if name == "score":  # parallel: penalise tokens the other heads' unpenalised top-b also pick
        def run():
            s = window_scores(keys, q, W)[..., :n - W]
            u = torch.zeros_like(s).scatter(-1, s.topk(k - W, dim=-1).indices, 1.0)
            pen = s * torch.exp(-(0.004 / inputs["hd"])[:, None] * (u.sum(1, keepdim=True) - u))
            sel = pen.topk(k - W, dim=-1, sorted=False).indices
            return gather(keys, values, torch.cat([sel, torch.arange(n - W, n).expand(B, H, W)], -1).sort(-1).values)
        return run
    raise KeyError(f"no plain pipeline for policy {name!r}")


# ---------------------------------------------------------------------------------------------
# timing


def make_inputs(n, d_model=D_MODEL, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)
    hq = G * H
    inputs = {"queries": torch.randn(B, hq, W, D, generator=g),
              "o_proj": torch.randn(d_model, hq * D, generator=g) / math.sqrt(hq * D),
              "hd": torch.rand(H, generator=g) + 0.1}
    return keys, values, inputs


def time_pair(fa, fb, runs):
    """``runs`` alternating timed calls of each (both already warmed up): (times_a, times_b) in seconds."""
    ta, tb = [], []
    for _ in range(runs):
        for f, t in ((fa, ta), (fb, tb)):
            t0 = time.perf_counter()
            f()
            t.append(time.perf_counter() - t0)
    return ta, tb


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
    keys, values, pool = make_inputs(n, d_model)
    pol = tritonkv.get_policy(name)
    inputs = {x: pool[x] for x in pol.needs}
    k = tritonkv.resolve_budget(KEEP, n)
    ours = lambda: tritonkv.compress((keys, values), name, KEEP, **inputs)  # noqa: E731
    ref = plain(name, keys, values, k, inputs)
    (out, t_ours), (want, t_ref) = timed(ours), timed(ref)
    assert out.indices.shape == (B, H, k) and want[2].shape == (B, H, k), (name, out.indices.shape, want[2].shape)
    same, overlap = agreement(out.indices, want[2])
    t = max(t_ours, t_ref)
    runs = min(runs, 1 if t > slow[1] else 3 if t > slow[0] else runs)
    ta, tb = time_pair(ours, ref, runs)
    a, b = statistics.median(ta), statistics.median(tb)
    return dict(policy=name, N=n, k=k, runs=runs, tritonkv_ms=ms(a), plain_ms=ms(b), ratio=round(a / b, 2),
                ratio_of_min=round(min(ta) / min(tb), 2),
                tritonkv_min_ms=ms(min(ta)), tritonkv_max_ms=ms(max(ta)), plain_min_ms=ms(min(tb)),
                plain_max_ms=ms(max(tb)), same_kept=round(same, 3), overlap=round(overlap, 4))


# ---------------------------------------------------------------------------------------------
# machine, output


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def commit() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def markdown(res) -> str:
    m = res["machine"]
    lines = ["# CPU speed: tritonkv.compress vs a plain PyTorch pipeline",
             "",
             f"{m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), torch {res['torch']}, "
             f"commit {res['commit']}, {res['date']}. Command: `{res['command']}` ({res['wall_s']:.0f} s; load "
             f"average {m['load_avg_before'][0]} before, {m['load_avg_after'][0]} after).",
             "",
             f"K/V fp32 [{B}, {H}, N, {D}], keep {KEEP:.0%}, the native CPU path (the ops' PyTorch bodies). Window "
             f"policies read W = {W} queries, H_q = {G * H}; CriticalKV's W_O is [{res['d_model']}, {G * H * D}]. "
             f"Median of {res['runs']} alternating runs (3 where a call takes over {SLOW_S[0]:g} s, 1 over "
             f"{SLOW_S[1]:g} s: the runs column) after a warm-up, "
             f"in ms. ratio = tritonkv / plain of the medians (target ≤ 1.5), min ratio = of the fastest runs "
             f"(less sensitive to other processes on a shared machine). same_kept = fraction of rows with the same kept "
             f"set, overlap = mean fraction of kept tokens in both (ties go to the lower index in tritonkv, "
             f"anywhere in torch.topk).",
             "",
             "| policy | N | tritonkv ms | plain ms | ratio | min ratio | runs | same_kept | overlap |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['policy']} | {r['N']} | error: {r['error']} | | | | | | |")
        else:
            lines.append(f"| {r['policy']} | {r['N']} | {r['tritonkv_ms']} | {r['plain_ms']} | {r['ratio']} | "
                         f"{r['ratio_of_min']} | {r['runs']} | {r['same_kept']} | {r['overlap']} |")
    return "\n".join(lines) + "\n"


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help=f"N = {SMOKE_SIZES}, D_model = {SMOKE_D_MODEL}, one timed "
                                                        f"run; writes only with --out")
    p.add_argument("--sizes", type=int, nargs="+", help=f"token counts N (default {SIZES})")
    p.add_argument("--policies", nargs="+", help="policy names (default: every registered policy)")
    p.add_argument("--runs", type=int, help="timed runs per side (default 5; 1 with --smoke)")
    p.add_argument("--d-model", type=int, help=f"rows of CriticalKV's W_O (default {D_MODEL}; {SMOKE_D_MODEL} "
                                               f"with --smoke)")
    p.add_argument("--out", help=f"output folder (default {RESULTS}; none with --smoke)")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    sizes = args.sizes or (SMOKE_SIZES if args.smoke else SIZES)
    runs = args.runs or (1 if args.smoke else 5)
    names = args.policies or sorted(tritonkv.POLICIES)
    d_model = args.d_model or (SMOKE_D_MODEL if args.smoke else D_MODEL)
    rows = []
    load = [round(x, 2) for x in os.getloadavg()]
    t0 = time.perf_counter()
    with cpu_kernels("torch"), torch.no_grad():
        for n in sizes:
            for name in names:
                try:
                    rows.append(run_case(name, n, runs, d_model))
                except Exception as e:  # noqa: BLE001 (reported in the table, the run goes on)
                    rows.append(dict(policy=name, N=n, error=f"{type(e).__name__}: {e}"[:300]))
                print(json.dumps(rows[-1]), flush=True)
    res = dict(machine=dict(cpu=cpu_model(), cores=os.cpu_count(), torch_threads=torch.get_num_threads(),
                            platform=platform.platform(), load_avg_before=load,
                            load_avg_after=[round(x, 2) for x in os.getloadavg()]),
               torch=torch.__version__, commit=commit(),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               command="python " + " ".join([os.path.relpath(sys.argv[0])] + (sys.argv[1:] if argv is None else argv)),
               wall_s=round(time.perf_counter() - t0, 1), triton_interpret=INTERPRET, runs=runs, sizes=list(sizes), keep=KEEP, d_model=d_model, rows=rows)
    out = args.out or (None if args.smoke else RESULTS)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "cpu_speed.json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(out, "cpu_speed.md"), "w") as f:
            f.write(markdown(res))
    return res


if __name__ == "__main__":
    res = main()
    sys.exit(1 if any("error" in r for r in res["rows"]) else 0)
