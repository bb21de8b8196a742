"""'rope_mixed' (RoPE-Mixed, Heo et al. 2024): the paper's initialization, values and gradients
against a float64 NumPy reference, the relative property, equality with 'rope2d' at the axial
frequencies, sharding names, bf16, and a ViT train step."""

import math
import types

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from goat_jax.models.vit import ViT, ViTConfig
from goat_jax.layers.positional import PositionalAttention
from goat_jax.positional.rope_mixed import (PARAM_NAME, apply_rope_mixed, axial_frequencies,
                                             init_mixed_frequencies)
from goat_jax.train import sharding

E, N, K, H = 16, 4, 2, 8  # model dim, query heads, kv heads (GQA), head dim
GRID = (3, 4)


def _layer(**kw):
    return PositionalAttention(num_heads=N, kv_num_heads=K, head_dim=H, position_encoding="rope_mixed",
                               rope_base=10.0, **kw)


def _coords(grid, has_cls):
    c = [(r, col) for r in range(grid[0]) for col in range(grid[1])]
    return np.array(([(0, 0)] if has_cls else []) + c, np.float64)


def np_rope_mixed_attention(p, x, grid, has_cls):
    """Self-attention with RoPE-Mixed, float64, written pair by pair from the formula:
    pair m of head n (kv head n // G) turns by ``row * F[kv, m, 0] + col * F[kv, m, 1]``; pair
    m < H/4 is dims (m, m + H/4), pair H/4 + j is dims (H/2 + j, 3H/4 + j)."""
    proj = lambda name: np.einsum("le,enh->lnh", x, p[name]["kernel"]) + p[name]["bias"]
    g = N // K
    q, k, v = proj("q_proj"), np.repeat(proj("k_proj"), g, 1), np.repeat(proj("v_proj"), g, 1)
    f = p[PARAM_NAME]  # [K, H/2, 2]
    coords = _coords(grid, has_cls)
    quarter = H // 4

    def rotate(vec, pos, head):
        out = vec.copy()
        for m in range(H // 2):
            i = m if m < quarter else H // 2 + (m - quarter)
            j = i + quarter
            theta = pos[0] * f[head // g, m, 0] + pos[1] * f[head // g, m, 1]
            out[i] = vec[i] * math.cos(theta) - vec[j] * math.sin(theta)
            out[j] = vec[j] * math.cos(theta) + vec[i] * math.sin(theta)
        return out

    out = np.zeros_like(q)
    for n in range(N):
        qr = np.stack([rotate(q[t, n], coords[t], n) for t in range(len(coords))])
        kr = np.stack([rotate(k[t, n], coords[t], n) for t in range(len(coords))])
        logits = qr @ kr.T / math.sqrt(H)
        w = np.exp(logits - logits.max(axis=1, keepdims=True))
        out[:, n] = (w / w.sum(axis=1, keepdims=True)) @ v[:, n]
    return np.einsum("lnh,nhe->le", out, p["out_proj"]["kernel"]) + p["out_proj"]["bias"]


def _f64(tree):
    return jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), flax.core.meta.unbox(tree))


def _init(rng, has_cls=True, grid=GRID):
    x = rng.standard_normal((1, grid[0] * grid[1] + int(has_cls), E))
    attn = _layer()
    v = jax.jit(lambda x: attn.init(jax.random.PRNGKey(0), x, spatial_shape=grid, has_cls_token=has_cls))(
        jnp.asarray(x, jnp.float32))
    # Every parameter moved (zero biases would hide layout bugs); frequencies by up to ~0.3.
    v = jax.tree_util.tree_map(lambda a: a + 0.3 * jnp.asarray(rng.standard_normal(a.shape), a.dtype),
                               flax.core.meta.unbox(v))
    return attn, v, x


def test_init_is_the_papers_random_2d_frequencies():
    f = np.asarray(init_mixed_frequencies(10.0)(jax.random.PRNGKey(3), (5, H // 2, 2)), np.float64)
    mag = 10.0 ** (-np.arange(0, H, 4) / H)  # Heo et al.: theta ** (-arange(0, dim, 4) / dim), theta 10
    for h in range(5):
        a = math.atan2(f[h, 0, 1], f[h, 0, 0]) % (2 * math.pi)  # the head's random angle
        want = np.concatenate([np.outer(mag, [math.cos(a), math.sin(a)]),
                               np.outer(mag, [math.cos(a + math.pi / 2), math.sin(a + math.pi / 2)])])
        np.testing.assert_allclose(f[h], want, rtol=0, atol=1e-6)
    angles = np.arctan2(f[:, 0, 1], f[:, 0, 0])
    assert len(np.unique(np.round(angles, 4))) == 5  # one random direction per head


@pytest.mark.parametrize("has_cls,grads", [(True, True), (False, False)])
def test_values_and_gradients_match_float64_reference(has_cls, grads, rng):
    attn, v, x = _init(rng, has_cls)
    kw = dict(spatial_shape=GRID, has_cls_token=has_cls)
    got = np.asarray(jax.jit(lambda v: attn.apply(v, jnp.asarray(x, jnp.float32), **kw))(v))[0]
    p = _f64(v["params"])
    want = np_rope_mixed_attention(p, x[0], GRID, has_cls)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
    if not grads:
        return
    # d <cot, out> / d freqs: JAX autodiff against central differences of the float64 reference.
    cot = rng.standard_normal(want.shape)
    loss = lambda v: jnp.sum(attn.apply(v, jnp.asarray(x, jnp.float32), **kw)[0] * cot)
    g = np.asarray(jax.jit(jax.grad(loss))(v)["params"][PARAM_NAME], np.float64)
    fd = np.zeros_like(g)
    eps = 1e-6
    for idx in np.ndindex(*g.shape):
        for sign in (1, -1):
            q = jax.tree_util.tree_map(np.copy, p)
            q[PARAM_NAME][idx] += sign * eps
            fd[idx] += sign * np.sum(np_rope_mixed_attention(q, x[0], GRID, has_cls) * cot) / (2 * eps)
    np.testing.assert_allclose(g, fd, rtol=0, atol=2e-3 * np.abs(fd).max())
    assert np.abs(fd).max() > 1e-3  # the frequencies do reach the output


def test_logits_depend_only_on_coordinate_differences(rng):
    f = jnp.asarray(rng.standard_normal((K, H // 2, 2)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((1, 6, N, H)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 6, K, H)), jnp.float32)
    coords = jnp.asarray(rng.uniform(0, 10, (6, 2)), jnp.float32)

    def logits(shift):
        qr = apply_rope_mixed(q, coords + shift, f)
        kr = jnp.repeat(apply_rope_mixed(k, coords + shift, f), N // K, axis=2)
        return np.asarray(jnp.einsum("btnh,bsnh->bnts", qr, kr))

    base = logits(jnp.zeros(2))
    for shift in ([3.0, 0.0], [0.0, -2.0], [1.5, 4.25]):
        np.testing.assert_allclose(logits(jnp.asarray(shift, jnp.float32)), base, rtol=0, atol=2e-4)
    assert np.abs(logits(jnp.zeros(2)) - np.asarray(jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, 2, 2)))).max() > 1e-2


def test_cls_at_origin_is_not_rotated(rng):
    f = jnp.asarray(rng.standard_normal((K, H // 2, 2)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 5, K, H)), jnp.float32)
    coords = jnp.concatenate([jnp.zeros((1, 2)), jnp.ones((4, 2))], 0)
    out = apply_rope_mixed(x, coords, f)
    np.testing.assert_array_equal(np.asarray(out[:, 0]), np.asarray(x[:, 0]))


@pytest.mark.parametrize("has_cls", [True])
def test_axial_frequencies_give_rope2d(has_cls, rng):
    _, v, x = _init(rng, has_cls)
    kw = dict(spatial_shape=GRID, has_cls_token=has_cls)
    axial = dict(v["params"], **{PARAM_NAME: axial_frequencies(K, H, 100.0)})
    got = jax.jit(lambda v, x: _layer().apply(v, x, **kw))({"params": axial}, jnp.asarray(x, jnp.float32))
    rope2d = PositionalAttention(num_heads=N, kv_num_heads=K, head_dim=H, position_encoding="rope2d", rope_base=100.0)
    plain = {n: a for n, a in v["params"].items() if n != PARAM_NAME}
    want = jax.jit(lambda v, x: rope2d.apply(v, x, **kw))({"params": plain}, jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)


def test_sharding_names_bf16_and_errors():
    x = jnp.zeros((1, 13, E), jnp.bfloat16)
    boxed = jax.eval_shape(lambda x: _layer(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16).init(
        jax.random.PRNGKey(0), x, spatial_shape=GRID, has_cls_token=True), x)["params"][PARAM_NAME]
    assert tuple(boxed.names) == ("kv_heads", None, None)
    assert boxed.value.dtype == jnp.float32  # angles reach row * f; bf16 would blur them
    mesh = types.SimpleNamespace(shape={"data": 1, "fsdp": 2, "tensor": 2})
    assert sharding._resolve(boxed.names, boxed.value.shape, mesh, sharding.DEFAULT_RULES) == (  # pylint: disable=protected-access
        jax.sharding.PartitionSpec("tensor", None, None))
    with pytest.raises(ValueError, match="divisible by 4"):
        PositionalAttention(num_heads=2, head_dim=6, position_encoding="rope_mixed").init(
            jax.random.PRNGKey(0), jnp.ones((1, 4, 8)), spatial_shape=(2, 2), has_cls_token=False)
    with pytest.raises(ValueError, match="spatial_shape"):
        _layer().init(jax.random.PRNGKey(0), jnp.ones((1, 4, E)))
    with pytest.raises(ValueError, match="'rope_mixed' needs a head dim divisible by 4"):
        ViTConfig(embed_dim=12, num_heads=2, position_encoding="rope_mixed")


def test_vit_train_step_moves_the_frequencies(rng):
    # Higher resolution (a 2x grid, no interpolation) is test_vit.py::test_forward_1x_and_2x.
    cfg = ViTConfig(image_size=8, patch_size=4, channels=1, num_layers=2, embed_dim=16, num_heads=2,
                    mlp_dim=16, num_classes=5, drop_path_rate=0.0, position_encoding="rope_mixed")
    model = ViT(cfg)
    images = jnp.asarray(rng.standard_normal((4, 8, 8, 1)), jnp.float32)
    labels = jnp.asarray([0, 1, 2, 3])
    params = flax.core.meta.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), images))["params"]
    f0, f1 = (np.asarray(params[f"block_{i}"]["attention"][PARAM_NAME]) for i in (0, 1))
    assert f0.shape == (2, 4, 2) and not np.allclose(f0, f1)  # per layer, own random angles
    np.testing.assert_allclose(np.linalg.norm(f0[:, 0], axis=-1), 1.0, rtol=1e-6)  # magnitude 10 ** 0

    # Move the zero-initialized head so that the gradient reaches the attention layers.
    params["head"]["kernel"] = jnp.asarray(rng.standard_normal(params["head"]["kernel"].shape), jnp.float32)
    opt = optax.sgd(0.1)

    def loss_fn(p):
        logits = model.apply({"params": p}, images)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    @jax.jit
    def step(p, s):
        loss, g = jax.value_and_grad(loss_fn)(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss, g

    new, _, loss, g = step(params, opt.init(params))
    assert np.isfinite(float(loss))
    gf = np.asarray(g["block_0"]["attention"][PARAM_NAME])
    assert np.isfinite(gf).all() and np.abs(gf).max() > 0
    assert not np.allclose(np.asarray(new["block_0"]["attention"][PARAM_NAME]), f0)
