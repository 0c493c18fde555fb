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
    for bad in (["--rates", "0.5"], ["--min-len", "100", "--max-len", "50"], ["--num-prompts", "0"]):
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
