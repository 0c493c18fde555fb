"""``python -m benchmarks.serving``: its arguments, and ``--smoke`` (two engines on the CPU with the tiny Llama, a 24-block
pool): with 4x compression more requests run at once than without."""
import json
import os
import subprocess
import sys

import pytest

from benchmarks import serving

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_arguments():
    a = serving.parse([])
    assert a.rates == [1, 2, 4, 8] and (a.min_len, a.max_len) == (4096, 8192)
    assert serving.budget_for(a, 1) is None
    assert serving.budget_for(a, 4) == {"policy": "keydiff", "budget": 1536}
    s = serving.parse(["--smoke"])
    assert s.rates == [1, 4] and s.max_len <= 400 and s.kv_blocks == 24
    for bad in (["--rates", "0.5"], ["--min-len", "100", "--max-len", "50"], ["--num-prompts", "0"],
                ["--transformers"]):  # --transformers needs --task needle
        with pytest.raises(SystemExit):
            serving.parse(bad)
    r = subprocess.run([sys.executable, "-m", "benchmarks.serving", "--help"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0 and "--kv-blocks" in r.stdout


def test_smoke(tmp_path):
    out = tmp_path / "serving.json"
    env = dict(os.environ, PYTHONPATH=ROOT, VLLM_CPU_KVCACHE_SPACE="1")
    r = subprocess.run([sys.executable, "-m", "benchmarks.serving", "--smoke", "--out", str(out)], capture_output=True,
                       text=True, timeout=900, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    res = json.loads(out.read_text())
    rows = {row["rate"]: row for row in res["rows"]}
    assert set(rows) == {1, 4}
    for row in rows.values():
        assert row["output_tokens"] == 6 * 16 and row["output_tok_s"] > 0
        assert row["peak_blocks"] <= row["pool_blocks"]
    assert rows[4]["peak_running"] > rows[1]["peak_running"]
    assert "| rate |" in r.stdout


def test_needle_rows():
    """Per rate: passes and their exact interval; against rate 1 on the same cases, the paired difference and
    whether the interval shows a loss (12 cases with 1 gained and 4 lost: inconclusive; 20 of 40 lost: a loss)."""
    base = [1] * 10 + [0] * 2
    r4 = [1] * 6 + [0] * 4 + [1, 0]
    rows = serving.needle_rows([dict(rate=1, passed=base), dict(rate=4, passed=r4)])
    assert [(r["rate"], r["passed"], r["cases"]) for r in rows] == [(1, 10, 12), (4, 7, 12)]
    assert "diff" not in rows[0] and rows[1]["diff"] == (1 - 4) / 12
    assert rows[1]["diff_lo"] < 0 < rows[1]["diff_hi"] and rows[1]["loss"] == "inconclusive"
    assert 0 < rows[1]["lo"] < 7 / 12 < rows[1]["hi"] < 1
    lost = serving.needle_rows([dict(rate=1, passed=[1] * 40), dict(rate=8, passed=[1] * 20 + [0] * 20)])[1]
    assert lost["diff"] == -0.5 and lost["diff_hi"] < 0 and lost["loss"] == "reproduced"
    md = serving.markdown([dict(rate=1, settings=None, output_tok_s=1.0, total_tok_s=2.0, peak_running=1,
                                peak_blocks=3, pool_blocks=4, passed=base),
                           dict(rate=4, settings={"budget": 8}, output_tok_s=1.0, total_tok_s=2.0, peak_running=2,
                                peak_blocks=3, pool_blocks=4, passed=r4)])
    assert "| 4 | 7/12 |" in md and "inconclusive" in md
    both = serving.needle_rows([dict(rate=1, passed=base), dict(rate=4, passed=r4, passed_transformers=[1] * 12)])
    assert "transformers" not in both[0] and (both[1]["transformers"], both[1]["agree"]) == (12, 7)
