"""The select's tail stage (``_select_tail_kernel``: the third and fourth radix bytes and the chunks'
output offsets from the candidates, the keys sharing the threshold's top 16 bits) on candidate-heavy
rows, kept indices compared exactly with the NumPy oracle: many ties at the threshold spread over
many chunks, candidates that differ only in their low 16 bits, candidates in one chunk only, rows of
one value, AdaKV's one-row global select with forced tokens; and the pooling kernel's first radix
pass (``hist0=``) against a NumPy histogram of the keys."""
import contextlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from helpers import on_backend, programs_out_of_order, ulps
from reference.select import first_pass_histogram, select as ref_select
from tritonkv.kernels.select import INTERPRET, NB, select_indices, select_kv

ULP_RUN = 300  # 1.0 + j·ulp for j < ULP_RUN: every key has the top 16 bits of 1.0


def _check(s, k, chunk, sink=0, window=0, forced=None, order="grid"):
    """Kernel (``chunk`` tokens per program) against the oracle, row by row; the programs of each launch in grid
    order, or reversed (``order=None``) or permuted (a seed) by ``helpers.programs_out_of_order`` (on a GPU, the
    hardware's order)."""
    rows, n = s.shape
    ctx = contextlib.nullcontext() if order == "grid" or not INTERPRET else programs_out_of_order(order)
    with on_backend("triton"), ctx:
        idx, lengths = select_indices(torch.from_numpy(s), k, min(k, n), sink=sink, window=window, chunk=chunk,
                                      forced=None if forced is None else torch.from_numpy(forced))
    for r in range(rows):
        want = ref_select(s[r], k, sink, window, None if forced is None else forced[r])
        np.testing.assert_array_equal(idx[r, : lengths[r]].numpy(), want)


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), data=st.data())
def test_ties_at_the_threshold_spread_over_chunks(seed, data):
    """Three values over ~19 chunks of 16: the threshold's value is tied in every chunk; the kept ties are
    the lowest indices, whatever chunk they lie in."""
    rng = np.random.default_rng(seed)
    n = data.draw(st.integers(200, 300))
    s = rng.integers(0, 3, (2, n)).astype(np.float32)
    sink = data.draw(st.integers(0, 3))
    window = data.draw(st.integers(0, 5))
    k = data.draw(st.integers(sink + window, n))
    _check(s, k, 16, sink, window)


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), dup=st.integers(1, 4), data=st.data())
def test_candidates_that_differ_in_the_low_bits_only(seed, dup, data):
    """Every key is a candidate (one 16-bit prefix): the last two bytes decide, over shuffled chunks; with
    ``dup`` > 1 the values repeat (ties inside the candidates)."""
    rng = np.random.default_rng(seed)
    n = data.draw(st.integers(100, ULP_RUN))
    s = np.stack([ulps(rng.permutation(n) // dup) for _ in range(2)])
    k = data.draw(st.integers(0, n))
    _check(s, k, 16)


@pytest.mark.parametrize("chunk_of_run", [0, 5, 11])
def test_candidates_in_one_chunk_only(chunk_of_run):
    """Far-apart values everywhere but one chunk of 16 keys a few ulps apart (two of them tied): each budget
    whose threshold falls inside that chunk keeps its top m of them."""
    rng = np.random.default_rng(chunk_of_run)
    n = 192
    s = np.where(rng.random(n) < 0.5, 10.0 + rng.random(n), -10.0 - rng.random(n)).astype(np.float32)
    j = np.arange(16)
    j[3] = j[9]  # a tie inside the run
    s[chunk_of_run * 16:(chunk_of_run + 1) * 16] = ulps(rng.permutation(j))
    above = int((s > 2.0).sum())
    for m in (0, 1, 2, 7, 9, 10, 15, 16):
        _check(s[None], above + m, 16)


@pytest.mark.parametrize("value", [0.0, 1.5, float("nan")])
def test_rows_of_one_value(value):
    """The worst case (every key a candidate, every key tied): the lowest indices win; -0 == +0 (a row of
    both is one value); NaN ranks as -inf (a row of NaN is one value)."""
    n = 257
    s = np.full((2, n), value, np.float32)
    if value == 0.0:
        s[1, ::3] = -0.0
    for k in (0, 1, 100, n - 1, n):
        _check(s, k, 16)
    _check(s, 50, 16, sink=2, window=3)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(["normal", "ties", "ulps"]), data=st.data())
def test_adakv_global_select_with_forced_tokens(seed, kind, data):
    """AdaKV's second select: one row of H·N scores (a batch row's heads side by side) with each head's
    protected and top tokens forced, many chunks per row; the forced tokens and then the best of the rest."""
    rng = np.random.default_rng(seed)
    H, N = 4, data.draw(st.integers(40, 80))
    if kind == "normal":
        s = rng.standard_normal((1, H * N)).astype(np.float32)
    elif kind == "ties":
        s = rng.integers(-1, 2, (1, H * N)).astype(np.float32)
    else:
        s = ulps(rng.integers(0, 40, (1, H * N)))
    forced = rng.random((1, H * N)) < data.draw(st.sampled_from([0.0, 0.1, 0.4]))
    f = int(forced.sum())
    k = data.draw(st.integers(f, H * N))
    _check(s, k, 16, forced=forced)


@pytest.fixture
def small_steps(monkeypatch):
    """Every loop of the finish and tail kernels in several steps under the interpreter (where one step covers
    a whole row): 16 keys a pass step (the finish's next tile loaded during the current one's histogram), 4 slots
    summed a step, 8 candidates a step of the tail's last program (the first step loaded before its slots)."""
    from tritonkv.kernels import select as sel

    monkeypatch.setattr(sel, "_pass_tile", lambda n: 16)
    monkeypatch.setattr(sel, "SB", 4)
    monkeypatch.setattr(sel, "_cand_tile", lambda tile: 8)


# the fixture is a constant patch: nothing to reset between examples
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(["ties", "ulps", "one value", "normal"]),
       forced=st.booleans(), order=st.sampled_from(["grid", None, 0, 1, 2]), data=st.data())
def test_every_loop_in_several_steps(small_steps, seed, kind, forced, order, data):
    """Candidate-heavy rows through loops of several steps (``small_steps``): chunks of 64 keys (4 pass steps
    each), 5-9 chunks a row (2-3 slot steps), tens of candidates (several candidate steps); sink, window and
    forced tokens; the programs in grid order or out of it (as on a GPU, where the candidates land in the buffer
    in the order their programs claim slots, and any program of a row may be its last); kept indices exactly the
    oracle's."""
    rng = np.random.default_rng(seed)
    n = data.draw(st.integers(300, 560))
    if kind == "ties":
        s = rng.integers(0, 3, (2, n)).astype(np.float32)
    elif kind == "ulps":
        s = np.stack([ulps(rng.permutation(n) // 2) for _ in range(2)])
    elif kind == "one value":
        s = np.full((2, n), 1.5, np.float32)
    else:
        s = rng.standard_normal((2, n)).astype(np.float32)
    sink, window = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 5))
    f = rng.random((2, n)) < 0.1 if forced else None
    low = sink + window + (0 if f is None else int(f.sum(1).max()))
    _check(s, data.draw(st.integers(min(low, n), n)), 64, sink, window, f, order)


@pytest.mark.parametrize("head_reduce,kernel_size", [("mean", 7), ("layer", 1), ("max", 3), ("mean", 1), ("max", 1)])
@pytest.mark.parametrize("chunk", [0, 32])
def test_kernel_writing_the_scores_counts_the_first_pass(head_reduce, kernel_size, chunk):
    """The ``hist0`` of the kernel that writes the scores (the pooling kernel, or without pooling, κ = 1 and a
    per-KV-head reduction, the score kernel), in one chunk a row or several, is the first radix pass of the scores
    it returns (its slots sum to the NumPy histogram), and a select fed with it launches no pass-0 kernel and keeps
    what a select counting its own pass keeps."""
    from tritonkv.kernels._common import record_launches
    from tritonkv.kernels.window_attention import window_attention_scores

    g = torch.Generator().manual_seed(7)
    B, H, G, N, D, W = 1, 2, 2, 150, 16, 8
    keys = torch.randn(B, H, N, D, generator=g).to(torch.bfloat16)
    values = torch.randn(B, H, N, D, generator=g).to(torch.bfloat16)
    queries = torch.randn(B, H * G, W, D, generator=g).to(torch.bfloat16)
    sink, window = 2, W
    kw = dict(kernel_size=kernel_size, head_reduce=head_reduce, chunk=chunk)
    with on_backend("triton"):
        s, h0 = window_attention_scores(keys, queries, protect=(sink, window), **kw)
        assert torch.equal(s, window_attention_scores(keys, queries, **kw))
        want = first_pass_histogram(s.view(B * H, N).numpy(), sink, window, bins=NB)
        np.testing.assert_array_equal(h0.hist[:, 1:].sum(1).numpy(), want)
        plain = select_kv(s, 40, keys, values, 40, sink=sink, window=window)
        for _ in range(2):  # the control block is reset: the same pass serves another select
            with record_launches() as log:
                got = select_kv(s, 40, keys, values, 40, sink=sink, window=window, hist0=h0)
            assert all(torch.equal(a, b) for a, b in zip(got, plain))
            assert "_select_hist0_kernel" not in [x.name for x in log]
    for r in range(B * H):
        np.testing.assert_array_equal(plain[2].view(B * H, 40)[r].numpy(), ref_select(s.view(B * H, N)[r].numpy(),
                                                                                     40, sink, window))
    with on_backend("torch"):
        assert window_attention_scores(keys, queries, protect=(sink, window), **kw)[1] is None
