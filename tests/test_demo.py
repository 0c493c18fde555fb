"""``tritonkv demo`` (tritonkv/demo.py, issue 17): its table, legend and plot on a tiny random model in a few
seconds, and, on the real model, the full cache's greedy answer contains the pass key."""
import sys

import pytest
import torch

from tritonkv import demo

from helpers import CharTok, tiny_llama as _tiny_llama


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The demo on a 2-layer random Llama with a one-character-per-token tokenizer: 256 tokens, 64-token
    blocks, 3 policies (LagKV included, whose protected tokens skip the shortest plot point)."""
    lines = []
    path = tmp_path_factory.mktemp("demo") / "memory.png"
    threads = torch.get_num_threads()
    rows = demo.run("cpu", 256, 0.25, 64, ("keydiff", "snapkv", "lagkv", "no_such_policy"), new_tokens=3,
                    plot=str(path), out=lines.append, progress=False, model_tok=(_tiny_llama(), CharTok()))
    assert torch.get_num_threads() == threads  # restored
    return rows, "\n".join(lines), path


def test_rows_measure_memory(tiny_run):
    rows, _, _ = tiny_run
    full, *comp = rows
    assert [r["policy"] for r in rows] == ["full cache", "keydiff", "snapkv", "lagkv (L=64)"]
    assert full["kept_bytes"] == full["peak_bytes"] == full["kv_bytes"]
    # 2 layers x 2 KV heads x 16 dims x (K + V) x fp32 per token
    assert full["kept_bytes"] == 256 * 2 * 2 * 16 * 2 * 4
    for r in comp:
        assert r["kept_tokens"] == 64  # 25% of 256
        assert r["peak_tokens"] == 64 + 64  # the budget plus one block
        assert r["kv_bytes"] == 64 * 2 * 2 * 16 * 2 * 4  # memory_bytes(): K+V of the kept tokens
        assert r["kv_bytes"] < r["kept_bytes"] < full["kept_bytes"]  # nbytes adds positions, slack (and queries)
        assert r["peak_bytes"] == 128 * 2 * 2 * 16 * 2 * 4
        assert 1 <= r["rank"] <= 10 and r["decode_ms"] > 0 and r["prefill_tok_s"] > 0
    assert comp[1]["queries"] > 0 and comp[0]["queries"] == 0  # snapkv keeps its query window, keydiff none


def test_output_has_table_legend_and_plot(tiny_run):
    rows, text, path = tiny_run
    assert "Not available: no_such_policy" in text
    head = next(line for line in text.splitlines() if line.startswith("policy"))
    for col in ("KV kept", "KV peak", "key rank", "greedy answer", "key?", "prefill", "decode"):
        assert col in head
    legend = " ".join(text.split())
    for phrase in ("cache.nbytes", "memory_bytes(peak=True)", "64 + 64 = 128 tokens per head = 50% of the prompt",
                   "likelihood rank among 10 candidate", "same 64-token blocks", "native PyTorch path"):
        assert phrase in legend, phrase
    pytest.importorskip("matplotlib")
    assert f"plot: {path}" in text and path.stat().st_size > 1000


def test_plot_without_matplotlib_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    lines = []
    assert demo._plot({"full cache": [(128, 1), (256, 2)]}, str(tmp_path / "p.png"), 256, 0.25, 128,
                      out=lines.append) is None
    assert lines == ['plot skipped: matplotlib is not installed (pip install "tritonkv[bench]")']
    assert not (tmp_path / "p.png").exists()


def test_pick_threads():
    assert demo.pick_threads(3) == 3
    assert 1 <= demo.pick_threads() <= torch.get_num_threads()


@pytest.mark.model
def test_real_model_full_cache_answers_with_the_key(tmp_path):
    """SmolLM2 with the full cache answers the question greedily with the key (the issue: it never did)."""
    lines = []
    rows = demo.run("cpu", 512, 0.25, 128, ("keydiff",), new_tokens=7, plot=None, out=lines.append, progress=False)
    full = rows[0]
    assert full["rank"] == 1 and full["answer_ok"], full
    assert rows[1]["peak_tokens"] == 128 + 128
