"""The attention backend on a GPU with vLLM's ``TRITON_ATTN``: its builder, impl and backend, wrapped with the
plugin's mixins (``common.py``; the CPU wrapper, ``backend.py``, shares them). Registered over ``TRITON_ATTN``,
so vLLM picks it wherever it would pick the stock one (``--attention-backend TRITON_ATTN``, or its own choice).

The cache is ``[blocks, H_kv, block, 2 D]`` (keys then values in the last dimension, ``FLASH_LAYOUT``). Imported
only when vLLM selects the backend; the module imports on vLLM's CPU build too (the tests run it there with
Triton's interpreter).
"""
from __future__ import annotations

from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)

from .common import TritonKVBackendMixin, TritonKVBuilderMixin, TritonKVImplMixin

__all__ = ["TritonKVTritonBackend", "TritonKVTritonBuilder", "TritonKVTritonImpl"]


class TritonKVTritonBuilder(TritonKVBuilderMixin, TritonAttentionMetadataBuilder):
    pass


class TritonKVTritonImpl(TritonKVImplMixin, TritonAttentionImpl):
    pass


class TritonKVTritonBackend(TritonKVBackendMixin, TritonAttentionBackend):
    """vLLM's Triton attention with tritonkv's compression."""

    @staticmethod
    def get_impl_cls():
        return TritonKVTritonImpl

    @staticmethod
    def get_builder_cls():
        return TritonKVTritonBuilder
