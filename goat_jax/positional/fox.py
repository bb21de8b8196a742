"""FoX, the Forgetting Transformer (Lin et al., ICLR 2025, "Forgetting Transformer: Softmax
Attention with a Forget Gate"): a data-dependent forget gate per head,
``f_t = sigmoid(w_h . x_t + b_h)``, adds ``sum_{l=j+1..i} log f_l`` to the logit of query ``i``
and key ``j``; there is no other position encoding.

With ``c_t = sum_{l<=t} log f_l`` (a cumulative sum along the sequence) the bias is
``c_i - c_j``. Under a causal mask ``c_i`` is a row constant, which softmax ignores, so only
``-c_j`` is needed and it packs into extra q/k channels exactly like 'alibi_packed' (and GOAT's
causal recency term): query head ``n`` carries ones in its own block of ``c`` channels, the keys
carry ``split(-c_j)`` for each query head of their GQA group. Every kernel then runs it (xla,
flash, dense, splash, cuDNN), with no [T, S] bias. ``-c_j`` grows with position (about
``-log f`` per token), so in bf16 it is split exactly over ``c`` channels
(``goat_jax.prior.packing.split_exact``, as GOAT's sink): the bias reaches the logits at float32 accuracy.

Parameters (the official layer's ``fgate_proj``, a Linear with bias): ``fox_gate`` [E, N]
(logical axes ('embed', 'heads')), initialized N(0, 0.02) as the official code's
``initializer_range``, and ``fox_gate_bias`` [N] ('heads'), ``fox_gate_bias_init`` (:class:`FoxSettings`; default 0:
the official data-dependent gate has no special bias init; larger values start the gates nearer
1, i.e. with a longer memory).

The gate is read from the *key-side* input (``call.key``, which is the layer input in
self-attention): only ``c_j`` enters the logits, and reading it from the keys makes a chunk of
queries attending over the whole sequence (cross-call chunking) exact too.

KV cache: the cache stores the packed keys (their ``-c_j`` included) and, in
``fox_log_forget_sum`` [B, N] float32, the running ``c`` of the last cached token, from which the
new tokens' cumulative sums continue; no query-side ``c_i`` is needed.

Positions: FoX ignores them (offsets and explicit positions change nothing). Segment packing:
because cross-segment keys are masked, ``c_i - c_j`` within one segment is already the sum over
that segment's gates, so no reset of ``c`` per segment is needed.

Shape legend: B batch, T queries, S keys, E model dim, N query heads, K kv heads, G = N // K,
H head dim, c split channels.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from goat_jax import partitioning
from goat_jax import prior as prior_lib
from goat_jax.prior.packing import split_exact
from goat_jax.config.fields import Float, declare
from goat_jax.positional.alibi import pack_alibi_query
from goat_jax.positional.base import EncodingContext, EncodingSettings, PositionEncoding

Array = jax.Array
Dtype = Any

# The official FoX code draws every Linear, the forget-gate projection included, N(0, 0.02).
GATE_INIT_STD = 0.02
# The cache slot of the running sum of log forget gates (while decoding).
CACHE_SLOT = "fox_log_forget_sum"


def fox_log_forget(x: Array, w: Array, b: Array) -> Array:
    """``log f_t = log sigmoid(x_t . w + b)`` per head, in float32 (the official code also takes
    the log-sigmoid in float32).

    Args:
      x: [B, S, E] the key-side layer input; w: [E, N]; b: [N].
    Returns:
      [B, S, N] float32 (<= 0).
    """
    f32 = prior_lib.real_dtype()
    logits = jnp.einsum("bse,en->bsn", x.astype(f32), w.astype(f32)) + b.astype(f32)
    return jax.nn.log_sigmoid(logits)


def fox_cumulative(log_f: Array, start: Optional[Array] = None) -> Array:
    """``c_t = start + sum_{l<=t} log f_l`` along the sequence: [B, S, N] (``start`` [B, N], the
    ``c`` of the token before the first one; None is 0)."""
    c = jnp.cumsum(log_f, axis=1)
    return c if start is None else c + start[:, None, :].astype(c.dtype)


def pack_fox_key(k: Array, c: Array, channels: int, dtype: Dtype) -> Array:
    """Keys for packed FoX: ``[k, split(-c_j) for each query head of the group]``.

    With :func:`goat_jax.positional.alibi.pack_alibi_query` queries (ones in query head ``n``'s
    own block), ``q~ . k~ = scale * q . k - c_j^(n)``, which is FoX's ``c_i - c_j`` up to the row
    constant ``c_i`` that softmax ignores under a causal mask.

    Args:
      k: [B, S, K, H]; c: [B, S, N] cumulative log forget gates (float32).
    Returns:
      [B, S, K, H + G c] in ``dtype``.
    """
    b, s, kh, _ = k.shape
    g = c.shape[-1] // kh
    u = -c.reshape(b, s, kh, g)  # query head n = kv head * G + group member
    parts = split_exact(u, channels, dtype).reshape(b, s, kh, g * channels)
    return jnp.concatenate([k.astype(dtype), parts], axis=-1)


@dataclasses.dataclass(frozen=True)
class FoxSettings(EncodingSettings):
    """'fox': the forget gates' initial bias."""

    fox_gate_bias_init: float = declare(0.0, Float(doc="'fox': initial bias of the forget gates (0 as the "
                                                        "official FoX; larger starts them nearer 1)"))


class Fox(PositionEncoding):
    """'fox': the forget gate packed into q/k channels; runs on every kernel; causal only."""

    name = "fox"
    settings_class = FoxSettings
    causal_only = ("its packed bias drops the row constant c_i of c_i - c_j, which is exact only "
                   "when every visible key precedes the query (FoX is a causal model).")

    def extra_qk_dims(self, shape: Any, channels: int) -> int:
        return shape.group * channels

    def parameters(self, sizes: Any, settings: FoxSettings):
        n = sizes.num_heads
        return (("fox_gate", partitioning.with_logical_partitioning(
                    nn.initializers.normal(GATE_INIT_STD), ("embed", "heads")), ((sizes.kv_features, n), sizes.param_dtype)),
                ("fox_gate_bias", partitioning.with_logical_partitioning(
                    nn.initializers.constant(settings.fox_gate_bias_init), ("heads",)), ((n,), sizes.param_dtype)))

    def cache_slots(self, sizes: Any, batch: int):
        # The running sum of log forget gates before the cache index: sized at init, read and
        # advanced while decoding.
        return ((CACHE_SLOT, jnp.zeros, ((batch, sizes.num_heads), prior_lib.real_dtype())),)

    def _cumulative(self, params: Mapping[str, Any], ctx: EncodingContext) -> Array:
        """``c`` [B, S, N] of this call's keys, from the cache's running sum while decoding."""
        log_f = fox_log_forget(ctx.call.key, jnp.asarray(params["fox_gate"]),
                               jnp.asarray(params["fox_gate_bias"]))  # [B, S, N]
        return fox_cumulative(log_f, ctx.cache[CACHE_SLOT] if ctx.decoding else None)

    def cache_update(self, params: Mapping[str, Any], ctx: EncodingContext):
        return {CACHE_SLOT: self._cumulative(params, ctx)[:, -1]}

    def encode(self, params: Mapping[str, Any], ctx: EncodingContext, q: Array, k: Array):
        c = self._cumulative(params, ctx)  # [B, S, N]
        dtype = ctx.shape.dtype
        q = pack_alibi_query(q, ctx.shape.group, ctx.channels, dtype, ctx.attention_scale)  # [B, T, N, H + G c]
        k = pack_fox_key(k, c, ctx.channels, dtype)  # [B, S, K, H + G c]
        return q, k, 1.0


FOX = Fox()
