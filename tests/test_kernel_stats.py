"""benchmarks/kernel_stats.py: the SASS loop parser, the source analyses (trip counts, loaded/stored pointers),
and a smoke run on a few workloads (compiled for sm_90 with the installed Triton, no GPU). Everything runs
in subprocesses without the interpreter (the program compiles, and drops TRITON_INTERPRET on import)."""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _python(code: str, tmp_path) -> dict:
    """Run ``code`` from a file (``@triton.jit`` needs a source file) in ``tmp_path``, argv[1] = ``tmp_path``."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITONKV_CPU_KERNELS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH", "")]))
    script = tmp_path / "script.py"
    script.write_text(code)
    r = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, env=env,
                       timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


_UNITS = r'''
import json, os, sys
from benchmarks import kernel_stats as ks
import triton
import triton.language as tl

# a hand-written SASS listing: an outer loop (0x20..0x90, closed at line 10) holding an inner one
# (0x40..0x70, line 12) with two shared atomics and a POPC; a self-branch at the end is no loop
sass = """
        //## File "/x/k.py", line 5
        /*0000*/                   S2R R0, SR_TID.X ;
.L_x_0:
        //## File "/x/k.py", line 11
        /*0010*/                   VOTE.ANY R1, PT, P0 ;
        /*0020*/                   IADD3 R2, R2, 0x1, RZ ;
.L_x_1:
        //## File "/x/k.py", line 13
        /*0030*/                   POPC R3, R1 ;
        /*0040*/                   ATOMS.ADD RZ, [R4], R3 ;
        /*0050*/              @!P1 ATOMS.ADD RZ, [R4+0x4], R3 ;
        //## File "/x/k.py", line 12
        /*0060*/               @P0 BRA `(.L_x_1) ;
        //## File "/x/k.py", line 14
        /*0070*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        //## File "/x/k.py", line 10
        /*0080*/               @P2 BRA `(.L_x_0) ;
        /*0090*/                   EXIT ;
.L_x_2:
        /*00a0*/                   BRA `(.L_x_2) ;
"""
ins = ks.parse_sass(sass)
loops = ks.sass_loops(ins)
out = dict(n=len(ins), loops=[{k: L[k] for k in ("lo", "hi", "line", "parent", "depth", "n", "own_n")} |
                              {"own": {o: L["own"][o] for o in ("ATOMS", "POPC", "VOTE", "BAR")},
                               "all_atoms": L["counts"]["ATOMS"]} for L in loops])

# trip counts from the source loop of a logged launch (a stand-in record)
src = "def k(x_ptr, N, CHUNK, TILE):\n    c = tl.program_id(0)\n    hi = tl.minimum(N - c * CHUNK, CHUNK)\n" \
      "    for t0 in range(0, hi, TILE):\n        pass\n    for i in range(c):\n        pass\n" \
      "    n = tl.load(x_ptr)\n    for j in range(0, n):\n        pass\n" \
      "    m = 3\n    if N:\n        m2 = m * 2\n    m = 1000\n    for q in range(m2):\n        pass\n"
path = os.path.join(sys.argv[1], "k.py")
open(path, "w").write(src)
sys.path.insert(0, sys.argv[1])
import k as kmod
class Rec:
    grid = (4, 2)
    args = dict(N=1000, CHUNK=256, x_ptr=None)
    constexprs = dict(TILE=64)
    kernel = triton.jit(kmod.k)
out["trips"] = [ks.trip_count(path, line, Rec) for line in (4, 6, 9, 3, 15)]

@triton.jit
def _helper(p, q, n):
    tl.store(q + tl.arange(0, 4), tl.load(p + tl.arange(0, 4)))

@triton.jit
def _demo_kernel(a_ptr, b_ptr, c_ptr, h_ptr, n, BLOCK: tl.constexpr):
    row = a_ptr + tl.program_id(0) * n
    x = tl.load(row + tl.arange(0, BLOCK))
    off = x.to(tl.int32)
    tl.store(c_ptr + off, x)       # c written at offsets loaded from a: a stays read-only
    _helper(b_ptr, c_ptr, n)
    tl.atomic_add(h_ptr + off, 1)
out["access"] = ks.pointer_access(_demo_kernel)
out["occupancy"] = [ks.occupancy(*case, 90) for case in ((255, 2048, 4), (32, 0, 4), (32, 100 * 1024, 4), (40, 0, 8))]
print(json.dumps(out))
'''


def test_sass_loops_trip_counts_and_pointer_access(tmp_path):
    """The SASS parser finds the two nested loops by their backward branches (not the final self-branch),
    with own counts excluding the inner loop; trip counts come from the ``for`` on the branch's line (the
    middle program of the grid, locals evaluated in source order, ``None`` when the bound is loaded); pointer
    parameters are classified as loaded/stored through assignments and helper calls (an offset loaded from a
    pointer does not make that pointer written); the occupancy arithmetic on cases worked by hand."""
    res = _python(_UNITS, tmp_path)
    assert res["n"] == 11
    outer, inner = res["loops"]
    assert (outer["lo"], outer["hi"], outer["line"], outer["parent"], outer["depth"]) == (0x10, 0x80, 10, None, 0)
    assert (inner["lo"], inner["hi"], inner["line"], inner["parent"], inner["depth"]) == (0x30, 0x60, 12, 0, 1)
    assert inner["n"] == inner["own_n"] == 4 and inner["own"] == dict(ATOMS=2, POPC=1, VOTE=0, BAR=0)
    assert outer["n"] == 8 and outer["own_n"] == 4 and outer["own"] == dict(ATOMS=0, POPC=0, VOTE=1, BAR=1)
    assert outer["all_atoms"] == 2
    # program 2 of 4: hi = min(1000 - 512, 256) = 256 -> 4 tiles of 64; range(c) = 2; a loaded bound: None
    assert res["trips"] == [4, 2, None, None, 6]  # m2 from the m before it (source order, not nesting)
    access = {k: v for k, v in res["access"].items() if k.endswith("_ptr")}
    assert access == {"a_ptr": "r", "b_ptr": "r", "c_ptr": "w", "h_ptr": "rw"}
    # occupancy on an H100, worked by hand: 255 regs -> 8192 per warp, 8 warps/SM; 32 regs -> the thread limit;
    # 233472 // (102400 + 1024) = 2 CTAs; 40 regs -> 1280 per warp, 51 warps -> 6 CTAs of 8
    assert [(o["ctas_per_sm"], o["occupancy"], o["limiter"]) for o in res["occupancy"]] == [
        (2, 0.125, "registers"), (16, 1.0, "threads"), (2, 0.125, "shared memory"), (6, 0.75, "registers")]


_CALLEES = r'''
import json, os, sys
from benchmarks import kernel_stats as ks
from tritonkv.kernels import knorm, select

# helpers' loops: parameters bound at the call site, not looked up by name among the kernel's arguments
src = """import triton
import triton.language as tl


@triton.jit
def _inner(n, STEP: tl.constexpr):
    for i in range(0, n, STEP):
        pass


@triton.jit
def _helper(CHUNK, TILE: tl.constexpr, REPS: tl.constexpr = 3):
    for t0 in range(0, CHUNK, TILE):
        pass
    for q in range(REPS):
        pass
    _inner(CHUNK * 2, STEP=TILE)


@triton.jit
def _sum(n, SB: tl.constexpr):
    for i0 in range(0, n, SB):
        pass


@triton.jit
def _kernel(CHUNK, C0, TILE: tl.constexpr, HIST_TILE: tl.constexpr, SB: tl.constexpr):
    c = tl.program_id(0)
    half = CHUNK // 2
    _helper(half, HIST_TILE)
    C = tl.num_programs(0)
    _sum(C0, SB)
    _sum(C, SB)


@triton.jit
def _agree_kernel(C0, SB: tl.constexpr):
    _sum(C0, SB)
    _sum(tl.num_programs(0), SB)
"""
open(os.path.join(sys.argv[1], "calls.py"), "w").write(src)
sys.path.insert(0, sys.argv[1])
import calls
path = calls.__file__

class Rec:
    grid = (16, 8)
    args = dict(CHUNK=1024, C0=32, n=5, REPS=7)  # n and REPS: names of the helpers' parameters, other values
    constexprs = dict(TILE=64, HIST_TILE=256, STEP=8, SB=16)
    kernel = calls._kernel

class Agree(Rec):
    args = dict(C0=16)
    kernel = calls._agree_kernel

out = dict(helper=[ks.trip_count(path, line, Rec) for line in (7, 13, 15, 22)],
           agree=ks.trip_count(path, 22, Agree))

# Knorm at 32K: the scoring kernel fuses the select's pass 0 (hist0_of_chunk, 1-D tiles of HIST_TILE)
rec = next(r for w in ks.workloads(ks.N_FULL, ["knorm"]) for r in w["launches"] if r.name == "_knorm_kernel")
fors = {fn.name: line for p in (select.__file__, knorm.__file__) for line, (_, fn) in ks._fors(p).items()}
out["knorm"] = dict(CHUNK=rec.args["CHUNK"], TILE=rec.constexprs["TILE"], HIST_TILE=rec.constexprs["HIST_TILE"],
                    own=ks.trip_count(knorm.__file__, fors["_knorm_kernel"], rec),
                    hist0=ks.trip_count(select.__file__, fors["hist0_of_chunk"], rec))
print(json.dumps(out))
'''


def test_trip_counts_of_inlined_helpers(tmp_path):
    """A loop in a ``@triton.jit`` helper counts with the helper's parameters bound at its call site (the
    caller's arguments and locals before the call, positional and keyword arguments, defaults), through a
    helper calling a helper, even where a kernel argument shares a parameter's name; a helper called from
    two sites counts when the sites agree, else None. Knorm at 32K: its own loop takes CHUNK / TILE steps,
    the fused pass-0 histogram CHUNK / HIST_TILE (one 1024-key step), not CHUNK / TILE."""
    res = _python(_CALLEES, tmp_path)
    # _helper(512, TILE=256): 2 steps; REPS = its default 3; _inner(1024, STEP=256): 4; _sum: C0 = 32 vs C = 16
    assert res["helper"] == [4, 2, 3, None]
    assert res["agree"] == 1  # _sum(16, 16) and _sum(num_programs = 16, 16)
    kn = res["knorm"]
    assert (kn["CHUNK"], kn["TILE"], kn["HIST_TILE"]) == (1024, 64, 1024), kn
    assert kn["own"] == 16 and kn["hist0"] == 1, kn


_SMOKE = r'''
import json, os, sys
from benchmarks import kernel_stats as ks
import torch, tritonkv
from tritonkv.kernels import _common
out_dir = sys.argv[1]
names = ["knorm", "streaming_llm"]
rc = ks.main(["--smoke", "--out", out_dir, "--only", *names])
res = json.load(open(os.path.join(out_dir, "kernel_stats-triton-%s.json" % ks.triton.__version__)))
# an independent replay of the same calls: the Triton launches logged by record_launches
inp = ks.make_inputs(res["shape"]["N"])
replay = {}
for name in names:
    pol = tritonkv.POLICIES[name.split("+")[0]]()
    kw = ks.policy_inputs(pol, inp["pool"])
    if "+" in name:
        kw.update(allocation=name.split("+")[1], layer=15, num_layers=30)
    with _common.record_launches(execute=False) as log:
        with ks.gpu_like(ks.TorchOps(), readback=(8 * res["shape"]["kept_per_head"], res["shape"]["kept_per_head"])):
            tritonkv.compress((inp["keys"], inp["values"]), pol, ks.KEEP, **kw)
    replay[name] = [r.name for r in log]
# SnapKV + AdaKV, dry only (no compiles): its host read-back, and the launches of the same workload
ada = [w for w in ks.workloads(res["shape"]["N"], ["snapkv+adakv"])][0]
syncs = [o for o in ada["ops"] if o["kind"] == "sync"]
ada = dict(error=ada["error"], launches=len(ada["launches"]), syncs=[o["op"] for o in syncs],
           where=[o["where"] for o in syncs], readback=ada["readback"])
print(json.dumps(dict(rc=rc, replay=replay, triton=ks.triton.__version__, ada=ada)))
'''


def test_smoke_run(tmp_path):
    """``--smoke --only knorm streaming_llm``: per-version result files; every compiled kernel has registers,
    occupancy and its SASS parsed into loops (a radix histogram's loop holds shared atomics); the Triton
    launches of each workload are those of an independent ``record_launches`` replay, in order, interleaved
    with the torch-side ops; bytes and modelled times are positive; no host sync in these policies nor in
    SnapKV + AdaKV (dry run); the comparison Markdown renders."""
    res_run = _python(_SMOKE, tmp_path)
    assert res_run["rc"] == 0
    ver = res_run["triton"]
    res = json.loads((tmp_path / f"kernel_stats-triton-{ver}.json").read_text())
    assert res["triton"] == ver and res["archs"] == ["sm_90"] and not res["errors"]
    for k in res["kernels"]:
        st = k["archs"]["sm_90"]
        assert st["regs"] > 0 and 0 < st["occupancy"] <= 1 and st["ctas_per_sm"] >= 1, k["label"]
        # straight-line code and the loops' own instructions partition the kernel's SASS
        assert st["sass_n"] > 0 and st["sass_n"] == st["straight_n"] + sum(L["own_n"] for L in st["loops"]), k["label"]
        for op in ("ATOMS", "POPC", "BAR", "LDG"):
            assert st["sass"][op] == st["straight"][op] + sum(L["own"][op] for L in st["loops"]), (k["label"], op)
    # the score kernel and the select passes loop over their chunk; a radix histogram uses shared atomics
    assert sum(bool(k["archs"]["sm_90"]["loops"]) for k in res["kernels"]) >= 3
    assert any(L["own"]["ATOMS"] > 0 for k in res["kernels"] for L in k["archs"]["sm_90"]["loops"])
    work = {w["name"]: w for w in res["workloads"]}
    assert set(work) == set(res_run["replay"])
    for name, w in work.items():
        seq = w["sequence"]
        assert [x["kernel"] for x in seq if x["type"] == "triton"] == res_run["replay"][name], name
        assert w["triton_launches"] == len(res_run["replay"][name])
        assert w["launches"] == w["triton_launches"] + w["torch_launches"] == sum(
            x["type"] in ("triton", "torch") for x in seq)
        assert w["read_bytes"] > 0 and w["write_bytes"] > 0 and w["model_us"]["H200"] > 0
        assert w["model_us"]["H100"] >= w["model_us"]["H200"]  # less bandwidth
        for x in seq:
            if x["type"] == "triton":
                assert x["read"] + x["write"] > 0 and x["model"]["H200"]["us"] > 0 and x["grid"], (name, x)
    assert work["knorm"]["host_syncs"] == 0 and work["streaming_llm"]["host_syncs"] == 0
    ada = res_run["ada"]  # sized from host ints (H·b per batch row): nothing read back
    assert ada["error"] is None and ada["launches"] > 0 and not ada["syncs"] and not ada["readback"], ada
    # knorm's first kernel scores the keys: K counted as read, not written; its loops have trip counts
    kn = next(x for x in work["knorm"]["sequence"] if x["type"] == "triton")
    kbytes = res["shape"]["N"] * 8 * 128 * 2
    assert kbytes <= kn["read"] < 2 * kbytes and kn["write"] < kbytes, kn
    assert kn["loops"] and all(L["iterations"] for L in kn["loops"]), kn["loops"]
    md = (tmp_path / f"kernel_stats-triton-{ver}.md").read_text()
    assert "## SASS loops" in md and "| `_knorm_kernel` |" in md and "model H200 µs" in md
    assert "Against the H100 run of 2026-11-26" in md and "measured H200" not in md  # the model checked on a GPU
    # every kernel is compiled for sm_90 as launched there, with programmatic dependent launch, and waits first
    t = res["targets"]
    assert t["pdl_ok"] and t["pdl_kernels"] == len(res["kernels"]) and not t["pdl_early"], t
    assert all(k["archs"]["sm_90"]["pdl"]["ok"] for k in res["kernels"])
    # the comparison of two result files (here the same one twice)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH", "")]))
    f = str(tmp_path / f"kernel_stats-triton-{ver}.json")
    r = subprocess.run([sys.executable, "-m", "benchmarks.kernel_stats", "--compare", f, f, "--out",
                        str(tmp_path / "cmp.md")], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    cmp_md = (tmp_path / "cmp.md").read_text()
    assert f"Triton {ver} vs {ver}" in cmp_md and "## Hot loops" in cmp_md and "select.py:" in cmp_md
