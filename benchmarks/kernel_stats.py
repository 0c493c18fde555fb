"""Compile-time evidence for every Triton kernel of tritonkv, with no GPU: registers, spills, shared
memory, occupancy, fenced atomics, and launches and bytes per compress.

    python benchmarks/kernel_stats.py            # full run: N = 32768, sm_90 + sm_80 -> benchmarks/results/
    python benchmarks/kernel_stats.py --smoke    # N = 2048, sm_90 only (< 60 s), writes nothing unless --out

Target shape (``docs/architecture.md``, Benchmarks): B = 1, H_kv = 8, H_q = 32, D = 128, bf16 K/V, keep 25 %,
N = 32768; window queries W = 32 and W_O ``[4096, 4096]`` as in ``benchmarks/speed.py``.

**Which configurations.** The launchers choose block sizes from shapes alone, with a GPU branch and an
interpreter branch (``INTERPRET``). This program never turns the interpreter on (it drops
``TRITON_INTERPRET`` before triton is imported), so every launcher takes its GPU branch, exactly as on a
GPU. It routes CPU tensors to the Triton bodies (``_common._cpu``) and runs, at the target shape, each
policy's ``tritonkv.compress``, decode attention over a ``RaggedKV`` holding 25 % per head, and one ragged
append inside ``_common.record_launches(execute=False)``: every launch is logged (kernel, grid,
constexprs, launch options, arguments) and not run. Nothing downstream of a kernel reads its output to
decide shapes or launches (the library's contract: shapes depend on shapes and static budgets), so the
log is the launch sequence of a GPU run. The ragged cache for decoding is built by
``RaggedKV.from_selection`` (also dry) and then given its lengths (8192 per row).

**Compiling.** Each distinct launch configuration is compiled with ``triton.compile(ASTSource(...),
target=GPUTarget("cuda", cap, 32))`` (``tests/aot.py``'s pattern), with the signature, constexprs and
argument specialisation (``tt.divisibility`` 16, ints equal to 1 as constants) computed by Triton's own
JIT binder from the logged arguments, so the compiled code is the code a GPU launch would compile. From
it: registers and spill bytes from the ptxas log (``CompiledKernel.n_regs``/``n_spills`` need a CUDA
driver to load the binary), cross-checked against ``cuobjdump --dump-resource-usage``; shared memory,
num_warps and num_stages from ``k.metadata``; fenced atomics from the PTX (a global ``atom``/``red``
whose memory order is ``acq_rel``/``acquire``/``release``; ``tl.atomic_add``'s default ``sem`` is
``acq_rel``, ``sem="relaxed"`` gives ``red.global.gpu.relaxed``) and the ``MEMBAR`` instructions in the
SASS (an ``acq_rel`` atomic compiles to ``MEMBAR.ALL.GPU; ATOMG; CCTL.IVALL; MEMBAR.ALL.GPU``).
Stats are triton-version dependent: the JSON records the version (CPU CI: 3.9; the GPU image: 3.6).

**Occupancy** (``occupancy()``; CUDA occupancy calculator rules, H100 = sm_90 and A100 = sm_80 limits in
``ARCH``): registers per warp = ceil(regs·32 / 256)·256; CTAs/SM = min(⌊⌊65536 / regs per warp⌋ /
warps⌋, ⌊2048 / (32·warps)⌋, 32, ⌊smem per SM / (shared + 1 KB reserved)⌋); occupancy = CTAs·warps / 64.

**Launches and bytes per compress** come from the same log, not from hand counts:
- launches: the Triton launches (exact), plus the torch-side device operations seen by a
  ``TorchDispatchMode`` (fills, copies, arithmetic: one kernel or memset each on a GPU; views and
  ``empty`` allocations are not launches; allocations are counted apart). Host reads of device values
  (``item``, ``bool(t)``) are counted as syncs. Caveat: the run is on CPU tensors, so validation that
  the library does only for CPU inputs (``on_host()`` guards) shows up here and not on a GPU.
- bytes, an upper bound: per launch, the sizes of its distinct tensor arguments, as if every byte of
  every argument crossed HBM once (re-reads inside a launch assumed to hit L2; an argument a launch
  never touches, or touches in part, still counts whole). ``est. MB`` tightens one known gap: a kernel
  that gathers rows from a large tensor into a small one, or scatters them the other way
  (``TOUCHES_AT_MOST``), touches only that many rows of the large one, so it counts at the size of the
  small one. Torch-side ops count their outputs (fills) or inputs + outputs (the rest).

**Targets** (issue 16, reported, not fixed): no spills in any kernel; no kernel under 25 % occupancy on
sm_90 without a reason in ``LOW_OCCUPANCY_REASONS``; at most 6 launches per compress for the key-only
policies (keydiff, knorm, streaming_llm; checked on Triton launches and on all device launches); no
fenced atomics. The exit status is 0 when the program ran (targets missed are results, not errors) and 1
when a kernel failed to compile or a workload failed to run.

Outputs (full run): ``benchmarks/results/kernel_stats.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

# Compiled code, never the interpreter: the launchers must take their GPU branch.
os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the GPU image's default (3.6); 3.9 warns when unset

import torch  # noqa: E402
import triton  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402

import tritonkv  # noqa: E402
from tritonkv.kernels import _common  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")

# (B, H_kv, G, D, W), keep fraction, N
SHAPE = dict(B=1, H=8, G=4, D=128, W=32)
KEEP = 0.25
N_FULL, N_SMOKE = 32768, 2048
ARCHS_FULL, ARCHS_SMOKE = (90, 80), (90,)
KEY_ONLY = ("keydiff", "knorm", "streaming_llm")
MAX_LAUNCHES = 6
MIN_OCCUPANCY = 0.25

# Per-SM limits (CUDA occupancy calculator; H100 SXM and A100).
ARCH = {
    90: dict(gpu="H100", regs_per_sm=65536, reg_unit=256, max_threads=2048, max_ctas=32, max_warps=64,
             smem_per_sm=228 * 1024, smem_reserved_per_cta=1024),
    80: dict(gpu="A100", regs_per_sm=65536, reg_unit=256, max_threads=2048, max_ctas=32, max_warps=64,
             smem_per_sm=164 * 1024, smem_reserved_per_cta=1024),
}

# Kernels that move rows between a large tensor and a small one touch only those rows of the large
# one: {kernel: {argument: the argument whose size bounds what it touches}} (``est. MB``).
TOUCHES_AT_MOST = {
    "_select_compact_kernel": {"k_ptr": "ko_ptr", "v_ptr": "vo_ptr"},  # gathers the kept rows
    "_ragged_append_kernel": {"ko_ptr": "k_ptr", "vo_ptr": "v_ptr", "pos_ptr": "next_ptr"},  # one row per head
}

# Kernels allowed under 25 % occupancy on sm_90, and why. Only reasons that hold: a kernel missing
# here and under the bar is reported as a miss.
# Keys are kernel names; none is excused today (see the results for the kernels under the bar).
LOW_OCCUPANCY_REASONS: dict[str, str] = {}


# ---------------------------------------------------------------------------------------------
# running the library at the target shape, launches logged and not run


class TorchOps(TorchDispatchMode):
    """Logs the aten ops of the block, descending into tritonkv's custom ops (a mode sees a custom op
    whole; its Python body is run again under the mode so the fills and allocations inside show)."""

    META = {"view", "_unsafe_view", "reshape", "expand", "slice", "select", "as_strided", "unsqueeze",
            "squeeze", "permute", "t", "transpose", "alias", "detach", "split", "unbind", "narrow",
            "lift_fresh", "_reshape_alias", "diagonal", "unflatten", "flatten", "split_with_sizes",
            "view_as", "expand_as", "_to_copy_noop"}
    ALLOC = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
    FILL = {"zeros", "ones", "full", "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones",
            "new_full", "fill_", "zero_", "arange", "scalar_tensor"}
    SYNC = {"_local_scalar_dense", "is_nonzero", "item", "equal"}

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "tritonkv":
            from torch._library.custom_ops import OPDEFS

            opdef = OPDEFS.get(func._schema.name)
            if opdef is not None:
                with self:
                    return opdef._init_fn(*args, **kwargs)
        out = func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        kind = ("meta" if name in self.META else "alloc" if name in self.ALLOC else "fill" if name in self.FILL
                else "sync" if name in self.SYNC else "compute")
        if kind != "meta":
            ins = _tensors(args) + _tensors(kwargs)
            outs = _tensors(out)
            if kind == "alloc":
                nbytes = _nbytes(outs)
            elif kind == "fill":
                nbytes = _nbytes(outs or ins[:1])
            elif kind == "sync":
                nbytes = 0
            else:
                nbytes = _nbytes(ins + outs)
            self.ops.append(dict(op=str(func), kind=kind, bytes=nbytes,
                                 shapes=[list(t.shape) for t in (outs or ins)][:3]))
        return out


def _tensors(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


def _nbytes(ts) -> int:
    """Bytes of distinct tensors (same address and size counted once)."""
    seen = {}
    for t in ts:
        seen[(t.data_ptr(), t.numel() * t.element_size())] = t.numel() * t.element_size()
    return sum(seen.values())


@contextlib.contextmanager
def triton_on_cpu():
    """CPU tensors take the Triton bodies of the ops (only safe with launches not run)."""
    old, _common._cpu[0] = _common._cpu[0], "triton"
    try:
        yield
    finally:
        _common._cpu[0] = old


def make_inputs(N: int) -> dict:
    """K/V ``[B, H, N, D]`` bf16 (unwritten: nothing reads them), window queries ``[B, H·G, W, D]``,
    W_O ``[H·G·D, H·G·D]`` and SCORE's ``hd`` (positive), as in ``benchmarks/speed.py``."""
    B, H, G, D, W = (SHAPE[k] for k in "BHGDW")
    gen = torch.Generator().manual_seed(0)
    keys = torch.empty(B, H, N, D, dtype=torch.bfloat16)
    values = torch.empty(B, H, N, D, dtype=torch.bfloat16)
    queries = torch.randn(B, H * G, W, D, generator=gen).to(torch.bfloat16)
    o_proj = torch.empty(H * G * D, H * G * D, dtype=torch.bfloat16)
    hd = torch.rand(H, generator=gen) + 0.1
    return dict(keys=keys, values=values, pool=dict(queries=queries, o_proj=o_proj, hd=hd))


def dry(fn):
    """``(launches, torch ops, error)`` of ``fn()`` with launches logged and not run."""
    mode, log = TorchOps(), []
    try:
        with triton_on_cpu(), _common.record_launches(execute=False) as log, mode:
            fn()
    except Exception as e:  # reported per workload
        return list(log), mode.ops, f"{type(e).__name__}: {e}"
    return list(log), mode.ops, None


def workloads(N: int) -> list[dict]:
    """Every policy's compress at the target shape, then a decode step over the ragged cache."""
    inp = make_inputs(N)
    keys, values, pool = inp["keys"], inp["values"], inp["pool"]
    out = []
    variants = [(name, tritonkv.POLICIES[name]()) for name in sorted(tritonkv.POLICIES)]
    variants.append(("criticalkv_l2", tritonkv.POLICIES["criticalkv"](norm="l2")))  # its own norm kernel
    for name, pol in variants:
        missing = [n for n in pol.needs if n not in pool]
        if missing:
            out.append(dict(name=name, kind="compress", launches=[], ops=[], error=f"no input {missing}"))
            continue
        inputs = {n: pool[n] for n in pol.needs}
        log, ops, err = dry(lambda: tritonkv.compress((keys, values), pol, KEEP, **inputs))
        out.append(dict(name=name, kind="compress", launches=log, ops=ops, error=err))

    # decode step over a RaggedKV holding round(KEEP·N) tokens per row (+ the default slack)
    from tritonkv.cache import RaggedKV
    from tritonkv.kernels.decode_attention import decode_attention

    B, H, G, D = (SHAPE[k] for k in "BHGD")
    k = tritonkv.resolve_budget(KEEP, N)
    scores = torch.empty(B, H, N)
    holder = {}
    _, _, err = dry(lambda: holder.setdefault("kv", RaggedKV.from_selection(scores, k, keys, values,
                                                                            total=B * H * k, k_max=k)))
    if err is None:
        kv = holder["kv"]
        kv.length.fill_(k)
        q = torch.randn(B, H * G, 1, D).to(torch.bfloat16)
        k1 = torch.randn(B, H, 1, D).to(torch.bfloat16)
        v1 = torch.randn(B, H, 1, D).to(torch.bfloat16)
        for name, fn in (("decode_attention", lambda: decode_attention(q, kv)),
                         ("ragged_append", lambda: kv.append(k1, v1))):
            log, ops, e = dry(fn)
            out.append(dict(name=name, kind="decode", launches=log, ops=ops, error=e))
    else:
        out.append(dict(name="decode_attention", kind="decode", launches=[], ops=[], error=f"ragged build: {err}"))
    return out


# ---------------------------------------------------------------------------------------------
# compiling each distinct launch configuration


def _jit_key(rec) -> str:
    return f"{rec.kernel.fn.__module__}.{rec.name}"


def specialise(rec, cap: int):
    """``(target, signature, constexprs, attrs, options)`` of a logged launch, from Triton's own JIT
    binder (what ``kernel[grid](...)`` would compile on a GPU of capability ``cap``)."""
    from triton import knobs
    from triton.runtime.jit import create_function_from_signature

    kern = rec.kernel
    args = [rec.args[p.name] if p.name in rec.args else rec.constexprs[p.name] for p in kern.params]
    target = GPUTarget("cuda", cap, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kern.signature, kern.params, backend)
    kw = dict(rec.options, debug=bool(knobs.runtime.debug))
    for opt in ("instrumentation_mode", "fpsan_homomorphic_casts"):  # run() adds these in 3.9
        if hasattr(knobs.compilation, opt):
            kw[opt] = getattr(knobs.compilation, opt)
    bound, spec, opts = binder(*args, **kw)
    options, signature, constexprs, attrs = kern._pack_args(backend, kw, bound, spec, opts)
    return target, signature, constexprs, attrs, options


def config_key(rec) -> tuple[str, dict]:
    """One compiled variant (kernel, constexprs, options, argument specialisation), and the
    specialisation of each runtime argument: ``"=1"`` (compiled in as a constant), ``"%16"``
    (divisible by 16, or a 16-byte aligned pointer) or ``""``."""
    _, signature, constexprs, attrs, _ = specialise(rec, 90)
    names = [p.name for p in rec.kernel.params]
    spec = {}
    for i, n in enumerate(names):
        if n in rec.constexprs:
            continue
        if signature[n] == "constexpr":
            spec[n] = f"={rec.args[n]}"
        else:
            spec[n] = "%16" if any(a[0] == "tt.divisibility" for a in attrs.get((i,), [])) else ""
    key = json.dumps([_jit_key(rec), signature, sorted((str(k), repr(v)) for k, v in constexprs.items()),
                      sorted((str(k), repr(v)) for k, v in attrs.items()), sorted(rec.options.items())])
    return key, spec


def base_labels(recs) -> dict:
    """``{config key: label}``: the kernel name and the constexprs (and num_warps) that tell its
    configurations apart."""
    recs = list(recs)
    by_kernel = {}
    for rec in recs:
        by_kernel.setdefault(rec.name, []).append(rec)
    out = {}
    for rec in recs:
        same = by_kernel[rec.name]
        ks = [k for k in rec.constexprs if len({repr(r.constexprs.get(k)) for r in same}) > 1]
        parts = [f"{k}={_short(rec.constexprs[k])}" for k in ks]
        if len({repr(sorted(r.options.items())) for r in same}) > 1:
            parts.append(f"warps={rec.options.get('num_warps', 4)}")
        out[config_key(rec)[0]] = f"{rec.name}[{','.join(parts)}]" if parts else rec.name
    return out


ORDER = ("knorm", "keydiff", "lagkv", "window_attention", "critical", "select", "decode_attention", "cache")


def _order(rec):
    """Table order: scoring kernels, the select pipeline, then decoding (the source order within a file)."""
    mod = rec.kernel.fn.__module__.rsplit(".", 1)[-1]
    return (ORDER.index(mod) if mod in ORDER else len(ORDER), rec.kernel.fn.__code__.co_firstlineno)


def _stats_sig(st: dict) -> str:
    keep = ("regs", "spill_stores", "spill_loads", "smem", "num_warps", "num_stages", "fenced_atomics", "membar",
            "error")
    return json.dumps({a: {k: v.get(k) for k in keep} for a, v in st.items()}, sort_keys=True)


_PTXAS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_ATOM = re.compile(r"^\s*(?:@!?%\w+\s+)?(atom|red)\.([\w.]+)", re.M)
_FENCED = {"acq_rel", "acquire", "release", "sc", "seq_cst"}


def _tool(name: str) -> str | None:
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.path.exists(path) else shutil.which(name)


def compile_stats(rec, cap: int) -> dict:
    """Compile one logged launch for ``sm_<cap>`` and read its resources."""
    from triton import knobs

    target, signature, constexprs, attrs, options = specialise(rec, cap)
    log = io.StringIO()
    t0 = time.perf_counter()
    old = knobs.nvidia.dump_ptxas_log
    knobs.nvidia.dump_ptxas_log = True
    try:
        with contextlib.redirect_stdout(log):
            k = triton.compile(ASTSource(rec.kernel, signature, constexprs, attrs), target=target,
                               options=options.__dict__)
    finally:
        knobs.nvidia.dump_ptxas_log = old
    secs = time.perf_counter() - t0
    text = log.getvalue()
    m, r, s = _PTXAS.search(text), _REGS.search(text), _SMEM.search(text)
    if not (m and r):
        raise RuntimeError(f"no ptxas report for {rec.name} sm_{cap} (cached compile?):\n{text[-2000:]}")
    ptx = k.asm["ptx"]
    atoms = [dict(op=op, quals=q) for op, q in _ATOM.findall(ptx)]
    glob = [a for a in atoms if ".shared" not in "." + a["quals"] and not a["quals"].startswith("shared")]
    fenced = [a for a in glob if _FENCED & set(a["quals"].split("."))]
    sass, usage = _sass(k.asm["cubin"])
    meta = k.metadata
    shared = int(meta.shared) + (int(s.group(1)) if s else 0)
    st = dict(arch=f"sm_{cap}", regs=int(r.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)),
              stack=int(m.group(1)), smem=shared, num_warps=int(meta.num_warps), num_stages=int(meta.num_stages),
              global_atomics=len(glob), fenced_atomics=len(fenced),
              atomic_forms=sorted({f"{a['op']}.{a['quals']}" for a in glob}),
              membar=sass.get("MEMBAR", 0) if sass is not None else None,
              cuobjdump_regs=usage, compile_s=round(secs, 2))
    if usage is not None and usage != st["regs"]:
        raise RuntimeError(f"cuobjdump reports {usage} registers, the ptxas log {st['regs']}")
    st.update(occupancy(st["regs"], st["smem"], st["num_warps"], cap))
    return st


def _sass(cubin: bytes):
    """(instruction counts of interest in the SASS, registers from the resource usage) or Nones."""
    tool = _tool("cuobjdump")
    if tool is None:
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, timeout=120).stdout
        res = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                             timeout=120).stdout
    finally:
        os.unlink(f.name)
    counts = {}
    for ins in ("ATOMG", "REDG", "RED", "ATOMS", "CCTL"):
        counts[ins] = len(re.findall(rf"\b{ins}\b", sass))
    # device- or system-scope barriers (the fences of acq_rel atomics); MEMBAR.ALL.CTA with
    # FENCE.VIEW.ASYNC is the CTA-scope proxy fence of wgmma, unrelated to atomics
    counts["MEMBAR"] = len(re.findall(r"\bMEMBAR\.[\w.]*(?:GPU|SYS)\b", sass))
    reg = re.search(r"REG:(\d+)", res)
    return counts, (int(reg.group(1)) if reg else None)


def occupancy(regs: int, smem: int, warps: int, cap: int) -> dict:
    """Theoretical occupancy on one SM of ``ARCH[cap]`` (see the module docstring)."""
    a = ARCH[cap]
    regs_per_warp = math.ceil(max(regs, 1) * 32 / a["reg_unit"]) * a["reg_unit"]
    limits = {
        "registers": (a["regs_per_sm"] // regs_per_warp) // warps,
        "threads": a["max_threads"] // (32 * warps),
        "CTA slots": a["max_ctas"],
        "shared memory": a["smem_per_sm"] // (smem + a["smem_reserved_per_cta"]),
    }
    ctas = min(limits.values())
    limiter = min(limits, key=lambda k: (limits[k], k != "threads"))
    return dict(ctas_per_sm=ctas, occupancy=round(ctas * warps / a["max_warps"], 4), limiter=limiter)


# ---------------------------------------------------------------------------------------------
# launches and bytes


def launch_bytes(rec) -> tuple[int, int]:
    """(upper bound, estimate) in bytes of one launch's tensor arguments (see the module docstring)."""
    tens = {n: v for n, v in rec.args.items() if isinstance(v, torch.Tensor)}
    bound = _nbytes(tens.values())
    est = bound
    for arg, ref in TOUCHES_AT_MOST.get(rec.name, {}).items():
        if arg in tens and ref in tens:
            a = tens[arg].numel() * tens[arg].element_size()
            r = tens[ref].numel() * tens[ref].element_size()
            est -= a - min(a, r)
    return bound, est


def floor_bytes(name: str, N: int) -> int | None:
    """§7's HBM floor of a compress: read what scoring reads (K, K+V for lagkv/criticalkv, nothing for
    streaming_llm), re-read and write the kept K+V."""
    B, H, D = SHAPE["B"], SHAPE["H"], SHAPE["D"]
    k_bytes = B * H * N * D * 2
    kept = 2 * B * H * tritonkv.resolve_budget(KEEP, N) * D * 2
    reads = {"streaming_llm": 0, "lagkv": 2 * k_bytes, "criticalkv": 2 * k_bytes, "criticalkv_l2": 2 * k_bytes}.get(name, k_bytes)
    return reads + 2 * kept


def _short(v):
    return int(v) if isinstance(v, bool) else v


def _cfg(rec) -> str:
    parts = [f"{k}={_short(v)}" for k, v in rec.constexprs.items()]
    parts += [f"{k}={v}" for k, v in rec.options.items()]
    return " ".join(parts)


# ---------------------------------------------------------------------------------------------
# the run


def run(args) -> dict:
    t_start = time.perf_counter()
    N = args.n or (N_SMOKE if args.smoke else N_FULL)
    archs = tuple(args.arch) if args.arch else (ARCHS_SMOKE if args.smoke else ARCHS_FULL)
    cache = tempfile.mkdtemp(prefix="tritonkv-kernel-stats-")
    os.environ["TRITON_CACHE_DIR"] = cache  # a fresh cache: every compile runs ptxas (and logs it)
    try:
        from triton import knobs

        knobs.cache.dir = cache
    except Exception:
        pass
    try:
        return _run(args, N, archs, t_start)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def self_check() -> list[str]:
    """The occupancy arithmetic on cases worked by hand (H100)."""
    cases = [((255, 2048, 4), (2, 0.125, "registers")),  # 8192 regs/warp: 8 warps/SM
             ((32, 0, 4), (16, 1.0, "threads")),
             ((32, 100 * 1024, 4), (2, 0.125, "shared memory")),  # 233472 // (102400 + 1024)
             ((40, 0, 8), (6, 0.75, "registers"))]  # 1280 regs/warp: 51 warps -> 6 CTAs of 8
    bad = []
    for (regs, smem, warps), want in cases:
        o = occupancy(regs, smem, warps, 90)
        if (o["ctas_per_sm"], o["occupancy"], o["limiter"]) != want:
            bad.append(f"occupancy({regs}, {smem}, {warps}) = {o}, expected {want}")
    return bad


def _run(args, N: int, archs, t_start) -> dict:
    wls = workloads(N)
    errors = [f"{w['name']}: {w['error']}" for w in wls if w["error"]]
    errors += [f"self-check: {e}" for e in self_check()]

    # distinct compiles (kernel, constexprs, options, argument specialisation), in first-seen order
    configs, users, key_of, spec_of = {}, {}, {}, {}
    for w in wls:
        for rec in w["launches"]:
            key, spec = config_key(rec)
            key_of[id(rec)] = key
            if key not in configs:
                configs[key], users[key], spec_of[key] = rec, [], spec
            if w["name"] not in users[key]:
                users[key].append(w["name"])
    base = base_labels(configs.values())
    stats, first = {}, {}
    for key, rec in configs.items():
        if args.smoke and base[key] in first:  # smoke: one argument specialisation per configuration
            stats[key] = stats[first[base[key]]]
            continue
        first.setdefault(base[key], key)
        stats[key] = {}
        for cap in archs:
            arch = f"sm_{cap}"
            try:
                stats[key][arch] = compile_stats(rec, cap)
            except Exception as e:
                text = str(e).strip()
                msg = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:500]
                stats[key][arch] = dict(arch=arch, error=msg)
                errors.append(f"compile {base[key]} {arch}: {msg[:300]}")
            print(f"compiled {base[key]} {arch}: {stats[key][arch].get('regs', 'ERROR')} regs", file=sys.stderr)

    # one row per kernel configuration; argument specialisations with identical results are merged
    label_of, kernels = {}, []
    groups = {}
    for key in sorted(configs, key=lambda k: _order(configs[k])):
        groups.setdefault(base[key], []).append(key)
    for lab, keys in groups.items():
        buckets = {}
        for key in keys:
            buckets.setdefault(_stats_sig(stats[key]), []).append(key)
        vary = sorted({a for k in keys for a in spec_of[k] if len({spec_of[j].get(a) for j in keys}) > 1})
        for bkeys in buckets.values():
            rec = configs[bkeys[0]]
            name = lab
            if len(buckets) > 1:
                name += "{" + ",".join(f"{a}{spec_of[bkeys[0]].get(a) or ''}" for a in vary) + "}"
            for k in bkeys:
                label_of[k] = name
            used = []
            for k in bkeys:
                used += [u for u in users[k] if u not in used]
            kernels.append(dict(kernel=rec.name, label=name, module=rec.kernel.fn.__module__, config=_cfg(rec),
                                constexprs={k: _short(v) for k, v in rec.constexprs.items()},
                                options=dict(rec.options), grid=list(rec.grid), used_by=used,
                                specialisations=len(bkeys), archs=stats[bkeys[0]]))

    # kernels of the library that no workload launched
    jit = {}
    for mod in list(sys.modules.values()):
        mname = getattr(mod, "__name__", "") or ""
        if mname.startswith("tritonkv"):
            for attr, obj in list(vars(mod).items()):
                if isinstance(obj, triton.runtime.jit.JITFunction) and attr.endswith("_kernel"):
                    jit[f"{obj.fn.__module__}.{attr}"] = attr
    launched = {_jit_key(r) for r in configs.values()}
    not_launched = sorted(v for k, v in jit.items() if k not in launched)

    # per workload: launches and bytes
    rows = []
    for w in wls:
        tl_ = []
        for rec in w["launches"]:
            b, e = launch_bytes(rec)
            tl_.append(dict(kernel=label_of[key_of[id(rec)]], grid=list(rec.grid), bytes=b, est_bytes=e))
        ops = w["ops"]
        dev_ops = [o for o in ops if o["kind"] in ("fill", "compute")]
        row = dict(name=w["name"], kind=w["kind"], error=w["error"],
                   triton_launches=len(tl_), torch_launches=len(dev_ops),
                   launches=len(tl_) + len(dev_ops),
                   host_syncs=sum(o["kind"] == "sync" for o in ops),
                   allocations=sum(o["kind"] == "alloc" for o in ops),
                   alloc_bytes=sum(o["bytes"] for o in ops if o["kind"] == "alloc"),
                   triton_bytes=sum(x["bytes"] for x in tl_), triton_est_bytes=sum(x["est_bytes"] for x in tl_),
                   torch_bytes=sum(o["bytes"] for o in dev_ops),
                   floor_bytes=floor_bytes(w["name"], N) if w["kind"] == "compress" else None,
                   kernel_launches=tl_, torch_ops=ops)
        rows.append(row)

    targets = check_targets(kernels, rows, archs)
    if not_launched:
        targets["not_launched"] = not_launched
    import platform

    result = dict(
        program="benchmarks/kernel_stats.py", command=" ".join(["python", "benchmarks/kernel_stats.py"] +
                                                               [shlex.quote(a) for a in args.argv]),
        smoke=bool(args.smoke), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=_git("rev-parse", "--short", "HEAD"), dirty_kernels=bool(_git("status", "--porcelain", "tritonkv")),
        triton=triton.__version__, torch=torch.__version__, python=platform.python_version(),
        ptxas=_ptxas_version(), fp_fusion=os.environ.get("TRITON_DEFAULT_FP_FUSION"),
        shape=dict(SHAPE, N=N, H_q=SHAPE["H"] * SHAPE["G"], dtype="bfloat16", keep=KEEP,
                   kept_per_head=tritonkv.resolve_budget(KEEP, N)),
        archs=[f"sm_{c}" for c in archs], arch_limits={f"sm_{c}": ARCH[c] for c in archs},
        occupancy_formula=("regs_per_warp = ceil(regs*32/256)*256; CTAs/SM = min(floor(floor(65536/regs_per_warp)"
                           "/warps), floor(2048/(32*warps)), 32, floor(smem_per_SM/(shared+1024))); "
                           "occupancy = CTAs*warps/64"),
        bytes_rule=("per launch: sum of the sizes of its distinct tensor arguments (each byte assumed to cross "
                    "HBM once per launch; untouched or partly touched arguments count whole): an upper bound on "
                    "compulsory traffic. est: the large side of a gather/scatter (TOUCHES_AT_MOST) counted at the size of "
                    "the small side."),
        low_occupancy_reasons=LOW_OCCUPANCY_REASONS, kernels=kernels, workloads=rows, targets=targets,
        errors=errors, wall_s=round(time.perf_counter() - args.t0, 1))
    return result


def check_targets(kernels, rows, archs) -> dict:
    spills, low, low_ok, fenced = [], [], [], []
    for k in kernels:
        for arch, st in k["archs"].items():
            if "error" in st:
                continue
            if st["spill_stores"] or st["spill_loads"]:
                spills.append(dict(kernel=k["label"], arch=arch, spill_stores=st["spill_stores"],
                                   spill_loads=st["spill_loads"], regs=st["regs"], config=k["config"]))
            if st["fenced_atomics"] or st["membar"]:
                fenced.append(dict(kernel=k["label"], arch=arch, fenced_atomics=st["fenced_atomics"],
                                   membar=st["membar"], forms=st["atomic_forms"]))
        st = k["archs"].get("sm_90")
        if st and "error" not in st and st["occupancy"] < MIN_OCCUPANCY:
            item = dict(kernel=k["label"], occupancy=st["occupancy"], limiter=st["limiter"], regs=st["regs"],
                        smem=st["smem"], warps=st["num_warps"])
            if k["kernel"] in LOW_OCCUPANCY_REASONS:
                low_ok.append(dict(item, reason=LOW_OCCUPANCY_REASONS[k["kernel"]]))
            else:
                low.append(item)
    launches = []
    for r in rows:
        if r["name"] in KEY_ONLY:
            launches.append(dict(policy=r["name"], triton_launches=r["triton_launches"], all_launches=r["launches"],
                                 triton_ok=r["triton_launches"] <= MAX_LAUNCHES, all_ok=r["launches"] <= MAX_LAUNCHES))
    return dict(
        spills=spills, no_spills=not spills,
        low_occupancy=low, low_occupancy_with_reason=low_ok, occupancy_ok=not low,
        occupancy_checked_on="sm_90" if 90 in archs else None,
        launches=launches, launches_ok_triton=all(x["triton_ok"] for x in launches),
        launches_ok_all=all(x["all_ok"] for x in launches),
        fenced_atomics=fenced, no_fenced_atomics=not fenced)


def _git(*a) -> str | None:
    try:
        return subprocess.run(["git", *a], capture_output=True, text=True, cwd=ROOT, timeout=30).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _ptxas_version() -> str | None:
    tool = _tool("ptxas")
    if tool is None:
        return None
    out = subprocess.run([tool, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release ([\d.]+)", out)
    return m.group(1) if m else None


# ---------------------------------------------------------------------------------------------
# output


def _mb(b) -> str:
    return "—" if b is None else f"{b / 1e6:.1f}"


def _yes(ok: bool) -> str:
    return "met" if ok else "**missed**"


def markdown(res: dict) -> str:
    sh = res["shape"]
    out = [f"# Kernel statistics (compiled, no GPU)", "",
           f"Command: `{res['command']}`  ",
           f"triton {res['triton']} (ptxas {res['ptxas']}), torch {res['torch']}, commit {res['commit']}"
           f"{' (kernel files modified in the working tree)' if res['dirty_kernels'] else ''}, {res['date']}, "
           f"{res['wall_s']} s; FP fusion {res['fp_fusion']}.  ",
           f"Shape: B = {sh['B']}, H_kv = {sh['H']}, H_q = {sh['H_q']}, D = {sh['D']}, {sh['dtype']} K/V, N = {sh['N']}, "
           f"keep {sh['keep']:.0%} ({sh['kept_per_head']} per head), W = {sh['W']} window queries.  ",
           "Constexprs are the ones the launchers pick on a GPU at this shape (launches logged with "
           "`record_launches(execute=False)`, interpreter off); see the docstring of `benchmarks/kernel_stats.py`. "
           "Compiled with triton " + res["triton"] + "; the GPU image has triton 3.6, whose code may differ.", ""]
    t = res["targets"]
    out += ["## Issue 16 targets", "",
            f"- No spills in any kernel: {_yes(t['no_spills'])}"
            + ("" if t["no_spills"] else " — " + "; ".join(
                f"`{s['kernel']}` {s['arch']} ({s['spill_stores']} B stored / {s['spill_loads']} B loaded, "
                f"{s['regs']} regs)" for s in t["spills"])),
            f"- No kernel under {MIN_OCCUPANCY:.0%} occupancy (sm_90) without a reason: {_yes(t['occupancy_ok'])}"
            + ("" if t["occupancy_ok"] else " — " + "; ".join(
                f"`{x['kernel']}` {x['occupancy']:.1%} ({x['limiter']})" for x in t["low_occupancy"])),
            ]
    for x in t["low_occupancy_with_reason"]:
        out.append(f"  - under the bar with a reason: `{x['kernel']}` {x['occupancy']:.1%} — {x['reason']}")
    out += [f"- At most {MAX_LAUNCHES} launches per compress for {', '.join(KEY_ONLY)}: Triton launches "
            f"{_yes(t['launches_ok_triton'])}, all device launches {_yes(t['launches_ok_all'])} — "
            + "; ".join(f"{x['policy']} {x['triton_launches']} Triton / {x['all_launches']} all"
                        for x in t["launches"]),
            f"- No fenced atomics: {_yes(t['no_fenced_atomics'])}"
            + ("" if t["no_fenced_atomics"] else " — " + "; ".join(
                f"`{x['kernel']}` {x['arch']} ({x['fenced_atomics']} acq_rel atomics in PTX: "
                f"{', '.join(x['forms'])}; {x['membar']} MEMBAR in SASS)" for x in t["fenced_atomics"]))]
    if t.get("not_launched"):
        out.append(f"- Kernels no workload launched (not compiled here): {', '.join(t['not_launched'])}")
    if res["errors"]:
        out += ["", "**Errors:**", ""] + [f"- {e}" for e in res["errors"]]
    for arch in res["archs"]:
        lim = res["arch_limits"][arch]
        out += ["", f"## Kernels, {arch} (occupancy on an {lim['gpu']})", "",
                "| kernel | used by | grid | regs | spill st/ld B | smem B | warps | stages | CTAs/SM | occupancy | "
                "limited by | fenced atomics (PTX) | MEMBAR (SASS) |",
                "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
        for k in res["kernels"]:
            st = k["archs"].get(arch, {})
            used = ", ".join(k["used_by"]) if len(k["used_by"]) <= 3 else f"{len(k['used_by'])} workloads"
            grid = "×".join(str(g) for g in k["grid"])
            if "error" in st:
                out.append(f"| `{k['label']}` | {used} | {grid} | compile error: {st['error'][:120]} |||||||||||")
                continue
            occ = f"{st['occupancy']:.1%}"
            if arch == "sm_90" and st["occupancy"] < MIN_OCCUPANCY:
                occ = f"{occ} (reason)" if k["kernel"] in LOW_OCCUPANCY_REASONS else f"**{occ}**"
            spill = f"{st['spill_stores']}/{st['spill_loads']}"
            if st["spill_stores"] or st["spill_loads"]:
                spill = f"**{spill}**"
            fen = f"**{st['fenced_atomics']}**" if st["fenced_atomics"] else "0"
            mem = f"**{st['membar']}**" if st["membar"] else str(st["membar"])
            out.append(f"| `{k['label']}` | {used} | {grid} | {st['regs']} | {spill} | {st['smem']} | {st['num_warps']} | "
                       f"{st['num_stages']} | {st['ctas_per_sm']} | {occ} | {st['limiter']} | {fen} | {mem} |")
    out += ["", "Rows split by `{...}` are argument specialisations of one configuration that compile "
            "differently: `{arg%16}` the argument is divisible by 16 in those launches (Triton specialises "
            "on it), `{arg=1}` it equals 1 (compiled in), `{arg}` neither. Smem includes the software "
            "pipeline's buffers (num_stages).", "",
            "Configurations (constexprs and launch options as launched):", ""]
    for k in res["kernels"]:
        out.append(f"- `{k['label']}`: {k['config']}")
    out += ["", "## Launches and bytes per compress (and per decode step)", "",
            "| workload | Triton launches | torch-side device ops | all launches | host syncs | allocations (MB) | "
            "Triton MB (bound) | Triton MB (est.) | torch-side MB | floor MB (§7) | est. / floor |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["workloads"]:
        if r["error"]:
            out.append(f"| {r['name']} | error: {r['error'][:150]} ||||||||||")
            continue
        ratio = "—" if not r["floor_bytes"] else f"{(r['triton_est_bytes'] + r['torch_bytes']) / r['floor_bytes']:.2f}"
        out.append(f"| {r['name']} | {r['triton_launches']} | {r['torch_launches']} | {r['launches']} | {r['host_syncs']} | "
                   f"{r['allocations']} ({_mb(r['alloc_bytes'])}) | {_mb(r['triton_bytes'])} | {_mb(r['triton_est_bytes'])} | "
                   f"{_mb(r['torch_bytes'])} | {_mb(r['floor_bytes'])} | {ratio} |")
    out += ["", "Bytes: " + res["bytes_rule"] + " Torch-side ops: fills count their output, other ops inputs + "
            "outputs. Floor: `docs/architecture.md`, Benchmarks (read what scoring reads, re-read and write the kept "
            "K+V). The run is on CPU tensors: checks the library makes only on CPU inputs (e.g. SCORE's `hd`) "
            "appear as torch-side ops and syncs here and not on a GPU.", "",
            "Launch sequences:", ""]
    for r in res["workloads"]:
        seq = ", ".join(x["kernel"] for x in r["kernel_launches"])
        tops = ", ".join(o["op"].replace("aten.", "").replace(".default", "") for o in r["torch_ops"]
                         if o["kind"] in ("fill", "compute", "sync"))
        out.append(f"- {r['name']}: {seq or '—'}; torch-side: {tops or '—'}")
    out += ["", f"Occupancy: {res['occupancy_formula']} (smem per SM: "
            + ", ".join(f"{a} {res['arch_limits'][a]['smem_per_sm'] // 1024} KB" for a in res["archs"]) + ")."]
    return "\n".join(out) + "\n"


def write(res: dict, out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, "kernel_stats")
    with open(base + ".json", "w") as f:
        json.dump(res, f, indent=1, default=str)
        f.write("\n")
    with open(base + ".md", "w") as f:
        f.write(markdown(res))
    return [base + ".json", base + ".md"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help=f"N = {N_SMOKE}, sm_90 only, one argument specialisation per configuration; "
                        "writes nothing unless --out")
    p.add_argument("--out", help="output folder (default benchmarks/results for a full run)")
    p.add_argument("--n", type=int, help="sequence length N (default 32768, smoke 2048)")
    p.add_argument("--arch", type=int, nargs="*", choices=sorted(ARCH), help="compute capabilities (default 90 80)")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    args.argv, args.t0 = argv, time.perf_counter()
    torch.set_num_threads(1)
    res = run(args)
    out = args.out or (None if args.smoke else RESULTS)
    if out:
        for p in write(res, out):
            print("wrote", p)
    t = res["targets"]
    print(f"kernels {len(res['kernels'])}, workloads {len(res['workloads'])}, errors {len(res['errors'])}; "
          f"spills {'none' if t['no_spills'] else len(t['spills'])}, low occupancy {len(t['low_occupancy'])}, "
          f"launch target triton {t['launches_ok_triton']} / all {t['launches_ok_all']}, "
          f"fenced atomics {len(t['fenced_atomics'])}; {res['wall_s']} s")
    for e in res["errors"]:
        print("ERROR", e, file=sys.stderr)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
