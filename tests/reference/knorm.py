"""Oracle of Knorm (Devoto et al.; docs/algorithms.md §1.1). NumPy only.

    s_i = −‖k_i‖₂
"""
import numpy as np


def scores(keys) -> np.ndarray:
    """float64 scores ``[..., N]`` of keys ``[..., N, D]``: the negated L2 norm of each key."""
    k = np.asarray(keys, dtype=np.float64)
    return -np.sqrt((k * k).sum(axis=-1))
