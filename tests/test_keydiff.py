"""KeyDiff (algorithms.md §1.2): the two-launch anchor + score kernel and the CPU PyTorch body
against the NumPy oracle and each other, the oracle's two forms (Eq. 7 pairwise, Eq. 8 anchor)
against each other, kept indices end to end through compress() (the shared select with the
policy's protected sizes), the invariants of §1.2, the sliding-window protection, bad inputs and
the AOT compile."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import tritonkv
from aot import assert_compiles
from reference import keydiff as ref
from reference.select import select as ref_select
from tritonkv.kernels import keydiff as kkd
from tritonkv.kernels.keydiff import keydiff_scores
from tritonkv.kernels.knorm import STREAM_STAGES
from tritonkv.policies import KeyDiff
from helpers import DTYPES, assert_kept_matches, assert_raises_naming, assert_same_scores, both_backends, on_backend  # noqa: E402

# fp32 cosine against fp64: ~1e-7 measured on scores in [-1, 1] (D ≤ 128, N ≤ 300)
TOL = 2e-6


# ------------------------------------------------------------------------------------------------
# inputs


@st.composite
def keys_case(draw, max_n=300, dtypes=DTYPES, max_rows=(2, 4)):
    """keys [B, H, N, D] of one of several kinds (N not a multiple of any block), possibly strided."""
    B = draw(st.integers(1, max_rows[0]))
    H = draw(st.integers(1, max_rows[1]))
    N = draw(st.one_of(st.integers(1, 12), st.integers(13, max_n)))
    D = draw(st.sampled_from([16, 64, 128]))
    dtype = draw(st.sampled_from(dtypes))
    kind = draw(st.sampled_from(["normal", "biased", "dups", "zeros", "scaled"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    k = rng.standard_normal((B, H, N, D))
    if kind == "biased":  # a common direction per row, as real keys have: a large anchor
        k += 2.0 * rng.standard_normal((B, H, 1, D))
    elif kind == "dups":  # exact duplicates: equal scores, the lower index wins
        src = rng.integers(0, N, N)
        pick = rng.random(N) < 0.4
        k[:, :, pick] = k[:, :, src[pick]]
    elif kind == "zeros":
        k[:, :, rng.random(N) < 0.2] = 0.0
    elif kind == "scaled":  # norms spread over e^±3
        k *= np.exp(rng.uniform(-3, 3, (B, H, N, 1)))
    keys = torch.from_numpy(k).to(dtype)
    if draw(st.booleans()):  # [B, N, H, D] storage seen as [B, H, N, D]: strided rows
        keys = keys.transpose(1, 2).contiguous().transpose(1, 2)
    return keys


def oracle(keys, mode="normalized"):
    """float64 [B, H, N] on the rounded inputs."""
    return ref.scores(keys.double().numpy(), mode)


# ------------------------------------------------------------------------------------------------
# kernel against the oracle


@both_backends
@given(keys=keys_case(), mode=st.sampled_from(kkd.ANCHORS), chunk=st.sampled_from([0, 64]))
def test_scores_match_oracle(backend, keys, mode, chunk):
    with on_backend(backend):
        got = keydiff_scores(keys, anchor=mode, chunk=chunk)
    assert got.dtype == torch.float32 and got.shape == keys.shape[:3] and got.is_contiguous()
    s = got.numpy()
    np.testing.assert_allclose(s, oracle(keys, mode), rtol=0, atol=TOL)
    assert ((s >= -1) & (s <= 1)).all()
    zero = (keys.float() == 0).all(-1).numpy()
    assert (s[zero] == 0).all() and not np.signbit(s[zero]).any()


@settings(max_examples=10)
@given(keys=keys_case(max_n=200, max_rows=(1, 2)), chunk=st.sampled_from([16, 32]))
def test_split_rows_agree(keys, chunk):
    """Rows split over many programs give the one-program scores up to the anchor's summation order."""
    a = keydiff_scores(keys, chunk=chunk)
    b = keydiff_scores(keys)
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=TOL)
    assert torch.equal(a, keydiff_scores(keys, chunk=chunk))  # deterministic


def test_many_chunks_per_row():
    """More chunk partials than one load of the score kernel takes (C = 38 > BLOCK_C = 32)."""
    g = torch.Generator().manual_seed(0)
    keys = (torch.randn(1, 1, 601, 128, generator=g) + torch.randn(128, generator=g)).to(torch.bfloat16)
    for mode in kkd.ANCHORS:
        got = keydiff_scores(keys, anchor=mode, chunk=16)
        np.testing.assert_allclose(got.numpy(), oracle(keys, mode), rtol=0, atol=TOL)


@given(keys=keys_case(), data=st.data())
def test_torch_body_matches_kernel(keys, data):
    """The CPU PyTorch body against the Triton kernel (interpreter) on the same keys: scores within
    fp32 round-off of each other (the anchor is summed in another order), and compress() keeps the
    same indices on both (the kernel's scores decide; at a near-tie the multiset of kept scores)."""
    B, H, N, D = keys.shape
    pol, k = data.draw(policy_case(N))
    with on_backend("triton"):
        want = keydiff_scores(keys, anchor=pol.anchor)
    with on_backend("torch"):
        got = keydiff_scores(keys, anchor=pol.anchor)
    assert got.dtype == torch.float32 and got.shape == want.shape and got.is_contiguous()
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=TOL)
    sink, window = pol.protected(N, k)
    if k >= N or sink + window > k:
        return
    s = want.double().numpy().reshape(B * H, N)
    for backend in ("triton", "torch"):
        with on_backend(backend):
            idx = tritonkv.compress((keys, keys), pol, k).indices.reshape(B * H, k).numpy()
        assert_kept_matches(idx, [k] * (B * H), s, k, sink, window, 2 * TOL, keys.double().numpy().reshape(B * H, N, D))


@pytest.mark.parametrize("anchor", kkd.ANCHORS)
@pytest.mark.parametrize("val", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_key_never_poisons_its_row(val, anchor):
    """A key with a NaN or ±inf element scores NaN and stays out of the anchor: every other token of
    its row scores as it does with that token absent (kernel, PyTorch body and oracle alike), and
    the kept tokens are those of the row without it (NaN ranks lowest). Before this rule one such key
    made its whole row NaN."""
    keys = torch.randn(2, 2, 30, 16, generator=torch.Generator().manual_seed(5))
    keys[0, 1, 4, 3] = val
    keys[1, 0, 0, :] = val  # a whole key, the first of its row
    rest = [i for i in range(30) if i != 4]
    for backend in ("triton", "torch"):
        with on_backend(backend):
            got = keydiff_scores(keys, anchor=anchor)
            alone = keydiff_scores(keys[0:1, 1:2, rest], anchor=anchor)
            alone2 = keydiff_scores(keys[1:2, 0:1, 1:], anchor=anchor)
            idx = tritonkv.compress((keys, keys), KeyDiff(anchor=anchor), 10).indices
        assert torch.isnan(got[0, 1, 4]) and torch.isnan(got[1, 0, 0])
        assert torch.isfinite(got[0, 1, rest]).all() and torch.isfinite(got[1, 0, 1:]).all()
        assert_same_scores(got[0, 1, rest], alone[0, 0], rtol=0, atol=TOL)
        assert_same_scores(got[1, 0, 1:], alone2[0, 0], rtol=0, atol=TOL)
        assert torch.isfinite(got[0, 0]).all() and torch.isfinite(got[1, 1]).all()
        want = np.array(rest)[ref_select(alone[0, 0].numpy(), 10)]
        np.testing.assert_array_equal(idx[0, 1].numpy(), want)
    o = ref.scores(keys.numpy(), anchor)
    assert np.isnan(o[0, 1, 4]) and np.isnan(o[1, 0, 0])
    np.testing.assert_allclose(o[0, 1, rest], ref.scores(keys[0, 1, rest].numpy(), anchor), rtol=0, atol=1e-12)
    assert_same_scores(got[0, 1, rest], torch.from_numpy(o[0, 1, rest]).float(), rtol=0, atol=TOL)


# ------------------------------------------------------------------------------------------------
# the oracle's two forms


@given(n=st.integers(1, 200), d=st.sampled_from([2, 5, 16, 64]), kind=st.sampled_from(["normal", "biased", "dups", "zeros"]),
       seed=st.integers(0, 2**31 - 1))
def test_pairwise_and_anchor_forms_rank_identically(n, d, kind, seed):
    """Eq. 7 (−Σ_j cos(k_i, k_j), O(n²)) = −n·‖a‖·Eq. 8, so both keep the same tokens at every budget."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((n, d))
    if kind == "biased":
        k += 2 * rng.standard_normal(d)
    elif kind == "dups":
        k[rng.random(n) < 0.5] = k[0]
    elif kind == "zeros":
        k[rng.random(n) < 0.3] = 0.0
    pair = ref.pairwise_scores(k)
    anc = ref.scores(k)
    a_norm = np.linalg.norm(ref.anchor(k))
    np.testing.assert_allclose(pair, n * a_norm * anc, rtol=1e-9, atol=1e-9 * n)
    tol = 1e-9 * n
    for budget in sorted({1, n // 3, n // 2, n - 1, n} - {0}):
        assert_kept_matches(ref_select(anc, budget)[None], [budget], pair[None], budget, 0, 0, tol)


# ------------------------------------------------------------------------------------------------
# end to end: compress() = policy.protected + score + the shared select


@st.composite
def policy_case(draw, n):
    sink = draw(st.sampled_from([0, 0, 1, 4]))
    how = draw(st.sampled_from(["none", "share", "window"]))
    share = draw(st.sampled_from([0.1, 0.2, 0.5])) if how == "share" else 0.0
    window = draw(st.integers(1, 8)) if how == "window" else 0
    pol = KeyDiff(sink=sink, window=window, window_share=share, anchor=draw(st.sampled_from(kkd.ANCHORS)))
    p = pol.protected(n, n)[0] + (window if how == "window" else 0)
    edge = draw(st.sampled_from(["protected", "n-1", "n", "over", "random", "random"]))
    k = {"protected": max(p, 1), "n-1": max(n - 1, 1), "n": n, "over": n + 3}.get(edge) or draw(st.integers(1, n))
    return pol, k


@both_backends
@given(keys=keys_case(), data=st.data())
def test_kept_matches_oracle(backend, keys, data):
    with on_backend(backend):
        _kept_matches_oracle(keys, data)


def _kept_matches_oracle(keys, data):
    B, H, N, D = keys.shape
    pol, k = data.draw(policy_case(N))
    values = torch.randn(keys.shape).to(keys.dtype)
    if k >= N:  # unchanged, bit for bit
        out = tritonkv.compress((keys, values), pol, k)
        assert out.keys is keys and out.values is values
        return
    sink, window = pol.protected(N, k)
    assert window == min(pol.window or int(np.floor(pol.window_share * k + 1e-6)), N - sink)
    if sink + window > k:
        with pytest.raises(ValueError, match="budget"):
            tritonkv.compress((keys, values), pol, k)
        return
    out = tritonkv.compress((keys, values), pol, k)
    assert out.keys.shape == (B, H, k, D) and out.indices.dtype == torch.int64
    idx = out.indices.reshape(B * H, k).numpy()
    assert_kept_matches(idx, [k] * (B * H), oracle(keys, pol.anchor).reshape(B * H, N), k, sink, window, TOL,
                        keys.double().numpy().reshape(B * H, N, D))
    g = out.indices[..., None].expand(-1, -1, -1, D)
    assert torch.equal(out.keys, keys.gather(2, g)) and torch.equal(out.values, values.gather(2, g))


def test_window_share_protects_the_last_tokens():
    assert KeyDiff(window_share=0.2).protected(100, 30) == (0, 6)
    assert KeyDiff(window_share=0.1).protected(100, 30) == (0, 3)
    assert KeyDiff(window_share=0.29).protected(1000, 100) == (0, 29)  # floor(0.29·100) = 29, not 28
    assert KeyDiff(sink=4, window=10).protected(100, 30) == (4, 10)
    assert KeyDiff(sink=4, window=10).protected(8, 8) == (4, 4)  # clipped to the row
    assert KeyDiff().protected(100, 30) == (0, 0)
    # a recent window is kept whatever its scores; the anchor still spans every token
    keys = torch.zeros(1, 1, 40, 16)
    keys[..., 0] = 1.0  # all alike: every token scores -1 ...
    keys[..., :5, 1] = 1.0  # ... but the first five are most distinct
    values = torch.randn_like(keys)
    plain = tritonkv.compress((keys, values), "keydiff", 10)
    assert plain.indices[0, 0].tolist() == list(range(5)) + list(range(5, 10))
    win = tritonkv.compress((keys, values), KeyDiff(window_share=0.5), 10)
    assert win.indices[0, 0].tolist() == list(range(5)) + list(range(35, 40))
    assert torch.equal(KeyDiff(window_share=0.5).score(keys, values), KeyDiff().score(keys, values))


# ------------------------------------------------------------------------------------------------
# invariants (§1.2)


def _away_from_zero(keys_case_keys):
    """|x| >= 0.5: power-of-two rescaling stays exact in fp16/bf16 (no subnormals)."""
    k = keys_case_keys.float()
    return (torch.sign(k) + (k == 0).float()) * (0.5 + k.abs())


@both_backends
@given(keys=keys_case(max_n=150), data=st.data())
def test_per_key_rescaling_leaves_scores_unchanged(backend, keys, data):
    with on_backend(backend):
        _per_key_rescaling_leaves_scores_unchanged(keys, data)


def _per_key_rescaling_leaves_scores_unchanged(keys, data):
    B, H, N, D = keys.shape
    base = _away_from_zero(keys).to(keys.dtype)
    rng = np.random.default_rng(data.draw(st.integers(0, 1000)))
    pow2 = torch.from_numpy(2.0 ** rng.integers(-3, 4, (B, H, N, 1))).float()
    scaled = (base.float() * pow2).to(keys.dtype)
    assert torch.equal(scaled.float(), base.float() * pow2)  # exact in every dtype
    s = keydiff_scores(base)
    assert torch.equal(keydiff_scores(scaled), s)  # bit for bit: k̂ and cos are unchanged exactly
    any_c = torch.from_numpy(rng.uniform(0.01, 100, (B, H, N, 1))).float()
    np.testing.assert_allclose(keydiff_scores(base.float() * any_c).numpy(), s.numpy(), rtol=0, atol=TOL)


@both_backends
@settings(max_examples=10)
@given(keys=keys_case(max_n=150, dtypes=[torch.float32], max_rows=(1, 2)), mode=st.sampled_from(kkd.ANCHORS), seed=st.integers(0, 1000))
def test_rotation_and_permutation(backend, keys, mode, seed):
    with on_backend(backend):
        _rotation_and_permutation(keys, mode, seed)


def _rotation_and_permutation(keys, mode, seed):
    B, H, N, D = keys.shape
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((D, D)))
    rotated = torch.from_numpy(keys.double().numpy() @ q).float()
    s = keydiff_scores(keys, anchor=mode).numpy()
    np.testing.assert_allclose(keydiff_scores(rotated, anchor=mode).numpy(), s, rtol=0, atol=TOL)
    perm = torch.from_numpy(rng.permutation(N))
    np.testing.assert_allclose(keydiff_scores(keys[:, :, perm], anchor=mode).numpy(), s[:, :, perm.numpy()],
                               rtol=0, atol=TOL)


@both_backends
@settings(max_examples=10)
@given(n=st.integers(1, 200), d=st.sampled_from([16, 64]), mode=st.sampled_from(kkd.ANCHORS),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 1000), data=st.data())
def test_zero_anchor_scores_zero_and_lower_indices_win(backend, n, d, mode, dtype, seed, data):
    with on_backend(backend):
        _zero_anchor_scores_zero_and_lower_indices_win(n, d, mode, dtype, seed, data)


def _zero_anchor_scores_zero_and_lower_indices_win(n, d, mode, dtype, seed, data):
    """Keys in ± pairs (unit norm, entries ±0.5: every sum is exact) and zero keys: a = 0."""
    rng = np.random.default_rng(seed)
    half = rng.integers(0, n // 2 + 1)
    k = np.zeros((n, d))
    for i in range(half):
        cols = rng.choice(d, 4, replace=False)
        k[2 * i, cols] = rng.choice([-0.5, 0.5], 4)
        k[2 * i + 1] = -k[2 * i]
    k = k[rng.permutation(n)]
    keys = torch.from_numpy(np.broadcast_to(k, (2, 1, n, d)).copy()).to(dtype)
    assert (ref.anchor(k, mode) == 0).all()
    s = keydiff_scores(keys, anchor=mode)
    assert (s == 0).all()
    budget = data.draw(st.integers(1, n))
    out = tritonkv.compress((keys, keys), KeyDiff(anchor=mode), budget)
    assert (out.indices == torch.arange(min(budget, n))).all()


# ------------------------------------------------------------------------------------------------
# settings, bad inputs, AOT


@pytest.mark.parametrize("make, exc, words", [
    (lambda: KeyDiff(window_share=1.0), ValueError, ["window_share"]),
    (lambda: KeyDiff(window_share=-0.1), ValueError, ["window_share"]),
    (lambda: KeyDiff(window_share=True), ValueError, ["window_share"]),
    (lambda: KeyDiff(window_share=0.2, window=3), ValueError, ["window", "window_share"]),
    (lambda: KeyDiff(anchor="median"), ValueError, ["anchor"]),
    (lambda: KeyDiff(sink=-1), ValueError, ["sink"]),
    (lambda: keydiff_scores(torch.randn(2, 3, 4)), ValueError, ["keys"]),
    (lambda: keydiff_scores(torch.ones(1, 1, 4, 8, dtype=torch.int32)), TypeError, ["keys"]),
    (lambda: keydiff_scores(torch.randn(1, 1, 4, 8), anchor="mean"), ValueError, ["anchor"]),
    (lambda: keydiff_scores(torch.randn(1, 1, 4, 8), chunk=-1), ValueError, ["chunk"]),
    (lambda: keydiff_scores(torch.randn(1, 1, 4, 0)), ValueError, ["keys", "head dim"]),
])
def test_bad_inputs(make, exc, words):
    assert_raises_naming(make, exc, words)


def test_registered():
    assert tritonkv.POLICIES["keydiff"] is KeyDiff
    pol = KeyDiff()
    assert (pol.sink, pol.window, pol.window_share, pol.anchor, pol.needs) == (0, 0, 0.0, "normalized", ())


def test_aot_compiles():
    common = {"H": "i32", "skb": "i32", "skh": "i32", "skn": "i32", "N": "i32", "D": "i32", "C": "i32", "CHUNK": "i32"}
    assert_compiles(
        {"module": "tritonkv.kernels.keydiff", "kernel": "_keydiff_anchor_kernel",
         "signature": {"k_ptr": "*bf16", "part_ptr": "*fp32", **common, "skb": "i64",
                       "TILE": "constexpr", "BLOCK_D": "constexpr", "STAGES": "constexpr", "NORMALIZE": "constexpr"},
         "constexprs": {"TILE": 64, "BLOCK_D": 128, "STAGES": STREAM_STAGES, "NORMALIZE": True}},
        {"module": "tritonkv.kernels.keydiff", "kernel": "_keydiff_score_kernel",
         "signature": {"k_ptr": "*fp16", "part_ptr": "*fp32", "out_ptr": "*fp32", "h0_ptr": "*i32", **common,
                       "sink": "i32", "window": "i32", "TILE": "constexpr", "BLOCK_D": "constexpr",
                       "BLOCK_C": "constexpr", "HIST": "constexpr", "NB": "constexpr", "HIST_TILE": "constexpr"},
         "constexprs": {"TILE": 64, "BLOCK_D": 128, "BLOCK_C": 32, "HIST": True, "NB": 256, "HIST_TILE": 1024}},
    )
