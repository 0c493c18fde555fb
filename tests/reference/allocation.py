"""Oracles of every allocator (docs/algorithms.md §2), written from the notes in NumPy (float64).

Conventions shared with the library (stated in the notes or chosen there):
- floors of float products are ``floor(x + 1e-6)`` (§0: 0.29·100 gives 29);
- exact mode = largest remainder: cap at avail and spread the excess over the uncapped entries in
  proportion to their weights, repeating until nothing exceeds (evenly over zero-weight entries
  once every weighted entry is full); take floors; add 1 to the largest fractional parts
  (compared in fp32, the precision of the selection kernel), ties to the lower flat index.
"""
import math

import numpy as np

from .select import select as select_row


def floor_eps(x):
    return math.floor(x + 1e-6)


# -- rounding ------------------------------------------------------------------------------------
def cap_and_spread(x, cap, weights):
    """The literal iteration: cap, spread the excess in proportion to weights, repeat."""
    x = np.array(x, dtype=np.float64)
    cap = np.broadcast_to(np.asarray(cap, dtype=np.float64), x.shape)
    w = np.maximum(np.asarray(weights, dtype=np.float64), 0.0)
    capped = np.zeros(x.shape, dtype=bool)
    for _ in range(2 * len(x) + 2):
        over = x > cap
        excess = float((x[over] - cap[over]).sum())
        x[over] = cap[over]
        capped |= over
        if excess <= 0:
            break
        free = ~capped
        if w[free].sum() > 0:
            x[free] += excess * w[free] / w[free].sum()
        elif free.any():
            x[free] += excess / free.sum()
        else:
            break
    return x


def largest_remainder(x, total, cap=None, weights=None):
    """int64 budgets (1-D) summing to ``min(total, Σcap)``."""
    x = np.maximum(np.asarray(x, dtype=np.float64), 0.0)
    if cap is None:
        cap = np.full(x.shape, np.inf)
    else:
        cap = np.broadcast_to(np.asarray(cap, dtype=np.float64), x.shape)
        total = min(total, cap.sum())
        x = cap_and_spread(x, cap, x if weights is None else weights)
    fl = np.floor(x)
    rem = int(round(total - fl.sum()))
    key = np.where(fl < cap, (x - fl).astype(np.float32), -np.inf)
    order = sorted(range(len(x)), key=lambda i: (-key[i], i))
    out = fl.astype(np.int64)
    for i in order[:max(rem, 0)]:
        out[i] += 1
    return out


def adjust_budgets(x, total, cap):
    """CAKE's adjust_budgets: truncate, cap, spread the excess evenly over uncapped entries
    (remainders to the lowest indices), then the shortfall the same way; final clamp."""
    b = np.floor(np.maximum(np.asarray(x, dtype=np.float64), 0)).astype(np.int64)

    def spread(b, amount):
        valid = np.flatnonzero(b < cap)
        if len(valid) == 0:
            return b
        per, extra = divmod(int(amount), len(valid))
        b = b.copy()
        b[valid] += per
        b[valid[:extra]] += 1
        return b

    excess = int(np.maximum(b - cap, 0).sum())
    b = spread(np.minimum(b, cap), excess)
    b = spread(b, total - b.sum())
    return np.clip(b, 0, cap)


# -- allocators -----------------------------------------------------------------------------------
def uniform(b, avail, shape):
    return np.full(shape, max(min(b, avail), 0), dtype=np.int64)


def pyramid(L, b, avail, beta=20.0, mode="exact"):
    if b >= avail:
        return np.full(L, avail)
    if b <= 0 or L == 1:
        return np.full(L, max(b, 0))
    if mode == "paper":
        lo = floor_eps(b / beta)
        hi = 2 * b - lo
        if hi >= avail:
            hi, lo = avail, 2 * b - avail
        step = (hi - lo) // (L - 1)
        return np.clip(hi - np.arange(L) * step, 0, avail)
    lo = b / beta
    hi = 2 * b - lo
    if hi > avail:
        hi = float(avail)
        lo = 2 * b - hi
    x = hi - np.arange(L) * (hi - lo) / (L - 1)
    return largest_remainder(x, L * b, cap=avail)


def adakv(scores, b, alpha=0.2, mode="exact"):
    """scores [B, H, M] (selectable tokens) -> [B, H]."""
    scores = np.asarray(scores, dtype=np.float32)
    B, H, M = scores.shape
    if b >= M or b <= 0:
        return np.full((B, H), max(min(b, M), 0))
    f = min(floor_eps(alpha * b), b)
    out = np.zeros((B, H), dtype=np.int64)
    for r in range(B):
        flat = scores[r].reshape(-1)
        if mode == "paper":
            kept = select_row(flat, H * b)
            c = np.bincount(kept // M, minlength=H)
            out[r] = np.clip(np.round(c * (1 - alpha) + f), f, M)
            continue
        forced = np.zeros(H * M, dtype=bool)
        for h in range(H):
            forced[h * M + select_row(scores[r, h], f)] = True
        kept = select_row(flat, H * b, forced=forced)
        out[r] = np.bincount(kept // M, minlength=H)
    return out


def _fixed_plus_pool(share, b, avail, ratio, mode):
    L, H = share.shape
    if b >= avail or b <= 0:
        return np.full((L, H), max(min(b, avail), 0))
    small = floor_eps(b / ratio)
    fixed, pool = b - small, small * L * H
    x = fixed + share * pool
    if mode == "paper":
        return np.clip(np.round(x), 0, avail).astype(np.int64)
    return largest_remainder(x.reshape(-1), L * H * b, cap=avail, weights=share.reshape(-1)).reshape(L, H)


def _norm(p):
    s = p.sum()
    return p / s if s > 0 else np.full(p.shape, 1.0 / p.size)


def headkv(profile, b, avail, beta=1.5, tau=1.0, mode="exact"):
    p = _norm(np.maximum(np.asarray(profile, dtype=np.float64), 0))
    if tau != 1.0:
        p = _norm(p ** tau)
    return _fixed_plus_pool(p, b, avail, beta, mode)


def surfacelogic(inf, b, avail, rho=1.351, floor=0.01, mode="strict"):
    inf = np.maximum(np.asarray(inf, dtype=np.float64), 0)
    L, H = inf.shape
    layer = inf.sum(1)
    imp = layer / layer.sum() if layer.sum() > 0 else np.full(L, 1.0 / L)
    imp = np.maximum(imp, floor)
    if mode == "strict":
        imp = imp / imp.sum()
    within = np.array([inf[l] / layer[l] if layer[l] > 0 else np.full(H, 1.0 / H) for l in range(L)])
    return _fixed_plus_pool(imp[:, None] * within, b, avail, rho, "exact" if mode == "strict" else "paper")


# -- SCORE -----------------------------------------------------------------------------------------
def head_distance_rows(rows_i, rows_j):
    """Eq. 4 with δ = cosine distance, by its definition: (1/K²) Σ_s Σ_t (1 − cos(a_i^(s), a_j^(t)))."""
    K = rows_i.shape[0]
    tot = 0.0
    for s in range(K):
        for t in range(rows_j.shape[0]):
            a, c = rows_i[s], rows_j[t]
            na, nc = np.linalg.norm(a), np.linalg.norm(c)
            cos = a @ c / (na * nc) if na > 0 and nc > 0 else 0.0
            tot += 1.0 - cos
    return min(max(tot / (K * rows_j.shape[0]), 0.0), 1.0)


def score_stats(rows, gamma=0.5):
    """rows [L, Hq, K, n] of one batch row -> (IR [L], TD [L], HD [L, Hq])."""
    L, Hq = rows.shape[:2]
    D = lambda l1, q1, l2, q2: head_distance_rows(rows[l1, q1], rows[l2, q2])  # noqa: E731
    ir, td, hd = np.zeros(L), np.zeros(L), np.zeros((L, Hq))
    ema = 0.0
    for l in range(L):
        same = np.array([[D(l, q, l, p) for p in range(Hq)] for q in range(Hq)])
        ir[l] = same.sum() / Hq ** 2
        if l == 0:
            td[0] = ema = ir[0]
            hd[0] = same.sum(1) / Hq
        else:
            prev = np.array([[D(l, q, l - 1, p) for p in range(Hq)] for q in range(Hq)])
            mu = prev.sum() / Hq ** 2
            td[l] = abs(mu - ema)
            ema = gamma * ema + (1 - gamma) * mu
            hd[l] = (same.sum(1) + prev.sum(1)) / (2 * Hq)
    return ir, td, np.maximum(hd, 1e-6)


def score_layers(ir, td, b, H, avail, lambda1=1.0, lambda2=1.0, mode="exact"):
    L = len(ir)
    total = L * H * b
    n = lambda1 * np.asarray(ir, np.float64) + lambda2 * np.asarray(td, np.float64)
    x = total * n / n.sum() if n.sum() > 0 else np.full(L, total / L)
    if mode == "paper":
        return adjust_budgets(x, total, H * avail)
    return largest_remainder(x, total, cap=H * avail, weights=n)


def score_heads(scores, bl, hd):
    """One batch row of one layer: scores [H, M], total bl, KV-head hd [H] -> [H]."""
    H, M = scores.shape
    kept = select_row(np.asarray(scores, np.float32).reshape(-1), int(bl))
    return score_head_shares(np.bincount(kept // M, minlength=H), bl, hd, M)


def score_head_shares(t, bl, hd, M):
    """Eq. 12 from the heads' counts T [H] in the layer's global top-bl: B_l·HD_h·T_h / Σ HD·T (T when the sum
    is 0), rounded to a total of min(bl, H·M) with every head capped at M -> [H]."""
    t = np.asarray(t, np.float64)
    w = np.asarray(hd, np.float64) * t
    x = bl * w / w.sum() if w.sum() > 0 else t
    return largest_remainder(x, int(bl), cap=M, weights=w)


def score(rows, layer_scores, b, avail, gamma=0.5, mode="exact"):
    """rows [L, B, Hq, K, n]; layer_scores [L, B, H, avail] -> (budgets [L, B, H], hd [L, B, H])."""
    L, B, H, M = layer_scores.shape
    out = np.zeros((L, B, H), dtype=np.int64)
    hds = np.zeros((L, B, H))
    for r in range(B):
        ir, td, hdq = score_stats(rows[:, r], gamma)
        hd = hdq.reshape(L, H, -1).mean(-1)
        hds[:, r] = hd
        if b >= avail or b <= 0:
            out[:, r] = max(min(b, avail), 0)
            continue
        lb = score_layers(ir, td, b, H, avail, mode=mode)
        for l in range(L):
            out[l, r] = score_heads(layer_scores[l, r], lb[l], hd[l])
    return out, hds


# -- CAKE ------------------------------------------------------------------------------------------
def cake_preference(attn, tau1=1.0, tau2=1.0):
    """attn [H, W, n] of one batch row -> P."""
    a = np.asarray(attn, np.float64)
    ent = -(a * np.log(a + 1e-10)).sum()
    var = a.var(axis=1).sum()
    return max(ent, 0.0) ** (1 / tau1) * var ** (1 / tau2)


def cake(pref, b, avail, mode="exact"):
    """pref [L] -> per-head budget of each layer [L]."""
    p = np.maximum(np.asarray(pref, np.float64), 0)
    L = len(p)
    if b >= avail or b <= 0:
        return np.full(L, max(min(b, avail), 0))
    total = L * b
    x = total * p / p.sum() if p.sum() > 0 else np.full(L, float(b))
    if mode == "paper":
        return adjust_budgets(x, total, avail)
    return largest_remainder(x, total, cap=avail, weights=p)
