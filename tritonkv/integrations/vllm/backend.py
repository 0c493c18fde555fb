"""The attention backend: vLLM's CPU backend, wrapped.

* ``customize_spec`` gives each decoder layer a ``TritonKVSpec`` (the schedule travels to the scheduler with it);
* the metadata builder computes, per request row, ``s = start(seq_len - query_len)`` and hands the stock kernel the
  row's block table from block ``s / block_size`` on and the length ``seq_len - s`` (a *virtual* table: positions
  and the slot mapping stay logical, so the model runner is untouched); it lists the rows whose ``start`` advances
  in this step;
* after a layer's attention, ``forward`` compresses each listed row: it reads that layer's kept tokens
  ``[s_old, n)`` from the paged cache, runs ``tritonkv.compress`` (per KV head, the same count for every head) and
  writes the kept keys and values, in their original order, into the trailing slots ``[s_new, n)``.

With no ``"tritonkv"`` entry in ``additional_config`` every method is the stock one.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec

from .config import TritonKVConfig, TritonKVConfigError, kept_start, parse_config
from .spec import TritonKVSpec

# The settings and vLLM config this process last saw (the builder and impl run inside vLLM's config context; the
# spec hook may be called outside it).
_SEEN: list = [None, None]


def current_config(vllm_config=None) -> Optional[TritonKVConfig]:
    """The checked ``additional_config["tritonkv"]`` of ``vllm_config`` (or of vLLM's current config)."""
    vllm_config = vllm_config if vllm_config is not None else get_current_vllm_config_or_none()
    if vllm_config is None:
        return _SEEN[0]
    cfg = parse_config(vllm_config)
    _SEEN[:] = [cfg, vllm_config]
    return cfg


def check_engine(vllm_config) -> None:
    """What the plugin does not support, refused at start with ``TritonKVConfigError``."""
    where = "tritonkv vLLM plugin"
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is not None:
        raise TritonKVConfigError(f"{where}: speculative decoding is not supported (rejected drafts would cross a "
                                  f"compression)")
    cache = vllm_config.cache_config
    if str(getattr(cache, "cache_dtype", "auto")) != "auto":
        raise TritonKVConfigError(f"{where}: a quantized KV cache ({cache.cache_dtype}) is not supported; use "
                                  f"kv_cache_dtype='auto'")


@dataclasses.dataclass
class TritonKVCPUMetadata(CPUAttentionMetadata):
    """The stock metadata (over the virtual block table) plus this step's compressions: one
    ``(block ids of [s_old, n), s_old, n, s_new)`` per row whose ``start`` advances."""

    compactions: list = dataclasses.field(default_factory=list)


class TritonKVCPUBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.tkv = current_config(vllm_config)
        self.granularity = 0
        if self.tkv is not None and isinstance(kv_cache_spec, TritonKVSpec):
            check_engine(vllm_config)
            self.granularity = kv_cache_spec.tkv_granularity
            if self.granularity % self.block_size:
                raise TritonKVConfigError(f"decode_every {self.granularity} is not a multiple of the attention "
                                          f"kernel's block size {self.block_size}")
            cache_layout(self.isa, self.dtype, self.num_kv_heads, self.block_size, self.head_dim)
        elif self.tkv is not None:
            self.tkv = None  # a group the plugin does not compress (e.g. sliding window): stock

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        if self.tkv is None:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        cm = common_attn_metadata
        r = cm.num_reqs
        qsl = cm.query_start_loc_cpu[: r + 1]
        seq = cm.seq_lens[:r].cpu()
        n_new = seq.tolist()
        q_len = (qsl[1:] - qsl[:-1]).tolist()
        bs, g, budget = self.block_size, self.granularity, self.tkv.budget
        old = [kept_start(n - q, budget, g) if n > 0 else 0 for n, q in zip(n_new, q_len)]
        new = [kept_start(n, budget, g) if n > 0 else 0 for n in n_new]
        table = cm.block_table_tensor
        compactions = []
        for i, (s0, s1, n) in enumerate(zip(old, new, n_new)):
            if s1 > s0:
                compactions.append((table[i, s0 // bs: -(-n // bs)].to(torch.long).clone(), s0, n, s1))
        if any(old):
            shift = torch.tensor(old + [0] * (table.shape[0] - r), dtype=torch.long) // bs
            cols = torch.arange(table.shape[1]).unsqueeze(0) + shift.unsqueeze(1)
            virtual = torch.where(cols < table.shape[1], table.gather(1, cols.clamp(max=table.shape[1] - 1)),
                                  torch.zeros((), dtype=table.dtype))
            seq_v = cm.seq_lens.clone()
            seq_v[:r] -= torch.tensor(old, dtype=seq_v.dtype, device=seq_v.device)
            cm = cm.replace(block_table_tensor=virtual.to(table.device), seq_lens=seq_v,
                            max_seq_len=max([n - s for n, s in zip(n_new, old)], default=0))
        md = super().build(common_prefix_len, cm, fast_build)
        return TritonKVCPUMetadata(**{f.name: getattr(md, f.name) for f in dataclasses.fields(md)},
                                   compactions=compactions)


class TritonKVCPUImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cfg = current_config()
        self.tkv_policy = None
        if cfg is None:
            return
        self.tkv_policy = cfg.make_policy()
        if self.alibi_slopes is not None or self.sinks is not None or self.logits_soft_cap:
            raise TritonKVConfigError("tritonkv vLLM plugin: attention with ALiBi, learned sinks or a logits soft "
                                      "cap is not supported")

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                              output_block_scale)
        plan = getattr(attn_metadata, "compactions", None)
        if plan and self.tkv_policy is not None and kv_cache.numel():
            _, h, bs, d2 = kv_cache.shape
            compact(kv_cache, plan, self.tkv_policy, cache_layout(layer.isa, kv_cache.dtype, h, bs, d2 // 2))
        return out


def _split_cache(kv_cache: torch.Tensor):
    """The CPU cache ``[blocks, H_kv, block, 2 D]`` as (keys, values) views ``[blocks, H_kv, block, D]`` (each
    block and head holds ``block * D`` elements, in the order of the ISA's layout: ``cache_layout``)."""
    nb, h, bs, _ = kv_cache.shape
    kv = kv_cache.view(nb, h, 2 * bs, -1)
    return kv[:, :, :bs], kv[:, :, bs:]


def _gather(cache: torch.Tensor, blocks: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Tokens of ``blocks`` as ``[H, len(blocks) * block, D]`` (token-major), read through the layout ``order``."""
    m = blocks.numel()
    _, h, bs, d = cache.shape
    raw = cache[blocks].reshape(m, h, bs * d)
    return raw.gather(2, order.expand(m, h, bs * d)).view(m, h, bs, d).permute(1, 0, 2, 3).reshape(h, m * bs, d)


def _scatter(cache: torch.Tensor, blocks: torch.Tensor, order: torch.Tensor, tokens: torch.Tensor) -> None:
    """Write ``tokens`` ``[H, len(blocks) * block, D]`` into ``blocks`` in the layout ``order``."""
    m = blocks.numel()
    _, h, bs, d = cache.shape
    plain = tokens.reshape(h, m, bs * d).permute(1, 0, 2)
    raw = torch.empty_like(plain).scatter_(2, order.expand(m, h, bs * d), plain)
    cache[blocks] = raw.view(m, h, bs, d)


def compact(kv_cache: torch.Tensor, plan, policy, layout) -> None:
    """For each ``(blocks, s_old, n, s_new)``: score the layer's kept tokens ``[s_old, n)`` with ``policy``, keep
    ``n - s_new`` per KV head and write them, in original order, into slots ``[s_new, n)``."""
    from ...api import compress

    key_cache, value_cache = _split_cache(kv_cache)
    bs = key_cache.shape[2]
    korder, vorder = layout
    for blocks, s0, n, s1 in plan:
        keys = _gather(key_cache, blocks, korder)
        values = _gather(value_cache, blocks, vorder)
        kept = compress((keys[None, :, : n - s0], values[None, :, : n - s0]), policy, n - s1)
        lo = s1 - s0  # a block boundary: s0 and s1 are multiples of the block size
        keys[:, lo: n - s0] = kept.keys[0]
        values[:, lo: n - s0] = kept.values[0]
        tail = blocks[lo // bs:]
        _scatter(key_cache, tail, korder, keys[:, lo:])
        _scatter(value_cache, tail, vorder, values[:, lo:])


_LAYOUTS: dict = {}


def cache_layout(isa: str, dtype: torch.dtype, num_kv_heads: int, block_size: int, head_dim: int):
    """Where vLLM's CPU cache writer puts each element of a block, for keys and for values: int64 ``[H_kv,
    block * D]`` maps, entry ``h, i * D + d`` = offset of token ``i``'s dimension ``d`` inside head ``h``'s
    ``block * D`` elements (the ``vec`` ISA stores keys dimension-major, AMX packs pairs). Found once per
    (ISA, dtype, shape) by writing the elements' indices (in base-64 digits, exact in every float dtype) through
    ``cpu_attn_reshape_and_cache``; a layout that is not a permutation is refused."""
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
        kc, vc = _split_cache(cache)
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
    _LAYOUTS[key] = tuple(maps)
    return _LAYOUTS[key]


class TritonKVCPUBackend(CPUAttentionBackend):
    """vLLM's CPU attention with tritonkv's compression (registered over ``CPU_ATTN``: on the CPU vLLM always picks
    that backend)."""

    @staticmethod
    def get_impl_cls():
        return TritonKVCPUImpl

    @staticmethod
    def get_builder_cls():
        return TritonKVCPUBuilder

    @classmethod
    def customize_spec(cls, spec):
        spec = super().customize_spec(spec)
        cfg = current_config()
        if cfg is None or type(spec) is not FullAttentionSpec or spec.sliding_window is not None:
            return spec
        fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init}
        in_flight = getattr(_SEEN[1], "max_in_flight_tokens", 0) or 0
        return TritonKVSpec(**fields, tkv_budget=cfg.budget, tkv_granularity=cfg.granularity(spec.block_size),
                            tkv_in_flight=int(in_flight))
