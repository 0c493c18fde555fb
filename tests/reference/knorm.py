"""Oracle of Knorm (Devoto et al.; docs/algorithms.md §1.1). NumPy only.

    s_i = −‖k_i‖₂,   NaN when k_i has a non-finite element (the project-wide rule: it ranks lowest)
"""
import numpy as np


def scores(keys) -> np.ndarray:
    """float64 scores ``[..., N]`` of keys ``[..., N, D]``: the negated L2 norm of each key (NaN for a
    key with a NaN or ±inf element)."""
    k = np.asarray(keys, dtype=np.float64)
    return np.where(np.isfinite(k).all(axis=-1), -np.sqrt((k * k).sum(axis=-1)), np.nan)
