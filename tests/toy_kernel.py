"""A toy attention kernel, written only against the kernel table's contract: it registers its
own row (:func:`goat_jax.kernels.capabilities.register`, a row built with keywords) when imported
and touches no other file. It states nothing about ring attention: a row without ring blocks
cannot run in a ring, and the ring strategy says so.
tests/test_plan.py imports it in a fresh process and finds it in the capability table, the
automatic choice (it asks to be tried first on CPUs) and the docs table, and runs it.

It is plain softmax attention over the mask's explicit form (no bias, no window), so its
outputs can be checked against a float64 reference.
"""

import jax
import jax.numpy as jnp

from goat_jax.kernels import capabilities as caps


def attention(q, k, v, *, scale, mask, bias=None, mesh=None):
    """``softmax(scale * q . k + mask) v`` on q [B, T, N, H], k/v [B, S, K, H] (N % K == 0)."""
    del bias, mesh  # refused by its row / XLA partitions it
    t, s, g = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    logits = scale * jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, g, 2)).astype(jnp.float32)
    visible = mask.explicit(t, s)
    if visible is not None:
        logits = jnp.where(visible, logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", probs, jnp.repeat(v, g, 2).astype(jnp.float32)).astype(v.dtype)


ROW = caps.register(caps.Capability(
    name="toy", platforms=caps.ANY, features=("segment_ids", "ragged_segments", "traced_offset"),
    why_not={"bias": "the toy takes no bias", "window": caps.NO_WINDOW, "return_probs": caps.NO_PROBS},
    summary="a toy kernel defined outside the package (tests/toy_kernel.py)", attention=attention,
    preferred_on=("cpu",)))
