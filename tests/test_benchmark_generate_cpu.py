"""Smoke test of ``benchmarks/generate_cpu.py`` (its own process, no interpreter: the ops' PyTorch bodies, as users
run them on the CPU): it checks the program, not the speed."""
import json
import os
import subprocess
import sys

import pytest

from benchmarks.generate_cpu import PARTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.bench


def test_generate_cpu_smoke(tmp_path):
    """--smoke: stock, block-wise KeyDiff and SnapKV + AdaKV generate on the random Llama at 1 and 2 threads, one
    timed run each; every call made its new tokens; the JSON and Markdown carry the machine, command and ratios;
    ``--parts 1``: where each call's time went, the stock call in none of the integration's parts."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "benchmarks.generate_cpu", "--smoke", "--parts", "1", "--out",
                        str(tmp_path)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    data = json.loads((tmp_path / "generate_cpu.json").read_text())
    rows = data["rows"]
    assert [(x["call"], x["threads"]) for x in rows] == [(c, t) for t in (1, 2)
                                                         for c in ("stock", "keydiff", "snapkv+adakv")]
    for x in rows:
        assert x["median_s"] > 0 and x["min_s"] > 0 and x["ratio"] > 0 and x["runs"] == 1, x
        assert data["tokens"] < x["length"] <= data["tokens"] + data["new_tokens"], x
    assert all(x["ratio"] == 1.0 and "paired_ratio" not in x for x in rows if x["call"] == "stock")
    for x in rows:  # every round's seconds; one round is no interval: inconclusive
        assert len(x["times_s"]) == 1 and x["times_s"][0] == pytest.approx(x["median_s"], abs=1e-3), x
        if x["call"] != "stock":
            assert x["target"] == "inconclusive" and x["coverage"] == 0.0 and x["paired_ratio"] > 0, x
    m = data["machine"]
    assert data["forward_tokens"] == 512  # generate's default
    assert data["smoke"] and not m["triton_interpret"] and m["cpu"] and m["torch"] and "--smoke" in m["command"]
    parts = {(x["call"], x["threads"]): x for x in data["parts"]}  # --parts: where each call's time went
    assert set(parts) == {(x["call"], x["threads"]) for x in rows}
    for (call, _), x in parts.items():
        assert x["rounds"] == 1 and x["wall_s"] > 0
        calls = {part: x[part][1] for part in PARTS}
        if call == "stock":  # the stock model runs none of the integration's functions
            assert not any(calls.values()), x
        else:
            assert calls["compressions"] > 0 and calls["prompt-block attention"] > 0 and calls["decode attention"] > 0
            assert x["compressions"][0] >= x["compressions: window attention (PyTorch body)"][0]
            assert (calls["compressions: window attention (PyTorch body)"] > 0) == (call == "snapkv+adakv"), x
            assert (calls["compressions: AdaKV winners"] > 0) == (call == "snapkv+adakv"), x
    md = (tmp_path / "generate_cpu.md").read_text()
    assert "| call | threads | median s | min s | ratio | min ratio | paired ratio | interval | target |" in md
    assert "| snapkv+adakv | 2 |" in md and "inconclusive |" in md and "| compressions |" in md


def test_timing_parts_restores_every_function():
    """``--parts`` wraps the integration's functions where they are bound and puts the originals back."""
    import importlib

    from benchmarks.generate_cpu import timing_parts

    mods = [importlib.import_module("tritonkv.integrations.transformers." + m) for m in ("cache", "attention")]
    before = [dict(vars(m)) for m in mods] + [dict(vars(mods[0].TritonKVLayer))]
    with timing_parts({}, {}):
        assert mods[0].suffix_attention is not before[0]["suffix_attention"]
        assert mods[1].block_attention is not before[1]["block_attention"]
    after = [dict(vars(m)) for m in mods] + [dict(vars(mods[0].TritonKVLayer))]
    assert all(a[k] is b[k] for a, b in zip(after, before) for k in b)


def test_the_verdict_needs_an_interval_of_95_percent():
    """``paired``: met or missed only when the interval of the median ratio (>= 95 %: 6 rounds or more) lies wholly
    below or above 1.1; five rounds all at 0.9 are still inconclusive (their [min, max] covers 94 %)."""
    from benchmarks.generate_cpu import paired

    stock = [10.0, 11.0, 9.0, 10.5, 9.5, 10.0, 12.0, 10.0, 9.0]
    assert paired([0.9 * s for s in stock], stock)["target"] == "met"
    assert paired([1.2 * s for s in stock], stock)["target"] == "missed"
    mixed = paired([r * s for r, s in zip([0.9, 1.2] * 4 + [1.0], stock)], stock)
    assert mixed["target"] == "inconclusive" and mixed["ratio_lo"] == 0.9 and mixed["ratio_hi"] == 1.2
    few = paired([0.9 * s for s in stock[:5]], stock[:5])
    assert few["target"] == "inconclusive" and few["coverage"] == 0.938 and few["paired_ratio"] == 0.9


def test_calls_picks_the_calls_timed_against_stock():
    """``--calls``: the stock call always, then only the named tritonkv calls; an unknown name is refused."""
    from benchmarks.generate_cpu import CALLS, calls, parser

    assert list(calls(None, None, 4, 0.25)) == ["stock", *CALLS]
    assert list(calls(None, None, 4, 0.25, names=["snapkv+adakv"])) == ["stock", "snapkv+adakv"]
    assert parser().parse_args([]).calls == list(CALLS)
    assert parser().parse_args(["--calls", "keydiff"]).calls == ["keydiff"]
    with pytest.raises(SystemExit):
        parser().parse_args(["--calls", "tova"])
