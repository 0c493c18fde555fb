"""Oracle of LagKV (LagKV §2.2, Eqs. 5–10; docs/algorithms.md §1.5), written from the paper. NumPy only.

One row at a time: K and V are [T, d]. Sink S, lag L, partitions π_j = [S + jL, S + (j+1)L),
P = ⌊(T−S)/L⌋ when T ≥ S + 2L (else nothing is scored), tail = [S + (P−1)L, T).

Non-finite inputs (the library's rule): a token whose key or value holds a NaN or ±inf scores NaN
and ranks lowest in its partition (the lower index first among such tokens); every statistic over
tokens — the reference min/max, the softmax normaliser — is taken over the finite tokens only. A
reference without a finite token leaves the channels unnormalised (lo = 0, range 1).
"""
import math

import numpy as np


def num_partitions(T: int, S: int, L: int) -> int:
    return (T - S) // L if T >= S + 2 * L else 0


def tail_len(T: int, S: int, L: int) -> int:
    """|tail| = L + (T−S) mod L, the last full partition plus the remainder (0 when nothing is scored)."""
    P = num_partitions(T, S, L)
    return T - (S + (P - 1) * L) if P else 0


def finite_tokens(K, V) -> np.ndarray:
    """bool [T]: the tokens whose key and value are finite."""
    return np.isfinite(np.asarray(K, dtype=np.float64)).all(axis=1) & np.isfinite(np.asarray(V, dtype=np.float64)).all(axis=1)


def _phi(Z: np.ndarray, ref: np.ndarray, eps: float, ok=None, ok_ref=None) -> np.ndarray:
    """Eqs. 5–8 for one partition Z [L, d] against its reference partition ref [L, d]; ``ok``/``ok_ref``
    mark the finite tokens of each (default: all). NaN on the tokens not ``ok``."""
    ok = np.ones(len(Z), bool) if ok is None else ok
    ok_ref = np.ones(len(ref), bool) if ok_ref is None else ok_ref
    if ok_ref.any():
        lo = ref[ok_ref].min(axis=0)
        rng = np.maximum(ref[ok_ref].max(axis=0) - lo, eps)
    else:
        lo, rng = 0.0, 1.0
    out = np.full(len(Z), np.nan)
    if ok.any():
        zn = (Z[ok] - lo) / rng
        sigma = zn.std(axis=1, ddof=1)
        e = np.exp(sigma - sigma.max())
        out[ok] = e / e.sum()
    return out


def lag_scores(K, V, S: int, L: int, eps: float = 1e-6):
    """(score, φ_K, φ_V), float64 [T]; score = φ_K + φ_V (Eq. 9) on scored partitions, NaN elsewhere
    (and on tokens with a non-finite key or value)."""
    K = np.asarray(K, dtype=np.float64)
    V = np.asarray(V, dtype=np.float64)
    T = K.shape[0]
    ok = finite_tokens(K, V)
    phik = np.full(T, np.nan)
    phiv = np.full(T, np.nan)
    for j in range(num_partitions(T, S, L) - 1):
        a, b, c = S + j * L, S + (j + 1) * L, S + (j + 2) * L
        phik[a:b] = _phi(K[a:b], K[b:c], eps, ok[a:b], ok[b:c])
        phiv[a:b] = _phi(V[a:b], V[b:c], eps, ok[a:b], ok[b:c])
    return phik + phiv, phik, phiv


def ranks(score: np.ndarray, S: int, L: int) -> np.ndarray:
    """Within-partition rank ρ/L of each scored token (higher score = higher rank; at equal scores the
    lower index gets the higher rank; NaN scores lowest); NaN elsewhere."""
    T = score.shape[0]
    score = np.where(np.isnan(score), -np.inf, score)
    out = np.full(T, np.nan)
    for j in range(num_partitions(T, S, L) - 1):
        a = S + j * L
        order = sorted(range(L), key=lambda i: (score[a + i], -i))  # ascending: position = rank
        for rho, i in enumerate(order):
            out[a + i] = rho / L
    return out


def _top(score: np.ndarray, idx: np.ndarray, m: int) -> list:
    """The m indices of ``idx`` with the highest scores, ties to the lower index, NaN scores last."""
    return sorted(idx.tolist(), key=lambda i: (np.inf if np.isnan(score[i]) else -score[i], i))[:m]


def keep_m(ratio: float, L: int) -> int:
    """Tokens kept per partition: m = ⌊r·L⌋."""
    return math.floor(ratio * L + 1e-6)


def paper_keep(K, V, S: int, L: int, ratio: float, eps: float = 1e-6) -> np.ndarray:
    """Paper mode: sinks, the top m of each scored partition and the tail; everything when T < S + 2L."""
    T = np.asarray(K).shape[0]
    P = num_partitions(T, S, L)
    if P == 0:
        return np.arange(T)
    score = lag_scores(K, V, S, L, eps)[0]
    m = keep_m(ratio, L)
    kept = list(range(S)) + list(range(S + (P - 1) * L, T))
    for j in range(P - 1):
        kept += _top(score, np.arange(S + j * L, S + (j + 1) * L), m)
    return np.array(sorted(kept), dtype=np.int64)


def paper_count(T: int, S: int, L: int, ratio: float) -> int:
    """Eq. 10: L_R = S + m(P−1) + L + (T−S) mod L (T when nothing is scored)."""
    P = num_partitions(T, S, L)
    return S + keep_m(ratio, L) * (P - 1) + L + (T - S) % L if P else T


def budget_keep(K, V, S: int, L: int, k: int, eps: float = 1e-6) -> np.ndarray:
    """Budget mode: sinks ∪ tail, then ⌊b/(P−1)⌋ per scored partition (b = k − S − |tail|) plus one more
    in each of the first b mod (P−1) partitions, each partition's top by score (ties to the lower index).
    T < S + 2L: StreamingLLM with sink S."""
    T = np.asarray(K).shape[0]
    if k >= T:
        return np.arange(T)
    P = num_partitions(T, S, L)
    if P == 0:
        if k < S:
            raise ValueError("budget")
        return np.array(sorted(set(range(S)) | set(range(T - (k - S), T))), dtype=np.int64)
    b = k - S - tail_len(T, S, L)
    if b < 0:
        raise ValueError("budget")
    score = lag_scores(K, V, S, L, eps)[0]
    q, rem = divmod(b, P - 1)
    kept = list(range(S)) + list(range(S + (P - 1) * L, T))
    for j in range(P - 1):
        kept += _top(score, np.arange(S + j * L, S + (j + 1) * L), q + (1 if j < rem else 0))
    return np.array(sorted(kept), dtype=np.int64)


def recursive_keep(K, V, S: int, L: int, ratio: float, chunks, eps: float = 1e-6) -> np.ndarray:
    """The recursive form (Fig. 1): tokens arrive in ``chunks`` (sizes summing to T); the first S go to the
    compressed part C, the rest to a raw tail U; while |U| ≥ 2L, U[0:L) is scored against U[L:2L), its top
    m move to C and U[0:L) is dropped. Returns the kept positions C ∪ U."""
    K = np.asarray(K, dtype=np.float64)
    V = np.asarray(V, dtype=np.float64)
    m = keep_m(ratio, L)
    C, U, seen = [], [], 0
    for n in chunks:
        for t in range(seen, seen + n):
            (C if t < S else U).append(t)
        seen += n
        while len(U) >= 2 * L:
            cur, nxt = np.array(U[:L]), np.array(U[L:2 * L])
            score = np.zeros(K.shape[0])
            ok = finite_tokens(K, V)
            score[cur] = _phi(K[cur], K[nxt], eps, ok[cur], ok[nxt]) + _phi(V[cur], V[nxt], eps, ok[cur], ok[nxt])
            C += _top(score, cur, m)
            U = U[L:]
        assert len(U) < 2 * L
    return np.array(sorted(C + U), dtype=np.int64)
