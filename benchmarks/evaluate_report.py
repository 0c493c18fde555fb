"""Summaries, paired tests and verdicts from ``benchmarks/evaluate.py``'s per-case records.

    python -m benchmarks.evaluate_report

Writes ``summary.json``, ``README.md`` and ``*.png`` beside the records in ``benchmarks/results/quality/`` and prints
the quality section of ``benchmarks/results/README.md``. The rules (pairing, tests, the gate, the papers' own
bounds as margins): docs/benchmarks.md ("The quality benchmark: method").
"""
from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from benchmarks import evaluate_stats as S
from benchmarks.common import RESULTS, ROOT, jsonl_files, pyplot, read_jsonl, table

OUT = os.path.join(RESULTS, "quality")
MIN_CASES = 10
FULL_GATE = 0.9
ACC = ("acc_ll", "acc_greedy")
LOWER = {"kl", "kl_answer", "wo_err", "layer_err"}  # lower is better; dll and accuracies: higher


def index(recs: Sequence[dict]) -> Dict[Tuple, Dict[Tuple, dict]]:
    """``{(task, context, config, metric): {(seed, source): record}}`` (the last record of a case wins). ``lm``
    cases on the synthetic filler are left out: the continuation of five sentences in a loop is no language
    modelling (earlier sweeps drew a third of their lm cases from it; ``evaluate.py`` now draws real text only)."""
    out: Dict[Tuple, Dict[Tuple, dict]] = defaultdict(dict)
    for r in recs:
        if r.get("task") == "lm" and r.get("source") == "synthetic":
            continue
        if "value" in r or "per_head" in r:
            out[(r["task"], r["context"], r["config"], r["metric"])][(r["seed"], r["source"])] = r
    return out


def _values(idx, task, ctx, cfg, metric) -> List[float]:
    """The values of one (task, context, configuration, metric) cell, one per case."""
    return [r["value"] for r in idx.get((task, ctx, cfg, metric), {}).values()]


def _bud(b) -> str:
    if isinstance(b, str):
        return b
    b = float(b)
    return str(int(b)) if b.is_integer() and b > 1 else f"{b:g}"


def cfg_name(policy, allocation="uniform", mode="after_prefill", setting="aware", budget=1.0) -> str:
    return f"{policy}|{allocation}|{mode}|{setting}|{_bud(budget)}"


FULL = "full|uniform|full|aware|1.0"


def cells(idx) -> List[dict]:
    """Every (task, context, config, metric) with n, mean and its interval."""
    out = []
    for (task, ctx, cfg, metric), per in sorted(idx.items(), key=lambda kv: tuple(map(str, kv[0]))):
        vals = [r["value"] for r in per.values() if r.get("value") is not None]
        if vals and metric not in ("seconds", "error"):
            out.append(dict(task=task, context=ctx, config=cfg, metric=metric, **S.summarise(vals)))
    return out


def compare(idx, task, ctx, metric, a: str, b: str, *, ratio_margin: Optional[float] = None) -> Optional[dict]:
    """Paired comparison of configuration ``a`` (claimed better) against ``b``."""
    pa, pb = idx.get((task, ctx, a, metric), {}), idx.get((task, ctx, b, metric), {})
    keys = [k for k in sorted(set(pa) & set(pb), key=str) if None not in (pa[k].get("value"), pb[k].get("value"))]
    if len(keys) < MIN_CASES:
        return None
    va, vb = (np.array([p[k]["value"] for k in keys], dtype=float) for p in (pa, pb))
    out = dict(task=task, context=ctx, metric=metric, a=a, b=b, n=len(keys), mean_a=float(va.mean()),
               mean_b=float(vb.mean()))
    if ratio_margin is not None:
        r, lo, hi = S.ratio_bootstrap(va, vb)
        out.update(stat="ratio a/b", est=r, lo=lo, hi=hi, margin=ratio_margin,
                   verdict=S.verdict(lo, hi, margin=ratio_margin))
        return out
    better = "lower" if metric in LOWER else "higher"
    if metric in ACC:  # McNemar's exact test and its conditional exact interval of the accuracy difference
        m = S.paired_accuracy(va.astype(int), vb.astype(int))
        d, lo, hi = m["diff"], m["lo"], m["hi"]
        out["mcnemar"] = {k: m[k] for k in ("n10", "n01", "p")}
    else:
        d, lo, hi = S.paired_bootstrap(va, vb)
    out.update(stat="a − b", est=d, lo=lo, hi=hi, better=better, verdict=S.verdict(lo, hi, better=better))
    return out


def full_accuracy(idx, task, ctx, metric: str = "acc_ll") -> Optional[dict]:
    vals = _values(idx, task, ctx, FULL, metric)
    return S.summarise(vals) if vals else None


def _tasks(idx):
    return sorted({(k[0], k[1]) for k in idx})


def _gated(idx, accuracies_only: bool = False):
    """Every ``(task, context, metric)`` a claim compares: the task's metrics, an accuracy only where the full cache
    scores >= 90 % on that same accuracy (a task may pass by likelihood and fail by greedy answer: the needle at
    8K); lm and error metrics always pass the gate."""
    for task, ctx in _tasks(idx):
        for metric in ["kl", "dll"] if task == "lm" else ["acc_ll", "acc_greedy", "kl_answer"]:
            full = full_accuracy(idx, task, ctx, metric) if metric in ACC else None
            if (full["mean"] >= FULL_GATE if full else metric not in ACC and not accuracies_only):
                yield task, ctx, metric


COMPOSE = cfg_name("keydiff_critical", "surfacelogic", mode="blockwise", budget=64)


def _allocator_pairs(name: str) -> List[Tuple[str, str]]:
    """Policy ``name`` with its own allocator against SnapKV with uniform, PyramidKV and AdaKV allocations, then
    SnapKV with that allocator against SnapKV uniform, at 128 and 64 tokens per head."""
    return ([(cfg_name(name, name, budget=b), cfg_name("snapkv", o, budget=b))
             for b in (128, 64) for o in ("uniform", "pyramid", "adakv")]
            + [(cfg_name("snapkv", name, budget=b), cfg_name("snapkv", "uniform", budget=b)) for b in (128, 64)])


CLAIMS = [
    dict(id="keydiff",
         claim="KeyDiff beats TOVA, SnapKV and StreamingLLM under block-wise prefill (B = 128) at small cache "
               "budgets (KeyDiff §4.1–4.2: NIAH and LongBench)",
         pairs=[(cfg_name("keydiff", mode="blockwise", budget=b), cfg_name(o, mode="blockwise", budget=b))
                for b in (128, 64, 512) for o in ("tova", "snapkv", "streaming_llm")]),
    dict(id="criticalkv_acc",
         claim="CriticalKV's selection improves SnapKV and AdaKV with the context compressed before the question "
               "(CriticalKV Table 1 at 40 %, Fig. 2 at 20 %)",
         pairs=[(cfg_name(c, a, setting="agnostic", budget=b), cfg_name("snapkv", a, setting="agnostic", budget=b))
                for b in (0.4, 0.2) for c, a in (("criticalkv", "uniform"), ("criticalkv", "adakv"))]),
    dict(id="score",
         claim="SCORE (its allocation and its redundancy-penalised selection) beats SnapKV, PyramidKV and AdaKV at "
               "KV size 128 and 64 (SCORE Tables 1, 8); its allocation alone beats uniform",
         pairs=_allocator_pairs("score")),
    dict(id="surfacelogic",
         claim="SurfaceLogicKV (INF-profile allocation + its window selection) beats SnapKV, PyramidKV and AdaKV "
               "at KV size 64 and 128 (SurfaceLogicKV Tables 1–2); its allocation alone beats uniform",
         pairs=_allocator_pairs("surfacelogic")),
    dict(id="surfacelogic_profile",
         claim="The profile's effect: SurfaceLogicKV's allocation from the profile on the paper's grid (6 "
               "lengths × 33 depths, 5 answer steps, synthetic haystack) beats the same allocation from the shipped "
               "default (4 × 5, 1 step, KJV haystack). Not a claim of the paper: how much the profile matters",
         pairs=[(cfg_name(p, "surfacelogic_paper", budget=b), cfg_name(p, "surfacelogic", budget=b))
                for b in (128, 64) for p in ("surfacelogic", "snapkv")]
               + [(cfg_name("keydiff_critical", "surfacelogic_paper", mode="blockwise", budget=64), COMPOSE)]),
    dict(id="compose",
         claim="Beyond the seeds: KeyDiff's scores + CriticalKV's value-aware second stage + SurfaceLogicKV's "
               "allocation, block-wise (B = 128) at 64 tokens per head, beats every single seed method run "
               "block-wise at 64 (KeyDiff, TOVA, SnapKV, StreamingLLM, CriticalKV, SurfaceLogicKV). Not a claim of "
               "any paper: a composition none of them tried",
         pairs=[(COMPOSE, cfg_name(o, a, mode="blockwise", budget=64))
                for o, a in (("keydiff", "uniform"), ("tova", "uniform"), ("snapkv", "uniform"),
                             ("streaming_llm", "uniform"), ("criticalkv", "uniform"),
                             ("surfacelogic", "surfacelogic"))]),
    dict(id="compose_ablation",
         claim="Each ingredient of the composition helps: the composition against itself without the "
               "allocation (uniform), without CriticalKV's second stage (KeyDiff + SurfaceLogicKV allocation), "
               "and with SnapKV's scores instead of KeyDiff's (SnapKV + SurfaceLogicKV allocation)",
         pairs=[(COMPOSE, cfg_name(o, a, mode="blockwise", budget=64))
                for o, a in (("keydiff_critical", "uniform"), ("keydiff", "surfacelogic"),
                             ("snapkv", "surfacelogic"))]),
]


LAGKV = [(lag, r, margin) for lag in (128, 512, 1024) for r, margin in ((0.5, 0.95), (0.25, 0.90))]


def _lagkv(lag: int, ratio: float) -> str:
    """The configuration name of LagKV at lag ``L`` and compression ratio ``r``."""
    return cfg_name("lagkv" if lag == 128 else f"lagkv_l{lag}", mode="lagkv", budget=ratio)


def _compressed(idx, task, ctx, cfg) -> bool:
    """Whether ``cfg`` held fewer tokens than the prompt (LagKV compresses nothing below S + 2L tokens)."""
    kept = _values(idx, task, ctx, cfg, "kept_per_head")
    return bool(kept) and float(np.mean(kept)) < 0.99 * ctx


def claim_rows(idx) -> List[dict]:
    out = []
    for c in CLAIMS:
        comps = [compare(idx, task, ctx, metric, a, b) for task, ctx, metric in _gated(idx) for a, b in c["pairs"]]
        comps = [r for r in comps if r]
        out.append(dict(id=c["id"], claim=c["claim"], comparisons=comps, overall=_overall(comps),
                        **({"caveat": c["caveat"]} if c.get("caveat") else {})))
    # LagKV: relative score against the full cache (the paper's own bounds)
    comps = []
    for task, ctx, metric in _gated(idx, accuracies_only=True):
        for lag, r, margin in LAGKV:
            cfg = _lagkv(lag, r)
            comp = _compressed(idx, task, ctx, cfg) and compare(idx, task, ctx, metric, cfg, FULL, ratio_margin=margin)
            if comp:
                comps.append(dict(comp, lag=lag))
    kl_rows = []
    for task, ctx in _tasks(idx):
        m = "kl" if task == "lm" else "kl_answer"
        for lag, r, _ in LAGKV:
            vals = _values(idx, task, ctx, _lagkv(lag, r), m)
            if len(vals) >= MIN_CASES and _compressed(idx, task, ctx, _lagkv(lag, r)):
                kl_rows.append(dict(task=task, context=ctx, metric=m, lag=lag, ratio=r, **S.summarise(vals)))
    claim = ("LagKV (S = 16, recursive; L = 128, 512, 1024) keeps ≥ 95 % of the full cache's score at 2× (r = ½: "
             "'nearly zero loss, < 5 %') and ≥ 90 % at 4× (r = ¼; the paper claims ≈ 90 % even at 8×); a cell where L "
             "compresses nothing at that context (S + 2L > prompt) is left out")
    out.append(dict(id="lagkv", claim=claim, comparisons=comps, overall=_overall(comps), kl=kl_rows))
    # CriticalKV's own metric: error after W_O at the first answer token, head-wise
    comps, heads = [], []
    for r, ea, eb in _critical_cells(idx, "wo_err", "per_head"):
        comps.append(r)
        hw = S.head_wise(ea, eb)
        lo, hi = hw["sig_lower"], 1.0 - hw["sig_higher"]  # NaN below 2 cases: inconclusive
        at_20 = r["a"].endswith("|" + _bud(0.2))  # the paper's 92 % is at 20 % (CriticalKV §4.7); 40 %: not judged
        heads.append(dict(task=r["task"], context=r["context"], a=r["a"], b=r["b"], n=r["n"], heads=hw["heads"],
                          fraction=hw["lower"], lo=lo, hi=hi,
                          vs_paper=S.verdict(lo - 0.92, hi - 0.92) if at_20 else "– (the paper: 20 %)",
                          verdict=S.verdict(lo - 0.5, hi - 0.5)))
    out.insert(1, dict(id="criticalkv_err",
                       claim="CriticalKV lowers the attention-output perturbation ‖(A − A′)VW_O‖₁ at the first "
                             "decoding token vs SnapKV / AdaKV (mean over heads and cases), and does so in 92 % of the "
                             "heads (CriticalKV §4.5, Llama at 20 %; cells: the mean difference, then the head "
                             "fraction against 92 %)",
                       comparisons=comps,
                       overall=_overall(comps + [{"verdict": h["vs_paper"]} for h in heads if h["vs_paper"][0] != "–"]),
                       heads=heads))
    out.insert(2, _layer_claim(idx))
    return out


def _critical_cells(idx, metric: str, field: str):
    """CriticalKV against its base (SnapKV, AdaKV) with the context compressed before the question, at 20 % and
    40 %: for every cell with enough paired cases, ``(comparison, a's [cases, …] field, b's)``."""
    for (task, ctx), b, alloc in itertools.product(_tasks(idx), (0.2, 0.4), ("uniform", "adakv")):
        a = cfg_name("criticalkv", alloc, setting="agnostic", budget=b)
        base = cfg_name("snapkv", alloc, setting="agnostic", budget=b)
        r = compare(idx, task, ctx, metric, a, base)
        if r:
            pa, pb = idx[(task, ctx, a, metric)], idx[(task, ctx, base, metric)]
            keys = sorted(set(pa) & set(pb), key=str)
            yield (r, *(np.array([np.ravel(p[k][field]) for k in keys], dtype=float) for p in (pa, pb)))


def _layer_claim(idx) -> dict:
    """CriticalKV §4.5 b (Fig. 5): inside the compressed run, its advantage accumulates across layers, lowering
    the final hidden state's perturbation. Cells: the final hidden state's ‖Δ‖₁ (paired), then per comparison the
    ratio of mean attention-output errors (CriticalKV / baseline) at five depths with paired-bootstrap intervals."""
    comps, layers = [], []
    for r, ea, eb in _critical_cells(idx, "layer_err", "per_layer"):
        comps.append(r)
        L = ea.shape[1]
        at = sorted({0, L // 4, L // 2, 3 * L // 4, L - 1})
        layers.append(dict(task=r["task"], context=r["context"], a=r["a"], b=r["b"], n=r["n"],
                           ratios=[(l, *S.ratio_bootstrap(ea[:, l], eb[:, l])) for l in at]))
    return dict(id="criticalkv_layers",
                claim="Inside the compressed run, CriticalKV lowers the final hidden state's perturbation at the "
                      "first decoding token vs SnapKV / AdaKV, its advantage accumulating across layers (CriticalKV "
                      "§4.5 b, Fig. 5). The verdict is on the final hidden state's ‖Δ‖₁; the ratios of "
                      "attention-output errors per layer show whether it accumulates from the first layer",
                comparisons=comps, overall=_overall(comps), layers=layers)


def _overall(comps) -> str:
    """All cells reproduced → reproduced; some reproduced, none reversed → partly reproduced; none either way →
    inconclusive; some reversed, none reproduced → not reproduced; both → mixed. With the counts."""
    v = [c["verdict"] for c in comps]
    if not v:
        return "not measured"
    n_r, n_n, n_i = v.count("reproduced"), v.count("not reproduced"), v.count("inconclusive")
    mixes = {(True, False): "partly reproduced", (False, False): "inconclusive", (False, True): "not reproduced",
             (True, True): "mixed"}  # (any reproduced, any not reproduced)
    head = "reproduced" if n_r == len(v) else mixes[(n_r > 0, n_n > 0)]
    return f"{head} ({n_r} reproduced, {n_n} not reproduced, {n_i} inconclusive of {len(v)} cells)"


# ------------------------------------------------------------------------------------------------
# tables, plots


def _fmt(x, metric=None) -> str:
    if x is None or (isinstance(x, float) and np.isnan(x)):
        return "–"
    if metric in ACC:
        return f"{100 * x:.0f}"
    return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


def _ci(m, lo, hi, metric=None) -> str:
    return f"{_fmt(m, metric)} [{_fmt(lo, metric)}, {_fmt(hi, metric)}]"


def _short(cfg: str) -> str:
    p, a, mode, setting, b = cfg.split("|")
    if p == "full":
        return "full cache"
    if mode == "lagkv":
        return f"lagkv L={p[len('lagkv_l'):] if p.startswith('lagkv_l') else 128} r={b}"
    return f"{p if a == 'uniform' else f'{p}+{a}'} @{b}"


def _vs(x: dict) -> str:
    return f"{_short(x['a'])} vs {_short(x['b'])}"


def comparison_table(comps: Sequence[dict]) -> List[str]:
    rows = []
    for c in comps:
        m = c["metric"]
        diff = (_ci(c["est"], c["lo"], c["hi"], m) if c["stat"] == "a − b"
                else f"ratio {c['est']:.3f} [{c['lo']:.3f}, {c['hi']:.3f}] vs {c['margin']}")
        p = f"{c['mcnemar']['p']:.3g} ({c['mcnemar']['n10']}:{c['mcnemar']['n01']})" if "mcnemar" in c else "–"
        rows.append([c["task"], c["context"], m, _vs(c), c["n"], _fmt(c["mean_a"], m), _fmt(c["mean_b"], m), diff, p,
                     c["verdict"]])
    return table(rows, ["task", "ctx", "metric", "a vs b", "n", "a", "b", "difference [95% CI]", "McNemar p",
                        "verdict"])


def _held(comps, cells) -> List[str]:
    """A line naming the configurations of a claim that held more tokens per (layer, KV head) than their
    nominal integer budget (by > 0.5 %), so a comparison at "equal" budgets says where it was not."""
    held = {}
    for c in cells:
        if c["metric"] == "kept_per_head":
            held.setdefault(c["config"], []).append(c["mean"])
    over = []
    for cfg in dict.fromkeys(x for comp in comps for x in (comp["a"], comp["b"])):
        b = cfg.rsplit("|", 1)[-1]
        if b.isdigit() and cfg in held and max(held[cfg]) > 1.005 * int(b):
            over.append(f"{_short(cfg)} {max(held[cfg]):.1f}")
    return ["Tokens held per (layer, KV head) above the nominal budget (mean over cases, worst task): "
            + "; ".join(over) + ".", ""] if over else []


SECOND_LOOK = ("Cases: 50 per task and context in every claim's cells (the n column says how many are paired), "
               "except the CriticalKV configurations at 2K and 4K (the needle and the held-out continuation), which "
               "have 100: they were extended after half of the selection claim's cells were inconclusive at 50, a "
               "second look at the same hypotheses that the intervals are not corrected for.")


def _full_cell(idx, task, ctx, metric) -> str:
    """The full cache's accuracy with its interval, ✗ where it fails the gate."""
    s = full_accuracy(idx, task, ctx, metric)
    return _ci(s["mean"], s["lo"], s["hi"], metric) + (" ✗" if s["mean"] < FULL_GATE else "") if s else "–"


def markdown(recs, summary) -> str:
    idx = index(recs)
    runs = sorted({r.get("commit") for r in recs if r.get("commit")})
    secs = sum(r["value"] for r in recs if r["metric"] == "seconds")
    out = ["# Quality evidence: the seeds' claims with their own metrics (SmolLM2-135M-Instruct, CPU)", "",
           f"Per-case records in `*.jsonl.gz` (commits {', '.join(runs) or '–'}; {secs / 3600:.1f} CPU-hours of "
           "measurement). Produced by `benchmarks/evaluate.py`, summarised by `benchmarks/evaluate_report.py`. "
           "Accuracies in %, with 95 % percentile-bootstrap intervals over cases; comparisons are paired on the "
           "same cases. Method and caveats: [docs/benchmarks.md](../../../docs/benchmarks.md#the-quality-benchmark-method).",
           "", SECOND_LOOK, ""]
    out += ["## Full-cache accuracy (the ≥ 90 % gate)", "",
            "An accuracy enters the claims at a task and context only where the full cache's mean on that accuracy is "
            "≥ 90 %; ✗ marks the ones that do not.", ""]
    rows = [[t, c, len(idx.get((t, c, FULL, "acc_ll"), {})), *(_full_cell(idx, t, c, m) for m in ACC)]
            for t, c in _tasks(idx) if t != "lm"]
    out += table(rows, ["task", "context", "n", *ACC])
    out += ["", "## Claims", ""]
    for c in summary["claims"]:
        out += [f"### {c['claim']}", "", f"**Overall: {c['overall']}**", ""]
        if c.get("caveat"):
            out += [f"*Caveat:* {c['caveat']}.", ""]
        if c["comparisons"]:
            out += comparison_table(c["comparisons"]) + [""]
            out += _held(c["comparisons"], summary["cells"])
        if c.get("heads"):
            out += ["Head-wise (per (layer, query head), mean error over cases): the fraction of heads where the "
                    "first configuration is lower, bounded below by the heads whose interval is wholly below 0 and "
                    "above by 1 − those wholly above 0; the intervals are simultaneous over the heads (95 % that "
                    "every head lies in its own at once: `evaluate_stats.head_wise`), so the bounds hold together:",
                    ""]
            out += table([[h["task"], h["context"], _vs(h), h["n"], h["heads"],
                           f"{h['fraction']:.2f} [{h['lo']:.2f}, {h['hi']:.2f}]", h["vs_paper"], h["verdict"]]
                          for h in c["heads"]],
                         ["task", "ctx", "a vs b", "n", "heads", "fraction lower [bounds]",
                          "≥ 92 % of heads (the paper)", "most heads (> ½)"]) + [""]
        if c.get("layers"):
            out += ["Attention-output error after W_O per layer, inside the compressed run: mean(a) / mean(b) "
                    "[95 % CI] (below 1: a perturbs less)", ""]
            out += table([[r["task"], r["context"], _vs(r), r["n"]]
                          + [f"{x:.3f} [{lo:.3f}, {hi:.3f}]" for _, x, lo, hi in r["ratios"]] for r in c["layers"]],
                         ["task", "ctx", "a vs b", "n"] + [f"layer {l}" for l, *_ in c["layers"][0]["ratios"]]) + [""]
        if c.get("kl"):
            out += table([dict(k, ci=_ci(k["mean"], k["lo"], k["hi"])) for k in c["kl"]],
                         ["task", "context", "metric", "lag", "ratio", "n", "ci"],
                         ["task", "ctx", "metric", "L", "r", "n", "mean [95% CI]"]) + [""]
    pes = summary.get("profile_effect") or []
    if pes:
        out += ["## SurfaceLogicKV: what the profile changes in the allocation", "",
                "Profiles: " + "; ".join(f"`{k}` {v}" for k, v in PROFILES.items()) + ". Budgets at a "
                f"{pes[0]['prompt']}-token prompt; moved = share of the L·H·b tokens that change (layer, head):", ""]
        out += table([[f"{_stem(pe['a'])} vs {_stem(pe['b'])}", pe["differs"], f"{pe['spearman']:.2f}", r["budget"],
                       f"{r['moved']:.1%}", f"{r['layer_change']:.0%}", f"{r['top10_shared']}/10"]
                      for pe in pes for r in pe["budgets"]],
                     ["a vs b", "what differs", "Spearman of INF", "tokens per head", "moved",
                      "largest per-layer change", "top-10 heads shared"])
        out += ["", "End to end (paper-grid profile against the default): the claim *The profile's effect* above.", ""]
    out += ["## Every cell", ""]
    out += table([[c["task"], c["context"], f"`{c['config']}`", c["metric"], c["n"],
                   _ci(c["mean"], c["lo"], c["hi"], c["metric"])] for c in summary["cells"]
                  if c["metric"] != "kept_per_head"], ["task", "ctx", "configuration", "metric", "n", "mean [95% CI]"])
    out.append("")
    return "\n".join(out)


def plots(recs, out_dir: str) -> None:
    """``<task>-<context>.png`` per task and context: each claim's metric against the budget, with interval bands."""
    plt = pyplot()
    if plt is None:
        return
    idx = index(recs)
    panels = [  # (title, metric, [(label, config template with {b})], budgets)
        ("KeyDiff claim: block-wise prefill", "acc_ll",
         [(p, cfg_name(p, mode="blockwise", budget="{b}")) for p in ("keydiff", "tova", "snapkv", "streaming_llm")],
         (64, 128, 512)),
        ("Allocation, after prefill (question in the prompt)", "acc_ll",
         [(f"{p}+{a}", cfg_name(p, a, budget="{b}")) for p, a in
          (("snapkv", "uniform"), ("snapkv", "pyramid"), ("snapkv", "adakv"), ("snapkv", "score"), ("score", "score"),
           ("snapkv", "surfacelogic"), ("surfacelogic", "surfacelogic"), ("snapkv_k1", "uniform"))], (64, 128)),
        ("CriticalKV: context compressed before the question", "acc_ll",
         [(f"{p}+{a}", cfg_name(p, a, setting="agnostic", budget="{b}")) for a in ("uniform", "adakv")
          for p in ("snapkv", "criticalkv")], (0.2, 0.4)),
        ("CriticalKV: error after W_O, first answer token", "wo_err",
         [(f"{p}+{a}", cfg_name(p, a, setting="agnostic", budget="{b}")) for a in ("uniform", "adakv")
          for p in ("snapkv", "criticalkv")], (0.2, 0.4)),
    ]
    for task, ctx in _tasks(idx):
        todo = []
        for title, metric, lines, budgets in panels:
            m = metric if task != "lm" or metric == "wo_err" else "kl"
            if any(idx.get((task, ctx, t.replace("{b}", _bud(b)), m)) for _, t in lines for b in budgets):
                todo.append((title, m, lines, budgets))
        if not todo:
            continue
        fig, axes = plt.subplots(1, len(todo), figsize=(4.6 * len(todo), 3.6), squeeze=False)
        for ax, (title, m, lines, budgets) in zip(axes[0], todo):
            for label, t in lines:
                xs, ys, lo, hi = [], [], [], []
                for b in budgets:
                    vals = _values(idx, task, ctx, t.replace("{b}", _bud(b)), m)
                    if len(vals) >= 2:
                        s = S.summarise(vals)
                        xs.append(b), ys.append(s["mean"]), lo.append(s["lo"]), hi.append(s["hi"])
                if xs:
                    (ln,) = ax.plot(xs, ys, marker="o", label=label)
                    ax.fill_between(xs, lo, hi, color=ln.get_color(), alpha=0.15)
            f = _values(idx, task, ctx, FULL, m) if m in ACC else []
            if f:
                ax.axhline(np.mean(f), color="k", ls="--", lw=0.8, label="full cache")
            ax.set(xlabel="budget (tokens per head)" if budgets[0] > 1 else "budget (fraction of the context)",
                   ylabel=m)
            if budgets[0] > 1:
                ax.set_xscale("log", base=2)
            ax.set_title(title, fontsize=8)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
        fig.suptitle(f"{task}, {ctx} tokens (95% bootstrap bands)", fontsize=9)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, f"{task}-{ctx}.png"), dpi=90)
        plt.close(fig)


def _headline(comps: Sequence[dict], per_task: int = 3) -> List[dict]:
    """The comparisons the README shows for a claim: the primary metric of each task (accuracy by likelihood, KL of
    the continuation, the errors after W_O, the LagKV ratio), context by context, at most ``per_task`` each."""
    primary = ("acc_ll", "kl", "wo_err", "layer_err")
    out, count = [], defaultdict(int)
    for x in sorted(comps, key=lambda x: (x["context"], x["task"] != "needle", x["task"])):
        k = (x["task"], x["context"])
        if x["metric"] in primary and count[k] < per_task:
            out.append(x)
            count[k] += 1
    return out


def readme_section(summary: dict, rel: str = "quality", plots_dir: Optional[str] = None) -> str:
    """The quality section of ``benchmarks/results/README.md`` (``rel``: the records' folder from there): one line
    per claim with its verdict and headline interval, then the plots found in ``plots_dir`` (linked as
    ``rel/<file>``)."""
    out = [f"Quality on SmolLM2-135M-Instruct (CPU): the seeds' claims tested with their own metrics at their "
           f"budgets, paired over locally generated cases, 95 % bootstrap intervals. Everything (per-case records, "
           f"every cell, plots): [{rel}/README.md]({rel}/README.md). A verdict is read off an interval: "
           "reproduced (strictly on the claimed side), not reproduced (strictly on the other side), inconclusive "
           "(contains or touches no difference). These are findings about a 135M-parameter model at 2K–8K tokens, not "
           "about the papers' 8B models at 32K. " + SECOND_LOOK, ""]
    rows = []
    for c in summary["claims"]:
        ev = []
        for x in _headline(c["comparisons"]):
            m = x["metric"]
            if x["stat"] == "a − b":
                ev.append(f"{x['task']}@{x['context']} {m}: {_short(x['a'])} − {_short(x['b'])} = "
                          f"{_ci(x['est'], x['lo'], x['hi'], m)} (n={x['n']})")
            else:
                ev.append(f"{x['task']}@{x['context']} {m}: {_short(x['a'])} / full = {x['est']:.2f} "
                          f"[{x['lo']:.2f}, {x['hi']:.2f}] vs {x['margin']} (n={x['n']})")
        for r in c.get("layers", [])[:2]:
            (l0, x0, lo0, hi0), (l1, x1, lo1, hi1) = r["ratios"][0], r["ratios"][-1]
            ev.append(f"{r['task']}@{r['context']} attention-output error {_short(r['a'])} / {_short(r['b'])}: "
                      f"{x0:.2f} [{lo0:.2f}, {hi0:.2f}] at layer {l0}, {x1:.2f} [{lo1:.2f}, {hi1:.2f}] at layer {l1} "
                      f"(n={r['n']})")
        for h in c.get("heads", [])[:2]:
            ev.append(f"{_short(h['a'])} lower in {h['fraction']:.0%} [{h['lo']:.0%}, {h['hi']:.0%}] of "
                      f"{h['heads']} heads (paper's 92 %: {h['vs_paper']})")
        rows.append([c["claim"], f"**{c['overall']}**", "; ".join(ev) or "–"])
    out += table(rows, ["claim", "verdict", "headline evidence"])
    pngs = sorted(glob.glob(os.path.join(plots_dir, "*.png"))) if plots_dir else []
    if pngs:
        out += ["", " ".join(f"![{os.path.basename(p)[:-4]}]({rel}/{os.path.basename(p)})" for p in pngs)]
    return "\n".join(out)


PAPER_PROFILE, DEFAULT_PROFILE = "smollm2-135m-instruct-infsc-paper", "smollm2-135m-instruct-infsc"
CONTROL_PROFILE = "benchmarks/results/quality/profiles/smollm2-135m-instruct-infsc-4x5-synthetic.json"
PROFILES = {PAPER_PROFILE: "(shipped; the paper's grid: 6 lengths × 33 depths, 5 answer steps, synthetic haystack)",
            DEFAULT_PROFILE: "(shipped default: 4 lengths × 5 depths, 1 step, KJV haystack)",
            "4x5-synthetic": "(control, not shipped: the default's grid and step on the synthetic haystack)"}
PROFILE_PAIRS = [(PAPER_PROFILE, DEFAULT_PROFILE, "all: grid, steps, haystack"),
                 (PAPER_PROFILE, CONTROL_PROFILE, "grid and steps"),
                 (CONTROL_PROFILE, DEFAULT_PROFILE, "haystack")]


def _stem(name: str) -> str:
    return "4x5-synthetic" if name == CONTROL_PROFILE else name


def profile_effect(a: str = PAPER_PROFILE, b: str = DEFAULT_PROFILE, prompt: int = 2048,
                   differs: str = "") -> Optional[dict]:
    """What a profile changes in SurfaceLogicKV's allocation against another, before any task: the rank correlation
    of the two KV-head INF profiles, and per budget the share of the L·H·b tokens that move between (layer, head)
    cells (½ Σ|b_a − b_b| / Σ b_b), the largest per-layer change, and how many of the 10 best-funded heads they
    share. None when either profile is missing."""
    from tritonkv.allocation.profiler import load_profile
    from tritonkv.allocation.surfacelogic import surfacelogic_budgets
    try:
        pa, pb = (load_profile(os.path.join(ROOT, p) if p.endswith(".json") else p).double() for p in (a, b))
    except (OSError, ValueError):
        return None
    rank = lambda x: np.argsort(np.argsort(x.ravel().numpy()))  # noqa: E731
    out = dict(a=a, b=b, differs=differs, prompt=prompt, spearman=float(np.corrcoef(rank(pa), rank(pb))[0, 1]),
               budgets=[])
    for bud in (128, 64):
        ba, bb = (surfacelogic_budgets(p, bud, prompt).double() for p in (pa, pb))
        top = lambda x: set(np.argsort(-x.ravel().numpy(), kind="stable")[:10].tolist())  # noqa: E731
        out["budgets"].append(dict(budget=bud, moved=float((ba - bb).abs().sum() / 2 / bb.sum()),
                                   layer_change=float(((ba.sum(1) - bb.sum(1)).abs() / bb.sum(1)).max()),
                                   top10_shared=len(top(ba) & top(bb))))
    return out


def build(out_dir: str = OUT, write: bool = True) -> dict:
    recs = [r for f in jsonl_files(out_dir) for r in read_jsonl(f)]
    idx = index(recs)
    summary = {"cells": cells(idx), "claims": claim_rows(idx),
               "full_accuracy": {f"{t}/{c}": full_accuracy(idx, t, c) for t, c in _tasks(idx) if t != "lm"},
               "full_accuracy_greedy": {f"{t}/{c}": full_accuracy(idx, t, c, "acc_greedy") for t, c in _tasks(idx)
                                        if t != "lm"},
               "profile_effect": [e for e in (profile_effect(a, b, differs=d) for a, b, d in PROFILE_PAIRS) if e]}
    if write:
        with open(os.path.join(out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1, default=float)
        with open(os.path.join(out_dir, "README.md"), "w") as f:
            f.write(markdown(recs, summary))
        plots(recs, out_dir)
    return summary


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=OUT)
    print(readme_section(build(p.parse_args(argv).out)))


if __name__ == "__main__":
    main()
