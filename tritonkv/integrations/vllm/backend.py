"""The attention backend on the CPU: vLLM's CPU backend, wrapped (``common.py`` has what all wrapped backends
share).

* ``customize_spec`` gives each decoder layer a ``TritonKVSpec`` (the schedule travels to the scheduler with it);
* the metadata builder computes, per request row, ``s = start(seq_len - query_len)`` and hands the stock kernel the
  row's block table from block ``s / block_size`` on and the length ``seq_len - s`` (a *virtual* table: positions
  and the slot mapping stay logical, so the model runner is untouched); it lists the rows whose ``start`` advances
  in this step;
* after a layer's attention, ``forward`` compresses each listed row: it reads that layer's kept tokens
  ``[s_old, n)`` from the paged cache, runs ``tritonkv.compress`` (per KV head, the same count for every head) and
  writes the kept keys and values, in their original order, into the trailing slots ``[s_new, n)``.

The CPU cache packs each (block, head)'s keys and values in an order that depends on the ISA; ``cache_layout``
finds it once by writing probe values through vLLM's own cache writer. With no ``"tritonkv"`` entry in
``additional_config`` every method is the stock one.
"""
from __future__ import annotations

import math

import torch
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from .common import (
    PagedLayout,
    TritonKVBackendMixin,
    TritonKVBuilderMixin,
    TritonKVImplMixin,
    check_engine,
    compact,
    current_config,
)
from .config import TritonKVConfigError

__all__ = ["TritonKVCPUBackend", "TritonKVCPUBuilder", "TritonKVCPUImpl", "cache_layout", "compact",
           "current_config", "check_engine"]


class TritonKVCPUBuilder(TritonKVBuilderMixin, CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if self.tkv is not None:  # an ISA whose layout the plugin cannot move is refused at start
            cache_layout(self.isa, self.dtype, self.num_kv_heads, self.block_size, self.head_dim)


class TritonKVCPUImpl(TritonKVImplMixin, CPUAttentionBackendImpl):
    def tkv_layout(self, layer, kv_cache: torch.Tensor) -> PagedLayout:
        _, h, bs, d2 = kv_cache.shape
        return cache_layout(layer.isa, kv_cache.dtype, h, bs, d2 // 2)


_LAYOUTS: dict = {}


def cache_layout(isa: str, dtype: torch.dtype, num_kv_heads: int, block_size: int, head_dim: int) -> PagedLayout:
    """Where vLLM's CPU cache writer puts each element of a block, for keys and for values: a packed
    ``PagedLayout`` whose int64 ``[H_kv, block * D]`` maps give, at ``h, i * D + d``, the offset of token ``i``'s
    dimension ``d`` inside head ``h``'s ``block * D`` elements (the ``vec`` ISA stores keys dimension-major, AMX
    packs pairs). Found once per (ISA, dtype, shape) by writing the elements' indices (in base-64 digits, exact in
    every float dtype) through ``cpu_attn_reshape_and_cache``; a layout that is not a permutation is refused."""
    key = (isa, dtype, num_kv_heads, block_size, head_dim)
    if key in _LAYOUTS:
        return _LAYOUTS[key]
    from vllm import _custom_ops as ops

    h, bs, d = num_kv_heads, block_size, head_dim
    n = bs * d
    ids = torch.arange(h * n).view(h, bs, d).permute(1, 0, 2)  # [token, head, dim]: the element's plain index
    found = [torch.zeros(h, n, dtype=torch.long), torch.zeros(h, n, dtype=torch.long)]
    digits = max(1, math.ceil(math.log(h * n, 64)))
    for p in range(digits):
        val = ((ids // 64 ** p) % 64).to(dtype)
        cache = torch.zeros(1, h, bs, 2 * d, dtype=dtype)
        kc, vc = PagedLayout(packed=True).split(cache)
        ops.cpu_attn_reshape_and_cache(val, val.clone(), kc, vc, torch.arange(bs, dtype=torch.long), isa)
        for i, c in enumerate((kc, vc)):
            found[i] += c[0].reshape(h, n).to(torch.long) * 64 ** p
    maps = []
    for f in found:  # f[h, offset] = plain index at that offset; invert it per head
        local = f - torch.arange(h).unsqueeze(1) * n
        if not all(torch.equal(local[j].sort().values, torch.arange(n)) for j in range(h)):
            raise TritonKVConfigError(f"tritonkv vLLM plugin: the CPU attention ISA {isa!r} stores {dtype} keys/values "
                                      f"in a layout that is not a permutation of each block; it is not supported")
        maps.append(torch.argsort(local, dim=1))
    _LAYOUTS[key] = PagedLayout(packed=True, key_order=maps[0], value_order=maps[1])
    return _LAYOUTS[key]


class TritonKVCPUBackend(TritonKVBackendMixin, CPUAttentionBackend):
    """vLLM's CPU attention with tritonkv's compression (registered over ``CPU_ATTN``: on the CPU vLLM always picks
    that backend)."""

    @staticmethod
    def get_impl_cls():
        return TritonKVCPUImpl

    @staticmethod
    def get_builder_cls():
        return TritonKVCPUBuilder
