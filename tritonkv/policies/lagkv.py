"""LagKV (LagKV §2.2, Eqs. 5–10; ``docs/algorithms.md`` §1.5).

Each partition of L tokens after the S sinks is scored against the raw next partition
(``kernels/lagkv.py``); the last full partition plus the remainder (the *tail*) has no reference
and is always kept, like the sinks.

* **Budget mode** (``compress(kv, "lagkv", budget)``): scores are within-partition ranks ρ/L, so
  the top b of them (ties to the lower index) are ⌊b/(P−1)⌋ tokens of each scored partition plus
  one more in each of the earliest b mod (P−1) (b = budget − S − |tail|). ``compress`` takes that
  closed form (``LagKV.compress_dense``: one kernel launch that scores, ranks and writes the kept
  tokens); the scores + shared select path gives the same tokens and serves what the closed form
  does not: ``cross_scoring=True`` (raw scores φ_K + φ_V, comparable across partitions and heads,
  for allocators), allocations and ``forced`` tokens. Rows shorter than S + 2L behave as
  StreamingLLM.
* **Paper mode** (``LagKV(ratio=r).paper(keys, values)``): sinks + the top m = ⌊r·L⌋ of every
  scored partition + the tail (Eq. 10), the same kernel; rows shorter than S + 2L are kept whole.
* **Recursive form** (``LagKVState``): tokens are appended in any chunks and partitions are
  compressed as soon as their successor is complete; the result equals paper mode on the whole row.
"""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch

from ..kernels._common import check_kv_tensor
from ..kernels.lagkv import lagkv_compress, lagkv_scores, num_partitions
from .base import Policy, register_policy


@register_policy
@dataclasses.dataclass(kw_only=True)
class LagKV(Policy):
    """LagKV: sink S, lag L, keep ratio r (paper mode), raw cross-partition scores with ``cross_scoring``.

    Non-finite keys/values: a token whose key or value holds a NaN or ±inf scores NaN and ranks
    lowest *within its partition* (the lower index first among such tokens), and it is left out of
    every statistic over tokens (the min/max reference of the previous partition, the softmax of its
    own), so the other tokens score as if it were absent. Budget mode still takes every scored
    partition's quota; sinks and tail are kept whatever they hold.
    """

    name: ClassVar[str] = "lagkv"

    sink: int = 16
    lag: int = 128
    ratio: float = 0.5
    cross_scoring: bool = False
    eps: float = 1e-6

    def __post_init__(self):
        super().__post_init__()
        if self.window != 0:
            raise ValueError(f"window must be 0: LagKV always keeps its tail (last partition + remainder), "
                             f"got {self.window!r}")
        if isinstance(self.lag, bool) or not isinstance(self.lag, int) or self.lag < 1:
            raise ValueError(f"lag must be a positive int, got {self.lag!r}")
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0 < self.ratio <= 1:
            raise ValueError(f"ratio must be a float in (0, 1] (fraction kept per partition), got {self.ratio!r}")
        if not isinstance(self.eps, (int, float)) or not self.eps > 0:
            raise ValueError(f"eps must be a positive float, got {self.eps!r}")

    @property
    def keep(self) -> int:
        """m = ⌊r·L⌋, tokens kept per scored partition in paper mode."""
        return math.floor(self.ratio * self.lag + 1e-6)

    def tail(self, n: int) -> int:
        """|tail| = L + (n − S) mod L of a row of n tokens (0 when nothing can be scored)."""
        p = num_partitions(n, self.sink, self.lag)
        return n - self.sink - (p - 1) * self.lag if p else 0

    def kept_count(self, n: int) -> int:
        """Tokens paper mode keeps of a row of n (Eq. 10; n when n < S + 2L)."""
        p = num_partitions(n, self.sink, self.lag)
        return self.sink + self.keep * (p - 1) + self.tail(n) if p else n

    def protected(self, n: int, budget: int) -> tuple[int, int]:
        """Sinks and tail; for n < S + 2L the StreamingLLM split (S, budget − S)."""
        sink = min(self.sink, n)
        window = self.tail(n) if num_partitions(n, self.sink, self.lag) else max(min(budget, n) - sink, 0)
        if budget < sink + window:
            raise ValueError(f"budget {budget} is below LagKV's protected tokens: sink {sink} + tail {window} "
                             f"(last partition of lag {self.lag} + remainder) of a row of {n}")
        return sink, window

    def score(self, keys: torch.Tensor, values: torch.Tensor, **inputs) -> torch.Tensor:
        """Within-partition ranks ρ/L (raw φ_K + φ_V with ``cross_scoring``); +inf on sinks and tail."""
        return lagkv_scores(keys, values, sink=self.sink, lag=self.lag, eps=self.eps, rank=not self.cross_scoring)

    def compress_dense(self, keys: torch.Tensor, values: torch.Tensor, k: int, *, sink: int, window: int,
                       **inputs):
        """Budget mode's closed form, called by ``compress`` (one budget for every head, k < N):
        ``(keys, values, indices)`` from one kernel launch, the tokens the scores + shared select path
        keeps. None where the closed form does not apply (``cross_scoring``, ``forced`` tokens), and
        ``compress`` then takes that path."""
        if self.cross_scoring or inputs.get("forced") is not None:
            return None
        p = num_partitions(keys.shape[2], self.sink, self.lag)
        quota, rem = divmod(k - sink - window, p - 1) if p else (0, 0)
        return lagkv_compress(keys, values, k, sink=sink, lag=self.lag, quota=quota, rem=rem, window=window,
                              eps=self.eps)

    def paper(self, keys: torch.Tensor, values: torch.Tensor):
        """Paper mode (Eq. 10): ``(keys, values, indices)`` with ``kept_count(N)`` tokens per row — the
        sinks, the top m of each scored partition (the tokens of rank ≥ L − m) and the tail, from one
        kernel launch. Rows with N < S + 2L come back unchanged."""
        check_kv_tensor("keys", keys)
        B, H, N, _ = keys.shape
        k = self.kept_count(N)
        if k >= N:
            return keys, values, torch.arange(N, device=keys.device).expand(B, H, N)
        return lagkv_compress(keys, values, k, sink=self.sink, lag=self.lag, quota=self.keep, window=self.tail(N),
                              eps=self.eps)

    def new_state(self) -> "LagKVState":
        """An empty recursive-form state with this policy's settings."""
        return LagKVState(sink=self.sink, lag=self.lag, ratio=self.ratio, eps=self.eps)


class LagKVState:
    """LagKV's recursive form (Fig. 1), for chunked prefill and decoding.

    Per row it holds the compressed part C (sinks and kept tokens, ascending positions) and a raw
    tail U that starts on a partition boundary. ``append`` adds any number of tokens; whenever U
    holds q ≥ 2 full partitions, the first q − 1 are scored against their raw successors and their
    top m move to C (one kernel launch, the kernel of one-shot compression), and they leave U, so
    |U| < 2L afterwards. Every row keeps exactly m per partition, so C stays dense and
    the result after any chunking equals ``LagKV(...).paper`` on all tokens seen.
    """

    TENSORS = ("c_keys", "c_values", "c_indices", "u_keys", "u_values")  # what it holds, batch rows first

    def __init__(self, sink: int = 16, lag: int = 128, ratio: float = 0.5, eps: float = 1e-6):
        pol = LagKV(sink=sink, lag=lag, ratio=ratio, eps=eps)  # validates the settings
        self.sink, self.lag, self.eps, self.m = pol.sink, pol.lag, pol.eps, pol.keep
        self.seen = 0  # tokens appended so far (positions count tokens seen)
        self.c_keys = self.c_values = self.c_indices = None  # compressed part C
        self.u_keys = self.u_values = None  # raw tail U, positions [u_start, seen)
        self.u_start = self.sink

    def __len__(self) -> int:
        """Tokens stored per row (|C| + |U|)."""
        return sum(t.shape[2] for t in (self.c_keys, self.u_keys) if t is not None)

    def _check(self, keys, values):
        check_kv_tensor("keys", keys)
        check_kv_tensor("values", values)
        if values.shape != keys.shape or values.dtype != keys.dtype:
            raise ValueError(f"values must match keys {tuple(keys.shape)} {keys.dtype}, "
                             f"got {tuple(values.shape)} {values.dtype}")
        ref = self.c_keys if self.c_keys is not None else self.u_keys
        if ref is not None and (keys.shape[:2] != ref.shape[:2] or keys.shape[3] != ref.shape[3]
                                or keys.dtype != ref.dtype or keys.device != ref.device):
            raise ValueError(f"keys must be [B, H, t, D] = [{ref.shape[0]}, {ref.shape[1]}, t, {ref.shape[3]}] "
                             f"({ref.dtype}, {ref.device}) like the tokens already appended, got "
                             f"{tuple(keys.shape)} ({keys.dtype}, {keys.device})")

    @staticmethod
    def _cat(a, b):
        """``a`` then ``b`` along the tokens; always a new tensor (a view of ``b`` would keep its whole storage —
        e.g. the prompt's keys — alive)."""
        return b.clone() if a is None else torch.cat([a, b], dim=2)

    def _to_c(self, keys, values, indices):
        self.c_keys = self._cat(self.c_keys, keys)
        self.c_values = self._cat(self.c_values, values)
        self.c_indices = self._cat(self.c_indices, indices)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> "LagKVState":
        """Append ``[B, H, t, D]`` new keys/values (any t ≥ 0) and compress what can be compressed."""
        self._check(keys, values)
        B, H, t, _ = keys.shape
        dev = keys.device
        n_sink = min(max(self.sink - self.seen, 0), t)
        if n_sink:
            pos = torch.arange(self.seen, self.seen + n_sink, device=dev).expand(B, H, n_sink)
            self._to_c(keys[:, :, :n_sink], values[:, :, :n_sink], pos)
        self.u_keys = self._cat(self.u_keys, keys[:, :, n_sink:])
        self.u_values = self._cat(self.u_values, values[:, :, n_sink:])
        self.seen += t
        L = self.lag
        q = self.u_keys.shape[2] // L
        if q >= 2:
            n = (q - 1) * L  # partitions 0 … q−2 of U have their raw successor
            if self.m > 0:
                ko, vo, idx = lagkv_compress(self.u_keys, self.u_values, self.m * (q - 1), sink=0, lag=L,
                                             quota=self.m, window=0, eps=self.eps)
                self._to_c(ko, vo, idx + self.u_start)
            self.u_keys = self.u_keys[:, :, n:].clone()  # a copy, not a view of the compressed partitions
            self.u_values = self.u_values[:, :, n:].clone()
            self.u_start += n
        return self

    def _parts(self, c, u):
        if c is None and u is None:
            raise ValueError("LagKVState: nothing appended yet")
        return [t for t in (c, u) if t is not None]

    @property
    def keys(self) -> torch.Tensor:
        """Stored keys ``[B, H, |C| + |U|, D]`` in ascending original order."""
        return torch.cat(self._parts(self.c_keys, self.u_keys), dim=2)

    @property
    def values(self) -> torch.Tensor:
        return torch.cat(self._parts(self.c_values, self.u_values), dim=2)

    @property
    def indices(self) -> torch.Tensor:
        """int64 ``[B, H, |C| + |U|]`` original positions of the stored tokens."""
        u = None
        if self.u_keys is not None:
            B, H, nu, _ = self.u_keys.shape
            u = torch.arange(self.u_start, self.u_start + nu, device=self.u_keys.device).expand(B, H, nu)
        return torch.cat(self._parts(self.c_indices, u), dim=2)

    @property
    def tail_len(self) -> int:
        """|U|, the raw tokens not yet compressed (always < 2L after ``append``)."""
        return 0 if self.u_keys is None else self.u_keys.shape[2]
