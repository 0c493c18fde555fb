"""Oracle of StreamingLLM (docs/algorithms.md §1.3): the first ``sink`` tokens and the most recent
``k − sink``. NumPy only."""
import numpy as np


def kept(n: int, k: int, sink: int = 4) -> np.ndarray:
    """Kept indices (ascending) of a row of ``n`` tokens at budget ``k`` (everything when k ≥ n)."""
    if k >= n:
        return np.arange(n)
    if k < min(sink, n):
        raise ValueError("budget below the sink")
    head = list(range(min(sink, n)))
    tail = list(range(n - (k - len(head)), n))
    return np.array(sorted(set(head) | set(tail)), dtype=np.int64)
