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
