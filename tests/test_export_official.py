"""A ``qk_layout='lane_aligned'`` GOAT layer exports to the official ``goat-attention`` 0.1.1
layer exactly (goat_jax/export/official.py, through goat_jax.interop.to_official): its carved
content dims become the official layout's zero-weight dims and the content scales' ratio folds
into the queries. Float32 throughout; the carve is set with ``sink_channels=3`` (bfloat16's
carve, computed in float32), so the comparison is exact to float32 round-off."""

import numpy as np
import pytest

pytest.importorskip("goat")
pytest.importorskip("torch")

E = 32


@pytest.mark.parametrize("gate", ["none", "query_norm"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_lane_aligned_layer_equals_the_official_layer_within_1e5(rng, gate, kv_heads):
    import jax
    import jax.numpy as jnp
    import torch
    from goat_jax import GoatAttention
    from goat_jax.export import official
    from goat_jax.interop import to_official
    from goat_jax.prior import PriorSettings
    from tests import jitted

    prior = PriorSettings(pos_rank=2, abs_rank=2, training_seq_len=16, qk_layout="lane_aligned", prior_gate=gate)
    module = GoatAttention(num_heads=4, kv_num_heads=kv_heads, prior=prior, sink_channels=3, dtype=jnp.float32)
    assert official.content_dims(prior, E // 4, jnp.float32, 3) == (8 - 4 - 3, 8 - 4 - 1)  # 1 vs 3 content dims
    x = jnp.asarray(rng.standard_normal((2, 20, E)), jnp.float32)
    params = jitted.init(module, jax.random.PRNGKey(int(rng.integers(1 << 30))), x, is_causal=True)
    # Non-trivial parameters: the prior, biases and every projection row (the carved rows too).
    params = jax.tree.map(lambda a: jnp.asarray(rng.normal(0, 0.5, a.shape), a.dtype), params)
    got = np.asarray(jitted.apply(module, params, x, x, is_causal=True))
    m = to_official(module, params)
    with torch.no_grad():
        want = m(*(torch.tensor(np.asarray(x)),) * 3, need_weights=False, is_causal=True)[0].numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
