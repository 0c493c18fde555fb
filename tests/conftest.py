"""Test configuration.

TRITON_INTERPRET must be set before any module defining ``@triton.jit`` kernels is imported
(docs/contracts.md, "Devices"), so it is decided here, at conftest import time: without a CUDA device the
kernel tests run the Triton kernels on CPU tensors under the interpreter, while the model-level
tests (``NATIVE_MODULES``) run every op's native PyTorch body on the CPU, as users do.
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
# deep: thousands of random examples (HYPOTHESIS_MAX_EXAMPLES overrides the count, e.g. to fit a time budget)
settings.register_profile("deep", max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "2000")),
                          **{**_common, "derandomize": False})
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pytest_collection_modifyitems(items):
    """Deep profile only: a test that caps its examples for the CI time budget (``@settings(
    max_examples=n)``, n below the profile's count) gets the deep count scaled by n / 25, its share
    of the "ci" profile's 25 examples, so every property test runs deeper, not only the uncapped ones."""
    deep = settings.get_profile("deep").max_examples
    if settings.default.max_examples != deep or os.environ.get("HYPOTHESIS_PROFILE") != "deep":
        return
    done = set()
    for item in items:
        fn = getattr(item, "obj", None)
        s = getattr(fn, "_hypothesis_internal_use_settings", None)
        if s is None or id(fn) in done or s.max_examples >= deep:
            continue
        done.add(id(fn))
        fn._hypothesis_internal_use_settings = settings(s, max_examples=max(s.max_examples,
                                                                            round(deep * s.max_examples / 25)))


NATIVE_MODULES = ("test_transformers", "test_needle", "test_profiler")


@pytest.fixture(autouse=True)
def _native_cpu_path(request):
    """Model-level tests on the CPU use the ops' PyTorch bodies (the interpreter is for kernel tests)."""
    if DEVICE == "cpu" and request.module.__name__.startswith(NATIVE_MODULES):
        from tritonkv.kernels._common import cpu_kernels

        with cpu_kernels("torch"):
            yield
    else:
        yield


@pytest.fixture
def device():
    return DEVICE
