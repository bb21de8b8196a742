"""The position-encoding protocol (goat_jax.positional.base): the registry, and an encoding
written only against the protocol (one class, registered for the test) getting parameters, the
KV cache and the kernel rules from the shared layer, checked against a float64 reference."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from goat_jax import positional
from goat_jax.layers.positional import PositionalAttention
from goat_jax.positional import PositionEncoding
from goat_jax.positional import registry
from goat_jax.positional.base import as_batched
from tests import jitted

E, N, K, H = 16, 4, 2, 4  # model dim, query heads, kv heads, head dim


class LearnedDistanceBias(PositionEncoding):
    """A test encoding in the Kerple family: ``-softplus(r_h) * |p_i - p_j|`` with a learned
    per-head ``r`` (parameter 'distance_slope'), as a materialized bias."""

    name = "test_distance_bias"
    materialized_bias = True

    def parameters(self, sizes, settings):
        return (("distance_slope", nn.initializers.normal(1.0), ((sizes.num_heads,), jnp.float32)),)

    def bias(self, params, ctx):
        r = params["distance_slope"]
        q, k = as_batched(ctx.q_pos), as_batched(ctx.attended_k_pos)  # [B|1, T], [B|1, S]
        return -jax.nn.softplus(r)[:, None, None] * jnp.abs(q[:, None, :, None] - k[:, None, None, :])


@pytest.fixture
def registered(monkeypatch):
    """The test encoding in the registry for one test (a real one goes into registry.ENCODINGS)."""
    monkeypatch.setitem(registry._BY_NAME, LearnedDistanceBias.name, LearnedDistanceBias())  # pylint: disable=protected-access
    return lambda **kw: PositionalAttention(num_heads=N, kv_num_heads=K, head_dim=H,
                                            position_encoding=LearnedDistanceBias.name, **kw)


def np_reference(params, x, offset):
    """Causal GQA attention with the distance bias, float64, written from the formula."""
    w = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), nn.meta.unbox(params))
    x = np.asarray(x, np.float64)
    proj = lambda name: np.einsum("bte,enh->btnh", x, w[name]["kernel"]) + w[name]["bias"]
    q, k, v = proj("q_proj"), np.repeat(proj("k_proj"), N // K, 2), np.repeat(proj("v_proj"), N // K, 2)
    t = x.shape[1]
    p = offset + np.arange(t)
    slope = np.log1p(np.exp(w["distance_slope"]))
    logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H) - slope[:, None, None] * np.abs(p[:, None] - p[None])
    logits = np.where(np.arange(t)[None, :] <= np.arange(t)[:, None], logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("bnts,bsnh->btnh", probs, v)
    return np.einsum("btnh,nhe->bte", out, w["out_proj"]["kernel"]) + w["out_proj"]["bias"]


def test_registry_names_every_encoding_once():
    names = [e.name for e in positional.ENCODINGS]
    assert positional.POSITION_ENCODINGS == tuple(names)
    assert len(set(names)) == len(names)
    # The order users and configs saw before the package, kept; later encodings come in between.
    old = ["nope", "rope", "rope_pi", "alibi", "alibi_packed", "naive_prior", "rope2d"]
    assert [n for n in names if n in old] == old
    assert {"ntk", "yarn", "fire", "kerple_log", "fox", "rope_mixed"} <= set(names)  # the comparators
    for e in positional.ENCODINGS:
        assert isinstance(e, PositionEncoding) and e.positions in ("1d", "2d", "any"), e
        assert positional.get_encoding(e.name) is e
    with pytest.raises(ValueError, match=r"Unknown position_encoding='rope3d'; choose one of \('nope', "):
        positional.get_encoding("rope3d")


def test_an_encoding_written_against_the_protocol(registered, rng):
    x = jnp.asarray(rng.normal(size=(2, 7, E)), jnp.float32)
    module = registered()
    variables = jitted.init(module, jax.random.PRNGKey(int(rng.integers(2**31))), x, is_causal=True)
    params = variables["params"]
    # Its parameter sits beside the shared projections, with the shared names.
    assert sorted(params) == ["distance_slope", "k_proj", "out_proj", "q_proj", "v_proj"]
    offset = int(rng.integers(0, 50))
    y = jitted.apply(module, {"params": params}, x, is_causal=True, position_offset_q=offset, position_offset_k=offset)
    ref = np_reference(params, x, offset)
    assert np.max(np.abs(np.asarray(y, np.float64) - ref)) <= 1e-5 * np.max(np.abs(ref))

    # The shared KV cache: decoding a chunk, one token, then a chunk reproduces the full forward, the
    # bias reading the cached keys' positions.
    dec = registered(decode=True)
    cache = jitted.init(dec, jax.random.PRNGKey(0), x, is_causal=True)["cache"]
    outs = []
    for lo, hi in ((0, 3), (3, 4), (4, 7)):
        out, state = jitted.apply(dec, {"params": params, "cache": cache}, x[:, lo:hi], is_causal=True,
                                  mutable=["cache"])
        cache = state["cache"]
        outs.append(out)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), np_reference(params, x, 0), rtol=1e-5, atol=1e-5)

    # The shared kernel rules: a materialized bias picks 'xla' and refuses a flash kernel by name.
    with pytest.raises(ValueError, match=r"position_encoding='test_distance_bias' adds a materialized "
                                         r"\[N, T, S\] bias, which implementation='flash'"):
        registered(implementation="flash").init(jax.random.PRNGKey(0), x, is_causal=True)
    with pytest.raises(ValueError, match=r"'test_distance_bias' is 1D; for 2D inputs use 'rope2d'"):
        module.init(jax.random.PRNGKey(0), x[:, :6], spatial_shape=(2, 3))
