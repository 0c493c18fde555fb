"""Host time of an eager ``tritonkv.compress``: every layer above the kernel launch, measured on the CPU.

On a GPU a small compress is host-bound: inside ``generate`` block-wise prefill calls it once per layer per
block, and its CUDA graph replays in 0.01-0.5 ms where the eager call used to cost 0.4-1.8 ms of Python. This
program measures that Python without a GPU:

* CPU tensors take the Triton branch of every op (``tritonkv.kernels._common._cpu = "triton"``, the
  interpreter off), so the launchers pick their GPU configurations;
* a fake Triton driver answers device 0, stream 0, target ``sm_90``, and the kernels that take one are launched
  with programmatic dependent launch, as on an sm_90 GPU;
* ``JITFunction._do_compile`` is replaced by a stub kernel that Triton caches like a compiled one, whose
  ``run`` (the C launcher and ``cuLaunchKernel``) does nothing.

So argument checks, policy and allocator code, ``torch.library`` dispatch where it is used, Triton's binder
(argument specialisation, cache key) and the torch allocations run for real; missing are the C launcher
(argument packing, a few µs per launch), the CUDA allocator and the device itself. Outputs of the
stubbed kernels are never written: nothing is checked, only timed (allocators that read values back, such as
AdaKV's two totals, read whatever the uninitialised buffers hold; the sizes below keep that harmless).

Each case runs ``--warmup`` calls, then ``--rounds`` rounds of ``--calls`` calls; the minimum over rounds of the
mean per call is reported (``host_us``), with a calibration: the time of a 1000-iteration empty Python loop on
the same core (about 15-25 µs on an idle modern core). From the second call of a case on, ``compress`` is repeated
from its plan (``tritonkv/kernels/_plan.py``): the warm-up records it, the rounds replay it. Allocations here are
CPU allocations (``malloc``, for the larger outputs ``mmap`` and page faults), dearer than the CUDA caching
allocator's. ``without_triton_run_us`` repeats the measurement with ``JITFunction.run`` itself stubbed: tritonkv's
own host time without Triton's per-launch binder and cache lookup, and without plans (a patched ``run`` keeps
calls off them), i.e. every layer of the call as it runs the first time a shape is seen. ``planned``: the share of
the timed calls repeated from a plan (``_plan.counts``). The cases ``speed ...`` are ``benchmarks/speed.py``'s own
calls (its policy objects, int budget, window LSE and allocation inputs, layer 15 of 30) at N = ``SPEED_N``; its
model-level tables (profile, CAKE's preferences, head means, SCORE's ``hd``) are host tensors here.

    python -m benchmarks.host_time                          # this checkout's tritonkv
    python -m benchmarks.host_time --compare <git ref> --json benchmarks/results/host_time.json
    python -m benchmarks.host_time --gpu --json $OUT/host_time_gpu.json   # on a GPU: the speed cases for real

``--compare REF`` also measures the ``tritonkv`` package of git revision ``REF`` (extracted to a temporary
directory, run in a subprocess with the same harness), interleaving the two so that a loaded machine affects
both alike. Run without ``TRITON_INTERPRET``. Needs torch and triton only.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import timeit

from benchmarks.common import ROOT, git, run_info, table, write_json

B, H, G, N, D, W = 1, 8, 4, 1024, 128, 32  # H_q = H·G = 32 window queries of W tokens; keep 25 %
KEEP = 0.25
# (case, policy name, inputs it gets, allocation): every dense policy, and SnapKV/KNorm with an allocator
CASES = [
    ("knorm", "knorm", (), None),
    ("keydiff", "keydiff", (), None),
    ("lagkv", "lagkv", (), None),
    ("streaming_llm", "streaming_llm", (), None),
    ("snapkv", "snapkv", ("queries", "attn_lse"), None),
    ("tova", "tova", ("queries", "attn_lse"), None),
    ("h2o", "h2o", ("queries", "attn_lse"), None),
    ("surfacelogic", "surfacelogic", ("queries",), None),
    ("criticalkv", "criticalkv", ("queries", "o_proj"), None),
    ("score", "score", ("queries", "hd"), None),
    ("knorm+pyramid", "knorm", ("layer", "num_layers"), "pyramid"),
    ("snapkv+adakv", "snapkv", ("queries", "attn_lse"), "adakv"),
    ("knorm+headkv", "knorm", ("layer", "profile"), "headkv"),
    ("knorm+surfacelogic", "knorm", ("layer", "profile"), "surfacelogic"),
    ("knorm+cake", "knorm", ("layer", "layer_preference"), "cake"),
    ("knorm+score", "knorm", ("layer", "head_means"), "score"),
    ("knorm+fixed", "knorm", ("layer",), "fixed"),  # a Fixed allocator of HeadKV budgets from the profile
]
# ``benchmarks/speed.py``'s own calls at N = SPEED_N (its shape is the one above): a policy object, an int budget,
# the window queries' LSE, the allocators as layer 15 of 30 with the inputs it builds (its ``allocation_case``)
SPEED_N = 4096
SPEED_DENSE = ["snapkv", "score"]
SPEED_ALLOCATIONS = ["uniform", "adakv", "headkv", "score", "surfacelogic", "cake", "fixed"]


def loop_us(reps: int = 200) -> float:
    """µs of a 1000-iteration empty Python loop (min over ``reps``): the machine's speed."""
    def loop():
        for _ in range(1000):
            pass
    return min(timeit.repeat(loop, number=1, repeat=reps)) * 1e6


def gpu_path_on_cpu(make_stub=None, stream: int = 0):
    """Route CPU tensors to the Triton bodies with a fake driver (device 0, ``stream``, target sm_90) and stub
    kernels (see the docstring): ``make_stub(key)`` builds the stub that Triton caches under ``key`` (default:
    one whose ``launch_metadata`` and ``run`` do nothing)."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from tritonkv.kernels import _common

    if _common.INTERPRET:
        raise SystemExit("run without TRITON_INTERPRET=1: the measurement needs Triton's JIT path")

    class FakeDriver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return stream

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    class StubKernel:  # what a compiled kernel offers JITFunction.run
        function = packed_metadata = None

        def launch_metadata(self, grid, stream, *args):
            return None

        def run(self, *args):
            return None

    make_stub = make_stub or (lambda key: StubKernel())

    def stub_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        kernel = self.device_caches[device][0][key] = make_stub(key)
        return kernel

    driver.set_active(FakeDriver())
    JITFunction._do_compile = stub_compile
    _common._cpu[0] = "triton"
    if hasattr(_common, "_PDL_DEVICES"):  # (a tree before it, under --compare, has none)
        _common._PDL_DEVICES[-1] = True  # CPU tensors launch as on an sm_90 GPU: with programmatic dependent launch


def make_inputs():
    import torch

    g = torch.Generator().manual_seed(0)
    keys = torch.randn(B, H, N, D, generator=g).to(torch.bfloat16)
    values = torch.randn(B, H, N, D, generator=g).to(torch.bfloat16)
    pool = dict(queries=torch.randn(B, H * G, W, D, generator=g).to(torch.bfloat16),
                attn_lse=torch.randn(B, H * G, W, generator=g),
                o_proj=torch.randn(H * G * D, H * G * D, generator=g).to(torch.bfloat16),
                hd=torch.rand(H, generator=g) + 0.1, layer=3, num_layers=8,
                profile=torch.rand(8, H, generator=g), layer_preference=torch.rand(8, generator=g) + 0.1)
    m = torch.rand(8, B, H * G, N, generator=g)  # every layer's head means (normalised mean attention rows)
    pool["head_means"] = m / torch.linalg.vector_norm(m, dim=-1, keepdim=True)
    return keys, values, pool


def fixed(pool):
    """A ``Fixed`` allocator object (a tensor attribute) of HeadKV budgets from ``pool``'s profile."""
    from tritonkv.allocation import Fixed, headkv_budgets

    return Fixed(budgets=headkv_budgets(pool["profile"], int(KEEP * N), N))


def speed_calls(device: str = "cpu"):
    """``[(case, call)]``: ``benchmarks/speed.py``'s calls of its compress and allocation parts at N = SPEED_N
    on ``device`` (on the CPU its model-level tables are small host tensors, on a GPU device tensors)."""
    import torch
    import tritonkv
    from benchmarks import speed
    from benchmarks.common import policy_inputs, random_case

    keys, values, pool = random_case(SPEED_N, B, H, G, D, W, torch.bfloat16, device)
    pool["attn_lse"] = speed.window_lse(keys, pool["queries"])
    k = tritonkv.resolve_budget(speed.KEEP, SPEED_N)
    ctx = argparse.Namespace(G=G)
    out = []
    for name in SPEED_DENSE:
        pol = tritonkv.POLICIES[name]()
        inputs = policy_inputs(pol, pool)
        out.append((f"speed {name}",
                    lambda pol=pol, inputs=inputs: tritonkv.compress((keys, values), pol, k, **inputs)))
    pol = tritonkv.POLICIES[speed.ALLOC_POLICY]()
    inputs = policy_inputs(pol, pool)
    for name in SPEED_ALLOCATIONS:
        alloc, extra, _, _ = speed.allocation_case(name, SPEED_N, k, pol, keys, ctx)
        out.append((f"speed {speed.ALLOC_POLICY}+{name}", lambda alloc=alloc, extra=extra: tritonkv.compress(
            (keys, values), pol, k, allocation=alloc, **inputs, **extra)))
    return out


def measure(calls: int, rounds: int, warmup: int, only=None) -> tuple[dict, dict]:
    """``({case: host µs per call}, {case: share of the timed calls repeated from a plan})`` for this process's
    tritonkv (the share is None where its ``_plan`` keeps no counts)."""
    gpu_path_on_cpu()
    import torch
    import tritonkv
    from tritonkv.kernels import _plan

    torch.set_num_threads(1)
    keys, values, pool = make_inputs()
    todo = []
    for case, name, needs, allocation in CASES:
        inputs = {n: pool[n] for n in needs}
        extra = {} if allocation is None else {"allocation": fixed(pool) if allocation == "fixed" else allocation}
        todo.append((case, lambda name=name, inputs=inputs, extra=extra: tritonkv.compress(
            (keys, values), name, KEEP, **extra, **inputs)))
    todo += speed_calls()
    counts = getattr(_plan, "counts", None)
    out, planned = {}, {}
    for case, call in todo:
        if only and case not in only:
            continue
        for _ in range(warmup):
            call()
        before = None if counts is None else counts["replayed"]
        t = min(timeit.repeat(call, number=calls, repeat=rounds)) / calls
        out[case] = round(t * 1e6, 1)
        planned[case] = None if counts is None else round((counts["replayed"] - before) / (calls * rounds), 2)
    return out, planned


def on_gpu(calls: int, warmup: int) -> dict:
    """``speed_calls`` on the GPU, without stubs: per case, the host µs of one eager call (``calls`` calls without
    a synchronisation, divided), the µs per call until the device is done, the share of those calls repeated from a
    plan and why the latest calls were not recorded (``_plan.why``)."""
    import time

    import torch
    from tritonkv.kernels import _plan

    out = {}
    with torch.no_grad():
        for case, call in speed_calls("cuda"):
            failed = _plan.counts["not recorded"]
            for _ in range(warmup):  # the first call runs, the second is recorded
                call()
            torch.cuda.synchronize()
            failed = _plan.counts["not recorded"] - failed
            before = _plan.counts["replayed"]
            t0 = time.perf_counter()
            for _ in range(calls):
                call()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            out[case] = dict(host_us=round((t1 - t0) / calls * 1e6, 1), done_us=round((t2 - t0) / calls * 1e6, 1),
                             planned=round((_plan.counts["replayed"] - before) / calls, 2),
                             why=list(_plan.why)[-failed:] if failed else [])
            print(case, json.dumps(out[case]), flush=True)
    return out


def _worker(args) -> None:
    host, planned = measure(args.calls, args.rounds, args.warmup, args.only)
    from triton.runtime.jit import JITFunction

    JITFunction.run = lambda self, *a, grid, warmup, **k: None  # Triton's launch path (binder, cache key) off
    own, _ = measure(args.calls, args.rounds, args.warmup, args.only)
    json.dump(dict(host_us=host, without_triton_run_us=own, planned=planned, loop_us=round(loop_us(), 1)),
              sys.stdout)


def _run_tree(tree: str, args) -> dict:
    """One worker process on ``tree``'s tritonkv (first on the path; this checkout's ``benchmarks`` after it)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, ROOT]), OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "benchmarks.host_time", "--worker", "--calls", str(args.calls), "--rounds",
           str(args.rounds), "--warmup", str(args.warmup)] + (["--only", *args.only] if args.only else [])
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree)
    if r.returncode:
        raise SystemExit(f"host_time worker for {tree} failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=30, help="calls per round")
    ap.add_argument("--rounds", type=int, default=7, help="rounds (the minimum mean is reported)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="worker runs per tree, interleaved (min is kept)")
    ap.add_argument("--compare", metavar="REF", help="also measure the tritonkv of this git revision (before)")
    ap.add_argument("--only", nargs="*", help="cases to run")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--md", help="write the table here (Markdown)")
    ap.add_argument("--gpu", action="store_true",
                    help="on a GPU, no stubs: the speed cases' host and device-done µs per call, planned share")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return _worker(args)
    if args.gpu:
        res = dict(run_info(True), speed_N=SPEED_N, calls=args.calls, cases=on_gpu(args.calls, args.warmup))
        if args.json:
            write_json(args.json, res)
        return
    trees = {"after": (ROOT, git("rev-parse", "HEAD"))}
    with tempfile.TemporaryDirectory() as tmp:
        if args.compare:
            sha = git("rev-parse", "--verify", args.compare + "^{commit}")
            if not sha:
                raise SystemExit(f"--compare: no git revision {args.compare!r}")
            subprocess.run(f"git archive {sha} tritonkv | tar -x -C {tmp}", shell=True, cwd=ROOT, check=True)
            trees = {"before": (tmp, sha), **trees}
        runs = {k: [] for k in trees}
        for _ in range(args.repeats):
            for k, (tree, _sha) in trees.items():
                runs[k].append(_run_tree(tree, args))
    res = {}
    for k, rs in runs.items():
        res[k] = dict(commit=trees[k][1], loop_us=min(r["loop_us"] for r in rs),
                      **{m: {c: min(r[m][c] for r in rs) for c in rs[0][m]}
                         for m in ("host_us", "without_triton_run_us")},
                      planned=rs[-1]["planned"])
    cases = list(res["after"]["host_us"])
    cols = [(k, m) for m in ("host_us", "without_triton_run_us") for k in res]
    print(f"{'case':<26}" + "".join(f"{k + (' -run' if m != 'host_us' else ''):>14}" for k, m in cols)
          + ("  after/before" if "before" in res else "") + "  planned")
    for c in cases:
        row = "".join(f"{res[k][m][c]:>14.1f}" for k, m in cols)
        if "before" in res:
            row += f"  {res['after']['host_us'][c] / res['before']['host_us'][c]:>12.2f}"
        print(f"{c:<26}{row}  {res['after']['planned'][c]:>7.2f}")
    print("calibration, 1000-iteration Python loop (us): "
          + ", ".join(f"{k} {v['loop_us']}" for k, v in res.items()))
    info = run_info()
    if args.md:
        write_md(args.md, res, info["command"], info)
    if args.json:
        write_json(args.json, dict(
            what="host time per eager tritonkv.compress, GPU path driven on the CPU with stub launches "
                 "(benchmarks/host_time.py docstring)",
            shape=dict(B=B, H_kv=H, H_q=H * G, N=N, D=D, W=W, dtype="bfloat16", keep=KEEP),
            machine=dict({k: info[k] for k in ("cpu", "cores")}, load_average=[round(x, 2) for x in os.getloadavg()],
                         **{k: info[k] for k in ("python", "torch", "triton")}),
            date=info["date"], command=info["command"],
            settings=dict(calls=args.calls, rounds=args.rounds, warmup=args.warmup, repeats=args.repeats), **res))


def write_md(path: str, res: dict, command: str, info: dict) -> None:
    """The table of ``res`` as Markdown (host µs per call, before/after when both were measured); ``info``:
    ``run_info()``."""
    trees = list(res)
    head = ["case"] + [f"{k} µs" for k in trees] + [f"{k} µs without Triton's run()" for k in trees]
    if "before" in res:
        head.append("after / before")
    head.append("after: share repeated from a plan")
    rows = []
    for c in res["after"]["host_us"]:
        row = [c] + [f"{res[k]['host_us'][c]:.0f}" for k in trees]
        row += [f"{res[k]['without_triton_run_us'][c]:.0f}" for k in trees]
        if "before" in res:
            row.append(f"{res['after']['host_us'][c] / res['before']['host_us'][c]:.2f}")
        row.append(f"{res['after']['planned'][c]:.2f}")
        rows.append(row)
    lines = table(rows, None, head)
    calib = ", ".join(f"{k} {v['loop_us']} µs" for k, v in res.items())
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    commits = ", ".join(f"{k} `{v['commit'][:7]}`" for k, v in res.items())
    text = f"""# Host time per eager `compress` (GPU path driven on a CPU, launches stubbed)

Command: `{command}` (without `TRITON_INTERPRET`). Trees: {commits}. Method, shape and what is left out: the
docstring of `benchmarks/host_time.py` (B = {B}, H_kv = {H}, H_q = {H * G}, N = {N}, D = {D}, W = {W}, bf16,
keep {KEEP:.0%}; minimum over rounds and interleaved worker runs of the mean per call). Cases `speed ...`:
`benchmarks/speed.py`'s own calls (policy objects, an int budget, `attn_lse`, allocators as layer 15 of 30 with
the inputs it builds) at N = {SPEED_N}.

{chr(10).join(lines)}

Machine: {info['cpu']}, {info['cores']} CPU cores, load average {load} at the end of the run (1, 5, 15
min). Calibration: a 1000-iteration empty Python loop took {calib} (minimum; an idle modern core: 15-25 µs).
"""
    with open(path, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
