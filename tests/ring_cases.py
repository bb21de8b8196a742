"""The setup every ring-attention test case shares (tests/test_ring.py, tests/test_ring_blocks.py),
run inside their fake-device scripts: packed-document segment ids and key padding drawn from the
case's generator, the float64 reference's values and gradients, the load-balanced token order
and the (data, fsdp, context, tensor) mesh of 8 devices with ``c`` context shards."""

import jax
import jax.numpy as jnp
import numpy as np

from goat_jax.kernels import balance
from tests import goat_reference as ref


def ring_case(rng, q, k, v, ct, *, c: int, balanced: bool, seg: bool, pad: bool, padded_tail: int,
              causal: bool = True):
    """One case's (ids, kpm, want, order, perm, mesh) for q [B, T, N, H], k/v [B, T, K, H*], the
    cotangent ``ct``: ``ids`` [B, T] int32 (three cuts per row, drawn from ``rng``) when ``seg``,
    ``kpm`` [B, T] bool with the last ``padded_tail`` keys of row 1 padded when ``pad``, ``want``
    the reference (out, dq, dk, dv) at scale 0.3, ``order`` the tokens' order on the mesh
    (load-balanced or natural), ``perm`` an array (or None) put in that order along axis 1."""
    b, t = q.shape[0], q.shape[1]
    ids = kpm = None
    if seg:
        cuts = np.sort(rng.integers(1, t, size=(b, 3)), axis=1)
        ids = (np.arange(t)[None, :, None] >= cuts[:, None, :]).sum(-1).astype(np.int32)
    if pad:
        kpm = np.zeros((b, t), bool)
        kpm[1, -padded_tail:] = True
    want = ref.attention_and_grads(q, k, v, ct, scale=0.3, is_causal=causal, key_padding_mask=kpm,
                                   q_segment_ids=ids, kv_segment_ids=ids)
    order = balance.balance_order(t, c) if balanced else np.arange(t)
    perm = lambda a: None if a is None else jnp.take(jnp.asarray(a), order, axis=1)
    mesh = jax.make_mesh((8 // c, 1, c, 1), ("data", "fsdp", "context", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 4)
    return ids, kpm, want, order, perm, mesh
