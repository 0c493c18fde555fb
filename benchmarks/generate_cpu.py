"""Wall time of ``generate`` on the CPU in a real model, as a user calls it, against the stock ``model.generate``.

    python -m benchmarks.generate_cpu            # SmolLM2-135M, 2048-token prompt: results/generate_cpu.{json,md}
    python -m benchmarks.generate_cpu --smoke    # a tiny random Llama, one timed run (writes only with --out)

Three calls (``--calls`` picks the tritonkv ones) at the same torch thread count (``torch.set_num_threads``, 1 and
2 by default), greedy, ``--new-tokens`` new tokens from one prompt of real text
(``tritonkv.integrations.needle.build_case``):

- ``stock``: ``model.generate(input_ids, max_new_tokens=M, do_sample=False)`` (the full cache);
- ``keydiff``: ``generate(model, input_ids, policy="keydiff", budget=0.25, mode="blockwise", ...)``;
- ``snapkv+adakv``: the same with ``policy="snapkv", allocation="adakv"``

(``tritonkv.integrations.transformers.generate``, every other setting its default: blocks of 128 tokens, up to 512
tokens per model forward, ``--forward-tokens``). One
warm-up call of each, then ``--runs`` alternating rounds (stock, keydiff, snapkv+adakv, stock, ...) so that every
call sees the same machine load; median and min wall seconds, and ``ratio`` = the call's median / stock's median
(``min ratio``: of the minima, the less disturbed estimate on a shared machine). Target: ratio <= 1.1 at 1 and at
2 threads. On a shared machine the load drifts between runs of the whole benchmark (the same tree has measured
1.0 and 1.2), so the verdict is read off an interval: each round's call over the stock call of the same round
(``paired ratio``, their median) and the distribution-free interval of that median from the rounds' order
statistics (``evaluate_stats.median_ci``: 96 % with 9 rounds; with fewer than 6 it is [min, max] at a lower
coverage, which the table states): ``met`` when it lies below 1.1, ``missed`` above, else ``inconclusive`` (always
with fewer than 6 rounds, whose interval covers less than 95 %). Every
round's seconds are in the JSON (``times_s``). The native CPU path (the ops' PyTorch bodies): run it without
``TRITON_INTERPRET``.

``--parts R``: then R more rounds with wall-clock accumulators around the integration's functions (``PARTS``:
compressions and, within them, window attention's PyTorch body, AdaKV's winners and their layout; prompt-block and
decode attention), seconds per run and calls per run of each part, in the JSON (``parts``) and a second table:
where a call's time goes inside the model, as a user runs it (the accumulators cost ~1 µs a call).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import statistics
import time

import torch

from benchmarks.common import RESULTS, cpu_times, describe, random_llama, run_info, table, write_results
from benchmarks.evaluate_stats import LEVEL, median_ci, verdict
from tritonkv.integrations.transformers.generate import FORWARD_TOKENS

TOKENS, NEW_TOKENS, BUDGET, RUNS, THREADS = 2048, 32, 0.25, 3, (1, 2)
TARGET = 1.1  # a call's wall time over stock's, at most
SMOKE_TOKENS, SMOKE_NEW_TOKENS = 512, 4
CALLS = {"keydiff": dict(policy="keydiff"), "snapkv+adakv": dict(policy="snapkv", allocation="adakv")}


def load(smoke: bool, tokens: int):
    """``(model, input_ids [1, tokens])``: SmolLM2-135M and real text, or (``smoke``) the random Llama and ids."""
    if smoke:
        return random_llama(), torch.randint(3, 1000, (1, tokens), generator=torch.Generator().manual_seed(0))
    from tritonkv.integrations.model import load_smollm2
    from tritonkv.integrations.needle import build_case

    model, tok = load_smollm2()
    return model, build_case(tok, tokens, 0.5, seed=0, subject="apple").input_ids


def calls(model, ids, new_tokens: int, budget, forward_tokens: int = FORWARD_TOKENS, names=None) -> dict:
    """The stock call and each of ``names`` (default: every one of ``CALLS``), as zero-argument functions."""
    from tritonkv.integrations.transformers import generate

    out = {"stock": lambda: model.generate(ids, max_new_tokens=new_tokens, do_sample=False)}
    for name, kw in CALLS.items():
        if names is not None and name not in names:
            continue
        out[name] = (lambda kw=kw: generate(model, ids, budget=budget, mode="blockwise", max_new_tokens=new_tokens,
                                            do_sample=False, forward_tokens=forward_tokens, **kw))
    return out


def run_threads(fns: dict, threads: int, runs: int) -> list:
    torch.set_num_threads(threads)
    length = {name: f().shape[1] for name, f in fns.items()}  # the warm-up calls: prompt + new tokens
    times = dict(zip(fns, cpu_times(list(fns.values()), runs)))
    base = statistics.median(times["stock"])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        row = dict(call=name, threads=threads, median_s=round(med, 3), min_s=round(min(ts), 3),
                   max_s=round(max(ts), 3), ratio=round(med / base, 3),
                   ratio_of_min=round(min(ts) / min(times["stock"]), 3), runs=runs, length=length[name],
                   times_s=[round(t, 4) for t in ts])
        if name != "stock":
            row.update(paired(ts, times["stock"]))
        rows.append(row)
    return rows


_T = "tritonkv.integrations.transformers."
PARTS = {  # part: the functions timed in it, (module, name or Class.method); a name is patched wherever it is bound
    "compressions": [(_T + "cache", "TritonKVLayer.compress_to")],
    "compressions: window attention (PyTorch body)": [("tritonkv.kernels.window_attention",
                                                        "_window_attention_torch")],
    "compressions: AdaKV winners": [("tritonkv.allocation.adakv", "_kept_torch")],
    "compressions: winners laid out": [(_T + "storage", "kept_padded")],
    "prompt-block attention": [(_T + "attention", n) for n in ("block_attention", "suffix_attention",
                                                                "held_attention", "causal_attention")],
    "decode attention": [(_T + "attention", n) for n in ("decode_sdpa", "ragged_decode_sdpa", "kernel_decode")],
    "masked attention (pads)": [(_T + "attention", "masked_attention")],
}


@contextlib.contextmanager
def timing_parts(acc: dict, calls: dict):
    """Wrap every function of ``PARTS`` (in its module and in each integration module that imported it) so that
    each call adds its wall seconds to ``acc[part]`` and 1 to ``calls[part]``; restored on exit."""
    undo = []
    for part, fns in PARTS.items():
        for mod_name, name in fns:
            cls_name, _, attr = name.rpartition(".")
            home = importlib.import_module(mod_name)
            owner = getattr(home, cls_name) if cls_name else home
            f = getattr(owner, attr)

            def timed(*a, _f=f, _part=part, **k):
                t0 = time.perf_counter()
                try:
                    return _f(*a, **k)
                finally:
                    acc[_part] = acc.get(_part, 0.0) + time.perf_counter() - t0
                    calls[_part] = calls.get(_part, 0) + 1

            owners = [owner] + ([] if cls_name else [importlib.import_module(_T + m) for m in ("cache", "attention")])
            for o in owners:
                if o.__dict__.get(attr) is f:
                    undo.append((o, attr, f))
                    setattr(o, attr, timed)
    try:
        yield
    finally:
        for o, attr, f in reversed(undo):
            setattr(o, attr, f)


def run_parts(fns: dict, threads: int, rounds: int) -> list:
    """``rounds`` alternating rounds with ``timing_parts``: per call, seconds and calls per run of each part."""
    torch.set_num_threads(threads)
    acc = {name: {} for name in fns}
    n = {name: {} for name in fns}
    wall = {name: 0.0 for name in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            with timing_parts(acc[name], n[name]):
                t0 = time.perf_counter()
                f()
                wall[name] += time.perf_counter() - t0
    return [dict(call=name, threads=threads, rounds=rounds, wall_s=round(wall[name] / rounds, 3),
                 **{part: [round(acc[name].get(part, 0.0) / rounds, 3), n[name].get(part, 0) // rounds]
                    for part in PARTS}) for name in fns]


def paired(ts, stock) -> dict:
    """The round-by-round ratios of a call's times ``ts`` to the stock call's of the same rounds: their median, its
    interval and coverage (``median_ci``), and the verdict on the target (``met``/``missed``/``inconclusive``)."""
    med, lo, hi, cover = median_ci([t / s for t, s in zip(ts, stock)])
    v = verdict(lo, hi, better="lower", margin=TARGET) if cover >= LEVEL else "inconclusive"  # too few rounds
    return dict(paired_ratio=round(med, 3), ratio_lo=round(lo, 3), ratio_hi=round(hi, 3), coverage=round(cover, 3),
                target={"reproduced": "met", "not reproduced": "missed"}.get(v, v))


def markdown(res) -> str:
    m = res["machine"]
    lines = ["# generate on the CPU: tritonkv vs stock model.generate", "",
             f"{describe(m)}. Command: `{m['command']}` ({res['wall_s']:.0f} s; load average "
             f"{m['load_avg_before'][0]} before, {m['load_avg_after'][0]} after).", "",
             f"{res['model']}, a {res['tokens']}-token prompt, {res['new_tokens']} new tokens (greedy), budget "
             f"{res['budget']}, blockwise (blocks of 128, forwards of up to {res.get('forward_tokens', 128)} tokens). "
             f"Median and min of {res['runs']} alternating runs after a warm-up, in s; ratio = median / stock's "
             f"median, min ratio = min / stock's min; paired ratio = the median over rounds of the call's time / "
             f"stock's in the same round, with the distribution-free interval of that median (its coverage in "
             f"brackets) and the verdict on the target (<= {TARGET}): met (the interval below it), missed (above) "
             f"or inconclusive.", ""]
    rows = [dict(r, interval=None if "ratio_lo" not in r else
                 f"[{r['ratio_lo']}, {r['ratio_hi']}] ({100 * r['coverage']:.0f} %)") for r in res["rows"]]
    lines += table(rows, ["call", "threads", "median_s", "min_s", "ratio", "ratio_of_min", "paired_ratio", "interval",
                          "target"],
                   ["call", "threads", "median s", "min s", "ratio", "min ratio", "paired ratio", "interval", "target"],
                   right=True)
    if res.get("parts"):
        lines += ["", f"Where the time goes: seconds per run (calls per run) of each part, in "
                  f"{res['parts'][0]['rounds']} more rounds with accumulators around the integration's functions "
                  f"(`--parts`; \"compressions: ...\" is time within the compressions).", ""]
        head = [f"{r['call']}, {r['threads']} thr." for r in res["parts"]]
        cells = [["wall"] + [f"{r['wall_s']}" for r in res["parts"]]]
        cells += [[part] + [f"{r[part][0]} ({r[part][1]})" if r[part][1] else "–" for r in res["parts"]]
                  for part in PARTS]
        lines += table(cells, None, ["part"] + head, right=True)
    return "\n".join(lines) + "\n"


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true",
                   help=f"a random 2-layer Llama, {SMOKE_TOKENS} tokens, {SMOKE_NEW_TOKENS} new, one timed run; "
                        f"writes only with --out")
    p.add_argument("--tokens", type=int, help=f"prompt tokens (default {TOKENS})")
    p.add_argument("--new-tokens", type=int, help=f"new tokens (default {NEW_TOKENS})")
    p.add_argument("--budget", type=float, default=BUDGET, help=f"fraction of the prompt kept (default {BUDGET})")
    p.add_argument("--threads", type=int, nargs="+", default=list(THREADS), help="torch thread counts (default 1 2)")
    p.add_argument("--forward-tokens", type=int, default=FORWARD_TOKENS,
                   help=f"prompt tokens per model forward of the block-wise prefill (default {FORWARD_TOKENS})")
    p.add_argument("--calls", nargs="+", choices=list(CALLS), default=list(CALLS),
                   help="the calls timed against stock (default: all); fewer calls, more rounds in the same time")
    p.add_argument("--runs", type=int, help=f"timed rounds per thread count (default {RUNS}; 1 with --smoke)")
    p.add_argument("--parts", type=int, default=0, metavar="R",
                   help="then R rounds timing the integration's parts (PARTS) at each thread count (default 0: none)")
    p.add_argument("--out", help=f"output folder (default {RESULTS}; none with --smoke)")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    tokens = args.tokens or (SMOKE_TOKENS if args.smoke else TOKENS)
    new_tokens = args.new_tokens or (SMOKE_NEW_TOKENS if args.smoke else NEW_TOKENS)
    runs = args.runs or (1 if args.smoke else RUNS)
    load_before = [round(x, 2) for x in os.getloadavg()]
    t0 = time.perf_counter()
    model, ids = load(args.smoke, tokens)
    fns = calls(model, ids, new_tokens, args.budget, args.forward_tokens, args.calls)
    rows = []
    with torch.no_grad():
        for threads in args.threads:
            rows += run_threads(fns, threads, runs)
            for r in rows[-len(fns):]:
                print(r, flush=True)
        parts = [p for threads in args.threads for p in run_parts(fns, threads, args.parts)] if args.parts else []
        for r in parts:
            print(r, flush=True)
    machine = dict(run_info(argv=argv), load_avg_before=load_before,
                   load_avg_after=[round(x, 2) for x in os.getloadavg()])
    res = dict(machine=machine, wall_s=round(time.perf_counter() - t0, 1), smoke=args.smoke,
               model="a random 2-layer Llama" if args.smoke else "SmolLM2-135M-Instruct (fp32)", tokens=tokens,
               new_tokens=new_tokens, budget=args.budget, forward_tokens=args.forward_tokens, runs=runs, rows=rows,
               parts=parts)
    out = args.out or (None if args.smoke else RESULTS)
    if out:
        write_results(os.path.join(out, "generate_cpu"), res, markdown(res))
    return res


if __name__ == "__main__":
    main()
