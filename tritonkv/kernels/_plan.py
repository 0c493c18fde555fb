"""Plans: an eager call repeated from a record of what it did (the host side of a CUDA graph).

A small ``compress`` is host-bound: its Python (checks, policy and allocator code, launch configuration,
Triton's binder) takes longer than its kernels. Yet a call is a function of metadata: given the same policy and
allocator settings, budget, shapes, strides, dtypes, devices, address alignments, small host tables and global
switches, it makes the same torch ops and the same launches, only on other tensors. ``call(key, tensors, body)``
runs ``body()``; the second time a ``key`` is seen it records what ``body()`` does, and from then on a call with
that key repeats the record:

* the record is made under a ``TorchDispatchMode`` that logs every torch op (allocations, views, the odd
  arithmetic op) and by the launch cache (``_common._cached_run``), which logs every launch it makes with the
  compiled kernel, Triton's cache key and every bound argument in signature order;
* every tensor that a launch reads must be one of ``tensors`` (the call's inputs) or made by a logged op; an op
  may also read a tensor the call neither made nor received (a module's cached table, ``torch.tensor`` of host
  values), which the plan keeps as a constant (and must not write);
* values may be read back to the host (``item``, ``tolist``, a bool, an op whose output shape depends on data)
  only where the key determines them: not from an input (but those whose values ``key`` holds, ``known``), a
  kernel's output, uninitialised memory, or anything computed from them;
* no random op, no ``spoil()`` (a warning), no launch through Triton's own ``run``; a table cached per input
  object (``depends_on``) ties the plan to that object as it is (its identity and version);
* the result is a tuple of logged tensors (a ``NamedTuple``, rebuilt as its type) or an object whose attributes
  are logged tensors and plain values (``RaggedKV``);

else the key is never recorded again and every call of it runs ``body()`` (``counts`` and ``why`` tell which calls were
repeated and why a call was not recorded: a diagnostic). Host checks of input values
(``host_check``) run again on every repeat, but those of inputs whose values ``key`` holds (``known``: the check,
a function of its arguments, passed on those very values when the call was recorded).

A repeat allocates through the same ops (or takes its temporaries from the plan's workspace: the allocations no
result tensor shares storage with, made once per thread, device and stream and kept, as a fresh allocation on that
stream could return them; never while the stream is captured into a CUDA graph, never for two calls at once, at
most 1 MiB per plan; see ``_Plan``), makes the same views, and calls each compiled kernel's launcher with
the arguments the launch cache would pass (the same checks first: Triton's cache still maps the key to that
kernel, its global values are unchanged, no hooks, the same debug and instrumentation knobs), on the stream
current at the call. Anything that does not hold runs ``body()`` instead. ``key`` is the caller's business: it
must determine every decision ``body()`` takes (``api.compress`` builds it). ``TRITONKV_PLANS=0`` (or the
launch cache off) turns plans off.
"""
from __future__ import annotations

import collections
import os
import threading
import weakref
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import _common

_enabled = [os.environ.get("TRITONKV_PLANS", "1") != "0"]
_MAX_PLANS = 512  # keys remembered before the table starts over
_WORKSPACE_BYTES = 1 << 20  # temporaries a plan may keep between calls (see _Plan), at most
_KEPT_BYTES = 64 << 20  # all plans' kept temporaries together, at most
_kept = [0]  # bytes kept now
_KEPT_LOCK = threading.Lock()
_PLANS: dict = {}  # key -> 1 (seen once), a _Plan, or False (never recorded)
_MISS = object()
_STALE = object()  # a plan that depends on other input objects: recorded again
#: what became of the calls ``call`` saw, by outcome: "replayed" (repeated from its plan), "first" (a key's first
#: call), "recorded", "not recorded" (``why`` says why), "off" (a key never recorded, or no recording possible now:
#: ``body()``), "missed" (a plan whose assumptions changed: ``body()``), "stale" (a plan of other input objects)
counts: collections.Counter = collections.Counter()
why: collections.deque = collections.deque(maxlen=16)  # why the latest calls were not recorded, newest last
_RECORDING = threading.Lock()  # one recording at a time (it patches tensor methods for the whole process)
_READS = ("tolist", "numpy", "__array__")  # tensor methods that read values without an op the mode sees
_DATA_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)  # shapes or values read back
_PLAIN = frozenset({int, float, bool, str, type(None)})
_EMPTY = torch.ops.aten.empty.memory_format
_VIEW = torch.ops.aten.view.default
_DETACH = torch.ops.aten.detach.default
_LIFT = torch.ops.aten.lift_fresh.default
_RESHAPES_STORAGE = frozenset({"set_", "resize_", "resize_as_", "as_strided_"})  # besides the inplace_view tag
_UNINITIALISED = frozenset({_EMPTY, torch.ops.aten.empty_strided.default, torch.ops.aten.empty_like.default,
                            torch.ops.aten.new_empty.default, torch.ops.aten.new_empty_strided.default})


def on() -> bool:
    """Plans may serve this call: switched on, the launch cache on, the launch path audited, not the interpreter
    (whose kernels the launch cache does not serve)."""
    return _enabled[0] and _common._launch_cache[0] and _common._AUDITED is not None and not _common.INTERPRET


def tensor_key(t: torch.Tensor) -> tuple:
    """What of a plain tensor that does not require grad an eager call may depend on: shape, strides, dtype,
    device, 16-byte alignment of its address."""
    return t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() & 15


def _triton_state(device: int) -> tuple:
    """The global Triton state a recorded launch assumed (see ``_common._cached_run``)."""
    jit, run, knobs, _ = _common._AUDITED
    comp = knobs.compilation
    return (jit.run is run, getattr(knobs.runtime, "add_stages_inspection_hook", None) is None, knobs.runtime.debug,
            comp.instrumentation_mode, getattr(comp, "fpsan_homomorphic_casts", None), device)


def call(key, tensors: tuple, body, known: tuple = ()):
    """``body()``, or its repeat from the plan of ``key`` (see the module docstring). ``tensors``: the call's
    input tensors, in an order ``key`` fixes; ``known``: the positions of those whose values ``key`` holds."""
    state = _PLANS.get(key)
    if state.__class__ is _Plan:
        out = state.replay(tensors)
        if out is _STALE:
            _PLANS[key] = 1
            counts["stale"] += 1
        elif out is not _MISS:
            counts["replayed"] += 1
            return out
        else:
            counts["missed"] += 1
        return body()
    if state is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = 1
        counts["first"] += 1
        return body()
    if state is False or _common._recorder.rec is not None or not _triton_state(0)[0]:
        counts["off"] += 1
        return body()
    if not _RECORDING.acquire(blocking=False):
        counts["off"] += 1
        return body()
    try:
        return _record(key, tensors, body, known)
    finally:
        _RECORDING.release()


def spoil() -> None:
    """The call being recorded, if any, must not be repeated from a record (it warns, say)."""
    rec = _common._recorder.rec
    if rec is not None:
        rec.fail("spoil() (a warning)")


def depends_on(t) -> None:
    """The call being recorded, if any, used a value cached for the input tensor object ``t`` as it is now (its
    identity and version): its plan serves only calls given that very object, unchanged."""
    rec = _common._recorder.rec
    if rec is not None:
        slot = rec.slots.get(id(t)) if type(t) is torch.Tensor else None
        if slot is None or slot >= rec.inputs:
            return rec.fail("a table cached for a tensor that is not one of the call's inputs")
        rec.guards.append((slot, weakref.ref(t), t._version))


def host_check(fn, *tensors) -> None:
    """``fn(*tensors)``: a check that reads values on the host and raises on bad ones (a function of its
    arguments only). A plan being recorded does not log what it does and repeats it on its call's tensors."""
    rec = _common._recorder.rec
    if rec is None:
        return fn(*tensors)
    rec.checking = True
    try:
        fn(*tensors)
    finally:
        rec.checking = False
    got = rec._args(tensors)
    if got is None:
        return rec.fail("a host check of tensors that are not the call's")
    slots = tuple(slot for _, slot in got[1])
    if rec.known.issuperset(slots):  # the key holds these values, and the check passed on them: it passes again
        return

    def check(s):
        fn(*[s[i] for i in slots])
    rec.steps.append(check)


def _record(key, tensors, body, known):
    rec = _Recorder(tensors, known)
    device = _common._AUDITED[3].active.get_current_device()
    state = _triton_state(device)
    saved = {name: getattr(torch.Tensor, name) for name in _READS}

    def reading(name):
        def read(self, *args, **kwargs):
            if not rec.checking and rec.dirty_tensor(self):
                rec.fail(f"Tensor.{name} of values the key does not determine")
            return saved[name](self, *args, **kwargs)
        return read

    _common._recorder.rec = rec
    for name in _READS:
        setattr(torch.Tensor, name, reading(name))
    try:
        with rec:
            out = body()
    finally:
        _common._recorder.rec = None
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
    plan = rec.finish(out, state) if rec.ok else None
    _PLANS[key] = plan if plan is not None else False
    if plan is None:
        counts["not recorded"] += 1
        why.append(rec.why or "the result is not a tuple of the call's tensors, nor an object of them and plain values")
    else:
        counts["recorded"] += 1
    return out


class _Recorder(TorchDispatchMode):
    """Logs ops and launches as steps over numbered tensors (slots: the inputs first, then every op output)."""

    def __init__(self, tensors, known):
        super().__init__()
        self.storages = {_storage(t) for t in tensors}  # every storage seen
        # storages whose values the key does not determine (inputs, kernel outputs, uninitialised memory, and what
        # is computed from them): reading them back spoils the record
        self.dirty = {_storage(t) for i, t in enumerate(tensors) if i not in known}
        self.slots = {id(t): i for i, t in enumerate(tensors)}
        self.n = self.inputs = len(tensors)  # slots so far (the length of the replay's tensor list)
        self.guards = []  # (input slot, weak reference, version): see depends_on
        self.held = list(tensors)  # keeps every logged tensor alive, so that ids are not reused
        self.by_slot = list(tensors)  # the tensor of every slot
        self.known = frozenset(known)
        self.steps = []
        self.ok = True
        self.why = ""  # the first reason the call cannot be repeated from a record
        self.checking = False  # inside host_check: ops are not logged, reads allowed
        self.meta_written = False  # an op changed a tensor's shape, strides or storage in place
        self.cuda = any(t.is_cuda for t in tensors)  # CUDA graph capture may see the call

    def fail(self, why: str = "") -> None:
        self.ok = False
        self.why = self.why or why

    def dirty_tensor(self, t) -> bool:
        """Whether ``t``'s values may differ between calls of the key (a tensor made outside the log, from Python
        values, may not)."""
        return type(t) is torch.Tensor and _storage(t) in self.dirty

    def _args(self, args: tuple, constants: bool = False):
        """``(template, [(position, slot) or (position, index in a list, slot)])`` of a flat argument tuple; None
        when a tensor is not a slot (with ``constants``: unless it is a plain tensor the call did not make nor
        receive, such as a module's cached table, which the template then holds as a constant)."""
        template, where = list(args), []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                slot = self.slots.get(id(a))
                if slot is None and constants and type(a) is torch.Tensor:
                    self.held.append(a)
                    continue
                if slot is None or type(a) is not torch.Tensor:
                    return None
                where.append((i, slot))
                template[i] = None
            elif isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
                for j, x in enumerate(a):
                    slot = self.slots.get(id(x)) if type(x) is torch.Tensor else None
                    if slot is None:
                        return None
                    where.append((i, j, slot))
                template[i] = [None] * len(a)
        return tuple(template), tuple(where)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.ok or self.checking:
            return out
        ins = [t for t in _tensors(args) + _tensors(tuple(kwargs.values()))]
        dirty = any(self.dirty_tensor(t) for t in ins)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if not all(type(o) is torch.Tensor for o in outs):  # a value read back (an item, a bool): not repeated
            if dirty:
                self.fail(f"{func} read back values the key does not determine")
            return out
        if func is _LIFT and len(args) == 1 and id(args[0]) not in self.slots:  # torch.tensor(<Python values>)
            const, slot = args[0].clone(), self.n

            def lift(s):
                s[slot] = const.clone()
            self.steps.append(lift)
            self._outputs(outs, dirty)
            return out
        got = self._args(args, constants=True)
        data = dirty and any(t in func.tags for t in _DATA_TAGS)
        if got is None or any(_has_tensor(v) for v in kwargs.values()) or nondeterministic(func) or data:
            self.fail(f"{func}: " + ("a tensor argument the call neither made nor received" if got is None
                                     else "a random op" if nondeterministic(func)
                                     else "a shape or value read back" if data else "a tensor keyword argument"))
            return out
        for a, x in zip(func._schema.arguments, args):  # tensors written in place take the inputs' state
            if a.alias_info is not None and a.alias_info.is_write and isinstance(x, torch.Tensor):
                if id(x) not in self.slots:  # a constant must stay one
                    self.fail(f"{func} writes a tensor the call neither made nor received")
                    return out
                if dirty:
                    self.dirty.add(_storage(x))
        if func is _DETACH and not args[0].requires_grad:  # an alias without autograd history: the tensor itself
            self.slots[id(out)] = got[1][0][1]
            self.held.append(out)
            return out
        if torch.Tag.inplace_view in func.tags or func.__name__.split(".")[0] in _RESHAPES_STORAGE:
            self.meta_written = True  # a tensor's own shape, strides or storage changed in place: no workspace
        self.steps.append(_op_step(func, got, kwargs, isinstance(out, (tuple, list)), self.n))
        self._outputs(outs, dirty or func in _UNINITIALISED)
        return out

    def _outputs(self, outs, dirty: bool):
        for o in outs:
            st = _storage(o)
            if dirty:
                self.dirty.add(st)
            self.storages.add(st)
            self.slots[id(o)] = self.n
            self.n += 1
            self.held.append(o)
            self.by_slot.append(o)
            self.cuda = self.cuda or o.is_cuda

    def launched(self, kernel, cache, tkey, compiled, grid, values: tuple, debug) -> None:
        """A launch of the launch cache (``_common._cached_run``): it may write any tensor it is given."""
        got = self._args(values) if self.ok else None
        if got is None:
            return self.fail(f"a launch of {getattr(kernel, '__name__', kernel)} with a tensor the call neither made "
                             "nor received")
        self.dirty.update(_storage(t) for t in _tensors(values))
        self.steps.append(_Launch(kernel, cache, tkey, compiled, grid, got[0], got[1], debug))

    def finish(self, out, state):
        """The plan, or None when the result is not a tuple of logged tensors or an object whose attributes are
        logged tensors and plain values."""
        if isinstance(out, tuple):
            where = [self.slots.get(id(t)) if type(t) is torch.Tensor else None for t in out]
            if None in where:
                return None
            return _Plan(self.steps, tuple(where), type(out), state, self.guards, self.n, self._workspace(out),
                         self.cuda)
        attrs = getattr(out, "__dict__", None)
        if attrs is None:
            return None
        fields = {}
        for name, v in attrs.items():
            if type(v) is torch.Tensor:
                slot = self.slots.get(id(v))
                if slot is None:
                    return None
                fields[name] = slot
            elif type(v) not in _PLAIN:
                return None
        consts = {name: v for name, v in attrs.items() if name not in fields}
        result = [v for v in attrs.values() if type(v) is torch.Tensor]
        return _Plan(self.steps, _Fields(fields, consts), type(out), state, self.guards, self.n,
                     self._workspace(result), self.cuda)

    def _workspace(self, result):
        """The allocations a plan may keep between calls (see ``_Plan``): ``(steps, kept, views, bytes)``, the
        steps without them, the ``(slot, size, dtype, device)`` of every ``empty`` whose storage no result tensor
        uses (together at most ``_WORKSPACE_BYTES``), the ``(slot, source slot, size)`` of every view of them, their
        size; None when there are none, or a tensor's shape or storage was changed in place."""
        if self.meta_written:
            return None
        used = {_storage(t) for t in result}
        kept, views, derived, steps, total = [], [], set(), [], 0
        for step in self.steps:
            alloc, view = getattr(step, "alloc", None), getattr(step, "view_of", None)
            if alloc is not None and alloc[3] is not None and torch.device(alloc[3]).type in ("cpu", "cuda"):
                t = self.by_slot[alloc[0]]
                if _storage(t) not in used and total + t.nbytes <= _WORKSPACE_BYTES:
                    total += t.nbytes
                    kept.append(alloc)
                    derived.add(alloc[0])
                    continue
            if view is not None and view[1] in derived:
                views.append(view)
                derived.add(view[0])
                continue
            steps.append(step)
        return (steps, tuple(kept), tuple(views), total) if kept else None


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _tensors(args: tuple) -> list:
    """The tensors among ``args`` and inside its lists and tuples."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += [x for x in a if isinstance(x, torch.Tensor)]
    return out


def nondeterministic(func) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


def _has_tensor(v) -> bool:
    return isinstance(v, torch.Tensor) or isinstance(v, (list, tuple)) and any(_has_tensor(x) for x in v)


def _op_step(func, got, kwargs: dict, many: bool, slot: int):
    """A function of the slot list that repeats one op and writes its outputs from ``slot`` on. An ``empty``
    step carries ``alloc = (slot, size, dtype, device)``, a ``view`` step ``view_of = (slot, source, size)``."""
    template, where = got
    if func is _EMPTY and not where and set(kwargs) <= {"dtype", "device", "pin_memory"} \
            and not kwargs.get("pin_memory") and len(template) == 1:
        size, dtype, device = template[0], kwargs.get("dtype"), kwargs.get("device")

        def empty(s):
            s[slot] = torch.empty(size, dtype=dtype, device=device)
        empty.alloc = (slot, size, dtype, device)
        return empty
    if func is _VIEW and len(where) == 1 and where[0][0] == 0 and len(template) == 2 and not kwargs:
        src, size = where[0][1], template[1]

        def view(s):
            s[slot] = s[src].view(size)
        view.view_of = (slot, src, size)
        return view
    run = func._op  # the operator itself, without OpOverload.__call__
    nested = any(len(w) == 3 for w in where)

    def op(s):
        args = list(template)
        if nested:
            args = [list(a) if isinstance(a, (list, tuple)) else a for a in args]
            for w in where:
                if len(w) == 3:
                    args[w[0]][w[1]] = s[w[2]]
                else:
                    args[w[0]] = s[w[1]]
        else:
            for i, j in where:
                args[i] = s[j]
        out = run(*args, **kwargs)
        if many:
            s[slot:slot + len(out)] = out
        else:
            s[slot] = out
    return op


class _Fields(NamedTuple):
    """An object result: its tensor attributes' slots and its other attributes."""

    tensors: dict
    consts: dict


class _Launch:
    """One recorded launch: the kernel, where Triton caches its compiled form, the grid (as given, and as three
    ints), the bound arguments with the tensors' slots, the kernel's debug switch at the time."""

    __slots__ = ("kernel", "cache", "tkey", "compiled", "grid", "grid3", "template", "where", "debug")

    def __init__(self, kernel, cache, tkey, compiled, grid, template, where, debug):
        self.kernel, self.cache, self.tkey, self.compiled = kernel, cache, tkey, compiled
        n = len(grid)
        self.grid, self.grid3 = grid, (grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1)
        self.template, self.where, self.debug = template, where, debug

    def bind(self, filled: dict) -> "_Launch":
        """This launch with the tensors of ``filled`` (slot -> tensor) bound in its template."""
        template = list(self.template)
        for i, slot in self.where:
            if slot in filled:
                template[i] = filled[slot]
        where = tuple((i, slot) for i, slot in self.where if slot not in filled)
        return _Launch(self.kernel, self.cache, self.tkey, self.compiled, self.grid, tuple(template), where,
                       self.debug)

    def valid(self, device) -> bool:
        """What ``_cached_run`` checks before serving a launch, and the kernel's own switches."""
        kernel = self.kernel
        if kernel.device_caches[device][0] is not self.cache or self.cache.get(self.tkey) is not self.compiled:
            return False
        if kernel.pre_run_hooks or kernel.debug != self.debug:
            return False
        for (name, _), (val, globals_dict) in kernel.used_global_vals.items():
            if globals_dict.get(name, _MISS) != val:
                return False
        return True


class _Workspace:
    """A plan's kept allocations for one owner (thread, device, stream): the slot list with them and their views
    filled in, and the steps that remain (launches with those arguments bound)."""

    __slots__ = ("owner", "slots", "steps", "nbytes")

    def __init__(self, owner, blank: list, layout, nbytes: int):
        steps, kept, views, _ = layout
        self.owner, self.slots, self.nbytes = owner, list(blank), nbytes
        for slot, size, dtype, device in kept:
            self.slots[slot] = torch.empty(size, dtype=dtype, device=device)
        for slot, src, size in views:
            self.slots[slot] = self.slots[src].view(size)
        filled = {slot: self.slots[slot] for slot, _, _, _ in kept}
        filled.update((slot, self.slots[slot]) for slot, _, _ in views)
        self.steps = [s.bind(filled) if s.__class__ is _Launch else s for s in steps]

    def __del__(self):
        if _KEPT_LOCK is None:  # interpreter shutdown: the module's globals are gone, nothing is counted any more
            return
        with _KEPT_LOCK:
            _kept[0] -= self.nbytes


class _Plan:
    """A recorded call: its steps (ops, host checks, launches), where its result's tensors are, the Triton state
    it assumed, the input objects it depends on (``depends_on``) and the layout of its workspace.

    Workspace: the ``empty`` allocations whose storage the result does not use (temporaries: scratch, histograms,
    a select's control slots; at most ``_WORKSPACE_BYTES`` per plan, ``_KEPT_BYTES`` for all plans together) are
    made once per owner, the thread, device and stream of the call, and kept for the next call of the same owner,
    with their views. Reusing them is what a fresh ``torch.empty`` may return (the caching allocator hands a freed
    block to the next allocation on the same stream, with whatever the last kernel left in it): a kernel never
    relies on the contents of an allocation it did not write. A workspace serves one call at a time (taken from
    the plan for the call and given back after it: concurrent or nested calls of one plan make their own); none is
    used while the current stream is captured into a CUDA graph (a graph must not hold memory that later eager
    calls write), nor by a plan that changed a tensor's shape or storage in place."""

    def __init__(self, steps, out_slots, out_type, state, guards, n: int, workspace, cuda: bool):
        self.steps, self.out_slots, self.out_type, self.state = steps, out_slots, out_type, state
        self.guards = tuple(guards)
        self.blank = [None] * n
        unique = {}
        for s in steps:  # what _Launch.valid checks depends on the kernel and its Triton cache entry only
            if s.__class__ is _Launch:
                unique.setdefault((id(s.kernel), id(s.cache), s.tkey, id(s.compiled), s.debug), s)
        self.launches = tuple(unique.values())
        self.workspace, self.cuda = workspace, cuda
        self.nbytes = 0 if workspace is None else workspace[3]
        self.pool = []  # at most one _Workspace, of the owner that last gave it back

    def _take(self, device, stream):
        """A workspace for this call (the plan's, or a new one), or None where none may be used."""
        if self.cuda and torch.cuda.is_current_stream_capturing():
            return None
        owner = (threading.get_ident(), device, stream)
        try:
            ws = self.pool.pop()
        except IndexError:  # none, or another call of this plan holds it
            ws = None
        if ws is not None and ws.owner == owner:
            return ws
        ws = None  # another owner's: freed
        with _KEPT_LOCK:
            if _kept[0] + self.nbytes > _KEPT_BYTES:
                return None
            _kept[0] += self.nbytes
        return _Workspace(owner, self.blank, self.workspace, self.nbytes)

    def replay(self, tensors: tuple):
        """The call's result, repeated on ``tensors``; ``_MISS`` when something the record assumed has changed."""
        for slot, ref, version in self.guards:
            if ref() is not tensors[slot] or tensors[slot]._version != version:
                return _STALE
        driver, knobs = _common._AUDITED[3], _common._AUDITED[2]
        device = driver.active.get_current_device()
        if _triton_state(device) != self.state:
            return _MISS
        for step in self.launches:
            if not step.valid(device):
                return _MISS
        stream = driver.active.get_current_stream(device)
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        ws = None if self.workspace is None else self._take(device, stream)
        if ws is None:
            s, steps = list(self.blank), self.steps
        else:
            s, steps = list(ws.slots), ws.steps
        s[:len(tensors)] = tensors
        for step in steps:
            if step.__class__ is not _Launch:
                step(s)
                continue
            values = step.template
            if step.where:
                values = list(values)
                for i, slot in step.where:
                    values[i] = s[slot]
            compiled = step.compiled
            meta = compiled.launch_metadata(step.grid, stream, *values)
            compiled.run(*step.grid3, stream, compiled.function, compiled.packed_metadata, meta, enter, leave, *values)
        if ws is not None and not self.pool:
            self.pool.append(ws)
        if self.out_slots.__class__ is not _Fields:
            return self.out_type(*[s[i] for i in self.out_slots])
        fields, consts = self.out_slots
        out = self.out_type.__new__(self.out_type)
        out.__dict__.update(consts)
        for name, slot in fields.items():
            out.__dict__[name] = s[slot]
        return out
