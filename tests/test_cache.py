"""RaggedKV layout properties (docs/architecture.md, "RaggedKV") against the list-of-rows oracle, with the Triton kernels
(interpreted) and the CPU PyTorch bodies; the raw append op on both, and its graph capture."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from aot import assert_compiles
from reference.cache import Rows, layout as ref_layout
from reference.select import select as ref_select
from tritonkv.cache import LAYOUT_BLOCK, RaggedKV, ragged_append, ragged_layout
from tritonkv.policies.base import Policy
from helpers import assert_raises_naming, both_backends, on_backend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _layout_ok(c: RaggedKV):
    rs, ln = c.row_start, c.length.to(torch.int64)
    cap = rs[1:] - rs[:-1]
    assert rs.dtype == torch.int64 and c.length.dtype == torch.int32 and c.positions.dtype == torch.int64
    assert rs[0] == 0 and (cap >= 0).all() and rs[-1] <= c.keys.shape[0]  # monotone, inside T_cap
    assert ((ln >= 0) & (ln <= cap)).all() and cap.max() <= c.max_capacity
    c.check()


def _same_as_model(c: RaggedKV, model: Rows):
    """Every row holds exactly the model's tokens, in order, with their positions."""
    assert c.lengths.tolist() == model.lengths().tolist()
    cap = int(model.lengths().max())
    K, V, L, P = c.to_padded(cap + 2, with_positions=True)
    mk, mv, mp = model.padded(cap + 2)
    assert torch.equal(K.double().cpu(), torch.from_numpy(mk)) and torch.equal(V.double().cpu(), torch.from_numpy(mv))
    assert torch.equal(P.cpu(), torch.from_numpy(mp))
    for r in range(c.length.numel()):  # the flat rows themselves, not only their padded copy
        s, n = int(c.row_start[r]), int(c.length[r])
        assert c.positions[s:s + n].tolist() == mp.reshape(-1, cap + 2)[r, :n].tolist()


@st.composite
def selection_case(draw, max_n=120):
    B = draw(st.integers(1, 2))
    H = draw(st.integers(1, 3))
    N = draw(st.integers(1, max_n))
    D = draw(st.sampled_from([16, 16, 64]))
    sink = draw(st.integers(0, min(2, N)))
    window = draw(st.integers(0, min(3, N - sink)))
    kind = draw(st.sampled_from(["adakv", "uniform", "edges"]))
    R = B * H
    if kind == "adakv":  # one head takes most of the budget
        budgets = [draw(st.integers(sink + window, sink + window + 3)) for _ in range(R)]
        budgets[draw(st.integers(0, R - 1))] = draw(st.integers(sink + window, N + 3))
    elif kind == "uniform":
        budgets = [draw(st.integers(sink + window, N))] * R
    else:  # 0 (only without protected tokens), N - 1, N, > N
        lo = sink + window
        budgets = [draw(st.sampled_from([max(lo, 0), max(lo, N - 1), N, N + 5])) for _ in range(R)]
    slack = draw(st.sampled_from([0, 1, 5, 16]))
    align = draw(st.sampled_from([1, 8, 16]))
    exact_total = draw(st.booleans())
    return B, H, N, D, sink, window, budgets, slack, align, exact_total, draw(st.integers(0, 2 ** 31 - 1))


def _inputs(B, H, N, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, N, D, generator=g).to(dtype)
    values = torch.randn(B, H, N, D, generator=g).to(dtype)
    return keys.to(DEVICE), values.to(DEVICE), torch.randn(B, H, N, generator=g).to(DEVICE), g


def _new(B, H, D, g, dtype=torch.float32):
    """One new (k, v) token per row, [B, H, 1, D] on the test device."""
    return tuple(torch.randn(B, H, 1, D, generator=g).to(dtype).to(DEVICE) for _ in range(2))


def _rows(keys, values, kept):
    return Rows(keys.double().cpu().numpy(), values.double().cpu().numpy(), kept)


def _kept(scores, budgets, sink=0, window=0):
    H = scores.shape[1]
    return [ref_select(scores[r // H, r % H].cpu().numpy(), b, sink, window) for r, b in enumerate(budgets)]


@both_backends
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=10)  # each build runs the select kernel (~20 ms per program interpreted)
@given(case=selection_case(), form=st.sampled_from(["tensor", "tuple", "int"]))
@example(case=(1, 1, 1, 16, 0, 0, [0], 0, 1, True, 0), form="tensor")  # nothing kept, no slack: T_cap's floor
@example(case=(1, 2, 1, 16, 0, 0, [0, 0], 0, 1, True, 0), form="int")  # rows of capacity 0 at r·0
def test_from_selection_equals_per_row_gather(backend, dtype, case, form):
    """Each form of the budgets (a device tensor, host ints, one int when every row has the same budget) gives
    each row its kept tokens; only the tensor's layout is sized by ``total`` (the others are exact)."""
    B, H, N, D, sink, window, budgets, slack, align, exact_total, seed = case
    keys, values, scores, _ = _inputs(B, H, N, D, dtype, seed)
    kept = _kept(scores, budgets, sink, window)
    total = sum(len(k) for k in kept) if exact_total else None
    form = form if form != "int" or len(set(budgets)) == 1 else "tensor"
    given_budgets = {"tensor": torch.tensor(budgets, dtype=torch.int32), "tuple": tuple(budgets),
                     "int": budgets[0]}[form]
    with on_backend(backend):
        c = RaggedKV.from_selection(scores, given_budgets, keys, values, sink, window, slack=slack, total=total,
                                    align=align)
    _layout_ok(c)
    cap = c.capacity.flatten()
    for r, idx in enumerate(kept):
        b, h = divmod(r, H)
        s, n = int(c.row_start[r]), len(idx)
        assert int(c.length[r]) == n and cap[r] >= n + slack and int(c.row_start[r]) % align == 0
        assert c.positions[s:s + n].tolist() == idx.tolist()  # kept positions, exactly, ascending
        assert torch.equal(c.keys[s:s + n], keys[b, h, idx]) and torch.equal(c.values[s:s + n], values[b, h, idx])
    _same_as_model(c, _rows(keys, values, kept))
    if total is not None:  # the static size follows the given total, not R * N; never empty (module docstring)
        bound = max(total + B * H * (slack + align - 1), 1)
        assert c.keys.shape[0] == bound if form == "tensor" else c.keys.shape[0] <= bound


@both_backends
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=6)
@given(case=selection_case(max_n=60), steps=st.integers(1, 12))
def test_append_preserves_contents_and_adds_one(backend, dtype, case, steps):
    with on_backend(backend):
        _append_preserves_contents_and_adds_one(dtype, case, steps)


def _append_preserves_contents_and_adds_one(dtype, case, steps):
    B, H, N, D, sink, window, budgets, slack, align, exact_total, seed = case
    keys, values, scores, g = _inputs(B, H, N, D, dtype, seed)
    kept = _kept(scores, budgets, sink, window)
    c = RaggedKV.from_selection(scores, torch.tensor(budgets), keys, values, sink, window, slack=slack,
                                total=sum(len(k) for k in kept) if exact_total else None, align=align)
    model = _rows(keys, values, kept)
    for _ in range(steps):  # slack 0/1/5 forces re-packs along the way
        before = c.to_padded(int(c.length.max()))
        k = torch.randn(B, H, 1, D, generator=g).to(dtype).to(DEVICE)
        v = torch.randn(B, H, 1, D, generator=g).to(dtype).to(DEVICE)
        c.append(k, v)
        model.append(k[:, :, 0].double().cpu().numpy(), v[:, :, 0].double().cpu().numpy())
        after = c.to_padded(before[0].shape[2])
        assert torch.equal(c.lengths, before[2] + 1)
        old = (torch.arange(after[0].shape[2], device=DEVICE) < before[2][..., None])[..., None]  # old tokens kept
        assert torch.equal(after[0] * old, before[0]) and torch.equal(after[1] * old, before[1])
        _layout_ok(c)
    _same_as_model(c, model)
    assert (c.next_position == N + steps).all()


@both_backends
def test_append_writes_in_place_without_repack(backend):
    """With slack, an append changes exactly one slot per row and reallocates nothing."""
    with on_backend(backend):
        _append_writes_in_place_without_repack()


def _append_writes_in_place_without_repack():
    keys, values, scores, g = _inputs(1, 3, 40, 16, torch.float32, 0)
    c = RaggedKV.from_selection(scores, torch.tensor([16, 32, 16]), keys, values, slack=16, total=64)
    assert c.capacity.tolist() == [[32, 48, 32]]  # exactly 16 free slots per row
    storage = (c.keys.data_ptr(), c.values.data_ptr(), c.row_start.data_ptr())
    c.keys[c.positions < 0] = 1e30  # mark the slack (uninitialised: it may hold an earlier run's values)
    old_k = c.keys.clone()
    for _ in range(16):
        c.append(*_new(1, 3, 16, g))
    assert (c.keys.data_ptr(), c.values.data_ptr(), c.row_start.data_ptr()) == storage
    changed = (c.keys.view(torch.int32) != old_k.view(torch.int32)).any(1)  # bitwise
    assert int(changed.sum()) == 3 * 16 and c.lengths.tolist() == [[32, 48, 32]]
    c.append(*_new(1, 3, 16, g))  # all rows were full
    assert c.keys.data_ptr() != storage[0] and c.lengths.tolist() == [[33, 49, 33]]
    assert (c.capacity - c.lengths).min() >= 15


@both_backends
def test_host_rows_are_read_once_per_layout(backend, monkeypatch):
    """``host_rows()`` (the rows' starts and lengths as host lists, for CPU code that walks the rows, e.g. the
    transformers integration's decode attention): read back at the first call and after a re-pack, counted on the
    host by every append in between, and always the device's values (an empty row, re-packs every few steps)."""
    keys, values, scores, g = _inputs(2, 2, 40, 16, torch.float32, 0)
    reads, tolist = [], torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or tolist(t))
    with on_backend(backend):
        c = RaggedKV.from_selection(scores, torch.tensor([16, 0, 40, 7]), keys, values, slack=3, align=4)
        layout, repacks = None, 0
        for _ in range(30):
            before = len(reads)
            starts, lengths = c.host_rows()
            assert len(reads) - before == (0 if c.row_start is layout else 2)  # a read only for a new layout
            repacks += layout is not None and c.row_start is not layout
            layout = c.row_start
            assert (starts, lengths) == (c.row_start.cpu().numpy().tolist(), c.length.cpu().numpy().tolist())
            c.append(*_new(2, 2, 16, g))
    assert repacks >= 3


@both_backends
def test_allocate_then_fill(backend):
    with on_backend(backend):
        _allocate_then_fill()


def _allocate_then_fill():
    cap = torch.tensor([3, 0, 5, 1], dtype=torch.int32)
    c = RaggedKV.allocate(cap, 9, 2, 2, 16, torch.bfloat16, DEVICE, slack=2)
    assert c.row_start.tolist() == [0, 3, 3, 8, 9] and c.lengths.tolist() == [[0, 0], [0, 0]]
    _layout_ok(c)
    model = Rows(np.zeros((2, 2, 0, 16)), np.zeros((2, 2, 0, 16)), [[], [], [], []])
    g = torch.Generator().manual_seed(0)
    for _ in range(4):  # row 1 has no room at all: the first append re-packs
        k, v = _new(2, 2, 16, g, torch.bfloat16)
        c.append(k, v)
        model.append(k[:, :, 0].double().cpu().numpy(), v[:, :, 0].double().cpu().numpy())
        _layout_ok(c)
    _same_as_model(c, model)


@both_backends
def test_too_small_total_stays_in_bounds(backend):
    """A wrong static total cannot write past T_cap: the rows that do not fit shrink."""
    keys, values, scores, _ = _inputs(1, 3, 50, 16, torch.float32, 1)
    with on_backend(backend):
        c = RaggedKV.from_selection(scores, torch.tensor([40, 40, 40]), keys, values, slack=0, align=1, total=50)
    _layout_ok(c)
    assert c.keys.shape[0] == 50 and c.lengths.tolist() == [[40, 10, 0]]


def test_from_policy_writes_through_policy_select():
    calls = []

    class Spy(Policy):
        def select(self, scores, budgets, keys, values, **kw):
            calls.append(kw["out"])
            return super().select(scores, budgets, keys, values, **kw)

    keys, values, scores, _ = _inputs(2, 2, 30, 16, torch.float16, 2)
    budgets = torch.tensor([4, 9, 30, 2])
    a = RaggedKV.from_policy(Spy(), scores, budgets, keys, values, sink=1, window=1, total=45)
    b = RaggedKV.from_selection(scores, budgets, keys, values, 1, 1, total=45)
    assert len(calls) == 1 and calls[0].keys is a.keys
    assert torch.equal(a.positions, b.positions) and torch.equal(a.row_start, b.row_start)
    assert torch.equal(a.to_padded()[0], b.to_padded()[0])


def test_ragged_holds_less_than_padded():
    """AdaKV-like budgets (max = 4 x mean): the ragged storage is far below the padded one."""
    B, H, N, D = 1, 8, 256, 16
    keys, values, scores, _ = _inputs(B, H, N, D, torch.float16, 3)
    budgets = torch.tensor([128, 16, 16, 16, 32, 16, 16, 16])
    c = RaggedKV.from_selection(scores, budgets, keys, values, total=int(budgets.sum()))
    K, V, _ = c.to_padded()
    assert K.shape == (B, H, 128, D)
    assert c.keys.nbytes + c.values.nbytes < 0.6 * (K.nbytes + V.nbytes)
    assert c.nbytes < 0.7 * (K.nbytes + V.nbytes)


@pytest.mark.parametrize("full", [[], [1], [0, 2, 3], [0, 1, 2, 3]], ids=["none", "one", "most", "all"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_raw_append_leaves_full_rows_unchanged(full, dtype):
    """The raw op on flat rows (row 2 of capacity 0): a row with room gets its token at
    ``row_start + length`` with the next position; a full row, and every slot but those, keeps its
    bits. Both backends, the same result (also when no row has room)."""
    g = torch.Generator().manual_seed(len(full))
    B, H, D = 2, 2, 8
    row_start = torch.tensor([0, 3, 7, 7, 12])
    cap = (row_start[1:] - row_start[:-1]).tolist()
    length = torch.tensor([c if r in full else max(c - 2, 0) for r, c in enumerate(cap)], dtype=torch.int32)
    k, v = (torch.randn(B, H, 1, D, generator=g).to(dtype) for _ in range(2))
    state = [torch.randn(13, D, generator=g).to(dtype), torch.randn(13, D, generator=g).to(dtype),
             torch.arange(13) * 10, row_start, length, torch.tensor([50, 60, 70, 80])]
    res = {}
    for backend in ("triton", "torch"):
        s = [t.clone() for t in state]
        with on_backend(backend):
            ragged_append(k, v, *s, H)
        res[backend] = s
    for a, b in zip(res["triton"], res["torch"]):
        assert torch.equal(a, b)
    keys, values, pos, _, new_len, nxt = res["torch"]
    room = [r not in full and cap[r] > 0 for r in range(4)]
    assert new_len.tolist() == [n + f for n, f in zip(length.tolist(), room)]
    assert nxt.tolist() == [p + f for p, f in zip([50, 60, 70, 80], room)]
    written = torch.zeros(13, dtype=torch.bool)
    for r in range(4):
        if room[r]:
            slot = int(row_start[r] + length[r])
            written[slot] = True
            b, h = divmod(r, H)
            assert torch.equal(keys[slot], k[b, h, 0]) and torch.equal(values[slot], v[b, h, 0])
            assert int(pos[slot]) == 50 + 10 * r
    assert torch.equal(keys[~written], state[0][~written]) and torch.equal(values[~written], state[1][~written])
    assert torch.equal(pos[~written], state[2][~written])


_CAPTURE = r"""
import torch
from tritonkv.cache import RaggedKV, ragged_append
g = torch.Generator().manual_seed(0)
B, H, N, D = 1, 3, 40, 16
s, k, v = torch.randn(B, H, N, generator=g), torch.randn(B, H, N, D, generator=g), torch.randn(B, H, N, D, generator=g)
c = RaggedKV.from_selection(s, torch.tensor([4, 9, 0]), k, v, slack=1, align=1, total=13)
class Append(torch.nn.Module):
    def forward(self, k1, v1, keys, values, pos, rs, ln, nxt):
        ragged_append(k1, v1, keys, values, pos, rs, ln, nxt, H)
        return ln + 0
state = [c.keys, c.values, c.positions, c.row_start, c.length, c.next_position]
new = [(torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)) for _ in range(3)]
ep = torch.export.export(Append(), new[0] + tuple(t.clone() for t in state), strict=True)
ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
assert "tritonkv.ragged_append.default" in ops, ops
print("exported append")
compiled = torch.compile(Append(), fullgraph=True, backend="aot_eager")
runs = [(Append(), [t.clone() for t in state]), (ep.module(), [t.clone() for t in state]),
        (compiled, [t.clone() for t in state])]
for kv in new:  # rows fill up: the second and third appends find (almost) no room
    for m, st in runs:
        m(*kv, *st)
    assert all(torch.equal(a, b) for _, st in runs[1:] for a, b in zip(st, runs[0][1]))
print("compiled append")
"""


def test_append_exports_and_compiles_without_graph_break():
    """Without the interpreter CPU tensors run the PyTorch body: torch.export (strict) captures the
    in-place ``tritonkv::ragged_append`` op and ``torch.compile(fullgraph=True)`` (aot_eager) has no
    graph break; both mutate the cache as eager does."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITONKV_CPU_KERNELS")}
    r = subprocess.run([sys.executable, "-c", _CAPTURE], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "exported append" in r.stdout and "compiled append" in r.stdout


K0, V0, S0, _ = _inputs(1, 2, 10, 16, torch.float32, 0)


def _c0():
    return RaggedKV.from_selection(S0, 4, K0, V0)


BAD = [
    ("append shape", lambda: _c0().append(K0[:, :, :2], V0[:, :, :2]), ValueError, ["k", "[B, H_kv, 1, D]"]),
    ("append dtype", lambda: _c0().append(K0[:, :, :1].half(), V0[:, :, :1].half()), TypeError, ["k", "dtype"]),
    ("append not tensor", lambda: _c0().append([1.0], V0[:, :, :1]), TypeError, ["k"]),
    ("values shape", lambda: RaggedKV.from_selection(S0, 4, K0, V0[:, :1]), ValueError, ["values"]),
    ("budgets count", lambda: RaggedKV.from_selection(S0, torch.tensor([1, 2, 3]), K0, V0), ValueError, ["budgets"]),
    ("slack", lambda: RaggedKV.from_selection(S0, 4, K0, V0, slack=-1), ValueError, ["slack"]),
    ("total", lambda: RaggedKV.from_selection(S0, 4, K0, V0, total=2.5), TypeError, ["total"]),  # check_int
    ("capacity count", lambda: RaggedKV.allocate(torch.tensor([1]), 4, 1, 2, 16), ValueError, ["capacity"]),
    ("allocate dtype", lambda: RaggedKV.allocate(torch.tensor([1, 1]), 4, 1, 2, 16, torch.int8), TypeError, ["dtype"]),
]


@pytest.mark.parametrize("what,call,exc,words", BAD, ids=[b[0] for b in BAD])
def test_bad_input(what, call, exc, words):
    assert_raises_naming(call, exc, words, what)


def test_append_kernel_compiles_ahead_of_time():
    sig = {"k_ptr": "*bf16", "v_ptr": "*bf16", "ko_ptr": "*bf16", "vo_ptr": "*bf16", "pos_ptr": "*i64",
           "start_ptr": "*i64", "len_ptr": "*i32", "next_ptr": "*i64", "H": "i32", "D": "i32", "skb": "i64",
           "skh": "i64", "svb": "i64", "svh": "i64", "sko": "i64", "svo": "i64", "BLOCK_D": "constexpr"}
    assert_compiles({"module": "tritonkv.cache", "kernel": "_ragged_append_kernel", "signature": sig,
                     "constexprs": {"BLOCK_D": 128}})


# -- RaggedKV.from_kept: rows from tokens already chosen (AdaKV's winners), no selection ---------------------------
@st.composite
def kept_case(draw, max_n=90):
    """Each batch row keeps K flat tokens h·N + j, the same K in every row; heads may keep none, few or all."""
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 4))
    N, D = draw(st.integers(1, max_n)), draw(st.sampled_from([16, 24, 64]))
    K = draw(st.integers(1, H * N))
    kind = draw(st.sampled_from(["random", "one head", "edges"]))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 31 - 1)))
    rows = []
    for _ in range(B):
        if kind == "one head" and K <= N:  # a head takes every kept token, the others none
            h = int(rng.integers(0, H))
            rows.append(h * N + np.sort(rng.choice(N, K, replace=False)))
        elif kind == "edges":  # whole heads first, then the start of the next
            rows.append(np.arange(K))
        else:
            rows.append(np.sort(rng.choice(H * N, K, replace=False)))
    slack = draw(st.sampled_from([0, 1, 5, 16]))
    return B, H, N, D, np.stack(rows).astype(np.int64), slack, int(rng.integers(0, 2 ** 31 - 1))


def _check_from_kept(c, keys, values, flat, slack):
    """The rows hold exactly each head's kept tokens (the oracle), capacity = length + slack, -1 in the slack."""
    B, H, N, _ = keys.shape
    kept = [[int(i) - h * N for i in flat[b] if h * N <= i < (h + 1) * N] for b in range(B) for h in range(H)]
    _layout_ok(c)
    assert c.keys.shape[0] == B * flat.shape[1] + B * H * slack  # static: B·K + R·slack
    assert (c.capacity.flatten() == c.length.to(torch.int64) + slack).all() and int(c.row_start[-1]) == c.keys.shape[0]
    assert c.lengths.flatten().tolist() == [len(k) for k in kept] and (c.next_position == N).all()
    for r, idx in enumerate(kept):
        s, n = int(c.row_start[r]), len(idx)
        assert c.positions[s:s + n].tolist() == idx and (c.positions[s + n:s + n + slack] == -1).all()
    _same_as_model(c, _rows(keys, values, kept))


@both_backends
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=12)
@given(case=kept_case())
def test_from_kept_equals_the_rows_of_the_kept_tokens(backend, dtype, case):
    B, H, N, D, flat, slack, seed = case
    keys, values, _, _ = _inputs(B, H, N, D, dtype, seed)
    longest = int(max(sum(h * N <= i < (h + 1) * N for i in flat[b]) for b in range(B) for h in range(H)))
    with on_backend(backend):
        c = RaggedKV.from_kept(torch.from_numpy(flat).to(DEVICE), keys, values, longest=longest, slack=slack)
    _check_from_kept(c, keys, values, flat, slack)


@both_backends
def test_from_kept_searches_in_several_steps(backend, monkeypatch):
    """Rows of more kept tokens than probes: the kernel's search takes several steps (here 4 probes each), a
    strided (non-contiguous) cache is read through its strides, and appends follow in the slack."""
    from tritonkv import cache

    monkeypatch.setattr(cache, "KEPT_PROBES", 4)
    rng = np.random.default_rng(3)
    B, H, N, D = 2, 3, 70, 16
    flat = np.stack([np.sort(rng.choice(H * N, 100, replace=False)) for _ in range(B)]).astype(np.int64)
    big = torch.randn(B, H, N + 9, D, generator=torch.Generator().manual_seed(1))
    keys, values = big[:, :, 3:N + 3], big[:, :, 5:N + 5].clone()
    with on_backend(backend):
        c = RaggedKV.from_kept(torch.from_numpy(flat), keys, values, longest=N, slack=4)
        _check_from_kept(c, keys, values, flat, 4)
        model = _rows(keys, values, [[int(i) - h * N for i in flat[b] if h * N <= i < (h + 1) * N]
                                      for b in range(B) for h in range(H)])
        g = torch.Generator().manual_seed(2)
        for _ in range(6):  # 4 in place, then a re-pack
            k, v = (t.cpu() for t in _new(B, H, D, g))  # the backends run CPU tensors
            c.append(k, v)
            model.append(k[:, :, 0].double().numpy(), v[:, :, 0].double().numpy())
            _layout_ok(c)
    _same_as_model(c, model)


@both_backends
@settings(max_examples=40, deadline=None)
@given(R=st.integers(0, 70), k_max=st.integers(0, 40), slack=st.integers(0, 20), align=st.sampled_from([1, 2, 16]),
       room=st.floats(0.0, 1.2), seed=st.integers(0, 2**31 - 1))
def test_layout_from_device_budgets(backend, R, k_max, slack, align, room, seed):
    """Rows laid out on the device from budget tensors (negative, above k_max), with a total capacity that may cut
    rows short: the oracle's starts and lengths."""
    rng = np.random.default_rng(seed)
    budgets = rng.integers(-3, k_max + 5, R)
    T = max(int(room * R * (k_max + slack + align)), 1)
    with on_backend(backend):
        row_start, length, nxt = ragged_layout(torch.from_numpy(budgets).to(torch.int32), k_max, slack, align, T, 77)
    want_start, want_length = ref_layout(budgets, k_max, slack, align, T)
    assert row_start.dtype == torch.int64 and length.dtype == torch.int32 and nxt.dtype == torch.int64
    np.testing.assert_array_equal(row_start.numpy(), want_start)
    np.testing.assert_array_equal(length.numpy(), want_length)
    np.testing.assert_array_equal(nxt.numpy(), np.full(R, 77))


@both_backends
def test_layout_over_several_blocks(backend):
    """More rows than one step of the layout kernel: the running sum carries over."""
    R = 2 * LAYOUT_BLOCK + 37
    budgets = np.random.default_rng(0).integers(0, 30, R)
    with on_backend(backend):
        row_start, length, nxt = ragged_layout(torch.from_numpy(budgets).to(torch.int32), 25, 16, 16, 30 * R, 9)
    want_start, want_length = ref_layout(budgets, 25, 16, 16, 30 * R)
    np.testing.assert_array_equal(row_start.numpy(), want_start)
    np.testing.assert_array_equal(length.numpy(), want_length)
    assert (nxt == 9).all()


def test_layout_kernel_compiles_ahead_of_time():
    sig = {"b_ptr": "*i32", "start_ptr": "*i64", "len_ptr": "*i32", "next_ptr": "*i64", "R": "i32", "k_max": "i32",
           "slack": "i32", "align": "i32", "T": "i64", "N": "i32", "BLOCK_R": "constexpr"}
    assert_compiles({"module": "tritonkv.cache", "kernel": "_ragged_layout_kernel", "signature": sig,
                     "constexprs": {"BLOCK_R": 1024}},
                    {"module": "tritonkv.cache", "kernel": "_ragged_layout_kernel",
                     "signature": dict(sig, T="i32", N="i64"), "constexprs": {"BLOCK_R": 16}})


def test_from_kept_kernel_compiles_ahead_of_time():
    sig = {"idx_ptr": "*i64", "k_ptr": "*bf16", "v_ptr": "*bf16", "ko_ptr": "*bf16", "vo_ptr": "*bf16",
           "pos_ptr": "*i64", "start_ptr": "*i64", "len_ptr": "*i32", "next_ptr": "*i64", "H": "i32", "N": "i32",
           "K": "i32", "slack": "i32", "SPAN": "i32", "skb": "i64", "skh": "i64", "skn": "i64", "svb": "i64",
           "svh": "i64", "svn": "i64", "D": "i32", "BATCH": "constexpr", "BLOCK_D": "constexpr", "P": "constexpr"}
    assert_compiles({"module": "tritonkv.cache", "kernel": "_ragged_from_kept_kernel", "signature": sig,
                     "constexprs": {"BATCH": 64, "BLOCK_D": 128, "P": 1024}})


def _kept_rows(*shape, dtype=torch.int64):
    return torch.zeros(shape, dtype=dtype, device=DEVICE)  # on the device of K0: each case fails one check


KEPT_BAD = [
    ("kept dtype", lambda: RaggedKV.from_kept(_kept_rows(1, 4, dtype=torch.int32), K0, V0, longest=4), ValueError,
     ["kept", "int64"]),
    ("kept rows", lambda: RaggedKV.from_kept(_kept_rows(2, 4), K0, V0, longest=4), ValueError, ["kept", "[B = 1, K]"]),
    ("kept empty", lambda: RaggedKV.from_kept(_kept_rows(1, 0), K0, V0, longest=4), ValueError, ["kept"]),
    ("longest", lambda: RaggedKV.from_kept(_kept_rows(1, 4), K0, V0, longest=-1), ValueError, ["longest"]),
]


@pytest.mark.parametrize("what,call,exc,words", KEPT_BAD, ids=[b[0] for b in KEPT_BAD])
def test_from_kept_bad_input(what, call, exc, words):
    assert_raises_naming(call, exc, words, what)
