"""compress(): budgets, the unchanged path, dispatch, and a table of bad inputs."""
import pytest
import torch

import tritonkv
from reference.select import select as ref_select
from tritonkv.api import resolve_budget
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
