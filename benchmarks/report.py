"""Regenerate README.md's result tables from the committed results in ``benchmarks/results``.

Writes only between ``<!-- quality:begin -->``/``<!-- quality:end -->``, ``<!-- speed:begin -->``/
``<!-- speed:end -->`` and ``<!-- memory:begin -->``/``<!-- memory:end -->``; when markers are absent, a
"## Which policy?" section (quality, speed) or a "## Memory inside a model" section (memory) holding them is
appended.

    python benchmarks/report.py             # rewrite README.md
    python benchmarks/report.py --check     # exit 1 when README.md is out of date
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
RESULTS = os.path.join(HERE, "results")
README = os.path.join(os.path.dirname(HERE), "README.md")
SECTIONS = ("quality", "speed", "memory")
HEADINGS = {"quality": "Which policy?", "speed": "Which policy?", "memory": "Memory inside a model"}


def quality_section(results_dir: str = RESULTS) -> str:
    """Markdown for the quality markers. With per-case records in ``results/quality/`` (``benchmarks/evaluate.py``):
    the claims, their verdicts and headline intervals (``evaluate_report.readme_section``) and the plots; otherwise
    the older one-trial tables and claims from ``quality.json``."""
    qdir = os.path.join(results_dir, "quality")
    if [f for f in glob.glob(os.path.join(qdir, "*.jsonl")) if os.path.basename(f) != "runs.jsonl"]:
        from evaluate_report import build, readme_section

        return readme_section(build(qdir, write=False), rel=os.path.relpath(qdir, os.path.dirname(HERE)),
                              plots_dir=qdir)
    path = os.path.join(results_dir, "quality.json")
    if not os.path.exists(path):
        return "No quality results are committed yet (run `TRITON_INTERPRET=1 python benchmarks/quality.py --quick`)."
    from quality import claims, table

    with open(path) as f:
        data = json.load(f)
    rows = data["rows"]
    ctx = ", ".join(str(c) for c in sorted({r["context"] for r in rows}))
    out = [f"Quality on {data.get('model', 'SmolLM2-135M-Instruct')} (CPU), context {ctx} tokens of real text, "
           f"commit `{data.get('commit', '')[:10]}`, {data.get('date', '')[:10]}; full tables, plots and method in "
           "[benchmarks/results/quality.md](benchmarks/results/quality.md). Budgets are fractions kept per head.", ""]
    for metric, mode, title in (("attn_err", "after_prefill", "Attention-output error of future queries "
                                 "(‖o−ô‖₁/‖o‖₁, lower is better)"),
                                ("needle", "blockwise", "Needle accuracy by likelihood, block-wise prefill"),
                                ("kl", "blockwise", "KL(full ‖ compressed), nats, block-wise prefill"),
                                ("needle", "after_prefill", "Needle accuracy by likelihood, after prefill"),
                                ("kl", "after_prefill", "KL(full ‖ compressed), nats, after prefill")):
        for c in sorted({r["context"] for r in rows}):
            t = table(rows, metric, mode, "uniform", "policy", context=c)
            if t:
                out += [f"**{title}, context {c}**", "", t, ""]
    out += ["**The papers' claims**", "", "| claim | status |", "|---|---|"]
    for c in claims(data):
        out.append(f"| {c['claim']} | {c['status']} |")
    return "\n".join(out)


def speed_section(results_dir: str = RESULTS) -> str:
    """Markdown for the speed markers: every full-run ``<device>-speed.md`` from ``benchmarks/speed.py`` on a
    GPU (its compress, allocation, decode-attention and scaling tables, bold-titled), then its plots."""
    files = sorted(f for f in glob.glob(os.path.join(results_dir, "*-speed.md")) if not os.path.basename(f).startswith("cpu"))
    if not files:
        return ("No speed results yet: `benchmarks/speed.py` needs a CUDA GPU, and none was available when these "
                "results were produced. Run `python benchmarks/speed.py` on a GPU, then `python benchmarks/report.py`.")
    rel = lambda p: os.path.relpath(p, os.path.dirname(HERE))  # noqa: E731  (README-relative)
    out = []
    for f in files:
        with open(f) as fh:
            out += [f"From `{rel(f)}`:", "", fh.read().strip(), ""]
        plots = [f"![{title}]({rel(p)})" for p, title in ((f[:-3] + "-scaling.png", "compress time vs N"),
                                                          (f[:-3] + ".png", "compress time over the floor"))
                 if os.path.exists(p)]
        if plots:
            out += [" ".join(plots), ""]
    return "\n".join(out).strip()


def memory_section(results_dir: str = RESULTS) -> str:
    """Markdown for the memory markers: ``benchmarks/memory.py``'s summary of ``memory.json`` (peak RSS during
    ``generate`` as a multiple of stock per configuration and N, resident / kept), with links to its tables and
    plot."""
    path = os.path.join(results_dir, "memory.json")
    if not os.path.exists(path):
        return "No memory results are committed yet (run `python benchmarks/memory.py`, then `python benchmarks/report.py`)."
    from memory import readme_section

    with open(path) as f:
        return readme_section(json.load(f), results_dir)


def render(readme: str, sections: dict) -> str:
    """``readme`` with each ``<!-- name:begin -->…<!-- name:end -->`` span replaced by ``sections[name]``."""
    missing = [n for n in sections if f"<!-- {n}:begin -->" not in readme]
    if missing:
        add = []
        for heading in dict.fromkeys(HEADINGS.get(n, "Which policy?") for n in missing):
            add += ["", f"## {heading}", ""]
            for n in missing:
                if HEADINGS.get(n, "Which policy?") == heading:
                    add += [f"<!-- {n}:begin -->", f"<!-- {n}:end -->", ""]
        readme = readme.rstrip("\n") + "\n" + "\n".join(add)
    for n, body in sections.items():
        pat = re.compile(rf"(<!-- {n}:begin -->)(.*?)(<!-- {n}:end -->)", re.S)
        readme = pat.sub(lambda m: f"{m.group(1)}\n{body.strip()}\n{m.group(3)}", readme, count=1)
    return readme


def main(argv=None, readme_path: Optional[str] = None, results_dir: str = RESULTS) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 when README.md is out of date, write nothing")
    a = p.parse_args(argv)
    path = readme_path or README
    with open(path) as f:
        old = f.read()
    new = render(old, {"quality": quality_section(results_dir), "speed": speed_section(results_dir),
                       "memory": memory_section(results_dir)})
    if a.check:
        if new != old:
            print(f"{path} is out of date: run python benchmarks/report.py", file=sys.stderr)
            return 1
        return 0
    if new != old:
        with open(path, "w") as f:
            f.write(new)
    print("updated" if new != old else "unchanged", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
