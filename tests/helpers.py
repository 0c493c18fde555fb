"""Helpers shared by the tests (importable because conftest puts tests/ on sys.path)."""
import dataclasses
from typing import ClassVar, Optional

import pytest
import torch

from tritonkv.policies import Policy


def assert_raises_naming(call, exc, words, what="") -> None:
    """``call()`` raises exactly ``exc`` (not a subclass) and its message contains every one of ``words``."""
    with pytest.raises(exc) as e:
        call()
    assert type(e.value) is exc, (what, type(e.value))
    for w in words:
        assert w in str(e.value), (what, str(e.value))


@dataclasses.dataclass
class GivenScores(Policy):
    """Test-only base policy (not registered): returns the non-negative scores it holds."""

    name: ClassVar[str] = "test_given_scores"
    nonnegative: ClassVar[bool] = True
    scores: Optional[torch.Tensor] = None

    def score(self, keys, values, **inputs):
        return self.scores


@dataclasses.dataclass
class SignedScores(GivenScores):
    """``GivenScores`` whose scores may be negative."""

    nonnegative: ClassVar[bool] = False


# CPU op bodies (issue 13): the Triton kernels under the interpreter, or the vectorised PyTorch bodies
BACKENDS = ("triton", "torch")
both_backends = pytest.mark.parametrize("backend", BACKENDS)


def on_backend(backend: str):
    """Context in which CPU tensors run ``backend``'s op bodies (``tritonkv.kernels._common.cpu_kernels``);
    skips ``"triton"`` in a process without the interpreter (CPU tensors cannot run compiled kernels)."""
    from tritonkv.kernels._common import INTERPRET, cpu_kernels

    if backend == "triton" and not INTERPRET:
        pytest.skip("the Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
    return cpu_kernels(backend)


def assert_same_scores(got, want, rtol: float, atol: float = 0.0) -> None:
    """NaN, +inf and −inf at the same places, finite scores within ``rtol``/``atol`` (two backends)."""
    for f in (torch.isnan, lambda t: t == float("inf"), lambda t: t == float("-inf")):
        assert torch.equal(f(got), f(want))
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], rtol=rtol, atol=atol)
