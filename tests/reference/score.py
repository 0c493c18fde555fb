"""Oracle of SCORE's redundancy-penalised selection (SCORE §3.4, Eq. 13; docs/algorithms.md §1.7),
written from the paper and the notes. NumPy only, one layer and one batch row at a time.

    U_h     = top-b_h(A[h])                                     unpenalised
    r_h[j]  = |{h' ≠ h : j ∈ U_h'}|                             other heads only
    Ã[h,j]  = A[h,j] · exp(−(α / HD_h) · r_h[j])
    kept_h  = P ∪ top-b_h(Ã[h])

Sequential ("greedy"): heads in descending HD (ties to the lower h); r[j] counts the final
selections of the heads already visited. "top" ranks non-protected tokens by (score desc,
index asc), NaN lowest; protected tokens P count inside b_h.
"""
import numpy as np


def top_mask(a: np.ndarray, budget: int, sink: int = 0, window: int = 0) -> np.ndarray:
    """Bool [N]: P ∪ the top (budget − |P|) non-protected tokens of a."""
    a = np.asarray(a, dtype=np.float64)
    N = a.shape[0]
    P = np.zeros(N, dtype=bool)
    P[:min(sink, N)] = True
    if window > 0:
        P[max(N - window, 0):] = True
    key = np.where(np.isnan(a), -np.inf, a)
    key = np.where(key == 0, 0.0, key)
    rest = sorted(np.flatnonzero(~P).tolist(), key=lambda i: (-key[i], i))
    m = P.copy()
    m[rest[:max(min(budget, N) - int(P.sum()), 0)]] = True
    return m


def penalty(A, U, hd, alpha: float, picks=None):
    """Ã [H, N] of Eq. 13 for one batch row: A [H, N] base scores, U [H, N] bool unpenalised picks, HD [H].

    r_h[j] = |{h' ≠ h : j ∈ U_h'}|, or picks[j] − U_h[j] when every head's pick count ``picks`` [N] is given
    (heads beyond these H, as under tensor parallelism). NaN scores stay NaN (the factor is in (0, 1])."""
    A = np.asarray(A, dtype=np.float64)
    U = np.asarray(U, dtype=bool)
    H, N = A.shape
    if picks is None:
        r = np.array([[sum(int(U[g, j]) for g in range(H) if g != h) for j in range(N)] for h in range(H)],
                     dtype=np.float64).reshape(H, N)
    else:
        r = np.asarray(picks, dtype=np.float64)[None, :] - U
    return A * np.exp(-(alpha / np.asarray(hd, dtype=np.float64))[:, None] * r)


def parallel(A, budgets, hd, alpha: float, sink: int = 0, window: int = 0):
    """(kept [H, N] bool, U [H, N] bool, r [H, N], Ã [H, N]) for one batch row."""
    A = np.asarray(A, dtype=np.float64)
    H = A.shape[0]
    U = np.stack([top_mask(A[h], budgets[h], sink, window) for h in range(H)])
    r = np.stack([sum(U[g] for g in range(H) if g != h).astype(np.float64) if H > 1 else np.zeros(A.shape[1])
                  for h in range(H)])
    At = A * np.exp(-(alpha / np.asarray(hd, dtype=np.float64))[:, None] * r)
    kept = np.stack([top_mask(At[h], budgets[h], sink, window) for h in range(H)])
    return kept, U, r, At


def visit_order(hd) -> list:
    """Heads by descending HD, ties to the lower index."""
    return sorted(range(len(hd)), key=lambda h: (-float(hd[h]), h))


def sequential(A, budgets, hd, alpha: float, sink: int = 0, window: int = 0):
    """(kept [H, N] bool, Ã [H, N]) for one batch row."""
    A = np.asarray(A, dtype=np.float64)
    H, N = A.shape
    taken = np.zeros(N)
    kept = np.zeros((H, N), dtype=bool)
    At = np.zeros_like(A)
    for h in visit_order(hd):
        At[h] = A[h] * np.exp(-(alpha / float(hd[h])) * taken)
        kept[h] = top_mask(At[h], budgets[h], sink, window)
        taken += kept[h]
    return kept, At
