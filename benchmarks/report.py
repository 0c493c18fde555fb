"""Write ``benchmarks/results/README.md``, the page of result tables, from the committed results beside it.

    python -m benchmarks.report             # rewrite benchmarks/results/README.md
    python -m benchmarks.report --check     # exit 1 when it is out of date (a test runs this)

Its sections and what each benchmark measures: docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from benchmarks.common import RESULTS, jsonl_files

OTHERS = [  # (file or glob in results/, what it holds); any other Markdown file found is listed after these
    ("cpu_speed.md", "`compress` against the plain PyTorch pipelines on the CPU (`cpu_speed.py`)"),
    ("host_time.md", "the host (Python) time of an eager `compress` on the GPU path, before and after a change "
                     "(`host_time.py`)"),
    ("tp_memory.md", "per-rank memory under tensor parallelism and what balancing it costs (`tp_memory.py`)"),
    ("kernel_stats.md", "registers, spills, shared memory and occupancy of every kernel, launches per policy "
                        "(`kernel_stats.py`)"),
    ("kernel_stats-triton-*.md", "the full kernel statistics under one Triton version (`kernel_stats.py`)"),
    ("lagkv_tilings.md", "LagKV's kernel tilings (`tile`/`warps`) compiled under Triton 3.6 and 3.9: registers, "
                         "programs per SM, per-partition SASS, the channel layouts behind their exactness "
                         "(`lagkv_tilings.py`; no GPU)"),
    ("lagkv-tilings/kernel_stats-triton-*.md", "the kernel statistics of LagKV's tilings under one Triton version "
                                               "(`kernel_stats.py --only`)"),
    ("nvidia-h200-memory/memory.md", "memory inside a model on an H200 (`memory.py` on a GPU)"),
    ("memory-8k/memory.md", "memory inside a model at N = 8192 and 16384, KeyDiff and SnapKV + AdaKV in every mode "
                            "(`memory.py`)"),
    ("memory-8k-block128/*/memory.md", "memory at N = 8192 in blocks of 128, one block or 512 tokens per model "
                                       "forward (`memory.py --block-size --forward-tokens`)"),
    ("memory-gemma3/memory.md", "memory inside a random Gemma 3 (five sliding-window layers to one full) at "
                                "N = 8K-32K (`memory.py --model gemma3`)"),
    ("memory-gpt-oss/memory.md", "memory inside a random gpt-oss (attention sinks; sliding-window and full layers) "
                                 "against its stock eager attention (`memory.py --model gpt-oss`)"),
    ("generate_cpu-forwards/README.md", "block-wise `generate` on the CPU with one block per forward against 512 "
                                        "tokens per forward (`generate_cpu.py --forward-tokens`)"),
    ("generate_cpu.md", "block-wise `generate` (KeyDiff, SnapKV + AdaKV) against the stock `model.generate` on the "
                        "CPU at 1 and 2 torch threads, a 2,048-token prompt (`generate_cpu.py`)"),
    ("generate_cpu-2k/README.md", "the 2,048-token runs of 2026-12-07: the spread between runs of the same tree, "
                                  "where SnapKV + AdaKV's time goes (`generate_cpu.py --parts`), a cheaper per-head "
                                  "compression"),
    ("generate_cpu-8k/README.md", "the same at an 8,000-token prompt, before and after the PyTorch bodies took their "
                                  "exponentials in base 2 (`generate_cpu.py --tokens 8000`)"),
    ("cache_release.md", "a returned cache is freed with its last reference (`cache_release.py`)"),
    ("soak.md", "memory over a 10,000-step decode and 300 random `generate` requests (`soak.py`)"),
    ("batch_invariance.json", "each row of a left-padded batch against the row alone (`batch_invariance.py`)"),
    ("batch_invariance-gemma3-sliding.json", "the same on a random Gemma 3 with a sliding-window layer "
     "(`batch_invariance.py --model gemma3-sliding`)"),
    ("batch_invariance-gpt-oss.json", "the same on a random gpt-oss with attention sinks "
     "(`batch_invariance.py --model gpt-oss`)"),
    ("batch_invariance-gemma2-softcap.json", "the same on a random Gemma 2 with logit softcapping "
     "(`batch_invariance.py --model gemma2-softcap`)"),
    ("batch_invariance-interpret.json", "the first 33 cases with every policy's Triton kernels under "
     "`TRITON_INTERPRET=1` (`TRITON_INTERPRET=1 python -m benchmarks.batch_invariance --cases 33`)"),
    ("compiled_decode.json", "a decode loop under `torch.compile(fullgraph=True)` against the eager loop "
                             "(`compiled_decode.py`)"),
    ("quality/profiles/README.md", "the SurfaceLogicKV INF profiles of the quality runs"),
    ("gpu_tests.md", "the test suite on GPUs"),
    ("hypothesis_deep.md", "the property tests with thousands of examples, and the kernels' tests under Triton 3.6"),
    ("generate_cpu-2k/*/generate_cpu.md", "the single runs that generate_cpu-2k/README.md compares (each folder: "
                                          "the tree, the threads and the rounds)"),
    ("generate_cpu-8k/**/generate_cpu.md", "the single runs that generate_cpu-8k/README.md compares"),
    ("generate_cpu-ab/README.md", "`generate` on the CPU before and after a change of 2026-11-26, run back to back"),
    ("host_time-*.md", "host time per eager `compress` before and after a change, both trees in one run "
                       "(`host_time.py --compare <commit>`; the file says which)"),
    ("memory-8k-stop*/memory.md", "memory at N = 8192 in every mode, rerun after the changes of 2026-12-07 and "
                                  "2026-12-08 to check that none raised a peak (`memory.py --n 8192`)"),
    ("memory-8k-2026-*/memory.md", "the same check after the changes of that date"),
    ("nvidia-h100-memory-32k/memory.md", "block-wise prefill's peak at N = 32768 on an H100 (`memory.py` on a GPU)"),
    ("nvidia-h100-2026-11-26/*.md", "block-wise prefill on an H100 against the stock chunked prefill, and where its "
                                    "time goes"),
    ("serving-cpu-*.md", "vLLM with and without the plugin on needle prompts, on the CPU (`serving.py --task "
                         "needle`; the file names the policy)"),
]
SECTIONS = ("README.md", "memory.md", "quality/README.md")  # the page itself and the files its sections link


def quality_section(results_dir: str = RESULTS) -> str:
    """The claims, their verdicts and headline intervals, and the plots, from the records in ``quality/``."""
    qdir = os.path.join(results_dir, "quality")
    if not jsonl_files(qdir):
        return "No quality records are committed yet (`python -m benchmarks.evaluate`, see its docstring)."
    from benchmarks.evaluate_report import build, readme_section

    return readme_section(build(qdir, write=False), rel="quality", plots_dir=qdir)


def speed_section(results_dir: str = RESULTS) -> str:
    """Every full-run ``<device>-speed.md`` from ``speed.py`` on a GPU (its compress, allocation, decode-attention
    and scaling tables), then its plots."""
    files = sorted(f for f in glob.glob(os.path.join(results_dir, "*-speed.md"))
                   if not os.path.basename(f).startswith("cpu"))
    if not files:
        return ("No speed results yet: `benchmarks/speed.py` needs a CUDA GPU. Run `python -m benchmarks.speed` on "
                "one, then `python -m benchmarks.report`.")
    out = []
    for f in files:
        with open(f) as fh:
            out += [f"From [{os.path.basename(f)}]({os.path.basename(f)}):", "", fh.read().strip(), ""]
        figures = ((f[:-3] + "-scaling.png", "compress time vs N"), (f[:-3] + ".png", "compress time over the floor"))
        plots = [f"![{title}]({os.path.basename(p)})" for p, title in figures if os.path.exists(p)]
        if plots:
            out += [" ".join(plots), ""]
    return "\n".join(out).strip()


def memory_section(results_dir: str = RESULTS) -> str:
    """``memory.py``'s summary of ``memory.json``: peak during ``generate`` as a multiple of stock per configuration
    and N, resident / kept, with links to its tables and plot."""
    path = os.path.join(results_dir, "memory.json")
    if not os.path.exists(path):
        return ("No memory results are committed yet (`python -m benchmarks.memory`, then "
                "`python -m benchmarks.report`).")
    from benchmarks.memory import readme_section

    with open(path) as f:
        return readme_section(json.load(f), results_dir, rel="")


def render(results_dir: str = RESULTS) -> str:
    rel = lambda f: os.path.relpath(f, results_dir)  # noqa: E731
    others, seen = [], {*SECTIONS, *map(rel, glob.glob(os.path.join(results_dir, "*-speed.md")))}
    for pattern, what in OTHERS + [("**/*.md", None)]:
        for f in sorted(map(rel, glob.glob(os.path.join(results_dir, pattern), recursive=True))):
            if f not in seen:
                seen.add(f)
                others.append(f"- [{f}]({f})" + (f": {what}" if what else ""))
    return "\n".join([
        "# Benchmark results", "",
        "Generated by `python -m benchmarks.report` from the results in this folder (do not edit by hand; "
        "`python -m benchmarks.report --check` fails when this page is stale). What each benchmark measures and how "
        "to run it: [docs/benchmarks.md](../../docs/benchmarks.md).", "",
        "## Quality", "", quality_section(results_dir), "",
        "## Speed on a GPU", "", speed_section(results_dir), "",
        "## Memory inside a model", "", memory_section(results_dir), "",
        "## Other results", "", *others]) + "\n"


def main(argv=None, results_dir: str = RESULTS) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 when the page is out of date, write nothing")
    a = p.parse_args(argv)
    path = os.path.join(results_dir, "README.md")
    old = open(path).read() if os.path.exists(path) else None
    new = render(results_dir)
    if a.check:
        if new != old:
            print(f"{path} is out of date: run python -m benchmarks.report", file=sys.stderr)
            return 1
        return 0
    if new != old:
        with open(path, "w") as f:
            f.write(new)
    print("updated" if new != old else "unchanged", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
