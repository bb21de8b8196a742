"""The layers from Flax NNX (``nnx.bridge.ToNNX``), with no mesh and no eager-sharding setting:
forward and ``nnx.grad`` equal the Linen ``apply`` / ``jax.grad`` with the same parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.nnx import bridge

from goat_jax.layers.positional import PositionalAttention
from tests import goat_reference as ref
from tests.marks import SLOW_CASE

LAYERS = {
    "goat": lambda: ref.goat_module(num_heads=4, kv_num_heads=2, pos_rank=2, abs_rank=2, training_seq_len=16),
    "rope": lambda: PositionalAttention(num_heads=4, kv_num_heads=2, position_encoding="rope"),
    "alibi": lambda: PositionalAttention(num_heads=4, position_encoding="alibi"),
    "naive_prior": lambda: PositionalAttention(num_heads=4, position_encoding="naive_prior", max_len=16),
}


# Slow: goat (its bridge's eager lazy_init; tests/test_nnx_native.py compares the native layer).
@pytest.mark.parametrize("layer", [pytest.param(name, marks=[SLOW_CASE] if name == "goat" else [])
                                   for name in LAYERS])
def test_nnx_forward_and_grad_equal_linen(layer, rng):
    x = jnp.asarray(rng.normal(size=(2, 12, 32)), jnp.float32)
    linen_module = LAYERS[layer]()
    model = bridge.lazy_init(bridge.ToNNX(linen_module, rngs=nnx.Rngs(0)), x, is_causal=True)
    # The Linen params are the NNX model's own parameters (same names and shapes).
    params = nnx.state(model, nnx.Param).to_pure_dict()
    assert set(params) >= {"q_proj", "k_proj", "v_proj", "out_proj"}

    # Compiled calls (op by op, each compiled a few hundred one-op programs).
    y_nnx = nnx.jit(lambda m: m(x, is_causal=True))(model)
    y_linen = jax.jit(lambda p: linen_module.apply({"params": p}, x, is_causal=True))(params)
    np.testing.assert_allclose(np.asarray(y_nnx), np.asarray(y_linen), rtol=1e-6, atol=1e-6)

    target = jnp.asarray(rng.normal(size=y_linen.shape), jnp.float32)
    g_nnx = nnx.jit(nnx.grad(lambda m: jnp.sum((m(x, is_causal=True) - target) ** 2)))(model)
    g_linen = jax.jit(jax.grad(lambda p: jnp.sum((linen_module.apply({"params": p}, x, is_causal=True)
                                          - target) ** 2)))(params)
    g_nnx = g_nnx.to_pure_dict()
    flat_nnx = jax.tree_util.tree_leaves_with_path(g_nnx)
    flat_linen = dict(jax.tree_util.tree_leaves_with_path(g_linen))
    assert len(flat_nnx) == len(flat_linen)
    for path, g in flat_nnx:
        np.testing.assert_allclose(np.asarray(g), np.asarray(flat_linen[path]), rtol=1e-5, atol=1e-6)
    assert any(np.abs(np.asarray(g)).max() > 0 for _, g in flat_nnx)
