"""Smoke tests of the benchmark programs: quality.py's measurement logic on a tiny random Llama (no download),
its tables/claims, report.py's README markers, and speed.py's --smoke run."""
import copy
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))

import quality  # noqa: E402
import report  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


def test_capture_matches_model(tiny):
    ids = torch.randint(0, 256, (1, 40))
    cap = quality.capture(tiny, ids)
    assert len(cap) == 2
    k, v, q = cap[1]
    assert k.shape == (1, 2, 40, 16) and v.shape == k.shape and q.shape == (1, 6, 40, 16)
    # the captured queries reproduce the layer's attention output (causal SDPA over the captured K/V)
    G = 3
    o = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1),
                                                         is_causal=True)
    # attention_error with every token kept is exactly 0; with none of the last queries' keys it is not
    keep = torch.ones(1, 2, 30, dtype=torch.bool)
    assert torch.all(quality.attention_error(k[:, :, :30], v[:, :, :30], q[:, :, 30:], keep) == 0)
    keep[:, :, 10:] = False
    err = quality.attention_error(k[:, :, :30], v[:, :, :30], q[:, :, 30:], keep)
    assert err.shape == (6,) and torch.all(err > 0) and torch.all(err <= 2)
    # o over a prefix computed by hand agrees with SDPA at the prefix's last query
    full = quality.attention_error(k[:, :, :30], v[:, :, :30], q[:, :, 29:30], torch.ones(1, 2, 30, dtype=torch.bool))
    assert torch.all(full == 0) and torch.isfinite(o).all()


def test_compress_path_and_kept_mask(tiny):
    import tritonkv

    cap = quality.capture(tiny, torch.randint(0, 256, (1, 72)))
    k, v, q = cap[0]
    kp, vp, qp = k[:, :, :64], v[:, :, :64], q[:, :, :64]
    out = tritonkv.compress((kp, vp), "keydiff", 16)
    keep = quality.kept_mask(out, 64)
    assert keep.shape == (1, 2, 64) and torch.all(keep.sum(-1) == 16)
    assert torch.equal(keep.nonzero()[:, 2].reshape(1, 2, 16), out.indices)
    out = tritonkv.compress((kp, vp), "snapkv", 40, allocation="adakv", queries=qp[:, :, -32:])
    keep = quality.kept_mask(out, 64)
    assert int(keep.sum()) == 2 * 40  # AdaKV moves budget between heads, the layer total stays
    err = quality.attention_error(kp, vp, q[:, :, 64:], keep)
    assert torch.isfinite(err).all()


def test_score_case_full_and_compressed(tiny):
    from tritonkv.integrations.needle import NeedleCase

    ids = torch.randint(0, 256, (1, 48))
    cands = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]
    case = NeedleCase(input_ids=ids, needle_positions=torch.arange(10, 14), key="x", candidates=["a", "b", "c"],
                      candidate_ids=cands, answer=1, depth=0.5, seed=0)
    s_full, d_full = quality.score_case(tiny, case)
    # a budget >= the prompt evicts nothing: same likelihoods and zero KL (up to fp32 round-off)
    s_all, d_all = quality.score_case(tiny, case, "keydiff", 1.0, "blockwise", block_size=16)
    assert d_full.shape == (3, 256)
    assert max(abs(a - b) for a, b in zip(s_full, s_all)) < 1e-3
    assert quality.kl(d_full, d_all) < 1e-5
    s_c, d_c = quality.score_case(tiny, case, "keydiff", 0.25, "blockwise", block_size=16)
    assert quality.kl(d_full, d_c) > 1e-6


def _rows():
    rows = [dict(policy="full", allocation="uniform", mode="full", budget=1.0, context=64, metric="needle", value=1.0,
                 trials=2)]
    for p, acc, kl in (("keydiff", 1.0, 0.1), ("tova", 0.5, 0.3), ("snapkv", 1.0, 0.2), ("streaming_llm", 0.0, 0.5)):
        rows += [dict(policy=p, allocation="uniform", mode="blockwise", budget=0.1, context=64, metric="needle",
                      value=acc, trials=2),
                 dict(policy=p, allocation="uniform", mode="blockwise", budget=0.1, context=64, metric="kl",
                      value=kl, trials=2)]
    return rows


def test_claims_and_tables():
    data = {"rows": _rows(), "details": {
        "attn_err/criticalkv/uniform/0.1/64": {"layers": [0], "per_layer_head": [[0.1, 0.2, 0.3]]},
        "attn_err/snapkv/uniform/0.1/64": {"layers": [0], "per_layer_head": [[0.2, 0.3, 0.1]]}}}
    c = {x["claim"].split()[0]: x["status"] for x in quality.claims(data)}
    assert c["KeyDiff"] == "reproduced" and c["CriticalKV"] == "reproduced"
    assert c["LagKV"] == "not measured" and c["SCORE"] == "not measured"
    data["rows"][1]["value"] = 0.0  # keydiff needle below tova: the claim fails
    assert quality.claims(data)[0]["status"] == "not reproduced"
    t = quality.table(data["rows"], "needle", "blockwise")
    assert "| keydiff | 0.00 |" in t and "| full | 1.00 |" in t
    md = quality.markdown(data)
    assert "The papers' claims" in md


def test_report_markers(tmp_path):
    import json

    res = tmp_path / "results"
    res.mkdir()
    (res / "quality.json").write_text(json.dumps({"rows": _rows(), "details": {}, "commit": "abc", "date": "d"}))
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\ntext\n")
    assert report.main([], readme_path=str(readme), results_dir=str(res)) == 0
    text = readme.read_text()
    assert text.startswith("# x\n\ntext\n") and "## Which policy?" in text
    assert "<!-- quality:begin -->" in text and "| keydiff |" in text and "No speed results" in text
    assert report.main(["--check"], readme_path=str(readme), results_dir=str(res)) == 0
    readme.write_text(text.replace("| keydiff |", "| stale |"))
    assert report.main(["--check"], readme_path=str(readme), results_dir=str(res)) == 1
    report.main([], readme_path=str(readme), results_dir=str(res))
    assert readme.read_text() == text  # idempotent, outside text untouched


def test_speed_smoke(tmp_path):
    import json
    import shutil

    import speed

    assert speed.parser().parse_args(["--smoke"]).out is None  # a smoke run writes nothing unless --out is given
    out = tmp_path / "out"
    res = speed.main(["--smoke", "--out", str(out), "--policies", "knorm", "snapkv"])
    rows = res["rows"]
    assert not [r for r in rows if "error" in r] and not res["skipped"] and res["complete"]
    assert {r["kind"] for r in rows} == {"compress", "allocation", "decode_attention", "scaling"}
    assert {r["policy"] for r in rows if r["kind"] == "compress"} == {"knorm", "snapkv"}
    alloc = [r for r in rows if r["kind"] == "allocation"]
    assert {r["allocation"] for r in alloc} == set(speed.ALLOCATIONS) and all(r["policy"] == "snapkv" for r in alloc)
    assert {r["policy"] for r in rows if r["kind"] == "scaling"} == set(speed.SCALING_POLICIES)
    assert len({r["N"] for r in rows if r["kind"] == "scaling"}) == 3
    for r in rows:  # every timed result was checked, and has its floor
        assert r["ok"] is True and r["tritonkv_us"] > 0 and r["floor_us"] > 0 and r["pct_copy_bw"] >= 0, r
    for r in alloc:
        assert r["kept_tokens"] > 0 and r["k_max"] >= 1 and r["x_dense_eager"] > 0  # vs the dense snapkv row
    fits = res["scaling_fit"]
    assert set(fits) == set(speed.SCALING_POLICIES)
    for f in fits.values():
        assert f["points"] == 3 and None not in (f["slope_ns_per_token"], f["intercept_us"], f["r2"], f["exponent"])
    # the fit itself: exact on a line, and the large-N log-log exponent is 1 for time proportional to N
    f = speed.fit([(n, 5.0 + 0.002 * n) for n in (4096, 8192, 65536, 131072, 262144)])
    assert abs(f["slope_ns_per_token"] - 2.0) < 1e-6 and abs(f["intercept_us"] - 5.0) < 1e-6 and f["r2"] == 1.0
    assert f["exponent_from_N"] == 65536 and 0.95 < f["exponent"] < 1.0
    assert speed.fit([(n, 0.5 * n) for n in (65536, 131072)])["exponent"] == 1.0
    # files: JSON with the fit, Markdown with a table per kind, both plots
    names = sorted(os.listdir(out))
    assert names == ["cpu-speed-scaling.png", "cpu-speed.json", "cpu-speed.md", "cpu-speed.png"]
    data = json.loads((out / "cpu-speed.json").read_text())
    assert data["scaling_fit"] == fits and set(data["phase_s"]) >= set(speed.PARTS)
    md = (out / "cpu-speed.md").read_text()
    for title in ("**Compress**", "**Allocation**", "**Decode attention**", "**Scaling in N**", "slope_ns_per_token"):
        assert title in md
    # report.py renders a GPU run's Markdown and links its plots (CPU results are left out of the README)
    gpu = tmp_path / "results"
    gpu.mkdir()
    for n in names:
        shutil.copy(out / n, gpu / n.replace("cpu-", "nvidia-h100-"))
    assert "No speed results" in report.speed_section(str(out))
    section = report.speed_section(str(gpu))
    assert "**Scaling in N**" in section and "nvidia-h100-speed-scaling.png)" in section


def test_kernel_stats_smoke(tmp_path):
    """benchmarks/kernel_stats.py --smoke (its own process, no interpreter): every Triton kernel of the
    library compiles for sm_90 at the configurations its launcher picks on a GPU, with registers,
    spills, shared memory and occupancy read back, and every policy's compress is logged launch by launch."""
    import json
    import subprocess

    from tritonkv import POLICIES

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(HERE), "benchmarks", "kernel_stats.py")
    r = subprocess.run([sys.executable, script, "--smoke", "--out", str(tmp_path)], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-5000:]
    res = json.loads((tmp_path / "kernel_stats.json").read_text())
    assert not res["errors"] and res["smoke"] and res["archs"] == ["sm_90"] and res["triton"]
    assert not res["targets"].get("not_launched")  # every *_kernel of tritonkv ran in some workload
    for k in res["kernels"]:
        st = k["archs"]["sm_90"]
        assert st["regs"] > 0 and st["num_warps"] >= 1 and st["num_stages"] >= 1 and st["smem"] >= 0, k
        assert 0 < st["occupancy"] <= 1 and st["ctas_per_sm"] >= 1, k
    work = {w["name"]: w for w in res["workloads"]}
    assert {n for n, w in work.items() if w["kind"] == "compress"} == set(POLICIES) | {"criticalkv_l2"}
    assert {"decode_attention", "ragged_append"} <= set(work)
    for name in POLICIES:  # every compress ends in the shared select pipeline (LagKV: its one closed-form kernel)
        seq = [x["kernel"] for x in work[name]["kernel_launches"]]
        last = "_lagkv_kernel" if name == "lagkv" else "_select_compact_kernel"
        assert seq and seq[-1].startswith(last) and not work[name]["error"], (name, seq)
        assert work[name]["launches"] == work[name]["triton_launches"] + work[name]["torch_launches"]
        assert 0 < work[name]["triton_est_bytes"] <= work[name]["triton_bytes"]
    assert work["knorm"]["kernel_launches"][0]["kernel"] == "_knorm_kernel"
    assert all(x["kernel"].startswith("_select_") for x in work["streaming_llm"]["kernel_launches"])
    md = (tmp_path / "kernel_stats.md").read_text()
    assert "## Issue 16 targets" in md and "--smoke" in md and "| `_knorm_kernel` |" in md


def test_memory_smoke(tmp_path):
    """benchmarks/memory.py --smoke (its own process, no interpreter: the CPU bodies of the kernels): stock and one
    policy per mode at N = 512 and 1024, every measurement in a fresh process of its own, with positive peaks,
    resident and kept bytes; the Markdown (targets), the plot, and report.py's README section from the JSON."""
    import json
    import subprocess

    import memory

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(HERE), "benchmarks", "memory.py")
    r = subprocess.run([sys.executable, script, "--smoke", "--out", str(tmp_path)], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    data = json.loads((tmp_path / "memory.json").read_text())
    rows = data["rows"]
    assert not [x for x in rows if "error" in x], [x["error"] for x in rows if "error" in x]
    assert data["complete"] and not data["skipped"] and data["smoke"]
    want = {memory.config_key("tiny", *c) for c in memory.SMOKE_CONFIGS} | {"tiny/stock/dynamic"}
    assert set(data["configurations"]) == want and {c[0] for c in memory.SMOKE_CONFIGS} == set(memory.MODES)
    assert sorted((x["key"], x["N"]) for x in rows) == sorted((k, n) for k in want for n in memory.SMOKE_NS)
    assert len({x["pid"] for x in rows}) == len(rows)  # a fresh process per measurement
    m = data["machine"]
    assert m["cpu"] and m["cores"] >= 1 and m["torch"] and m["transformers"] and m["date"] and not m["triton_interpret"]
    assert "--smoke" in data["command"]
    stock = {x["N"]: x for x in rows if x["policy"] is None}
    for x in rows:
        # on a GPU the model and its cache live on the device: the call's peak is there, not in the host RSS
        assert x["peak_rss_kb"] > 0 and memory.peak_kb(x) > 0 and x["wall_s"] > 0, x
        assert ("cuda_peak_increase_bytes" in x) == (x["device"] != "cpu")
        assert x["generated"] == x["new_tokens"] == memory.SMOKE_NEW_TOKENS
        for when in ("after_prompt", "after_generate", "after_prompt_in_generate"):
            st = x[when]
            assert st["resident_bytes"] > 0 and st["held_bytes"] > 0 and st["kept_tokens"] > 0, (x["key"], when, st)
            assert st["kept_kv_bytes"] > 0 and st["resident_over_kept"] > 0
        if x["policy"] is None:  # the DynamicCache: every token, nothing else
            assert x["after_prompt"]["kept_tokens"] == 2 * 2 * x["N"]  # layers x KV heads x N
            assert x["after_generate"]["resident_bytes"] == x["after_generate"]["kept_kv_bytes"]
        else:  # compressed: fewer tokens than stock holds, after the prompt and after generating
            for when in ("after_prompt", "after_generate"):
                assert x[when]["kept_tokens"] < stock[x["N"]][when]["kept_tokens"], (x["key"], when)
            assert x["after_prompt"]["kept_tokens"] == x["after_prompt_in_generate"]["kept_tokens"]
    md = (tmp_path / "memory.md").read_text()
    assert "## Targets" in md and "**Peak RSS increase" in md and "after_prefill · keydiff" in md
    assert (tmp_path / "memory.png").stat().st_size > 0
    section = report.memory_section(str(tmp_path))
    assert "| stock (peak increase) |" in section and "blockwise · snapkv+adakv" in section
    assert "No memory results" in report.memory_section(str(tmp_path / "none"))


def test_cpu_speed_smoke(tmp_path):
    """benchmarks/cpu_speed.py --smoke in its own process without the interpreter (the ops' PyTorch bodies):
    every registered policy's compress() against its plain PyTorch pipeline at N = 1024, no errors, the same
    kept tokens up to ties at the cut, and the JSON/Markdown with the machine, versions and command."""
    import json
    import subprocess

    import tritonkv

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(HERE), "benchmarks", "cpu_speed.py")
    r = subprocess.run([sys.executable, script, "--smoke", "--out", str(tmp_path)], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    data = json.loads((tmp_path / "cpu_speed.json").read_text())
    rows = data["rows"]
    assert not [x for x in rows if "error" in x], [x["error"] for x in rows if "error" in x]
    assert sorted(x["policy"] for x in rows) == sorted(tritonkv.POLICIES) and {x["N"] for x in rows} == {1024}
    for x in rows:  # max pooling repeats a value over up to 7 tokens: at most that many swaps at the cut
        assert x["tritonkv_ms"] > 0 and x["plain_ms"] > 0 and x["ratio"] > 0 and x["ratio_of_min"] > 0, x
        assert x["overlap"] >= 1 - 7 / x["k"], x
    m = data["machine"]
    assert m["cpu"] and m["cores"] >= 1 and m["torch_threads"] >= 1 and not data["triton_interpret"]
    assert data["torch"] and data["commit"] and data["date"] and "--smoke" in data["command"]
    md = (tmp_path / "cpu_speed.md").read_text()
    assert "| policy | N | tritonkv ms | plain ms | ratio | min ratio | runs |" in md
    assert all(f"| {p} | 1024 |" in md for p in tritonkv.POLICIES)
