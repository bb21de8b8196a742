"""What the prior puts into the extra q/k channels (query side: relative features times the
optional gate, and the sink coefficient; key side: Fourier features and ``u(j)``), and the same
prior materialized as a dense ``[B, N, T, S]`` log-prior (plots, the 'dense' reference
implementation, tests).

``kappa`` and ``sink`` are called through their modules (``fourier.kappa``,
``sink_term.sink``) so that an intervention that replaces one of them
(experiments/probe_extrapolation.py) reaches every caller.

Shape legend: B batch, T queries, S keys, N query heads, K key/value heads, R relative rank.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from goat_jax.prior import fourier, sink_term
from goat_jax.prior.positions import Positions, real_dtype
from goat_jax.prior.settings import PriorSpec

Array = jax.Array
Params = Mapping[str, Any]


def _per_query_head(x: Array, spec: PriorSpec) -> Array:
    """[K, ...] per-KV-head parameter -> [N, ...], each KV head repeated over its group."""
    return jnp.repeat(x, spec.group_size, axis=0)


def relative_frequencies(spec: PriorSpec, params: Params) -> Array:
    """The relative prior's frequencies: the fixed ladder [R] (``fourier.frequencies``, float64
    NumPy), or the learned ``pos_freqs`` [K, R] (per KV head, float32) when
    ``spec.learn_frequencies``."""
    if spec.learn_frequencies and spec.pos_rank:
        return params["pos_freqs"].astype(real_dtype())
    return fourier.frequencies(spec.pos_rank, spec.pos_base)


def query_gate(spec: PriorSpec, params: Params, q_content: Optional[Array]) -> Optional[Array]:
    """The ``query_norm`` prior gate ``g = sigmoid(b_h - softplus(s_h) * ||q_c||)``.

    Args:
      q_content: [B, T, N, d_c] raw (unscaled) query content dims.
    Returns:
      None when ``prior_gate == 'none'``, else [B, T, N] float32.
    """
    if spec.prior_gate == "none":
        return None
    if q_content is None:
        raise ValueError("prior_gate='query_norm' needs the query content (q_content).")
    norm = jnp.sqrt(jnp.sum(jnp.square(q_content.astype(real_dtype())), axis=-1))
    scale = jax.nn.softplus(params["prior_gate_scale_raw"].astype(real_dtype()))
    return jax.nn.sigmoid(params["prior_gate_bias"].astype(real_dtype()) - scale * norm)


def relative_to(pos: Positions, origin: Optional[Array]) -> Positions:
    """``pos`` as the relative prior's features may see it: 1D coordinates minus ``origin``
    ([..., 1], e.g. the window's first key position), or ``pos`` itself when ``origin`` is None.

    The relative prior depends on ``p_i - p_j`` only, so the same integer shift of queries and
    keys leaves it as it is (the shifted positions are integers too: the phases stay exact).
    What it changes is the learned frequencies' gradient: ``p_i dw`` and ``p_j dw`` (each large
    far out) cancel to ``(p_i - p_j) dw`` in float32, which lost 3e-3 of it at 1M and 2e-2 at
    16.8M; relative to the window they are small and cancel exactly. The sink, which reads
    absolute positions, never takes a shifted ``pos``."""
    if origin is None or pos.is_2d:
        return pos
    return pos._replace(coords=pos.coords - origin)


def query_features(
    spec: PriorSpec, params: Params, q_pos: Positions, gate: Optional[Array] = None,
    origin: Optional[Array] = None,
) -> Tuple[Array, Array]:
    """Query-side prior channels; ``origin`` (None or [..., 1]): see :func:`relative_to`.

    Returns:
      q_rel: [..., T, N, 2R] = ``[A cos(w p_i) + B sin(w p_i), A sin(w p_i) - B cos(w p_i)]``
        (times the gate, if any), float32.
      q_sink: [..., T, N] coefficient of the sink channel: 1, or the gate. float32.
      The leading dims are those of ``q_pos`` broadcast with the gate's [B, T].
    """
    r = spec.pos_rank
    q_pos = relative_to(q_pos, origin)
    freqs = relative_frequencies(spec, params)
    if np.ndim(freqs) == 2:  # learned, per KV head: each query head reads its KV head's frequencies
        feats = fourier.fourier_features(q_pos, _per_query_head(freqs, spec))  # [..., T, N, 2R]
        cos, sin = feats[..., :r], feats[..., r:]  # [..., T, N, R]
    else:
        feats = fourier.fourier_features(q_pos, freqs)  # [..., T, 2R]
        cos, sin = feats[..., None, :r], feats[..., None, r:]  # [..., T, 1, R]
    a = _per_query_head(params["lambda_sym"], spec).astype(real_dtype()) if r else None
    b = _per_query_head(params["lambda_asym"], spec).astype(real_dtype()) if r else None
    if r:
        q_rel = jnp.concatenate([a * cos + b * sin, a * sin - b * cos], axis=-1)  # [..., T, N, 2R]
    else:
        q_rel = jnp.zeros(cos.shape[:-2] + (spec.num_heads, 0), real_dtype())
    q_sink = jnp.ones(q_rel.shape[:-1], real_dtype())
    if gate is not None:
        q_rel = q_rel * gate[..., None]
        q_sink = q_sink * gate
    return q_rel, q_sink


def key_features(spec: PriorSpec, params: Params, k_pos: Positions, is_causal: bool,
                 origin: Optional[Array] = None) -> Tuple[Array, Array]:
    """Key-side prior channels: ``k_rel`` [..., S, 2R] (``[cos(w p_j), sin(w p_j)]``; [..., S,
    K, 2R] with learned per-head frequencies) and ``u`` [..., S, K] (see
    :func:`goat_jax.prior.sink_term.sink`), float32. ``origin``: the queries' (see
    :func:`relative_to`); ``u`` reads the absolute positions either way."""
    k_rel = fourier.fourier_features(relative_to(k_pos, origin), relative_frequencies(spec, params))
    return k_rel, sink_term.sink(spec, params, k_pos, is_causal)



def log_prior(
    spec: PriorSpec,
    params: Params,
    q_pos: Positions,
    k_pos: Positions,
    *,
    is_causal: bool,
    gate: Optional[Array] = None,
) -> Array:
    """The materialized log-prior ``kappa_h(p_i - p_j) + u_h(j)`` (gated if a gate is given).

    kappa is evaluated from position *differences* (not through the packed features), so this
    is an independent check of the packing. No causal mask is applied here.

    Args:
      q_pos, k_pos: query and key positions (both 1D or both 2D); leading dims [B] optional.
      gate: None or [B, T, N] from :func:`query_gate`.
    Returns:
      [B or 1, N, T, S] float32.
    """
    r = spec.pos_rank
    freqs = relative_frequencies(spec, params)
    if np.ndim(freqs) == 2:
        freqs = _per_query_head(freqs, spec)  # [N, R]
    a = _per_query_head(params["lambda_sym"], spec).astype(real_dtype()) if r else None
    b = _per_query_head(params["lambda_asym"], spec).astype(real_dtype()) if r else None
    qc, kc = q_pos.coords, k_pos.coords
    if qc.ndim == (2 if q_pos.is_2d else 1):
        qc = qc[None]
    if kc.ndim == (2 if k_pos.is_2d else 1):
        kc = kc[None]
    if r == 0:
        rel = jnp.zeros((1, spec.num_heads, qc.shape[1], kc.shape[1]), real_dtype())
    elif not q_pos.is_2d:
        delta = qc[:, :, None] - kc[:, None, :]  # [B, T, S]
        rel = jnp.moveaxis(fourier.kappa(delta, a, b, freqs), 0, 1)  # [B, N, T, S]
    else:
        r_row = r - r // 2
        d_row = qc[:, :, None, 0] - kc[:, None, :, 0]
        d_col = qc[:, :, None, 1] - kc[:, None, :, 1]
        rel = fourier.kappa(d_row, a[:, :r_row], b[:, :r_row], freqs[..., :r_row]) + fourier.kappa(
            d_col, a[:, r_row:], b[:, r_row:], freqs[..., r_row:]
        )
        rel = jnp.moveaxis(rel, 0, 1)  # [B, N, T, S]
        cls_q = q_pos.is_cls if q_pos.is_cls is not None else jnp.zeros(qc.shape[1], bool)
        cls_k = k_pos.is_cls if k_pos.is_cls is not None else jnp.zeros(kc.shape[1], bool)
        keep = ~(cls_q[..., :, None] | cls_k[..., None, :])  # CLS has zero relative features
        rel = jnp.where(keep, rel, 0.0)
    if gate is not None:
        rel = rel * jnp.moveaxis(gate, -1, -2)[..., None]  # gate [B, T, N] -> [B, N, T, 1]
    u = sink_term.sink(spec, params, k_pos, is_causal)  # [..., S, K]
    if u.shape[-1]:
        u = _per_query_head(jnp.moveaxis(u, -1, 0), spec)  # [N, ..., S]
        u = jnp.moveaxis(u, 0, -2) if u.ndim == 3 else u[None]  # [B or 1, N, S]
        u = u[..., None, :]  # [B, N, 1, S]
        if gate is not None:
            u = u * jnp.moveaxis(gate, -1, -2)[..., None]
        rel = rel + u
    return rel
