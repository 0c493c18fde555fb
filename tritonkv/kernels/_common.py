"""Helpers shared by every kernel launcher.

* ``INTERPRET``: True when kernels run under the Triton interpreter (``TRITON_INTERPRET=1``,
  CPU tensors). The interpreter executes one program after another and pays ~0.5 ms per program,
  so launchers pick larger blocks and shorter grids there.
* ``triton_op`` / ``launch``: one op, two entry points. ``@triton_op(name, mutates_args=...)``
  registers the launcher with ``torch.library.triton_op`` (what ``torch.compile(fullgraph=True)``
  and ``torch.export`` trace: one op per launcher) and returns a function that, in eager mode
  (not tracing, no dispatch mode, plain tensors), calls the launcher body directly: the
  ``torch.library`` dispatcher costs more host time than the kernels of a small compress.
  ``launch`` then calls the ``@triton.jit`` kernel directly; while tracing it goes through
  ``wrap_triton`` (``docs/architecture.md``, "Kernels").
* ``use_triton`` / ``cpu_kernels``: one op, two devices. Every op body starts with
  ``if not use_triton(x): return <vectorised PyTorch body>``: CUDA tensors run the Triton kernels,
  CPU tensors the PyTorch body — unless the Triton interpreter is on (``TRITON_INTERPRET=1``), where
  CPU tensors run the Triton kernels (that is how the kernel tests check them). The branch sits in
  the op body itself, so torch.compile (which decomposes a ``triton_op`` into its body) and
  torch.export see one op on either device. ``cpu_kernels("torch"|"triton")`` overrides the choice
  for the CPU (a context manager; ``TRITONKV_CPU_KERNELS`` sets the default).
* ``TORCH_TO_TL``: the pointer type names used by ahead-of-time compile tests.
* ``record_launches``: log every Triton kernel launched inside a block (name, grid, constexprs,
  launch options, bound arguments), optionally without running them (``benchmarks/kernel_stats.py``).
* ``check_int`` and the other argument checks every layer shares.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import numbers
import os
from typing import NamedTuple, Optional

import torch
from torch._library.triton import is_wrap_triton_enabled, wrap_triton_enabled
from torch.library import wrap_triton
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_CPU_CHOICES = ("torch", "triton")
_cpu = [os.environ.get("TRITONKV_CPU_KERNELS") or ("triton" if INTERPRET else "torch")]
if _cpu[0] not in _CPU_CHOICES:
    raise ValueError(f"TRITONKV_CPU_KERNELS must be one of {_CPU_CHOICES}, got {_cpu[0]!r}")


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op on ``t``'s device runs its Triton kernels (True) or its PyTorch body (False).

    CUDA: Triton. CPU (and meta): the PyTorch body, or the Triton kernels under the interpreter (see
    ``cpu_kernels``). Any other device: a ValueError naming it."""
    kind = t.device.type
    if kind == "cuda":
        return True
    if kind in ("cpu", "meta"):
        return _cpu[0] == "triton" and kind == "cpu"
    raise ValueError(f"tritonkv runs on CUDA devices (Triton kernels) and on the CPU (PyTorch); "
                     f"got a tensor on {t.device}. Move the cache to 'cuda' or 'cpu'.")


@contextlib.contextmanager
def cpu_kernels(kind: str):
    """Run CPU tensors through the PyTorch bodies (``"torch"``) or the Triton kernels (``"triton"``,
    which needs ``TRITON_INTERPRET=1`` set before tritonkv is imported) inside the block."""
    if kind not in _CPU_CHOICES:
        raise ValueError(f"kind must be one of {_CPU_CHOICES}, got {kind!r}")
    if kind == "triton" and not INTERPRET:
        raise ValueError("cpu_kernels('triton') needs TRITON_INTERPRET=1 set before tritonkv is imported")
    old, _cpu[0] = _cpu[0], kind
    try:
        yield
    finally:
        _cpu[0] = old

TORCH_TO_TL = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
FLOAT_DTYPES = tuple(TORCH_TO_TL)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``); plain Python (``triton.next_power_of_2`` is a
    constexpr function, several µs per host call)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host code (``triton.cdiv`` is a constexpr function, several µs per host call)."""
    return -(-a // b)


# Argument types of an op call that may skip the dispatcher (anything else, e.g. a tensor subclass, goes
# through it).
_PLAIN = frozenset({torch.Tensor, int, float, bool, str, type(None)})


def _eager(args, kwargs) -> bool:
    """A real call: not traced by torch.compile/export, no dispatch mode, only plain tensors."""
    return (not torch.compiler.is_compiling() and not is_in_torch_dispatch_mode()
            and _PLAIN.issuperset(map(type, args)) and (not kwargs or _PLAIN.issuperset(map(type, kwargs.values()))))


def triton_op(name: str, *, mutates_args, schema: Optional[str] = None):
    """``torch.library.triton_op`` with an eager fast path (a decorator).

    The op is registered as usual (its ``CustomOpDef`` is the ``.op`` attribute of the result), and
    traced calls go through it: torch.compile and torch.export see one op. An eager call runs the
    body directly, with ``wrap_triton`` off as the op's own eager kernel would (``launch`` then calls
    the kernels without the tracing wrapper)."""
    def dec(fn):
        extra = {} if schema is None else {"schema": schema}
        op = torch.library.triton_op(name, mutates_args=mutates_args, **extra)(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if not _eager(args, kwargs):
                return op(*args, **kwargs)
            # below the dispatcher an op's body runs without autograd (its outputs never require grad, and
            # out= ops accept inputs that do, e.g. keys computed from a model's weights outside no_grad)
            prev, grad = getattr(wrap_triton_enabled, "value", True), torch.is_grad_enabled()
            wrap_triton_enabled.value = False
            torch.set_grad_enabled(False)
            try:
                return fn(*args, **kwargs)
            finally:
                wrap_triton_enabled.value = prev
                torch.set_grad_enabled(grad)

        call.op = op
        return call
    return dec


def launch(kernel, grid, *args, **kwargs):
    """Launch a ``@triton.jit`` kernel: directly in eager mode, through ``wrap_triton`` (traceable by
    torch.compile/export) otherwise."""
    if is_wrap_triton_enabled() and not _eager(args, kwargs):
        return wrap_triton(kernel)[grid](*args, **kwargs)
    return kernel.run(*args, grid=grid, warmup=False, **kwargs)  # what kernel[grid](...) calls


class Launch(NamedTuple):
    """One logged launch: ``name`` (the kernel's function name), ``grid``, ``constexprs`` (every
    constexpr parameter's value), ``options`` (launch options such as ``num_warps``), ``kernel``
    (the ``@triton.jit`` object) and ``args`` (the other parameters by name: tensors, ints, floats)."""

    name: str
    grid: tuple
    constexprs: dict
    options: dict
    kernel: object
    args: dict


def _launch_record(kernel, grid, args, kwargs) -> Launch:
    fn = getattr(kernel, "fn", kernel)
    sig = inspect.signature(fn)
    params = sig.parameters
    bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in params})
    bound.apply_defaults()
    const = {p.name for p in getattr(kernel, "params", ()) if p.is_constexpr} or \
        {n for n, p in params.items() if "constexpr" in str(p.annotation)}
    return Launch(fn.__name__, tuple(grid) if not callable(grid) else grid,
                  {n: v for n, v in bound.arguments.items() if n in const},
                  {k: v for k, v in kwargs.items() if k not in params}, kernel,
                  {n: v for n, v in bound.arguments.items() if n not in const})


def _kernel_classes() -> list[type]:
    """The classes whose ``run(*args, grid, warmup, **kwargs)`` launches a ``@triton.jit`` kernel."""
    from triton.runtime.jit import JITFunction

    classes = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:  # pragma: no cover
        pass
    return classes


_recording = [False]  # a record_launches() block is open


@contextlib.contextmanager
def record_launches(execute: bool = True):
    """Log every Triton kernel launched inside the block; yields the list of ``Launch``es.

    With ``execute=False`` the kernels are not run (a dry run: outputs stay unwritten, so only code
    whose control flow and shapes do not depend on kernel outputs gives the launches of a real
    run). The block wraps the launch method of Triton's kernel objects (``JITFunction.run``, and the
    interpreter's) while it is open; launchers themselves carry no hook. Launches traced by
    ``torch.compile``/``torch.export`` run no kernel and are not logged; a launch whose arguments
    include a tensor subclass (fake, functional) is neither logged nor skipped. The log holds
    references to the argument tensors until it is dropped. Not thread-safe; blocks do not nest."""
    if _recording[0]:
        raise RuntimeError("record_launches() blocks do not nest")
    log: list = []
    originals = {cls: cls.__dict__["run"] for cls in _kernel_classes()}

    def wrap(run):
        def recording_run(self, *args, grid, warmup, **kwargs):
            if warmup or not all(type(a) is torch.Tensor for a in (*args, *kwargs.values())
                                 if isinstance(a, torch.Tensor)):
                return run(self, *args, grid=grid, warmup=warmup, **kwargs)
            log.append(_launch_record(self, grid, args, kwargs))
            return run(self, *args, grid=grid, warmup=warmup, **kwargs) if execute else None
        return recording_run

    _recording[0] = True
    try:
        for cls, run in originals.items():
            cls.run = wrap(run)
        yield log
    finally:
        for cls, run in originals.items():
            cls.run = run
        _recording[0] = False


def check_kv_tensor(name: str, t, *, ndim: int = 4) -> None:
    """Raise a TypeError/ValueError naming ``name`` unless ``t`` is a float tensor of rank ``ndim``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")


def check_int(name: str, v, lo: int = 0) -> int:
    """``v`` as an int: a TypeError naming ``name`` unless it is an integer (bools are not; NumPy
    integers are), a ValueError when it is below ``lo``. The one integer check of the library."""
    if type(v) is int and v >= lo:  # the common case, without the ABC check
        return v
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    if v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v}")
    return int(v)


def check_device(name: str, t: torch.Tensor, device, of: str, *, cpu_ok: bool = False) -> None:
    """A ValueError naming ``name`` unless ``t`` is on ``device`` (the device of ``of``). With
    ``cpu_ok`` a CPU tensor is accepted too (the caller copies it over)."""
    device = torch.device(device)
    if t.device != device and not (cpu_ok and t.device.type == "cpu"):
        raise ValueError(f"{name} must be on the device of {of} ({device}), got {t.device}")


def on_host(t: torch.Tensor) -> bool:
    """True when ``t``'s values can be checked without a device read-back: a plain CPU tensor
    outside torch.compile/export tracing (elsewhere launchers never read values)."""
    return type(t) is torch.Tensor and t.device.type == "cpu" and not torch.compiler.is_compiling()


def row_major(t: torch.Tensor) -> torch.Tensor:
    """Make the last dimension unit-stride (kernels take the other strides as arguments)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def finite_rows(x: torch.Tensor, reduced: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, bool]:
    """``(torch.isfinite(x).all(-1), whether every row is finite)`` for the CPU bodies' non-finite checks, without
    the boolean copy of ``x`` in the common case: a row holding a NaN or ±inf element has a non-finite sum (or
    ``reduced``: any reduction over the last dim that propagates them, such as a norm), so when every row's is
    finite so is every element. Else (or where values cannot be read: tracing, meta or fake tensors) the
    elementwise check, and False."""
    if on_host(x):
        fin = torch.isfinite(x.sum(-1) if reduced is None else reduced)
        if bool(fin.all()):
            return fin, True
    return torch.isfinite(x).all(-1), False
