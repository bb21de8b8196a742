"""The LM's cross-entropy computed a chunk of positions at a time from the hidden states
(``model.loss_chunk_size``), so the ``[batch, length, vocab]`` float32 logits are never held.

At the 125M model's 8 x 2,048 tokens and a 32k vocabulary the full logits are 2 GiB of float32,
written and read again by the softmax, the loss and their gradients: the largest tensor of the
step. llm.c's fused classifier never holds them either (docs/training.md, GPU settings); here the
same effect comes from ``jax.lax.scan`` over chunks of positions with a rematerialized body:
each chunk's ``[batch, chunk, vocab]`` logits are made, reduced to its loss, and made again in
the backward pass to form that chunk's gradients, which are accumulated into ``dW`` by the
scan's transpose. Chunks run over the sequence axis (every row of the batch in each chunk), so a
batch sharded over devices stays sharded.

The value equals :func:`goat_jax.train.tasks.weighted_cross_entropy` of the full logits
(``tests/test_chunked_loss.py`` checks both, and their gradients, against float64).
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from goat_jax.train import tasks

Array = jax.Array


def chunked_cross_entropy(hidden: Array, weight: Array, targets: Array, weights: Array, *,
                          chunk_size: int, vocab_size: Optional[int] = None) -> Tuple[Array, Array]:
    """``(sum_i w_i * CE_i, sum_i w_i)`` in float32 of the logits ``hidden @ weight``, computed
    ``chunk_size`` positions at a time.

    Args:
      hidden: ``[B, T, E]`` (the model's final-norm output, ``return_hidden=True``).
      weight: ``[E, Vp]`` output projection (the tied embedding transposed, or ``lm_head``); the
        matmul accumulates in float32 whatever their dtype, as the model's own logits do.
      targets: ``[B, T]`` int token ids in ``[0, vocab_size)``.
      weights: ``[B, T]`` loss weights (0 for padding).
      chunk_size: positions per chunk; the logits held at once are ``[B, chunk_size, Vp]``.
        ``T`` need not be a multiple (the last chunk is padded with weight 0).
      vocab_size: the real vocabulary when ``weight`` has padded columns (``vocab_pad_multiple``):
        only the first ``vocab_size`` columns enter the softmax. None: all ``Vp``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}: set model.loss_chunk_size >= 1 "
                         "(or None for the full logits).")
    if hidden.ndim != 3 or targets.shape != hidden.shape[:2] or weights.shape != targets.shape:
        raise ValueError(f"hidden must be [B, T, E] with targets and weights [B, T]; got {hidden.shape}, "
                         f"{targets.shape}, {weights.shape}.")
    vp = weight.shape[-1]
    v = vp if vocab_size is None else vocab_size
    if not 1 <= v <= vp:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, {vp}] (the weight's columns).")
    b, t, e = hidden.shape
    c = min(chunk_size, t)
    pad = -t % c
    weights = weights.astype(jnp.float32)
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
        weights_p = jnp.pad(weights, ((0, 0), (0, pad)))
    else:
        weights_p = weights
    n = (t + pad) // c
    # [n, B, c, ...]: the scan walks the sequence; each step keeps the batch axis (and its sharding).
    hs = hidden.reshape(b, n, c, e).swapaxes(0, 1)
    ts = targets.reshape(b, n, c).swapaxes(0, 1)
    ws = weights_p.reshape(b, n, c).swapaxes(0, 1)

    @jax.checkpoint  # the backward remakes this chunk's logits instead of keeping every chunk's
    def chunk_loss(h, tgt, w):
        logits = jnp.einsum("bce,ev->bcv", h, weight, preferred_element_type=jnp.float32)
        if v != vp:
            logits = logits[..., :v]  # the padded columns are no tokens
        # The engine's own per-position CE (compare-and-sum, NaN for a target outside [0, v)).
        return jnp.sum(tasks.softmax_cross_entropy(logits, tgt) * w)

    def body(total, xs):
        return total + chunk_loss(*xs), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (hs, ts, ws))
    return total, jnp.sum(weights)
