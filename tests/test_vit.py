"""goat_jax.models.vit and the 2D position encodings it uses (positional.apply_rope_2d,
positional.sincos_2d_embedding): forward at 1x/2x for every encoding, float64 references, the
'ape' bicubic resize against PyTorch, GOAT layers against the official package."""

import math

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from goat_jax.kernels.plan import AttentionPlan
from goat_jax.tasks import vit as vit_task
from goat_jax.models.vit import (POSITION_ENCODINGS, ViT, ViTConfig, bicubic_matrix, make_attention,
                                 resize_position_table)
from goat_jax.layers.positional import PositionalAttention
from goat_jax.positional import sincos_2d_embedding
from tests import jitted

TINY = dict(image_size=16, patch_size=4, channels=1, num_layers=2, embed_dim=32, num_heads=2, mlp_dim=64,
            num_classes=5, pos_rank=4, abs_rank=2, drop_path_rate=0.0)


def _perturbed(variables, rng, scale=0.3):
    """Every parameter moved by noise: zero-initialized heads/priors would hide bugs."""
    return jax.tree_util.tree_map(
        lambda a: a + scale * jnp.asarray(rng.standard_normal(a.shape), a.dtype), flax.core.meta.unbox(variables))


def _model(encoding, **overrides):
    return ViT(ViTConfig(**{**TINY, "position_encoding": encoding, **overrides}))


def _capture(model, variables, images, module_name):
    """``(positional args, output)`` of the first submodule named ``module_name`` in a forward."""
    def run(variables, images):
        seen = {}

        def interceptor(next_fun, args, kw, context):
            out = next_fun(*args, **kw)
            if context.module.name == module_name and context.method_name == "__call__" and not seen:
                seen["hit"] = (tuple(a for a in args if isinstance(a, jax.Array)), out)
            return out

        with nn.intercept_methods(interceptor):
            model.apply(variables, images)
        return seen["hit"]
    return jax.jit(run)(variables, images)


@pytest.mark.parametrize("encoding", [
    pytest.param(e, marks=pytest.mark.slow(reason="goat and rope_mixed cover the 2x forward")) if e in ("ape", "sincos2d", "nope", "rope2d")
    else e for e in POSITION_ENCODINGS])
def test_forward_1x_and_2x(encoding, rng):
    model = _model(encoding)
    x1 = jnp.asarray(rng.standard_normal((2, 16, 16, 1)), jnp.float32)
    variables = _perturbed(jax.jit(model.init)(jax.random.PRNGKey(0), x1), rng)
    apply = jax.jit(model.apply)
    # One batch: the images and the same images with their patches permuted.
    both = apply(variables, jnp.concatenate([x1, _shuffle_patches(x1, rng.permutation(16))]))
    assert both.shape == (4, 5) and both.dtype == jnp.float32
    assert np.isfinite(np.asarray(both)).all()
    x2 = jnp.asarray(rng.standard_normal((2, 32, 32, 1)), jnp.float32)  # 2x: an 8x8 grid
    out2 = apply(variables, x2)
    assert out2.shape == (2, 5) and np.isfinite(np.asarray(out2)).all()
    # Position information: permuting the patches changes the output unless 'nope'.
    delta = float(jnp.abs(both[2:] - both[:2]).max())
    if encoding == "nope":
        assert delta < 1e-4, delta
    else:
        assert delta > 1e-3, delta


def _shuffle_patches(x, perm, patch=4):
    """Permutes the patches of [B, R, C, 1] images (row-major patch order)."""
    b, r, c, ch = x.shape
    gr, gc = r // patch, c // patch
    p = x.reshape(b, gr, patch, gc, patch, ch).transpose(0, 1, 3, 2, 4, 5).reshape(b, gr * gc, patch, patch, ch)
    return p[:, perm].reshape(b, gr, gc, patch, patch, ch).transpose(0, 1, 3, 2, 4, 5).reshape(x.shape)


@pytest.mark.slow(reason="initializes ViTs of every encoding to compare")
def test_uniform_goat_starts_position_free(rng):
    """Official ViT init: a flat prior (kappa = 0, u = 0), so at initialization the GOAT ViT
    ignores where patches are; after training the prior it no longer does."""
    x = jnp.asarray(rng.standard_normal((2, 16, 16, 1)), jnp.float32)
    goat = _model("goat")
    v = jax.jit(goat.init)(jax.random.PRNGKey(0), x)
    shuffled = _shuffle_patches(x, rng.permutation(16))
    feats = lambda params, images: _capture(goat, params, images, "final_norm")[1]
    np.testing.assert_allclose(feats(v, x), feats(v, shuffled), atol=1e-5)
    moved = flax.core.meta.unbox(v)
    moved["params"]["block_0"]["attention"]["prior"] = _perturbed(
        moved["params"]["block_0"]["attention"]["prior"], rng)
    assert float(jnp.abs(feats(moved, x) - feats(moved, shuffled)).max()) > 1e-3


def _build(**model):
    return vit_task.build_model(ml_collections.ConfigDict(dict(task="vit", model=model)), AttentionPlan())


def test_preset_and_param_count():
    m = _build(preset="s16", position_encoding="ape")
    assert m.config.embed_dim == 384 and m.config.num_layers == 12 and m.config.num_heads == 6
    assert m.config.mlp_dim == 1536 and m.config.drop_path_rate == 0.1 and m.config.norm_eps == 1e-6
    shapes = jax.eval_shape(m.init, jax.random.PRNGKey(0), jax.ShapeDtypeStruct((1, 224, 224, 3), jnp.float32))
    n = sum(int(np.prod(a.shape)) for a in jax.tree_util.tree_leaves(shapes))
    assert n == 22_050_664  # timm vit_small_patch16_224: 22,050,664 parameters
    with pytest.raises(ValueError, match="Unknown ViTConfig field"):
        _build(preset="s16", pos_embed="ape")
    with pytest.raises(ValueError, match="position_encoding"):
        ViTConfig(position_encoding="rope")


def test_bad_inputs_raise_clearly():
    model = _model("goat")
    v = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 16, 16, 1)))
    with pytest.raises(ValueError, match=r"18x16 is not divisible by patch_size=4"):
        jax.eval_shape(model.apply, v, jnp.zeros((1, 18, 16, 1)))
    with pytest.raises(ValueError, match=r"3 channel\(s\).*channels=1 \(grayscale\)"):
        jax.eval_shape(model.apply, v, jnp.zeros((1, 16, 16, 3)))
    with pytest.raises(ValueError, match="rows, cols, channels"):
        jax.eval_shape(model.apply, v, jnp.zeros((16, 16, 1)))
    with pytest.raises(ValueError, match="image_size=30 is not divisible"):
        ViTConfig(image_size=30, patch_size=4)


@pytest.mark.slow(reason="compiles the ViT's training and evaluation paths")
def test_drop_path_is_train_only_and_per_example(rng):
    model = _model("rope2d", drop_path_rate=0.5, num_layers=3)
    x = jnp.asarray(rng.standard_normal((8, 16, 16, 1)), jnp.float32)
    v = _perturbed(jax.jit(model.init)(jax.random.PRNGKey(0), x), rng)
    apply = jax.jit(model.apply, static_argnames="train")
    eval_out = apply(v, x)
    np.testing.assert_array_equal(eval_out, apply(v, x))
    a = apply(v, x, train=True, rngs={"dropout": jax.random.PRNGKey(1)})
    b = apply(v, x, train=True, rngs={"dropout": jax.random.PRNGKey(2)})
    assert float(jnp.abs(a - b).max()) > 1e-3
    with pytest.raises(Exception, match="dropout"):
        jax.eval_shape(lambda v, x: model.apply(v, x, train=True), v, x)
    # Rates grow linearly over depth: 0 for the first block, drop_path_rate for the last.
    rates = [0.5 * i / 2 for i in range(3)]
    assert rates[0] == 0.0 and rates[-1] == 0.5


# --- 'ape': the bicubic resize -----------------------------------------------------------------


@pytest.mark.parametrize("old,new", [((4, 4), (8, 8)), ((14, 14), (24, 24)), ((6, 5), (3, 9)), ((7, 7), (7, 7))])
def test_bicubic_resize_matches_torch(old, new, rng):
    torch = pytest.importorskip("torch")
    table = rng.standard_normal((old[0] * old[1], 6))
    got = np.asarray(resize_position_table(jnp.asarray(table, jnp.float32), old, new))
    grid = torch.tensor(table.reshape(1, old[0], old[1], 6)).permute(0, 3, 1, 2)  # float64 NCHW
    want = torch.nn.functional.interpolate(grid, size=new, mode="bicubic", align_corners=False)
    want = want.permute(0, 2, 3, 1).reshape(-1, 6).numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    if old == new:
        np.testing.assert_array_equal(got, table.astype(np.float32))


def test_bicubic_matrix_rows_sum_to_one_and_differs_from_jax_image():
    m = bicubic_matrix(14, 24)
    np.testing.assert_allclose(m.sum(axis=1), 1.0, atol=1e-12)
    # jax.image.resize uses Keys a=-0.5 and renormalizes at the border: not the PyTorch baseline.
    x = np.eye(14)
    jax_m = np.asarray(jax.image.resize(jnp.asarray(x), (24, 14), "bicubic"))
    assert np.abs(jax_m - m).max() > 1e-2


def test_ape_table_at_train_grid_and_resized_elsewhere(rng):
    torch = pytest.importorskip("torch")
    model = _model("ape")
    x = jnp.asarray(rng.standard_normal((1, 16, 16, 1)), jnp.float32)
    v = _perturbed(jax.jit(model.init)(jax.random.PRNGKey(0), x), rng)
    table = np.asarray(v["params"]["pos_embed"], np.float64)  # [1 + 4*4, E]
    v["params"]["patch_embed"] = jax.tree_util.tree_map(jnp.zeros_like, v["params"]["patch_embed"])
    cls = np.asarray(v["params"]["cls"], np.float64).reshape(1, -1)
    for side, grid in ((16, 4), (24, 6)):
        (tokens, *_), _ = _capture(model, v, jnp.zeros((1, side, side, 1)), "block_0")
        patches = table[1:].reshape(1, 4, 4, -1).transpose(0, 3, 1, 2)
        want = torch.nn.functional.interpolate(torch.tensor(patches), size=(grid, grid), mode="bicubic",
                                               align_corners=False).numpy().transpose(0, 2, 3, 1).reshape(grid * grid, -1)
        np.testing.assert_allclose(tokens[0, 0], cls[0] + table[0], atol=1e-5)  # CLS entry kept
        np.testing.assert_allclose(tokens[0, 1:], want, atol=1e-5)


# --- sincos2d and rope2d against float64 references ---------------------------------------------


def test_sincos_2d_embedding_matches_formula():
    rows, cols, width = 3, 5, 16
    got = np.asarray(sincos_2d_embedding(rows, cols, width))
    q = width // 4
    for r in range(rows):
        for c in range(cols):
            for i in range(q):
                omega = 10_000.0 ** (-i / (q - 1))
                row = got[r * cols + c]
                assert abs(row[i] - math.sin(c * omega)) < 1e-6
                assert abs(row[q + i] - math.cos(c * omega)) < 1e-6
                assert abs(row[2 * q + i] - math.sin(r * omega)) < 1e-6
                assert abs(row[3 * q + i] - math.cos(r * omega)) < 1e-6


def _rope2d_reference(x, params, grid, has_cls, heads, base):
    """Self-attention with axial 2D RoPE, float64 NumPy, written out plainly."""
    p = {k: {n: np.asarray(a, np.float64) for n, a in d.items()} for k, d in params.items()}
    q = np.einsum("le,enh->lnh", x, p["q_proj"]["kernel"]) + p["q_proj"]["bias"]
    k = np.einsum("le,enh->lnh", x, p["k_proj"]["kernel"]) + p["k_proj"]["bias"]
    v = np.einsum("le,enh->lnh", x, p["v_proj"]["kernel"]) + p["v_proj"]["bias"]
    coords = [(r, c) for r in range(grid[0]) for c in range(grid[1])]
    if has_cls:
        coords = [(0, 0)] + coords
    h = q.shape[-1]
    quarter = h // 4

    def rotate(vec, r, c):  # vec [H]: first half by the row, second half by the column
        out = vec.copy()
        for half, pos in ((0, r), (1, c)):
            seg = vec[half * h // 2:(half + 1) * h // 2]
            new = seg.copy()
            for i in range(quarter):
                theta = pos * base ** (-4.0 * i / h)
                a, b = seg[i], seg[i + quarter]
                new[i] = a * math.cos(theta) - b * math.sin(theta)
                new[i + quarter] = b * math.cos(theta) + a * math.sin(theta)
            out[half * h // 2:(half + 1) * h // 2] = new
        return out

    out = np.zeros_like(q)
    for n in range(heads):
        qr = np.stack([rotate(q[i, n], *coords[i]) for i in range(len(coords))])
        kr = np.stack([rotate(k[i, n], *coords[i]) for i in range(len(coords))])
        logits = qr @ kr.T / math.sqrt(h)
        w = np.exp(logits - logits.max(axis=1, keepdims=True))
        out[:, n] = (w / w.sum(axis=1, keepdims=True)) @ v[:, n]
    return np.einsum("lnh,nhe->le", out, p["out_proj"]["kernel"]) + p["out_proj"]["bias"]


@pytest.mark.parametrize("grid,has_cls", [((3, 4), True), ((2, 2), False)])
def test_rope2d_matches_float64_reference(grid, has_cls, rng):
    e, heads = 16, 2
    length = grid[0] * grid[1] + int(has_cls)
    attn = PositionalAttention(num_heads=heads, position_encoding="rope2d", rope_base=100.0)
    x = rng.standard_normal((1, length, e))
    v = jitted.init(attn, jax.random.PRNGKey(0), jnp.asarray(x, jnp.float32), spatial_shape=grid, has_cls_token=has_cls)
    v = _perturbed(v, rng)
    got = np.asarray(jitted.apply(attn, v, jnp.asarray(x, jnp.float32), spatial_shape=grid, has_cls_token=has_cls))[0]
    want = _rope2d_reference(x[0], v["params"], grid, has_cls, heads, 100.0)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_rope2d_errors():
    attn = PositionalAttention(num_heads=2, position_encoding="rope2d")
    x = jnp.zeros((1, 13, 16))
    with pytest.raises(ValueError, match="needs spatial_shape"):
        attn.init(jax.random.PRNGKey(0), x)
    with pytest.raises(ValueError, match="describes 12 tokens"):
        attn.init(jax.random.PRNGKey(0), x, spatial_shape=(3, 4), has_cls_token=False)
    with pytest.raises(ValueError, match="divisible by 4"):
        PositionalAttention(num_heads=2, position_encoding="rope2d").init(
            jax.random.PRNGKey(0), jnp.zeros((1, 4, 12)), spatial_shape=(2, 2))
    with pytest.raises(ValueError, match="1D"):
        PositionalAttention(num_heads=2, position_encoding="rope").init(
            jax.random.PRNGKey(0), jnp.zeros((1, 4, 16)), spatial_shape=(2, 2))


# --- GOAT ViT layers against the official package ------------------------------------------------


@pytest.mark.parametrize("image", [(128, 96)])  # a 8x6 grid: non-square, CLS first
def test_goat_vit_layer_matches_official_2d_layer_with_cls(image, rng):
    torch = pytest.importorskip("torch")
    goat = pytest.importorskip("goat")
    from goat_jax.interop import from_official

    cfg = ViTConfig.preset("s16", num_layers=1, position_encoding="goat", num_classes=10)
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    m = goat.GoatAttention(embed_dim=cfg.embed_dim, num_heads=cfg.num_heads, pos_rank=16, abs_rank=2,
                           prior_init="uniform", enable_key_bias=True, pos_encoding="2d",
                           has_cls_token_default=True, batch_first=True).eval()
    with torch.no_grad():  # move the prior away from its flat init
        for name, p in m.named_parameters():
            if not any(name.startswith(s) for s in ("q_proj", "k_proj", "v_proj", "in_proj", "out_proj")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    official_module, official_params = from_official(m)
    ours = make_attention(cfg)
    assert ours.prior == official_module.prior  # every prior setting (one PriorSettings)
    for field in ("num_heads", "pos_encoding", "has_cls_token_default", "use_bias"):
        assert getattr(ours, field) == getattr(official_module, field), field

    model = ViT(cfg)
    images = jnp.asarray(rng.standard_normal((2,) + image + (3,)), jnp.float32)
    v = flax.core.meta.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), images))
    v["params"]["block_0"]["attention"] = official_params["params"]
    (h,), out = _capture(model, v, images, "attention")
    grid = (image[0] // 16, image[1] // 16)
    xt = torch.tensor(np.asarray(h))
    with torch.no_grad():
        want = m(xt, xt, xt, need_weights=False, spatial_shape=grid, has_cls_token=True)[0].numpy()
    err = np.abs(np.asarray(out) - want).max() / np.abs(want).max()
    assert err <= 1e-5, err

    # The CLS attention maps of the figures equal the official layer's head-averaged weights.
    from goat_jax.eval.vision import cls_attention_maps

    with torch.no_grad():
        weights = m(xt, xt, xt, need_weights=True, average_attn_weights=True, spatial_shape=grid,
                    has_cls_token=True)[1].numpy()  # [B, L, L]
    maps = cls_attention_maps(model, v["params"], images, layer=0)
    np.testing.assert_allclose(maps, weights[:, 0, 1:].reshape((2,) + grid), atol=1e-6)
