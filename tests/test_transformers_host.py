"""Host work of a block-wise prefill inside a model (tritonkv/integrations/transformers): on a GPU, a read-back of a
device value (``.item()``, ``bool(t)``, ``.tolist()``) or a host-to-device copy makes the host wait for the device,
once per layer and block. Run on the meta device, where tensors have shapes and no values: a read-back raises, and a
host tensor reaching an op is a copy that a GPU run would make. A seeded random Llama; no download."""
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tritonkv.integrations import transformers as tt

from helpers import tiny_llama

BLOCK, N = 256, 768


class HostTensors(TorchDispatchMode):
    """Records every op that takes a host tensor of one or more dimensions (a Python number is not one)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() > 0
               for t in tree_leaves((args, kwargs))):
            self.ops.append(str(func))
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def meta_model():
    return tiny_llama().to("meta")


@pytest.mark.parametrize("policy", ["keydiff", "knorm", "snapkv"])
def test_blockwise_prefill_has_no_host_sync(meta_model, policy):
    """A block-wise prefill of a known prompt length, one budget for every head and no padding: three blocks, each
    compressed in every layer, with no read-back and no host tensor copied to the device (the RoPE positions are
    made on the ids' device; a compression of a layer whose slots all held a token reads nothing back)."""
    ids = torch.zeros(1, N, dtype=torch.long, device="meta")
    cache = tt.make_cache(meta_model, policy, 0.1, mode="blockwise", block_size=BLOCK, prompt_length=N)
    mode = HostTensors()
    with mode:
        tt.prefill(meta_model, ids, cache)
    assert mode.ops == []
    layers = meta_model.config.num_hidden_layers
    assert cache.compressions == 3 * layers  # every block is over the budget (76 tokens)
    assert cache.stored_tokens() == [76] * layers


class OpsIn(TorchDispatchMode):
    """Counts the aten ops that run inside each of the named functions (the innermost of them on the stack)."""

    def __init__(self, *names):
        super().__init__()
        self.names, self.ops = names, {n: 0 for n in names}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        f = sys._getframe(1)
        while f is not None and f.f_code.co_name not in self.names:
            f = f.f_back
        if f is not None:
            self.ops[f.f_code.co_name] += 1
        return func(*args, **(kwargs or {}))


def test_cpu_per_head_rows_attend_with_few_ops_and_no_read_back(monkeypatch):
    """Block-wise SnapKV + AdaKV on the CPU: each later prefill block attends over each (row, KV head)'s slots
    with one SDPA of strided views (``suffix_attention``: at most 6 ops per row and 4 more, was 12 per row), and a
    decode step over the per-head rows likewise (``ragged_decode_sdpa``: at most 3 ops per row and 4 more, was
    12 per row), reading nothing back: the rows' starts and lengths are kept on the host (``RaggedKV.host_rows``)
    from the first step on."""
    model = tiny_llama()
    layers, R = model.config.num_hidden_layers, model.config.num_key_value_heads  # batch 1: R rows per layer
    ids = torch.randint(0, 256, (1, N), generator=torch.Generator().manual_seed(0))
    cache = tt.make_cache(model, "snapkv", 0.1, mode="blockwise", block_size=BLOCK, allocation="adakv",
                          prompt_length=N)
    counted = OpsIn("suffix_attention", "lower_right_mask")  # the shared mask's ops counted apart
    with counted:
        logits = tt.prefill(model, ids, cache)[:, -1]
    assert 0 < counted.ops["suffix_attention"] <= 2 * layers * (6 * R + 4)  # the 2 blocks after the first
    tt.decode(model, cache, logits, 2)  # one step: the rows' layout read once
    assert all(layer.store.ragged for layer in cache.layers)
    reads, tolist = [], torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or tolist(t))
    counted = OpsIn("ragged_decode_sdpa")
    with counted:
        tt.decode(model, cache, logits, 5)  # 4 steps
    assert reads == []
    assert 0 < counted.ops["ragged_decode_sdpa"] <= 4 * layers * (3 * R + 4)
