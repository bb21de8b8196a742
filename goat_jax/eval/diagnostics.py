"""The official C4 run's attention diagnostics, at any evaluation length, with bounded memory.

* Last-layer attention statistics (:func:`last_layer_attention_stats`), per head and averaged
  over the queries ``i >= min_query`` of held-out windows:

  - ``first_mass``: the attention weight on token 0, ``p(i, 0)`` (a sink at the first token;
    BOS for ``data.bos_windows`` runs);
  - ``max_weight``: the largest weight of the query's row, ``max_j p(i, j)`` (how peaked);
  - ``recent_mass``: the mass on the last ``recent`` keys, ``sum_{i - recent < j <= i} p(i, j)``
    (official: 128; a query with ``i < recent`` sees only recent keys, so its mass is 1).

  The windows run through the KV cache in query chunks (:mod:`goat_jax.eval.chunked`) on the
  'dense' kernel, whose layers sow each chunk's probabilities over the cache
  (``goat_jax.layers.core.run``): memory holds one chunk x window block per layer,
  never window x window, so the statistics exist at 16x the training length too.
* Per-layer ``u(j)`` curves (:func:`sink_curves`): GOAT's learned key-only sink term of the
  prior, ``u_h(j) = gain_h mlp(phi(j)) + bump_h [j = 0] + softplus(slope_h) j`` (the causal
  recency slope included, as the softmax sees it; or without it, where the slope would hide
  the MLP's shape), per layer and query head, for ``j`` up to the longest evaluation length;
  :func:`plot_sink_curves` draws one panel per layer.

Definitions in docs/protocols.md, C4 125M. Shape legend: Y layers, B windows, W window length,
N query heads, C chunk queries, S keys (= W).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from goat_jax import _extras
from goat_jax import prior as prior_lib
from goat_jax.eval import chunked, sinks

DEFAULT_RECENT = 128  # official: mass on the last 128 keys
DEFAULT_CHUNK = 512  # official: 512-query chunks


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return int(value)


def last_layer_attention_stats(model, params: Any, tokens, *, chunk_size: int = DEFAULT_CHUNK,
                               recent: int = DEFAULT_RECENT, min_query: int = 1) -> dict[str, np.ndarray]:
    """Attention statistics of the last layer of a ``TransformerLM`` on ``tokens`` [B, W].

    Args:
      chunk_size: queries per chunk through the KV cache (memory ~ chunk_size x W per layer).
      recent: the number of most recent keys (the query's own included) ``recent_mass`` sums.
      min_query: first query position averaged over (query 0 sees only token 0).
    Returns (numpy float64), averaged over the windows and the queries ``i >= min_query``:
      ``first_mass``, ``max_weight``, ``recent_mass``: [N] per query head;
      ``num_queries``: the number of (window, query) rows averaged.
    """
    chunk_size = chunked.check_chunk_size(chunk_size)
    recent = _check_int("recent", recent, 1)
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [windows, length], got shape {tokens.shape}.")
    w = tokens.shape[1]
    min_query = _check_int("min_query", min_query, 0)
    if min_query >= w:
        raise ValueError(f"min_query={min_query} must be < the window length {w}.")
    model, params = sinks._unscanned(model, params)  # separate layers, dense kernel: they sow
    sums = _stats_sums(model, params, tokens, chunk_size, recent, min_query)
    rows = tokens.shape[0] * (w - min_query)
    out = {k: np.asarray(v, np.float64) / rows for k, v in sums.items()}
    out["num_queries"] = rows
    return out


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5))
def _stats_sums(model, params, tokens, chunk_size, recent, min_query):
    """Sums over windows and queries >= min_query of the three statistics, each [N]."""
    w = tokens.shape[1]
    last = f"layer_{model.config.num_layers - 1}"
    decoder = chunked.window_decoder(model, w)
    keys = jnp.arange(w)

    def step(carry, _logits, state, start, c):
        probs = state["intermediates"][last]["attention"]["attention_probs"][0]  # [B, N, c, S]
        queries = start + jnp.arange(c)  # absolute positions of the chunk's queries
        counted = (queries >= min_query).astype(jnp.float32)  # [c]
        in_recent = (keys[None, :] > queries[:, None] - recent).astype(jnp.float32)  # [c, S]
        stats = {"first_mass": probs[..., 0], "max_weight": probs.max(-1),
                 "recent_mass": jnp.einsum("bncs,cs->bnc", probs, in_recent)}  # each [B, N, c]
        return {k: carry[k] + jnp.einsum("bnc,c->n", v, counted) for k, v in stats.items()}

    zeros = jnp.zeros((model.config.num_heads,), jnp.float32)
    init = {"first_mass": zeros, "max_weight": zeros, "recent_mass": zeros}
    return chunked.scan_chunks(decoder, {"params": params}, tokens, chunk_size, step, init,
                               mutable=("cache", "intermediates"))


def sink_curves(model, params: Any, length: int, recency: bool = True) -> np.ndarray:
    """GOAT's ``u_h(j)`` for ``j = 0..length-1``, every layer and query head: [Y, N, length]
    float32, with the causal recency slope ``softplus(slope_h) j`` (module doc) or, with
    ``recency=False``, without it (the sink MLP and the bump: the part whose absolute-position
    features leave their trained range beyond the training length). Computed from the key
    positions alone (O(length) per layer), never through a length x length prior."""
    length = _check_int("length", length, 1)
    spec = sinks.prior_spec(model)
    if not spec.enable_key_bias:
        raise ValueError("sink_curves: the model's prior has enable_key_bias=False (no u(j)).")
    return np.stack([np.asarray(_sink_curve(spec, sinks.layer_params(model, params, i)["attention"]["prior"],
                                            length, recency), np.float32)
                     for i in range(model.config.num_layers)])


@functools.partial(jax.jit, static_argnums=(0, 2, 3))
def _sink_curve(spec: prior_lib.PriorSpec, p, length: int, recency: bool):
    u = prior_lib.sink(spec, p, prior_lib.positions_1d(length), recency)  # [S, K]
    return jnp.repeat(u.T, spec.group_size, axis=0)  # [N, S]


def curve_positions(length: int, max_points: int = 256) -> np.ndarray:
    """At most ``max_points`` key positions in ``[0, length)`` to store a curve at: all of them
    for short lengths, else 0, 1, 2, ... densely at the start and log-spaced after (what the
    sink's features change fastest over), always ending at ``length - 1``."""
    if length <= max_points:
        return np.arange(length)
    pos = np.unique(np.round(np.geomspace(1, length - 1, max_points - 1)).astype(int))
    return np.concatenate([[0], pos])


def plot_sink_curves(curves: dict[str, Any], path: str, *, train_len: Optional[int] = None,
                     title: str = "GOAT sink u(j) per layer") -> str:
    """One panel per layer, one line per head: ``curves`` as
    :func:`goat_jax.eval.runs.eval_diagnostics` stores them (``{'positions': [P],
    'u': [Y][N][P]}``); a dashed line at the training length."""
    from goat_jax.eval import plots  # pylint: disable=g-import-not-at-top  # matplotlib: on use
    with _extras.imports(__name__):
        from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

    u = np.asarray(curves["u"])
    pos = np.asarray(curves["positions"])
    y = u.shape[0]
    cols = min(y, 4)
    rows = -(-y // cols)
    fig = Figure(figsize=(3.2 * cols, 2.6 * rows), constrained_layout=True)
    for layer in range(y):
        ax = fig.add_subplot(rows, cols, layer + 1)
        for h in range(u.shape[1]):
            ax.plot(pos, u[layer, h], lw=1)
        if train_len:
            ax.axvline(train_len, color="k", ls="--", lw=0.8)
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.set_xlabel("key position j", fontsize=8)
        ax.set_ylabel("u(j)", fontsize=8)
        ax.tick_params(labelsize=7)
        if layer == 0 and u.shape[1] <= 16:
            ax.legend([f"head {h}" for h in range(u.shape[1])], fontsize=6, ncol=2)
    fig.suptitle(title, fontsize=10)
    return plots._save(fig, path)
