"""Error messages of ``compress()``: what an unknown keyword probably meant, and what a shape mistake looks like.

Nothing here runs on the success path of a call: ``tritonkv.api`` checks cheaply and calls in here to explain a
failure (and, once per combination of policy type, allocator type and input names, to list the accepted
inputs). Messages name the argument, what was expected, and a remedy only where it is right.
"""
from __future__ import annotations

import dataclasses
import importlib
import numbers

from ._names import suggest
from .api import INPUTS, PARAMS
from .policies import POLICIES


def _names(x) -> tuple[str, ...]:
    """``needs``/``accepts`` of a policy or allocator (object or class; a class's property reads as none)."""
    out = ()
    for attr in ("needs", "accepts"):
        v = getattr(x, attr, ())
        if isinstance(v, (tuple, list, set, frozenset)):
            out += tuple(n for n in v if isinstance(n, str))
    return out


def accepted_inputs(policy=None, allocation=None) -> set[str]:
    """The input names ``compress()`` accepts with these policy and allocator objects (or classes: then the names
    that every object of the class accepts): ``INPUTS`` and every registered policy's and allocator's
    ``needs``/``accepts``."""
    from .allocation import ALLOCATORS

    known = set(INPUTS)
    for x in (*POLICIES.values(), *ALLOCATORS.values(), policy, allocation):
        if x is not None:
            known.update(_names(x))
    return known


def unknown_inputs(inputs: dict, pol, alloc, known, caller: str = "compress()") -> TypeError:
    """The TypeError for the keywords of ``inputs`` not in ``known``: each one with the near match or, for a
    policy/allocator setting or kvpress's ``compression_ratio``, what to do instead; ``caller``: the call named."""
    bad = [n for n in inputs if n not in known]
    why = [_unknown_input(n, inputs[n], pol, alloc, known) for n in bad]
    what = "an unexpected keyword argument" if len(bad) == 1 else "unexpected keyword arguments"
    return TypeError(f"{caller} got {what} " + "; ".join(why)
                     + (f". The inputs compress() accepts: {', '.join(sorted(known))}" if known else ""))


def missing_budget(inputs: dict) -> TypeError:
    """``compress(kv, policy)`` without a budget (kvpress's ``compression_ratio=`` gets its explanation)."""
    if "compression_ratio" in inputs:
        return TypeError("compress() missing the budget: got " + _unknown_input(
            "compression_ratio", inputs["compression_ratio"], None, None, ()))
    return TypeError("compress() missing the budget: tokens kept per (batch row, KV head) as an int, or the fraction "
                     "kept as a float in (0, 1] (compress(kv, policy, budget))")


def queries_layout(keys_shape, q_shape, lse_shape, wo_shape, window) -> str:
    """Why ``queries`` of ``q_shape`` (with W_O of ``wo_shape`` and ``attn_lse`` of ``lse_shape``, None when not
    given, and the ``window`` of queries the policy reads, None when unknown) do not fit keys ``[B, H_kv, N, D]``,
    and, where the evidence shows it, that they are in the token-major layout ``[B, W, H_q, D]``."""
    B, H, N, D = keys_shape
    a, b = q_shape[1], q_shape[2]
    want = (f"queries must be [B={B}, H_q, W, D={D}] with H_q a multiple of the keys' H_kv = {H} (grouped-query "
            f"attention), got {tuple(q_shape)}")
    layouts = ("compress() expects keys/values [B, H_kv, N, D] and queries [B, H_q, W, D] (transformers' layouts "
               "after .transpose(1, 2))")
    transpose = "; pass queries.transpose(1, 2)"
    if q_shape[0] != B or q_shape[3] != D:
        return f"{want}. {layouts}"
    # which reading the other inputs support: heads in the second dimension (plain) or in the third (swapped)
    wo_plain = wo_shape is not None and wo_shape[1] == a * D
    wo_swap = wo_shape is not None and wo_shape[1] == b * D and not wo_plain
    lse = None if lse_shape is None or len(lse_shape) != 3 else tuple(lse_shape[1:])
    lse_swap = lse == (b, a) and a != b
    if a == 0 or a % H:
        msg = f"{want}: H_q = {a} is not a multiple of {H}. {layouts}"
        swap_fits = b > 0 and b % H == 0 and not wo_plain and not (lse == (a, b) and a != b)
        if window is not None and b == window != a:  # the plain reading has the policy's W queries
            swap_fits = wo_swap or lse_swap
        if swap_fits:
            evidence = _evidence(a, b, D, wo_swap, lse_swap, False, window)
            return (f"{msg}; queries look like [B, W, H_q, D] (W = {a} tokens of H_q = {b} heads{evidence})"
                    + transpose)
        if H > N:
            return f"{msg}; the keys look like [B, N, H_kv, D] (see the warning): pass keys.transpose(1, 2)"
        if window is not None and b == window:
            return (f"{want}: H_q = {a} is not a multiple of {H} (the layout fits: W = {b} queries, the policy's "
                    f"window; the head count does not). {layouts}")
        return msg
    if wo_shape is not None and not (wo_plain or wo_swap):
        return (f"o_proj must be W_O [D_model, H_q * D] with H_q * D = {a * D} columns (H_q = {a} from queries "
                f"{tuple(q_shape)}), got {tuple(wo_shape)}")
    evidence = _evidence(a, b, D, wo_swap, lse_swap, not (wo_swap or lse_swap), window)
    msg = (f"queries {tuple(q_shape)} read as [B, H_q = {a}, W = {b}, D] disagree with {evidence[2:]}: queries look "
           f"like [B, W, H_q, D] (W = {a} tokens of H_q = {b} heads), expected [B={B}, H_q={b}, W={a}, D={D}]"
           + transpose)
    if not (wo_swap or lse_swap):
        msg += (f" (if they are {a} heads of {b} queries, pass the last {window} the policy reads: "
                f"queries[:, :, -{window}:])")
    return msg


def _evidence(a, b, D, wo_swap, lse_swap, by_window, window) -> str:
    """``", <what shows the heads are in the third dimension>"`` or ``""``."""
    out = []
    if wo_swap:
        out.append(f"o_proj's {b * D} columns fit H_q = {b} heads, the queries' third dimension")
    if lse_swap:
        out.append(f"attn_lse is [B, {b}, {a}] = [B, H_q, W]")
    if by_window:
        out.append(f"the policy's window of W = {window} queries")
    return "".join(", " + e for e in out)


def _short(v) -> str:
    """``v`` for a message: numbers and strings as written, anything else as ``...``."""
    return repr(v) if v is None or isinstance(v, (str, numbers.Number)) else "..."


def _ctor(cls, package: str) -> str:
    """How a user writes ``cls``: ``tritonkv.policies.SnapKV`` when exported there, else its name."""
    try:
        if getattr(importlib.import_module(package), cls.__name__, None) is cls:
            return f"{package}.{cls.__name__}"
    except Exception:
        pass
    return cls.__qualname__


def _settings(cls) -> list[str]:
    """The settings a user passes to the class (its init fields)."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        return []
    return [f.name for f in dataclasses.fields(cls) if f.init]


def ratio_hint(ratio, call: str) -> str:
    """What kvpress's ``compression_ratio`` is to a tritonkv budget, with ``call`` (a format string taking the
    budget, e.g. ``"compress(kv, policy, {})"``) at this ratio's budget when it is a ratio in [0, 1)."""
    here = ""
    if isinstance(ratio, numbers.Real) and not isinstance(ratio, bool) and 0 <= float(ratio) < 1:
        b = f"{1 - float(ratio):.6g}"
        here = f" (here {b}: {call.format(b)})"
    return (f"kvpress's compression_ratio is the fraction removed; tritonkv's budget is the fraction kept: "
            f"budget = 1 - compression_ratio{here}")


def _unknown_input(name: str, value, pol, alloc, known) -> str:
    """Why ``compress(..., name=value)`` is not accepted, and what was probably meant."""
    from .allocation import ALLOCATORS

    v = _short(value)
    if name == "compression_ratio":
        return f"'compression_ratio' ({ratio_hint(value, 'compress(kv, policy, {})')})"
    pcls = type(pol) if pol is not None else None
    if pcls is not None and name in _settings(pcls):
        return (f"{name!r} ({name}={v} is a setting of the policy {pol.name!r}, not an input of compress(): pass "
                f"{_ctor(pcls, 'tritonkv.policies')}({name}={v}) as the policy)")
    base = getattr(pol, "base", None)
    if dataclasses.is_dataclass(pol) and name in (f.name for f in dataclasses.fields(pol)):
        if base is not None and name in _settings(type(base)):  # CriticalKV/SCORE mirror their base's sink/window
            return (f"{name!r} ({name}={v} is a setting of the base policy of {pol.name!r}, not an input of "
                    f"compress(): pass {_ctor(pcls, 'tritonkv.policies')}(base="
                    f"{_ctor(type(base), 'tritonkv.policies')}({name}={v})) as the policy)")
    acls = type(alloc) if alloc is not None else None
    if acls is not None and name in _settings(acls):
        return (f"{name!r} ({name}={v} is a setting of the allocator {alloc.name!r}, not an input of compress(): "
                f"pass allocation={_ctor(acls, 'tritonkv.allocation')}({name}={v}))")
    pols = [n for n, c in POLICIES.items() if name in _settings(c)]  # registry order: snapkv before h2o
    allocs = [n for n, c in ALLOCATORS.items() if name in _settings(c)]
    if pols or allocs:
        parts = []
        if pols:
            ex = _ctor(POLICIES[pols[0]], "tritonkv.policies")
            parts.append(f"of the policies {', '.join(pols)} (e.g. {ex}({name}={v}), passed as the policy)")
        if allocs:
            ex = _ctor(ALLOCATORS[allocs[0]], "tritonkv.allocation")
            parts.append(f"of the allocators {', '.join(allocs)} (e.g. allocation={ex}({name}={v}))")
        mine = "" if pol is None else (f"; the policy {pol.name!r} has no setting {name!r}: its settings are "
                                       f"{', '.join(_settings(pcls)) or 'none'}")
        return f"{name!r} ({name}={v} is a setting {' and '.join(parts)}, not an input of compress(){mine})"
    s = suggest(name, sorted(known) + list(PARAMS))
    return f"{name!r}" + (f" (did you mean {s!r}?)" if s else "")
