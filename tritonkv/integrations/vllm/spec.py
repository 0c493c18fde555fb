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

    @property
    def prefix_cacheable(self) -> bool:
        return False

    def kept_start(self, n: int) -> int:
        return kept_start(n, self.tkv_budget, self.tkv_granularity)

    @classmethod
    def merge(cls, specs):
        merged = super().merge(specs)  # FullAttentionSpec.merge rebuilds cls(...) without our fields
        keys = {(s.tkv_budget, s.tkv_granularity) for s in specs}
        if len(keys) != 1:
            raise ValueError(f"layers of one KV cache group have different tritonkv schedules: {sorted(keys)}")
        budget, granularity = keys.pop()
        return dataclasses.replace(merged, tkv_budget=budget, tkv_granularity=granularity)

    def max_memory_usage_bytes(self, vllm_config) -> int:
        """A request never holds more than ``budget + G`` kept tokens plus one step's tokens (an int budget), so
        the pool only has to hold that many, not ``max_model_len``."""
        full = super().max_memory_usage_bytes(vllm_config)
        if not isinstance(self.tkv_budget, int):
            return full
        step = vllm_config.scheduler_config.max_num_batched_tokens
        blocks = cdiv(self.tkv_budget + self.tkv_granularity + step, self.block_size) + 1
        return min(full, blocks * self.page_size_bytes)


class TritonKVManager(FullAttentionManager):
    """Frees a running request's blocks below ``start(processed tokens)`` and puts vLLM's null block in their
    place (``SingleTypeKVCacheManager.remove_skipped_blocks``); later steps allocate only tail blocks."""

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return self.kv_cache_spec.kept_start(num_computed_tokens)
