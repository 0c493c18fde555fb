"""The plugin's settings, read from vLLM's own configuration, and the schedule every process computes alike.

Settings live under the ``"tritonkv"`` key of vLLM's ``additional_config``
(``LLM(..., additional_config={"tritonkv": {...}})`` or ``vllm serve --additional-config '{"tritonkv": {...}}'``):

* ``policy`` (required): a policy name (``tritonkv.POLICIES``) that scores tokens from the cached keys and values
  alone: ``knorm``, ``keydiff``, ``streaming_llm``, ``lagkv``.
* ``budget`` (required): tokens kept per request, per layer and per KV head (an int >= 1), or the fraction of the
  request's tokens kept (a float in (0, 1]; never fewer than the policy's protected tokens, ``min_keep``).
* ``sink`` / ``window``: the policy's protected first and last tokens (inside the budget).
* ``policy_args``: more settings of the policy (``{"lag": 64}`` for ``lagkv``).
* ``decode_every``: tokens between two compressions once a request holds more than its budget (default: the KV
  block size; a multiple of it).

The schedule (``kept_start``): after a request's first ``n`` tokens are computed, its kept tokens lie in the
logical slots ``[start(n), n)`` of its own block table, with ``start(n) = align_down(max(0, n - budget(n)), G)``,
``G = decode_every`` and ``budget(n)`` the int budget or, for a fraction f, ``max(min_keep, floor(f·n))``. The
scheduler frees the blocks below ``start(n)``; every worker hands the attention kernel the blocks from ``start(n)``
on and compacts a layer's kept tokens into them. The rule is a function of ``n`` alone, so the processes agree
without exchanging a message.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Optional, Union

#: the key of vLLM's ``additional_config`` the plugin reads
CONFIG_KEY = "tritonkv"
_KEYS = ("policy", "budget", "sink", "window", "policy_args", "decode_every")


class TritonKVConfigError(ValueError):
    """A bad ``additional_config["tritonkv"]``; raised when the engine starts, before any request."""


@dataclasses.dataclass(frozen=True)
class TritonKVConfig:
    """Checked settings (see the module docstring). ``budget`` int: tokens per request, layer and KV head; float:
    the fraction kept. ``decode_every`` None: the KV block size."""

    policy: str
    budget: Union[int, float]
    sink: Optional[int] = None
    window: Optional[int] = None
    policy_args: tuple = ()  # sorted (name, value) pairs, hashable
    decode_every: Optional[int] = None
    #: a fraction keeps at least this many tokens: the fewest that hold the policy's protected ones (its sink and
    #: window, LagKV's sink and longest tail) in every region a compression sees (1 for an int budget)
    min_keep: int = 1

    def make_policy(self):
        """The ``tritonkv`` policy object these settings describe."""
        from ...policies import POLICIES

        kwargs = dict(self.policy_args)
        for name in ("sink", "window"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        return POLICIES[self.policy](**kwargs)

    def granularity(self, block_size: int) -> int:
        """``G``: the multiple of the block size that ``start(n)`` is aligned to."""
        g = self.decode_every or block_size
        if g % block_size:
            raise TritonKVConfigError(f"additional_config['tritonkv']['decode_every'] must be a multiple of the KV "
                                      f"cache block size {block_size} (whole blocks are freed), got {g}")
        return g


def kept_start(n: int, budget: Union[int, float], granularity: int, min_keep: int = 1) -> int:
    """``start(n)``: the first logical slot still held once ``n`` tokens are computed (0 while ``n`` fits the
    budget). A float budget keeps ``max(min_keep, 1, floor(budget * n))`` tokens (``floor`` as
    ``tritonkv.resolve_budget``); ``start`` never decreases as ``n`` grows."""
    keep = budget if isinstance(budget, int) else max(min_keep, 1, math.floor(budget * n + 1e-6))
    if n <= keep:
        return 0
    return (n - keep) // granularity * granularity


def parse_config(raw: Any) -> Optional[TritonKVConfig]:
    """``additional_config`` (a dict, or a vLLM ``VllmConfig``) to a checked ``TritonKVConfig``; None when it has no
    ``"tritonkv"`` key (the plugin then leaves vLLM as it is). Raises ``TritonKVConfigError`` naming the setting."""
    if hasattr(raw, "additional_config"):
        raw = raw.additional_config
    if not isinstance(raw, dict) or raw.get(CONFIG_KEY) is None:
        return None
    cfg = raw[CONFIG_KEY]
    where = f"additional_config[{CONFIG_KEY!r}]"
    if not isinstance(cfg, dict):
        raise TritonKVConfigError(f"{where} must be a dict of settings ({', '.join(_KEYS)}), got "
                                  f"{type(cfg).__name__}")
    unknown = [k for k in cfg if k not in _KEYS]
    if unknown:
        from ..._names import suggest

        hints = [f"{k!r}" + (f" (did you mean {s!r}?)" if (s := suggest(k, list(_KEYS))) else "") for k in unknown]
        raise TritonKVConfigError(f"{where} has unknown setting(s) {', '.join(hints)}; the settings are "
                                  f"{', '.join(_KEYS)}")
    for key in ("policy", "budget"):
        if key not in cfg:
            raise TritonKVConfigError(f"{where} needs {key!r}")
    policy = _check_policy(cfg["policy"], where)
    budget = _check_budget(cfg["budget"], where)
    for key in ("sink", "window", "decode_every"):
        v = cfg.get(key)
        low = 1 if key == "decode_every" else 0
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < low):
            raise TritonKVConfigError(f"{where}[{key!r}] must be an int >= {low}, got {v!r}")
    args = cfg.get("policy_args") or {}
    if not isinstance(args, dict):
        raise TritonKVConfigError(f"{where}['policy_args'] must be a dict of the policy's settings, got "
                                  f"{type(args).__name__}")
    out = TritonKVConfig(policy=policy, budget=budget, sink=_int(cfg.get("sink")), window=_int(cfg.get("window")),
                         policy_args=tuple(sorted(args.items())), decode_every=_int(cfg.get("decode_every")))
    try:
        pol = out.make_policy()
    except (TypeError, ValueError) as e:
        raise TritonKVConfigError(f"{where}: the policy {policy!r} refuses its settings: {e}") from None
    missing = [n for n in getattr(pol, "needs", ()) if n]
    if missing:
        raise TritonKVConfigError(
            f"{where}['policy'] = {policy!r} needs the input(s) {missing}, which the vLLM attention backend cannot "
            f"supply (it compresses from the cached keys and values alone); use one of {', '.join(kv_only_policies())}")
    if isinstance(budget, int):
        error = _unprotected(pol, budget)
        if error:
            raise TritonKVConfigError(f"{where}['budget'] = {budget}: {error}")
        return out
    return dataclasses.replace(out, min_keep=_min_keep(pol))


def _unprotected(pol, keep: int) -> Optional[str]:
    """``Policy.unprotected`` over every region a compression that keeps ``keep`` tokens can see: ``keep + 1``
    tokens up to a few lags more."""
    lag = getattr(pol, "lag", 0) if isinstance(getattr(pol, "lag", 0), int) else 0
    return pol.unprotected(keep, range(keep + 1, keep + 2 + max(256, 4 * lag)))


def _min_keep(pol) -> int:
    """The fewest tokens a fraction keeps: the smallest count that holds the protected tokens (for the policies the
    plugin runs, every larger count does too: sink + window, LagKV's sink + its longest tail)."""
    hi = 1
    while _unprotected(pol, hi):
        hi *= 2
    lo = hi // 2  # fails (or 0); hi holds
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _unprotected(pol, mid) is None else (mid, hi)
    return hi


def kv_only_policies() -> list[str]:
    """The registered policies that need no input beyond keys and values (those the plugin runs)."""
    from ...policies import POLICIES

    out = []
    for name, cls in POLICIES.items():
        try:
            needs = cls().needs
        except Exception:
            continue
        if not needs:
            out.append(name)
    return out


def _int(v):
    return None if v is None else int(v)


def _check_policy(policy, where: str) -> str:
    from ...policies import POLICIES

    if not isinstance(policy, str):
        raise TritonKVConfigError(f"{where}['policy'] must be a policy name (one of {', '.join(POLICIES)}), got "
                                  f"{type(policy).__name__}")
    if policy not in POLICIES:
        from ..._names import suggest

        s = suggest(policy, list(POLICIES))
        raise TritonKVConfigError(f"{where}['policy']: unknown policy {policy!r}"
                                  + (f" (did you mean {s!r}?)" if s else "")
                                  + f"; the policies are {', '.join(POLICIES)}")
    return policy


def _check_budget(budget, where: str) -> Union[int, float]:
    from ...api import resolve_budget

    try:
        resolve_budget(budget, 1)
    except (TypeError, ValueError) as e:
        raise TritonKVConfigError(f"{where}['budget']: {e}") from None
    return int(budget) if isinstance(budget, numbers.Integral) else float(budget)
