"""The policy protocol and the registry.

A policy is a small dataclass: its settings, a ``needs`` declaration (the extra inputs it reads,
by name: ``queries``, ``attn_lse``, ``o_proj``), ``score()`` calling its Triton kernel, and
``protected()`` saying which tokens are always kept. Selection is never reimplemented: the
default ``select()`` calls the shared select + compact kernel; a selector that is not a plain
top-k (CriticalKV, SCORE) overrides ``select()`` as a score transform plus calls of that kernel.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ..kernels import select as _select

POLICIES: dict[str, type["Policy"]] = {}


def register_policy(cls):
    """Class decorator: make ``cls`` reachable by its ``name`` in ``compress()``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    POLICIES[cls.name] = cls
    return cls


def get_policy(policy) -> "Policy":
    """A policy object from a name or an object (objects pass through).

    An unknown name is a ValueError with the near match (``'SnapKV'`` → ``'snapkv'``) or, for an
    allocator's name (``'adakv'``), the note to pass it as ``allocation=``. ``'score'`` and
    ``'surfacelogic'`` name a policy *and* an allocator: here they are the policies (SCORE's
    redundancy-penalised selection; SurfaceLogicKV's window-attention scoring).
    """
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        try:
            return POLICIES[policy]()
        except KeyError:
            from .._names import unknown_name

            try:
                from ..allocation import ALLOCATORS
            except Exception:  # the message must not fail for an unrelated reason
                ALLOCATORS = {}
            raise ValueError(unknown_name("policy", policy, POLICIES, "allocation", ALLOCATORS)) from None
    if isinstance(policy, type) and issubclass(policy, Policy):
        return policy()
    raise TypeError(f"policy must be a name or a tritonkv.policies.Policy, got {type(policy).__name__}")


@dataclasses.dataclass(kw_only=True)
class Policy:
    """Base class. ``sink`` first tokens and ``window`` last tokens are always kept (inside the budget)."""

    name: ClassVar[str] = ""
    #: names of the extra inputs ``score()`` needs (checked by ``compress()`` before scoring)
    needs: ClassVar[tuple[str, ...]] = ()
    #: True when scores are attention-like (>= 0); CriticalKV accepts only such bases
    nonnegative: ClassVar[bool] = False
    #: False when ``score()`` never reads the values (a wrapper need not prepare them, e.g. mark empty slots)
    reads_values: ClassVar[bool] = True

    sink: int = 0
    window: int = 0

    def __post_init__(self):
        for f in ("sink", "window"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{f} must be a non-negative int, got {v!r}")

    # -- what is protected -------------------------------------------------------------------
    def protected(self, n: int, budget: int) -> tuple[int, int]:
        """``(sink, window)`` kept unconditionally in a row of ``n`` tokens at ``budget`` (static)."""
        sink = min(self.sink, n)
        return sink, min(self.window, n - sink)

    def unprotected(self, budget: int, lengths) -> str | None:
        """Why a budget does not hold the protected tokens (``protected``) of a row of some length in ``lengths``
        (the rows a caller's compressions will see), or None when it holds them in every one: the check behind a
        setting refused before anything runs (the vLLM plugin's, the demo's)."""
        for n in lengths:
            try:
                sink, window = self.protected(n, budget)
            except ValueError as e:  # a policy that refuses the budget itself (LagKV)
                return str(e)
            if sink + window > budget:
                return (f"budget {budget} is smaller than the protected tokens of {self.name!r} (sink {sink} + "
                        f"window {window})")
        return None

    # -- scoring -------------------------------------------------------------------------------
    def score(self, keys: torch.Tensor, values: torch.Tensor, **inputs) -> torch.Tensor:
        """fp32 scores ``[B, H_kv, N]``, higher means keep."""
        raise NotImplementedError

    def score_and_hist0(self, keys: torch.Tensor, values: torch.Tensor, *, sink: int, window: int, **inputs):
        """``(scores, hist0)`` for a select with this ``sink``/``window`` (``compress()``'s dense path):
        ``score()``'s scores, and the shared select's first radix pass over them where the scoring
        kernel counts it (a ``select.Hist0`` for ``select(..., hist0=)``), else None."""
        return self.score(keys, values, **inputs), None

    # -- selection -----------------------------------------------------------------------------
    def select(self, scores, budgets, keys, values, *, sink: int, window: int, k_max: int, out=None, forced=None,
               hist0=None, **inputs):
        """Kept K/V through the shared kernel. ``budgets`` int32 ``[B*H_kv]`` on the device; ``forced``
        (optional bool ``[B, H_kv, N]``) marks more tokens kept like protected ones (inside the budget);
        ``hist0`` the select's first pass from ``score_and_hist0`` (or None).

        Returns ``select.select_kv``'s tuple, or writes into ``out`` (a ``select.Out``) when given.
        """
        return _select.select_kv(scores, budgets, keys, values, k_max, sink=sink, window=window, forced=forced,
                                 out=out, hist0=hist0)

    def missing(self, inputs: dict) -> list[str]:
        return [n for n in self.needs if inputs.get(n) is None]
