"""Smoke tests of the benchmark programs (each its own process or a tiny run: they check the programs, not the
speed), the shared harness, and the generated results page, which must match the committed results."""
import gzip
import json
import os
import subprocess
import sys
import time

import pytest

from benchmarks import common, report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.bench


def run_module(name, *args):
    """``python -m benchmarks.<name> ARGS`` from the repository root, without the interpreter (the ops' PyTorch
    bodies on the CPU, as users run them)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *args], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r


def test_results_page_is_current():
    """benchmarks/results/README.md is what ``python -m benchmarks.report`` writes from the committed results."""
    assert report.main(["--check"]) == 0, "run python -m benchmarks.report"


def test_results_page(tmp_path):
    """The page from a results folder: its sections say what is missing; --check fails on a stale page and passes on
    a fresh one; writing twice changes nothing; every other result file is linked."""
    res = tmp_path / "results"
    (res / "quality").mkdir(parents=True)
    assert report.main(["--check"], results_dir=str(res)) == 1  # no page yet
    assert report.main([], results_dir=str(res)) == 0
    page = (res / "README.md").read_text()
    assert "No quality records" in page and "No speed results" in page and "No memory results" in page
    assert report.main(["--check"], results_dir=str(res)) == 0
    (res / "README.md").write_text(page.replace("No speed results", "stale"))
    assert report.main(["--check"], results_dir=str(res)) == 1
    report.main([], results_dir=str(res))
    assert (res / "README.md").read_text() == page
    # every other result file is linked: the described ones, and any Markdown found
    (res / "soak.md").write_text("x")
    (res / "sub").mkdir()
    (res / "sub" / "new.md").write_text("x")
    report.main([], results_dir=str(res))
    page = (res / "README.md").read_text()
    assert "- [soak.md](soak.md): memory over" in page and "- [sub/new.md](sub/new.md)\n" in page


def test_records_compressed_and_plain(tmp_path):
    """JSON lines are read alike from .jsonl and .jsonl.gz (several gzip members: one per append), a blank or
    half-written line is left out, and a compressed tail cut short by a kill keeps the records before it."""
    gz, plain = str(tmp_path / "a.jsonl.gz"), str(tmp_path / "b.jsonl")
    common.append_jsonl(gz, [{"x": 1}, {"x": 2}])
    common.append_jsonl(gz, [{"x": 3}])
    common.append_jsonl(plain, [{"x": 4}])
    with open(plain, "a") as f:
        f.write('\n{"x": ')
    assert common.read_jsonl(gz) == [{"x": 1}, {"x": 2}, {"x": 3}] and common.read_jsonl(plain) == [{"x": 4}]
    with open(gz, "ab") as f:
        f.write(gzip.compress(b'{"x": 5}\n{"x": 6}\n')[:-12])  # a member cut short
    assert common.read_jsonl(gz)[:3] == [{"x": 1}, {"x": 2}, {"x": 3}]
    common.append_jsonl(str(tmp_path / "runs.jsonl"), [{"run": 1}])
    assert common.jsonl_files(str(tmp_path)) == [gz, plain]


def test_table():
    assert common.table([{"a": 1, "b": None}], ["a", "b"]) == ["| a | b |", "|---|---|", "| 1 | – |"]
    assert common.table([["x", 2]], None, ["name", "n"], right=True) == ["| name | n |", "|---|---:|", "| x | 2 |"]


def _child_row(spec):
    if spec["do"] == "raise":
        raise ValueError("bad spec")
    if spec["do"] == "die":
        os._exit(3)
    if spec["do"] == "hang":
        time.sleep(60)
    return dict(spec, pid=os.getpid())


def test_in_processes():
    """Each spec in a fresh process of its own, results in order; a raise, a death and a timeout become the row's
    ``error`` (the hanging process killed), the others' results kept."""
    import multiprocessing

    specs = [dict(do="ok"), dict(do="raise"), dict(do="die"), dict(do="hang"), dict(do="ok")]
    t = time.monotonic()
    rows = common.in_processes(multiprocessing.get_context("fork"), _child_row, specs, timeout=5)
    assert time.monotonic() - t < 30
    assert [r["do"] for r in rows] == [s["do"] for s in specs]
    assert rows[0]["pid"] != rows[4]["pid"] != os.getpid() and "error" not in rows[0] and "error" not in rows[4]
    assert "ValueError: bad spec" in rows[1]["error"]
    assert rows[2]["error"] == "the process died (exit code 3)"
    assert rows[3]["error"] == "timed out after 5 s"


def test_random_case_and_device_tag():
    """The speed programs' seeded inputs: shapes, dtypes, W_O square unless ``d_model`` is given, the same tensors
    for the same seed; result-file prefixes from the device name."""
    import torch

    keys, values, pool = common.random_case(40, 1, 2, 3, 8, 4, torch.bfloat16)
    assert keys.shape == values.shape == (1, 2, 40, 8) and keys.dtype == torch.bfloat16
    assert pool["queries"].shape == (1, 6, 4, 8) and pool["o_proj"].shape == (48, 48) and pool["hd"].shape == (2,)
    again = common.random_case(40, 1, 2, 3, 8, 4, torch.bfloat16)
    assert torch.equal(keys, again[0]) and torch.equal(pool["o_proj"], again[2]["o_proj"])
    k32, _, p32 = common.random_case(40, 1, 2, 3, 8, 4, d_model=16)
    assert k32.dtype == torch.float32 and p32["o_proj"].shape == (16, 48) and torch.equal(k32.bfloat16(), keys)
    assert common.device_tag({"device": "NVIDIA H200"}) == "nvidia-h200"
    assert common.device_tag({"device": "cpu"}) == "cpu"
    assert common.device_tag({"device": "NVIDIA H100 80GB HBM3 (MIG 1g)"}) == "nvidia-h100-80gb-hbm3"


def test_speed_markdown_from_committed_run():
    """speed.py's Markdown of the committed GPU run, rendered again from its JSON, is the committed file."""
    from benchmarks import speed

    base = os.path.join(ROOT, "benchmarks", "results", "nvidia-h100-speed")
    with open(base + ".json") as f, open(base + ".md") as g:
        assert speed.markdown(json.load(f)) == g.read()


def test_host_timed_times_each_call_from_an_idle_device(monkeypatch):
    """``common.host_timed`` (speed.py's eager times; CUDA faked here): before each call the device is waited for,
    so the events around the call see the host's work; the repeats fill the wall-time budget given."""
    import torch

    log = []

    class Event:
        def __init__(self, enable_timing):
            self.t = None

        def record(self):
            log.append("record")
            self.t = time.perf_counter()

        def synchronize(self):
            log.append("wait")

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

    empty = torch.empty
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: log.append("sync"))
    monkeypatch.setattr(torch, "empty", lambda *a, device=None, **k: empty(1024, dtype=torch.int8))
    ts = common.host_timed(lambda: (log.append("call"), time.sleep(0.002)), warmup=10, rep=40)
    assert 5 <= len(ts) <= 20 and all(t >= 2.0 for t in ts), ts
    assert log[:5] == ["sync", "record", "call", "record", "wait"], log[:5]
    assert log.count("call") == log.count("sync") > len(ts) + 5  # warm-up calls too, each from an idle device


def test_speed_smoke(tmp_path):
    """speed.py --smoke (tiny shapes under the interpreter, in this process) through every part, every row checked;
    its JSON, Markdown and plots; report.py's speed section from a GPU run's files."""
    import shutil

    from benchmarks import speed

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
    # report.py renders a GPU run's Markdown and links its plots (CPU results are left out of the page)
    gpu = tmp_path / "results"
    gpu.mkdir()
    for n in names:
        shutil.copy(out / n, gpu / n.replace("cpu-", "nvidia-h100-"))
    assert "No speed results" in report.speed_section(str(out))
    section = report.speed_section(str(gpu))
    assert "**Scaling in N**" in section and "nvidia-h100-speed-scaling.png)" in section


def test_memory_smoke(tmp_path):
    """benchmarks/memory.py --smoke (its own process, no interpreter: the CPU bodies of the kernels): stock and one
    policy per mode at N = 512 and 1024, every measurement in a fresh process of its own, with positive peaks,
    resident and kept bytes; the Markdown (targets), the plot, and report.py's README section from the JSON."""
    from benchmarks import memory

    run_module("memory", "--smoke", "--out", str(tmp_path))
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
    import tritonkv

    run_module("cpu_speed", "--smoke", "--out", str(tmp_path))
    data = json.loads((tmp_path / "cpu_speed.json").read_text())
    rows = data["rows"]
    assert not [x for x in rows if "error" in x], [x["error"] for x in rows if "error" in x]
    assert sorted(x["policy"] for x in rows) == sorted(tritonkv.POLICIES) and {x["N"] for x in rows} == {1024}
    for x in rows:  # max pooling repeats a value over up to 7 tokens: at most that many swaps at the cut
        assert x["tritonkv_ms"] > 0 and x["plain_ms"] > 0 and x["ratio"] > 0 and x["ratio_of_min"] > 0, x
        assert x["overlap"] >= 1 - 7 / x["k"], x
    m = data["machine"]
    assert m["cpu"] and m["cores"] >= 1 and m["torch_threads"] >= 1 and not data["triton_interpret"]
    assert m["torch"] and m["commit"] and m["date"] and "--smoke" in m["command"]
    md = (tmp_path / "cpu_speed.md").read_text()
    assert "| policy | N | tritonkv ms | plain ms | ratio | min ratio | runs |" in md
    assert all(f"| {p} | 1024 |" in md for p in tritonkv.POLICIES)


def test_host_time_smoke(tmp_path):
    """``python -m benchmarks.host_time`` on one dense and one allocated case (one round, stub launches, no
    interpreter): positive host times with and without Triton's ``run``, the calibration loop, and the JSON and
    Markdown with the machine and the command that ran."""
    j, md = tmp_path / "ht.json", tmp_path / "ht.md"
    run_module("host_time", "--only", "knorm", "snapkv+adakv", "--calls", "2", "--rounds", "1", "--warmup", "1",
               "--repeats", "1", "--json", str(j), "--md", str(md))
    data = json.loads(j.read_text())
    for m in ("host_us", "without_triton_run_us"):
        assert set(data["after"][m]) == {"knorm", "snapkv+adakv"} and min(data["after"][m].values()) > 0
    assert data["after"]["loop_us"] > 0 and data["after"]["commit"]
    assert data["machine"]["cpu"] and data["machine"]["cores"] >= 1 and data["machine"]["triton"]
    assert data["command"].startswith("python -m benchmarks.host_time --only knorm")
    text = md.read_text()
    assert "Command: `python -m benchmarks.host_time " in text and "| knorm |" in text and "| snapkv+adakv |" in text


def test_soak_smoke(tmp_path):
    """``python -m benchmarks.soak`` with 20 decode steps per cache and 3 requests: every cache's memory readings,
    the server loop's count, and ``--render`` rewriting the same Markdown from the JSON."""
    base = str(tmp_path / "soak")
    run_module("soak", "--steps", "20", "--every", "10", "--warmup", "10", "--requests", "3", "--warmup-requests",
               "1", "--out", base)
    data = json.loads((tmp_path / "soak.json").read_text())
    assert len(data["decode"]) == 3 and data["server"]["requests"] == 3 and len(data["server"]["rss_mib"]) == 3
    for r in data["decode"].values():
        assert [s["step"] for s in r["samples"]] == [0, 10, 20] and r["rss_mib_at_warmup"] > 0
        assert r["cache_bytes_at_warmup"] > 0
    assert data["command"].startswith("python -m benchmarks.soak --steps 20") and data["machine"]["cpu"]
    md = (tmp_path / "soak.md").read_text()
    assert "| cache | ms/step |" in md and "## Server loop: 3 requests" in md
    run_module("soak", "--render", "--out", base)
    assert (tmp_path / "soak.md").read_text() == md
