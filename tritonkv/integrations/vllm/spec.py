"""Block accounting: a KV-cache spec that carries the schedule, and the scheduler-side manager that frees the blocks
below ``start(n)`` of a running request (vLLM's null-block path, as its sliding-window manager does).

Both are registered through vLLM's ``KVCacheSpecRegistry``; the attention backend (``backend.py``) hands the spec
out from ``customize_spec``, so the scheduler receives the budget and granularity with the layers' specs and needs
no configuration of its own.
"""
from __future__ import annotations

import dataclasses
from typing import Union

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec

from .config import TritonKVConfigError, kept_start

#: why a full-attention layer the plugin compresses can end in a plain KV-cache group (``TritonKVSpec.merge`` and the
#: builder's ``common.check_group`` refuse it at start)
MIXED_GROUP = ("share a KV-cache group with layers of another kind, so they would run uncompressed: vLLM's hybrid "
               "KV-cache manager is off (disable_hybrid_kv_cache_manager, or turned off by vLLM for this model or KV "
               "connector), and the plugin needs it for a model that mixes full and sliding-window layers")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TritonKVSpec(FullAttentionSpec):
    """Full attention whose kept tokens of a request lie in ``[start(n), n)`` (``config.kept_start``).
    Its groups take part in prefix-cache lookups and always miss (``TritonKVManager``): a block's content changes
    when the layer compresses, and a hybrid model's other groups must not serve a hit without this one."""

    tkv_budget: Union[int, float] = 1
    tkv_granularity: int = 1
    tkv_min_keep: int = 1  # the fewest tokens a fractional budget keeps (``TritonKVConfig.min_keep``)
    #: tokens scheduled but not yet freed (vLLM's ``max_in_flight_tokens``), for the admission cap
    tkv_in_flight: int = 0

    def kept_start(self, n: int) -> int:
        return kept_start(n, self.tkv_budget, self.tkv_granularity, self.tkv_min_keep)

    @classmethod
    def merge(cls, specs):
        if not all(isinstance(s, TritonKVSpec) for s in specs):
            raise TritonKVConfigError(f"tritonkv vLLM plugin: the full-attention layers {MIXED_GROUP}")
        merged = super().merge(specs)  # FullAttentionSpec.merge rebuilds cls(...) without our fields
        keys = {(s.tkv_budget, s.tkv_granularity, s.tkv_min_keep, s.tkv_in_flight) for s in specs}
        if len(keys) != 1:
            raise ValueError(f"layers of one KV cache group have different tritonkv schedules: {sorted(keys)}")
        budget, granularity, min_keep, in_flight = keys.pop()
        return dataclasses.replace(merged, tkv_budget=budget, tkv_granularity=granularity, tkv_min_keep=min_keep,
                                   tkv_in_flight=in_flight)

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int):
        """Blocks a running request holds at most with an int budget: its kept tokens (fewer than ``budget + G``)
        plus the tokens in flight, +1 for a kept region that starts inside a block; None (no cap) for a fraction."""
        if not isinstance(self.tkv_budget, int):
            return None
        kept = cdiv(self.tkv_budget + self.tkv_granularity + max_in_flight_tokens, self.block_size) + 1
        return min(kept, cdiv(max_model_len, self.block_size))

    def max_memory_usage_bytes(self, vllm_config) -> int:
        """With an int budget the pool only has to hold one request's kept tokens, not ``max_model_len``."""
        cap = self.max_admission_blocks_per_request(vllm_config.max_in_flight_tokens,
                                                    vllm_config.model_config.max_model_len)
        full = super().max_memory_usage_bytes(vllm_config)
        return full if cap is None else min(full, cap * self.page_size_bytes)


class TritonKVManager(FullAttentionManager):
    """Frees a running request's blocks below ``start(processed tokens)`` and puts vLLM's null block in their
    place (``SingleTypeKVCacheManager.remove_skipped_blocks``); later steps allocate only tail blocks.

    With an int budget it also caps what vLLM reserves to admit a request (as for sliding windows): a long prompt
    is admitted when its kept tokens fit, not its whole length."""

    def __init__(self, kv_cache_spec, *args, **kwargs):
        super().__init__(kv_cache_spec, *args, **kwargs)
        if self.max_admission_blocks_per_request is None and kv_cache_spec.tkv_in_flight:
            self.max_admission_blocks_per_request = kv_cache_spec.max_admission_blocks_per_request(
                kv_cache_spec.tkv_in_flight, 1 << 62)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return self.kv_cache_spec.kept_start(num_computed_tokens)

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, *args, **kwargs):
        """No hit, ever: a compressed layer's blocks are not the prompt prefix they were written for. The group
        stays in the lookup (a spec that is not ``prefix_cacheable`` would be skipped there), so that in a hybrid
        model (sliding-window layers beside these) the combined hit is 0 too and every layer recomputes the prompt,
        instead of the other groups' hit leaving this group's blocks for those tokens unwritten."""
        return tuple([] for _ in kv_cache_group_ids), 0

    def cache_blocks(self, *args, **kwargs) -> None:
        """Nothing is registered for reuse (see ``find_longest_cache_hit``)."""
