"""``tritonkv demo`` (tritonkv/demo.py): its table, legend and plot on a tiny random model in a few
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
        assert r["kv_bytes"] < r["kept_bytes"] < full["kept_bytes"]  # nbytes adds positions and slack
        assert r["peak_bytes"] == 128 * 2 * 2 * 16 * 2 * 4
        assert 1 <= r["rank"] <= 10 and r["decode_ms"] > 0 and r["prefill_tok_s"] > 0
    # the queries a layer holds once the prompt is read: none (a block-wise cache that knows the prompt's length
    # drops snapkv's window of queries after the prompt's last compression)
    assert comp[1]["queries"] == comp[0]["queries"] == 0


def test_output_has_table_legend_and_plot(tiny_run):
    rows, text, path = tiny_run
    assert "Not available: no_such_policy" in text
    head = next(line for line in text.splitlines() if line.startswith("policy"))
    for col in ("KV kept", "KV peak", "key rank", "greedy answer", "key?", "prefill", "decode"):
        assert col in head
    legend = " ".join(text.split())
    for phrase in ("cache.nbytes", "memory_bytes(peak=True)",
                   "min(64 + 64, 256) = 128 tokens per head = 50% of the prompt",
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
    """SmolLM2 with the full cache answers the question greedily with the key (an early version of the demo's
    prompt never got it to)."""
    lines = []
    rows = demo.run("cpu", 512, 0.25, 128, ("keydiff",), new_tokens=7, plot=None, out=lines.append, progress=False)
    full = rows[0]
    assert full["rank"] == 1 and full["answer_ok"], full
    assert rows[1]["peak_tokens"] == 128 + 128


# -- the command line: one-line errors naming the fix, limits enforced, unknown names refused ---------------
def _cli(capsys, monkeypatch, *args):
    """``tritonkv demo ARGS`` through the package's entry point, without running the model: (status, stderr)."""
    from tritonkv.__main__ import main

    calls = []
    monkeypatch.setattr(demo, "run", lambda *a, **k: calls.append(a))
    rc = main(["demo", *args])
    err = capsys.readouterr().err
    return rc, err, calls


@pytest.mark.parametrize("args, words", [
    (["--device", "cuda"], ["--device cuda", "--device cpu"]),
    (["--device", "tpu"], ["--device", "cpu, cuda or auto"]),
    (["--tokens", "20000"], ["--tokens", "8192"]),
    (["--tokens", "-5"], ["--tokens", "8192"]),
    (["--budget", "1.5"], ["--budget", "(0, 1]"]),
    (["--block-size", "1"], ["--block-size", "at least 2"]),  # a 1-token forward is a decode step
    # a policy whose protected tokens the budget cannot hold: refused before the model loads
    (["--budget", "0.01", "--policies", "keydiff,snapkv"], ["--budget 0.01", "7 of 768", "snapkv", "window 32"]),
    (["--budget", "0.01", "--policies", "lagkv"], ["--budget 0.01", "lagkv", "LagKV's protected tokens"]),
    (["--depth", "2"], ["--depth", "[0, 1]"]),
    (["--policies", "keydiff,snapvk"], ["unknown policy 'snapvk'", "did you mean 'snapkv'"]),
    (["--policies", ","], ["--policies", "snapkv"]),
    (["--tokens", "abc"], ["--tokens", "invalid int", "--help"]),
    (["--no-such-flag"], ["unrecognized", "--help"]),
])
def test_bad_arguments_are_one_line_errors(capsys, monkeypatch, args, words):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    try:
        rc, err, calls = _cli(capsys, monkeypatch, *args)
    except SystemExit as e:  # argparse's own errors exit from parse_args
        rc, err, calls = e.code, capsys.readouterr().err, []
    assert rc == 2 and not calls
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tritonkv demo: error: "), err
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_good_arguments_run(capsys, monkeypatch):
    rc, err, calls = _cli(capsys, monkeypatch, "--device", "cpu", "--tokens", "8192", "--policies", "keydiff,tova")
    assert rc == 0 and err == ""
    assert calls and calls[0][0] == "cpu" and calls[0][1] == 8192 and calls[0][4] == ["keydiff", "tova"]


def test_a_setting_the_run_refuses_is_one_line(capsys, monkeypatch):
    """A ValueError from the library during the run (here: a budget below SnapKV's window) is one line, status 2."""
    from tritonkv.__main__ import main

    def refuse(*a, **k):
        raise ValueError("budget 7 is smaller than the protected tokens of 'snapkv' (sink 0 + window 32)")

    monkeypatch.setattr(demo, "run", refuse)
    assert main(["demo", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["tritonkv demo: error: budget 7 is smaller than the protected tokens of 'snapkv' (sink 0 + window 32)"]


def test_cuda_without_a_gpu_end_to_end():
    """The installed command, as a user runs it: one line on stderr, status 2, no traceback."""
    import subprocess

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    r = subprocess.run([sys.executable, "-m", "tritonkv", "demo", "--device", "cuda"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "--device cpu" in r.stderr
