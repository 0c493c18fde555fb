"""SurfaceLogicKV INFsc profiler (tritonkv/allocation/profiler.py, the model-running half in
tritonkv/integrations/profiler.py; docs/algorithms.md §2.5)."""
import json

import numpy as np
import pytest
import torch

from tritonkv.allocation import profiler
from tritonkv.allocation.profiler import WeightSums, group_mean, infsc_scores, load_profile, needle_weights, paper_grid
from tritonkv.integrations.profiler import profile_infsc

SHIPPED = "smollm2-135m-instruct-infsc"


def _oracle_weights(a: np.ndarray, needle: np.ndarray):
    """WO, WD, WS of one row by a stable sort (ties to the lower position)."""
    k = len(needle)
    order = sorted(range(len(a)), key=lambda i: (-a[i], i))
    top = set(order[:k])
    n = set(needle.tolist())
    return (sum(a[i] for i in top & n), sum(a[i] for i in top - n), sum(a[i] for i in n - top))


@pytest.mark.parametrize("T,n_needle", [(37, 5), (130, 17), (64, 1)])
def test_needle_weights_match_oracle(T, n_needle):
    g = torch.Generator().manual_seed(T)
    attn = torch.softmax(torch.randn(2, 3, T, generator=g) * 3, -1)
    start = T // 3
    pos = torch.arange(start, start + n_needle)
    wo, wd, ws = needle_weights(attn, pos)
    assert wo.shape == (2, 3)
    rows = attn.reshape(-1, T).numpy().astype(np.float64)
    for r, (o, d, s) in enumerate(zip(wo.flatten(), wd.flatten(), ws.flatten())):
        eo, ed, es = _oracle_weights(rows[r], pos.numpy())
        np.testing.assert_allclose([o, d, s], [eo, ed, es], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(float(o + s), rows[r][pos.numpy()].sum(), rtol=1e-5)


def test_needle_weights_extremes():
    T = 40
    pos = torch.arange(10, 14)
    a = torch.full((1, T), 0.01)
    a[0, pos] = 0.2  # the needle is the top-4: all weight correct
    wo, wd, ws = needle_weights(a, pos)
    assert float(wd) == 0 and float(ws) == 0 and abs(float(wo) - 0.8) < 1e-6
    b = torch.full((1, T), 0.001)
    b[0, :4] = 0.2  # a sink takes the top-4: the needle is subconscious
    wo, wd, ws = needle_weights(b, pos)
    assert float(wo) == 0 and abs(float(wd) - 0.8) < 1e-6 and abs(float(ws) - 0.004) < 1e-6
    with pytest.raises(ValueError, match="needle_positions"):
        needle_weights(a, torch.arange(0))


def test_infsc_formula():
    wo = torch.tensor([[0.6, 0.0], [0.2, 0.1]])
    wd = torch.tensor([[0.2, 0.5], [0.2, 0.0]])
    ws = torch.tensor([[0.1, 0.1], [0.0, 0.0]])
    sf, lg, inf = infsc_scores(wo, wd, ws)
    torch.testing.assert_close(sf, torch.tensor([[0.75, 0.0], [0.5, 1.0]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(lg, torch.tensor([[0.5, 1.0], [1 / 3, 0.0]]), atol=1e-6, rtol=0)
    expect = 2 * sf * lg / (sf + lg + 1e-8)
    torch.testing.assert_close(inf, expect)
    assert float(lg.max()) == pytest.approx(1.0)
    assert float(inf[0, 0]) == pytest.approx(0.6, abs=1e-6)  # harmonic mean of 0.75 and 0.5


def test_group_mean_and_sums():
    x = torch.arange(18, dtype=torch.float32).view(2, 9)
    torch.testing.assert_close(group_mean(x, 3), torch.tensor([[1.0, 4.0, 7.0], [10.0, 13.0, 16.0]]))
    with pytest.raises(ValueError, match="num_kv_heads"):
        group_mean(x, 2)
    s = WeightSums()
    s.add(torch.ones(2, 9, 3), torch.zeros(2, 9, 3), torch.ones(2, 9, 3))
    s.add(torch.ones(2, 9, 1), torch.ones(2, 9, 1), torch.ones(2, 9, 1))
    p = s.profile(3, {})
    torch.testing.assert_close(p.wd, torch.full((2, 9), 0.25))  # ratio of means: 1 over 4 steps
    with pytest.raises(ValueError, match="trials"):
        WeightSums().profile(3, {})


@pytest.mark.parametrize("name", [SHIPPED, SHIPPED + "-paper"])
def test_shipped_profile_loads(name):
    kv = load_profile(name)
    q = load_profile(name, heads="query")
    assert kv.shape == (30, 3) and q.shape == (30, 9) and kv.dtype == torch.float32
    assert torch.all((kv >= 0) & (kv <= 1)) and torch.all((q >= 0) & (q <= 1))
    torch.testing.assert_close(kv, group_mean(q, 3), atol=2e-6, rtol=0)
    assert float(q.max()) > 0
    with open(profiler.profile_path(name)) as f:
        data = json.load(f)
    assert {"model", "grid", "infsc_query_heads", "infsc_kv_heads", "date"} <= set(data)
    assert data["grid"]["lengths"] and data["grid"]["depths"]
    if name.endswith("-paper"):  # the paper's grid (6 lengths x 33 depths), every answer step
        g = paper_grid()
        assert (data["grid"]["lengths"], data["grid"]["depths"], data["grid"]["steps"]) == (g["lengths"],
                                                                                           g["depths"], 5)
    assert max(max(r) for r in data["lg_query_heads"]) == pytest.approx(1.0, abs=1e-5)


def test_load_profile_missing():
    with pytest.raises(ValueError, match="profile"):
        load_profile("no-such-model-infsc")
    with pytest.raises(TypeError, match="profile"):
        load_profile(None)
    with pytest.raises(ValueError, match="heads"):
        load_profile(SHIPPED, heads="both")


@pytest.mark.model
def test_profiler_on_real_model():
    from tritonkv.integrations.model import load_smollm2

    model, tok = load_smollm2()
    kw = dict(lengths=[384], depths=[0.5], steps=1, layers=[0, 14], source="synthetic")
    p = profile_infsc(model, tok, **kw)
    assert p.infsc_query_heads.shape == (2, 9) and p.infsc_kv_heads.shape == (2, 3)
    for t in (p.sf, p.lg, p.infsc_query_heads, p.infsc_kv_heads):
        assert torch.all((t >= 0) & (t <= 1)) and torch.isfinite(t).all()
    assert float(p.lg.max()) == pytest.approx(1.0, abs=1e-6)
    # the weights are attention mass: WO + WD + WS <= 1 per head
    assert torch.all(p.wo + p.wd + p.ws <= 1 + 1e-5)
    assert model.config._attn_implementation == "sdpa"  # eager only inside the profiler
    assert p.grid["lengths"] == [384] and p.grid["layers"] == [0, 14]
    q = profile_infsc(model, tok, **kw)
    assert torch.equal(p.infsc_query_heads, q.infsc_query_heads) and torch.equal(p.wd, q.wd)


@pytest.mark.parametrize("args, words", [
    (["--lengths", "abc"], ["--lengths", "comma-separated numbers"]),
    (["--lengths", "20000"], ["--lengths", "8192"]),
    (["--depths", "2"], ["--depths", "[0, 1]"]),
    (["--steps", "9"], ["--steps", "between 1 and 5"]),
    (["--trials", "0"], ["--trials", "at least 1"]),
    (["--layers", "0"], ["--layers", "at least 1"]),
    (["--out", "."], ["--out", "directory"]),
    (["--out", "no-such-dir/p.json"], ["--out", "does not exist"]),
])
def test_bad_arguments_are_one_line_errors_before_the_model_loads(capsys, monkeypatch, args, words):
    """``tritonkv profile`` with arguments it cannot run with: one line on stderr, status 2, and the model is
    never loaded (the checks come first)."""
    from tritonkv.__main__ import main
    from tritonkv.integrations import model

    monkeypatch.setattr(model, "load_smollm2", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["profile", "--out", "unused.json", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tritonkv profile: error: "), err
    for w in words:
        assert w in err[0], (w, err[0])


def test_weight_sums_refuse_other_shapes():
    """Sums of one run's ``[L, H_q]`` shape never broadcast with another's (a resumed run with other layers)."""
    s = WeightSums()
    s.add(torch.ones(2, 4, 1), torch.ones(2, 4, 1), torch.ones(2, 4, 1))
    for shape in ((1, 4, 1), (2, 1, 1)):
        with pytest.raises(ValueError, match="cannot be added"):
            s.add(torch.ones(shape), torch.ones(shape), torch.ones(shape))
    with pytest.raises(ValueError, match="one shape"):
        s.add(torch.ones(2, 4, 1), torch.ones(2, 4, 2), torch.ones(2, 4, 1))
    r = WeightSums()
    r.load(s.state())
    torch.testing.assert_close(r.profile(2, {}).wd, s.profile(2, {}).wd)
    bad = dict(s.state(), wd=torch.ones(1, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="one \\[L, H_q\\] shape"):
        WeightSums().load(bad)
    WeightSums().load(WeightSums().state())  # an empty run's state


def test_load_profile_paths_and_bad_files(tmp_path):
    """A name ending in ``.json`` or with a separator is a path; a file that is no profile is a ValueError naming it."""
    missing = str(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="not found") as e:
        load_profile(missing)
    assert f"(no file {missing})" in str(e.value) and ".json.json" not in str(e.value)
    torch.testing.assert_close(load_profile(SHIPPED + ".json"), load_profile(SHIPPED))
    (tmp_path / "corrupt.json").write_text("{not json")
    (tmp_path / "flat.json").write_text(json.dumps({"infsc_kv_heads": [1.0, 2.0]}))
    (tmp_path / "ragged.json").write_text(json.dumps({"infsc_kv_heads": [[1.0, 2.0], [1.0]]}))
    (tmp_path / "list.json").write_text("[[1.0, 2.0]]")
    for name, words in (("corrupt", "not valid JSON"), ("flat", "got shape (2,)"), ("ragged", "[L, H]"),
                        ("list", "no 'infsc_kv_heads' entry")):
        path = str(tmp_path / f"{name}.json")
        with pytest.raises(ValueError, match="profile file") as e:
            load_profile(path)
        assert path in str(e.value) and words in str(e.value), str(e.value)
    from tritonkv.allocation import SurfaceLogic

    with pytest.raises(ValueError, match="not valid JSON") as e:
        SurfaceLogic(profile_name=str(tmp_path / "corrupt.json"))(shape=(1, 2, 64), budget=16, layer=0)
    assert "shipped" not in str(e.value)


def _fake_trials(monkeypatch, calls):
    """``tritonkv profile`` with no model: each trial's attention is a fixed function of its case's seed."""
    from types import SimpleNamespace

    from tritonkv.integrations import model, needle
    from tritonkv.integrations import profiler as cli

    cfg = SimpleNamespace(num_hidden_layers=3, num_key_value_heads=2)
    monkeypatch.setattr(model, "load_smollm2", lambda *a, **k: (SimpleNamespace(config=cfg), None))
    monkeypatch.setattr(needle, "build_case", lambda tok, n, d, seed, text: SimpleNamespace(
        seed=seed, needle_positions=torch.arange(2)))

    def attention(model, case, steps, layers):
        calls.append(case.seed)
        g = torch.Generator().manual_seed(case.seed)
        return torch.softmax(torch.randn(len(layers or range(3)), 4, steps, 16, generator=g), -1)
    monkeypatch.setattr(cli, "answer_attention", attention)


def test_resume_refuses_another_runs_checkpoint(tmp_path, monkeypatch, capsys):
    """``--resume`` continues a checkpoint only with the settings it was written with; a run that cannot write
    its profile says so in one line and keeps the checkpoint."""
    from tritonkv.__main__ import main
    from tritonkv.integrations import profiler as cli

    calls = []
    _fake_trials(monkeypatch, calls)
    out = str(tmp_path / "p.json")
    run = ["profile", "--out", out, "--lengths", "96", "--depths", "0.2,0.7", "--steps", "2", "--source", "synthetic"]
    real_save = cli.save_profile

    def no_disk(prof, path):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(cli, "save_profile", no_disk)
    assert main(run) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot write" in err[0] and "--resume" in err[0], err
    assert len(calls) == 2 and not (tmp_path / "p.json").exists()
    partial = tmp_path / "p.json.partial.pt"
    assert partial.exists()
    monkeypatch.setattr(cli, "save_profile", real_save)
    for other, words in ((["--seed", "9"], "seed 0 (now 9)"), (["--steps", "1"], "steps 2 (now 1)"),
                         (["--depths", "0.7,0.2"], "depths"), (["--layers", "1"], "layers None (now 1)"),
                         (["--lengths", "128"], "lengths [96] (now [128])"), (["--trials", "2"], "trials")):
        assert main([*run, *other, "--resume"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "another run" in err[0] and words in err[0], (other, err)
    assert len(calls) == 2 and partial.exists()
    assert main([*run, "--resume"]) == 0  # the same run: every trial is done
    assert len(calls) == 2 and not partial.exists()
    resumed = json.loads((tmp_path / "p.json").read_text())
    assert main([*run, "--out", str(tmp_path / "fresh.json")]) == 0
    fresh = json.loads((tmp_path / "fresh.json").read_text())
    assert resumed["infsc_query_heads"] == fresh["infsc_query_heads"] and resumed["grid"] == fresh["grid"]
    torch.save({"sums": {}, "done": []}, partial)  # a checkpoint without its settings
    assert main([*run, "--resume"]) == 2
    assert "does not record" in capsys.readouterr().err

    def read_only(*a, **k):
        raise OSError(13, "Permission denied")
    monkeypatch.setattr(torch, "save", read_only)
    assert main([*run, "--out", str(tmp_path / "third.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot write the checkpoint" in err[0], err


def test_module_exit_status():
    """``python -m tritonkv.integrations.profiler`` exits with main()'s status."""
    import runpy
    import sys
    import warnings

    argv = sys.argv
    sys.argv = ["profiler", "--out", "unused.json", "--lengths", "abc"]
    try:
        with warnings.catch_warnings(), pytest.raises(SystemExit) as e:
            warnings.simplefilter("ignore", RuntimeWarning)  # the module is already imported
            runpy.run_module("tritonkv.integrations.profiler", run_name="__main__")
    finally:
        sys.argv = argv
    assert e.value.code == 2


def _commands(text: str):
    """The ``profile`` commands in ``text`` (line continuations joined), as argument lists."""
    import re
    import shlex

    text = text.replace("\\\n", " ")
    pattern = r"(?:-m tritonkv\.integrations\.profiler|tritonkv profile) (--out [^\n`]*)"
    return [shlex.split(m) for m in re.findall(pattern, text)]


def test_documented_command_writes_the_shipped_grid():
    """The regeneration command in the docstrings and the docs has the shipped default profile's settings, and
    ``--help`` shows the defaults."""
    import os

    from tritonkv.integrations import profiler as cli

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(profiler.profile_path(SHIPPED)) as f:
        grid = json.load(f)["grid"]
    with open(os.path.join(root, "docs", "algorithms.md")) as f:
        docs = f.read()
    commands = [c for text in (profiler.__doc__, cli.__doc__, docs) for c in _commands(text)]
    assert len(commands) == 3
    for argv in commands:
        a = cli.parser().parse_args(["--out", "x.json", *argv])
        assert a.out.endswith(SHIPPED + ".json")
        lengths, depths = cli._floats(a.lengths), cli._floats(a.depths)
        assert cli.run_settings(a, lengths, depths) == grid, argv
    text = " ".join(cli.parser().format_help().split())
    for words in ("(default: 0.1,0.35,0.65,0.9)", "(default: 5)", "--trials TRIALS cases", "--seed SEED base seed"):
        assert words in text, words
