"""The shared select + compact op against the oracle (kept indices compared exactly): the Triton
kernels (interpreted) and the CPU PyTorch body, against the oracle and against each other (every
output, every slot), graph capture of the PyTorch body, and the kernels' AOT compile."""
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from aot import assert_compiles
from reference.select import select as ref_select, select_rows
from tritonkv.kernels._common import use_triton
from tritonkv.kernels.select import CAND_TILE, COMPACT_STAGES, SB, Out, select_indices, select_kv, select_mask
from helpers import both_backends, on_backend  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@st.composite
def score_rows(draw, max_rows=8, max_n=300):
    rows = draw(st.integers(1, max_rows))
    n = draw(st.integers(1, max_n))
    kind = draw(st.sampled_from(["normal", "ties", "special", "ints"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    if kind == "normal":
        s = rng.standard_normal((rows, n)).astype(np.float32)
    elif kind == "ties":  # few distinct values: the tie rule decides
        s = rng.integers(-2, 3, (rows, n)).astype(np.float32)
    elif kind == "ints":
        s = rng.integers(-1000, 1000, (rows, n)).astype(np.float32) * 1e-3
    else:  # NaN, ±inf, ±0, subnormals, huge
        vals = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, 3e38, -3e38, 1.0, -1.0], np.float32)
        s = rng.choice(vals, (rows, n)).astype(np.float32)
    return s


@both_backends
@given(s=score_rows(), data=st.data())
def test_select_matches_oracle(backend, s, data):
    rows, n = s.shape
    sink = data.draw(st.integers(0, min(4, n)))
    window = data.draw(st.integers(0, n - sink))
    budgets = np.array([data.draw(st.integers(sink + window, n + 3)) for _ in range(rows)])
    k_max = int(min(budgets.max(), n))
    with on_backend(backend):
        idx, lengths = select_indices(torch.from_numpy(s), torch.from_numpy(budgets), k_max, sink=sink, window=window)
    ref = select_rows(s, budgets, sink, window)
    for r in range(rows):
        kept = idx[r, : lengths[r]].numpy()
        np.testing.assert_array_equal(kept, ref[r])
        assert (idx[r, lengths[r]:] == -1).all()


@settings(max_examples=10)
@given(s=score_rows(max_rows=3, max_n=200), data=st.data())
def test_chunking_does_not_change_result(s, data):
    """Bit-identical kept sets whatever the split count (integer atomics, deterministic)."""
    rows, n = s.shape
    k = data.draw(st.integers(0, n))
    a = select_indices(torch.from_numpy(s), k, k, chunk=16)
    b = select_indices(torch.from_numpy(s), k, k, chunk=64)
    c = select_indices(torch.from_numpy(s), k, k)
    assert torch.equal(a[0], b[0]) and torch.equal(a[0], c[0])
    for r in range(rows):
        np.testing.assert_array_equal(a[0][r].numpy(), ref_select(s[r], k))


@both_backends
@given(s=score_rows(max_rows=4, max_n=120), data=st.data())
def test_forced_tokens_are_kept(backend, s, data):
    rows, n = s.shape
    rng = np.random.default_rng(data.draw(st.integers(0, 1000)))
    forced = rng.random((rows, n)) < 0.2
    k = int(forced.sum(1).max()) + data.draw(st.integers(0, n))
    with on_backend(backend):
        idx, lengths = select_indices(torch.from_numpy(s), k, min(k, n), forced=torch.from_numpy(forced))
    for r in range(rows):
        np.testing.assert_array_equal(idx[r, : lengths[r]].numpy(), ref_select(s[r], k, forced=forced[r]))


@both_backends
@pytest.mark.parametrize("dtype", DTYPES)
@given(data=st.data())
def test_select_kv_gathers_rows(backend, dtype, data):
    B = data.draw(st.integers(1, 2))
    H = data.draw(st.integers(1, 4))
    N = data.draw(st.integers(1, 150))
    D = data.draw(st.sampled_from([16, 64, 128]))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    keys = torch.randn(B, H, N, D, generator=g).to(dtype)
    values = torch.randn(B, H, N, D, generator=g).to(dtype)
    scores = torch.randn(B, H, N, generator=g)
    sink = data.draw(st.integers(0, min(2, N)))
    window = data.draw(st.integers(0, min(3, N - sink)))
    k = data.draw(st.integers(sink + window, N))
    with on_backend(backend):
        ko, vo, idx, lengths = select_kv(scores, k, keys, values, k, sink=sink, window=window)
    assert ko.shape == (B, H, k, D) and ko.dtype == dtype and (lengths == k).all()
    for b in range(B):
        for h in range(H):
            ref = ref_select(scores[b, h].numpy(), k, sink, window)
            np.testing.assert_array_equal(idx[b, h].numpy(), ref)
            assert torch.equal(ko[b, h], keys[b, h, ref]) and torch.equal(vo[b, h], values[b, h, ref])


@both_backends
def test_select_kv_per_row_budgets_and_strided_input(backend):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 40, 3, 16, generator=g)  # [B, N, H, D] storage, viewed as [B, H, N, D]
    keys = base.permute(0, 2, 1, 3)
    values = (base * 2).permute(0, 2, 1, 3)
    scores = torch.randn(2, 3, 40, generator=g)
    budgets = torch.tensor([1, 5, 40, 0, 17, 60])
    with on_backend(backend):
        ko, vo, idx, lengths = select_kv(scores, budgets, keys, values, 40)
    assert lengths.flatten().tolist() == [1, 5, 40, 0, 17, 40]
    for r in range(6):
        b, h = divmod(r, 3)
        ref = ref_select(scores[b, h].numpy(), int(budgets[r]))
        n = len(ref)
        np.testing.assert_array_equal(idx[b, h, :n].numpy(), ref)
        assert torch.equal(ko[b, h, :n], keys[b, h, ref]) and torch.equal(vo[b, h, :n], values[b, h, ref])
        assert (ko[b, h, n:] == 0).all() and (idx[b, h, n:] == -1).all()


@both_backends
def test_invariant_under_increasing_transform(backend):
    s = torch.randn(4, 97, generator=torch.Generator().manual_seed(3))
    with on_backend(backend):
        a = select_mask(s, 20, sink=1, window=2)
        b = select_mask(torch.exp(s) * 3 - 1, 20, sink=1, window=2)
    assert torch.equal(a, b) and (a.sum(1) == 20).all()


@both_backends
def test_negative_zero_ties_positive_zero(backend):
    s = torch.tensor([[-0.0, 0.0, -0.0, 0.0]])
    with on_backend(backend):
        np.testing.assert_array_equal(select_indices(s, 2, 2)[0][0].numpy(), [0, 1])


@both_backends
def test_plus_inf_never_displaces_protected(backend):
    s = torch.tensor([[1.0, float("inf"), float("inf"), 2.0, 0.5]])
    with on_backend(backend):
        np.testing.assert_array_equal(select_indices(s, 3, 3, sink=1, window=1)[0][0].numpy(), [0, 1, 4])
        # a forced token outranks +inf too; NaN ranks as -inf (ties to the lower index)
        s = torch.tensor([[float("nan"), float("inf"), float("-inf"), float("nan"), float("-inf")]])
        np.testing.assert_array_equal(select_indices(s, 3, 3, forced=torch.tensor([[0, 0, 0, 1, 0]]))[0][0].numpy(),
                                      [0, 1, 3])


@both_backends
def test_strided_budget_view_is_read_correctly(backend):
    s = torch.randn(2, 30, generator=torch.Generator().manual_seed(1))
    lb = torch.tensor([[7, 2, 9], [1, 5, 3]])
    with on_backend(backend):
        assert select_mask(s, lb[:, 1]).sum(1).tolist() == [2, 5]


@st.composite
def into_case(draw):
    """Scores, per-row budgets (0, protected, N - 1, N, > N) and one int budget, a static k_max (0 to
    > N), maybe forced tokens, K/V of any dtype, head size and strides, and row starts in a shuffled
    order with gaps."""
    s = draw(score_rows(max_rows=6, max_n=90))
    R, N = s.shape
    sink = draw(st.integers(0, min(3, N)))
    window = draw(st.integers(0, min(3, N - sink)))
    k_max = draw(st.sampled_from([0, 1, N - 1, N, N + 4, draw(st.integers(0, N))]))
    budgets = [draw(st.sampled_from([0, sink + window, N - 1, N, N + 3, draw(st.integers(0, N))])) for _ in range(R)]
    int_budget = draw(st.sampled_from([sink + window, k_max, N + 2, draw(st.integers(sink + window, N))]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    forced = rng.random((R, N)) < 0.1 if draw(st.booleans()) else None
    dtype = draw(st.sampled_from(DTYPES))
    D = draw(st.sampled_from([1, 5, 16, 48]))
    kv = [torch.from_numpy(rng.standard_normal((1, N, R, D))).to(dtype).transpose(1, 2) for _ in range(2)]
    if draw(st.booleans()):
        kv = [t.contiguous() for t in kv]
    cap = max(min(k_max, N), 1)
    gaps = rng.integers(0, 3, R)
    start = (np.cumsum(gaps + cap) - cap)[rng.permutation(R)]
    return s, budgets, int_budget, k_max, sink, window, forced, kv, torch.from_numpy(start), int(start.max()) + cap + 2


@settings(max_examples=20)
@given(case=into_case())
def test_torch_body_equals_kernel_in_every_slot(case):
    """Same inputs, both backends: identical lengths, masks and every slot of the flat outputs (the
    kept rows written, every other slot untouched; outputs prefilled with markers), and identical
    dense outputs for an int budget."""
    s, budgets, kb, k_max, sink, window, forced, (keys, values), start, T = case
    R, N = s.shape
    scores = torch.from_numpy(s).view(1, R, N)
    b = torch.tensor(budgets, dtype=torch.int32)
    f = None if forced is None else torch.from_numpy(forced)
    got = {}
    for backend in ("triton", "torch"):
        with on_backend(backend):
            idx, lengths, mask = select_indices(scores, b, k_max, sink=sink, window=window, forced=f, with_mask=True)
            D = keys.shape[-1]
            out = Out(torch.full((T, D), 7.0, dtype=keys.dtype), torch.full((T, D), -7.0, dtype=keys.dtype),
                      torch.full((T,), -2, dtype=torch.int64), start, torch.full((R,), -5, dtype=torch.int32))
            select_kv(scores, b, keys, values, k_max, sink=sink, window=window, forced=f, out=out)
            dense = ()  # an int budget: dense outputs (every row full when kb >= k_max: a direct gather)
            if min(sink + window, N) <= min(k_max, N):  # else a ValueError (the budget cannot hold them)
                dense = select_kv(scores, kb, keys, values, k_max, sink=sink, window=window, forced=f)
        got[backend] = (idx, lengths, mask) + tuple(out) + dense
    for a, c in zip(got["triton"], got["torch"]):
        assert a.dtype == c.dtype and torch.equal(a, c)
    kk = min(k_max, N)
    want = select_rows(s, np.minimum(budgets, kk), sink, window, forced)
    lengths = got["torch"][1].flatten().tolist()
    assert lengths == got["torch"][7].tolist() == [len(w) for w in want]
    idx = got["torch"][0].view(R, k_max)
    for r in range(R):
        np.testing.assert_array_equal(idx[r, :lengths[r]].numpy(), want[r])


def test_meta_tensors_and_unsupported_devices():
    """Meta tensors (shape inference) run the PyTorch body; a device with neither (mps, xpu, ...) is a
    ValueError that names it."""
    s, k = torch.randn(2, 3, 40, device="meta"), torch.randn(2, 3, 40, 16, device="meta")
    assert not use_triton(s)
    ko, vo, idx, lengths = select_kv(s, 5, k, k, 5)
    assert ko.device.type == "meta" and ko.shape == (2, 3, 5, 16) and idx.shape == (2, 3, 5)
    assert select_mask(s, 5).shape == (2, 3, 40)
    for dev in ("mps", "xpu"):
        with pytest.raises(ValueError, match=dev):
            use_triton(types.SimpleNamespace(device=torch.device(dev)))


_CAPTURE = r"""
import torch, torch._dynamo
from tritonkv.kernels.select import select_indices, select_kv
class M(torch.nn.Module):
    def forward(self, s, k, v, b):
        return select_kv(s, b, k, v, 24, sink=1, window=2)
g = torch.Generator().manual_seed(0)
s = torch.randn(2, 3, 40, generator=g)
k, v = torch.randn(2, 3, 40, 16, generator=g), torch.randn(2, 3, 40, 16, generator=g)
b = torch.tensor([24, 3, 0, 17, 50, 8], dtype=torch.int32)
eager = M()(s, k, v, b)
ep = torch.export.export(M(), (s, k, v, b), strict=True)
ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
assert any("tritonkv.select_into" in o for o in ops), ops
assert all(torch.equal(a, e) for a, e in zip(ep.module()(s, k, v, b), eager))
print("exported select_kv")
def f(s, k, v, b):
    return select_kv(s, b, k, v, 24, sink=1, window=2) + select_indices(s, b, 24, with_mask=True)
explain = torch._dynamo.explain(f)(s, k, v, b)
assert explain.graph_break_count == 0, explain.break_reasons
cf = torch.compile(f, fullgraph=True, backend="aot_eager")
assert all(torch.equal(a, e) for a, e in zip(cf(s, k, v, b), f(s, k, v, b)))
print("compiled select")
"""


def test_torch_body_exports_and_compiles_without_graph_break():
    """Without the interpreter CPU tensors run the PyTorch body: torch.export (strict) captures one
    ``tritonkv::select_into`` op, ``torch.compile(fullgraph=True)`` (aot_eager) has no graph break,
    and both give the eager result."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITONKV_CPU_KERNELS")}
    r = subprocess.run([sys.executable, "-c", _CAPTURE], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "exported select_kv" in r.stdout and "compiled select" in r.stdout


def test_budget_tensor_errors():
    s = torch.randn(2, 10)
    with pytest.raises(ValueError, match="budgets"):
        select_indices(s, torch.tensor([1, 2, 3]), 3)
    with pytest.raises(TypeError, match="budgets"):
        select_indices(s, torch.tensor([1.0, 2.0]), 3)
    with pytest.raises(TypeError, match="budget"):
        select_indices(s, 2.5, 3)


def test_select_kernels_compile_ahead_of_time():
    mod = "tritonkv.kernels.select"
    flags = {"HAS_FORCED": True, "UNIFORM": False}
    const = {n: "constexpr" for n in ("TILE", "CT", "NB", "SB", "CB", "BATCH", "STAGES", "BLOCK_D", "HAS_FORCED",
                                      "UNIFORM", "HAS_KV", "WRITE_MASK", "HAS_START", "PROTECTED_ONLY")}
    row = {"N": "i32", "sink": "i32", "window": "i32"}
    hist0 = {"module": mod, "kernel": "_select_hist0_kernel",
             "signature": {"s_ptr": "*fp32", "f_ptr": "*u8", "h0_ptr": "*i32", **row, "CHUNK": "i32", "C0": "i32",
                           **{n: const[n] for n in ("TILE", "NB", "HAS_FORCED")}},
             "constexprs": {"TILE": 1024, "NB": 256, "HAS_FORCED": True}}
    finish = {"module": mod, "kernel": "_select_finish_kernel",
              "signature": {"s_ptr": "*fp32", "f_ptr": "*u8", "budget_ptr": "*i32", "h0_ptr": "*i32", "C0": "i32",
                            "p1_ptr": "*i32", "cnt_ptr": "*i32", **row, "k_max": "i32", "CHUNK": "i32",
                            **{n: const[n] for n in ("TILE", "NB", "SB", "HAS_FORCED", "UNIFORM")}},
              "constexprs": {"TILE": 1024, "NB": 256, "SB": SB, **flags}}
    tail = {"module": mod, "kernel": "_select_tail_kernel",
            "signature": {"s_ptr": "*fp32", "f_ptr": "*u8", "h0_ptr": "*i32", "C0": "i32", "p2_ptr": "*i32",
                          "cnt_ptr": "*i32", "cand_ptr": "*i64", **row, "CHUNK": "i32",
                          **{n: const[n] for n in ("TILE", "CT", "NB", "SB", "CB", "HAS_FORCED")}},
            "constexprs": {"TILE": 1024, "CT": CAND_TILE, "NB": 256, "SB": SB, "CB": 256, "HAS_FORCED": True}}
    compact = {"module": mod, "kernel": "_select_compact_kernel",
               "signature": {"s_ptr": "*fp32", "f_ptr": "*u8", "budget_ptr": "*i32", "cnt_ptr": "*i32", **row,
                             "k_max": "i32", "C": "i32", "CHUNK": "i32", "start_ptr": "*i64", "stride": "i32",
                             "idx_ptr": "*i64", "len_ptr": "*i32", "mask_ptr": "*i8", "k_ptr": "*bf16",
                             "v_ptr": "*bf16", "ko_ptr": "*bf16", "vo_ptr": "*bf16", "H": "i32", "skb": "i64",
                             "skh": "i64", "skn": "i64", "svb": "i64", "svh": "i64", "svn": "i64", "D": "i32",
                             **{n: const[n] for n in ("TILE", "BATCH", "STAGES", "BLOCK_D", "HAS_FORCED", "HAS_KV",
                                                      "WRITE_MASK", "UNIFORM", "HAS_START", "PROTECTED_ONLY")}},
               "constexprs": {"TILE": 256, "BATCH": 128, "STAGES": COMPACT_STAGES, "BLOCK_D": 128, "HAS_KV": True,
                              "WRITE_MASK": True,
                              "HAS_START": True, "PROTECTED_ONLY": False, **flags}}
    direct = {**compact, "constexprs": {**compact["constexprs"], "HAS_FORCED": False, "UNIFORM": True,
                                        "WRITE_MASK": False, "HAS_START": False, "PROTECTED_ONLY": True}}
    assert_compiles(hist0, finish, tail, compact, direct)


_GPU_LAUNCHES = r"""
import json, os, sys
from benchmarks import kernel_stats as ks  # drops TRITON_INTERPRET: the launchers take their GPU branch
import torch, tritonkv
from tritonkv.kernels import select as sel

def variant(rec):
    # what picks a compiled kernel: constexprs, launch options, and the specialisation of the ints
    # Triton specialises on (== 1, divisible by 16)
    params = {p.name: p for p in rec.kernel.params}
    ints = sorted((n, v == 1, v % 16 == 0) for n, v in rec.args.items()
                  if isinstance(v, int) and not isinstance(v, bool) and not params[n].do_not_specialize)
    return [rec.name, sorted((k, repr(v)) for k, v in rec.constexprs.items()), sorted(rec.options.items()), ints]

out = {}
for n in (1040, 5008, 40000):  # three power-of-two buckets (all multiples of 16, as N is specialised on)
    inp = ks.make_inputs(n)
    k, v = inp["keys"], inp["values"]
    runs = {name: (lambda name=name: tritonkv.compress((k, v), name, 0.25)) for name in ks.KEY_ONLY}
    pool = inp["pool"]
    for name in ("snapkv", "tova", "lagkv", "criticalkv"):  # window attention, LagKV, CriticalKV's value norms
        pol = tritonkv.POLICIES[name]()
        runs[name] = lambda pol=pol: tritonkv.compress((k, v), pol, 0.25, **{x: pool[x] for x in pol.needs})
    runs["knorm_window"] = lambda: tritonkv.compress((k, v), tritonkv.POLICIES["knorm"](sink=4, window=n // 10), 0.3)
    runs["select_kv_budgets"] = lambda: sel.select_kv(torch.empty(1, 8, n), torch.arange(8, dtype=torch.int32) * 7,
                                                      k, v, n // 3, sink=3, window=5)
    runs["select_mask"] = lambda: sel.select_mask(torch.empty(1, 8, n), n // 5, sink=1, window=9)
    for name, fn in runs.items():
        log, ops, err = ks.dry(fn)
        assert err is None, (name, err)
        launches = len(log) + sum(o["kind"] in ("fill", "compute") for o in ops)
        out.setdefault(name, []).append(dict(variants=[variant(r) for r in log], triton=len(log), all=launches,
                                             syncs=sum(o["kind"] == "sync" for o in ops)))
print(json.dumps(out))
"""


def test_gpu_launches_compile_once_and_stay_few():
    """The launches a GPU run makes (logged, not run; ``benchmarks/kernel_stats.py``'s dry run, no
    interpreter): a new N in another power-of-two bucket picks no new compiled variant of any kernel
    (CHUNK, C and the budget-dependent scalars are runtime, unspecialised arguments; the key-only
    policies, window attention, LagKV and CriticalKV are checked), and a compress
    by a key-only policy makes at most 4 (KeyDiff 5) device launches (Triton + torch-side), with no host sync."""
    import json

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITONKV_CPU_KERNELS")}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", _GPU_LAUNCHES], capture_output=True, text=True, env=env, timeout=600,
                       cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for name, per_n in res.items():
        assert all(x["variants"] == per_n[0]["variants"] for x in per_n), name
        assert all(x["syncs"] == 0 for x in per_n), name
    for name, most in (("keydiff", 5), ("knorm", 4), ("streaming_llm", 4)):
        assert all(x["triton"] <= most and x["all"] <= most for x in res[name]), (name, res[name])
    assert res["streaming_llm"][0]["all"] == 1  # only protected tokens: one direct copy, no score fill
    assert res["knorm"][0]["all"] == 4 and res["keydiff"][0]["all"] == 5  # first radix pass in the score
