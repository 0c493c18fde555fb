"""Smoke test of ``benchmarks/generate_cpu.py`` (its own process, no interpreter: the ops' PyTorch bodies, as users
run them on the CPU): it checks the program, not the speed."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.bench


def test_generate_cpu_smoke(tmp_path):
    """--smoke: stock, block-wise KeyDiff and SnapKV + AdaKV generate on the random Llama at 1 and 2 threads, one
    timed run each; every call made its new tokens; the JSON and Markdown carry the machine, command and ratios."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "benchmarks.generate_cpu", "--smoke", "--out", str(tmp_path)],
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
    md = (tmp_path / "generate_cpu.md").read_text()
    assert "| call | threads | median s | min s | ratio | min ratio | paired ratio | interval | target |" in md
    assert "| snapkv+adakv | 2 |" in md and "inconclusive |" in md
