"""Oracle of CriticalKV's perturbation-constrained selection (CriticalKV §3.4, Algorithms 1–2;
docs/algorithms.md §1.6), written from the paper and the notes. NumPy only, one row (b, h) at a time.

    n_j  = (1/G) Σ_{q∈G(h)} ‖ W_O[:, q·d:(q+1)·d] · v_j ‖₁        (the paper; ‖·‖₂ with norm="l2")
    S1   = top-⌊α·b⌋ non-protected tokens by s                 b = budget − |P|
    S2   = top-(b − |S1|) of the remaining by (s_j + ε)·n_j
    kept = P ∪ S1 ∪ S2

"top" ranks by (key desc, index asc) with NaN lowest and −0 == +0 (§0). ⌊α·b⌋ is evaluated as
floor(α·b + 1e-6), the library's rounding of fractional budgets.
"""
import math

import numpy as np


def value_norms(V: np.ndarray, W: np.ndarray, h: int, G: int, norm: str = "l1") -> np.ndarray:
    """n [N] for KV head h: V [N, d] its values, W [D_model, H_q·d] the o_proj weight. ``norm``:
    "l1" (the paper) or "l2" (the Euclidean norm of the same projection, computed directly, not
    through a Gram matrix)."""
    d = V.shape[1]
    V = np.asarray(V, dtype=np.float64)
    W = np.asarray(W, dtype=np.float64)
    n = np.zeros(V.shape[0])
    for q in range(h * G, (h + 1) * G):
        p = V @ W[:, q * d:(q + 1) * d].T  # W_O^q v_j for every j
        n += np.abs(p).sum(axis=1) if norm == "l1" else np.sqrt((p * p).sum(axis=1))
    # a token whose value has a non-finite element ranks lowest (docs/contracts.md, "Non-finite inputs")
    return np.where(np.isfinite(V).all(axis=1), n / G, np.nan)


def ranked(key: np.ndarray, candidates) -> list:
    """``candidates`` sorted by (key desc, index asc), NaN lowest, -0 == +0."""
    k = np.where(np.isnan(key), -np.inf, np.asarray(key, dtype=np.float64))
    k = np.where(k == 0, 0.0, k)
    return sorted((int(i) for i in candidates), key=lambda i: (-k[i], i))


def protected_set(n: int, sink: int, window: int) -> np.ndarray:
    p = np.zeros(n, dtype=bool)
    p[:min(sink, n)] = True
    if window > 0:
        p[max(n - window, 0):] = True
    return p


def stage1_count(budget: int, n: int, n_protected: int, alpha: float) -> int:
    """⌊α·b⌋ with b = min(budget, n) − |P|."""
    b = max(min(budget, n) - n_protected, 0)
    return math.floor(alpha * b + 1e-6)


def stages(s, n_norm, budget: int, sink: int, window: int, alpha: float, eps: float = 1e-4):
    """(P, S1, S2, stage-2 scores) of one row: bool masks [N] and (s + ε)·n."""
    s = np.asarray(s, dtype=np.float64)
    N = s.shape[0]
    P = protected_set(N, sink, window)
    b = max(min(budget, N) - int(P.sum()), 0)
    c1 = stage1_count(budget, N, int(P.sum()), alpha)
    S1 = np.zeros(N, dtype=bool)
    S1[ranked(s, np.flatnonzero(~P))[:c1]] = True
    s2 = (s + eps) * np.asarray(n_norm, dtype=np.float64)
    S2 = np.zeros(N, dtype=bool)
    S2[ranked(s2, np.flatnonzero(~P & ~S1))[:b - c1]] = True
    return P, S1, S2, s2


def keep(s, n_norm, budget: int, sink: int = 0, window: int = 0, alpha: float = 0.5, eps: float = 1e-4):
    """Kept indices (ascending) of one row."""
    P, S1, S2, _ = stages(s, n_norm, budget, sink, window, alpha, eps)
    return np.flatnonzero(P | S1 | S2)
