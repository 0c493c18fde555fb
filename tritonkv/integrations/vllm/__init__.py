"""tritonkv inside vLLM: a general plugin (entry point ``vllm.general_plugins``, name ``tritonkv``).

vLLM calls ``register()`` in every process it starts (front end, engine core, workers), possibly more than once;
the second and later calls do nothing. ``register()`` only fills vLLM's registries:

* the KV-cache spec ``TritonKVSpec`` and its manager ``TritonKVManager`` (``KVCacheSpecRegistry``), which free the
  blocks of a running request that hold no kept token;
* the attention backends, each a subclass of vLLM's stock one registered over it: ``TritonKVCPUBackend`` over
  ``CPU_ATTN`` (vLLM's CPU platform always picks that one), ``TritonKVTritonBackend`` over ``TRITON_ATTN`` and
  ``TritonKVFlashBackend`` over ``FLASH_ATTN`` (GPUs). vLLM imports a backend's module only when it selects it, so
  the GPU ones are never imported by the CPU build;
* a torch module-registration hook (``common.on_module_registered``) that refuses, while the worker builds the
  model, a full-attention layer vLLM gave a backend the plugin does not wrap (it would run uncompressed).

It changes nothing until ``additional_config`` has a ``"tritonkv"`` entry (``config.py``). Usage and limits:
``docs/vllm.md``.
"""
from __future__ import annotations

import logging

from .config import CONFIG_KEY, TritonKVConfig, TritonKVConfigError, kept_start, parse_config

logger = logging.getLogger("vllm.tritonkv")  # under vLLM's logger: printed with its process prefix

#: vLLM releases the plugin is tested with (``>=`` the first, ``<`` the second)
VLLM_TESTED = ("0.32", "0.34")

#: vLLM's attention backends the plugin wraps: enum member -> the wrapper's path inside this package
BACKENDS = {"CPU_ATTN": "backend.TritonKVCPUBackend", "TRITON_ATTN": "triton_attn.TritonKVTritonBackend",
            "FLASH_ATTN": "flash_attn.TritonKVFlashBackend"}

_REGISTERED = [0]  # how many times register() did its work in this process (0 or 1)


def register() -> None:
    """Fill vLLM's registries once per process (the ``vllm.general_plugins`` entry point)."""
    if _REGISTERED[0]:
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from .spec import TritonKVManager, TritonKVSpec

    # the built-in specs first: the registry registers them only while it is empty
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(TritonKVSpec, TritonKVManager, uniform_type_base_spec=FullAttentionSpec)
    for member, path in BACKENDS.items():
        register_backend(getattr(AttentionBackendEnum, member), f"{__name__}.{path}")
    # vLLM calls nothing of the plugin's for a layer served by another backend: torch's module-registration hook
    # sees each attention layer as the worker builds the model, and refuses an unwrapped backend (common.check_layer)
    from torch.nn.modules.module import register_module_module_registration_hook

    from .common import on_module_registered

    register_module_module_registration_hook(on_module_registered)
    _REGISTERED[0] = 1
    import os

    logger.info("tritonkv vLLM plugin registered (pid %d)", os.getpid())


__all__ = ["register", "CONFIG_KEY", "TritonKVConfig", "TritonKVConfigError", "kept_start", "parse_config",
           "VLLM_TESTED", "BACKENDS"]
