"""tritonkv: KV-cache compression by token eviction, with Triton kernels.

    import tritonkv
    kept = tritonkv.compress((keys, values), "keydiff", 0.25)

Policies (``tritonkv.POLICIES``) score tokens with a Triton kernel; one shared exact top-k +
compaction kernel (``tritonkv.kernels.select``) turns scores into a compacted cache; allocators
(``tritonkv.allocation``) spread budgets over layers and heads; ``RaggedKV`` stores per-head
budgets without padding.
"""
from .api import Compressed, compress, resolve_budget
from .policies import POLICIES, Policy, get_policy, register_policy

__version__ = "0.1.0"


def __getattr__(name):  # lazy: the cache and allocation layers import more kernels
    if name == "RaggedKV":
        from .cache import RaggedKV

        return RaggedKV
    if name in ("ALLOCATORS", "get_allocator"):
        from . import allocation

        return getattr(allocation, name)
    raise AttributeError(f"module 'tritonkv' has no attribute {name!r}")


__all__ = ["compress", "Compressed", "resolve_budget", "POLICIES", "Policy", "get_policy", "register_policy",
           "RaggedKV", "ALLOCATORS", "get_allocator"]
