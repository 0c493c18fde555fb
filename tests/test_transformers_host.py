"""Host work of a block-wise prefill inside a model (tritonkv/integrations/transformers): on a GPU, a read-back of a
device value (``.item()``, ``bool(t)``, ``.tolist()``) or a host-to-device copy makes the host wait for the device,
once per layer and block. Run on the meta device, where tensors have shapes and no values: a read-back raises, and a
host tensor reaching an op is a copy that a GPU run would make. A seeded random Llama; no download."""
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
