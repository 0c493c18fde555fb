"""compress(): budgets, the unchanged path, dispatch, and a table of bad inputs."""
import numpy as np
import pytest
import torch

import tritonkv
from reference.select import select as ref_select
from tritonkv.api import resolve_budget
from tritonkv.kernels._common import pdl_wait  # a module global: the test kernel below calls it
from helpers import assert_raises_naming  # noqa: E402


def _kv(B=1, H=2, N=50, D=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, N, D, generator=g).to(dtype), torch.randn(B, H, N, D, generator=g).to(dtype)


def test_float_budget_rounding():
    assert resolve_budget(0.29, 100) == 29
    assert resolve_budget(0.001, 100) == 1
    assert resolve_budget(1.0, 100) == 100
    assert resolve_budget(7, 100) == 7


@pytest.mark.parametrize("budget", [50, 51, 1000, 1.0])
def test_budget_at_least_n_returns_input_unchanged(budget):
    k, v = _kv()
    out = tritonkv.compress((k, v), "knorm", budget)
    assert out.keys is k and out.values is v
    assert torch.equal(out.indices, torch.arange(50).expand(1, 2, 50))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_knorm_end_to_end(dtype):
    k, v = _kv(B=2, H=3, N=70, D=16, dtype=dtype)
    out = tritonkv.compress((k, v), "knorm", 0.25)
    n = 17
    assert out.keys.shape == (2, 3, n, 16) and out.keys.dtype == dtype
    for b in range(2):
        for h in range(3):
            ref = ref_select(-k[b, h].float().norm(dim=-1).double().numpy(), n)
            assert out.indices[b, h].tolist() == ref.tolist()
            assert torch.equal(out.keys[b, h], k[b, h, ref]) and torch.equal(out.values[b, h], v[b, h, ref])


def test_policy_object_and_name_agree():
    k, v = _kv()
    a = tritonkv.compress((k, v), "streaming_llm", 10)
    b = tritonkv.compress((k, v), tritonkv.POLICIES["streaming_llm"](), 10)
    assert torch.equal(a.indices, b.indices)
    assert a.indices[0, 0].tolist() == [0, 1, 2, 3] + list(range(44, 50))


K, V = _kv()
BAD = [
    # (description, call, exception type, words the message must contain)
    ("unknown policy", lambda: tritonkv.compress((K, V), "nope", 10), ValueError, ["policy", "knorm"]),
    ("policy wrong type", lambda: tritonkv.compress((K, V), 3, 10), TypeError, ["policy"]),
    ("budget zero", lambda: tritonkv.compress((K, V), "knorm", 0), ValueError, ["budget"]),
    ("budget negative", lambda: tritonkv.compress((K, V), "knorm", -3), ValueError, ["budget"]),
    ("budget float > 1", lambda: tritonkv.compress((K, V), "knorm", 1.5), ValueError, ["budget"]),
    ("budget float 0", lambda: tritonkv.compress((K, V), "knorm", 0.0), ValueError, ["budget"]),
    ("budget nan", lambda: tritonkv.compress((K, V), "knorm", float("nan")), ValueError, ["budget"]),
    ("budget str", lambda: tritonkv.compress((K, V), "knorm", "10"), TypeError, ["budget"]),
    ("budget bool", lambda: tritonkv.compress((K, V), "knorm", True), TypeError, ["budget"]),
    ("budget below protected", lambda: tritonkv.compress((K, V), "streaming_llm", 3), ValueError, ["budget", "sink"]),
    ("kv not a pair", lambda: tritonkv.compress(K, "knorm", 10), TypeError, ["kv"]),
    ("keys rank", lambda: tritonkv.compress((K[0], V[0]), "knorm", 10), ValueError, ["keys", "dimensions"]),
    ("keys int dtype", lambda: tritonkv.compress((K.long(), V), "knorm", 10), TypeError, ["keys"]),
    ("values shape", lambda: tritonkv.compress((K, V[:, :1]), "knorm", 10), ValueError, ["values", "shape"]),
    ("values dtype", lambda: tritonkv.compress((K, V.half()), "knorm", 10), TypeError, ["values", "dtype"]),
    ("empty cache", lambda: tritonkv.compress((K[:, :, :0], V[:, :, :0]), "knorm", 10), ValueError, ["empty"]),
    ("negative sink", lambda: tritonkv.POLICIES["knorm"](sink=-1), ValueError, ["sink"]),
]


@pytest.mark.parametrize("desc,call,exc,words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_the_argument(desc, call, exc, words):
    assert_raises_naming(call, exc, words, desc)


def test_missing_input_is_named():
    k, v = _kv()
    with pytest.raises(ValueError, match="queries"):
        tritonkv.compress((k, v), "snapkv", 40)
    with pytest.raises(ValueError, match="o_proj"):
        tritonkv.compress((k, v), "criticalkv", 40, queries=torch.randn(1, 2, 32, 16))


# -- arguments are never silently dropped ---------------------------------------------------

Q = torch.randn(1, 4, 8, 16, generator=torch.Generator().manual_seed(3))  # H_q = 4: 2 query heads per KV head
WO = torch.randn(32, 4 * 16, generator=torch.Generator().manual_seed(4))
UNKNOWN = [
    # (description, call, words the TypeError must contain)
    ("misspelt input", lambda: tritonkv.compress((K, V), "snapkv", 40, queris=Q),
     ["'queris'", "did you mean 'queries'?"]),
    ("kvpress compression_ratio", lambda: tritonkv.compress((K, V), "keydiff", 0.25, compression_ratio=0.75),
     ["'compression_ratio'", "fraction removed", "budget = 1 - compression_ratio", "compress(kv, policy, 0.25)"]),
    ("a setting of other policies", lambda: tritonkv.compress((K, V), "keydiff", 0.25, kernel_size=3),
     ["'kernel_size'", "setting", "tritonkv.policies.SnapKV(kernel_size=3)", "'keydiff' has no setting"]),
    ("window: the policy's setting", lambda: tritonkv.compress((K, V), "snapkv", 40, queries=Q, window=8),
     ["'window'", "a setting of the policy 'snapkv'", "pass tritonkv.policies.SnapKV(window=8)"]),
    ("sink: the policy's setting", lambda: tritonkv.compress((K, V), "snapkv", 40, queries=Q, sink=4),
     ["'sink'", "tritonkv.policies.SnapKV(sink=4)"]),
    ("window of a policy over a base", lambda: tritonkv.compress((K, V), "criticalkv", 40, queries=Q, o_proj=WO,
                                                                  window=8),
     ["'window'", "tritonkv.policies.CriticalKV(base=tritonkv.policies.SnapKV(window=8))"]),
    ("an allocator's setting", lambda: tritonkv.compress((K, V), "knorm", 20, allocation="adakv", alpha=0.2),
     ["'alpha'", "allocation=tritonkv.allocation.AdaKV(alpha=0.2)"]),
    ("misspelt allocation", lambda: tritonkv.compress((K, V), "knorm", 20, allocator="adakv"),
     ["'allocator'", "did you mean 'allocation'?"]),
    ("unknown even when everything is kept", lambda: tritonkv.compress((K, V), "knorm", 1.0, querys=Q),
     ["'querys'", "did you mean 'queries'?"]),
    ("every unknown is named", lambda: tritonkv.compress((K, V), "knorm", 20, foo=1, kernel_size=3),
     ["'foo'", "'kernel_size'", "keyword arguments"]),
    ("nothing like it", lambda: tritonkv.compress((K, V), "knorm", 20, zzz=1),
     ["'zzz'", "The inputs compress() accepts: ", "queries"]),
]


@pytest.mark.parametrize("desc,call,words", UNKNOWN, ids=[u[0] for u in UNKNOWN])
def test_unknown_keyword_is_a_type_error_naming_it(desc, call, words):
    assert_raises_naming(call, TypeError, words, desc)


def test_every_known_input_is_accepted():
    """The names in INPUTS (and a policy's own needs/accepts) pass the keyword check."""
    from tritonkv.api import INPUTS, check_input_names

    check_input_names({n: None for n in INPUTS}, "knorm", "adakv")
    k, v = _kv()
    out = tritonkv.compress((k, v), "knorm", 50, layer=0, num_layers=4, positions=torch.arange(50), hd=None)
    assert out.keys is k

    import dataclasses
    from typing import ClassVar

    @dataclasses.dataclass
    class Custom(tritonkv.Policy):  # not registered: its needs/accepts come from the object
        name: ClassVar[str] = "test_custom_inputs"
        needs: ClassVar[tuple] = ("bias",)
        accepts: ClassVar[tuple] = ("temperature",)

        def score(self, keys, values, bias=None, temperature=1.0, **inputs):
            return -keys.float().norm(dim=-1) + 0 * bias

    check_input_names({"bias": 1, "temperature": 2.0}, Custom())
    with pytest.raises(TypeError, match="'bias'"):
        check_input_names({"bias": 1}, "knorm")


@pytest.mark.parametrize("np_budget,py_budget", [
    (np.float32(0.7), 0.7), (np.float32(0.29), 0.29), (np.float16(0.25), 0.25), (np.float64(0.3), 0.3),
    (np.int64(10), 10), (np.int32(7), 7), (np.uint8(3), 3)])
def test_numpy_scalar_budget_is_the_python_number(np_budget, py_budget):
    for n in (10, 50, 100, 1000, 4096, 131072):
        assert resolve_budget(np_budget, n) == resolve_budget(py_budget, n), (np_budget, n)
    k, v = _kv()
    a, b = tritonkv.compress((k, v), "knorm", np_budget), tritonkv.compress((k, v), "knorm", py_budget)
    assert torch.equal(a.indices, b.indices) and torch.equal(a.keys, b.keys)


def test_numpy_float32_fractions_match_python_floats():
    """float32 cannot hold 0.7 (it holds 0.69999999): the budget is still the fraction written."""
    for i in range(1, 101):
        f = i / 100
        for n in (10, 100, 777, 32768):
            assert resolve_budget(np.float32(f), n) == resolve_budget(f, n), (f, n)


@pytest.mark.parametrize("bad,exc", [(np.float32(1.5), ValueError), (np.float32("nan"), ValueError),
                                     (np.int64(0), ValueError), (np.bool_(True), TypeError)])
def test_numpy_scalar_budget_out_of_range(bad, exc):
    assert_raises_naming(lambda: tritonkv.compress(_kv(), "knorm", bad), exc, ["budget"])


NAMES = [
    # (description, call, words the ValueError must contain)
    ("policy case", lambda: tritonkv.get_policy("SnapKV"), ["'SnapKV'", "did you mean 'snapkv'?"]),
    ("policy underscore", lambda: tritonkv.get_policy("streamingllm"), ["did you mean 'streaming_llm'?"]),
    ("policy class name", lambda: tritonkv.get_policy("CriticalKV"), ["did you mean 'criticalkv'?"]),
    ("policy typo", lambda: tritonkv.get_policy("keydif"), ["did you mean 'keydiff'?"]),
    ("an allocator as policy", lambda: tritonkv.get_policy("adakv"), ["'adakv' is an allocator", "allocation='adakv'"]),
    ("PyramidKV as policy", lambda: tritonkv.get_policy("PyramidKV"), ["'pyramid' is an allocator"]),
    ("shared name, policy side", lambda: tritonkv.get_policy("SCORE"),
     ["did you mean 'score'?", "redundancy-penalised selection", "allocation='score'"]),
    ("allocator case", lambda: tritonkv.get_allocator("AdaKV"), ["'AdaKV'", "did you mean 'adakv'?"]),
    ("a policy as allocator", lambda: tritonkv.get_allocator("snapkv"), ["'snapkv' is a policy, not an allocator"]),
    ("shared name, allocator side", lambda: tritonkv.get_allocator("SurfaceLogic"),
     ["did you mean 'surfacelogic'?", "allocation='surfacelogic'", "INF-profile"]),
    ("through compress", lambda: tritonkv.compress((K, V), "Knorm", 10), ["policy", "did you mean 'knorm'?"]),
    ("allocation through compress", lambda: tritonkv.compress((K, V), "knorm", 10, allocation="Pyramid"),
     ["allocation", "did you mean 'pyramid'?"]),
    ("no near match", lambda: tritonkv.get_policy("zzzz"), ["unknown name 'zzzz'. known: "]),
]


@pytest.mark.parametrize("desc,call,words", NAMES, ids=[n[0] for n in NAMES])
def test_unknown_name_suggests_the_near_one(desc, call, words):
    assert_raises_naming(call, ValueError, words, desc)


def test_shared_name_policy_says_which_is_which():
    """compress(kv, "score", ...) without hd says the allocator of that name is allocation='score'."""
    assert_raises_naming(lambda: tritonkv.compress((K, V), "score", 40, queries=Q), ValueError,
                         ["hd", "allocation='score'"])
    doc = tritonkv.compress.__doc__
    assert "allocation=\"score\"" in doc and "surfacelogic" in doc


# -- layout mistakes do not pass silently ---------------------------------------------------

def test_queries_in_token_major_layout_are_an_error():
    q = Q.transpose(1, 2)[:, :7]  # [B, W=7, H_q=4, D]: W is not a multiple of H_kv = 2
    assert_raises_naming(lambda: tritonkv.compress((K, V), "snapkv", 40, queries=q), ValueError,
                         ["queries", "H_q", "multiple", "[B, H_kv, N, D]", "[B, H_q, W, D]", "[B, W, H_q, D]",
                          "queries.transpose(1, 2)"])


def test_queries_in_token_major_layout_with_o_proj_are_named():
    """W = 8 divides by H_kv = 2, so only W_O's width shows that the heads are in the third dimension."""
    q = Q.transpose(1, 2)  # [B, W=8, H_q=4, D]
    assert_raises_naming(lambda: tritonkv.compress((K, V), "criticalkv", 40, queries=q, o_proj=WO), ValueError,
                         ["o_proj", "[B, W, H_q, D]", "queries.transpose(1, 2)"])


def test_keys_with_more_heads_than_tokens_warn():
    kt, vt = K.transpose(1, 2), V.transpose(1, 2)  # [B, N=50, H=2, D] read as 50 heads of 2 tokens
    with pytest.warns(UserWarning, match=r"H_kv = 50 > N = 2.*\[B, H_kv, N, D\].*keys\.transpose\(1, 2\)"):
        out = tritonkv.compress((kt, vt), "knorm", 10)  # budget >= N: returned as is, but still warned
    assert out.keys is kt
    with pytest.warns(UserWarning, match="more heads than tokens"), \
            pytest.raises(ValueError, match=r"keys look like \[B, N, H_kv, D\]"):
        tritonkv.compress((kt, vt), "snapkv", 1, queries=Q)  # H_q = 4 is not a multiple of "H_kv" = 50


def test_plain_layout_does_not_warn():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tritonkv.compress((K, V), "knorm", 50)
        tritonkv.compress((K[:, :, :2], V[:, :, :2]), "knorm", 2)  # H_kv = N: not more heads than tokens


# -- queries layout: recognised from the keys' H_kv, o_proj's width, attn_lse's shape and the policy's window -------

def _kvh(H, N=64, D=16):
    g = torch.Generator().manual_seed(5)
    return torch.randn(1, H, N, D, generator=g), torch.randn(1, H, N, D, generator=g)


def test_token_major_queries_whose_window_divides_by_h_kv_are_caught():
    """H_kv = 8, H_q = 32 queries of W = 16 tokens passed as [B, W, H_q, D]: W is a multiple of H_kv, so the head
    count alone cannot tell; attn_lse [B, H_q, W] or W_O's width can (an error), the policy's window W hints at it (a
    warning: a model may have as many query heads as the window). All were silently accepted before: the scores came
    from the wrong heads."""
    k, v = _kvh(8)
    q = torch.randn(1, 32, 16, 16).transpose(1, 2)  # [B, W=16, H_q=32, D]
    lse = torch.randn(1, 32, 16)
    want = ["queries", "[B, W, H_q, D]", "[B=1, H_q=32, W=16, D=16]", "queries.transpose(1, 2)"]
    assert_raises_naming(lambda: tritonkv.compress((k, v), "snapkv", 40, queries=q, attn_lse=lse), ValueError,
                         want + ["attn_lse"], "attn_lse shows it")
    snap16 = tritonkv.policies.SnapKV(window=16)
    with pytest.warns(UserWarning) as rec:  # the window alone is a hint (H_q may equal it): a warning, not an error
        tritonkv.compress((k, v), snap16, 40, queries=q)
    msg = str(rec[-1].message)
    assert all(s in msg for s in want + ["window of W = 16", "queries[:, :, -16:]"]), msg
    crit = tritonkv.policies.CriticalKV(base=snap16)
    wo = torch.randn(64, 32 * 16)
    assert_raises_naming(lambda: tritonkv.compress((k, v), crit, 40, queries=q, o_proj=wo), ValueError,
                         want + ["o_proj"], "W_O's width shows it")


def test_queries_in_the_right_layout_pass():
    """The same shapes the right way round, fewer queries than the window (the transformers integration's first
    block), and 16 heads of 32 queries with a window of 16 when attn_lse confirms it, are accepted."""
    k, v = _kvh(8)
    q, lse = torch.randn(1, 32, 16, 16), torch.randn(1, 32, 16)
    snap16, snap32 = tritonkv.policies.SnapKV(window=16), tritonkv.policies.SnapKV(window=32)
    for pol, inputs in ((snap16, dict(queries=q)), (snap32, dict(queries=q, attn_lse=lse)),
                        (tritonkv.policies.SnapKV(window=32, sink=0), dict(queries=q[:, :, :5])),
                        (tritonkv.policies.SnapKV(window=16), dict(queries=q.transpose(1, 2), attn_lse=lse.transpose(1, 2)))):
        tritonkv.api._check_inputs(k, inputs, pol)  # no error (the kernels are covered elsewhere)
    out = tritonkv.compress((k, v), snap16, 40, queries=q)
    assert out.keys.shape == (1, 8, 40, 16)


def test_wrong_head_count_in_the_right_layout_has_no_transpose_hint():
    """[B, H_q = 6, W = 32, D] against H_kv = 4 with the policy's window of 32: the layout is right, the head count
    is not; the message must not tell the user to transpose (it did: W = 32 divides by 4)."""
    k, v = _kvh(4)
    q = torch.randn(1, 6, 32, 16)
    with pytest.raises(ValueError) as e:
        tritonkv.compress((k, v), "snapkv", 40, queries=q)
    msg = str(e.value)
    assert "queries" in msg and "H_q = 6 is not a multiple of 4" in msg and "[B=1, H_q, W, D=16]" in msg, msg
    assert "queries.transpose" not in msg and "look like [B, W, H_q, D]" not in msg, msg


def test_compression_ratio_instead_of_a_budget_is_explained():
    """kvpress's call shape compress(kv, press, compression_ratio=r): the TypeError docs/contracts.md promises (it was
    Python's generic 'missing 1 required positional argument')."""
    assert_raises_naming(lambda: tritonkv.compress((K, V), "keydiff", compression_ratio=0.5), TypeError,
                         ["budget", "'compression_ratio'", "fraction removed", "budget = 1 - compression_ratio",
                          "compress(kv, policy, 0.5)"], "compression_ratio for the budget")
    assert_raises_naming(lambda: tritonkv.compress((K, V), "keydiff"), TypeError,
                         ["missing the budget", "fraction kept"], "no budget")


# -- host overhead: memoised checks, the eager fast path, launch recording ---------------------------------------

def test_input_names_check_is_memoised_per_type_but_not_for_instance_names(monkeypatch):
    """The accepted names are computed once per (policy type, allocator type, names); a name accepted only through
    one object's own ``needs`` is not remembered for another object of the same type."""
    import dataclasses
    from typing import ClassVar

    from tritonkv import diagnostics
    from tritonkv.api import check_input_names

    @dataclasses.dataclass
    class Custom(tritonkv.Policy):
        name: ClassVar[str] = "custom_memo"
        extra: str = "bias"

        @property
        def needs(self):
            return (self.extra,)

    calls = []
    orig = diagnostics.accepted_inputs
    monkeypatch.setattr(diagnostics, "accepted_inputs", lambda *a: calls.append(a) or orig(*a))
    check_input_names({"queries": Q, "layer": 1}, "snapkv", "pyramid")
    n = len(calls)
    assert n > 0
    check_input_names({"layer": 2, "queries": Q}, tritonkv.policies.SnapKV(window=4), "pyramid")
    assert len(calls) == n  # memoised
    check_input_names({"bias": 1}, Custom())
    with pytest.raises(TypeError, match="'bias'"):
        check_input_names({"bias": 1}, Custom(extra="other"))


def test_eager_compress_bypasses_the_op_dispatcher():
    """Eager calls run the launcher bodies directly: no ``tritonkv::`` op reaches the dispatcher (the profiler
    records every dispatched op); the ops stay registered for torch.compile/export (tests/test_export.py)."""
    from torch.profiler import ProfilerActivity, profile

    from tritonkv.kernels.select import select_into

    k, v = _kv()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = tritonkv.compress((k, v), "knorm", 20)
    names = {e.name for e in prof.events()}
    assert not any(n.startswith("tritonkv::") for n in names), sorted(n for n in names if "tritonkv" in n)
    assert out.keys.shape == (1, 2, 20, 16)
    assert str(select_into.op._opoverload) == "tritonkv.select_into.default"


def test_record_launches_logs_and_dry_run_skips():
    """record_launches logs each kernel launch (name, grid, constexprs, options, arguments) and, with
    ``execute=False``, does not run it; blocks do not nest; outside a block launches run unrecorded."""
    import triton
    import triton.language as tl

    from tritonkv.kernels._common import launch, pdl, record_launches

    @triton.jit
    def _fill_kernel(out_ptr, n, value, BLOCK: tl.constexpr, PDL: tl.constexpr):  # PDL: given by launch
        pdl_wait(PDL)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.zeros([BLOCK], tl.float32) + value, mask=offs < n)

    out = torch.zeros(10, device="cuda" if torch.cuda.is_available() else "cpu")  # the interpreter runs CPU tensors
    with record_launches(execute=False) as log:
        launch(_fill_kernel, (2,), out, 10, 3.0, BLOCK=8, num_warps=1)
        with pytest.raises(RuntimeError, match="nest"):
            with record_launches():
                pass
    assert torch.equal(out.cpu(), torch.zeros(10))  # not run
    (rec,) = log
    on = pdl(out)  # {"PDL": False} but on an sm_90+ GPU
    assert rec.name == "_fill_kernel" and rec.grid == (2,) and rec.constexprs == {"BLOCK": 8, "PDL": on["PDL"]}
    assert rec.options == {"num_warps": 1, **({"launch_pdl": True} if on["PDL"] else {})}
    assert rec.args["n"] == 10 and rec.args["out_ptr"] is out
    with record_launches() as log:
        launch(_fill_kernel, (2,), out, 10, 3.0, BLOCK=8)
    assert len(log) == 1 and torch.equal(out.cpu(), torch.full((10,), 3.0))
    launch(_fill_kernel, (2,), out, 10, 5.0, BLOCK=8)
    assert len(log) == 1 and torch.equal(out.cpu(), torch.full((10,), 5.0))


def test_every_policy_module_is_imported():
    """tritonkv.policies imports its modules by name: a module added without its import line would register
    nothing."""
    import importlib
    import pkgutil

    import tritonkv.policies as pkg

    for m in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"tritonkv.policies.{m.name}")
        for obj in vars(mod).values():
            if isinstance(obj, type) and obj.__module__ == mod.__name__ and getattr(obj, "name", "") \
                    and issubclass(obj, tritonkv.Policy):
                assert tritonkv.POLICIES.get(obj.name) is obj and getattr(pkg, obj.__name__) is obj, obj
