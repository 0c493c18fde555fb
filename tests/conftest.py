"""Test configuration.

TRITON_INTERPRET must be set before any module defining ``@triton.jit`` kernels is imported
(kernels.md rule 3), so it is decided here, at conftest import time: without a CUDA device the
kernels run on CPU tensors under the interpreter.
"""
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))  # `import reference.x`, `import aot`

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
               derandomize=True, print_blob=True)
settings.register_profile("ci", max_examples=25, **_common)
settings.register_profile("dev", max_examples=10, **_common)
settings.register_profile("deep", max_examples=2000, **{**_common, "derandomize": False})
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device():
    return DEVICE
