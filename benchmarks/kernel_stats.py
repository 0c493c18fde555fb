"""Compile-time evidence for every Triton kernel of tritonkv, with no GPU, per Triton version: registers,
spills, shared memory, occupancy, the SASS of each hot loop, and per policy the device launches in order,
their bytes, host syncs and a simple time model.

    python -m benchmarks.kernel_stats              # N = 32768, sm_90 + sm_80 -> results/kernel_stats-triton-<v>.*
    python -m benchmarks.kernel_stats --smoke      # N = 2048, sm_90 only (< 60 s), writes nothing unless --out
    python -m benchmarks.kernel_stats --compare A.json B.json --out results/kernel_stats.md
    make stats                                     # Triton 3.6 (side environment) and the installed one + comparison

The method (target shape, which Triton, launches, host syncs, compiling, SASS loops, occupancy, bytes per
launch, time model) is in docs/benchmarks.md, "kernel_stats.py: method". The exit status is 1 when a kernel failed
to compile or a workload failed.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import inspect
import io
import json
import math
import operator
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback

# Compiled code, never the interpreter: the launchers must take their GPU branch.
os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the GPU image's default (3.6); 3.9 warns when unset

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402

import tritonkv  # noqa: E402
from benchmarks.common import RESULTS, ROOT, command, git, now, policy_inputs, table, write_results  # noqa: E402
from tritonkv.kernels import _common  # noqa: E402

SPEED_JSON = os.path.join(RESULTS, "nvidia-h200-speed.json")

# (B, H_kv, G, D, W), keep fraction, N
SHAPE = dict(B=1, H=8, G=4, D=128, W=32)
KEEP = 0.25
N_FULL, N_SMOKE = 32768, 2048
ARCHS_FULL, ARCHS_SMOKE = (90, 80), (90,)
KEY_ONLY = ("keydiff", "knorm", "streaming_llm")
MAX_LAUNCHES = 6
MIN_OCCUPANCY = 0.25
ALLOCATED = {"snapkv+adakv": ("snapkv", "adakv")}  # workload: (policy, allocator), as benchmarks/speed.py
LAYER, NUM_LAYERS = 15, 30

# Per-SM limits (CUDA occupancy calculator; H100 SXM and A100).
_SM = dict(regs_per_sm=65536, reg_unit=256, max_threads=2048, max_ctas=32, max_warps=64)
ARCH = {90: dict(gpu="H100", **_SM, smem_per_sm=228 * 1024, smem_reserved_per_cta=1024),
        80: dict(gpu="A100", **_SM, smem_per_sm=164 * 1024, smem_reserved_per_cta=1024)}

# Time model (sm_90 SASS). copy_GBps: measured device-to-device copy bandwidth (H200: results/nvidia-h200-
# speed.json; H100 SXM: ~2.9 TB/s); SMs and boost clock from the data sheets; issue: warp instructions per
# SM per clock (4 schedulers); launch_us: cost of one dependent launch in a CUDA graph (launch + tail).
MACHINES = {m: dict(copy_GBps=bw, sms=132, clock_GHz=1.98, issue_per_clk=4, launch_us=3.0)
            for m, bw in (("H100", 2900.0), ("H200", 4226.0))}
ATOMS_WAVEFRONTS = 32  # shared-memory wavefronts per ATOMS instruction (worst case: 32-way bank conflict)
MODEL_ARCH = "sm_90"

# Kernels that move rows between a large tensor and a small one touch only those rows of the large
# one: {kernel: {argument: the argument whose size bounds what it touches}}. A renamed kernel falls back
# to the whole-tensor rule (an upper bound).
TOUCHES_AT_MOST = {
    "_select_compact_kernel": {"k_ptr": "ko_ptr", "v_ptr": "vo_ptr"},  # gathers the kept rows
    "_ragged_append_kernel": {"ko_ptr": "k_ptr", "vo_ptr": "v_ptr", "pos_ptr": "next_ptr"},  # one row per head
}

# SASS instructions counted per loop and per kernel (by mnemonic, before the first '.').
SASS_OPS = ("ATOMS", "ATOMG", "RED", "REDG", "POPC", "VOTE", "BAR", "SHFL", "LDG", "STG", "LDS", "STS", "LDGSTS",
            "HGMMA", "HMMA", "MUFU", "MEMBAR")
LOOP_OPS = ("ATOMS", "POPC", "VOTE", "BAR")  # the loop columns of the kernel tables

# Kernels allowed under 25 % occupancy on sm_90, and why (none is excused today).
LOW_OCCUPANCY_REASONS: dict[str, str] = {}


# ---------------------------------------------------------------------------------------------
# running the library at the target shape, launches logged and not run


def _caller() -> str | None:
    """``file:line`` of the innermost tritonkv frame on the stack (where a sync was made)."""
    for fr in reversed(traceback.extract_stack()[:-2]):
        if "tritonkv" + os.sep in fr.filename and "_common.py" not in fr.filename:
            return f"{os.path.relpath(fr.filename, ROOT)}:{fr.lineno}"
    return None


class TorchOps(TorchDispatchMode):
    """Logs the aten ops of the block in order with the Triton launches (``at``: how many Triton launches
    came before), descending into tritonkv's custom ops (a mode sees a custom op whole; its Python body is
    run again under the mode so the fills and allocations inside show). Allocations are zero-filled."""

    META = set("view _unsafe_view reshape expand slice select as_strided unsqueeze squeeze permute t transpose alias "
               "detach split unbind narrow lift_fresh _reshape_alias diagonal unflatten flatten split_with_sizes "
               "view_as expand_as _to_copy_noop unsqueeze_ squeeze_ as_strided_ set_".split())
    ALLOC = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
    FILL = set("zeros ones full zeros_like ones_like full_like new_zeros new_ones new_full fill_ zero_ arange "
               "scalar_tensor linspace".split())
    # a host read of device values, or an output shape that depends on them (the host waits for the device)
    SYNC = set("_local_scalar_dense is_nonzero item equal nonzero masked_select unique _unique _unique2 "
               "unique_consecutive unique_dim argwhere nonzero_static_ repeat_interleave _assert_async".split())

    def __init__(self, inputs=()):
        super().__init__()
        self.ops, self.launches = [], []
        self.from_inputs = {t.data_ptr() for t in inputs}  # storage computed from small inputs only

    def input_only(self, ts) -> bool:
        """Whether the tensors ``ts`` derive only from the workload's small inputs (not K/V, not kernel
        outputs): a check of such a value reads the host when the caller passes the input there."""
        return bool(ts) and all(t.data_ptr() in self.from_inputs for t in ts)

    def note(self, op: str, kind: str, nbytes: int = 0, read: int = 0, write: int = 0, **kw):
        self.ops.append(dict(op=op, kind=kind, bytes=nbytes, read=read, write=write, at=len(self.launches), **kw))

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
        kinds = (("meta", self.META), ("alloc", self.ALLOC), ("fill", self.FILL), ("sync", self.SYNC))
        kind = next((k for k, names in kinds if name in names), "compute")
        if name == "repeat_interleave" and (kwargs.get("output_size") is not None or "int" in func._overloadname):
            kind = "compute"  # integer repeats, or the output size given: no read-back
        if kind == "meta":
            return out
        ins, outs = _tensors(args) + _tensors(kwargs), _tensors(out)
        shapes = [list(t.shape) for t in (outs or ins)][:3]
        if kind == "alloc":
            for t in outs:
                t.zero_()  # outside the log: nothing downstream reads unwritten memory
            self.note(str(func), kind, _nbytes(outs), shapes=shapes)
            return out
        read = 0 if kind == "fill" else _nbytes(ins)
        write = _nbytes(outs or ins[:1]) if kind != "sync" else 0
        only = kind != "fill" and self.input_only(ins)
        if only:
            self.from_inputs.update(t.data_ptr() for t in outs)
        if kind == "sync" and only:
            kind = "input_check"
        self.note(str(func), kind, read + write, read, write, shapes=shapes,
                  **({"where": _caller()} if kind in ("sync", "input_check") else {}))
        return out


def _tensors(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    items = x.values() if isinstance(x, dict) else x if isinstance(x, (list, tuple)) else ()
    return [t for v in items for t in _tensors(v)]


def _nbytes(ts) -> int:
    """Bytes of distinct tensors (same address and size counted once)."""
    return sum({(t.data_ptr(), t.numel() * t.element_size()): t.numel() * t.element_size() for t in ts}.values())


def _tritonkv_modules() -> list:
    return [m for m in list(sys.modules.values()) if (getattr(m, "__name__", "") or "").startswith("tritonkv")]


@contextlib.contextmanager
def gpu_like(mode: TorchOps, readback=None):
    """Inside the block: CPU tensors take the Triton bodies of the ops (only safe with launches not run),
    ``on_host`` is False in every tritonkv module (validation of host tensors is skipped, as for CUDA
    tensors) and ``Tensor.tolist`` logs a host sync; an integer read-back returns ``readback`` when given
    (what a real run reads; the dry run's memory is unwritten)."""
    patched = [(m, m.on_host) for m in _tritonkv_modules() if callable(getattr(m, "on_host", None))]
    tolist, cpu = torch.Tensor.tolist, _common._cpu[0]

    def logged_tolist(t):
        real = tolist(t)
        if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
            return real
        swap = readback is not None and not t.is_floating_point() and t.numel() == len(readback)
        mode.note("Tensor.tolist", "input_check" if mode.input_only([t]) else "sync", shapes=[list(t.shape)],
                  where=_caller(), **({"replaced": [real, list(readback)]} if swap else {}))
        return list(readback) if swap else real

    for m, _ in patched:
        m.on_host = lambda t: False
    torch.Tensor.tolist, _common._cpu[0] = logged_tolist, "triton"
    try:
        yield
    finally:
        torch.Tensor.tolist, _common._cpu[0] = tolist, cpu
        for m, f in patched:
            m.on_host = f


def dry(fn, readback=None, inputs=()):
    """``(launches, torch ops, error)`` of ``fn()`` with launches logged and not run; ``inputs``: the small
    input tensors (host checks of values derived from them only are ``input_check``s, not syncs)."""
    log, mode = [], TorchOps(inputs=inputs)
    try:
        with _common.record_launches(execute=False) as log:
            mode.launches = log
            with gpu_like(mode, readback), mode:
                fn()
    except Exception as e:  # reported per workload
        return list(log), mode.ops, f"{type(e).__name__}: {e}"
    return list(log), mode.ops, None


def make_inputs(N: int) -> dict:
    """K/V ``[B, H, N, D]`` bf16 (unwritten: nothing reads them), window queries ``[B, H·G, W, D]``, their
    ``attn_lse`` ``[B, H·G, W]``, W_O ``[H·G·D, H·G·D]`` and SCORE's ``hd`` (positive), as in ``speed.py``."""
    B, H, G, D, W = (SHAPE[k] for k in "BHGDW")
    gen = torch.Generator().manual_seed(0)
    keys = torch.empty(B, H, N, D, dtype=torch.bfloat16)
    values = torch.empty(B, H, N, D, dtype=torch.bfloat16)
    queries = torch.randn(B, H * G, W, D, generator=gen).to(torch.bfloat16)
    o_proj = torch.empty(H * G * D, H * G * D, dtype=torch.bfloat16)
    hd = torch.rand(H, generator=gen) + 0.1
    lse = torch.zeros(B, H * G, W)
    return dict(keys=keys, values=values, pool=dict(queries=queries, o_proj=o_proj, hd=hd, attn_lse=lse))


def workloads(N: int, only=None) -> list[dict]:
    """Every policy's compress at the target shape, SnapKV + AdaKV, then a decode step over the ragged cache
    (``only``: the names of the workloads to run; default all)."""
    from tritonkv.cache import RaggedKV
    from tritonkv.kernels.decode_attention import decode_attention

    inp = make_inputs(N)
    keys, values, pool = inp["keys"], inp["values"], inp["pool"]
    B, H, G, D = (SHAPE[k] for k in "BHGD")
    k = tritonkv.resolve_budget(KEEP, N)
    cases = [(name, tritonkv.POLICIES[name](), {}) for name in sorted(tritonkv.POLICIES)]
    cases.append(("criticalkv_l2", tritonkv.POLICIES["criticalkv"](norm="l2"), {}))  # its own norm kernel
    cases += [(name, tritonkv.POLICIES[p](), dict(allocation=a, layer=LAYER, num_layers=NUM_LAYERS))
              for name, (p, a) in ALLOCATED.items()]
    out = []
    for name, pol, alloc in [c for c in cases if not only or c[0] in only]:
        inputs = policy_inputs(pol, pool)
        rb = (B * H * k, k) if alloc else None  # an allocator's total and, standing in for its longest row, k
        log, ops, err = dry(lambda: tritonkv.compress((keys, values), pol, KEEP, **alloc, **inputs), readback=rb,
                            inputs=_tensors(inputs))
        read = any(o["kind"] == "sync" and o["op"] == "Tensor.tolist" for o in ops)
        out.append(dict(name=name, kind="allocation" if alloc else "compress", launches=log, ops=ops, error=err,
                        inputs=sorted(inputs), readback=list(rb) if rb and read else None))

    # decode step over a RaggedKV holding round(KEEP·N) tokens per row (+ the default slack)
    decode = [x for x in ("decode_attention", "ragged_append") if not only or x in only]
    if not decode:
        return out
    holder = {}
    _, _, err = dry(lambda: holder.setdefault("kv", RaggedKV.from_selection(torch.empty(B, H, N), k, keys, values,
                                                                            total=B * H * k, k_max=k)))
    if err is not None:
        return out + [dict(name="decode_attention", kind="decode", launches=[], ops=[], error=f"ragged build: {err}")]
    kv = holder["kv"]
    kv.length.fill_(k)
    q = torch.randn(B, H * G, 1, D).to(torch.bfloat16)
    k1, v1 = (torch.randn(B, H, 1, D).to(torch.bfloat16) for _ in range(2))
    fns = dict(decode_attention=lambda: decode_attention(q, kv), ragged_append=lambda: kv.append(k1, v1))
    for name in decode:
        log, ops, err = dry(fns[name])
        out.append(dict(name=name, kind="decode", launches=log, ops=ops, error=err))
    return out


# ---------------------------------------------------------------------------------------------
# compiling each distinct launch configuration


def _jit_key(rec) -> str:
    return f"{rec.kernel.fn.__module__}.{rec.name}"


def specialise(rec, cap: int):
    """``(target, signature, constexprs, attrs, options)`` of a logged launch, from Triton's own JIT
    binder (what ``kernel[grid](...)`` would compile on a GPU of capability ``cap``)."""
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
    spec = {}
    for i, p in enumerate(rec.kernel.params):
        if p.name in rec.constexprs:
            continue
        if signature[p.name] == "constexpr":
            spec[p.name] = f"={rec.args[p.name]}"
        else:
            spec[p.name] = "%16" if any(a[0] == "tt.divisibility" for a in attrs.get((i,), [])) else ""
    key = json.dumps([_jit_key(rec), signature, sorted((str(k), repr(v)) for k, v in constexprs.items()),
                      sorted((str(k), repr(v)) for k, v in attrs.items()), sorted(rec.options.items())])
    return key, spec


def base_labels(recs) -> dict:
    """``{config key: label}``: the kernel name and the constexprs (and num_warps) that tell its
    configurations apart."""
    recs = list(recs)
    out = {}
    for rec in recs:
        same = [r for r in recs if r.name == rec.name]
        parts = [f"{k}={_short(v)}" for k, v in rec.constexprs.items()
                 if len({repr(r.constexprs.get(k)) for r in same}) > 1]
        if len({repr(sorted(r.options.items())) for r in same}) > 1:
            parts.append(f"warps={rec.options.get('num_warps', 4)}")
        out[config_key(rec)[0]] = f"{rec.name}[{','.join(parts)}]" if parts else rec.name
    return out


ORDER = ("knorm", "keydiff", "lagkv", "window_attention", "critical", "score", "select", "decode_attention", "cache")


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
    target, signature, constexprs, attrs, options = specialise(rec, cap)
    log = io.StringIO()
    t0 = time.perf_counter()
    old, knobs.nvidia.dump_ptxas_log = knobs.nvidia.dump_ptxas_log, True
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
    atoms = [dict(op=op, quals=q) for op, q in _ATOM.findall(k.asm["ptx"])]
    glob = [a for a in atoms if ".shared" not in "." + a["quals"] and not a["quals"].startswith("shared")]
    fenced = [a for a in glob if _FENCED & set(a["quals"].split("."))]
    sass, usage = _sass(k.asm["cubin"])
    ins = parse_sass(sass) if sass else []
    loops = sass_loops(ins)
    outside = {a for L in loops if L["parent"] is None for a in range(L["lo"], L["hi"] + 1, 16)}
    straight = [x for x in ins if x["addr"] not in outside]
    meta = k.metadata
    st = dict(arch=f"sm_{cap}", regs=int(r.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)),
              stack=int(m.group(1)), smem=int(meta.shared) + (int(s.group(1)) if s else 0),
              num_warps=int(meta.num_warps), num_stages=int(meta.num_stages),
              global_atomics=len(glob), fenced_atomics=len(fenced),
              atomic_forms=sorted({f"{a['op']}.{a['quals']}" for a in glob}),
              membar=_counts(ins)["MEMBAR_GPU"] if sass else None, sass_n=len(ins), sass=_counts(ins),
              straight_n=len(straight), straight=_counts(straight), loops=loops,
              cuobjdump_regs=usage, compile_s=round(secs, 2))
    if usage is not None and usage != st["regs"]:
        raise RuntimeError(f"cuobjdump reports {usage} registers, the ptxas log {st['regs']}")
    st.update(occupancy(st["regs"], st["smem"], st["num_warps"], cap))
    return st


def _sass(cubin: bytes):
    """``(SASS text with line info, registers from the resource usage)``; Nones without the tools."""
    dis, dump = _tool("nvdisasm"), _tool("cuobjdump")
    if dis is None:
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([dis, "-g", "-c", f.name], capture_output=True, text=True, timeout=120).stdout
        res = subprocess.run([dump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                             timeout=120).stdout if dump else ""
    reg = re.search(r"REG:(\d+)", res)
    return sass, (int(reg.group(1)) if reg else None)


_LINE = re.compile(r'## File "(.*?)", line (\d+)')
_INS = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRA = re.compile(r"^(?:@!?U?P\w+\s+)?BRA\b.*`\((\.L_x_\d+)\)")


def parse_sass(sass: str) -> list[dict]:
    """Instructions ``{addr, text, op, file, line}`` (``op``: the mnemonic before the first '.') and, on each
    backward ``BRA``, ``back`` = its target."""
    ins, labels, pending, loc = [], {}, [], (None, None)
    for raw in sass.splitlines():
        if m := _LINE.search(raw):
            loc = (m.group(1), int(m.group(2)))
        elif m := _LABEL.match(raw):
            pending.append(m.group(1))
        elif m := _INS.match(raw):
            addr = int(m.group(1), 16)
            labels.update(dict.fromkeys(pending, addr))
            pending = []
            op = re.sub(r"^@!?U?P\w+\s+", "", m.group(2)).split()[0].split(".")[0]
            ins.append(dict(addr=addr, text=m.group(2), op=op, file=loc[0], line=loc[1]))
    for x in ins:
        m = _BRA.match(x["text"])
        if m and labels.get(m.group(1), 1 << 62) < x["addr"]:
            x["back"] = labels[m.group(1)]
    return ins


def _counts(ins) -> dict:
    c = {op: sum(x["op"] == op for x in ins) for op in SASS_OPS}
    c["MEMBAR_GPU"] = sum(bool(re.search(r"\bMEMBAR\.[\w.]*(?:GPU|SYS)\b", x["text"])) for x in ins)
    return c


def sass_loops(ins: list[dict]) -> list[dict]:
    """The loops of a kernel's SASS, outermost first: a loop is a backward ``BRA``, its body the address range;
    loops nest by range. Each: address range, the source line of the closing branch, parent, depth,
    instruction count and op counts, all and ``own`` (inner loops excluded)."""
    loops = []
    for x in ins:
        if "back" in x:
            body = [y for y in ins if x["back"] <= y["addr"] <= x["addr"]]
            loops.append(dict(lo=x["back"], hi=x["addr"], file=x["file"], line=x["line"], n=len(body), body=body))
    loops.sort(key=lambda L: (L["lo"], -L["hi"]))
    for i, L in enumerate(loops):
        enclosing = [j for j, P in enumerate(loops) if j != i and P["lo"] <= L["lo"] and L["hi"] <= P["hi"]
                     and (P["lo"], P["hi"]) != (L["lo"], L["hi"])]
        L["parent"] = min(enclosing, key=lambda j: loops[j]["hi"] - loops[j]["lo"]) if enclosing else None
    for i, L in enumerate(loops):
        depth, p = 0, L["parent"]
        while p is not None:
            depth, p = depth + 1, loops[p]["parent"]
        inner = {a for C in loops if C["parent"] == i for a in range(C["lo"], C["hi"] + 1, 16)}
        own = [y for y in L["body"] if y["addr"] not in inner]
        L.update(depth=depth, own_n=len(own), counts=_counts(L["body"]), own=_counts(own))
    for L in loops:
        del L["body"]
        L["where"] = f"{os.path.basename(L['file'] or '?')}:{L['line']}"
    return loops


def occupancy(regs: int, smem: int, warps: int, cap: int) -> dict:
    """Theoretical occupancy on one SM of ``ARCH[cap]`` (the CUDA occupancy calculator's arithmetic)."""
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
# source analysis: trip counts of loops and which pointers a kernel loads/stores


@functools.lru_cache(maxsize=None)
def _fors(path: str) -> dict:
    """``{line: (For node, enclosing FunctionDef)}`` of the source file at ``path`` (``{}`` if unreadable)."""
    try:
        with open(path) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, TypeError):
        return {}
    out = {}
    for fn in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
        for node in [n for n in ast.walk(fn) if isinstance(n, ast.For)]:
            out.setdefault(node.lineno, (node, fn))
    return out


class _Unknown(Exception):
    pass


_FUNCS = {"cdiv": lambda a, b: -(-a // b), "minimum": min, "maximum": max, "min": min, "max": max,
          "int": int, "abs": abs, "next_power_of_2": lambda n: 1 << max(int(n) - 1, 0).bit_length()}
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Div: operator.truediv, ast.Mod: operator.mod, ast.LShift: operator.lshift, ast.RShift: operator.rshift}
_EVAL_ERRORS = (_Unknown, ZeroDivisionError, TypeError, IndexError)


def _name(f) -> str | None:
    """The name a call's function goes by (``tl.load`` -> ``load``)."""
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _eval(node, env: dict, grid):
    """A small evaluator for ``range`` bounds: names from ``env``, arithmetic, ``tl.program_id(a)`` = the
    middle program of axis ``a``, ``tl.num_programs(a)``, ``cdiv``/``minimum``/``maximum``, ``x.to(...)``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, bool)):
        return node.value
    if isinstance(node, ast.Name):
        if node.id in env and isinstance(env[node.id], (int, float, bool)):
            return env[node.id]
        raise _Unknown(node.id)
    if isinstance(node, ast.BinOp):
        a, b = _eval(node.left, env, grid), _eval(node.right, env, grid)
        if type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](a, b)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand, env, grid)
    if isinstance(node, ast.Call):
        name = _name(node.func)
        if name == "to" and isinstance(node.func, ast.Attribute):
            return _eval(node.func.value, env, grid)
        if name in ("program_id", "num_programs"):
            axis = _eval(node.args[0], env, grid) if node.args else 0
            size = grid[axis] if axis < len(grid) else 1
            return size // 2 if name == "program_id" else size
        if name in _FUNCS:
            return _FUNCS[name](*[_eval(a, env, grid) for a in node.args])
    raise _Unknown(ast.dump(node)[:60])


def trip_count(path: str, line: int, rec) -> int | None:
    """Iterations of the source loop ``for ... in range(...)`` at ``path:line`` for launch ``rec``: the launch's
    arguments, locals assigned before the loop evaluated in order (None: not a ``range`` loop, or its bounds
    depend on values not known before the launch, such as bounds read from memory)."""
    loop, fn = _fors(path).get(line, (None, None))
    if loop is None or not isinstance(loop.iter, ast.Call) or _name(loop.iter.func) not in ("range", "static_range"):
        return None
    env = {k: v for k, v in {**rec.args, **rec.constexprs}.items() if isinstance(v, (int, float, bool))}
    grid = tuple(rec.grid) if not callable(rec.grid) else (1,)
    for node in ast.walk(fn):  # locals assigned before the loop, in source order
        if isinstance(node, ast.Assign) and node.lineno < line and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            try:
                env[node.targets[0].id] = _eval(node.value, env, grid)
            except _EVAL_ERRORS:
                env.pop(node.targets[0].id, None)
    try:
        a = [_eval(x, env, grid) for x in loop.iter.args]
    except _EVAL_ERRORS:
        return None
    start, stop, step = (0, a[0], 1) if len(a) == 1 else (a[0], a[1], a[2] if len(a) > 2 else 1)
    return max(0, -(-(stop - start) // step)) if step > 0 else None


def loop_iterations(loops: list[dict], rec) -> list[int | None]:
    """Iterations per program of each SASS loop: its source trip count × its parent's iterations."""
    out = [None] * len(loops)
    for i, L in enumerate(loops):  # parents come first (sorted by address, outermost first)
        t = trip_count(L["file"], L["line"], rec)
        out[i] = None if t is None else t * (1 if L["parent"] is None else (out[L["parent"]] or 1))
    return out


# calls through which a pointer stays a pointer (any other call's result is a value, not a pointer)
_PTR_CALLS = {"make_block_ptr", "make_tensor_descriptor", "advance", "multiple_of", "max_contiguous", "to",
              "cast", "where", "broadcast_to", "reshape", "expand_dims", "view"}


@functools.lru_cache(maxsize=None)
def _access(fn) -> dict:
    """``{parameter: {"r", "w"}}`` for the pointer parameters of the ``@triton.jit`` function ``fn`` (its
    Python function): ``tl.load`` reads, ``tl.store`` writes, ``tl.atomic_*`` both, ``.load``/``.store`` of
    a block pointer or descriptor likewise, following assignments and calls to other ``@triton.jit``
    functions."""
    try:
        fdef = next(n for n in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(fn))))
                    if isinstance(n, ast.FunctionDef))
    except (OSError, TypeError, SyntaxError):
        return {}
    params = [a.arg for a in fdef.args.args]
    alias = {p: {p} for p in params}  # variable -> the parameters its value derives from

    def roots(node) -> set:
        """The parameters a pointer expression derives from."""
        if isinstance(node, ast.Name):
            return set(alias.get(node.id, ()))
        if not isinstance(node, ast.Call):
            return set().union(*[roots(c) for c in ast.iter_child_nodes(node)])
        f, name = node.func, _name(node.func)
        if name not in _PTR_CALLS:
            return set()
        if name in ("to", "advance") and isinstance(f, ast.Attribute):
            return roots(f.value) | (roots(node.args[0]) if name == "advance" and node.args else set())
        return set().union(*[roots(a) for a in node.args], *[roots(k.value) for k in node.keywords])

    for _ in range(4):  # fixpoint over assignments
        for node in ast.walk(fdef):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and node.value is not None:
                r = roots(node.value)
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name) and r:
                            alias.setdefault(n.id, set()).update(r)
    acc: dict = {}

    def mark(node, kinds):
        for p in roots(node):
            acc.setdefault(p, set()).update(kinds)

    g = getattr(fn, "__globals__", {})
    for node in [n for n in ast.walk(fdef) if isinstance(n, ast.Call)]:
        f, name = node.func, _name(node.func)
        first = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "pointer"), None)
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "tl" and first is not None:
            kinds = {"r"} if name == "load" else {"w"} if name == "store" else {"r", "w"}
            if name in ("load", "store") or name.startswith("atomic_"):
                mark(first, kinds)
        elif isinstance(f, ast.Attribute) and name in ("load", "store"):  # block pointer / tensor descriptor
            mark(f.value, {"r"} if name == "load" else {"w"})
        elif isinstance(f, ast.Name) and isinstance(g.get(f.id), triton.runtime.jit.JITFunction):
            callee = g[f.id].fn
            sub, cparams = _access(callee), list(inspect.signature(callee).parameters)
            for p, a in [*zip(cparams, node.args), *((kw.arg, kw.value) for kw in node.keywords)]:
                if p in sub:
                    mark(a, sub[p])
    return {p: acc[p] for p in params if p in acc}  # in parameter order: the same on every run


def pointer_access(kernel) -> dict:
    """``{argument: "r" | "w" | "rw"}`` of a ``@triton.jit`` kernel's pointer arguments (from its source)."""
    return {p: "".join(sorted(k, key="rw".index)) for p, k in _access(getattr(kernel, "fn", kernel)).items()}


# ---------------------------------------------------------------------------------------------
# launches, bytes and the time model


def launch_bytes(rec) -> dict:
    """``{read, write, unknown}`` bytes of one Triton launch: a tensor argument counts once as read if the
    kernel loads through it, once as written if it stores (``TOUCHES_AT_MOST`` bounds a gather/scatter's
    large tensor); ``unknown`` lists tensor arguments the kernel neither loads nor stores through (read)."""
    acc = pointer_access(rec.kernel)
    tens = {n: v for n, v in rec.args.items() if isinstance(v, torch.Tensor)}
    size = {n: t.numel() * t.element_size() for n, t in tens.items()}
    for arg, ref in TOUCHES_AT_MOST.get(rec.name, {}).items():
        if arg in size and ref in size:
            size[arg] = min(size[arg], size[ref])
    seen_r, seen_w = {}, {}
    for n, t in tens.items():
        key, mode = (t.data_ptr(), t.numel() * t.element_size()), acc.get(n, "")
        if "r" in mode or not mode:
            seen_r[key] = max(seen_r.get(key, 0), size[n])
        if "w" in mode:
            seen_w[key] = max(seen_w.get(key, 0), size[n])
    return dict(read=sum(seen_r.values()), write=sum(seen_w.values()), unknown=[n for n in tens if not acc.get(n)])


def _times(nbytes: int, warp_instructions: int = 0, atoms_warp: int = 0) -> dict:
    """Per machine: modelled µs of one launch = launch cost + max(bytes part, issue part + shared atomics)."""
    out = {}
    for mname, m in MACHINES.items():
        clk = m["sms"] * m["clock_GHz"] * 1e3  # SM-clocks per µs
        t_bytes = nbytes / (m["copy_GBps"] * 1e3)
        t_issue = warp_instructions / (clk * m["issue_per_clk"])
        t_atoms = atoms_warp * ATOMS_WAVEFRONTS / clk
        out[mname] = dict(us=round(m["launch_us"] + max(t_bytes, t_issue + t_atoms), 2), bytes_us=round(t_bytes, 2),
                          issue_us=round(t_issue, 2), atoms_us=round(t_atoms, 2))
    return out


def launch_model(st: dict | None, rec, nbytes: int) -> dict:
    """Per machine: the modelled µs of one Triton launch (bytes, issue, atoms) from its sm_90 stats: the
    loops' own instructions × their iterations per program, straight-line code once, × warps × programs."""
    st = st or {}
    programs = math.prod(tuple(rec.grid) if not callable(rec.grid) else (1,))
    warps = st.get("num_warps", rec.options.get("num_warps", 4))
    iters = loop_iterations(st["loops"], rec) if "loops" in st else []
    instr, atoms = st.get("straight_n", 0), st.get("straight", {}).get("ATOMS", 0)
    for L, it in zip(st.get("loops", []), iters):
        instr += L["own_n"] * (it or 1)
        atoms += L["own"]["ATOMS"] * (it or 1)
    out = dict(programs=programs, loop_iterations=iters, warp_instructions=instr * warps * programs,
               atoms_warp=atoms * warps * programs)
    return dict(out, **_times(nbytes, out["warp_instructions"], out["atoms_warp"]))


def floor_bytes(name: str, N: int) -> int | None:
    """The HBM floor of a compress: read what scoring reads (K, K+V for lagkv/criticalkv, nothing for
    streaming_llm), re-read and write the kept K+V."""
    B, H, D = SHAPE["B"], SHAPE["H"], SHAPE["D"]
    k_bytes = B * H * N * D * 2
    kept = 2 * B * H * tritonkv.resolve_budget(KEEP, N) * D * 2
    reads = {"streaming_llm": 0, "lagkv": 2 * k_bytes, "criticalkv": 2 * k_bytes,
             "criticalkv_l2": 2 * k_bytes}.get(name.split("+")[0], k_bytes)
    return reads + 2 * kept


def measured_h200(N: int) -> dict:
    """``{workload: (µs, timing)}`` at N from results/nvidia-h200-speed.json (compress rows, and the
    allocation rows as ``policy+allocator``)."""
    try:
        with open(SPEED_JSON) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    out = {}
    for r in data.get("rows", []):
        if r.get("N") != N or r.get("tritonkv_us") is None:
            continue
        if r.get("kind") == "compress":
            out[r["policy"]] = dict(us=r["tritonkv_us"], timing=r.get("timing"), eager_us=r.get("tritonkv_eager_us"))
        elif r.get("kind") == "allocation":
            out[f"{r['policy']}+{r['allocation']}"] = dict(us=r["tritonkv_us"], timing=r.get("timing"))
    meta = {k: data.get(k) for k in ("device", "triton", "torch", "commit", "copy_GBps")}
    return dict(out, _meta=meta)


def _short(v):
    return int(v) if isinstance(v, bool) else v


# ---------------------------------------------------------------------------------------------
# the run


def run(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="tritonkv-kernel-stats-", ignore_cleanup_errors=True) as cache:
        os.environ["TRITON_CACHE_DIR"] = knobs.cache.dir = cache  # a fresh cache: every compile runs ptxas (logged)
        return _run(args, N_SMOKE if args.smoke else N_FULL, ARCHS_SMOKE if args.smoke else ARCHS_FULL)


def library_kernels() -> dict:
    """``{module.name: name}`` of every ``@triton.jit`` kernel (a ``_kernel`` suffix: a function that is
    launched, not a helper) defined in the imported tritonkv modules."""
    return {f"{m.__name__}.{attr}": attr for m in _tritonkv_modules() for attr, obj in list(vars(m).items())
            if isinstance(obj, triton.runtime.jit.JITFunction) and obj.fn.__module__ == m.__name__
            and attr.endswith("_kernel")}


def _compile(rec, cap: int, label: str, errors: list) -> dict:
    """``compile_stats``, or ``{arch, error}`` with the error added to ``errors``."""
    try:
        st = compile_stats(rec, cap)
    except Exception as e:
        text = str(e).strip()
        msg = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:500]
        st = dict(arch=f"sm_{cap}", error=msg)
        errors.append(f"compile {label} sm_{cap}: {msg[:300]}")
    print(f"compiled {label} sm_{cap}: {st.get('regs', 'ERROR')} regs", file=sys.stderr)
    return st


def kernel_rows(configs: dict, users: dict, spec_of: dict, stats: dict, base: dict):
    """``(kernels, label_of)``: one row per kernel configuration, in table order; argument specialisations
    with identical results share a row (labelled ``{arg%16}``, ``{arg=1}`` or ``{arg}`` where they differ)."""
    label_of, kernels, groups = {}, [], {}
    for key in sorted(configs, key=lambda k: _order(configs[k])):
        groups.setdefault(base[key], []).append(key)
    for lab, keys in groups.items():
        buckets = {}
        for key in keys:
            buckets.setdefault(_stats_sig(stats[key]), []).append(key)
        vary = sorted({a for k in keys for a in spec_of[k] if len({spec_of[j].get(a) for j in keys}) > 1})
        for bkeys in buckets.values():
            rec, spec = configs[bkeys[0]], spec_of[bkeys[0]]
            name = lab + ("{" + ",".join(f"{a}{spec.get(a) or ''}" for a in vary) + "}" if len(buckets) > 1 else "")
            label_of.update(dict.fromkeys(bkeys, name))
            kernels.append(dict(kernel=rec.name, label=name, module=rec.kernel.fn.__module__,
                                config=" ".join([f"{k}={_short(v)}" for k, v in rec.constexprs.items()]
                                                + [f"{k}={v}" for k, v in rec.options.items()]),
                                constexprs={k: _short(v) for k, v in rec.constexprs.items()},
                                options=dict(rec.options), grid=list(rec.grid),
                                used_by=list(dict.fromkeys(u for k in bkeys for u in users[k])),
                                specialisations=len(bkeys), access=pointer_access(rec.kernel),
                                archs=stats[bkeys[0]]))
    return kernels, label_of


def _op_entry(o: dict) -> dict:
    """A torch-side op of a launch sequence: a device launch (fill, compute), or a sync / input check."""
    dev = o["kind"] in ("fill", "compute")
    return dict(type="torch" if dev else o["kind"], name=o["op"].replace("aten.", "").replace(".default", ""),
                kind=o["kind"], read=o["read"], write=o["write"], shapes=o.get("shapes"), where=o.get("where"),
                model=_times(o["read"] + o["write"]) if dev else None)


def _launch_entry(rec, label: str, st: dict | None) -> dict:
    """A Triton launch of a launch sequence: bytes, the iterations of its SASS loops and modelled time."""
    b = launch_bytes(rec)
    mdl = launch_model(st, rec, b["read"] + b["write"])
    return dict(type="triton", name=label, kernel=rec.name, grid=list(rec.grid), read=b["read"], write=b["write"],
                unknown_args=b["unknown"],
                loops=[dict(where=L["where"], depth=L["depth"], own_n=L["own_n"], ATOMS=L["own"]["ATOMS"],
                            iterations=it) for L, it in zip(st["loops"] if st else [], mdl["loop_iterations"])],
                model={m: mdl[m] for m in MACHINES}, warp_instructions=mdl["warp_instructions"],
                atoms_warp=mdl["atoms_warp"])


def workload_row(w: dict, seq: list, N: int, ms: dict | None) -> dict:
    """A workload's totals over its launch sequence ``seq``: launches, syncs, bytes, modelled time and the
    measured H200 time ``ms``."""
    dev = [x for x in seq if x["type"] in ("triton", "torch")]
    model = {m: round(sum(x["model"][m]["us"] for x in dev), 1) for m in MACHINES}
    return dict(name=w["name"], kind=w["kind"], error=w["error"], inputs=w.get("inputs"), readback=w.get("readback"),
                triton_launches=sum(x["type"] == "triton" for x in seq),
                torch_launches=sum(x["type"] == "torch" for x in seq),
                launches=len(dev), host_syncs=sum(x["type"] == "sync" for x in seq),
                sync_sites=sorted({x["where"] or "?" for x in seq if x["type"] == "sync"}),
                input_checks=sorted({x["where"] or "?" for x in seq if x["type"] == "input_check"}),
                allocations=sum(o["kind"] == "alloc" for o in w["ops"]),
                alloc_bytes=sum(o["bytes"] for o in w["ops"] if o["kind"] == "alloc"),
                read_bytes=sum(x["read"] for x in dev), write_bytes=sum(x["write"] for x in dev),
                floor_bytes=floor_bytes(w["name"], N) if w["kind"] != "decode" else None,
                model_us=model, measured_h200=ms,
                model_over_measured=round(model["H200"] / ms["us"], 3) if ms else None,
                sequence=seq)


def _run(args, N: int, archs) -> dict:
    wls = workloads(N, args.only)
    errors = [f"{w['name']}: {w['error']}" for w in wls if w["error"]]

    # distinct compiles (kernel, constexprs, options, argument specialisation), in first-seen order
    configs, users, key_of, spec_of = {}, {}, {}, {}
    for w in wls:
        for rec in w["launches"]:
            key, spec = config_key(rec)
            key_of[id(rec)] = key
            configs.setdefault(key, rec)
            spec_of.setdefault(key, spec)
            if w["name"] not in users.setdefault(key, []):
                users[key].append(w["name"])
    base = base_labels(configs.values())
    stats, first = {}, {}
    for key, rec in configs.items():
        if args.smoke and base[key] in first:  # smoke: one argument specialisation per configuration
            stats[key] = stats[first[base[key]]]
        else:
            first.setdefault(base[key], key)
            stats[key] = {f"sm_{cap}": _compile(rec, cap, base[key], errors) for cap in archs}
    kernels, label_of = kernel_rows(configs, users, spec_of, stats, base)
    launched = {_jit_key(r) for r in configs.values()}
    not_launched = sorted(v for k, v in library_kernels().items() if k not in launched)

    # per workload: device launches in order (Triton and torch-side), bytes, syncs, modelled time
    meas, rows = measured_h200(N), []
    for w in wls:
        recs, seq = w["launches"], []
        ops = [o for o in w["ops"] if o["kind"] in ("fill", "compute", "sync", "input_check")]
        for i in range(len(recs) + 1):
            seq += [_op_entry(o) for o in ops if o["at"] == i]
            if i < len(recs):
                key = key_of[id(recs[i])]
                st = stats[key].get(MODEL_ARCH)
                seq.append(_launch_entry(recs[i], label_of[key], st if st and "error" not in st else None))
        rows.append(workload_row(w, seq, N, meas.get(w["name"])))

    targets = check_targets(kernels, rows, archs)
    if not_launched:
        targets["not_launched"] = not_launched
    return dict(
        program="benchmarks/kernel_stats.py", command=command(args.argv, "benchmarks.kernel_stats"),
        smoke=bool(args.smoke), date=now(), commit=git("rev-parse", "--short", "HEAD") or None,
        dirty_kernels=bool(git("status", "--porcelain", "tritonkv")),
        triton=triton.__version__, triton_path=os.path.dirname(triton.__file__), torch=torch.__version__,
        python=platform.python_version(), ptxas=_ptxas_version(), fp_fusion=os.environ.get("TRITON_DEFAULT_FP_FUSION"),
        shape=dict(SHAPE, N=N, H_q=SHAPE["H"] * SHAPE["G"], dtype="bfloat16", keep=KEEP,
                   kept_per_head=tritonkv.resolve_budget(KEEP, N)),
        archs=[f"sm_{c}" for c in archs], arch_limits={f"sm_{c}": ARCH[c] for c in archs},
        machines=MACHINES, atoms_wavefronts=ATOMS_WAVEFRONTS, model_arch=MODEL_ARCH,
        measured=meas.get("_meta"),
        occupancy_formula=("regs_per_warp = ceil(regs*32/256)*256; CTAs/SM = min(floor(floor(65536/regs_per_warp)"
                           "/warps), floor(2048/(32*warps)), 32, floor(smem_per_SM/(shared+1024))); "
                           "occupancy = CTAs*warps/64"),
        low_occupancy_reasons=LOW_OCCUPANCY_REASONS, kernels=kernels, workloads=rows, targets=targets,
        errors=errors, wall_s=round(time.perf_counter() - args.t0, 1))


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
    launches = [dict(policy=r["name"], triton_launches=r["triton_launches"], all_launches=r["launches"],
                     triton_ok=r["triton_launches"] <= MAX_LAUNCHES, all_ok=r["launches"] <= MAX_LAUNCHES)
                for r in rows if r["name"] in KEY_ONLY]
    syncs = [dict(workload=r["name"], syncs=r["host_syncs"], where=r["sync_sites"]) for r in rows if r["host_syncs"]]
    return dict(
        spills=spills, no_spills=not spills,
        low_occupancy=low, low_occupancy_with_reason=low_ok, occupancy_ok=not low,
        occupancy_checked_on="sm_90" if 90 in archs else None,
        launches=launches, launches_ok_triton=all(x["triton_ok"] for x in launches),
        launches_ok_all=all(x["all_ok"] for x in launches),
        fenced_atomics=fenced, no_fenced_atomics=not fenced, host_syncs=syncs, no_host_syncs=not syncs)


def _ptxas_version() -> str | None:
    tool = _tool("ptxas")
    out = subprocess.run([tool, "--version"], capture_output=True, text=True).stdout if tool else ""
    m = re.search(r"release ([\d.]+)", out)
    return m.group(1) if m else None


# ---------------------------------------------------------------------------------------------
# output


def _mb(b) -> str:
    return "—" if b is None else f"{b / 1e6:.1f}"


def _yes(ok: bool) -> str:
    return "met" if ok else "**missed**"


def _check(text: str, ok: bool, misses) -> str:
    """A line of the checks list: ``text: met``, or missed and by what (``misses``, read only then)."""
    return f"- {text}: {_yes(ok)}" + ("" if ok else " — " + "; ".join(misses))


def _grid(g) -> str:
    return "×".join(str(x) for x in g) if isinstance(g, (list, tuple)) else str(g)


def _used(k) -> str:
    return ", ".join(k["used_by"]) if len(k["used_by"]) <= 3 else f"{len(k['used_by'])} workloads"


def _loop_cell(loops, op) -> str:
    return " / ".join(str(L["own"][op]) for L in loops) or "—"


def markdown(res: dict) -> str:
    sh, t, meas = res["shape"], res["targets"], res.get("measured") or {}
    out = [f"# Kernel statistics, Triton {res['triton']} (compiled, no GPU)", "",
           f"Command: `{res['command']}`  ",
           f"triton {res['triton']} (ptxas {res['ptxas']}), torch {res['torch']}, commit {res['commit']}"
           f"{' (kernel files modified in the working tree)' if res['dirty_kernels'] else ''}, {res['date']}, "
           f"{res['wall_s']} s; FP fusion {res['fp_fusion']}.  ",
           f"Shape: B = {sh['B']}, H_kv = {sh['H']}, H_q = {sh['H_q']}, D = {sh['D']}, {sh['dtype']} K/V, "
           f"N = {sh['N']}, keep {sh['keep']:.0%} ({sh['kept_per_head']} per head), W = {sh['W']} window queries.  ",
           "Launch configurations are the ones the launchers pick on a GPU at this shape; method, byte formulas and "
           "time model: `docs/benchmarks.md` (kernel_stats.py: method). Times are **model estimates**, not "
           "measurements.", "",
           "## Checks", "",
           _check("No spills in any kernel", t["no_spills"], (
               f"`{s['kernel']}` {s['arch']} ({s['spill_stores']} B stored / {s['spill_loads']} B loaded, "
               f"{s['regs']} regs)" for s in t["spills"])),
           _check(f"No kernel under {MIN_OCCUPANCY:.0%} occupancy (sm_90)", t["occupancy_ok"], (
               f"`{x['kernel']}` {x['occupancy']:.1%} ({x['limiter']}, {x['regs']} regs)" for x in t["low_occupancy"])),
           f"- At most {MAX_LAUNCHES} launches per compress for {', '.join(KEY_ONLY)}: Triton "
           f"{_yes(t['launches_ok_triton'])}, all device launches {_yes(t['launches_ok_all'])} — "
           + "; ".join(f"{x['policy']} {x['triton_launches']} Triton / {x['all_launches']} all" for x in t["launches"]),
           _check("No fenced atomics", t["no_fenced_atomics"], (
               f"`{x['kernel']}` {x['arch']} ({x['fenced_atomics']} in PTX, {x['membar']} MEMBAR)"
               for x in t["fenced_atomics"])),
           _check("No host syncs", t["no_host_syncs"], (
               f"{x['workload']} {x['syncs']} ({', '.join(x['where'])})" for x in t["host_syncs"]))]
    checks = [f"{r['name']} ({', '.join(r['input_checks'])})" for r in res["workloads"] if r.get("input_checks")]
    if checks:
        out.append("- Host reads of values computed only from a small input (not counted as syncs: no device read "
                   "when the caller passes the input on the host, a sync when on the device): " + "; ".join(checks))
    if t.get("not_launched"):
        out.append(f"- Kernels no workload launched (not compiled here): {', '.join(t['not_launched'])}")
    if res["errors"]:
        out += ["", "**Errors:**", ""] + [f"- {e}" for e in res["errors"]]

    # per policy: summary with the model and the calibration
    out += ["", "## Per workload: device launches, bytes, host syncs, modelled time", "",
            "Model: µs per launch = launch cost + max(bytes / copy bandwidth, issue + shared-atomic time), summed "
            "over the device launches (parameters: " + "; ".join(
                f"{m} {p['copy_GBps']:.0f} GB/s, {p['sms']} SMs at {p['clock_GHz']} GHz, {p['launch_us']} µs/launch"
                for m, p in res["machines"].items()) + f"; {res['atoms_wavefronts']} wavefronts per ATOMS). "
            f"Measured: {meas.get('device', '—')} with Triton {meas.get('triton', '—')}, "
            f"torch {meas.get('torch', '—')} "
            "(results/nvidia-h200-speed.json; CUDA-graph replay for compress, eager for the allocation). "
            "The ratio only has to be in the right order of magnitude (0.3–3): the model ignores latency, "
            "L2 and host time.", ""]
    rows = []
    for r in res["workloads"]:
        if r["error"]:
            rows.append([r["name"], f"error: {r['error'][:150]}"])
            continue
        ms = r["measured_h200"]
        rows.append([r["name"], r["triton_launches"], r["torch_launches"], r["launches"], r["host_syncs"],
                     _mb(r["read_bytes"]), _mb(r["write_bytes"]), _mb(r["floor_bytes"]), r["model_us"]["H100"],
                     r["model_us"]["H200"], "—" if not ms else f"{ms['us']}" + (
                         "" if ms.get("timing") == "graph" else f" ({ms.get('timing')})"),
                     "—" if r["model_over_measured"] is None else r["model_over_measured"]])
    out += table(rows, None, ["workload", "Triton launches", "torch-side launches", "all", "host syncs", "read MB",
                              "written MB", "floor MB", "model H100 µs", "model H200 µs", "measured H200 µs",
                              "model / measured"], right=True)
    ratios = sorted((r["model_over_measured"], r["name"]) for r in res["workloads"] if r["model_over_measured"])
    if ratios:
        off = [f"{n} {x}" for x, n in ratios if not 1 / 3 <= x <= 3]
        out.append(f"\nCalibration with Triton {res['triton']}: model / measured from {ratios[0][0]} "
                   f"({ratios[0][1]}) to {ratios[-1][0]} ({ratios[-1][1]}), median {ratios[len(ratios) // 2][0]}; "
                   f"outside 1/3–3: {', '.join(off) or 'none'}. A ratio far below 1 is time the model cannot see "
                   "(latency-bound loops, host time in eager rows); the measured run used Triton "
                   f"{meas.get('triton', '?')}, so only a run with that version is calibrated against it.")
    out += [f"\n{r['name']}: its host read-back (`tolist`) returned {r['readback']} in this dry run (the "
            "allocator's static total B·H·k, and k standing in for the data-dependent longest row)."
            for r in res["workloads"] if r.get("readback")]

    # kernels
    for arch in res["archs"]:
        out += ["", f"## Kernels, {arch} (occupancy on an {res['arch_limits'][arch]['gpu']})", ""]
        rows = []
        for k in res["kernels"]:
            st = k["archs"].get(arch, {})
            if "error" in st:
                rows.append([f"`{k['label']}`", _used(k), _grid(k["grid"]), f"compile error: {st['error'][:120]}"])
                continue
            occ, spill = f"{st['occupancy']:.1%}", f"{st['spill_stores']}/{st['spill_loads']}"
            if arch == "sm_90" and st["occupancy"] < MIN_OCCUPANCY:
                occ = f"**{occ}**"
            if st["spill_stores"] or st["spill_loads"]:
                spill = f"**{spill}**"
            L = st.get("loops", [])
            rows.append([f"`{k['label']}`", _used(k), _grid(k["grid"]), st["regs"], spill, st["smem"], st["num_warps"],
                         st["num_stages"], st["ctas_per_sm"], occ, st["limiter"], st.get("sass_n", "—"),
                         " / ".join(str(x["own_n"]) for x in L) or "—"] + [_loop_cell(L, op) for op in LOOP_OPS])
        out += table(rows, None, ["kernel", "used by", "grid", "regs", "spill st/ld B", "smem B", "warps", "stages",
                                  "CTAs/SM", "occupancy", "limited by", "SASS instr.", "loops: own instr."]
                     + [f"loops: {op}" for op in LOOP_OPS], align="lllrrrrrrrlrlllll")
    out += ["", "Loop columns: one value per SASS loop in address order (outer loops count only their own "
            "instructions, not those of the loops inside); the source line of each loop is in the hot-loop table. "
            "Rows split by `{...}` are argument specialisations that compile differently (`{arg%16}` divisible by "
            "16, `{arg=1}` equal to 1, `{arg}` neither).", ""]
    ops = ("ATOMS", "POPC", "VOTE", "BAR", "SHFL", "LDG", "STG", "LDGSTS")
    out += [f"## SASS loops ({MODEL_ARCH})", ""]
    out += table([[f"`{k['label']}`", L["where"], L["depth"], L["own_n"], *(L["own"][op] for op in ops),
                   L["own"]["HGMMA"] + L["own"]["HMMA"], L["own"]["MUFU"]]
                  for k in res["kernels"] for L in k["archs"].get(MODEL_ARCH, {}).get("loops", [])], None,
                 ["kernel", "loop (source `for`)", "depth", "own instr.", *ops, "HGMMA/HMMA", "MUFU"],
                 align="ll" + "r" * 12)

    # launch sequences
    out += ["", "## Launch sequences", "",
            "Per workload, the device launches in order: Triton kernels (grid, bytes by the per-kernel formula, "
            "iterations per program of each SASS loop, modelled H200 µs = bytes / issue / shared atomics parts) "
            "and torch-side ops (fills and compute ops; syncs shown where they happen).", ""]
    for r in [r for r in res["workloads"] if not r["error"]]:
        out += [f"**{r['name']}** ({r['launches']} launches, {r['host_syncs']} host syncs; model "
                f"{r['model_us']['H200']} µs on an H200)", ""]
        rows, i = [], 0
        for x in r["sequence"]:
            if x["type"] in ("sync", "input_check"):
                what = "host sync" if x["type"] == "sync" else "check of an input (no sync when it is on the host)"
                rows.append(["–", f"{what} `{x['name']}` at {x['where']}", "", "", "", "", ""])
                continue
            i, m = i + 1, x["model"]["H200"]
            if x["type"] == "triton":
                its = ", ".join(f"{L['where']}: {L['iterations'] if L['iterations'] is not None else '?'}"
                                for L in x["loops"]) or "—"
                rows.append([i, f"`{x['name']}`", _grid(x["grid"]), _mb(x["read"]), _mb(x["write"]), its,
                             f"{m['us']} ({m['bytes_us']} / {m['issue_us']} / {m['atoms_us']})"])
            else:
                shp = "×".join(str(s) for s in (x["shapes"] or [[]])[0])
                rows.append([i, f"torch `{x['name']}` [{shp}]", "", _mb(x["read"]), _mb(x["write"]), "", m["us"]])
        out += table(rows, None, ["#", "launch", "grid", "read MB", "written MB", "loop iterations / program",
                                  "H200 µs (bytes / issue / atoms)"], align="rllrrll") + [""]
    out += [f"Occupancy: {res['occupancy_formula']}."]
    return "\n".join(out) + "\n"


def compare_markdown(results: list[dict]) -> str:
    """One table per topic, a column per Triton version (the files of ``--compare``)."""
    vs = [r["triton"] for r in results]
    hdr = " / ".join(vs)
    out = ["# Kernel statistics: Triton " + " vs ".join(vs), "",
           "Compiled with no GPU for sm_90 at the target shape (N = "
           f"{results[0]['shape']['N']}, B 1, H_kv 8, H_q 32, D 128, bf16, keep 25 %); per version: "
           + ", ".join(f"[`kernel_stats-triton-{r['triton']}.md`](kernel_stats-triton-{r['triton']}.md) "
                       f"(commit {r['commit']}, {r['date']})" for r in results)
           + ". GPU images with torch 2.11 run Triton 3.6. Times are the model of "
             "`benchmarks/kernel_stats.py` (bytes / bandwidth, launches, SASS instructions and shared atomics), "
             "not measurements; the last column is the measured H200 time (Triton 3.6).", "",
           "## Per workload", ""]

    def cols(items, f) -> str:
        """One cell holding ``f(item)`` per version, "—" where the version has none."""
        return " / ".join("—" if x is None else str(f(x)) for x in items)

    by = [{w["name"]: w for w in r["workloads"]} for r in results]
    rows = []
    for n in [w["name"] for w in results[0]["workloads"]]:
        w0, ws = by[0][n], [None if b.get(n) is None or b[n]["error"] else b[n] for b in by]
        if w0["error"]:
            rows.append([n, f"error: {w0['error'][:100]}"])
            continue
        rows.append([n, f"{w0['launches']} ({w0['triton_launches']}+{w0['torch_launches']})", w0["host_syncs"],
                     cols(ws, lambda w: w["model_us"]["H200"]), cols(ws, lambda w: w["model_us"]["H100"]),
                     w0["measured_h200"]["us"] if w0["measured_h200"] else "—",
                     cols([None if b.get(n) is None else b[n]["model_over_measured"] for b in by], str)])
    out += table(rows, None, ["workload", "launches (Triton+torch)", "host syncs", f"model H200 µs: {hdr}",
                              f"model H100 µs: {hdr}", "measured H200 µs", f"model / measured: {hdr}"],
                 align="lrrllrl")
    kb = [{k["label"]: k for k in r["kernels"]} for r in results]
    kernel_rows, loop_rows = [], []
    for lab in dict.fromkeys(lab for d in kb for lab in d):
        sts = [(d[lab]["archs"].get(MODEL_ARCH) if lab in d else None) for d in kb]
        sts = [s if s and "error" not in s else None for s in sts]
        kernel_rows.append([f"`{lab}`", cols(sts, lambda s: s["regs"]), cols(sts, lambda s: s["ctas_per_sm"]),
                            cols(sts, lambda s: s["spill_stores"] + s["spill_loads"]), cols(sts, lambda s: s["smem"]),
                            cols(sts, lambda s: s.get("sass_n"))])
        for wh in dict.fromkeys(L["where"] for s in sts if s for L in s.get("loops", [])):
            Ls = [None if s is None else next((L for L in s.get("loops", []) if L["where"] == wh), None) for s in sts]
            loop_rows.append([f"`{lab}`", wh, cols(Ls, lambda L: L["own_n"])]
                             + [cols(Ls, lambda L, op=op: L["own"][op]) for op in LOOP_OPS])
    out += ["", "## Kernels (sm_90)", ""]
    out += table(kernel_rows, None, ["kernel"] + [f"{t}: {hdr}" for t in ("regs", "CTAs/SM", "spills", "smem B",
                                                                          "SASS instr.")])
    out += ["", "## Hot loops (sm_90, per source `for`)", ""]
    out += table(loop_rows, None, ["kernel", "loop", f"own instr.: {hdr}"] + [f"{op}: {hdr}" for op in LOOP_OPS])
    out += ["", "A loop appears once per source `for` whose closing branch survives in the SASS (unrolled loops "
            "do not appear; two SASS loops of one `for`, e.g. a peeled copy, share a row and the first is shown)."]
    return "\n".join(out) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help=f"N = {N_SMOKE}, sm_90 only, one argument specialisation per configuration; "
                        "writes nothing unless --out")
    p.add_argument("--out", help="output folder (default benchmarks/results for a full run); with --compare the "
                                 "Markdown file (default benchmarks/results/kernel_stats.md)")
    p.add_argument("--only", nargs="*", help="only these workloads (e.g. knorm streaming_llm)")
    p.add_argument("--compare", nargs="+", metavar="JSON", help="write the comparison of result files and exit")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    args.argv, args.t0 = argv, time.perf_counter()
    if args.compare:
        results = []
        for p in args.compare:
            with open(p) as f:
                results.append(json.load(f))
        results.sort(key=lambda r: tuple(int(x) for x in re.findall(r"\d+", r["triton"])[:3]))
        out = args.out or os.path.join(RESULTS, "kernel_stats.md")
        with open(out, "w") as f:
            f.write(compare_markdown(results))
        print("wrote", out)
        return 0
    torch.set_num_threads(1)
    res = run(args)
    out = args.out or (None if args.smoke else RESULTS)
    if out:
        base = write_results(os.path.join(out, f"kernel_stats-triton-{res['triton']}"), res, markdown(res))
        print("wrote", base + ".json")
        print("wrote", base + ".md")
    t = res["targets"]
    print(f"triton {res['triton']}: kernels {len(res['kernels'])}, workloads {len(res['workloads'])}, errors "
          f"{len(res['errors'])}; spills {'none' if t['no_spills'] else len(t['spills'])}, low occupancy "
          f"{len(t['low_occupancy'])}, host syncs {len(t['host_syncs'])}; {res['wall_s']} s")
    for e in res["errors"]:
        print("ERROR", e, file=sys.stderr)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
