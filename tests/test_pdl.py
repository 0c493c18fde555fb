"""Programmatic dependent launch (``kernels/_common.py``: ``pdl``, ``pdl_wait``): which launches use it, that a
traced launch never does, that every kernel takes it and waits before anything else, and on an sm_90+ GPU that it
changes no result (eager, repeated from a plan, and replayed from a CUDA graph). The PTX of every such kernel
compiled for sm_90 is checked by the ahead-of-time compile tests (``aot.py``: the wait before any global access),
its SASS by ``benchmarks/kernel_stats.py``."""
import ast
import importlib
import inspect
import pkgutil
import textwrap

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import tritonkv
import tritonkv.cache
from tritonkv.kernels import _common, _plan, decode_attention
from tritonkv.kernels.knorm import _knorm_kernel


def _kernels() -> list:
    """Every ``@triton.jit`` kernel (``_*_kernel``) of tritonkv's modules."""
    jit = type(_common.pdl_wait)  # JITFunction, or InterpretedFunction under the interpreter
    mods = [tritonkv.cache] + [importlib.import_module(f"tritonkv.kernels.{m.name}")
                               for m in pkgutil.iter_modules(tritonkv.kernels.__path__)]
    return sorted({k for m in mods for n, k in vars(m).items() if n.endswith("_kernel") and isinstance(k, jit)},
                  key=lambda k: k.fn.__name__)


KERNELS = _kernels()


def test_keywords_follow_the_device(monkeypatch):
    t = torch.zeros(4)
    assert _common.pdl(t) == {"PDL": False}  # the CPU (the interpreter, the PyTorch bodies)
    monkeypatch.setitem(_common._PDL_DEVICES, -1, True)  # as benchmarks.host_time drives the GPU path
    assert _common.pdl(t) == {"PDL": True, "launch_pdl": True}
    with FakeTensorMode() as mode:  # traced: never
        assert _common.pdl(mode.from_tensor(t)) == {"PDL": False}
    monkeypatch.setattr(_common, "PDL", False)  # TRITONKV_PDL=0
    assert _common.pdl(t) == {"PDL": False}


@pytest.mark.parametrize("cap, hip, on", [((9, 0), None, True), ((10, 0), None, True), ((8, 9), None, False),
                                          ((8, 0), None, False), ((9, 4), "6.2", False)])
def test_only_nvidia_sm90_and_newer(monkeypatch, cap, hip, on):
    monkeypatch.setattr(_common, "_PDL_DEVICES", {-1: False})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: cap)
    monkeypatch.setattr(torch.version, "hip", hip)
    assert _common._pdl_device(3) is on and _common._PDL_DEVICES[3] is on  # asked once per device


def test_launch_gives_the_keywords(monkeypatch):
    """``launch`` adds ``pdl(first argument)`` to an eager launch; under torch.compile/export (``wrap_triton``)
    Inductor launches the kernel itself: ``PDL=False``, no ``launch_pdl``, whatever the device."""
    seen = []

    class Wrapped:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(("traced", grid, args, kwargs))

    monkeypatch.setitem(_common._PDL_DEVICES, -1, True)  # CPU tensors launch as on an sm_90 GPU
    monkeypatch.setattr(_common, "_cached_run", lambda kernel, grid, args, kwargs: seen.append(("eager", kwargs)))
    monkeypatch.setattr(_common, "_launch_cache", [True])
    t = torch.zeros(4)
    _common.launch(_knorm_kernel, (2, 1), t, 2, TILE=16)
    assert seen == [("eager", {"TILE": 16, "PDL": True, "launch_pdl": True})]
    seen.clear()
    monkeypatch.setattr(_common, "wrap_triton", lambda kernel: Wrapped())
    monkeypatch.setattr(_common, "is_wrap_triton_enabled", lambda: True)
    monkeypatch.setattr(_common, "_eager", lambda args, kwargs: False)
    _common.launch(_knorm_kernel, (2, 1), t, 2, TILE=16)
    assert seen == [("traced", (2, 1), (t, 2), {"TILE": 16, "PDL": False})]


def test_every_kernel_is_found():
    assert len(KERNELS) == 20 and {"_select_compact_kernel", "_lagkv_kernel", "_ragged_append_kernel"} <= {
        k.fn.__name__ for k in KERNELS}


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.fn.__name__)
def test_kernel_waits_before_anything_else(kernel):
    """Every kernel takes ``PDL`` and calls ``pdl_wait(PDL)`` as its first statement (after the docstring): nothing of
    it may run before the kernel it depends on has completed."""
    assert "PDL" in kernel.arg_names
    body = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn))).body[0].body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    assert ast.unparse(body[0]) == "pdl_wait(PDL)", ast.unparse(body[0])


def _gpu_cases(dev):
    g = torch.Generator(device=dev).manual_seed(0)
    keys = torch.randn(2, 4, 3000, 64, device=dev, generator=g, dtype=torch.bfloat16)
    values = torch.randn(2, 4, 3000, 64, device=dev, generator=g, dtype=torch.bfloat16)
    queries = torch.randn(2, 8, 16, 64, device=dev, generator=g, dtype=torch.bfloat16)
    hd = torch.rand(4, device=dev, generator=g) + 0.1
    kv = (keys, values)
    return {name: (lambda name=name, extra=extra: tritonkv.compress(kv, name.split("+")[0], 0.25, **extra))
            for name, extra in (("knorm", {}), ("keydiff", {}), ("streaming_llm", {}),
                                ("snapkv", dict(queries=queries)), ("tova", dict(queries=queries)),
                                ("score", dict(queries=queries, hd=hd)),
                                ("snapkv+adakv", dict(queries=queries, allocation="adakv", layer=1, num_layers=4)))}


def _flat(out) -> list:
    """The tensors of a result; a RaggedKV's rows padded (its slack is never written)."""
    if isinstance(out, tritonkv.RaggedKV):
        return [*out.to_padded(with_positions=True), out.row_start]
    if isinstance(out, (tuple, list)):
        return [t for x in out for t in _flat(x)]
    return [out]


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
                    reason="programmatic dependent launch needs an sm_90+ GPU")
def test_no_result_changes_on_a_gpu(monkeypatch):
    cases = _gpu_cases("cuda")
    q = torch.randn(2, 8, 1, 64, device="cuda", dtype=torch.bfloat16)
    cases["decode_attention"] = lambda: decode_attention.decode_attention(q, cases["knorm"]()[:2], return_lse=True)
    for name, fn in cases.items():
        monkeypatch.setattr(_common, "PDL", False)
        _plan._PLANS.clear()
        ref = _flat(fn())
        monkeypatch.setattr(_common, "PDL", True)
        _plan._PLANS.clear()
        with _common.record_launches() as log:
            got = [_flat(fn())]
        with_pdl = [r for r in log if "PDL" in r.constexprs]
        assert with_pdl and all(r.constexprs["PDL"] and r.options.get("launch_pdl") for r in with_pdl), name
        got += [_flat(fn()) for _ in range(3)]  # the first call records a plan, the next repeat it
        stream = torch.cuda.Stream()  # a CUDA graph: warmed up on a side stream, captured, replayed
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fn()
        graph.replay()
        torch.cuda.synchronize()
        for out in [*got, _flat(captured)]:
            assert len(out) == len(ref) and all(torch.equal(a, b) for a, b in zip(out, ref)), name
