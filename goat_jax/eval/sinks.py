"""Attention sinks and what a GOAT prior learned, read from an LM's parameters.

Two views, comparable across position encodings:

* Attention statistics on real inputs (:func:`sink_statistics`): the attention mass each
  head puts on position 0, and the norm of the first token's key against the others'. A
  softmax head with nothing to attend to must park its mass somewhere; RoPE models do it by
  inflating the first key's norm (a "sink" token), while GOAT can use its key-only prior
  ``u(j)`` (paper section 5, Theorem 5.1: with a weak content signal the posterior collapses
  to the prior) and leave key norms alone.
* The GOAT prior itself (:func:`prior_components`): ``u(j)``, ``kappa(lag)``, the dense
  causal log-prior and its softmax, per layer and head; :func:`summarize_prior` says in words
  what it learned and :func:`has_sink_at_zero` / :func:`has_diagonal_at_lag` are the checks
  the toy copy-mixture test uses.

The attention probabilities are read from the model itself: run with the 'dense' kernel and a
mutable 'intermediates' collection, every attention layer sows the softmax it applied, its
content keys and values (``goat_jax.layers.core.run``), so a new position encoding
needs no code here. Dense means O(T^2) memory per layer: use moderate lengths.

Shape legend: Y layers, B batch, T queries, S keys (= T), N query heads, K kv heads, H head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from goat_jax import prior as prior_lib

Params = Any


# ----------------------------------------------------------------------------------------------
# Parameters of one layer
# ----------------------------------------------------------------------------------------------


def layer_params(model, params: Params, layer: int) -> dict:
    """The (unboxed) params of decoder block ``layer`` of a ``TransformerLM``, whether its
    layers are separate (``layer_i``) or stacked under ``nn.scan`` (``layers``, axis 0)."""
    params = nn.unbox(params.get("params", params))
    cfg = model.config
    if not 0 <= layer < cfg.num_layers:
        raise ValueError(f"layer={layer} is out of range for num_layers={cfg.num_layers}.")
    if "layers" in params:
        return jax.tree_util.tree_map(lambda x: x[layer], params["layers"])
    return params[f"layer_{layer}"]


def _unscanned(model, params: Params):
    """(model, params) with separate layers and no remat, for ``capture_intermediates``."""
    params = nn.unbox(params.get("params", params))
    cfg = model.config
    if "layers" in params:
        params = dict(params)
        stacked = params.pop("layers")
        for i in range(cfg.num_layers):
            params[f"layer_{i}"] = jax.tree_util.tree_map(lambda x, i=i: x[i], stacked)
    # Dense kernel: the only one that materializes the probabilities the layers sow.
    cfg = dataclasses.replace(cfg, scan_layers=False, remat=False)
    return model.clone(config=cfg, decode=False, plan=model.plan.replace(implementation="dense")), params


def prior_spec(model) -> prior_lib.PriorSpec:
    """The :class:`PriorSpec` of a GOAT ``TransformerLM`` (``LMConfig.prior`` with its heads)."""
    cfg = model.config
    if cfg.position_encoding != "goat":
        raise ValueError(f"position_encoding={cfg.position_encoding!r} has no GOAT prior.")
    return cfg.prior.for_heads(cfg.num_heads, cfg.kv_heads)


# ----------------------------------------------------------------------------------------------
# The GOAT prior of one layer
# ----------------------------------------------------------------------------------------------


def prior_components(model, params: Params, layer: int, seq_len: int) -> dict[str, np.ndarray]:
    """The learned causal prior of ``layer`` at positions ``0..seq_len-1``, per query head.

    The query-norm gate (if any) is left out: it depends on the content, and at its init it
    is ~1.

    Returns (numpy float32):
      ``u`` [N, S]: the key-only sink ``u(j)`` (including the causal recency slope);
      ``kappa`` [N, S]: the relative prior at lags ``0..S-1``;
      ``log_prior`` [N, T, S]: ``kappa(i - j) + u(j)``, ``-inf`` above the diagonal;
      ``probs`` [N, T, S]: its row softmax (the attention of a head with no content signal).
    """
    out = _prior_components(prior_spec(model), layer_params(model, params, layer)["attention"]["prior"],
                            seq_len)
    return {k: np.asarray(v, np.float32) for k, v in out.items()}


@functools.partial(jax.jit, static_argnums=(0, 2))
def _prior_components(spec: prior_lib.PriorSpec, p, seq_len: int):
    pos = prior_lib.positions_1d(seq_len)
    lp = prior_lib.log_prior(spec, p, pos, pos, is_causal=True)[0]  # [N, T, S]
    causal = jnp.tril(jnp.ones((seq_len, seq_len), bool))
    lp = jnp.where(causal, lp, -jnp.inf)
    if spec.enable_key_bias:
        u = jnp.repeat(prior_lib.sink(spec, p, pos, True).T, spec.group_size, axis=0)  # [N, S]
    else:
        u = jnp.zeros((spec.num_heads, seq_len))
    lags = jnp.arange(seq_len, dtype=jnp.float32)
    if spec.pos_rank:
        kap = prior_lib.kappa(lags, p["lambda_sym"], p["lambda_asym"],
                              prior_lib.relative_frequencies(spec, p))  # [K, S]; learned ones if any
        kap = jnp.repeat(kap, spec.group_size, axis=0)
    else:
        kap = jnp.zeros((spec.num_heads, seq_len))
    return {"u": u, "kappa": kap, "log_prior": lp, "probs": jax.nn.softmax(lp, axis=-1)}


def log_priors(model, params: Params, seq_len: int) -> np.ndarray:
    """Causal log-priors of every layer, [Y, N, T, S] (``-inf`` above the diagonal)."""
    return np.stack([prior_components(model, params, i, seq_len)["log_prior"]
                     for i in range(model.config.num_layers)])


# ----------------------------------------------------------------------------------------------
# Reading a causal score matrix: sink and diagonal
# ----------------------------------------------------------------------------------------------
# These take any causal [..., T, S] log-score (a GOAT log-prior, or log attention probabilities
# of any model) and compare each row against its median over the visible keys 0 < j <= i: the
# median ignores the few positions a head singles out, so a sink or a diagonal stands out.


def _row_medians(scores: np.ndarray) -> np.ndarray:
    """[..., T, S] -> [..., T]: median over 0 < j <= i of each row (NaN for row 0)."""
    t = scores.shape[-2]
    visible = np.tril(np.ones((t, t), bool)) & (np.arange(t)[None, :] > 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # row 0 has no j > 0: an all-NaN row
        return np.nanmedian(np.where(visible, scores[..., :t], np.nan), axis=-1)


def sink_margin(scores: np.ndarray, min_query: int = 4) -> np.ndarray:
    """How far position 0 stands above the rest: mean over rows ``i >= min_query`` of
    ``scores[i, 0] - median_{0 < j <= i} scores[i, j]`` (nats for log-scores). [..., T, S] -> [...]."""
    scores = np.asarray(scores, np.float64)
    t = scores.shape[-2]
    if not 1 <= min_query < t:
        raise ValueError(f"min_query={min_query} must be in [1, T={t}).")
    med = _row_medians(scores)
    return (scores[..., min_query:, 0] - med[..., min_query:]).mean(axis=-1)


def lag_profile(scores: np.ndarray, max_lag: int = 8) -> np.ndarray:
    """Mean over rows of ``scores[i, i - lag] - median_{0 < j <= i} scores[i, j]`` for lags
    ``0..max_lag``, over rows ``i > max_lag`` (so ``i - lag > 0`` never hits the sink).
    [..., T, S] -> [..., max_lag + 1]."""
    scores = np.asarray(scores, np.float64)
    t = scores.shape[-2]
    if not 0 <= max_lag < t - 2:
        raise ValueError(f"max_lag={max_lag} must be in [0, T - 2 = {t - 2}).")
    rows = np.arange(max_lag + 1, t)
    med = _row_medians(scores)[..., rows]  # [..., R]
    return np.stack([(scores[..., rows, rows - lag] - med).mean(axis=-1)
                     for lag in range(max_lag + 1)], axis=-1)


def has_sink_at_zero(scores: np.ndarray, margin: float = 1.0, min_query: int = 4) -> bool:
    """True iff some head's position 0 stands ``margin`` (nats) above its row medians
    (:func:`sink_margin`). ``scores``: [..., T, S], e.g. :func:`log_priors` [Y, N, T, S]."""
    return bool(np.any(sink_margin(scores, min_query) >= margin))


def has_diagonal_at_lag(scores: np.ndarray, lag: int = 1, margin: float = 1.0,
                        max_lag: int = 8) -> bool:
    """True iff some head's :func:`lag_profile` peaks exactly at ``lag`` (among lags
    ``0..max_lag``) and stands ``margin`` (nats) above the row medians there."""
    if not 0 <= lag <= max_lag:
        raise ValueError(f"lag={lag} must be in [0, max_lag={max_lag}].")
    prof = lag_profile(scores, max_lag).reshape(-1, max_lag + 1)
    return bool(np.any((prof.argmax(axis=-1) == lag) & (prof[:, lag] >= margin)))


def summarize_prior(model, params: Params, seq_len: int = 64, min_query: int = 4,
                    max_lag: int = 8) -> str:
    """What the GOAT prior learned, one line per layer/head, e.g.::

        layer 0 head 1: sink +4.21 nats over the row median (u(0) - mean u(j>0) = +3.90);
          relative prior peaks at lag 1 with +2.87 nats over its median (kappa alone: lag 1)

    "Over the median" compares ``kappa(i - j) + u(j)`` with the median of its row over the
    visible keys ``0 < j <= i`` (:func:`sink_margin`, :func:`lag_profile`), i.e. what the
    softmax sees; the u and kappa numbers are the components alone.
    """
    lines = []
    for layer in range(model.config.num_layers):
        comp = prior_components(model, params, layer, seq_len)
        sink = sink_margin(comp["log_prior"], min_query)  # [N]
        prof = lag_profile(comp["log_prior"], max_lag)  # [N, max_lag + 1]
        for h in range(comp["u"].shape[0]):
            u = comp["u"][h]
            peak = int(prof[h].argmax())
            kappa_peak = int(comp["kappa"][h, :max_lag + 1].argmax())
            lines.append(
                f"layer {layer} head {h}: sink {sink[h]:+.2f} nats over the row median "
                f"(u(0) - mean u(j>0) = {u[0] - u[1:].mean():+.2f}); relative prior peaks at "
                f"lag {peak} with {prof[h, peak]:+.2f} nats over its median (kappa alone: "
                f"lag {kappa_peak})")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Attention maps on real inputs (any position encoding)
# ----------------------------------------------------------------------------------------------


def attention_maps(model, params: Params, tokens) -> dict[str, np.ndarray]:
    """Causal attention probabilities of every layer and head on ``tokens`` [B, T], read from
    the model itself: its attention layers run the 'dense' kernel and sow what they computed
    (:func:`goat_jax.layers.core.run`), so any position encoding works unchanged.

    Returns (numpy float32):
      ``probs`` [Y, B, N, T, S]; ``keys`` [Y, B, S, K, Hk] -- the content keys before any
      position encoding (for GOAT the ``d_c`` content dims; for RoPE the raw projection);
      ``values`` [Y, B, S, K, H].
    """
    model, params = _unscanned(model, params)
    out = _attention_maps(model, params, jnp.asarray(tokens, jnp.int32))
    return {k: np.asarray(v, np.float32) for k, v in out.items()}


# One jitted forward (eager dispatch of a whole LM op by op is far slower than a compile); the
# module is hashable, so repeated calls on one model reuse the compiled function.
@functools.partial(jax.jit, static_argnums=0)
def _attention_maps(model, params, tokens):
    _, state = model.apply({"params": params}, tokens, mutable=["intermediates"])
    inter = state["intermediates"]
    maps = {"probs": [], "keys": [], "values": []}
    for i in range(model.config.num_layers):
        att = inter[f"layer_{i}"]["attention"]
        for name in maps:
            maps[name].append(att[f"attention_{name}"][0].astype(jnp.float32))
    return {name: jnp.stack(v) for name, v in maps.items()}


def sink_statistics(model, params: Params, tokens, min_query: int = 1) -> dict[str, np.ndarray]:
    """Attention sinks of an LM on ``tokens`` [B, T], comparable across position encodings.

    Returns (numpy):
      ``first_mass`` [Y, N]: attention on position 0, averaged over batch and queries
        ``i >= min_query`` (query 0 can only attend to itself);
      ``key_norm_first`` [Y, K]: norm of the key of position 0 (mean over the batch);
      ``key_norm_rest`` [Y, K]: mean norm of the keys at positions > 0;
      ``key_norm_ratio`` [Y]: mean over KV heads of first / rest (>> 1: a norm-inflated sink).
    """
    maps = attention_maps(model, params, tokens)
    t = maps["probs"].shape[-1]
    if not 0 <= min_query < t:
        raise ValueError(f"min_query={min_query} must be in [0, T={t}).")
    first_mass = maps["probs"][:, :, :, min_query:, 0].mean(axis=(1, 3))  # [Y, N]
    norms = np.linalg.norm(maps["keys"], axis=-1)  # [Y, B, S, K]
    first = norms[:, :, 0].mean(axis=1)  # [Y, K]
    rest = norms[:, :, 1:].mean(axis=(1, 2))  # [Y, K]
    return {"first_mass": first_mass, "key_norm_first": first, "key_norm_rest": rest,
            "key_norm_ratio": (first / rest).mean(axis=-1)}

