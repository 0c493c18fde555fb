"""Eviction policies: one small class per policy, registered by name.

Every module of this package is imported here so its ``@register_policy`` classes are reachable
by name from ``tritonkv.compress``.
"""
import importlib
import pkgutil

from .base import POLICIES, Policy, get_policy, register_policy

for _m in pkgutil.iter_modules(__path__):
    if _m.name != "base":
        _mod = importlib.import_module(f"{__name__}.{_m.name}")
        for _cls in POLICIES.values():
            if _cls.__module__ == _mod.__name__:
                globals()[_cls.__name__] = _cls

__all__ = ["POLICIES", "Policy", "get_policy", "register_policy"] + [c.__name__ for c in POLICIES.values()]
