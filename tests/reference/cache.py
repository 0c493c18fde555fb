"""Oracle of the ragged cache (docs/contracts.md, "RaggedKV"): one Python list of tokens per row.

A row r = b·H_kv + h built by selection holds ``keys[b, h, kept]`` in ascending order of the kept
original positions; an append adds one token at the end of every row, with the next position.
Padding to ``cap`` fills zeros (positions -1).
"""
import numpy as np


class Rows:
    """Per-row lists of (key [D], value [D], position)."""

    def __init__(self, keys: np.ndarray, values: np.ndarray, kept):
        B, H, N, D = keys.shape
        self.B, self.H, self.D = B, H, D
        self.rows = [[(keys[r // H, r % H, i], values[r // H, r % H, i], int(i)) for i in kept[r]]
                     for r in range(B * H)]
        self.next_position = N

    def append(self, k: np.ndarray, v: np.ndarray):
        """``k, v [B, H, D]``: one token at the end of each row."""
        for r, row in enumerate(self.rows):
            row.append((k[r // self.H, r % self.H], v[r // self.H, r % self.H], self.next_position))
        self.next_position += 1

    def lengths(self) -> np.ndarray:
        return np.array([len(row) for row in self.rows]).reshape(self.B, self.H)

    def padded(self, cap: int):
        """``(K [B, H, cap, D], V, positions [B, H, cap])``, zero / -1 padded."""
        K = np.zeros((self.B * self.H, cap, self.D))
        V = np.zeros_like(K)
        P = np.full((self.B * self.H, cap), -1, dtype=np.int64)
        for r, row in enumerate(self.rows):
            for j, (k, v, p) in enumerate(row[:cap]):
                K[r, j], V[r, j], P[r, j] = k, v, p
        shape = (self.B, self.H, cap)
        return K.reshape(*shape, self.D), V.reshape(*shape, self.D), P.reshape(shape)


def layout(budgets, k_max: int, slack: int, align: int, total_capacity: int):
    """Rows laid out one after another from device budgets: row r holds min(max(budget, 0), k_max) tokens in a
    capacity of that plus ``slack``, rounded up to a multiple of ``align``; starts past ``total_capacity`` are
    clamped to it and a row keeps only what fits before it -> (row_start [R+1], length [R])."""
    starts, lengths = [0], []
    end = 0
    for b in budgets:
        want = min(max(int(b), 0), k_max)
        cap = -(-(want + slack) // align) * align
        start, end = end, end + cap
        lengths.append(min(want, max(min(end, total_capacity) - min(start, total_capacity), 0)))
        starts.append(min(end, total_capacity))
    return np.array(starts, dtype=np.int64), np.array(lengths, dtype=np.int32)
