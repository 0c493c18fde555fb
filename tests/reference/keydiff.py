"""Oracle of KeyDiff (KeyDiff §3.2, Eqs. 7–8, App. B.1; docs/algorithms.md §1.2). NumPy only.

Two independent forms over the n keys of one row, ``keys [n, D]``:

* Eq. 8, the anchor form:   k̂_i = k_i / max(‖k_i‖, 1e-12),  a = (1/n) Σ_i k̂_i  (or the raw mean),
                            s_i = −(a·k_i) / max(‖a‖·‖k_i‖, 1e-8)
* Eq. 7, literally:         s_i = −Σ_j cos(k_i, k_j),  cos(x, y) = x·y / max(‖x‖·‖y‖, 1e-8)

Eq. 7 = −n·‖a‖·(Eq. 8) for keys of non-negligible norm, so both rank tokens identically.

Non-finite keys (the project-wide rule): a key with a NaN or ±inf element scores NaN and every
statistic over tokens (the anchor's mean) is taken over the finite keys only.
"""
import numpy as np

EPS_NORM = 1e-12
EPS_COS = 1e-8


def anchor(keys, mode: str = "normalized") -> np.ndarray:
    """The anchor vector ``[..., D]``: the mean over tokens of the unit keys (or of the keys, ``raw``)."""
    k = np.asarray(keys, dtype=np.float64)
    finite = np.isfinite(k).all(axis=-1, keepdims=True)
    k = np.where(finite, k, 0.0)
    if mode == "normalized":
        k = k / np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), EPS_NORM)
    elif mode != "raw":
        raise ValueError(mode)
    return k.sum(axis=-2) / np.maximum(finite.sum(axis=-2), 1)


def scores(keys, mode: str = "normalized") -> np.ndarray:
    """Eq. 8 with App. B.1's ε: float64 ``[..., N]`` = −cos(k_i, a)."""
    k = np.asarray(keys, dtype=np.float64)
    a = anchor(k, mode)
    dot = (k * a[..., None, :]).sum(axis=-1)
    den = np.maximum(np.linalg.norm(a, axis=-1)[..., None] * np.linalg.norm(k, axis=-1), EPS_COS)
    return np.where(np.isfinite(k).all(axis=-1), -dot / den, np.nan)


def pairwise_scores(keys) -> np.ndarray:
    """Eq. 7 literally, O(n²): −CosSim(K)·𝟏 = −Σ_j cos(k_i, k_j), float64 ``[n]`` for one row ``[n, D]``."""
    k = np.asarray(keys, dtype=np.float64)
    nrm = np.linalg.norm(k, axis=-1)
    cos = (k @ k.T) / np.maximum(nrm[:, None] * nrm[None, :], EPS_COS)
    return -cos.sum(axis=1)
