"""Near-match suggestions for names a user typed: policy and allocator names, compress() inputs.

``suggest("SnapKV", POLICIES)`` → ``"snapkv"``; ``suggest("streamingllm", POLICIES)`` → ``"streaming_llm"``;
``suggest("queris", inputs)`` → ``"queries"``. Case, ``-`` and ``_`` do not matter; otherwise the closest
name by ``difflib`` (ratio ≥ 0.6), or None.
"""
from __future__ import annotations

import difflib
from typing import Iterable, Optional

#: names that are both a policy and an allocator, and what each of them is
SHARED_NAMES = {
    "score": ("policy 'score' is SCORE's redundancy-penalised selection (needs hd=); "
              "allocation='score' is SCORE's layer/head budget allocator (needs head_means=, layer=)"),
    "surfacelogic": ("policy 'surfacelogic' is SurfaceLogicKV's window-attention scoring (needs queries=); "
                     "allocation='surfacelogic' is its INF-profile per-head budget allocator (needs layer=)"),
}


def _norm(s: str) -> str:
    return s.lower().replace("-", "").replace("_", "").replace(" ", "")


def suggest(name, choices: Iterable[str]) -> Optional[str]:
    """The choice ``name`` most probably meant, or None."""
    if not isinstance(name, str):
        return None
    choices = list(choices)
    by_norm = {}
    for c in choices:
        by_norm.setdefault(_norm(c), c)
    n = _norm(name)
    if n in by_norm:
        return by_norm[n]
    close = difflib.get_close_matches(n, list(by_norm), n=1, cutoff=0.6)
    if close:
        return by_norm[close[0]]
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(name, choices: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` or ``""``."""
    s = suggest(name, choices)
    return f"; did you mean {s!r}?" if s is not None else ""


def _match(name: str, choices) -> tuple[Optional[str], float]:
    """``(choice, similarity)``: 1.0 for a match up to case and ``-``/``_``."""
    s = suggest(name, choices)
    if s is None:
        return None, 0.0
    if _norm(s) == _norm(name):
        return s, 1.0
    return s, difflib.SequenceMatcher(None, _norm(name), _norm(s)).ratio()


def unknown_name(kind: str, name, known, other_kind: str, other_known) -> str:
    """The message for an unknown ``policy``/``allocation`` name: the near match in its own registry,
    or the note that it names the other kind (``policy='adakv'``: an allocator), then every known name."""
    own, r_own = _match(name, known)
    other, r_other = _match(name, other_known)
    msg = f"{kind}: unknown name {name!r}"
    if other is not None and r_other > r_own:
        if kind == "policy":
            msg += (f"; {other!r} is an allocator, not a policy: pass a scoring policy and allocation={other!r} "
                    f"(e.g. compress(kv, 'knorm', 0.25, allocation={other!r}))")
        else:
            msg += (f"; {other!r} is a policy, not an allocator: pass it as compress()'s policy "
                    f"(compress(kv, {other!r}, budget, ...)); allocation= takes one of the names below")
    elif own is not None:
        msg += f"; did you mean {own!r}?"
        if own in SHARED_NAMES:
            msg += f" (the {SHARED_NAMES[own]})"
    return msg + ("" if msg.endswith("?") else ".") + f" known: {sorted(known)}"
