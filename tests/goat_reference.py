"""An independent float64 NumPy reference of GOAT attention, written from the paper's formula.

It never touches goat_jax.prior or the packing: the relative prior is evaluated as
``sum_r A cos(w_r (p_i - p_j)) + B sin(w_r (p_i - p_j))`` on position differences, the sink
MLP is written out, and attention is a dense softmax over materialized logits.
"""

from __future__ import annotations

import numpy as np


def _f64(tree):
    if isinstance(tree, dict):
        return {k: _f64(v) for k, v in tree.items()}
    return np.asarray(getattr(tree, "value", tree), np.float64)


def unboxed(params) -> dict:
    """``{'params': ...}`` from Flax (possibly LogicallyPartitioned) -> float64 numpy tree."""
    import flax

    p = flax.core.meta.unbox(params)
    return _f64(p.get("params", p))


def _softplus(x):
    return np.logaddexp(0.0, x)


def _freqs(rank, base):
    return base ** (-np.arange(rank, dtype=np.float64) / max(rank - 1, 1))


def _positions(length, offset, grid, has_cls):
    """Returns (index t [L], coords [L] or [L, 2], is_cls [L])."""
    if grid is None:
        pos = np.arange(length, dtype=np.float64) + offset
        return pos, pos, np.zeros(length, bool)
    h, w = grid
    tokens = [(0.0, 0.0, True)] if has_cls else []
    tokens += [(r + offset[0], c + offset[1], False) for r in range(h) for c in range(w)]
    coords = np.array([[a, b] for a, b, _ in tokens], np.float64)
    return np.arange(length, dtype=np.float64), coords, np.array([c for _, _, c in tokens])


def relative_prior(p, cfg, q_coords, k_coords, q_cls, k_cls, grid):
    """kappa_h(p_i - p_j) [N, T, S] from position differences. The frequencies are the fixed
    ladder, or ``p['pos_freqs']`` [K, R] (learned, per KV head) when the params have them."""
    g, r = cfg["num_heads"] // cfg["kv_num_heads"], cfg["pos_rank"]
    a = np.repeat(p["lambda_sym"], g, axis=0)  # [N, R]
    b = np.repeat(p["lambda_asym"], g, axis=0)
    if "pos_freqs" in p:
        w = np.repeat(p["pos_freqs"], g, axis=0)  # [N, R]
    else:
        w = np.broadcast_to(_freqs(r, cfg.get("pos_base", 1e4)), a.shape)

    def kappa(d, sl):  # d [T, S] -> [N, T, S]
        ph = d[None, :, :, None] * w[:, None, None, sl]  # [N, T, S, R']
        return (np.cos(ph) * a[:, None, None, sl]).sum(-1) + (np.sin(ph) * b[:, None, None, sl]).sum(-1)

    if grid is None:
        return kappa(q_coords[:, None] - k_coords[None, :], slice(0, r))
    r_row = r - r // 2
    out = 0.0
    for axis, sl in ((0, slice(0, r_row)), (1, slice(r_row, r))):
        out = out + kappa(q_coords[:, None, axis] - k_coords[None, :, axis], sl)
    keep = ~(q_cls[:, None] | k_cls[None, :])
    return out * keep


def sink_prior(p, cfg, k_index, k_coords, k_cls, grid, is_causal):
    """u_h(j) [K, S]."""
    m = cfg["abs_rank"]
    wa = _freqs(m, cfg.get("abs_base", 1e4))
    s = k_index.shape[0]
    if grid is None:
        ph = k_index[:, None] * wa
    else:
        m_row = m - m // 2
        ph = np.concatenate([k_coords[:, :1] * wa[:m_row], k_coords[:, 1:] * wa[m_row:]], axis=1)
    feats = np.concatenate([np.cos(ph), np.sin(ph)], axis=1) * ~k_cls[:, None]
    ln = cfg.get("training_seq_len") or max(s - 1, 1)
    kb = p["key_bias"]

    def mlp_at(t, feats):
        x = np.concatenate([feats, t[:, None] / ln, np.log1p(t)[:, None] / np.log1p(ln)], axis=1)
        hdn = x @ kb["fc1"]["kernel"] + kb["fc1"]["bias"]
        hdn = hdn / (1.0 + np.exp(-hdn))  # SiLU
        return (hdn @ kb["fc2"]["kernel"] + kb["fc2"]["bias"])[:, 0]  # [len(t)]

    mlp = mlp_at(k_index, feats)  # [S]
    if cfg.get("sink_extrapolation", "official") == "linear":
        # Past the last training key e = L - 1 the MLP output follows the straight line through
        # its values at e - L // 2 and e (1D positions only).
        assert grid is None
        e, h = ln - 1, ln // 2
        anchors = np.array([e - h, e], np.float64)
        m_mid, m_end = mlp_at(anchors, np.concatenate([np.cos(anchors[:, None] * wa), np.sin(anchors[:, None] * wa)], axis=1))
        line = m_end + (m_end - m_mid) / h * (k_index - e)
        mlp = np.where(k_index > e, line, mlp)
    u = p["sink_gain"][:, None] * mlp[None] + p["sink_bump"][:, None] * (k_index == 0)[None]
    if is_causal:
        u = u + _softplus(p["recency_slope_raw"])[:, None] * k_index[None]
    return u


def goat_attention(params, cfg, xq, xk, xv, *, is_causal=False, key_padding_mask=None,
                   offset_q=0, offset_k=0, grid=None, has_cls=False, return_logits=False,
                   logn=None, logn_mode="content"):
    """Reference GoatAttention forward. ``cfg``: num_heads, kv_num_heads, head_dim, pos_rank,
    abs_rank, [pos_base, abs_base, training_seq_len, prior_gate, enable_key_bias,
    sink_extrapolation]. ``logn``: None or per-query factors [T] multiplying the content logits
    (``logn_mode='content'``) or content plus prior (``'all'``) row by row."""
    p = unboxed(params)
    xq, xk, xv = (np.asarray(x, np.float64) for x in (xq, xk, xv))
    n, kv, h = cfg["num_heads"], cfg["kv_num_heads"], cfg["head_dim"]
    g = n // kv
    key_bias = cfg.get("enable_key_bias", True)
    # Content dims: the official layout's, or given (qk_layout='lane_aligned' carves more).
    d_c = cfg.get("content_dims", h - 2 * cfg["pos_rank"] - int(key_bias))

    def proj(name, x):
        y = np.einsum("bte,enh->btnh", x, p[name]["kernel"])
        return y + p[name]["bias"] if "bias" in p[name] else y

    q, k, v = proj("q_proj", xq), proj("k_proj", xk), proj("v_proj", xv)
    k = np.repeat(k, g, axis=2)
    v = np.repeat(v, g, axis=2)
    t, s = q.shape[1], k.shape[1]
    logits = np.einsum("btnh,bsnh->bnts", q[..., :d_c], k[..., :d_c]) / np.sqrt(d_c)

    qi, qc, qcls = _positions(t, offset_q, grid, has_cls)
    ki, kc, kcls = _positions(s, offset_k, grid, has_cls)
    prior = relative_prior(p["prior"], cfg, qc, kc, qcls, kcls, grid)[None]  # [1, N, T, S]
    if key_bias:
        u = sink_prior(p["prior"], cfg, ki, kc, kcls, grid, is_causal)  # [K, S]
        prior = prior + np.repeat(u, g, axis=0)[None, :, None, :]
    if cfg.get("prior_gate", "none") == "query_norm":
        norm = np.linalg.norm(q[..., :d_c], axis=-1)  # [B, T, N]
        gate = 1.0 / (1.0 + np.exp(-(p["prior"]["prior_gate_bias"] - _softplus(p["prior"]["prior_gate_scale_raw"]) * norm)))
        prior = prior * np.moveaxis(gate, -1, 1)[..., None]
    if logn is not None:
        row = np.asarray(logn, np.float64)[:, None]  # [T, 1]
        logits = logits * row
        prior = prior * row if logn_mode == "all" else prior
    logits = logits + prior

    mask = np.ones((1, 1, t, s), bool)
    if is_causal:
        off = 0 if grid is not None else offset_q - offset_k
        mask = mask & (np.arange(s)[None, :] <= np.arange(t)[:, None] + off)
    if key_padding_mask is not None:
        mask = mask & ~np.asarray(key_padding_mask, bool)[:, None, None, :]
    logits = np.where(mask, logits, -np.inf)
    if return_logits:
        return logits
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True)
    o = np.einsum("bnts,bsnh->btnh", w, v)
    out = np.einsum("btnh,nhe->bte", o, p["out_proj"]["kernel"])
    return out + p["out_proj"]["bias"] if "bias" in p["out_proj"] else out


def goat_module(**fields):
    """A ``GoatAttention`` from flat keyword fields, as the official constructor takes them: the
    :class:`goat_jax.prior.PriorSettings` names go into its ``prior``, the rest are module fields."""
    from goat_jax.layers.goat import GoatAttention
    from goat_jax.prior import PriorSettings

    names = set(PriorSettings.names())
    prior = PriorSettings(**{k: v for k, v in fields.items() if k in names})
    return GoatAttention(prior=prior, **{k: v for k, v in fields.items() if k not in names})


def attention_and_grads(q, k, v, cotangent, *, scale=1.0, is_causal=False, causal_offset=0,
                        key_padding_mask=None, kv_lengths=None, q_segment_ids=None,
                        kv_segment_ids=None):
    """Plain attention and its gradients, float64, written out by hand (no autodiff).

    q [B, T, N, Hqk], k [B, S, K, Hqk], v [B, S, K, Hv] (N % K == 0), ``cotangent`` [B, T, N, Hv]
    = d loss / d out. Masking contract of ``goat_jax.kernels`` (segment ids: a query sees only
    keys of an equal id); a row with no visible key outputs zeros and passes zero gradient.
    Returns (out, dq, dk, dv).
    """
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, cotangent))
    b, t, n, _ = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = n // kh
    kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # [B, S, N, H]
    visible = np.ones((b, 1, t, s), bool)
    if is_causal:
        visible = visible & (np.arange(s)[None, :] <= np.arange(t)[:, None] + causal_offset)
    if key_padding_mask is not None:
        visible = visible & ~np.asarray(key_padding_mask, bool)[:, None, None, :]
    if kv_lengths is not None:
        visible = visible & (np.arange(s)[None, :] < np.asarray(kv_lengths)[:, None])[:, None, None, :]
    if q_segment_ids is not None:
        qs, ks = np.asarray(q_segment_ids), np.asarray(kv_segment_ids)
        visible = visible & (qs[:, :, None] == ks[:, None, :])[:, None]
    logits = np.einsum("btnh,bsnh->bnts", q, kr) * scale
    logits = np.where(visible, logits, -np.inf)
    row_max = logits.max(-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    w = np.exp(logits - row_max)
    total = w.sum(-1, keepdims=True)
    p = np.where(total > 0, w / np.where(total > 0, total, 1.0), 0.0)  # [B, N, T, S]
    out = np.einsum("bnts,bsnh->btnh", p, vr)
    # Backward of out = P V, P = softmax(scale * Q K^T): dP = dO V^T, dS = P (dP - rowsum(dP P)).
    dp = np.einsum("btnh,bsnh->bnts", do, vr)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * scale
    dq = np.einsum("bnts,bsnh->btnh", ds, kr)
    dk = np.einsum("bnts,btnh->bsnh", ds, q).reshape(b, s, kh, g, -1).sum(3)
    dv = np.einsum("bnts,btnh->bsnh", p, do).reshape(b, s, kh, g, -1).sum(3)
    return out, dq, dk, dv
