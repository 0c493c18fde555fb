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

from .config import kept_start


@dataclasses.dataclass(frozen=True, kw_only=True)
class TritonKVSpec(FullAttentionSpec):
    """Full attention whose kept tokens of a request lie in ``[start(n), n)`` (``config.kept_start``).
    Prefix caching is off for its groups: a block's content changes when the layer compresses."""

    tkv_budget: Union[int, float] = 1
    tkv_granularity: int = 1
    #: tokens scheduled but not yet freed (vLLM's ``max_in_flight_tokens``), for the admission cap
    tkv_in_flight: int = 0

    @property
    def prefix_cacheable(self) -> bool:
        return False

    def kept_start(self, n: int) -> int:
        return kept_start(n, self.tkv_budget, self.tkv_granularity)

    @classmethod
    def merge(cls, specs):
        merged = super().merge(specs)  # FullAttentionSpec.merge rebuilds cls(...) without our fields
        keys = {(s.tkv_budget, s.tkv_granularity, s.tkv_in_flight) for s in specs}
        if len(keys) != 1:
            raise ValueError(f"layers of one KV cache group have different tritonkv schedules: {sorted(keys)}")
        budget, granularity, in_flight = keys.pop()
        return dataclasses.replace(merged, tkv_budget=budget, tkv_granularity=granularity, tkv_in_flight=in_flight)

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
