"""Knorm (algorithms.md §1.1): the kernel and the CPU PyTorch body against the NumPy oracle and each
other, kept indices end to end through compress() (the shared select with the policy's protected
sizes), the invariants (s ≤ 0, ranking unchanged by a common positive scale), bad inputs and the
AOT compile."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import tritonkv
from aot import assert_compiles
from reference import knorm as ref
from reference.select import select as ref_select
from helpers import DTYPES, assert_kept_matches
from tritonkv.kernels.knorm import STREAM_STAGES, knorm_scores
from tritonkv.kernels.select import select_indices
from tritonkv.policies import Knorm
from helpers import assert_raises_naming, assert_same_scores, both_backends, on_backend  # noqa: E402

RTOL = 1e-6  # fp32 sum of squares against fp64: ~1e-7 relative


@st.composite
def keys_case(draw, max_n=300, dtypes=DTYPES):
    """keys [B, H, N, D]: Gaussian, small integers (many exact ties), exact duplicates or spread
    scales; possibly strided rows."""
    B = draw(st.integers(1, 2))
    H = draw(st.integers(1, 4))
    N = draw(st.one_of(st.integers(1, 12), st.integers(13, max_n)))
    D = draw(st.sampled_from([16, 64, 128]))
    dtype = draw(st.sampled_from(dtypes))
    kind = draw(st.sampled_from(["normal", "ints", "dups", "scaled"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    if kind == "ints":  # exact in every dtype; equal norms tie exactly
        k = rng.integers(-2, 3, (B, H, N, D)).astype(np.float64)
    else:
        k = rng.standard_normal((B, H, N, D))
    if kind == "dups":
        src = rng.integers(0, N, N)
        pick = rng.random(N) < 0.4
        k[:, :, pick] = k[:, :, src[pick]]
    elif kind == "scaled":
        k *= np.exp(rng.uniform(-3, 3, (B, H, N, 1)))
    keys = torch.from_numpy(k).to(dtype)
    if draw(st.booleans()):
        keys = keys.transpose(1, 2).contiguous().transpose(1, 2)
    return keys


def oracle(keys):
    return ref.scores(keys.double().numpy())


def tol(s):
    return RTOL * max(1.0, float(np.abs(s).max(initial=0.0)))


@both_backends
@given(keys=keys_case(), chunk=st.sampled_from([0, 64]))
def test_scores_match_oracle(backend, keys, chunk):
    with on_backend(backend):
        got = knorm_scores(keys, chunk=chunk)
    assert got.dtype == torch.float32 and got.shape == keys.shape[:3] and got.is_contiguous()
    want = oracle(keys)
    np.testing.assert_allclose(got.numpy(), want, rtol=RTOL, atol=0)
    assert (got <= 0).all()


@st.composite
def budget_case(draw, n):
    sink = draw(st.sampled_from([0, 0, 1, 4]))
    window = draw(st.sampled_from([0, 0, 1, 7]))
    pol = Knorm(sink=sink, window=window)
    s, w = pol.protected(n, n)
    edge = draw(st.sampled_from(["protected", "n-1", "n", "over", "random", "random"]))
    k = {"protected": max(s + w, 1), "n-1": max(n - 1, 1), "n": n, "over": n + 3}.get(edge) or draw(st.integers(1, n))
    return pol, k


@both_backends
@given(keys=keys_case(), data=st.data())
def test_kept_matches_oracle(backend, keys, data):
    B, H, N, D = keys.shape
    pol, k = data.draw(budget_case(N))
    values = torch.randn(keys.shape).to(keys.dtype)
    if k >= N:
        out = tritonkv.compress((keys, values), pol, k)
        assert out.keys is keys and out.values is values
        return
    sink, window = pol.protected(N, k)
    if sink + window > k:
        with pytest.raises(ValueError, match="budget"):
            tritonkv.compress((keys, values), pol, k)
        return
    with on_backend(backend):
        out = tritonkv.compress((keys, values), pol, k)
    s = oracle(keys).reshape(B * H, N)
    assert_kept_matches(out.indices.reshape(B * H, k).numpy(), [k] * (B * H), s, k, sink, window, tol(s))
    g = out.indices[..., None].expand(-1, -1, -1, D)
    assert torch.equal(out.keys, keys.gather(2, g)) and torch.equal(out.values, values.gather(2, g))


@both_backends
@settings(max_examples=15)
@given(keys=keys_case(max_n=200), data=st.data())
def test_common_scale_keeps_the_ranking(backend, keys, data):
    with on_backend(backend):
        _common_scale_keeps_the_ranking(keys, data)


def _common_scale_keeps_the_ranking(keys, data):
    B, H, N, D = keys.shape
    k = data.draw(st.integers(1, N))
    base = knorm_scores(keys)
    # a power of two scales every fp32 score exactly: identical kept sets, whatever the ties
    c2 = 2.0 ** data.draw(st.sampled_from([-2, -1, 1, 3]))
    scaled = knorm_scores(keys.float() * c2)
    assert torch.equal(scaled, base * c2)
    assert torch.equal(select_indices(scaled, k, k)[0], select_indices(base, k, k)[0])
    # any c > 0 keeps the oracle's top-k scores. Rounding keys*c to fp32 can split ties that are
    # exact in the oracle (|(1,1,1,1)| == |(2,0,0,0)|), so among tied tokens the indices may differ:
    # compare the kept multiset of oracle scores, always.
    c = data.draw(st.floats(0.01, 100))
    idx, lengths = select_indices(knorm_scores(keys.float() * c), k, k)
    s = oracle(keys).reshape(B * H, N)
    idx = idx.reshape(B * H, k).numpy()
    for r in range(B * H):
        assert lengths.reshape(-1)[r] == k and (np.diff(idx[r]) > 0).all()
        want = ref_select(s[r], k)
        np.testing.assert_allclose(np.sort(s[r][idx[r]]), np.sort(s[r][want]), rtol=0, atol=4 * tol(s))


@given(keys=keys_case(), data=st.data())
def test_torch_body_matches_kernel(keys, data):
    """The CPU PyTorch body against the Triton kernel (interpreter) on the same keys: scores within
    fp32 round-off (both sum fp32 squares, in different orders), and compress() keeps the same
    indices on both (the kernel's scores decide; at a near-tie the multiset of kept scores)."""
    B, H, N, D = keys.shape
    with on_backend("triton"):
        want = knorm_scores(keys)
    with on_backend("torch"):
        got = knorm_scores(keys)
    assert got.dtype == torch.float32 and got.shape == want.shape and got.is_contiguous()
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=2 * RTOL, atol=0)
    pol, k = data.draw(budget_case(N))
    sink, window = pol.protected(N, k)
    if k >= N or sink + window > k:
        return
    s = want.double().numpy().reshape(B * H, N)
    for backend in ("triton", "torch"):
        with on_backend(backend):
            idx = tritonkv.compress((keys, keys), pol, k).indices.reshape(B * H, k).numpy()
        assert_kept_matches(idx, [k] * (B * H), s, k, sink, window, 2 * tol(s))


@pytest.mark.parametrize("val", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_keys_score_nan_on_both_backends(val):
    """A key with a NaN or ±inf element scores NaN (ranks lowest), on the kernel, the PyTorch body and
    the oracle alike; every other score is unchanged."""
    keys = torch.randn(2, 2, 30, 16, generator=torch.Generator().manual_seed(5))
    clean = knorm_scores(keys)
    keys[0, 1, 4, 3] = val
    keys[1, 0, 29, 0] = val
    with on_backend("triton"):
        want = knorm_scores(keys)
    with on_backend("torch"):
        got = knorm_scores(keys)
    assert_same_scores(got, want, rtol=2 * RTOL)
    bad = torch.zeros(2, 2, 30, dtype=torch.bool)
    bad[0, 1, 4] = bad[1, 0, 29] = True
    for s in (got, want, torch.from_numpy(ref.scores(keys.numpy()))):
        assert torch.isnan(s).equal(bad) and torch.allclose(s[~bad].float(), clean[~bad], rtol=2 * RTOL)


@pytest.mark.parametrize("make, exc, words", [
    (lambda: knorm_scores(torch.randn(2, 3, 4)), ValueError, ["keys"]),
    (lambda: knorm_scores(torch.ones(1, 1, 4, 8, dtype=torch.int64)), TypeError, ["keys"]),
    (lambda: knorm_scores([1.0]), TypeError, ["keys"]),
    (lambda: knorm_scores(torch.randn(1, 1, 4, 8), chunk=-2), ValueError, ["chunk"]),
    (lambda: Knorm(window=-1), ValueError, ["window"]),
])
def test_bad_inputs(make, exc, words):
    assert_raises_naming(make, exc, words)


def test_registered():
    assert tritonkv.POLICIES["knorm"] is Knorm
    assert (Knorm().sink, Knorm().window, Knorm.needs) == (0, 0, ())


def test_aot_compiles():
    assert_compiles({"module": "tritonkv.kernels.knorm", "kernel": "_knorm_kernel",
                     "signature": {"k_ptr": "*bf16", "out_ptr": "*fp32", "h0_ptr": "*i32", "H": "i32", "skb": "i64",
                                   "skh": "i32", "skn": "i32", "N": "i32", "D": "i32", "CHUNK": "i32", "C0": "i32",
                                   "sink": "i32", "window": "i32", "TILE": "constexpr", "BLOCK_D": "constexpr",
                                   "STAGES": "constexpr", "HIST": "constexpr", "NB": "constexpr",
                                   "HIST_TILE": "constexpr"},
                     "constexprs": {"TILE": 64, "BLOCK_D": 128, "STAGES": STREAM_STAGES, "HIST": True, "NB": 256,
                                    "HIST_TILE": 1024}})


def test_first_pass_from_the_score_kernel_feeds_the_select():
    """``protect=`` makes the scoring kernel also return the select's first radix pass (an explicit
    ``Hist0``): ``select_kv(..., hist0=)`` then skips its own pass-0 launch and keeps the same tokens,
    any number of times (the ticket is reset); a ``Hist0`` of other protection, or with ``forced``
    tokens, is a ValueError naming it."""
    from tritonkv.kernels._common import record_launches
    from tritonkv.kernels.select import select_kv

    g = torch.Generator().manual_seed(3)
    keys = torch.randint(-2, 3, (1, 3, 90, 16), generator=g).to(torch.bfloat16)  # many exact ties
    values = torch.randn(1, 3, 90, 16, generator=g).to(torch.bfloat16)
    with on_backend("triton"):
        s, h0 = knorm_scores(keys, protect=(2, 5))
        assert (h0.sink, h0.window) == (2, 5) and torch.equal(s, knorm_scores(keys))
        want = select_indices(s, 30, 30, sink=2, window=5)[0]
        for _ in range(2):
            with record_launches() as log:
                idx = select_kv(s, 30, keys, values, 30, sink=2, window=5, hist0=h0)[2]
            assert torch.equal(idx, want) and "_select_hist0_kernel" not in [x.name for x in log]
        forced = torch.zeros(1, 3, 90, dtype=torch.bool)
        for kw in (dict(sink=0, window=5), dict(sink=2, window=5, forced=forced)):
            with pytest.raises(ValueError, match="hist0"):
                select_kv(s, 30, keys, values, 30, hist0=h0, **kw)
    with on_backend("torch"):
        s, h0 = knorm_scores(keys, protect=(2, 5))
        assert h0 is None and torch.equal(s, knorm_scores(keys))
