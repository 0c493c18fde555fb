"""Eviction policies: one small class per policy, registered by name.

Each module below registers its policy class(es) with ``@register_policy`` when imported, which makes
them reachable by name from ``tritonkv.compress``. A new policy module is added to this list.
"""
from .base import POLICIES, Policy, get_policy, register_policy
from .criticalkv import CriticalKV
from .snapkv import SnapKV
from .h2o import H2O
from .keydiff import KeyDiff
from .knorm import Knorm
from .lagkv import LagKV
from .score import ScoreSelect
from .streaming_llm import StreamingLLM
from .surfacelogic import SurfaceLogicKV
from .tova import TOVA

__all__ = ["POLICIES", "Policy", "get_policy", "register_policy", "CriticalKV", "SnapKV", "H2O", "KeyDiff", "Knorm",
           "LagKV", "ScoreSelect", "StreamingLLM", "SurfaceLogicKV", "TOVA"]
