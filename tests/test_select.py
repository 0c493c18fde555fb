"""The shared select + compact kernel against the oracle (kept indices compared exactly)."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from aot import assert_compiles
from reference.select import select as ref_select, select_rows
from tritonkv.kernels.select import select_indices, select_kv, select_mask

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


@given(s=score_rows(), data=st.data())
def test_select_matches_oracle(s, data):
    rows, n = s.shape
    sink = data.draw(st.integers(0, min(4, n)))
    window = data.draw(st.integers(0, n - sink))
    budgets = np.array([data.draw(st.integers(sink + window, n + 3)) for _ in range(rows)])
    k_max = int(min(budgets.max(), n))
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


@given(s=score_rows(max_rows=4, max_n=120), data=st.data())
def test_forced_tokens_are_kept(s, data):
    rows, n = s.shape
    rng = np.random.default_rng(data.draw(st.integers(0, 1000)))
    forced = rng.random((rows, n)) < 0.2
    k = int(forced.sum(1).max()) + data.draw(st.integers(0, n))
    idx, lengths = select_indices(torch.from_numpy(s), k, min(k, n), forced=torch.from_numpy(forced))
    for r in range(rows):
        np.testing.assert_array_equal(idx[r, : lengths[r]].numpy(), ref_select(s[r], k, forced=forced[r]))


@pytest.mark.parametrize("dtype", DTYPES)
@given(data=st.data())
def test_select_kv_gathers_rows(dtype, data):
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
    ko, vo, idx, lengths = select_kv(scores, k, keys, values, k, sink=sink, window=window)
    assert ko.shape == (B, H, k, D) and ko.dtype == dtype and (lengths == k).all()
    for b in range(B):
        for h in range(H):
            ref = ref_select(scores[b, h].numpy(), k, sink, window)
            np.testing.assert_array_equal(idx[b, h].numpy(), ref)
            assert torch.equal(ko[b, h], keys[b, h, ref]) and torch.equal(vo[b, h], values[b, h, ref])


def test_select_kv_per_row_budgets_and_strided_input():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 40, 3, 16, generator=g)  # [B, N, H, D] storage, viewed as [B, H, N, D]
    keys = base.permute(0, 2, 1, 3)
    values = (base * 2).permute(0, 2, 1, 3)
    scores = torch.randn(2, 3, 40, generator=g)
    budgets = torch.tensor([1, 5, 40, 0, 17, 60])
    ko, vo, idx, lengths = select_kv(scores, budgets, keys, values, 40)
    assert lengths.flatten().tolist() == [1, 5, 40, 0, 17, 40]
    for r in range(6):
        b, h = divmod(r, 3)
        ref = ref_select(scores[b, h].numpy(), int(budgets[r]))
        n = len(ref)
        np.testing.assert_array_equal(idx[b, h, :n].numpy(), ref)
        assert torch.equal(ko[b, h, :n], keys[b, h, ref]) and torch.equal(vo[b, h, :n], values[b, h, ref])
        assert (ko[b, h, n:] == 0).all() and (idx[b, h, n:] == -1).all()


def test_invariant_under_increasing_transform():
    s = torch.randn(4, 97, generator=torch.Generator().manual_seed(3))
    a = select_mask(s, 20, sink=1, window=2)
    b = select_mask(torch.exp(s) * 3 - 1, 20, sink=1, window=2)
    assert torch.equal(a, b) and (a.sum(1) == 20).all()


def test_negative_zero_ties_positive_zero():
    s = torch.tensor([[-0.0, 0.0, -0.0, 0.0]])
    np.testing.assert_array_equal(select_indices(s, 2, 2)[0][0].numpy(), [0, 1])


def test_plus_inf_never_displaces_protected():
    s = torch.tensor([[1.0, float("inf"), float("inf"), 2.0, 0.5]])
    np.testing.assert_array_equal(select_indices(s, 3, 3, sink=1, window=1)[0][0].numpy(), [0, 1, 4])


def test_strided_budget_view_is_read_correctly():
    s = torch.randn(2, 30, generator=torch.Generator().manual_seed(1))
    lb = torch.tensor([[7, 2, 9], [1, 5, 3]])
    assert select_mask(s, lb[:, 1]).sum(1).tolist() == [2, 5]


def test_budget_tensor_errors():
    s = torch.randn(2, 10)
    with pytest.raises(ValueError, match="budgets"):
        select_indices(s, torch.tensor([1, 2, 3]), 3)
    with pytest.raises(TypeError, match="budgets"):
        select_indices(s, torch.tensor([1.0, 2.0]), 3)
    with pytest.raises(TypeError, match="budget"):
        select_indices(s, 2.5, 3)


def test_select_kernels_compile_ahead_of_time():
    common = {"s_ptr": "*fp32", "f_ptr": "*u8", "budget_ptr": "*i32", "hist_ptr": "*i32", "N": "i32",
              "sink": "i32", "window": "i32", "k_max": "i32"}
    consts = {"CHUNK": 1024, "TILE": 256, "NB": 2048, "HAS_FORCED": True}
    hist = {"module": "tritonkv.kernels.select", "kernel": "_select_hist_kernel",
            "signature": {**common, "PASS": "constexpr", "CHUNK": "constexpr", "TILE": "constexpr",
                          "NB": "constexpr", "HAS_FORCED": "constexpr"}, "constexprs": {**consts, "PASS": 2}}
    count = {"module": "tritonkv.kernels.select", "kernel": "_select_count_kernel",
             "signature": {**common, "cnt_ptr": "*i32", "C": "i32", "CHUNK": "constexpr", "TILE": "constexpr",
                           "NB": "constexpr", "HAS_FORCED": "constexpr"}, "constexprs": consts}
    count["signature"] = {k: count["signature"][k] for k in
                          ["s_ptr", "f_ptr", "budget_ptr", "hist_ptr", "cnt_ptr", "N", "sink", "window", "k_max", "C",
                           "CHUNK", "TILE", "NB", "HAS_FORCED"]}
    compact_sig = {k: common[k] for k in ["s_ptr", "f_ptr", "budget_ptr", "hist_ptr"]}
    compact_sig.update({"cnt_ptr": "*i32", "N": "i32", "sink": "i32", "window": "i32", "k_max": "i32", "C": "i32",
                        "start_ptr": "*i64", "idx_ptr": "*i64", "len_ptr": "*i32", "mask_ptr": "*i8",
                        "k_ptr": "*bf16", "v_ptr": "*bf16", "ko_ptr": "*bf16", "vo_ptr": "*bf16", "H": "i32",
                        "skb": "i64", "skh": "i64", "skn": "i64", "svb": "i64", "svh": "i64", "svn": "i64", "D": "i32",
                        "CHUNK": "constexpr", "TILE": "constexpr", "NB": "constexpr", "CP2": "constexpr",
                        "BLOCK_D": "constexpr", "HAS_FORCED": "constexpr", "HAS_KV": "constexpr",
                        "WRITE_MASK": "constexpr"})
    compact = {"module": "tritonkv.kernels.select", "kernel": "_select_compact_kernel", "signature": compact_sig,
               "constexprs": {**consts, "CP2": 64, "BLOCK_D": 128, "HAS_KV": True, "WRITE_MASK": True}}
    assert_compiles(hist, count, compact)
