"""Helpers shared by the tests (importable because conftest puts tests/ on sys.path)."""
import contextlib
import dataclasses
import inspect
import math
from typing import ClassVar, Optional

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from reference.select import select as ref_select
from tritonkv.kernels import _common
from tritonkv.policies import Policy

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def assert_raises_naming(call, exc, words, what="") -> None:
    """``call()`` raises exactly ``exc`` (not a subclass) and its message contains every one of ``words``."""
    with pytest.raises(exc) as e:
        call()
    assert type(e.value) is exc, (what, type(e.value))
    for w in words:
        assert w in str(e.value), (what, str(e.value))


@dataclasses.dataclass
class GivenScores(Policy):
    """Test-only base policy (not registered): returns the non-negative scores it holds."""

    name: ClassVar[str] = "test_given_scores"
    nonnegative: ClassVar[bool] = True
    scores: Optional[torch.Tensor] = None

    def score(self, keys, values, **inputs):
        return self.scores


@dataclasses.dataclass
class SignedScores(GivenScores):
    """``GivenScores`` whose scores may be negative."""

    nonnegative: ClassVar[bool] = False


# CPU op bodies: the Triton kernels under the interpreter, or the vectorised PyTorch bodies
BACKENDS = ("triton", "torch")
both_backends = pytest.mark.parametrize("backend", BACKENDS)


def on_backend(backend: str):
    """Context in which CPU tensors run ``backend``'s op bodies (``tritonkv.kernels._common.cpu_kernels``);
    skips ``"triton"`` in a process without the interpreter (CPU tensors cannot run compiled kernels)."""
    from tritonkv.kernels._common import INTERPRET, cpu_kernels

    if backend == "triton" and not INTERPRET:
        pytest.skip("the Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
    return cpu_kernels(backend)


def assert_same_scores(got, want, rtol: float, atol: float = 0.0) -> None:
    """NaN, +inf and −inf at the same places, finite scores within ``rtol``/``atol`` (two backends)."""
    for f in (torch.isnan, lambda t: t == float("inf"), lambda t: t == float("-inf")):
        assert torch.equal(f(got), f(want))
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], rtol=rtol, atol=atol)


# kept indices against an oracle (test_keydiff.py, test_knorm.py): exact unless the oracle's cut is a near-tie


def ambiguous_cut(s, k, sink, window, tol, keys=None) -> bool:
    """True when oracle scores ``s`` (one row) put a near-tie (within ``tol``, not an exact tie) at
    the selection cut, so fp32 rounding may legitimately pick the other token. With the row's
    ``keys`` [n, D], an exact tie between tokens whose keys differ is a near-tie too: the scores are
    equal only mathematically (e.g. KeyDiff's two tokens of a row of 2), and rounding may split them;
    ties between identical keys stay exact (the lower index must win)."""
    n = len(s)
    prot = np.zeros(n, bool)
    prot[:sink] = True
    if window:
        prot[n - window:] = True
    v = np.sort(s[~prot])[::-1]
    m = min(k, n) - int(prot.sum())
    if m <= 0 or m >= len(v):
        return False
    a, b = v[m - 1], v[m]
    if a != b:
        return a - b <= tol
    if keys is not None:
        tied = keys[(s == a) & ~prot]
        if not (tied == tied[:1]).all():
            return True
    near = np.abs(v - a)
    return bool(((near > 0) & (near <= tol)).any())


def assert_kept_matches(idx, lengths, oracle, k, sink, window, tol, keys=None):
    """``idx`` int64 [R, k_max] and ``lengths`` [R] from the kernel path; ``oracle`` float64 [R, N]
    scores on the same (rounded) inputs. Kept indices must equal the oracle's selection exactly;
    at a near-tie, the multiset of kept oracle scores must (and the protected tokens are kept).
    ``keys`` [R, N, D] (optional) tell mathematical ties of distinct keys from exact duplicates."""
    n = oracle.shape[1]
    for r in range(oracle.shape[0]):
        got = np.asarray(idx[r, : int(lengths[r])])
        want = ref_select(oracle[r], k, sink, window)
        if not ambiguous_cut(oracle[r], k, sink, window, tol, None if keys is None else keys[r]):
            np.testing.assert_array_equal(got, want, err_msg=f"row {r}")
            continue
        assert len(got) == len(want) and (np.diff(got) > 0).all()
        assert set(range(sink)) | set(range(n - window if window else n, n)) <= set(got.tolist())
        np.testing.assert_allclose(np.sort(oracle[r][got]), np.sort(oracle[r][want]), rtol=0, atol=tol)


class CharTok:
    """A stand-in tokenizer: one token per character (id = code point)."""

    def __call__(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        return {"input_ids": [ord(c) for c in text]}

    @staticmethod
    def decode(ids):
        return "".join(chr(int(i)) for i in ids)


def tiny_llama():
    """A seeded random Llama (2 layers, 4/2 heads, head_dim 16, vocab 256): a model without a download."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval()


# -- device launches of a block, logged and not run (the dry launch replay) ---------------------------------

NO_LAUNCH = {"view", "_unsafe_view", "reshape", "expand", "slice", "select", "as_strided", "unsqueeze", "squeeze",
             "permute", "t", "transpose", "alias", "detach", "split", "unbind", "narrow", "lift_fresh",
             "_reshape_alias", "diagonal", "unflatten", "flatten", "split_with_sizes", "view_as", "expand_as",
             "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
SYNC = {"_local_scalar_dense", "is_nonzero", "item", "equal"}


class DeviceOps(TorchDispatchMode):
    """Logs the aten ops of the block by name, descending into tritonkv's custom ops (a mode sees a
    custom op whole; its Python body is run again under the mode so the ops inside show)."""

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
        name = func._schema.name.split("::")[-1]
        if name not in NO_LAUNCH:
            self.ops.append(name)
        return func(*args, **kwargs)


def dry(fn):
    """``(Triton launch names, torch device op names, host syncs)`` of ``fn()``, nothing launched."""
    mode = DeviceOps()
    old, _common._cpu[0] = _common._cpu[0], "triton"
    try:
        with _common.record_launches(execute=False) as log, mode:
            fn()
    finally:
        _common._cpu[0] = old
    syncs = [o for o in mode.ops if o in SYNC]
    return [x.name for x in log], [o for o in mode.ops if o not in SYNC], syncs


def ulps(j: np.ndarray) -> np.ndarray:
    """fp32 ``1.0 + j·ulp``: keys equal in their top 16 bits (the select's tail candidates), different below."""
    return (np.float32(1.0).view(np.uint32) + j.astype(np.uint32)).view(np.float32)


@contextlib.contextmanager
def programs_out_of_order(seed: Optional[int] = None):
    """Under the Triton interpreter, run every launch's programs in another order than the interpreter's own
    (grid axis 0 outermost, each axis ascending): reversed (``seed=None``) or in a seeded random permutation of
    the whole grid. On a GPU any program of a launch may run first or last, so a kernel whose output depends on
    which program finishes a row (last-block-done) or claims a slot first (atomics) differs there while it passes
    every interpreted test in grid order. Yields a list that counts the programs of each launch run."""
    from triton.runtime import interpreter as ti

    if not _common.INTERPRET:
        pytest.skip("program order is chosen by the interpreter only (TRITON_INTERPRET=1)")
    builder, call, patch_lang = ti.interpreter_builder, ti.GridExecutor.__call__, ti._patch_lang
    rng = np.random.default_rng(seed)
    launches, running = [], []

    def reorder(fn):
        """``fn``'s stand-in for the interpreter's loop over the grid: the programs it asks for are collected, and
        at the last one all of them run in the chosen order (before the interpreter copies the arguments back)."""
        asked = []

        def run(**args):
            asked.append(tuple(builder.grid_idx))
            if len(asked) == math.prod(builder.grid_dim):
                order = asked[::-1] if seed is None else [asked[i] for i in rng.permutation(len(asked))]
                for idx in order:
                    builder.set_grid_idx(*idx)
                    fn(**args)
                launches.append(len(order))

        run.__signature__ = inspect.signature(fn)  # the interpreter binds the launch's arguments with it
        return run

    def patched_patch_lang(fn):
        scope = patch_lang(fn)
        if running and fn is running[-1].fn:  # the launched kernel (not a @triton.jit function it calls)
            running[-1].fn = reorder(fn)
        return scope

    def patched_call(self, *args, **kwargs):
        fn = self.fn
        running.append(self)
        try:
            return call(self, *args, **kwargs)
        finally:
            running.pop()
            self.fn = fn

    ti._patch_lang, ti.GridExecutor.__call__ = patched_patch_lang, patched_call
    try:
        yield launches
    finally:
        ti._patch_lang, ti.GridExecutor.__call__ = patch_lang, call
