"""Oracle of the shared selection (docs/algorithms.md §0), written from the spec.

    key_i = -inf if isnan(s_i) else (0.0 if s_i == 0 else s_i)
    order = non-protected indices sorted by (key desc, index asc)
    kept  = sorted(P ∪ order[:k - |P|])
"""
import numpy as np


def select(scores: np.ndarray, k: int, sink: int = 0, window: int = 0, forced=None) -> np.ndarray:
    """Kept indices (ascending) of one row; ``forced`` (bool [N]) are kept like protected tokens."""
    s = np.asarray(scores, dtype=np.float64)
    n = s.shape[0]
    k = max(0, min(int(k), n))
    prot = np.zeros(n, dtype=bool)
    prot[: min(sink, n)] = True
    if window > 0:
        prot[max(n - window, 0):] = True
    if forced is not None:
        prot |= np.asarray(forced, dtype=bool)
    protected = np.flatnonzero(prot)
    if len(protected) >= k:  # only reachable through misuse; keep the first k protected
        return protected[:k]
    key = np.where(np.isnan(s), -np.inf, s)
    key = np.where(key == 0, 0.0, key)
    rest = np.flatnonzero(~prot)
    order = sorted(rest.tolist(), key=lambda i: (-key[i], i))
    return np.array(sorted(protected.tolist() + order[: k - len(protected)]), dtype=np.int64)


def select_rows(scores: np.ndarray, budgets, sink: int = 0, window: int = 0, forced=None):
    """Per-row kept indices for ``scores [R, N]`` and one budget per row."""
    scores = np.asarray(scores)
    budgets = np.broadcast_to(np.asarray(budgets), scores.shape[:1])
    return [select(scores[r], budgets[r], sink, window, None if forced is None else forced[r])
            for r in range(scores.shape[0])]


def first_pass_histogram(scores: np.ndarray, sink: int = 0, window: int = 0, forced=None, bins: int = 256):
    """The select's first radix pass from the spec, ``[R, bins]``: per row, the histogram of the top byte of the
    order-preserving uint32 key of every score (NaN -> -inf, -0 -> +0; sign bit set: all bits flipped, else the
    sign bit set), protected tokens (the first ``sink``, the last ``window``, ``forced`` ones: bool ``[R, N]``)
    the maximum key 0xFFFFFFFF."""
    s = np.asarray(scores, dtype=np.float32)
    s = np.where(np.isnan(s), -np.inf, s).astype(np.float32)
    s = np.where(s == 0, np.float32(0.0), s).astype(np.float32)
    b = s.view(np.uint32).astype(np.uint64)
    u = np.where(b >> 31 != 0, (~b) & 0xFFFFFFFF, b | 0x80000000)
    n = s.shape[1]
    pos = np.arange(n)
    prot = (pos < sink) | (pos >= n - window)
    if forced is not None:
        prot = prot | np.asarray(forced, dtype=bool)
    u = np.where(prot, 0xFFFFFFFF, u)
    return np.stack([np.bincount((row >> 24).astype(np.int64), minlength=bins) for row in u])
