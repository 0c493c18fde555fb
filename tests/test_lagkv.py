"""LagKV: scoring kernel and CPU PyTorch body, budget and paper modes, recursive form, against the
NumPy oracle and each other."""
import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

import tritonkv
from aot import assert_compiles
from reference import lagkv as ref
from reference.select import select as ref_select
from tritonkv.kernels import lagkv as klag
from tritonkv.kernels.lagkv import lagkv_scores
from tritonkv.policies.lagkv import LagKV, LagKVState
from helpers import assert_same_scores, both_backends, dry, on_backend  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@st.composite
def kv_case(draw, max_rows=2, scored=True, dups=False):
    """(keys, values, S, L): rows of P partitions plus a remainder; per-token scales spread the scores.
    ``dups``: some tokens copied onto others (equal scores within a partition, repeated references)."""
    S = draw(st.integers(0, 5))
    L = draw(st.sampled_from([4, 5, 8, 13, 16, 32]))
    P = draw(st.integers(2, 4)) if scored else draw(st.integers(0, 1))
    N = max(1, S + P * L + draw(st.sampled_from([0, L - 1]) | st.integers(0, L - 1)))
    B = draw(st.integers(1, 2))
    H = draw(st.integers(1, max_rows // B))
    D = draw(st.sampled_from([2, 3, 16, 33, 64]))
    dtype = draw(st.sampled_from(DTYPES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = torch.exp(torch.rand(B, H, N, 1, generator=g) * 3 - 1.5)
    keys = (torch.randn(B, H, N, D, generator=g) * scale).to(dtype)
    values = (torch.randn(B, H, N, D, generator=g) * scale.flip(2)).to(dtype)
    if dups:
        for src, dst in draw(st.lists(st.tuples(st.integers(0, N - 1), st.integers(0, N - 1)), max_size=12)):
            keys[:, :, dst], values[:, :, dst] = keys[:, :, src], values[:, :, src]
    return keys, values, S, L


def rows(keys, values):
    """(b, h, K, V) per row, the rounded inputs as float64 NumPy arrays for the oracle."""
    B, H = keys.shape[:2]
    for b in range(B):
        for h in range(H):
            yield b, h, keys[b, h].double().numpy(), values[b, h].double().numpy()


def separated(score, S, L, rel=1e-5):
    """True when, in every scored partition, distinct oracle scores differ by more than rel·max."""
    for j in range(ref.num_partitions(len(score), S, L) - 1):
        s = np.sort(score[S + j * L: S + (j + 1) * L])
        if np.diff(s).min() <= rel * s.max():
            return False
    return True


@both_backends
@given(case=kv_case())
def test_scores_and_ranks_match_oracle(backend, case):
    with on_backend(backend):
        keys, values, S, L = case
        raw = lagkv_scores(keys, values, sink=S, lag=L, rank=False)
        rank = lagkv_scores(keys, values, sink=S, lag=L, rank=True)
        assert raw.dtype == torch.float32 and raw.shape == keys.shape[:3]
        for b, h, K, V in rows(keys, values):
            s = ref.lag_scores(K, V, S, L)[0]
            sc = ~np.isnan(s)
            assert np.isinf(raw[b, h].numpy()[~sc]).all() and np.isinf(rank[b, h].numpy()[~sc]).all()
            np.testing.assert_allclose(raw[b, h].numpy()[sc], s[sc], rtol=1e-5, atol=1e-7)
            if separated(s, S, L):
                np.testing.assert_array_equal(rank[b, h].numpy()[sc], ref.ranks(s, S, L)[sc].astype(np.float32))


@given(case=kv_case(), data=st.data())
def test_torch_body_matches_kernel(case, data):
    """The CPU PyTorch body against the Triton kernel (interpreter): raw scores within fp32 round-off
    (+inf at the same places), ranks and compress()'s kept indices identical where the kernel's
    scores are separated within every partition (ranks of near-ties may swap)."""
    keys, values, S, L = case
    N = keys.shape[2]
    out = {}
    for backend in ("triton", "torch"):
        with on_backend(backend):
            raw = lagkv_scores(keys, values, sink=S, lag=L, rank=False)
            rank = lagkv_scores(keys, values, sink=S, lag=L, rank=True)
            k = data.draw(st.integers(S + ref.tail_len(N, S, L), N - 1)) if not out else out["triton"][2]
            out[backend] = raw, rank, k, tritonkv.compress((keys, values), LagKV(sink=S, lag=L), k).indices
    (raw_t, rank_t, _, idx_t), (raw_p, rank_p, _, idx_p) = out["triton"], out["torch"]
    assert raw_p.dtype == torch.float32 and raw_p.shape == raw_t.shape and raw_p.is_contiguous()
    fin = torch.isfinite(raw_t)
    assert torch.equal(fin, torch.isfinite(raw_p)) and torch.equal(rank_t[~fin], rank_p[~fin])
    torch.testing.assert_close(raw_p[fin], raw_t[fin], rtol=1e-5, atol=1e-7)
    for b, h, _, _ in rows(keys, values):
        if separated(raw_t[b, h].double().numpy(), S, L):
            assert torch.equal(rank_p[b, h], rank_t[b, h]) and torch.equal(idx_p[b, h], idx_t[b, h])


@pytest.mark.parametrize("rank", [False, True])
@pytest.mark.parametrize("val", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_inputs_score_alike_on_both_backends(val, rank):
    """NaN/±inf in a scored partition, in a reference partition and in a value: the same NaN and
    +inf scores (and ranks) on the kernel and the PyTorch body, the finite ones within round-off."""
    g = torch.Generator().manual_seed(6)
    keys, values = torch.randn(2, 2, 3 + 6 * 8 + 5, 16, generator=g), torch.randn(2, 2, 3 + 6 * 8 + 5, 16, generator=g)
    keys[0, 1, 3 + 5, 2] = val  # partition 0
    keys[1, 0, 3 + 8 * 3, 0] = val  # partition 3: its own scores and partition 2's reference
    values[1, 1, 3 + 8 + 7, 15] = val
    with on_backend("triton"):
        want = lagkv_scores(keys, values, sink=3, lag=8, rank=rank)
    with on_backend("torch"):
        got = lagkv_scores(keys, values, sink=3, lag=8, rank=rank)
    assert_same_scores(got, want, rtol=1e-5, atol=1e-7)


def _bits(t):
    """The bit patterns of ``t`` (to compare NaN payloads too)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


@both_backends
@pytest.mark.parametrize("val", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_token_is_left_out(backend, val):
    """The NaN rule: a token with a non-finite key or value scores NaN and ranks lowest in its partition
    (the lower index first among such tokens); the reference min/max and the softmax are taken over the
    finite tokens, so the other tokens score as if it were absent — a reference partition holding one
    scores its predecessor exactly like one holding a copy of a finite token instead (same min/max);
    a partition of bad tokens only leaves its predecessor unnormalised. Kept set = the oracle's, kept
    rows bit for bit."""
    with on_backend(backend):
        S, L, D = 3, 8, 16
        N = S + 5 * L + 4  # P = 5: partitions 0-3 scored, tail [S + 4L, N)
        g = torch.Generator().manual_seed(7)
        keys, values = torch.randn(2, 1, N, D, generator=g), torch.randn(2, 1, N, D, generator=g)
        keys[:, 0, S + 1, 2] = val  # partition 0
        clean_k, clean_v = keys.clone(), values.clone()
        values[:, 0, S + L + 6, 0] = val  # partition 1: partition 0's reference
        keys[:, 0, S + L + 7, 5] = val
        keys[1, 0, S + 3 * L: S + 4 * L, 1] = val  # row 1: partition 3 all bad (partition 2's reference)
        clean_k[:, 0, S + L + 6: S + L + 8] = clean_k[:, 0, S + L: S + L + 1]  # copies of a finite token
        clean_v[:, 0, S + L + 6: S + L + 8] = clean_v[:, 0, S + L: S + L + 1]
        raw = lagkv_scores(keys, values, sink=S, lag=L, rank=False)
        rank = lagkv_scores(keys, values, sink=S, lag=L, rank=True)
        bad = ~(torch.isfinite(keys).all(-1) & torch.isfinite(values).all(-1))
        scored = slice(S, S + 4 * L)
        assert torch.equal(torch.isnan(raw[..., scored]), bad[..., scored])
        for b, h, K, V in rows(keys, values):
            s = ref.lag_scores(K, V, S, L)[0]
            sc = ~np.isnan(s)
            np.testing.assert_allclose(raw[b, h].numpy()[sc], s[sc], rtol=1e-5, atol=1e-7)
        # the finite tokens' softmaxes still sum to 1 (K) + 1 (V) in every partition that has some
        sums = torch.nansum(raw[..., scored].reshape(2, 1, 4, L).double(), -1)
        want = torch.full_like(sums, 2.0)
        want[1, 0, 3] = 0.0
        torch.testing.assert_close(sums, want, rtol=0, atol=1e-5)
        # partition 0 (its bad token aside) scores as with finite copies in its reference
        clean = lagkv_scores(clean_k, clean_v, sink=S, lag=L, rank=False)
        p0 = slice(S, S + L)
        fin = ~bad[..., p0]
        assert torch.equal(raw[..., p0][fin], clean[..., p0][fin])
        # bad tokens rank lowest; a partition of bad tokens ranks by index
        assert (rank[..., S + 1] == 0).all()
        torch.testing.assert_close(rank[1, 0, S + 3 * L: S + 4 * L], torch.arange(L - 1, -1, -1) / L, rtol=0, atol=0)
        for k in (S + L + 4 + 4, N - 3):  # one, then most tokens per partition: the bad ones are kept last
            out = tritonkv.compress((keys, values), LagKV(sink=S, lag=L), k)
            for b, h, K, V in rows(keys, values):
                np.testing.assert_array_equal(out.indices[b, h].numpy(), ref.budget_keep(K, V, S, L, k))
                i = out.indices[b, h]
                assert torch.equal(_bits(out.keys[b, h]), _bits(keys[b, h, i]))
                assert torch.equal(_bits(out.values[b, h]), _bits(values[b, h, i]))


@settings(max_examples=10)
@given(case=kv_case(dups=True), parts=st.integers(1, 3), data=st.data())
def test_grid_and_blocks_do_not_change_results(case, parts, data):
    """Runs of several partitions per program (min/max carried down the run) and partitions cut into
    token/rank chunks (the path of partitions too large for one register tile: stds and scores through
    the scratch row, kept rows re-read) give bit-identical scores, ranks and kept tokens."""
    keys, values, S, L = case
    N = keys.shape[2]
    k = data.draw(st.integers(S + ref.tail_len(N, S, L), N - 1))
    pol = LagKV(sink=S, lag=L)
    base = [lagkv_scores(keys, values, sink=S, lag=L, rank=r) for r in (False, True)]
    kept = tritonkv.compress((keys, values), pol, k)
    orig = klag._blocks

    def small(*args):  # also rank chunks (BLOCK_J < BLOCK_L), which no tile gives at these sizes
        pp, bl, bt, bd, bj, w = orig(*args)
        return pp, bl, max(1, bl // 4), bd, max(1, bl // 2), w

    try:
        klag._blocks = small
        tiled = [lagkv_scores(keys, values, sink=S, lag=L, rank=r, parts=parts) for r in (False, True)]
        P = ref.num_partitions(N, S, L)
        q, rem = divmod(k - S - ref.tail_len(N, S, L), P - 1)
        chunked = klag.lagkv_compress(keys, values, k, sink=S, lag=L, quota=q, rem=rem, window=ref.tail_len(N, S, L),
                                      parts=parts)
    finally:
        klag._blocks = orig
    for a, b in zip(base, tiled):
        assert_same_scores(b, a, rtol=0, atol=0)
    for a, b in zip(kept, chunked):
        assert torch.equal(a, b)


def _kept(keys, values, S, L, k, **tiling):
    """``lagkv_compress`` in budget mode keeping ``k`` tokens (the policy's split), with a tiling."""
    N = keys.shape[2]
    q, rem = divmod(k - S - ref.tail_len(N, S, L), ref.num_partitions(N, S, L) - 1)
    return klag.lagkv_compress(keys, values, k, sink=S, lag=L, quota=q, rem=rem, window=ref.tail_len(N, S, L),
                               **tiling)


@settings(max_examples=20)
@given(case=kv_case(dups=True), tile=st.sampled_from(sorted({t for t, _ in klag.TILINGS[1:]} | {1, 2, 4, 8})),
       parts=st.integers(0, 3), data=st.data())
def test_tilings_match_oracle_and_default(case, tile, parts, data):
    """Every tile (the GPU session's ``TILINGS`` and smaller; token chunks through the scratch row, warps chosen
    to keep the channel layout) against the NumPy oracle — raw scores within round-off, ranks and kept tokens
    exact where the scores are separated — and bit for bit against the default tiling: raw scores, ranks, kept
    indices and K/V rows."""
    keys, values, S, L = case
    N, D = keys.shape[2:]
    try:
        klag._tiling(L, D, keys.element_size(), tile, 0)
    except ValueError:  # a [tile, D] chunk cannot keep the default's channel layout (small tiles, D 33/64)
        assume(False)
    k = data.draw(st.integers(S + ref.tail_len(N, S, L), N - 1))
    tiled = dict(tile=tile, parts=parts)
    got = [lagkv_scores(keys, values, sink=S, lag=L, rank=r, **tiled) for r in (False, True)]
    got_kept = _kept(keys, values, S, L, k, **tiled)
    for b, h, K, V in rows(keys, values):
        s = ref.lag_scores(K, V, S, L)[0]
        sc = ~np.isnan(s)
        np.testing.assert_allclose(got[0][b, h].numpy()[sc], s[sc], rtol=1e-5, atol=1e-7)
        if separated(s, S, L):
            np.testing.assert_array_equal(got[1][b, h].numpy()[sc], ref.ranks(s, S, L)[sc].astype(np.float32))
            np.testing.assert_array_equal(got_kept[2][b, h].numpy(), ref.budget_keep(K, V, S, L, k))
    want = [lagkv_scores(keys, values, sink=S, lag=L, rank=r) for r in (False, True)] + list(_kept(keys, values, S,
                                                                                                  L, k))
    for a, b in zip(want, got + list(got_kept)):
        assert torch.equal(_bits(a), _bits(b)) if a.is_floating_point() else torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tilings_keep_the_channel_layout(dtype):
    """At the shipped shape (lag 128, D 128) every tiling of ``TILINGS`` is admitted as given and lays a token's
    channels out like the default (a 16-byte vector per thread, 128·itemsize/16 lanes, one warp): the per-token
    stds sum in the same order. A tile too small for its warps is refused by name, and so are bad values."""
    item = torch.empty((), dtype=dtype).element_size()
    assert klag._tiling(128, 128, item)[1:4] == (128, 128, 32)  # the whole partition (on a GPU: 16 warps)
    want = (16 // item, 128 * item // 16, 1)
    assert klag._channels(128, 128, 16 // item, 16) == want
    for tile, warps in klag.TILINGS[1:]:
        _, bt, _, _, w = klag._tiling(128, 128, item, tile, warps)
        assert (bt, w) == (tile, warps) and klag._channels(bt, 128, 16 // item, w) == want
    keys = torch.zeros(1, 1, 600, 128, dtype=dtype)
    with pytest.raises(ValueError, match="tile 2 / warps 4"):  # [2, 128] over 128 threads: 2 channels a thread
        lagkv_scores(keys, keys, lag=128, tile=2, warps=4)
    # not 16-byte aligned (a row of 129 channels cut to 128): scalar loads spread a token over 4 warps by default,
    # so fewer warps are refused, 4 and more admitted
    odd = torch.zeros(1, 1, 600, 129, dtype=dtype)[..., 1:]
    assert not klag._aligned(odd, odd) and klag._aligned(keys, keys)
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        lagkv_scores(odd, odd, lag=128, tile=8, warps=1)
    lagkv_scores(odd[:, :, :300], odd[:, :, :300], lag=128, tile=16, warps=4)
    for kw, arg, err in [({"tile": 3}, "tile", ValueError), ({"warps": 3}, "warps", ValueError),
                         ({"warps": 32}, "warps", ValueError), ({"tile": -1}, "tile", ValueError),
                         ({"tile": 1.0}, "tile", TypeError), ({"parts": -1}, "parts", ValueError)]:
        with pytest.raises(err, match=arg):
            lagkv_scores(keys, keys, lag=128, **kw)
        with pytest.raises(err, match=arg):
            _kept(keys, keys, 16, 128, 16 + 64 + 128 + 72, **kw)


@both_backends
@given(case=kv_case(dups=True), data=st.data())
def test_budget_mode_matches_oracle(backend, case, data):
    """compress() (one launch of the closed form): the quota per partition whatever the scores, the
    oracle's kept set where scores are separated, the kept rows copied; budgets at the edges (sinks +
    tail, N − 1, N, > N, fractions)."""
    with on_backend(backend):
        keys, values, S, L = case
        N = keys.shape[2]
        pol = LagKV(sink=S, lag=L)
        P, tail = ref.num_partitions(N, S, L), ref.tail_len(N, S, L)
        assert pol.tail(N) == tail
        k = data.draw(st.sampled_from([S + tail, N - 1, N, N + 3]) | st.integers(S + tail, N - 1))
        budget = data.draw(st.sampled_from([k, k / N]) if k <= N else st.just(k))
        k = tritonkv.resolve_budget(budget, N)
        assume(k >= S + tail)
        out = tritonkv.compress((keys, values), pol, budget)
        if k >= N:  # the input itself
            assert out.keys is keys and out.values is values and torch.equal(out.indices[0, 0], torch.arange(N))
            return
        assert pol.protected(N, k) == (S, tail)
        assert out.indices.shape == keys.shape[:2] + (k,) and out.indices.dtype == torch.int64
        q, rem = divmod(k - S - tail, P - 1)
        for b, h, K, V in rows(keys, values):
            idx = out.indices[b, h].numpy()
            # the quota holds whatever the scores: q per partition, one more in the first rem
            part = (idx[(idx >= S) & (idx < S + (P - 1) * L)] - S) // L
            np.testing.assert_array_equal(np.bincount(part, minlength=P - 1), [q + (j < rem) for j in range(P - 1)])
            if separated(ref.lag_scores(K, V, S, L)[0], S, L):
                np.testing.assert_array_equal(idx, ref.budget_keep(K, V, S, L, k))
            assert torch.equal(out.keys[b, h], keys[b, h, idx]) and torch.equal(out.values[b, h], values[b, h, idx])


@both_backends
@given(case=kv_case(dups=True), data=st.data())
def test_closed_form_equals_scores_and_shared_select(backend, case, data):
    """The one-launch closed form keeps exactly what the ranks + the shared top-k keep (equal ranks
    across partitions and ties to the lower index), duplicated tokens and near-ties included: both
    paths rank with the same code."""
    from tritonkv.kernels import select as sel

    with on_backend(backend):
        keys, values, S, L = case
        N = keys.shape[2]
        tail = ref.tail_len(N, S, L)
        k = data.draw(st.sampled_from([S + tail, N - 1]) | st.integers(S + tail, N - 1))
        out = tritonkv.compress((keys, values), LagKV(sink=S, lag=L), k)
        ranks = lagkv_scores(keys, values, sink=S, lag=L, rank=True)
        ko, vo, idx, _ = sel.select_kv(ranks, k, keys, values, k, sink=S, window=tail)
        assert torch.equal(out.indices, idx) and torch.equal(out.keys, ko) and torch.equal(out.values, vo)


@both_backends
@given(case=kv_case(), data=st.data())
def test_cross_scoring_selects_top_raw_scores(backend, case, data):
    with on_backend(backend):
        keys, values, S, L = case
        N = keys.shape[2]
        pol = LagKV(sink=S, lag=L, cross_scoring=True)
        tail = ref.tail_len(N, S, L)
        k = data.draw(st.integers(S + tail, N - 1))
        out = tritonkv.compress((keys, values), pol, k)
        for b, h, K, V in rows(keys, values):
            s = ref.lag_scores(K, V, S, L)[0]
            srt = np.sort(s[~np.isnan(s)])
            if np.diff(srt).min() > 1e-5 * srt.max():
                np.testing.assert_array_equal(out.indices[b, h].numpy(), ref_select(np.nan_to_num(s), k, S, tail))


@both_backends
@given(case=kv_case(), ratio=st.sampled_from([0.5, 0.25, 1 / 6, 0.125, 1.0, 0.01]))
def test_paper_mode_matches_oracle(backend, case, ratio):
    with on_backend(backend):
        keys, values, S, L = case
        N = keys.shape[2]
        pol = LagKV(sink=S, lag=L, ratio=ratio)
        ko, vo, idx = pol.paper(keys, values)
        assert idx.shape[-1] == pol.kept_count(N) == ref.paper_count(N, S, L, ratio)  # Eq. 10
        for b, h, K, V in rows(keys, values):
            if separated(ref.lag_scores(K, V, S, L)[0], S, L):
                np.testing.assert_array_equal(idx[b, h].numpy(), ref.paper_keep(K, V, S, L, ratio))
            i = idx[b, h]
            assert torch.equal(ko[b, h], keys[b, h, i]) and torch.equal(vo[b, h], values[b, h, i])


@st.composite
def chunkings(draw, n):
    """Chunk sizes summing to n (empty chunks included)."""
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=6)))
    return np.diff([0] + cuts + [n]).tolist()


@both_backends
@settings(max_examples=15)
@given(case=kv_case(), ratio=st.sampled_from([0.5, 0.25, 0.125]), data=st.data())
def test_recursive_form_equals_one_shot(backend, case, ratio, data):
    """After ANY chunking the recursive state equals paper mode on all tokens; |U| < 2L after every append."""
    with on_backend(backend):
        keys, values, S, L = case
        N = keys.shape[2]
        chunks = data.draw(chunkings(N))
        state = LagKV(sink=S, lag=L, ratio=ratio).new_state()
        t = 0
        for n in chunks:
            state.append(keys[:, :, t:t + n], values[:, :, t:t + n])
            t += n
            assert state.tail_len < 2 * L and len(state) == state.keys.shape[2] == state.indices.shape[2]
        ko, vo, idx = LagKV(sink=S, lag=L, ratio=ratio).paper(keys, values)
        assert torch.equal(state.indices, idx)
        assert torch.equal(state.keys, ko) and torch.equal(state.values, vo)
        for b, h, K, V in rows(keys, values):  # an independent NumPy recursive implementation agrees
            if separated(ref.lag_scores(K, V, S, L)[0], S, L):
                np.testing.assert_array_equal(idx[b, h].numpy(), ref.recursive_keep(K, V, S, L, ratio, chunks))


@both_backends
@given(case=kv_case(scored=False), data=st.data())
def test_short_rows(backend, case, data):
    """N < S + 2L: nothing is scored; paper mode keeps everything, budget mode is StreamingLLM."""
    with on_backend(backend):
        keys, values, S, L = case
        N = keys.shape[2]
        assert torch.isinf(lagkv_scores(keys, values, sink=S, lag=L)).all()
        pol = LagKV(sink=S, lag=L)
        ko, vo, idx = pol.paper(keys, values)
        assert ko is keys and vo is values and torch.equal(idx[0, 0], torch.arange(N))
        assume(N > max(S, 1))
        k = data.draw(st.integers(max(S, 1), N - 1))
        assert pol.protected(N, k) == (S, k - S)
        out = tritonkv.compress((keys, values), pol, k)
        for b, h, K, V in rows(keys, values):
            np.testing.assert_array_equal(out.indices[b, h].numpy(), ref.budget_keep(K, V, S, L, k))


@both_backends
@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_channels_give_finite_scores(backend, dtype):
    with on_backend(backend):
        g = torch.Generator().manual_seed(1)
        keys = torch.randn(1, 2, 4 + 5 * 8 + 3, 16, generator=g)
        values = torch.randn(1, 2, keys.shape[2], 16, generator=g)
        keys[..., :5] = 0.5  # constant over all tokens
        values[..., 3] = -2.0
        values[:, :, 4 + 8: 4 + 16] = 1.0  # a whole constant reference partition (every channel)
        keys, values = keys.to(dtype), values.to(dtype)
        for rank in (False, True):
            s = lagkv_scores(keys, values, sink=4, lag=8, rank=rank)
            assert torch.isfinite(s[..., 4: 4 + 4 * 8]).all()
        raw = lagkv_scores(keys, values, sink=4, lag=8, rank=False)
        for b, h, K, V in rows(keys, values):
            s = ref.lag_scores(K, V, 4, 8)[0]
            sc = ~np.isnan(s)
            np.testing.assert_allclose(raw[b, h].numpy()[sc], s[sc], rtol=1e-5, atol=1e-7)


@both_backends
@settings(max_examples=15)
@given(case=kv_case(), seed=st.integers(0, 1000))
def test_per_channel_affine_maps_leave_scores_unchanged(backend, case, seed):
    with on_backend(backend):
        keys, values, S, L = case
        keys, values = keys.float(), values.float()
        g = torch.Generator().manual_seed(seed)
        D = keys.shape[-1]
        a_k, a_v = torch.rand(D, generator=g) * 3 + 0.25, torch.rand(D, generator=g) * 3 + 0.25
        b_k, b_v = torch.randn(D, generator=g) * 5, torch.randn(D, generator=g) * 5
        s0 = lagkv_scores(keys, values, sink=S, lag=L, rank=False)
        s1 = lagkv_scores(keys * a_k + b_k, values * a_v + b_v, sink=S, lag=L, rank=False)
        fin = torch.isfinite(s0)
        assert torch.equal(fin, torch.isfinite(s1))
        torch.testing.assert_close(s1[fin], s0[fin], rtol=1e-4, atol=1e-6)


@both_backends
@given(case=kv_case())
def test_softmax_sums_to_one_per_partition(backend, case):
    """Σ_{t∈π_j} φ_Z[t] = 1: the raw score sums to 2 per partition, and to 2·φ_K when V = K."""
    with on_backend(backend):
        keys, values, S, L = case
        N = keys.shape[2]
        P = ref.num_partitions(N, S, L)
        parts = slice(S, S + (P - 1) * L)
        raw = lagkv_scores(keys, values, sink=S, lag=L, rank=False)[..., parts]
        sums = raw.reshape(*raw.shape[:2], P - 1, L).double().sum(-1)
        torch.testing.assert_close(sums, torch.full_like(sums, 2.0), rtol=0, atol=1e-5)
        same = lagkv_scores(keys, keys, sink=S, lag=L, rank=False)[..., parts]
        for b, h, K, _ in rows(keys, values):
            np.testing.assert_allclose(same[b, h].numpy(), 2 * ref.lag_scores(K, K, S, L)[1][parts],
                                       rtol=1e-5, atol=1e-7)


@both_backends
@pytest.mark.parametrize("dtype", DTYPES)
def test_equal_scores_give_lower_index_the_higher_rank(backend, dtype):
    with on_backend(backend):
        S, L, D = 2, 8, 16
        g = torch.Generator().manual_seed(2)
        keys = torch.randn(1, 1, S + 4 * L, D, generator=g)
        values = torch.randn(1, 1, S + 4 * L, D, generator=g)
        p2 = slice(S + 2 * L, S + 3 * L)
        keys[:, :, p2], values[:, :, p2] = keys[:, :, S + 2 * L: S + 2 * L + 1], values[:, :, S + 2 * L: S + 2 * L + 1]
        keys[:, :, S + 5], values[:, :, S + 5] = keys[:, :, S + 2], values[:, :, S + 2]  # a duplicate in partition 0
        keys, values = keys.to(dtype), values.to(dtype)
        rank = lagkv_scores(keys, values, sink=S, lag=L)[0, 0]
        raw = lagkv_scores(keys, values, sink=S, lag=L, rank=False)[0, 0]
        assert raw[S + 2] == raw[S + 5] and rank[S + 2] == rank[S + 5] + 1 / L
        assert sorted((rank[S: S + L] * L).tolist()) == list(range(L))
        # partition 2: L identical tokens rank L-1, L-2, ..., 0
        torch.testing.assert_close(rank[p2], torch.arange(L - 1, -1, -1) / L, rtol=0, atol=0)
        # budget mode, one selectable token per scored partition: partition 2 keeps its first token
        out = tritonkv.compress((keys, values), LagKV(sink=S, lag=L), S + L + 3)
        kept = out.indices[0, 0].tolist()
        assert S + 2 * L in kept and all(i not in kept for i in range(S + 2 * L + 1, S + 3 * L))


@both_backends
def test_strided_inputs(backend):
    with on_backend(backend):
        g = torch.Generator().manual_seed(3)
        base = torch.randn(2, 50, 3, 16, generator=g)  # [B, N, H, D] storage
        keys, values = base.permute(0, 2, 1, 3), (base * 2 + 1).flip(-1).permute(0, 2, 1, 3)
        a = lagkv_scores(keys, values, sink=3, lag=8)
        b = lagkv_scores(keys.contiguous(), values.contiguous(), sink=3, lag=8)
        assert torch.equal(a, b)


def test_default_settings_and_registry():
    pol = tritonkv.get_policy("lagkv")
    assert isinstance(pol, LagKV) and (pol.sink, pol.lag, pol.ratio, pol.cross_scoring) == (16, 128, 0.5, False)
    assert pol.keep == 64 and LagKV(ratio=1 / 6).keep == 21 and LagKV(lag=100, ratio=0.29).keep == 29
    assert pol.kept_count(16 + 5 * 128 + 7) == 16 + 64 * 4 + 128 + 7


def test_bad_input():
    k = torch.randn(1, 2, 40, 8)
    pol = LagKV(sink=4, lag=8)  # P = 4, tail = 12
    with pytest.raises(ValueError, match="budget"):
        pol.protected(40, 15)
    with pytest.raises(ValueError, match="budget"):
        tritonkv.compress((k, k), pol, 15)
    with pytest.raises(ValueError, match="budget"):
        LagKV(sink=4, lag=32).protected(40, 3)  # short row: below the sinks
    for kw, arg in [({"lag": 0}, "lag"), ({"ratio": 0.0}, "ratio"), ({"ratio": 1.5}, "ratio"),
                    ({"window": 4}, "window"), ({"sink": -1}, "sink"), ({"eps": 0.0}, "eps")]:
        with pytest.raises(ValueError, match=arg):
            LagKV(**kw)
    with pytest.raises(ValueError, match="head dim"):
        lagkv_scores(torch.randn(1, 1, 40, 1), torch.randn(1, 1, 40, 1), sink=4, lag=8)
    with pytest.raises(ValueError, match="values"):
        lagkv_scores(k, k[:, :1], sink=4, lag=8)
    with pytest.raises(TypeError, match="keys"):
        lagkv_scores(k.long(), k, sink=4, lag=8)
    state = LagKVState(sink=4, lag=8)
    with pytest.raises(ValueError, match="nothing appended"):
        state.keys
    state.append(k[:, :, :5], k[:, :, :5])
    with pytest.raises(ValueError, match="keys"):
        state.append(torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 8))


@pytest.mark.parametrize("what", ["budget", "budget_short_row", "paper", "recursive"])
def test_compress_is_one_launch(what):
    """Budget mode (also on a row too short to score) and paper mode: one Triton launch and no torch-side
    device op (so no host sync either); a recursive step: one Triton launch. (The launches logged and not
    run, on the Triton bodies; the old score + shared select path made 6 and more.)"""
    if not klag.INTERPRET:
        pytest.skip("the Triton bodies run on CPU tensors only under TRITON_INTERPRET=1")
    n = 100 if what == "budget_short_row" else 4096
    keys = torch.empty(1, 8, n, 128, dtype=torch.bfloat16)
    values = torch.empty_like(keys)
    pol = LagKV()
    state = pol.new_state()
    run = {"budget": lambda: tritonkv.compress((keys, values), pol, 0.25),
           "budget_short_row": lambda: tritonkv.compress((keys, values), pol, 0.25),
           "paper": lambda: pol.paper(keys, values),
           "recursive": lambda: state.append(keys[:, :, :16 + 3 * 128], values[:, :, :16 + 3 * 128])}[what]
    launches, ops, syncs = dry(run)
    assert launches == ["_lagkv_kernel"] and not syncs, (launches, syncs)
    if what != "recursive":  # (a recursive step also copies tokens into its state: arange, clone, cat)
        assert not ops, ops


@pytest.mark.parametrize("dtype", DTYPES)
def test_interpreters_min_max_equal_the_joint_reduction(dtype, monkeypatch):
    """The interpreter takes each channel's min and max as ``tl.min``/``tl.max``; the GPU's one tuple reduction
    (``_lohi``, ``_JOINT_MINMAX``) gives the same bits: raw scores, ranks and kept tokens, on rows with non-finite
    tokens, zeros of both signs (a channel's min ±0), whole-partition and chunked tiles."""
    S, L, D = 2, 8, 16
    g = torch.Generator().manual_seed(11)
    keys, values = torch.randn(2, 1, S + 3 * L + 3, D, generator=g), torch.randn(2, 1, S + 3 * L + 3, D, generator=g)
    keys[0, 0, S + 1, 3], values[1, 0, S + L + 2, 5] = float("nan"), float("inf")  # left out of the min/max
    keys[:, :, S:, 0] = torch.where(torch.rand(keys.shape[:3], generator=g)[..., S:] < 0.5, 0.0, -0.0)
    keys, values = keys.to(dtype), values.to(dtype)
    k = S + ref.tail_len(keys.shape[2], S, L) + 2 * 3
    orig = klag._blocks

    def chunks(*args):  # partitions cut into token chunks (the min/max folded chunk by chunk)
        pp, bl, bt, bd, bj, w = orig(*args)
        return pp, bl, max(1, bl // 4), bd, bj, w

    def run():
        with on_backend("triton"):
            out = [lagkv_scores(keys, values, sink=S, lag=L, rank=r) for r in (False, True)]
            out += list(tritonkv.compress((keys, values), LagKV(sink=S, lag=L), k))
            monkeypatch.setattr(klag, "_blocks", chunks)
            out += [lagkv_scores(keys, values, sink=S, lag=L, rank=True)]
            monkeypatch.setattr(klag, "_blocks", orig)
            return out

    split = run()
    assert not klag._JOINT_MINMAX  # the interpreter's form
    monkeypatch.setattr(klag, "_JOINT_MINMAX", True)
    joint = run()
    for a, b in zip(split, joint):
        assert torch.equal(_bits(a), _bits(b)) if a.is_floating_point() else torch.equal(a, b)


def test_lagkv_kernel_compiles_ahead_of_time():
    """Every mode (select, rank, raw), whole-partition and chunked tiles, and every tiling of ``TILINGS`` at the
    shipped shape and its warps, for sm_80 and sm_90, and the partition walk software-pipelined (``STAGES`` 2);
    eps also as fp64, how torch.compile (Inductor) passes a Python float."""
    sig = {"k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*i64", "ko_ptr": "*bf16", "vo_ptr": "*bf16",
           "tmp_ptr": "*fp32", "H": "i32", "skb": "i64", "skh": "i64", "skn": "i64", "svb": "i64", "svh": "i64",
           "svn": "i64", "N": "i32", "D": "constexpr", "sink": "i32", "lag": "constexpr", "n_scored": "i32",
           "parts": "i32",
           "n_runs": "i32", "quota": "i32", "rem": "i32", "n_out": "i32", "window": "i32", "eps": "fp32",
           "BLOCK_L": "constexpr", "BLOCK_T": "constexpr", "BLOCK_D": "constexpr", "BLOCK_J": "constexpr",
           "MODE": "constexpr", "STAGES": "constexpr"}
    # (tests/aot.py compiles at its default 4 warps: small tiles, so that ptxas stays quick; the shipped
    # 128 x 128 whole-partition tile runs 16 warps)
    # (D = BLOCK_D and lag = BLOCK_L: the tile masks fold away; smaller: they stay)
    whole = {"D": 64, "lag": 32, "BLOCK_L": 32, "BLOCK_T": 32, "BLOCK_D": 64, "BLOCK_J": 32}
    chunked = {"D": 48, "lag": 200, "BLOCK_L": 256, "BLOCK_T": 16, "BLOCK_D": 64, "BLOCK_J": 64}
    specs = [(whole, 2, "fp64", "*i64", 4), (chunked, 2, "fp32", "*i64", 4), (whole, 1, "fp32", "*fp32", 4),
             (chunked, 0, "fp64", "*fp32", 4), ({**whole, "STAGES": 2}, 2, "fp32", "*i64", 4)]  # pipelined walk
    # the GPU session's tilings at the shipped shape (lag 128, D 128), select mode, at their warps
    for tile, warps in klag.TILINGS[1:]:
        bl, bt, bd, bj, w = klag._tiling(128, 128, 2, tile, warps)
        specs.append(({"D": 128, "lag": 128, "BLOCK_L": bl, "BLOCK_T": bt, "BLOCK_D": bd, "BLOCK_J": bj}, 2, "fp32",
                      "*i64", w))
    assert_compiles(*({"module": "tritonkv.kernels.lagkv", "kernel": "_lagkv_kernel",
                       "signature": {**sig, "eps": eps, "out_ptr": out},
                       "constexprs": {"STAGES": klag.STAGES, **blocks, "MODE": mode},
                       "options": {"num_warps": warps}} for blocks, mode, eps, out, warps in specs))
