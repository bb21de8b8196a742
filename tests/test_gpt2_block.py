"""The GPT-2 block option of the LM (``LMConfig.block='gpt2'``) against a float64 NumPy forward."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from goat_jax.models import count_params
from goat_jax.models.lm import DecoderBlock, LMConfig, TransformerLM, matmul_params


def _layer_norm(x, scale, bias, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * scale + bias


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def _numpy_gpt2_block(p, x, num_heads, eps):
    """x [T, E] float64 -> [T, E]: pre-LN causal attention (no position encoding) + GELU MLP."""
    t, _ = x.shape
    a = p["attention"]
    h = _layer_norm(x, p["attn_norm"]["scale"], p["attn_norm"]["bias"], eps)
    q = np.einsum("te,enh->tnh", h, a["q_proj"]["kernel"]) + a["q_proj"]["bias"]
    k = np.einsum("te,enh->tnh", h, a["k_proj"]["kernel"]) + a["k_proj"]["bias"]
    v = np.einsum("te,enh->tnh", h, a["v_proj"]["kernel"]) + a["v_proj"]["bias"]
    s = np.einsum("tnh,snh->nts", q, k) / np.sqrt(q.shape[-1])
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    o = np.einsum("nts,snh->tnh", w, v)
    x = x + np.einsum("tnh,nhe->te", o, a["out_proj"]["kernel"]) + a["out_proj"]["bias"]
    m = p["mlp"]
    h = _layer_norm(x, p["mlp_norm"]["scale"], p["mlp_norm"]["bias"], eps)
    h = _gelu_tanh(h @ m["wi"]["kernel"] + m["wi"]["bias"])
    return x + h @ m["wo"]["kernel"] + m["wo"]["bias"]


def test_gpt2_block_matches_numpy_float64(rng):
    cfg = LMConfig(vocab_size=5, num_layers=1, embed_dim=32, num_heads=4, mlp_dim=128,
                   position_encoding="nope", block="gpt2", use_bias=True, norm_eps=1e-5)
    block = DecoderBlock(cfg)
    x = rng.normal(size=(1, 7, 32)).astype(np.float32)
    params = nn.unbox(jax.jit(lambda k, x: block.init(k, x, None))(jax.random.PRNGKey(0), jnp.asarray(x)))["params"]
    # Random (non-zero) biases and norm parameters so that every term is exercised.
    params = jax.tree_util.tree_map(lambda v: v + 0.3 * rng.normal(size=v.shape).astype(v.dtype), params)
    assert set(params["mlp"]) == {"wi", "wo"} and "bias" in params["attn_norm"]
    got = np.asarray(jax.jit(lambda p, x: block.apply({"params": p}, x, None))(params, jnp.asarray(x)), np.float64)
    p64 = jax.tree_util.tree_map(lambda v: np.asarray(v, np.float64), params)
    want = _numpy_gpt2_block(p64, x[0].astype(np.float64), 4, 1e-5)
    np.testing.assert_allclose(got[0], want, rtol=2e-5, atol=2e-5)


def test_llama_stays_the_default_and_gpt2_param_count():
    assert LMConfig().block == "llama"
    with pytest.raises(ValueError, match="block='bert' is not allowed"):
        LMConfig(block="bert")
    # The official genome model: d 512, 8 layers, 8 heads, MLP 4x, biases, tied, vocab 5.
    cfg = LMConfig(vocab_size=5, num_layers=8, embed_dim=512, num_heads=8, mlp_dim=2048,
                   position_encoding="rope", block="gpt2", use_bias=True, norm_eps=1e-5)
    per_layer = 4 * (512 * 512 + 512) + (512 * 2048 + 2048) + (2048 * 512 + 512) + 2 * 2 * 512
    assert count_params(TransformerLM(cfg), (1, 8)) == 8 * per_layer + 5 * 512 + 2 * 512  # 25.2M
    assert matmul_params(cfg) == 8 * (4 * 512 * 512 + 2 * 512 * 2048) + 512 * 5
