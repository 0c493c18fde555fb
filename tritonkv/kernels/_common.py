"""Helpers shared by every kernel launcher.

* ``INTERPRET``: True when kernels run under the Triton interpreter (``TRITON_INTERPRET=1``,
  CPU tensors). The interpreter executes one program after another and pays ~0.5 ms per program,
  so launchers pick larger blocks and shorter grids there.
* ``triton_op`` / ``launch``: one op, two entry points. ``@triton_op(name, mutates_args=...)``
  registers the launcher with ``torch.library.triton_op`` (what ``torch.compile(fullgraph=True)``
  and ``torch.export`` trace: one op per launcher) and returns a function that, in eager mode
  (not tracing, no dispatch mode, plain tensors), calls the launcher body directly: the
  ``torch.library`` dispatcher costs more host time than the kernels of a small compress.
  ``launch`` then calls the ``@triton.jit`` kernel directly, through the launch cache
  (``_cached_run``: the compiled kernel's launcher called with exactly what ``JITFunction.run`` would
  pass it, without re-binding; ``TRITONKV_LAUNCH_CACHE=0`` turns it off); while tracing it goes
  through ``wrap_triton`` (``docs/architecture.md``, "Kernels"). A repeated eager ``compress`` goes further:
  ``_plan`` repeats its ops and launches from a record, and the launch cache logs launches for it.
* ``use_triton`` / ``cpu_kernels``: one op, two devices. Every op body starts with
  ``if not use_triton(x): return <vectorised PyTorch body>``: CUDA tensors run the Triton kernels,
  CPU tensors the PyTorch body — unless the Triton interpreter is on (``TRITON_INTERPRET=1``), where
  CPU tensors run the Triton kernels (that is how the kernel tests check them). The branch sits in
  the op body itself, so torch.compile (which decomposes a ``triton_op`` into its body) and
  torch.export see one op on either device. ``cpu_kernels("torch"|"triton")`` overrides the choice
  for the CPU (a context manager; ``TRITONKV_CPU_KERNELS`` sets the default).
* ``TORCH_TO_TL``: the pointer type names used by ahead-of-time compile tests.
* ``pdl`` / ``pdl_wait``: programmatic dependent launch on sm_90+ (Hopper and newer): every kernel takes a ``PDL``
  constexpr (``launch`` gives it), waits for the kernel before it at its very top and then lets the next one
  launch, so a compress's chain of kernels starts each launch while the previous kernel still runs
  (``TRITONKV_PDL=0`` turns it off).
* ``record_launches``: log every Triton kernel launched inside a block (name, grid, constexprs,
  launch options, bound arguments), optionally without running them (``benchmarks/kernel_stats.py``).
* ``check_int`` and the other argument checks every layer shares.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import math
import numbers
import operator
import os
import threading
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch._library.triton import is_wrap_triton_enabled, wrap_triton_enabled
from torch.library import wrap_triton
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
#: log2 e. The PyTorch bodies take every exp as ``exp2`` (base-2 logits, as the kernels): PyTorch's CPU ``exp`` takes a
#: slow path, 5-10x the time, for each element whose result is subnormal or zero (masked and far-off logits)
LOG2E = 1.4426950408889634

_CPU_CHOICES = ("torch", "triton")
_cpu = [os.environ.get("TRITONKV_CPU_KERNELS") or ("triton" if INTERPRET else "torch")]
if _cpu[0] not in _CPU_CHOICES:
    raise ValueError(f"TRITONKV_CPU_KERNELS must be one of {_CPU_CHOICES}, got {_cpu[0]!r}")


def host_cache(maxsize: int):
    """``functools.lru_cache(maxsize)`` for a pure function of host values (a launch configuration, a table) called
    on every eager launch; a traced call (``torch.compile``, ``torch.export``) runs the function itself, which is
    what dynamo would do anyway, without its warning about a cache wrapper it cannot keep."""
    def wrap(fn):
        cached = functools.lru_cache(maxsize=maxsize)(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                return fn(*args, **kwargs)
            return cached(*args, **kwargs)

        call.cache_clear, call.cache_info = cached.cache_clear, cached.cache_info
        return call
    return wrap


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op on ``t``'s device runs its Triton kernels (True) or its PyTorch body (False).

    CUDA: Triton. CPU (and meta): the PyTorch body, or the Triton kernels under the interpreter (see
    ``cpu_kernels``). Any other device: a ValueError naming it."""
    if type(t) is torch.Tensor:  # a plain tensor's flags are its device (``t.device`` builds an object)
        if t.is_cuda:
            return True
        if t.is_cpu:
            return _cpu[0] == "triton"
    kind = t.device.type  # subclasses (fake tensors while tracing) say their device here
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
_set_grad_enabled = torch._C._set_grad_enabled


class _Recording(threading.local):
    rec = None  # the ``_plan`` recorder of the call this thread is recording, if any


_recorder = _Recording()


def _recording_only() -> bool:
    """The only dispatch mode is the recorder of a plan (``_plan``), which sees the ops of an eager call."""
    return _recorder.rec is not None and torch._C._len_torch_dispatch_stack() == 1


def _eager(args, kwargs) -> bool:
    """A real call: not traced by torch.compile/export, no dispatch mode (but a plan's recorder), only plain
    tensors."""
    return (not torch.compiler.is_compiling() and (not is_in_torch_dispatch_mode() or _recording_only())
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
            _set_grad_enabled(False)  # torch.set_grad_enabled's C setter, without its context-manager object
            try:
                return fn(*args, **kwargs)
            finally:
                wrap_triton_enabled.value = prev
                _set_grad_enabled(grad)

        call.op = op
        return call
    return dec


def launch(kernel, grid, *args, **kwargs):
    """Launch a ``@triton.jit`` kernel (every one takes a ``PDL`` constexpr, given here: see ``pdl``; its first
    argument is a tensor on the device it runs on): directly in eager mode (through the launch cache, see
    ``_cached_run``), through ``wrap_triton`` (traceable by torch.compile/export) otherwise, then without
    programmatic dependent launch (Inductor launches the kernels of a compiled graph itself)."""
    if is_wrap_triton_enabled() and not _eager(args, kwargs):
        return wrap_triton(kernel)[grid](*args, **kwargs, **_PDL_OFF)
    kwargs.update(pdl(args[0]))
    if _launch_cache[0]:
        return _cached_run(kernel, grid, args, kwargs)
    return _run(kernel, grid, args, kwargs)


# ------------------------------------------------------------------------------------------------
# Programmatic dependent launch (PDL; sm_90+). A compress is a chain of short dependent kernels (score,
# finish, tail, compact); between two of them the GPU drains the first grid, flushes its writes, then
# launches and ramps up the next. Launched with ``launch_pdl`` (CUDA's programmatic stream
# serialization), a kernel may be launched as soon as every program of the kernel before it has passed
# ``griddepcontrol.launch_dependents`` (or exited), and its programs wait in ``griddepcontrol.wait`` for
# that kernel to complete with its writes visible. ``pdl_wait`` does both, first thing in a kernel: no
# global load or store precedes the wait (``benchmarks/kernel_stats.py`` checks the SASS of every such
# kernel), so every read and write is ordered after the previous kernel exactly as without PDL, and what
# overlaps is the launch and the programs' start-up. A kernel not launched with PDL treats both as no-ops.
# read at each launch that is not repeated from a plan (the tuning benchmarks switch it, then clear the plans)
PDL = os.environ.get("TRITONKV_PDL", "1") != "0"
_PDL_ON = {"PDL": True, "launch_pdl": True}
_PDL_OFF = {"PDL": False}
_PDL_DEVICES: dict = {-1: False}  # device index (-1: the CPU) -> whether it runs PDL (host-side benchmarks set -1)


def _pdl_device(index: int) -> bool:
    """Whether CUDA device ``index`` runs programmatic dependent launches: NVIDIA, compute capability 9+."""
    on = _PDL_DEVICES[index] = torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9
    return on


def pdl(t: torch.Tensor) -> dict:
    """The keywords ``launch`` adds to an eager launch of a kernel whose first argument is ``t`` (every kernel
    takes a ``PDL`` constexpr and starts with ``pdl_wait``): ``PDL=True`` and ``launch_pdl=True`` for a plain
    tensor on an sm_90+ NVIDIA GPU (unless ``TRITONKV_PDL=0`` or ``PDL`` is False), else ``PDL=False``. The dict
    is shared: read only."""
    if not PDL or type(t) is not torch.Tensor:
        return _PDL_OFF
    index = t.get_device()
    on = _PDL_DEVICES.get(index)
    if on is None:
        on = _pdl_device(index)
    return _PDL_ON if on else _PDL_OFF


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """First thing in a kernel launched with ``pdl``: wait for the previous kernel in the stream to complete
    (its writes visible), then let the next kernel launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def _run(kernel, grid, args: tuple, kwargs: dict):
    """``kernel[grid](*args, **kwargs)``: Triton's own ``run`` (a plan being recorded cannot repeat it)."""
    if _recorder.rec is not None:
        _recorder.rec.fail(f"a launch of {getattr(kernel, '__name__', kernel)} through Triton's own run")
    return kernel.run(*args, grid=grid, warmup=False, **kwargs)


# ------------------------------------------------------------------------------------------------
# The launch cache: Triton's own launch path without its per-launch binder.
#
# ``JITFunction.run`` binds the arguments, asks a C helper for each argument's specialisation (pointer
# dtype and 16-byte alignment; an int's width, divisibility by 16 and == 1), builds the cache-key string
# of the specialisation and the options, looks the compiled kernel up and calls its launcher: 8-35 µs of
# host time per launch, more than the kernels of a small compress take on the GPU. ``_cached_run`` keys
# a launch by a classification of the same arguments at least as fine (every two arguments that Triton's
# specialisation tells apart, it tells apart too: a tensor's dtype and whether its address is a multiple
# of 16, an int's divisibility by 16, == 1 and width, other types by type) plus the constexpr and option values with their types,
# the device and the knobs ``run`` adds to the options. The first launch of a key goes through ``run``
# itself, which compiles or finds the kernel; the cache remembers the compiled kernel under Triton's
# own key string (found in Triton's cache by identity). Later launches of the key check that Triton's
# cache still maps that string to that kernel and that the kernel's global values are unchanged (as
# ``run`` does), then call the kernel's launcher with exactly the arguments ``run`` passes it: grid,
# stream, function, packed metadata, launch metadata, hooks, every bound argument in signature order.
# Anything else takes ``run``: other argument or constexpr types, keyword defaults, a callable grid,
# pre-run hooks, a stage-inspection hook, a patched ``JITFunction.run`` (``record_launches``), a backend
# without native tensor specialisation (AMD), another kernel class (the interpreter, autotuners), a
# Triton version whose ``run`` was not audited (3.6 and 3.9 are; tests/test_launch_cache.py compares
# both paths argument by argument). ``TRITONKV_LAUNCH_CACHE=0`` turns the cache off.

_launch_cache = [os.environ.get("TRITONKV_LAUNCH_CACHE", "1") != "0"]
_RECIPES: dict = {}  # (id(kernel), positional count, keyword names) -> _Recipe, or False: always ``run``
_MAX_LAUNCHES = 1024  # cached launches per recipe before its cache starts over
_CONST_TYPES = frozenset({int, bool, str, type(None)})  # constexpr/option values whose (type, value) fix their repr
_ARG_TYPES = frozenset({torch.Tensor, int, bool, float, type(None)})  # other arguments the cache classifies
_I32 = (-(1 << 31), (1 << 31) - 1)
_15 = itertools.repeat(15)
_ZERO = (0).__eq__
_IS_ONE = (1).__eq__
_DTYPE = operator.attrgetter("dtype")
_DATA_PTR = torch.Tensor.data_ptr
_NOT_PRESENT = object()


def _triton_run():
    """``(JITFunction, its run, knobs, driver)`` when ``run`` is the audited one of Triton 3.6 or 3.9, else None."""
    try:
        import triton
        from triton import knobs
        from triton.runtime.driver import driver
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover
        return None
    if not triton.__version__.startswith(("3.6.", "3.9.")) or JITFunction.run.__module__ != "triton.runtime.jit":
        return None
    return JITFunction, JITFunction.run, knobs, driver


_AUDITED = _triton_run()


def _int_width(v: int) -> int:
    """0, 1, 2: ``v`` fits int32, int64, neither (Triton's i32, i64, u64)."""
    return 0 if _I32[0] <= v <= _I32[1] else 1 if -(1 << 63) <= v < (1 << 63) else 2


def _getter(keys):
    """A function returning the tuple of ``seq[k]`` for ``k`` in ``keys``."""
    if len(keys) > 1:
        return operator.itemgetter(*keys)
    if keys:
        k = keys[0]
        return lambda seq: (seq[k],)
    return lambda seq: ()


class _Recipe(NamedTuple):
    """How to read the launches of one kernel with a given positional count and keyword names."""

    kernel: object  # held, so that the id in the recipe's key is never reused
    tail: object  # keywords -> the keyword parameters, in signature order
    consts: object  # all parameters -> the constexpr ones
    variables: object  # all parameters -> the others
    options: object  # keywords -> the launch options (num_warps, ...)
    splits: dict  # types of the variables -> (tensor getter, int getter), or None: not classified
    launches: dict  # our key -> (Triton's cache dict, Triton's key string, compiled kernel)


def _recipe(kernel, nargs: int, kwnames: tuple):
    """The ``_Recipe`` of these launches, or False when ``run`` must take them (another kernel class,
    keyword defaults, missing or doubled arguments)."""
    if _AUDITED is None or type(kernel) is not _AUDITED[0]:
        return False
    names = [p.name for p in kernel.params]
    tail = names[nargs:]
    if nargs > len(names) or not set(tail).issubset(kwnames) or set(names[:nargs]) & set(kwnames):
        return False
    const = [p.is_constexpr for p in kernel.params]
    return _Recipe(kernel, _getter(tail), _getter([i for i, c in enumerate(const) if c]),
                   _getter([i for i, c in enumerate(const) if not c]), _getter([k for k in kwnames if k not in names]),
                   {}, {})


def _split(types: tuple):
    """Getters of the tensors and of the ints among arguments of these ``types``; None when a type is not
    classified by the launch cache."""
    if not _ARG_TYPES.issuperset(types):
        return None
    return (_getter([i for i, t in enumerate(types) if t is torch.Tensor]),
            _getter([i for i, t in enumerate(types) if t is int]))


def _cached_run(kernel, grid, args: tuple, kwargs: dict):
    """``kernel.run(*args, grid=grid, warmup=False, **kwargs)`` through the launch cache (see above). A plan
    being recorded (``_plan``) is told of every launch the cache serves or stores, and spoilt by any other."""
    kwnames = tuple(kwargs)
    rkey = (id(kernel), len(args), kwnames)
    rec = _RECIPES.get(rkey)
    if rec is None:
        rec = _RECIPES[rkey] = _recipe(kernel, len(args), kwnames)
    if not rec or _AUDITED[0].run is not _AUDITED[1] or kernel.pre_run_hooks or callable(grid):
        return _run(kernel, grid, args, kwargs)
    knobs, driver = _AUDITED[2], _AUDITED[3]
    if getattr(knobs.runtime, "add_stages_inspection_hook", None) is not None:
        return _run(kernel, grid, args, kwargs)
    values = args + rec.tail(kwargs)
    comp = knobs.compilation
    # the constexpr values, the options and what ``run`` adds to them enter Triton's key as they are
    const = rec.consts(values) + rec.options(kwargs) + (
        kwargs.get("debug", kernel.debug) or knobs.runtime.debug, comp.instrumentation_mode,
        getattr(comp, "fpsan_homomorphic_casts", None))
    ctypes = tuple(map(type, const))
    var = rec.variables(values)
    vtypes = tuple(map(type, var))
    split = rec.splits.get(vtypes, _NOT_PRESENT)
    if split is _NOT_PRESENT:
        split = rec.splits[vtypes] = _split(vtypes)
    if split is None or not _CONST_TYPES.issuperset(ctypes):
        return _run(kernel, grid, args, kwargs)
    tensors, ints = split[0](var), split[1](var)
    width = 0 if not ints or (_I32[0] <= min(ints) and max(ints) <= _I32[1]) else tuple(map(_int_width, ints))
    device = driver.active.get_current_device()
    key = (device, const, ctypes, vtypes, tuple(map(_DTYPE, tensors)),
           tuple(map(_ZERO, map(operator.and_, map(_DATA_PTR, tensors), _15))),
           tuple(map(_ZERO, map(operator.and_, ints, _15))),
           tuple(map(_IS_ONE, ints)) if 1 in ints else None, width)
    hit = rec.launches.get(key)
    if hit is not None:
        cache, tkey, compiled = hit
        if kernel.device_caches[device][0] is cache and cache.get(tkey) is compiled:
            for (name, _), (val, globals_dict) in kernel.used_global_vals.items():  # as ``run`` checks them
                if (new_val := globals_dict.get(name, _NOT_PRESENT)) != val:
                    raise RuntimeError(f"Global variable {name} has changed since we compiled this kernel, "
                                       f"from {val} to {new_val}")
            stream = driver.active.get_current_stream(device)
            n = len(grid)
            launch_metadata = compiled.launch_metadata(grid, stream, *values)
            compiled.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, compiled.function,
                         compiled.packed_metadata, launch_metadata, knobs.runtime.launch_enter_hook,
                         knobs.runtime.launch_exit_hook, *values)
            if _recorder.rec is not None:
                _recorder.rec.launched(kernel, cache, tkey, compiled, grid, values, kernel.debug)
            return compiled
    compiled = kernel.run(*args, grid=grid, warmup=False, **kwargs)
    cache, _, _, backend, _ = kernel.device_caches[device]
    tkey = next((k for k, v in cache.items() if v is compiled), None) if compiled is not None else None
    if tkey is not None and getattr(backend, "supports_native_tensor_specialization", False) is True:
        if len(rec.launches) >= _MAX_LAUNCHES:
            rec.launches.clear()
        rec.launches[key] = (cache, tkey, compiled)
        if _recorder.rec is not None:
            _recorder.rec.launched(kernel, cache, tkey, compiled, grid, values, kernel.debug)
    elif _recorder.rec is not None:
        _recorder.rec.fail(f"a launch of {getattr(kernel, '__name__', kernel)} that the launch cache cannot keep")
    return compiled


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


def check_positive_float(name: str, v, what: str) -> float:
    """``v`` as a float: a TypeError naming ``name`` unless it is a real number (bools are not), a ValueError unless it
    is positive and finite (``what`` says what it is)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(v).__name__}")
    if not 0 < v < math.inf:
        raise ValueError(f"{name} must be a positive finite float ({what}), got {v!r}")
    return float(v)


def check_device(name: str, t: torch.Tensor, device, of: str, *, cpu_ok: bool = False) -> None:
    """A ValueError naming ``name`` unless ``t`` is on ``device`` (the device of ``of``). With
    ``cpu_ok`` a CPU tensor is accepted too (the caller copies it over)."""
    if type(device) is not torch.device:
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
    finite so is every element. Else (or where values cannot be read: tracing, meta or fake tensors) the exact
    check ``Σ x·0 == 0`` per row (x·0 is ±0 for a finite x, NaN for ±inf and NaN; a sum of zeros cannot
    overflow), eagerly on the rows whose sum is not finite alone, and False."""
    if on_host(x):
        fin = torch.isfinite(x.sum(-1) if reduced is None else reduced)
        if bool(fin.all()):
            return fin, True
        bad = (~fin).nonzero(as_tuple=True)  # only a row whose sum is not finite can hold a non-finite element
        fin[bad] = x[bad].mul(0.0).sum(-1) == 0
        return fin, False
    return x.mul(0.0).sum(-1) == 0, False
