"""Oracle of decode attention over a ragged or padded KV cache (docs/architecture.md, "Kernels"), in float64.

Query head j of batch row b attends to the kept tokens of KV head j // G (G = H_q / H_kv):

    o[b, j] = softmax(s) V_r,   lse[b, j] = log Σ exp(s),   s = scale · K_r q[b, j]

with K_r, V_r the first length[r] tokens of row r = b·H_kv + j // G. An empty row gives o = 0 and
lse = -inf. With logit softcapping (Gemma 2) each logit is s -> softcap · tanh(s / softcap) first.
"""
import numpy as np


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, softcap=None):
    """One row: ``q [G, D]`` against ``k, v [n, D]`` -> ``(o [G, D], lse [G])``."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    if k.shape[0] == 0:
        return np.zeros((q.shape[0], v.shape[1])), np.full(q.shape[0], -np.inf)
    logits = scale * q @ k.T  # [G, n]
    if softcap is not None:
        logits = softcap * np.tanh(logits / softcap)
    m = logits.max(axis=1, keepdims=True)
    p = np.exp(logits - m)
    z = p.sum(axis=1, keepdims=True)
    return (p / z) @ v, (m + np.log(z))[:, 0]


def decode_rows(q: np.ndarray, rows_k, rows_v, num_kv_heads: int, scale=None, softcap=None):
    """``q [B, H_q, D]``; ``rows_k[r]``, ``rows_v[r]`` the ``[n_r, D]`` tokens of row r = b·H_kv + h.

    Returns ``(o [B, H_q, D], lse [B, H_q])``.
    """
    B, Hq, D = q.shape
    G = Hq // num_kv_heads
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    o = np.zeros((B, Hq, D))
    lse = np.zeros((B, Hq))
    for b in range(B):
        for h in range(num_kv_heads):
            r = b * num_kv_heads + h
            heads = slice(h * G, (h + 1) * G)
            o[b, heads], lse[b, heads] = attention(q[b, heads], rows_k[r], rows_v[r], scale, softcap)
    return o, lse


def decode_ragged(q, keys, values, row_start, lengths, num_kv_heads: int, scale=None, softcap=None):
    """Flat ``keys/values [T, D]``, row r at ``[row_start[r], row_start[r] + lengths[r])``."""
    rows = [slice(int(s), int(s) + int(n)) for s, n in zip(row_start, lengths)]
    return decode_rows(q, [keys[s] for s in rows], [values[s] for s in rows], num_kv_heads, scale, softcap)


def decode_padded(q, keys, values, lengths, scale=None, softcap=None):
    """Padded ``keys/values [B, H_kv, cap, D]`` and ``lengths [B, H_kv]``."""
    B, H = keys.shape[:2]
    ln = np.asarray(lengths).reshape(B * H)
    rk = [keys[r // H, r % H, : ln[r]] for r in range(B * H)]
    rv = [values[r // H, r % H, : ln[r]] for r in range(B * H)]
    return decode_rows(q, rk, rv, H, scale, softcap)
