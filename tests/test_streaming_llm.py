"""StreamingLLM (docs/algorithms.md §1.3): the kept set [0, sink) ∪ [N − (k − sink), N) end to end through
compress() against the oracle, constant scores, protected sizes and bad inputs. (No kernel of its
own: the shared select does the work.)"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import tritonkv
from reference import streaming_llm as ref
from tritonkv.policies import StreamingLLM
from helpers import assert_raises_naming, both_backends, on_backend  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@settings(max_examples=15)
@given(B=st.integers(1, 2), H=st.integers(1, 4), N=st.one_of(st.integers(1, 12), st.integers(13, 300)),
       D=st.sampled_from([16, 64, 128]), dtype=st.sampled_from(DTYPES), sink=st.sampled_from([0, 1, 4, 4, 6]),
       data=st.data())
def test_kept_matches_oracle(B, H, N, D, dtype, sink, data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    keys = torch.randn(B, H, N, D, generator=g).to(dtype)
    values = torch.randn(B, H, N, D, generator=g).to(dtype)
    pol = StreamingLLM(sink=sink)
    edge = data.draw(st.sampled_from(["sink", "sink+1", "n-1", "n", "over", "random", "random"]))
    k = {"sink": max(sink, 1), "sink+1": sink + 1, "n-1": max(N - 1, 1), "n": N, "over": N + 3}.get(edge) \
        or data.draw(st.integers(1, N))
    if k >= N:
        out = tritonkv.compress((keys, values), pol, k)
        assert out.keys is keys and out.values is values
        return
    if k < min(sink, N):
        with pytest.raises(ValueError, match="budget"):
            tritonkv.compress((keys, values), pol, k)
        return
    assert pol.protected(N, k) == (min(sink, N), k - min(sink, N))
    out = tritonkv.compress((keys, values), pol, k)
    want = torch.from_numpy(ref.kept(N, k, sink))
    assert torch.equal(out.indices, want.expand(B, H, k))
    assert torch.equal(out.keys, keys[:, :, want]) and torch.equal(out.values, values[:, :, want])


@both_backends
def test_per_head_budgets_rank_the_constant_scores_by_index(backend):
    """With an allocation whose budgets exceed sink + window (``Fixed``'s do: it ignores the budget), a head keeps
    its sink and window plus its share of the other tokens, whose scores all tie at zero: the lowest indices, the
    same on both backends and in every run (the Triton path once ranked an unwritten score buffer there)."""
    from tritonkv.allocation import Fixed

    g = torch.Generator().manual_seed(1)
    B, H, N, sink, k = 2, 2, 64, 2, 20
    keys, values = torch.randn(B, H, N, 16, generator=g), torch.randn(B, H, N, 16, generator=g)
    shares = [[3, 9], [5, 0], [7, 7], [2, 30]]  # [L, H]: layer 1 gives heads 5 and 0
    for _ in range(2):
        with on_backend(backend):
            out = tritonkv.compress((keys, values), StreamingLLM(sink=sink), k,
                                    allocation=Fixed(budgets=torch.tensor(shares)), layer=1)
        _, _, lengths, pos = out.to_padded(with_positions=True)
        for h, share in enumerate(shares[1]):
            want = sorted(set(range(sink + share)) | set(ref.kept(N, k, sink).tolist()))  # + the lowest others
            for b in range(B):
                assert pos[b, h, :int(lengths[b, h])].tolist() == want, (b, h)


def test_scores_are_constant_zeros():
    keys = torch.randn(2, 3, 17, 16, dtype=torch.bfloat16)
    s = StreamingLLM().score(keys, keys)
    assert s.dtype == torch.float32 and s.shape == (2, 3, 17) and (s == 0).all()


def test_protected_sizes():
    pol = StreamingLLM()
    assert pol.sink == 4 and pol.window == 0 and StreamingLLM.needs == ()
    assert pol.protected(100, 10) == (4, 6)
    assert pol.protected(100, 4) == (4, 0)
    assert pol.protected(3, 2) == (3, 0)  # a row shorter than the sink: all sink
    assert pol.protected(100, 2) == (4, 0)  # below the sink: compress() rejects it
    assert ref.kept(100, 10).tolist() == [0, 1, 2, 3, 94, 95, 96, 97, 98, 99]
    assert tritonkv.POLICIES["streaming_llm"] is StreamingLLM


@pytest.mark.parametrize("make, exc, words", [
    (lambda: StreamingLLM(window=8), ValueError, ["window"]),
    (lambda: StreamingLLM(sink=-1), ValueError, ["sink"]),
    (lambda: StreamingLLM(sink=2.5), ValueError, ["sink"]),
    (lambda: StreamingLLM().score(torch.randn(2, 3, 4), None), ValueError, ["keys"]),
    (lambda: tritonkv.compress((torch.randn(1, 1, 20, 8),) * 2, "streaming_llm", 3), ValueError, ["budget", "sink"]),
])
def test_bad_inputs(make, exc, words):
    assert_raises_naming(make, exc, words)
