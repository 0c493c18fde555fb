"""The attention backend on a GPU with vLLM's ``FLASH_ATTN``: its builder, impl and backend, wrapped with the
plugin's mixins (``common.py``; the CPU wrapper, ``backend.py``, shares them). Registered over ``FLASH_ATTN``, so
vLLM picks it wherever it would pick the stock one (its default on most NVIDIA GPUs).

The cache is ``[blocks, H_kv, block, 2 D]`` (keys then values in the last dimension, ``FLASH_LAYOUT``). Imported
only when vLLM selects the backend; the FlashAttention kernels themselves need vLLM's CUDA build.
"""
from __future__ import annotations

from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)

from .common import TritonKVBackendMixin, TritonKVBuilderMixin, TritonKVImplMixin

__all__ = ["TritonKVFlashBackend", "TritonKVFlashBuilder", "TritonKVFlashImpl"]


class TritonKVFlashBuilder(TritonKVBuilderMixin, FlashAttentionMetadataBuilder):
    pass


class TritonKVFlashImpl(TritonKVImplMixin, FlashAttentionImpl):
    pass


class TritonKVFlashBackend(TritonKVBackendMixin, FlashAttentionBackend):
    """vLLM's FlashAttention with tritonkv's compression."""

    @staticmethod
    def get_impl_cls():
        return TritonKVFlashImpl

    @staticmethod
    def get_builder_cls():
        return TritonKVFlashBuilder
