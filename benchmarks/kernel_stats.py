"""Compile-time evidence for every Triton kernel of tritonkv, with no GPU, per Triton version: registers,
spills, shared memory, occupancy, the SASS of each hot loop, and per policy the device launches in order,
their bytes, host syncs and a simple time model.

Usage (``make stats``, ``--smoke``, ``--compare``) and method: docs/benchmarks.md, "kernel_stats.py: method". The
exit status is 1 when a kernel failed to compile or a workload failed.
"""
from __future__ import annotations

import argparse
import ast
import collections
import contextlib
import functools
import io
import json
import math
import operator
import os
import pathlib
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from unittest import mock

# Compiled code, never the interpreter: the launchers must take their GPU branch.
os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the GPU image's default (3.6); 3.9 warns when unset

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from torch._library.custom_ops import OPDEFS  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

import tritonkv  # noqa: E402
from benchmarks.common import RESULTS, ROOT, command, git, now, policy_inputs, table, write_results  # noqa: E402
from tritonkv.kernels import _common  # noqa: E402

# (B, H_kv, G, D, W), keep fraction, N
SHAPE = dict(B=1, H=8, G=4, D=128, W=32)
KEEP = 0.25
N_FULL, N_SMOKE = 32768, 2048
ARCHS_FULL, ARCHS_SMOKE = (90, 80), (90,)
KEY_ONLY = ("keydiff", "knorm", "streaming_llm")
MAX_LAUNCHES = 6
MIN_OCCUPANCY = 0.25
ALLOCATED = {"snapkv+adakv": ("snapkv", "adakv")}  # workload: (policy, allocator), as benchmarks/speed.py
# workload: a window policy scored from its window queries alone, as inside generate (the LSE pass over K runs too)
NO_LSE = {"snapkv[no lse]": "snapkv"}
LAYER, NUM_LAYERS = 15, 30

# Per-SM limits (CUDA occupancy calculator; H100 SXM and A100).
_SM = dict(regs_per_sm=65536, reg_unit=256, max_threads=2048, max_ctas=32, max_warps=64)
ARCH = {90: dict(gpu="H100", **_SM, smem_per_sm=228 * 1024, smem_reserved_per_cta=1024),
        80: dict(gpu="A100", **_SM, smem_per_sm=164 * 1024, smem_reserved_per_cta=1024)}

# Time model (sm_90 SASS); where the parameters come from: docs/benchmarks.md, "kernel_stats.py: method".
MACHINES = {m: dict(copy_GBps=bw, sms=132, clock_GHz=1.98, issue_per_clk=4, launch_us=3.0)
            for m, bw in (("H100", 2900.0), ("H200", 4226.0))}
MODEL_VS_GPU = ("Against the H100 run of 2026-11-26 (gpu_tests.md), measured / model was 1.06 for StreamingLLM, "
                "1.3 for Knorm, KeyDiff and TOVA, 1.9-2.0 for the other window policies, 2.9 for CriticalKV, "
                "4.3 for LagKV")
ATOMS_WAVEFRONTS = 32  # shared-memory wavefronts per ATOMS instruction (worst case: 32-way bank conflict)
MODEL_ARCH = "sm_90"

# {kernel: {argument: the argument whose size bounds what it touches}}: gathers/scatters (a renamed kernel
# falls back to the whole tensor, an upper bound)
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
# Kernels allowed one fenced atomic (at most one MEMBAR): the acq_rel ticket of a last-block-done step, taken once per
# program outside every loop, so that the row's last program sees every other program's slots.
TICKET_KERNELS = frozenset({"_select_finish_kernel", "_select_tail_kernel"})


# ---------------------------------------------------------------------------------------------
# running the library at the target shape, launches logged and not run


def _caller() -> str | None:
    """``file:line`` of the innermost tritonkv frame on the stack (where a sync was made)."""
    return next((f"{os.path.relpath(fr.filename, ROOT)}:{fr.lineno}" for fr in reversed(traceback.extract_stack()[:-2])
                 if "tritonkv" + os.sep in fr.filename and "_common.py" not in fr.filename), None)


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

    def note(self, op: str, kind: str, read: int = 0, write: int = 0, **kw):
        self.ops.append(dict(op=op, kind=kind, read=read, write=write, at=len(self.launches), **kw))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        opdef = OPDEFS.get(func._schema.name) if func.namespace == "tritonkv" else None
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
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        shapes = [list(t.shape) for t in (outs or ins)][:3]
        if kind == "alloc":
            for t in outs:
                t.zero_()  # outside the log: nothing downstream reads unwritten memory
            self.note(str(func), kind, bytes=_nbytes(outs), shapes=shapes)
            return out
        read = 0 if kind == "fill" else _nbytes(ins)
        write = _nbytes(outs or ins[:1]) if kind != "sync" else 0
        if kind != "fill" and self.input_only(ins):
            self.from_inputs.update(t.data_ptr() for t in outs)
            kind = "input_check" if kind == "sync" else kind
        self.note(str(func), kind, read, write, shapes=shapes,
                  **({"where": _caller()} if kind in ("sync", "input_check") else {}))
        return out


def _tensors(x) -> list:
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


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
    tolist = torch.Tensor.tolist

    def logged_tolist(t):
        real = tolist(t)
        if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
            return real
        swap = readback is not None and not t.is_floating_point() and t.numel() == len(readback)
        mode.note("Tensor.tolist", "input_check" if mode.input_only([t]) else "sync", shapes=[list(t.shape)],
                  where=_caller())
        return list(readback) if swap else real

    with contextlib.ExitStack() as patches:
        for m in [m for m in _tritonkv_modules() if callable(getattr(m, "on_host", None))]:
            patches.enter_context(mock.patch.object(m, "on_host", lambda t: False))
        patches.enter_context(mock.patch.object(torch.Tensor, "tolist", logged_tolist))
        patches.enter_context(mock.patch.object(_common, "_cpu", ["triton"]))
        yield


def dry(fn, readback=None, inputs=()):
    """``(launches, torch ops, error)`` of ``fn()`` with launches logged and not run; ``inputs``: the small
    input tensors (host checks of values derived from them only are ``input_check``s, not syncs)."""
    log, mode, err = [], TorchOps(inputs=inputs), None
    try:
        with _common.record_launches(execute=False) as log:
            mode.launches = log
            with gpu_like(mode, readback), mode:
                fn()
    except Exception as e:  # reported per workload
        err = f"{type(e).__name__}: {e}"
    for rec in log:  # the dry run's tensors are on the CPU: launch as on an sm_90 GPU (``specialise`` per arch)
        if "PDL" in rec.constexprs:
            rec.constexprs["PDL"] = _common.PDL
            rec.options.pop("launch_pdl", None)
            if _common.PDL:
                rec.options["launch_pdl"] = True
    return list(log), mode.ops, err


def make_inputs(N: int) -> dict:
    """K/V ``[B, H, N, D]`` bf16 (unwritten: nothing reads them), window queries ``[B, H·G, W, D]``, their
    ``attn_lse`` ``[B, H·G, W]``, W_O ``[H·G·D, H·G·D]`` and SCORE's ``hd`` (positive), as in ``speed.py``."""
    B, H, G, D, W = (SHAPE[k] for k in "BHGDW")
    gen = torch.Generator().manual_seed(0)
    keys, values = (torch.empty(B, H, N, D, dtype=torch.bfloat16) for _ in range(2))
    queries = torch.randn(B, H * G, W, D, generator=gen).to(torch.bfloat16)
    o_proj = torch.empty(H * G * D, H * G * D, dtype=torch.bfloat16)
    hd = torch.rand(H, generator=gen) + 0.1
    lse = torch.zeros(B, H * G, W)
    return dict(keys=keys, values=values, pool=dict(queries=queries, o_proj=o_proj, hd=hd, attn_lse=lse))


def workloads(N: int, only=None) -> list[dict]:
    """Every policy's compress at the target shape, SnapKV + AdaKV, SnapKV without attn_lse (``NO_LSE``), then a
    decode step over the ragged cache (``only``: the names of the workloads to run; default all)."""
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
    cases += [(name, tritonkv.POLICIES[p](), {}) for name, p in NO_LSE.items()]
    out = []
    for name, pol, alloc in [c for c in cases if not only or c[0] in only]:
        inputs = policy_inputs(pol, pool, attn_lse=name not in NO_LSE)
        rb = (B * H * k, k) if alloc else None  # an allocator's total and, standing in for its longest row, k
        log, ops, err = dry(lambda: tritonkv.compress((keys, values), pol, KEEP, **alloc, **inputs), readback=rb,
                            inputs=_tensors(inputs))
        read = any(o["kind"] == "sync" and o["op"] == "Tensor.tolist" for o in ops)
        out.append(dict(name=name, kind="allocation" if alloc else "compress", launches=log, ops=ops, error=err,
                        inputs=sorted(inputs), readback=list(rb) if rb and read else None))
    out += lagkv_tilings(keys, values, k, only) if only else []  # tuning variants: only by name

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


def lagkv_tilings(keys, values, k: int, only=None) -> list[dict]:
    """LagKV's compress (budget mode, the policy's defaults) with each tiling of ``kernels.lagkv.TILINGS`` but the
    default, named ``lagkv[tile=T,warps=W]``, and the default with its partitions software-pipelined,
    ``lagkv[stages=2]`` (``kernels.lagkv.STAGES``): the same tokens, other programs (docs/architecture.md). Compiled
    only when named in ``--only``: they are tuning candidates, not what a compress runs, so the checks leave them
    out."""
    from tritonkv.kernels import lagkv as kl

    pol, N = tritonkv.POLICIES["lagkv"](), keys.shape[2]
    sink, window = pol.protected(N, k)
    quota, rem = divmod(k - sink - window, kl.num_partitions(N, pol.sink, pol.lag) - 1)
    out = []
    for tile, warps, stages in [(t, w, 1) for t, w in kl.TILINGS[1:]] + [(0, 0, 2)]:
        name = f"lagkv[tile={tile},warps={warps}]" if stages == 1 else f"lagkv[stages={stages}]"
        if name in only:
            with mock.patch.object(kl, "STAGES", stages):
                log, ops, err = dry(lambda: kl.lagkv_compress(keys, values, k, sink=sink, lag=pol.lag, quota=quota,
                                                              rem=rem, window=window, tile=tile, warps=warps))
            out.append(dict(name=name, kind="compress", launches=log, ops=ops, error=err, inputs=[], readback=None))
    return out


# ---------------------------------------------------------------------------------------------
# compiling each distinct launch configuration


def _jit_key(rec) -> str:
    return f"{rec.kernel.fn.__module__}.{rec.name}"


def specialise(rec, cap: int):
    """``(target, signature, constexprs, attrs, options)`` of a logged launch, from Triton's own JIT
    binder (what ``kernel[grid](...)`` would compile on a GPU of capability ``cap``)."""
    kern = rec.kernel
    const = dict(rec.constexprs, **({"PDL": False} if cap < 90 and "PDL" in rec.constexprs else {}))
    args = [rec.args[p.name] if p.name in rec.args else const[p.name] for p in kern.params]
    target = GPUTarget("cuda", cap, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kern.signature, kern.params, backend)
    kw = dict(rec.options, debug=bool(knobs.runtime.debug))
    if cap < 90:  # programmatic dependent launch is sm_90+ (``_common.pdl``)
        kw.pop("launch_pdl", None)
    kw.update({opt: getattr(knobs.compilation, opt) for opt in ("instrumentation_mode", "fpsan_homomorphic_casts")
               if hasattr(knobs.compilation, opt)})  # run() adds these in 3.9
    bound, spec, opts = binder(*args, **kw)
    options, signature, constexprs, attrs = kern._pack_args(backend, kw, bound, spec, opts)
    return target, signature, constexprs, attrs, options


def config_key(rec) -> tuple[str, dict]:
    """One compiled variant (kernel, constexprs, options, argument specialisation), and the
    specialisation of each runtime argument: ``"=1"`` (compiled in as a constant), ``"%16"``
    (divisible by 16, or a 16-byte aligned pointer) or ``""``."""
    _, signature, constexprs, attrs, _ = specialise(rec, 90)
    spec = {p.name: f"={rec.args[p.name]}" if signature[p.name] == "constexpr"
            else "%16" if any(a[0] == "tt.divisibility" for a in attrs.get((i,), [])) else ""
            for i, p in enumerate(rec.kernel.params) if p.name not in rec.constexprs}
    key = json.dumps([_jit_key(rec), signature, sorted((str(k), repr(v)) for k, v in constexprs.items()),
                      sorted((str(k), repr(v)) for k, v in attrs.items()), sorted(rec.options.items())])
    return key, spec


_PTXAS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_ATOM = re.compile(r"^\s*(?:@!?%\w+\s+)?(atom|red)\.([\w.]+)", re.M)
_FENCED = {"acq_rel", "acquire", "release", "sc", "seq_cst"}


def _tool(name: str, *args) -> str:
    """The output of a CUDA tool: the copy Triton uses (``knobs.nvidia``; it raises when there is none)."""
    return subprocess.run([getattr(knobs.nvidia, name).path, *args], capture_output=True, text=True, timeout=120).stdout


def compile_stats(rec, cap: int) -> dict:
    """Compile one logged launch for ``sm_<cap>`` and read its resources."""
    target, signature, constexprs, attrs, options = specialise(rec, cap)
    log, t0 = io.StringIO(), time.perf_counter()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True
        k = triton.compile(ASTSource(rec.kernel, signature, constexprs, attrs), target=target,
                           options=options.__dict__)
    secs = time.perf_counter() - t0
    text = log.getvalue()
    m, r, s = _PTXAS.search(text), _REGS.search(text), _SMEM.search(text)
    if not (m and r):
        raise RuntimeError(f"no ptxas report for {rec.name} sm_{cap} (cached compile?):\n{text[-2000:]}")
    glob = [(op, q) for op, q in _ATOM.findall(k.asm["ptx"]) if ".shared" not in "." + q]  # global atomics
    fenced = [q for _, q in glob if _FENCED & set(q.split("."))]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:  # SASS with line info; registers to cross-check
        f.write(k.asm["cubin"])
        f.flush()
        sass = _tool("nvdisasm", "-g", "-c", f.name)
        usage = re.search(r"REG:(\d+)", _tool("cuobjdump", "--dump-resource-usage", f.name))
    usage, ins = int(usage.group(1)) if usage else None, parse_sass(sass)
    loops = sass_loops(ins)
    straight = [x for x in ins if not any(L["lo"] <= x["addr"] <= L["hi"] for L in loops)]
    meta = k.metadata
    st = dict(arch=f"sm_{cap}", regs=int(r.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)),
              pdl=pdl_order(ins) if getattr(meta, "launch_pdl", False) else None,
              stack=int(m.group(1)), smem=int(meta.shared) + (int(s.group(1)) if s else 0),
              num_warps=int(meta.num_warps), num_stages=int(meta.num_stages),
              global_atomics=len(glob), fenced_atomics=len(fenced),
              atomic_forms=sorted({f"{op}.{q}" for op, q in glob}),
              membar=_counts(ins)["MEMBAR_GPU"] if sass else None, sass_n=len(ins), sass=_counts(ins),
              straight_n=len(straight), straight=_counts(straight), loops=loops,
              cuobjdump_regs=usage, compile_s=round(secs, 2))
    if usage is not None and usage != st["regs"]:
        raise RuntimeError(f"cuobjdump reports {usage} registers, the ptxas log {st['regs']}")
    st.update(occupancy(st["regs"], st["smem"], st["num_warps"], cap))
    return st


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


# SASS global memory accesses (loads, stores, atomics, reductions, async and bulk copies; generic LD/ST too)
GLOBAL_MEMORY = frozenset({"LDG", "STG", "ATOMG", "ATOM", "RED", "REDG", "LDGSTS", "LD", "ST", "UTMALDG", "UTMASTG",
                           "UBLKCP", "UBLKRED"})


def pdl_order(ins) -> dict:
    """Where a kernel launched with programmatic dependent launch waits for the kernel before it (``ACQBULK``, the
    SASS of ``griddepcontrol.wait``) and touches global memory first (instruction indices; None: never), and
    whether the wait comes first."""
    wait = next((i for i, x in enumerate(ins) if x["op"] == "ACQBULK"), None)
    first = next((i for i, x in enumerate(ins) if x["op"] in GLOBAL_MEMORY), None)
    return dict(wait=wait, first_memory=first, ok=wait is not None and (first is None or wait < first))


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
    for i, L in enumerate(loops):  # an enclosing loop sorts first: its depth is known
        enclosing = [j for j, P in enumerate(loops) if j != i and P["lo"] <= L["lo"] and L["hi"] <= P["hi"]
                     and (P["lo"], P["hi"]) != (L["lo"], L["hi"])]
        L["parent"] = min(enclosing, key=lambda j: loops[j]["hi"] - loops[j]["lo"]) if enclosing else None
        L["depth"] = 0 if L["parent"] is None else loops[L["parent"]]["depth"] + 1
    for i, L in enumerate(loops):
        body = L.pop("body")
        own = [y for y in body if not any(C["parent"] == i and C["lo"] <= y["addr"] <= C["hi"] for C in loops)]
        L.update(own_n=len(own), counts=_counts(body), own=_counts(own),
                 where=f"{os.path.basename(L['file'] or '?')}:{L['line']}")
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
def _tree(path: str):
    """The parsed source file at ``path`` (None if unreadable)."""
    try:
        return ast.parse(pathlib.Path(path).read_text())
    except (OSError, SyntaxError, TypeError):
        return None


@functools.lru_cache(maxsize=None)
def _fors(path: str) -> dict:
    """``{line: (For node, enclosing FunctionDef)}`` of the source file at ``path`` (``{}`` if unreadable)."""
    tree, out = _tree(path), {}
    for fn in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)] if tree else []:
        for node in [n for n in ast.walk(fn) if isinstance(n, ast.For)]:
            out.setdefault(node.lineno, (node, fn))
    return out


_FUNCS = {"cdiv": lambda a, b: -(-a // b), "minimum": min, "maximum": max, "min": min, "max": max,
          "int": int, "abs": abs, "next_power_of_2": lambda n: 1 << max(int(n) - 1, 0).bit_length()}
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Div: operator.truediv, ast.Mod: operator.mod, ast.LShift: operator.lshift, ast.RShift: operator.rshift}
_EVAL_ERRORS = (KeyError, ValueError, ZeroDivisionError, TypeError, IndexError)  # KeyError: not known here


def _name(f) -> str | None:
    """The name a call's function goes by (``tl.load`` -> ``load``)."""
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _eval(node, env: dict, grid):
    """A small evaluator for ``range`` bounds: names from ``env``, arithmetic, ``tl.program_id(a)`` = the
    middle program of axis ``a``, ``tl.num_programs(a)``, ``cdiv``/``minimum``/``maximum``, ``x.to(...)``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, bool)):
        return node.value
    if isinstance(node, ast.Name):
        return env[node.id]
    if isinstance(node, ast.BinOp):
        return _BINOPS[type(node.op)](_eval(node.left, env, grid), _eval(node.right, env, grid))
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
        return _FUNCS[name](*[_eval(a, env, grid) for a in node.args])
    raise ValueError(ast.dump(node)[:60])


def _locals(fn, env: dict, grid, line: int) -> dict:
    """``env`` and the locals of function ``fn`` assigned before ``line``, evaluated in source order (a value
    not known here is dropped)."""
    env = dict(env)
    assigns = [n for n in ast.walk(fn) if isinstance(n, ast.Assign) and n.lineno < line and len(n.targets) == 1
               and isinstance(n.targets[0], ast.Name)]
    for node in sorted(assigns, key=lambda n: (n.lineno, n.col_offset)):  # ast.walk is breadth-first: source order
        try:
            env[node.targets[0].id] = _eval(node.value, env, grid)
        except _EVAL_ERRORS:
            env.pop(node.targets[0].id, None)
    return env


def _function(jit) -> tuple:
    """``(path, FunctionDef)`` of a ``@triton.jit`` function's source (the def None if not found)."""
    path = jit.fn.__code__.co_filename
    tree = _tree(path)
    return path, next((n for n in (tree.body if tree else []) if isinstance(n, ast.FunctionDef)
                       and n.name == jit.fn.__name__), None)


def _callee(f, g: dict):
    """The ``@triton.jit`` function a call's ``f`` names in globals ``g``: a helper (``hist0_of_chunk``) or a
    module's (``_select._copy_kv_rows``); None for anything else."""
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
        obj = getattr(g.get(f.value.id), f.attr, None)
    else:
        obj = g.get(f.id) if isinstance(f, ast.Name) else None
    return obj if isinstance(obj, JITFunction) else None


def _bind(fn, call, env: dict, grid) -> dict:
    """The parameters of ``fn`` bound from ``call``: its positional and keyword arguments evaluated in the
    caller's ``env``, constant defaults (a value not known here is left out)."""
    params = [a.arg for a in fn.args.args]
    defaults = zip(params[len(params) - len(fn.args.defaults):], fn.args.defaults)
    exprs = {p: d for p, d in defaults if isinstance(d, ast.Constant)}
    exprs.update(zip(params, call.args))
    exprs.update((k.arg, k.value) for k in call.keywords)
    out = {}
    for p, e in exprs.items():
        try:
            out[p] = _eval(e, env, grid)
        except _EVAL_ERRORS:
            pass
    return out


def _entry_envs(jit, env: dict, grid, target: tuple, depth: int = 0) -> list[dict]:
    """The parameter values of function ``target`` = ``(path, name)`` on entry, one per call site on the
    chains from ``jit`` (called with ``env``) down to it through ``@triton.jit`` calls (``jit`` itself first)."""
    path, fn = _function(jit)
    if fn is None or depth > 8:
        return []
    if (os.path.realpath(path), fn.name) == target:
        return [env]
    out = []
    for call in [n for n in ast.walk(fn) if isinstance(n, ast.Call)]:
        callee = _callee(call.func, jit.fn.__globals__)
        callee_fn = _function(callee)[1] if callee is not None else None
        if callee_fn is not None:
            args = _bind(callee_fn, call, _locals(fn, env, grid, call.lineno), grid)
            out += _entry_envs(callee, args, grid, target, depth + 1)
    return out


def trip_count(path: str, line: int, rec) -> int | None:
    """Iterations of the source loop ``for ... in range(...)`` at ``path:line`` for launch ``rec``. In the kernel:
    its bounds evaluated with the launch's arguments and the locals assigned before the loop, in order. In an
    inlined ``@triton.jit`` helper: with the helper's parameters bound at its call site (evaluated with the
    caller's arguments and locals before the call), through helpers calling helpers. None: not a ``range``
    loop, bounds that depend on values not known before the launch (such as bounds read from memory), a helper
    not reached from the kernel, or call sites that disagree (each inlined copy is its own SASS loop, and which
    site a copy comes from is not known)."""
    loop, fn = _fors(path).get(line, (None, None))
    if loop is None or not isinstance(loop.iter, ast.Call) or _name(loop.iter.func) not in ("range", "static_range"):
        return None
    env = {k: v for k, v in {**rec.args, **rec.constexprs}.items() if isinstance(v, (int, float, bool))}
    grid = tuple(rec.grid)
    counts = set()
    for entry in _entry_envs(rec.kernel, env, grid, (os.path.realpath(path), fn.name)):
        local = _locals(fn, entry, grid, line)
        try:
            counts.add(len(range(*[_eval(x, local, grid) for x in loop.iter.args])))
        except _EVAL_ERRORS:
            return None
    return counts.pop() if len(counts) == 1 else None


# calls through which a pointer stays a pointer (any other call's result is a value, not a pointer)
_PTR_CALLS = {"make_block_ptr", "make_tensor_descriptor", "advance", "multiple_of", "max_contiguous", "to",
              "cast", "where", "broadcast_to", "reshape", "expand_dims", "view"}


@functools.lru_cache(maxsize=None)
def pointer_access(kernel) -> dict:
    """``{argument: "r" | "w" | "rw"}`` of a ``@triton.jit`` kernel's pointer arguments, from its source:
    ``tl.load`` reads, ``tl.store`` writes, ``tl.atomic_*`` both, ``.load``/``.store`` of a block pointer or
    descriptor likewise, following assignments and calls to other ``@triton.jit`` functions."""
    fdef, params = kernel.parse().body[0], kernel.arg_names  # Triton's own parse of the source
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

    assigns = [n for n in ast.walk(fdef) if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and n.value]
    for _ in range(4):  # fixpoint over assignments
        for node in assigns:
            r, targets = roots(node.value), node.targets if isinstance(node, ast.Assign) else [node.target]
            for n in [n for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]:
                alias.setdefault(n.id, set()).update(r)
    acc: dict = {}

    def mark(node, kinds):
        for p in roots(node):
            acc.setdefault(p, set()).update(kinds)

    g = kernel.fn.__globals__
    for node in [n for n in ast.walk(fdef) if isinstance(n, ast.Call)]:
        f, name = node.func, _name(node.func)
        first = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "pointer"), None)
        kinds = {"load": {"r"}, "store": {"w"}}.get(name, {"r", "w"})
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "tl" and first is not None:
            if name in ("load", "store") or name.startswith("atomic_"):
                mark(first, kinds)
        elif isinstance(f, ast.Attribute) and name in ("load", "store"):  # block pointer / tensor descriptor
            mark(f.value, kinds)
        elif isinstance(f, ast.Name) and isinstance(g.get(f.id), JITFunction):
            sub = pointer_access(g[f.id])
            for p, a in [*zip(g[f.id].arg_names, node.args), *((kw.arg, kw.value) for kw in node.keywords)]:
                if p in sub:
                    mark(a, set(sub[p]))
    # in parameter order: the same on every run
    return {p: "".join(sorted(acc[p], key="rw".index)) for p in params if p in acc}


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
    seen = {"r": {}, "w": {}}  # per direction, distinct storage at its largest bound
    for n, t in tens.items():
        for mode in acc.get(n) or "r":
            key = (t.data_ptr(), t.numel() * t.element_size())
            seen[mode][key] = max(seen[mode].get(key, 0), size[n])
    return dict(read=sum(seen["r"].values()), write=sum(seen["w"].values()), unknown=[n for n in tens if n not in acc])


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


def floor_bytes(name: str, N: int) -> int | None:
    """The HBM floor of a compress (``benchmarks.speed``'s): read what scoring reads (K; K+V for lagkv and
    criticalkv, with criticalkv's W_O; nothing for streaming_llm), then re-read and write the kept K+V (lagkv, whose
    selection is within the partition it has just read: write them)."""
    token = SHAPE["B"] * SHAPE["H"] * SHAPE["D"] * 2  # bytes of one bf16 token of K (or V), every head
    base = re.split(r"[+\[]", name)[0]
    reads = {"streaming_llm": 0, "lagkv": 2, "criticalkv": 2, "criticalkv_l2": 2}.get(base, 1)
    w_o = (SHAPE["H"] * SHAPE["G"] * SHAPE["D"]) ** 2 * 2 if base.startswith("criticalkv") else 0
    return token * (reads * N + (2 if base == "lagkv" else 4) * tritonkv.resolve_budget(KEEP, N)) + w_o


# ---------------------------------------------------------------------------------------------
# the run


def _compile(rec, cap: int, label: str, errors: list) -> dict:
    """``compile_stats``, or ``{arch, error}`` with the error added to ``errors``."""
    try:
        st = compile_stats(rec, cap)
    except Exception as e:
        msg = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"[:500]
        st = dict(arch=f"sm_{cap}", error=msg)
        errors.append(f"compile {label} sm_{cap}: {msg[:300]}")
    print(f"compiled {label} sm_{cap}: {st.get('regs', 'ERROR')} regs", file=sys.stderr)
    return st


def _short(v):
    return int(v) if isinstance(v, bool) else v


def base_labels(configs: dict) -> None:
    """Sets each config's ``base`` label: the kernel name and the constexprs (and num_warps) that tell its
    configurations apart."""
    recs = [c["rec"] for c in configs.values()]
    for c in configs.values():
        rec = c["rec"]
        same = [r for r in recs if r.name == rec.name]
        parts = [f"{k}={_short(v)}" for k, v in rec.constexprs.items()
                 if len({repr(r.constexprs.get(k)) for r in same}) > 1]
        if len({repr(sorted(r.options.items())) for r in same}) > 1:
            parts.append(f"warps={rec.options.get('num_warps', 4)}")
        c["base"] = f"{rec.name}[{','.join(parts)}]" if parts else rec.name


ORDER = ("knorm", "keydiff", "lagkv", "window_attention", "critical", "score", "select", "decode_attention", "cache")
SAME_STATS = ("regs", "spill_stores", "spill_loads", "smem", "num_warps", "num_stages", "fenced_atomics", "membar",
              "error")  # argument specialisations alike in these share a row


def kernel_rows(configs: dict) -> list[dict]:
    """One row per kernel configuration, in table order; argument specialisations with identical results share
    a row (labelled ``{arg%16}``, ``{arg=1}`` or ``{arg}`` where they differ), whose label each config gets."""
    def order(c):  # scoring kernels, the select pipeline, then decoding (the source order within a file)
        mod = c["rec"].kernel.fn.__module__.rsplit(".", 1)[-1]
        return (ORDER.index(mod) if mod in ORDER else len(ORDER), c["rec"].kernel.fn.__code__.co_firstlineno)

    groups = {}  # base label -> {stats signature -> configs}
    for c in sorted(configs.values(), key=order):
        sig = json.dumps({a: {k: v.get(k) for k in SAME_STATS} for a, v in c["stats"].items()}, sort_keys=True)
        groups.setdefault(c["base"], {}).setdefault(sig, []).append(c)
    kernels = []
    for lab, buckets in groups.items():
        specs = [c["spec"] for cs in buckets.values() for c in cs]
        vary = sorted({a for s in specs for a in s if len({t.get(a) for t in specs}) > 1})
        for cs in buckets.values():
            rec, spec = cs[0]["rec"], cs[0]["spec"]
            name = lab + ("{" + ",".join(f"{a}{spec.get(a) or ''}" for a in vary) + "}" if len(buckets) > 1 else "")
            for c in cs:
                c["label"] = name
            const = {k: _short(v) for k, v in rec.constexprs.items()}
            kernels.append(dict(kernel=rec.name, label=name, module=rec.kernel.fn.__module__,
                                config=" ".join(f"{k}={v}" for k, v in [*const.items(), *rec.options.items()]),
                                constexprs=const, options=dict(rec.options), grid=list(rec.grid),
                                used_by=list(dict.fromkeys(u for c in cs for u in c["users"])),
                                specialisations=len(cs), access=pointer_access(rec.kernel), archs=cs[0]["stats"]))
    return kernels


def _launch_entry(rec, label: str, st: dict | None) -> dict:
    """A Triton launch of a launch sequence: bytes, the iterations per program of its SASS loops and the
    modelled µs per machine from its sm_90 stats ``st``: the loops' own instructions × their iterations,
    straight-line code once, × warps × programs."""
    b, st = launch_bytes(rec), st or {}
    loops, iters = st.get("loops", []), []
    instr, atoms = st.get("straight_n", 0), st.get("straight", {}).get("ATOMS", 0)
    for L in loops:  # iterations: the source trip count × the enclosing loop's (which comes first)
        t = trip_count(L["file"], L["line"], rec)
        iters.append(None if t is None else t * (1 if L["parent"] is None else (iters[L["parent"]] or 1)))
        instr += L["own_n"] * (iters[-1] or 1)
        atoms += L["own"]["ATOMS"] * (iters[-1] or 1)
    scale = st.get("num_warps", rec.options.get("num_warps", 4)) * math.prod(rec.grid)  # warps × programs
    return dict(type="triton", name=label, kernel=rec.name, grid=list(rec.grid), read=b["read"], write=b["write"],
                unknown_args=b["unknown"],
                loops=[dict(where=L["where"], depth=L["depth"], own_n=L["own_n"], ATOMS=L["own"]["ATOMS"],
                            iterations=it) for L, it in zip(loops, iters)],
                model=_times(b["read"] + b["write"], instr * scale, atoms * scale),
                warp_instructions=instr * scale, atoms_warp=atoms * scale)


def _op_entry(o: dict) -> dict:
    """A torch-side op of a launch sequence: a device launch (fill, compute), or a sync / input check."""
    dev = o["kind"] in ("fill", "compute")
    return dict(type="torch" if dev else o["kind"], name=o["op"].replace("aten.", "").replace(".default", ""),
                kind=o["kind"], read=o["read"], write=o["write"], shapes=o.get("shapes"), where=o.get("where"),
                model=_times(o["read"] + o["write"]) if dev else None)


def workload_row(w: dict, N: int) -> dict:
    """A workload's launch sequence (the Triton launches in order with the torch-side device ops, syncs and
    input checks between them) and its totals: launches, syncs, bytes and modelled time."""
    recs, seq = w["launches"], []
    ops = [o for o in w["ops"] if o["kind"] in ("fill", "compute", "sync", "input_check")]
    for i in range(len(recs) + 1):
        seq += [_op_entry(o) for o in ops if o["at"] == i]
        if i < len(recs):
            st = w["configs"][i]["stats"].get(MODEL_ARCH)
            seq.append(_launch_entry(recs[i], w["configs"][i]["label"], st if st and "error" not in st else None))
    dev, n = [x for x in seq if x["type"] in ("triton", "torch")], collections.Counter(x["type"] for x in seq)
    return dict(name=w["name"], kind=w["kind"], error=w["error"], inputs=w.get("inputs"), readback=w.get("readback"),
                triton_launches=n["triton"], torch_launches=n["torch"], launches=len(dev), host_syncs=n["sync"],
                sync_sites=sorted({x["where"] or "?" for x in seq if x["type"] == "sync"}),
                input_checks=sorted({x["where"] or "?" for x in seq if x["type"] == "input_check"}),
                allocations=sum(o["kind"] == "alloc" for o in w["ops"]),
                alloc_bytes=sum(o["bytes"] for o in w["ops"] if o["kind"] == "alloc"),
                read_bytes=sum(x["read"] for x in dev), write_bytes=sum(x["write"] for x in dev),
                floor_bytes=floor_bytes(w["name"], N) if w["kind"] != "decode" else None,
                model_us={m: round(sum(x["model"][m]["us"] for x in dev), 1) for m in MACHINES}, sequence=seq)


def run(args) -> dict:
    """The workloads dry-run, each distinct compile of their launches (kernel, constexprs, options, argument
    specialisation) compiled for every arch, then the kernel rows, the launch sequences and the checks."""
    N, archs = (N_SMOKE, ARCHS_SMOKE) if args.smoke else (N_FULL, ARCHS_FULL)
    wls = workloads(N, args.only)
    errors = [f"{w['name']}: {w['error']}" for w in wls if w["error"]]
    configs = {}  # config key -> {rec, spec, users}, in first-seen order
    for w in wls:
        w["configs"] = []
        for rec in w["launches"]:
            key, spec = config_key(rec)
            w["configs"].append(configs.setdefault(key, dict(rec=rec, spec=spec, users={})))
            w["configs"][-1]["users"][w["name"]] = None
    base_labels(configs)
    stats = {}  # base label -> the stats of its last config compiled
    for c in configs.values():
        if not (args.smoke and c["base"] in stats):  # smoke: one argument specialisation per configuration
            stats[c["base"]] = {f"sm_{cap}": _compile(c["rec"], cap, c["base"], errors) for cap in archs}
        c["stats"] = stats[c["base"]]
    kernels = kernel_rows(configs)
    rows = [workload_row(w, N) for w in wls]
    targets = check_targets(kernels, rows, archs)
    # the @triton.jit kernels of tritonkv (a _kernel suffix: launched, not a helper) that no workload launched
    launched = {_jit_key(c["rec"]) for c in configs.values()}
    not_launched = sorted(attr for m in _tritonkv_modules() for attr, obj in list(vars(m).items())
                          if isinstance(obj, JITFunction) and obj.fn.__module__ == m.__name__
                          and attr.endswith("_kernel") and f"{m.__name__}.{attr}" not in launched)
    if not_launched:
        targets["not_launched"] = not_launched
    return dict(
        program="benchmarks/kernel_stats.py", command=command(args.argv, "benchmarks.kernel_stats"),
        smoke=bool(args.smoke), date=now(), commit=git("rev-parse", "--short", "HEAD") or None,
        dirty_kernels=bool(git("status", "--porcelain", "tritonkv")),
        triton=triton.__version__, triton_path=os.path.dirname(triton.__file__), torch=torch.__version__,
        python=platform.python_version(), ptxas=knobs.nvidia.ptxas.version,
        fp_fusion=os.environ.get("TRITON_DEFAULT_FP_FUSION"),
        shape=dict(SHAPE, N=N, H_q=SHAPE["H"] * SHAPE["G"], dtype="bfloat16", keep=KEEP,
                   kept_per_head=tritonkv.resolve_budget(KEEP, N)),
        archs=[f"sm_{c}" for c in archs], arch_limits={f"sm_{c}": ARCH[c] for c in archs},
        machines=MACHINES, atoms_wavefronts=ATOMS_WAVEFRONTS, model_arch=MODEL_ARCH,
        occupancy_formula=("regs_per_warp = ceil(regs*32/256)*256; CTAs/SM = min(floor(floor(65536/regs_per_warp)"
                           "/warps), floor(2048/(32*warps)), 32, floor(smem_per_SM/(shared+1024))); "
                           "occupancy = CTAs*warps/64"),
        low_occupancy_reasons=LOW_OCCUPANCY_REASONS, kernels=kernels, workloads=rows, targets=targets,
        errors=errors, wall_s=round(time.perf_counter() - args.t0, 1))


def check_targets(kernels, rows, archs) -> dict:
    """What the checks list tests, with what missed each: spills and fenced atomics (every arch), occupancy
    (sm_90), the launches of the key-only policies, host syncs."""
    done = [(k, arch, st) for k in kernels for arch, st in k["archs"].items() if "error" not in st]
    spills = [dict(kernel=k["label"], arch=arch, spill_stores=st["spill_stores"], spill_loads=st["spill_loads"],
                   regs=st["regs"], config=k["config"])
              for k, arch, st in done if st["spill_stores"] or st["spill_loads"]]
    fenced = [(k["kernel"] in TICKET_KERNELS and st["fenced_atomics"] <= 1 and (st["membar"] or 0) <= 1,
               dict(kernel=k["label"], arch=arch, fenced_atomics=st["fenced_atomics"], membar=st["membar"],
                    forms=st["atomic_forms"])) for k, arch, st in done if st["fenced_atomics"] or st["membar"]]
    tickets = [x for ticket, x in fenced if ticket]
    fenced = [x for ticket, x in fenced if not ticket]
    low = [(k["kernel"], dict(kernel=k["label"], occupancy=st["occupancy"], limiter=st["limiter"], regs=st["regs"],
                              smem=st["smem"], warps=st["num_warps"]))
           for k, arch, st in done if arch == "sm_90" and st["occupancy"] < MIN_OCCUPANCY]
    excused = LOW_OCCUPANCY_REASONS
    launches = [dict(policy=r["name"], triton_launches=r["triton_launches"], all_launches=r["launches"],
                     triton_ok=r["triton_launches"] <= MAX_LAUNCHES, all_ok=r["launches"] <= MAX_LAUNCHES)
                for r in rows if r["name"] in KEY_ONLY]
    syncs = [dict(workload=r["name"], syncs=r["host_syncs"], where=r["sync_sites"]) for r in rows if r["host_syncs"]]
    pdl = [(k["label"], arch, st["pdl"]) for k, arch, st in done if st.get("pdl")]
    return dict(
        pdl_kernels=len(pdl), pdl_ok=all(p["ok"] for _, _, p in pdl),
        pdl_early=[dict(kernel=lab, arch=arch, **p) for lab, arch, p in pdl if not p["ok"]],
        spills=spills, no_spills=not spills,
        low_occupancy=[x for n, x in low if n not in excused],
        low_occupancy_with_reason=[dict(x, reason=excused[n]) for n, x in low if n in excused],
        occupancy_ok=all(n in excused for n, _ in low),
        occupancy_checked_on="sm_90" if 90 in archs else None,
        launches=launches, launches_ok_triton=all(x["triton_ok"] for x in launches),
        launches_ok_all=all(x["all_ok"] for x in launches),
        fenced_atomics=fenced, no_fenced_atomics=not fenced, ticket_atomics=tickets, host_syncs=syncs,
        no_host_syncs=not syncs)


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
    return "×".join(map(str, g))


def markdown(res: dict) -> str:
    """The report of one run: checks, per-workload totals, the kernels per arch, the SASS loops, the launch
    sequences."""
    sh, t = res["shape"], res["targets"]
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
           _check("No fenced atomics but one last-block-done ticket per program", t["no_fenced_atomics"], (
               f"`{x['kernel']}` {x['arch']} ({x['fenced_atomics']} in PTX, {x['membar']} MEMBAR)"
               for x in t["fenced_atomics"]))
           + (f" (tickets: {', '.join(sorted({x['kernel'] for x in t['ticket_atomics']}))})"
              if t.get("ticket_atomics") else ""),
           _check("No host syncs", t["no_host_syncs"], (
               f"{x['workload']} {x['syncs']} ({', '.join(x['where'])})" for x in t["host_syncs"])),
           _check(f"Kernels launched with programmatic dependent launch ({t.get('pdl_kernels', 0)} compiled "
                  "variants) wait for the kernel before them (ACQBULK) before any global memory access",
                  t.get("pdl_ok", True), (f"`{x['kernel']}` {x['arch']} (wait at instruction {x['wait']}, first "
                                          f"access at {x['first_memory']})" for x in t.get("pdl_early", [])))]
    checks = [f"{r['name']} ({', '.join(r['input_checks'])})" for r in res["workloads"] if r.get("input_checks")]
    if checks:
        out.append("- Host reads of values computed only from a small input (not counted as syncs: no device read "
                   "when the caller passes the input on the host, a sync when on the device): " + "; ".join(checks))
    if t.get("not_launched"):
        out.append(f"- Kernels no workload launched (not compiled here): {', '.join(t['not_launched'])}")
    if res["errors"]:
        out += ["", "**Errors:**", ""] + [f"- {e}" for e in res["errors"]]

    out += ["", "## Per workload: device launches, bytes, host syncs, modelled time", "",
            "Model: µs per launch = launch cost + max(bytes / copy bandwidth, issue + shared-atomic time), summed "
            "over the device launches (parameters: " + "; ".join(
                f"{m} {p['copy_GBps']:.0f} GB/s, {p['sms']} SMs at {p['clock_GHz']} GHz, {p['launch_us']} µs/launch"
                for m, p in res["machines"].items()) + f"; {res['atoms_wavefronts']} wavefronts per ATOMS). "
            f"{MODEL_VS_GPU}; it ignores latency, L2 and host time.", ""]
    rows = [[r["name"], f"error: {r['error'][:150]}"] if r["error"] else
            [r["name"], r["triton_launches"], r["torch_launches"], r["launches"], r["host_syncs"],
             _mb(r["read_bytes"]), _mb(r["write_bytes"]), _mb(r["floor_bytes"]), r["model_us"]["H100"],
             r["model_us"]["H200"]] for r in res["workloads"]]
    out += table(rows, None, ["workload", "Triton launches", "torch-side launches", "all", "host syncs", "read MB",
                              "written MB", "floor MB", "model H100 µs", "model H200 µs"], right=True)
    out += [f"\n{r['name']}: its host read-back (`tolist`) returned {r['readback']} in this dry run (the "
            "allocator's static total B·H·k, and k standing in for the data-dependent longest row)."
            for r in res["workloads"] if r.get("readback")]

    for arch in res["archs"]:
        out += ["", f"## Kernels, {arch} (occupancy on an {res['arch_limits'][arch]['gpu']})", ""]
        rows = []
        for k in res["kernels"]:
            st, u = k["archs"].get(arch, {}), k["used_by"]
            row = [f"`{k['label']}`", ", ".join(u) if len(u) <= 3 else f"{len(u)} workloads", _grid(k["grid"])]
            if "error" in st:
                rows.append(row + [f"compile error: {st['error'][:120]}"])
                continue
            occ, spill = f"{st['occupancy']:.1%}", f"{st['spill_stores']}/{st['spill_loads']}"
            if arch == "sm_90" and st["occupancy"] < MIN_OCCUPANCY:
                occ = f"**{occ}**"
            if st["spill_stores"] or st["spill_loads"]:
                spill = f"**{spill}**"
            L = st.get("loops", [])
            per_loop = [[x["own_n"] for x in L]] + [[x["own"][op] for x in L] for op in LOOP_OPS]
            rows.append(row + [st["regs"], spill, st["smem"], st["num_warps"], st["num_stages"], st["ctas_per_sm"],
                               occ, st["limiter"], st.get("sass_n", "—")]
                        + [" / ".join(map(str, v)) or "—" for v in per_loop])
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
             f"not measurements. {MODEL_VS_GPU}.", "",
           "## Per workload", ""]

    def cols(items, f) -> str:
        """One cell holding ``f(item)`` per version, "—" where the version has none."""
        return " / ".join("—" if x is None else str(f(x)) for x in items)

    by = [{w["name"]: w for w in r["workloads"]} for r in results]
    rows = []
    for n in [w["name"] for w in results[0]["workloads"]]:
        w0, ws = by[0][n], [None if b.get(n) is None or b[n]["error"] else b[n] for b in by]
        rows.append([n, f"error: {w0['error'][:100]}"] if w0["error"] else
                    [n, f"{w0['launches']} ({w0['triton_launches']}+{w0['torch_launches']})", w0["host_syncs"],
                     cols(ws, lambda w: w["model_us"]["H200"]), cols(ws, lambda w: w["model_us"]["H100"])])
    out += table(rows, None, ["workload", "launches (Triton+torch)", "host syncs", f"model H200 µs: {hdr}",
                              f"model H100 µs: {hdr}"], align="lrrll")
    kb = [{k["label"]: k for k in r["kernels"]} for r in results]
    krows, lrows = [], []
    for lab in dict.fromkeys(lab for d in kb for lab in d):
        sts = [(d[lab]["archs"].get(MODEL_ARCH) if lab in d else None) for d in kb]
        sts = [s if s and "error" not in s else None for s in sts]
        krows.append([f"`{lab}`", cols(sts, lambda s: s["regs"]), cols(sts, lambda s: s["ctas_per_sm"]),
                      cols(sts, lambda s: s["spill_stores"] + s["spill_loads"]), cols(sts, lambda s: s["smem"]),
                      cols(sts, lambda s: s.get("sass_n"))])
        for wh in dict.fromkeys(L["where"] for s in sts if s for L in s.get("loops", [])):
            Ls = [None if s is None else next((L for L in s.get("loops", []) if L["where"] == wh), None) for s in sts]
            lrows.append([f"`{lab}`", wh, cols(Ls, lambda L: L["own_n"])]
                         + [cols(Ls, lambda L, op=op: L["own"][op]) for op in LOOP_OPS])
    out += ["", "## Kernels (sm_90)", ""]
    out += table(krows, None, ["kernel"] + [f"{t}: {hdr}" for t in ("regs", "CTAs/SM", "spills", "smem B",
                                                                    "SASS instr.")])
    out += ["", "## Hot loops (sm_90, per source `for`)", ""]
    out += table(lrows, None, ["kernel", "loop", f"own instr.: {hdr}"] + [f"{op}: {hdr}" for op in LOOP_OPS])
    out += ["", "A loop appears once per source `for` whose closing branch survives in the SASS (unrolled loops "
            "do not appear; two SASS loops of one `for`, e.g. a peeled copy, share a row and the first is shown)."]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help=f"N = {N_SMOKE}, sm_90 only, one argument specialisation per configuration; "
                        "writes nothing unless --out")
    p.add_argument("--out", help="output folder (default benchmarks/results for a full run); with --compare the "
                                 "Markdown file (default benchmarks/results/kernel_stats.md)")
    p.add_argument("--only", nargs="*", help="only these workloads (e.g. knorm streaming_llm)")
    p.add_argument("--compare", nargs="+", metavar="JSON", help="write the comparison of result files and exit")
    args = p.parse_args(argv)
    args.argv, args.t0 = argv, time.perf_counter()
    if args.compare:
        results = sorted((json.loads(pathlib.Path(path).read_text()) for path in args.compare),
                         key=lambda r: tuple(int(x) for x in re.findall(r"\d+", r["triton"])[:3]))
        out = args.out or os.path.join(RESULTS, "kernel_stats.md")
        pathlib.Path(out).write_text(compare_markdown(results))
        print("wrote", out)
        return 0
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="tritonkv-kernel-stats-", ignore_cleanup_errors=True) as cache:
        os.environ["TRITON_CACHE_DIR"] = knobs.cache.dir = cache  # a fresh cache: every compile runs ptxas (logged)
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
