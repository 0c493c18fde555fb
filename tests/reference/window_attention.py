"""Oracle of the window-attention family (SnapKV, TOVA, H2O-style, SurfaceLogicKV selection;
docs/algorithms.md §1.4), written from the formulas. NumPy only, float64.

One batch row at a time: K is [H, N, d] (H KV heads), Q is [H_q, W, d] with H_q = G·H, query head q
reading KV head q // G; query row i sits at position p_i = N − W + i.

    P[q,i,j] = exp(τ·q_i·k_j − lse[q,i])    for j ≤ p_i, else 0
    u[q,j]   = (1/W) Σ_i P[q,i,j]            (rows="sum": Σ_i, H2O)
    u[h,j]   = mean_{q∈G(h)} u[q,j]          (head_reduce "max": max; "layer": mean over all H_q)
    s[h,·]   = pool_κ(u[h,·]) over [0, N−W), stride 1, padding κ//2

Window positions [N−W, N) keep their unpooled u (the attention they receive from the window rows
that see them); they are protected, so any value would do. Query rows at a negative position
(W > N) see no key and add nothing.

Non-finite inputs (docs/contracts.md, "Non-finite inputs"): a key with a non-finite element is absent
from every softmax (P = 0) and its score is NaN (with head_reduce "layer", NaN in every head); a query
row with a non-finite element (or a non-finite given LSE) is left out: the mean over rows divides by
the rows left in of its head, the mean over the group by the heads with a row left in ("layer": the
mean of the H group means). Pooling treats a NaN neighbour as a hole like the padding.
"""
import numpy as np


def lse(K, Q, scale=None):
    """ln Σ_{j ≤ p_i} exp(τ·q_i·k_j), float64 [H_q, W] (−inf for rows that see no key)."""
    K = np.asarray(K, dtype=np.float64)
    Q = np.asarray(Q, dtype=np.float64)
    H, N, d = K.shape
    Hq, W, _ = Q.shape
    G = Hq // H
    tau = 1.0 / np.sqrt(d) if scale is None else scale
    out = np.full((Hq, W), -np.inf)
    for q in range(Hq):
        for i in range(W):
            p = N - W + i
            if p < 0:
                continue
            fin = np.isfinite(K[q // G, : p + 1]).all(-1)
            if not fin.any() or not np.isfinite(Q[q, i]).all():
                continue
            logits = tau * K[q // G, : p + 1][fin] @ Q[q, i]
            m = logits.max()
            out[q, i] = m + np.log(np.exp(logits - m).sum())
    return out


def attention(K, Q, scale=None, attn_lse=None):
    """P[q, i, j], float64 [H_q, W, N] (zero where j > p_i)."""
    K = np.asarray(K, dtype=np.float64)
    Q = np.asarray(Q, dtype=np.float64)
    H, N, d = K.shape
    Hq, W, _ = Q.shape
    G = Hq // H
    tau = 1.0 / np.sqrt(d) if scale is None else scale
    L = lse(K, Q, scale) if attn_lse is None else np.asarray(attn_lse, dtype=np.float64)
    P = np.zeros((Hq, W, N))
    for q in range(Hq):
        for i in range(W):
            p = N - W + i
            if p < 0 or not (np.isfinite(Q[q, i]).all() and np.isfinite(L[q, i])):
                continue
            fin = np.isfinite(K[q // G, : p + 1]).all(-1)
            P[q, i, : p + 1][fin] = np.exp(tau * K[q // G, : p + 1][fin] @ Q[q, i] - L[q, i])
    return P


def rows_left_in(Q, N, attn_lse=None):
    """bool [H_q, W]: query rows with every element finite and a finite given LSE (a row at a
    negative position sees no key: its LSE is −inf and it still counts)."""
    ok = np.isfinite(np.asarray(Q, dtype=np.float64)).all(-1)
    if attn_lse is not None:
        W = ok.shape[1]
        ok &= np.isfinite(np.asarray(attn_lse, dtype=np.float64)) | (N - W + np.arange(W) < 0)
    return ok


def pool(u, n_pool: int, kernel_size: int, mode: str = "max"):
    """1-D pooling of u[:n_pool] with stride 1 and padding κ//2 (output j covers
    [j − κ//2, j − κ//2 + κ)); "max" ignores the padding, "avg" counts it as zeros (divides by κ).
    Entries from n_pool on are copied unchanged."""
    u = np.asarray(u, dtype=np.float64)
    out = u.copy()
    pad = kernel_size // 2
    for j in range(max(n_pool, 0)):
        if np.isnan(u[j]):
            continue  # a non-finite key keeps its NaN
        lo, hi = max(j - pad, 0), min(j - pad + kernel_size, n_pool)
        seg = u[lo:hi][~np.isnan(u[lo:hi])]  # NaN neighbours are holes
        out[j] = seg.max() if mode == "max" else seg.sum() / kernel_size
    return out


def scores(K, Q, *, scale=None, attn_lse=None, kernel_size=1, pool_mode="max", rows="mean",
           head_reduce="mean"):
    """Scores float64 [H, N] of one batch row (H KV heads)."""
    K = np.asarray(K, dtype=np.float64)
    H, N, _ = K.shape
    Hq, W, _ = np.shape(Q)
    G = Hq // H
    P = attention(K, Q, scale, attn_lse)
    n_rows = rows_left_in(Q, N, attn_lse).sum(axis=1)  # [H_q]
    u = P.sum(axis=1) if rows == "sum" else P.sum(axis=1) / np.maximum(n_rows, 1)[:, None]  # [H_q, N]
    ug = u.reshape(H, G, N)
    present = (n_rows > 0).reshape(H, G)
    if head_reduce == "max":
        uh = ug.max(axis=1)
    else:
        uh = ug.sum(axis=1) / np.maximum(present.sum(axis=1), 1)[:, None]
        if head_reduce == "layer":
            uh = np.broadcast_to(uh.mean(axis=0), (H, N)).copy()
    kfin = np.isfinite(K).all(-1)  # [H, N]
    uh = np.where(kfin.all(0) if head_reduce == "layer" else kfin, uh, np.nan)
    return np.stack([pool(uh[h], N - W, kernel_size, pool_mode) for h in range(H)])
