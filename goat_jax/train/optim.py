"""Optimizer: AdamW, linear warmup + cosine decay, global-norm clipping, a weight-decay mask,
and gradient accumulation over microbatches.

Config (``config.optimizer``): ``learning_rate, warmup_steps, min_lr_ratio, b1, b2, eps,
weight_decay, grad_clip``; the decay horizon is ``config.num_train_steps``.

Weight-decay groupings live here as rules (:func:`decay_mask`, :func:`substring_decay_mask`,
:func:`decay_everything`); a task declares which names or substrings they apply to
(``Task.no_decay_names``, ``Task.decay_groupings``), since the names are its parameters'.
"""

from __future__ import annotations

from typing import AbstractSet, Any, Callable, Optional, Tuple

import jax
import jax.numpy as jnp

from goat_jax import _extras
with _extras.imports(__name__):  # optional packages: one-line error naming the extra
    import optax


def learning_rate_schedule(opt_config: Any, num_train_steps: int) -> optax.Schedule:
    """``lr(count)`` for the update with 0-based index ``count``: linear warmup reaching the
    peak at update ``warmup_steps`` (the first update already moves, unlike optax's warmup from
    0), then cosine decay to ``min_lr_ratio * peak`` at ``num_train_steps``."""
    peak = float(opt_config.learning_rate)
    warmup = int(opt_config.warmup_steps)
    floor = peak * float(opt_config.min_lr_ratio)
    decay_steps = max(num_train_steps - warmup, 1)

    def schedule(count):
        step = jnp.asarray(count, jnp.float32) + 1.0  # 1-based: the update being made
        warm = peak * step / max(warmup, 1)
        frac = jnp.clip((step - warmup) / decay_steps, 0.0, 1.0)
        cosine = floor + 0.5 * (peak - floor) * (1.0 + jnp.cos(jnp.pi * frac))
        return jnp.where(step <= warmup, warm, cosine)

    return schedule


def decay_mask(params: Any, no_decay_names: AbstractSet[str] = frozenset()) -> Any:
    """True for parameters that get weight decay: arrays with >= 2 dims none of whose path
    names (parameter or enclosing module) is in ``no_decay_names`` (the task's list, e.g.
    biases, norm scales, the GOAT prior). 1-D parameters are never decayed."""
    def one(path, leaf):
        names = {getattr(k, "key", getattr(k, "name", None)) for k in path}
        return bool(jnp.ndim(leaf) >= 2 and not names & no_decay_names)
    return jax.tree_util.tree_map_with_path(one, params)


def dotted_path(path: Any) -> str:
    """``layer_0.attention.q_proj.kernel`` for a pytree key path (boxed ``.value`` dropped)."""
    names = (getattr(k, "key", getattr(k, "name", None)) for k in path)
    return ".".join(str(n) for n in names if n not in (None, "value"))


def substring_decay_mask(no_decay_substrings: Tuple[str, ...]) -> Callable[[Any], Any]:
    """The grouping ``params -> pytree of bools`` that decays every parameter whose dotted path
    contains none of ``no_decay_substrings``, whatever its rank (the PyTorch recipes' rule,
    e.g. the official GOAT C4 script's). ``params`` may be boxed (``nn.Partitioned``) or plain."""
    substrings = tuple(no_decay_substrings)

    def mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: not any(s in dotted_path(path) for s in substrings), params)
    return mask


def decay_everything(params: Any) -> Any:
    """The grouping that decays every parameter (AdamW without exclusions). Pytree of True."""
    return jax.tree_util.tree_map(lambda _: True, params)


def make_optimizer(opt_config: Any, num_train_steps: int, no_decay_names: AbstractSet[str] = frozenset(),
                   mask: Optional[Callable[[Any], Any]] = None,
                   ) -> Tuple[optax.GradientTransformation, optax.Schedule]:
    """Returns ``(tx, schedule)``: clip-by-global-norm (if ``grad_clip > 0``) then AdamW with
    the decoupled weight decay masked by :func:`decay_mask` (``no_decay_names``: the task's), or
    by ``mask`` (``params -> pytree of bools``, True = decayed) when given."""
    if mask is None:
        mask = lambda params: decay_mask(params, frozenset(no_decay_names))
    schedule = learning_rate_schedule(opt_config, num_train_steps)
    parts = []
    if opt_config.grad_clip and float(opt_config.grad_clip) > 0:
        parts.append(optax.clip_by_global_norm(float(opt_config.grad_clip)))
    parts.append(optax.adamw(
        learning_rate=schedule, b1=float(opt_config.b1), b2=float(opt_config.b2),
        eps=float(opt_config.eps), weight_decay=float(opt_config.weight_decay),
        mask=mask))
    return optax.chain(*parts), schedule


def split_microbatches(x: jax.Array, num_microbatches: int) -> jax.Array:
    """``[B, ...] -> [n, B / n, ...]`` with microbatch ``i`` = rows ``i, i + n, ...`` (see
    :func:`accumulate_gradients` for why strided)."""
    b = x.shape[0]
    if b % num_microbatches:
        raise ValueError(f"batch of {b} does not split into grad_accum_steps={num_microbatches} microbatches.")
    return jnp.swapaxes(x.reshape((b // num_microbatches, num_microbatches) + x.shape[1:]), 0, 1)


def accumulate_gradients(
    loss_fn: Callable[[Any, Any, Optional[jax.Array]], Tuple[jax.Array, Tuple[jax.Array, Any]]],
    params: Any,
    batch: Any,
    num_microbatches: int,
    rng: Optional[jax.Array] = None,
) -> Tuple[jax.Array, jax.Array, Any]:
    """Sums ``loss_fn``'s value and gradient over ``num_microbatches`` slices of ``batch``.

    ``loss_fn(params, batch, rng) -> (loss_sum, (weight_sum, aux))`` must return an
    *unnormalized* sum (e.g. of token losses); the caller divides by the total weight, so the
    result equals the full-batch loss exactly (up to float summation order) whatever the
    microbatch count. Microbatch ``i`` takes rows ``i, i + n, i + 2n, ...``: with the batch
    sharded in contiguous blocks over devices, every device then holds its share of every
    microbatch, so the loop needs no resharding. It gets the key ``fold_in(rng, i)`` (None when
    ``rng`` is None), so its dropout masks differ from the other microbatches'.

    Returns ``(loss_sum, weight_sum, grad_sum)``; ``aux`` is dropped when accumulating.
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def key(i):
        return None if rng is None else jax.random.fold_in(rng, i)

    if num_microbatches == 1:
        (loss, (weight, _)), grads = grad_fn(params, batch, key(0))
        return loss, weight, grads

    micro = jax.tree.map(lambda x: split_microbatches(x, num_microbatches), batch)

    def body(carry, xs):
        i, mb = xs
        loss, weight, grads = carry
        (l, (w, _)), g = grad_fn(params, mb, key(i))
        return (loss + l, weight + w, jax.tree.map(jnp.add, grads, g)), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zeros)
    (loss, weight, grads), _ = jax.lax.scan(body, init, (jnp.arange(num_microbatches), micro))
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    return loss, weight, grads
