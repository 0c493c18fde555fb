"""One plain PyTorch pipeline per policy: the same policy's scores written directly in torch, ``torch.topk`` of the
kept count, a sort of the kept indices and a gather of K/V, with the tritonkv defaults and protected tokens. Every
benchmark that compares tritonkv with plain PyTorch uses these (``cpu_speed.py`` eager on the CPU, ``speed.py``
under ``torch.compile`` on a GPU); the settings and tie rules: docs/benchmarks.md ("The plain PyTorch pipelines").
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

INF = float("inf")
W = 32  # the window policies' query window


def gather(keys, values, idx):
    """Kept K/V at ``idx`` [B, H, k] (ascending), and ``idx``."""
    g = idx[..., None].expand(-1, -1, -1, keys.shape[-1])
    return keys.gather(2, g), values.gather(2, g), idx


def topk_sorted(s, k):
    return s.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values


def window_scores(keys, queries, w, *, kernel_size=1, rows="mean"):
    """Softmax of the last ``w`` queries over the keys (causal inside the window), reduced over the window rows
    (mean or sum) and the query group (mean), max-pooled over the prefix."""
    b, h, n, d = keys.shape
    q = queries[:, :, -w:].float()
    g = q.shape[1] // h
    logits = q.reshape(b, h, g * w, d) @ keys.float().transpose(-1, -2) / math.sqrt(d)
    dev = keys.device
    causal = torch.arange(n, device=dev) > (n - w + torch.arange(w, device=dev)).repeat(g)[:, None]
    p = logits.masked_fill(causal, -INF).softmax(-1).view(b, h, g, w, n)
    u = (p.sum(3) if rows == "sum" else p.mean(3)).mean(2)
    if kernel_size > 1:
        pooled = F.max_pool1d(u[..., :n - w], kernel_size, 1, kernel_size // 2)[..., :n - w]
        u = torch.cat([pooled, u[..., n - w:]], dim=-1)
    return u


def protect_window(s, w):
    s[..., s.shape[-1] - w:] = INF
    return s


def value_norms(values, o_proj, block=1 << 24):
    """Mean over the group of ‖W_O^q v_j‖₁, in token chunks (a [B, H, G, n, D_model] block of ≤ 64 MiB)."""
    b, h, n, d = values.shape
    dm = o_proj.shape[0]
    g = o_proj.shape[1] // (h * d)
    w = o_proj.float().view(dm, h, g, d).permute(1, 2, 3, 0)
    step = max(1, block // (b * h * g * dm))
    return torch.cat([(values[:, :, None, t:t + step].float() @ w).abs().sum(-1).mean(2) for t in range(0, n, step)],
                     -1)


def lagkv_indices(keys, values, k, sink=16, lag=128):
    """LagKV budget mode: per scored partition the top ⌊b/(P−1)⌋ (one more in the first b mod (P−1)) by
    φ_K + φ_V against the next partition, plus the sinks and the tail."""
    b_, h, n, d = keys.shape
    dev = keys.device
    p = (n - sink) // lag
    tail = n - sink - (p - 1) * lag

    def phi(t):
        z = t[:, :, sink:sink + p * lag].float().reshape(b_, h, p, lag, d)
        lo, hi = z[:, :, 1:].amin(3, keepdim=True), z[:, :, 1:].amax(3, keepdim=True)
        return ((z[:, :, :-1] - lo) / (hi - lo).clamp_min(1e-6)).std(-1).softmax(-1)

    q, rem = divmod(k - sink - tail, p - 1)
    ar = lambda *a: torch.arange(*a, device=dev)  # noqa: E731
    top = (phi(keys) + phi(values)).topk(q + 1, dim=-1).indices + sink + lag * ar(p - 1)[:, None]
    take = (ar(q + 1) < q) | (ar(p - 1)[:, None] < rem)  # [P−1, q+1], the same for every row
    return torch.cat([ar(sink).expand(b_, h, sink), top[:, :, take], ar(n - tail, n).expand(b_, h, tail)],
                     -1).sort(-1).values


def pipeline(name, keys, values, k, inputs):
    """The plain PyTorch pipeline of policy ``name`` keeping ``k`` tokens per head, with ``inputs`` (``queries``,
    ``o_proj``, ``hd`` as ``compress`` takes them): a zero-argument function returning (K, V, indices)."""
    b, h, n, _ = keys.shape
    q = inputs.get("queries")
    if name == "knorm":
        return lambda: gather(keys, values, topk_sorted(-keys.float().norm(dim=-1), k))
    if name == "keydiff":
        def run():
            kf = keys.float()
            a = F.normalize(kf, dim=-1).mean(2, keepdim=True)
            return gather(keys, values, topk_sorted(-F.cosine_similarity(kf, a, dim=-1), k))
        return run
    if name == "streaming_llm":
        ar = lambda *a: torch.arange(*a, device=keys.device)  # noqa: E731
        idx = torch.cat([ar(4), ar(n - (k - 4), n)]).expand(b, h, k)
        return lambda: gather(keys, values, idx)
    if name == "lagkv":
        return lambda: gather(keys, values, lagkv_indices(keys, values, k))
    if name in ("snapkv", "surfacelogic", "h2o", "tova"):
        w = 1 if name == "tova" else W
        opts = dict(kernel_size=7 if name == "snapkv" else 1, rows="sum" if name == "h2o" else "mean")
        return lambda: gather(keys, values, topk_sorted(protect_window(window_scores(keys, q, w, **opts), w), k))
    if name == "criticalkv":  # stage 1: top ⌊α·b⌋ by SnapKV scores; stage 2: the rest by (s + ε)·‖v W_O‖₁
        def run():
            s = window_scores(keys, q, W, kernel_size=7)
            first = s[..., :n - W].topk(math.floor(0.5 * (k - W) + 1e-6), dim=-1).indices
            s2 = protect_window((s + 1e-4) * value_norms(values, inputs["o_proj"]), W).scatter(-1, first, INF)
            return gather(keys, values, topk_sorted(s2, k))
        return run
    if name == "score":  # parallel: penalise tokens the other heads' unpenalised top-b also pick
        def run():
            s = window_scores(keys, q, W)[..., :n - W]
            u = torch.zeros_like(s).scatter(-1, s.topk(k - W, dim=-1).indices, 1.0)
            pen = s * torch.exp(-(0.004 / inputs["hd"])[:, None] * (u.sum(1, keepdim=True) - u))
            sel = pen.topk(k - W, dim=-1, sorted=False).indices
            window = torch.arange(n - W, n, device=keys.device).expand(b, h, W)
            return gather(keys, values, torch.cat([sel, window], -1).sort(-1).values)
        return run
    raise KeyError(f"no plain pipeline for policy {name!r}")
