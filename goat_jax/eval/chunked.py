"""Long windows evaluated in query chunks through the KV cache, so memory stays bounded.

A full-window forward at length W materializes [B, W, V] output logits (6.6 GB in float32 for
GPT-2's vocabulary at W = 32768, B = 1) and, on the XLA kernel, W x W attention logits per
layer. The official C4 evaluation instead feeds each window to the model in chunks of C queries
(512 there; docs/protocols.md, Length extrapolation): chunk ``c`` holds the queries at positions
``[cC, cC + C)``, appends their keys and values to the layer's KV cache and attends causally over
the cached keys ``[0, cC + C)``. Every position-dependent term is computed at the absolute
position (the cache index): GOAT's ``kappa(i - j)`` through the packed Fourier channels of the
queries and the cached keys, its sink ``u(j)`` stored in the cached packed keys, RoPE's rotation,
ALiBi's distance. So the chunked evaluation computes exactly the full-window logits, one chunk at
a time: per chunk at most [B, C, V] output logits and [B, N, C, W] attention logits (the flash
kernel does not even build those), plus the cache, [B, W, K, H] per layer.

The chunks run under one ``jax.lax.scan`` (one compile per window length, whatever the number of
chunks); a last, shorter chunk handles window lengths that C does not divide.

GOAT without ``training_seq_len``: its sink MLP normalizes key positions by the key length minus
one, which a growing cache would change from chunk to chunk. A full-window forward normalizes by
``W - 1``, so the chunked path fixes ``training_seq_len = max(W - 1, 1)`` for the window and stays
identical to it.

Shape legend: B batch (windows), W window length, C chunk size, V vocabulary, N heads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from goat_jax.eval.extrapolation import token_nll

Array = jax.Array


def check_chunk_size(chunk_size: Any) -> int:
    """``chunk_size`` as an int, or ValueError naming the argument and what it takes."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an integer >= 1 (queries per chunk, e.g. 512), "
                         f"got {chunk_size!r}.")
    return chunk_size


def window_decoder(model, window: int):
    """The ``decode=True`` clone of a :class:`goat_jax.models.lm.TransformerLM` that evaluates
    windows of ``window`` tokens through its cache, equal to the full-window forward (see the
    module doc for GOAT without ``training_seq_len``)."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "position_encoding"):
        raise ValueError(f"chunked evaluation needs a goat_jax TransformerLM (a model with an "
                         f"LMConfig and a KV cache), got {type(model).__name__}.")
    if cfg.position_encoding == "goat" and cfg.training_seq_len is None:
        cfg = dataclasses.replace(cfg, training_seq_len=max(window - 1, 1))
    return model.clone(config=cfg, decode=True)


def empty_cache(decoder, batch: int, window: int):
    """The decoder's 'cache' collection sized for [batch, window] tokens, at index 0 (all
    zeros, as ``init`` creates it; only its shapes are traced, no init runs)."""
    shapes = jax.eval_shape(decoder.init, jax.random.PRNGKey(0),
                            jax.ShapeDtypeStruct((batch, window), jnp.int32))["cache"]
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def scan_chunks(decoder, variables: dict, inputs: Array, chunk_size: int,
                step: Callable[[Any, Array, Any, int, int], Any], init: Any,
                mutable: tuple = ("cache",)) -> Any:
    """Runs ``inputs`` [B, W] through ``decoder`` in chunks of ``chunk_size`` queries and folds
    each chunk's output into a carry.

    ``step(carry, logits [B, c, V], state, start, c) -> carry`` sees the chunk's logits and the
    mutable collections the apply returned (``state``; e.g. sown 'intermediates'), with
    ``start`` the chunk's first position (traced inside the scan) and ``c`` its static length.
    ``variables`` holds 'params' (no cache: it starts empty). Returns the final carry.
    """
    b, w = inputs.shape
    c = min(chunk_size, w)
    num_full, tail = divmod(w, c)

    def run(cache, x, carry, start):
        logits, state = decoder.apply({**variables, "cache": cache}, x, mutable=list(mutable))
        return state["cache"], step(carry, logits, state, start, x.shape[1])

    def body(state, i):
        cache, carry = state
        start = i * c
        x = jax.lax.dynamic_slice_in_dim(inputs, start, c, axis=1)  # [B, C]
        return run(cache, x, carry, start), None

    cache = empty_cache(decoder, b, w)
    (cache, carry), _ = jax.lax.scan(body, (cache, init), jnp.arange(num_full))
    if tail:
        _, carry = run(cache, inputs[:, num_full * c:], carry, num_full * c)
    return carry


def make_chunked_nll_fn(model, chunk_size: int) -> Callable:
    """Like :func:`goat_jax.eval.extrapolation.make_nll_fn` (same signature and result:
    ``(params, inputs [B, W], targets [B, W], weights [B, W]) -> (sum w * nll [B], sum w [B])``),
    but each window goes through the KV cache in chunks of ``chunk_size`` queries (module doc),
    so no [B, W, V] logits and no W x W attention logits are ever built. Jitted; compiles once
    per window length and batch size."""
    chunk_size = check_chunk_size(chunk_size)

    def nll_sums(params, inputs, targets, weights):
        w = inputs.shape[1]
        decoder = window_decoder(model, w)
        weights = weights.astype(jnp.float32)

        def step(carry, logits, _state, start, c):
            total, count = carry
            y = jax.lax.dynamic_slice_in_dim(targets, start, c, axis=1)  # [B, c]
            wt = jax.lax.dynamic_slice_in_dim(weights, start, c, axis=1)
            return total + jnp.sum(token_nll(logits, y) * wt, -1), count + jnp.sum(wt, -1)

        zeros = jnp.zeros((inputs.shape[0],), jnp.float32)
        return scan_chunks(decoder, {"params": params}, inputs, chunk_size, step, (zeros, zeros))

    return jax.jit(nll_sums)
