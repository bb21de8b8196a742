"""Token cross-entropy losses, below the engine and the models (both import them):
:func:`softmax_cross_entropy` and :func:`weighted_cross_entropy` of full logits (the tasks' shared
losses, re-exported by :mod:`goat_jax.train.tasks`), and :func:`chunked_cross_entropy`, the LM's
cross-entropy computed a chunk of positions at a time from the hidden states
(``model.loss_chunk_size``), so the ``[batch, length, vocab]`` float32 logits are never held.

At the 125M model's 8 x 2,048 tokens and a 32k vocabulary the full logits are 2 GiB of float32,
written and read again by the softmax, the loss and their gradients: the largest tensor of the
step. llm.c's fused classifier never holds them either (docs/training.md, GPU settings); here the
same effect comes from ``jax.lax.scan`` over chunks of positions with a rematerialized body:
each chunk's ``[batch, chunk, vocab]`` logits are made, reduced to its loss, and made again in
the backward pass to form that chunk's gradients, which are accumulated into ``dW`` by the
scan's transpose. Chunks run over the sequence axis (every row of the batch in each chunk), so a
batch sharded over devices stays sharded.

The value equals :func:`weighted_cross_entropy` of the full logits
(``tests/test_chunked_loss.py`` checks both, and their gradients, against float64).
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp

Array = jax.Array


def softmax_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """``-log softmax(logits)[..., target]`` per position, in float32: ``logits [..., C]``,
    ``targets [...]`` (int) -> ``[...]``. A target outside ``[0, C)`` gives NaN.

    The target's logit is picked by comparing ``targets`` with the class index and summing
    (one nonzero term: exact), not by a gather (``optax.softmax_cross_entropy_with_integer_labels``
    uses ``take_along_axis``). Same values; what changes is the backward pass. The gather's
    transpose is a scatter into the ``[..., C]`` gradient, which the TPU compiler turns into an
    elementwise one-hot while the logits are split over the batch only; once an LM's length is
    split over ``mesh.context`` it lowers the scatter through a flattened float32 copy of the
    local logits' gradient and bfloat16 copies for its loops instead: 5.9 GiB more per device for
    the 125M model at 32,768 tokens on v5p-8 (benchmarks/context.md, "The LM head and the loss
    under context"). Compare-and-sum makes the gradient one elementwise ``softmax - one_hot``
    whatever the sharding (MaxText likewise feeds its loss ``jax.nn.one_hot`` targets).
    """
    logits = logits.astype(jnp.float32)
    classes = logits.shape[-1]
    hit = jnp.arange(classes, dtype=targets.dtype) == targets[..., None]
    label_logits = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
    ce = jax.nn.logsumexp(logits, axis=-1) - label_logits
    # A target with no class would read 0 as its logit: NaN makes it loud, as a gather's
    # out-of-range fill did (weights never hide it: NaN * 0 is NaN).
    return jnp.where((targets >= 0) & (targets < classes), ce, jnp.nan)


def weighted_cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> Tuple[jax.Array, jax.Array]:
    """``(sum_i w_i * CE(logits_i, targets_i), sum_i w_i)`` in float32 (the log-softmax over a
    large vocabulary loses digits in bfloat16); CE is :func:`softmax_cross_entropy`.

    Shapes: ``logits [..., C]``, ``targets [...]`` (int), ``weights [...]``.
    """
    ce = softmax_cross_entropy(logits, targets)
    weights = weights.astype(jnp.float32)
    return jnp.sum(ce * weights), jnp.sum(weights)


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
        # The same per-position CE as the full logits' (compare-and-sum, NaN for a target outside [0, v)).
        return jnp.sum(softmax_cross_entropy(logits, tgt) * w)

    def body(total, xs):
        return total + chunk_loss(*xs), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (hs, ts, ws))
    return total, jnp.sum(weights)
