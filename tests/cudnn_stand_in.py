"""A pure-JAX stand-in for jax 0.10.2's private cuDNN attention calls, with their signatures and
their statistics, so the cuDNN ring blocks (goat_jax/kernels/ring_blocks.py, ``CudnnBlocks``) run
their block arithmetic on CPU: :func:`calls` is the ``calls`` argument of ``CudnnBlocks``.

* ``forward``: ``fused_attention_stablehlo.dot_product_attention(q, k, v, *, scale, mask_type,
  qkv_layout='BTNH', return_residual=True)`` -> (out [B, T, N, Hv] in q's dtype, stats float32
  [B, N, T], the natural-log log-sum-exp of the scaled logits). GQA as cuDNN takes it (K heads,
  query head n reads KV head n // (N / K)); ``mask_type`` CAUSAL is top-left (key j <= query i).
* ``backward``: the backward primitive's ``bind(q, k, v, bias, q_seqlen, kv_seqlen, q_offsets,
  kv_offsets, page_table_k, page_table_v, stats, out, do, *, scale, ..., mask_type, layout, ...)``
  -> (dq, dk, dv): the softmax recomputed from the *given* stats and ``rowsum(out * do)`` from the
  *given* output, as cuDNN's kernel does, so a ring can drive it with global ones.

Written independently of the block code it checks: dense einsums, no loops.
"""

import enum

import jax.numpy as jnp

from goat_jax.kernels.ring_blocks import CudnnCalls


class MaskType(enum.Enum):
    """The two members of cuDNN's MaskType the ring blocks use."""

    NO_MASK = 0
    CAUSAL = 2


BTNH = 1  # fused_attention_stablehlo.AttentionLayout.BTNH.value


def _logits(q, k, scale, mask_type):
    """Scaled logits [B, N, T, S] float32 with GQA and the mask applied (-inf)."""
    b, t, n, _ = q.shape
    s, kh = k.shape[1], k.shape[2]
    kr = jnp.repeat(k, n // kh, axis=2)
    logits = jnp.einsum("btnh,bsnh->bnts", q.astype(jnp.float32), kr.astype(jnp.float32),
                        precision="highest") * scale
    if mask_type == MaskType.CAUSAL:
        logits = jnp.where(jnp.arange(s)[None, :] <= jnp.arange(t)[:, None], logits, -jnp.inf)
    return logits


def forward(q, k, v, *, scale=1.0, mask_type=MaskType.NO_MASK, qkv_layout="BTNH", return_residual=False):
    """The private forward's contract (module doc); BTNH only."""
    assert qkv_layout == "BTNH" and return_residual
    n, kh = q.shape[2], k.shape[2]
    logits = _logits(q, k, scale, mask_type)
    stats = jnp.log(jnp.sum(jnp.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    p = jnp.exp(logits - stats[..., None])
    out = jnp.einsum("bnts,bsnh->btnh", p, jnp.repeat(v, n // kh, axis=2).astype(jnp.float32), precision="highest")
    return out.astype(q.dtype), stats


def backward(q, k, v, bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets, page_table_k, page_table_v, stats, out,
             do, *, scale, seed, dropout_rate, variadic_args, mask_type, layout, sliding_window_length):
    """The backward primitive's contract (module doc): gradients under the given stats and output."""
    del bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets, page_table_k, page_table_v, seed, sliding_window_length
    assert layout == BTNH and dropout_rate == 0.0 and variadic_args == (False, False)
    b, t, n, _ = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = n // kh
    f32 = lambda x: x.astype(jnp.float32)
    p = jnp.exp(_logits(q, k, scale, mask_type) - f32(stats)[..., None])  # [B, N, T, S]
    vr = jnp.repeat(f32(v), g, axis=2)
    delta = jnp.einsum("btnh,btnh->bnt", f32(out), f32(do))
    dp = jnp.einsum("btnh,bsnh->bnts", f32(do), vr, precision="highest")
    ds = p * (dp - delta[..., None]) * scale
    dq = jnp.einsum("bnts,bsnh->btnh", ds, jnp.repeat(f32(k), g, axis=2), precision="highest")
    dk = jnp.einsum("bnts,btnh->bsnh", ds, f32(q), precision="highest").reshape(b, s, kh, g, -1).sum(3)
    dv = jnp.einsum("bnts,btnh->bsnh", p, f32(do), precision="highest").reshape(b, s, kh, g, -1).sum(3)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def calls() -> CudnnCalls:
    """The stand-in as ``CudnnBlocks``'s ``calls`` argument."""
    return CudnnCalls(forward, backward, MaskType, BTNH)
