"""A position encoding is one module: tests/toy_encoding.py, written only against the protocol and
registered by importing it, runs in the Linen LM (forward and KV-cache decoding) and in the NNX
layer, each equal to a float64 reference written here from the formula. It runs in a fresh
process, since the models read the registry when they are imported."""

import json

from tests.config_helpers import run_on_fake_devices

_SCRIPT = r'''
import json
import flax
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
import tests.toy_encoding as toy  # the one module: it registers the encoding
from goat_jax import nnx as gnnx
from goat_jax.models.lm import LMConfig, TransformerLM
from goat_jax.kernels.plan import AttentionPlan

E, N, K, H, V, T = 16, 4, 2, 4, 11, 9


def softplus(x):
    return np.log1p(np.exp(x))


def attention64(w, x):
    """Causal GQA attention with the learned recency slope, float64, from the formula."""
    proj = lambda name: np.einsum("bte,enh->btnh", x, w[name]["kernel"]) + (w[name]["bias"] if "bias" in w[name] else 0)
    q, k, v = proj("q_proj"), np.repeat(proj("k_proj"), N // K, 2), np.repeat(proj("v_proj"), N // K, 2)
    t = x.shape[1]
    i = np.arange(t)
    logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
    logits = logits - softplus(w["toy_slope_raw"])[:, None, None] * (i[:, None] - i[None, :])
    logits = np.where(i[None, :] <= i[:, None], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bnts,bsnh->btnh", p, v)
    y = np.einsum("btnh,nhe->bte", out, w["out_proj"]["kernel"])
    return y + (w["out_proj"]["bias"] if "bias" in w["out_proj"] else 0)


def rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale


def lm64(w, tokens, cfg):
    """The one-layer Llama-style LM (RMSNorm, SwiGLU, tied embeddings), float64."""
    x = w["embed"]["embedding"][tokens]
    blk = w["layer_0"]
    x = x + attention64(blk["attention"], rms(x, blk["attn_norm"]["scale"], cfg.norm_eps))
    h = rms(x, blk["mlp_norm"]["scale"], cfg.norm_eps)
    m = blk["mlp"]
    g, u = h @ m["wi_0"]["kernel"], h @ m["wi_1"]["kernel"]
    x = x + ((g / (1 + np.exp(-g))) * u) @ m["wo"]["kernel"]
    return rms(x, w["final_norm"]["scale"], cfg.norm_eps) @ w["embed"]["embedding"].T


f64 = lambda tree: jax.tree.map(lambda a: np.asarray(a, np.float64), flax.core.meta.unbox(tree))
out = {}
cfg = LMConfig(vocab_size=V, num_layers=1, embed_dim=E, num_heads=N, kv_num_heads=K, mlp_dim=24,
               position_encoding=toy.NAME)
model = TransformerLM(cfg, plan=AttentionPlan(implementation="xla"))
rng = np.random.default_rng(0)
tokens = jnp.asarray(rng.integers(0, V, size=(2, T)), jnp.int32)
variables = model.init(jax.random.PRNGKey(0), tokens)
out["param"] = "toy_slope_raw" in variables["params"]["layer_0"]["attention"]
logits = np.asarray(model.apply(variables, tokens))
want = lm64(f64(variables["params"]), np.asarray(tokens), cfg)
out["lm_error"] = float(np.max(np.abs(logits - want)) / np.max(np.abs(want)))
# KV-cache decoding: the prompt in one chunk, then one token at a time, equal to the full forward.
dm = model.clone(decode=True)
cache = dm.init(jax.random.PRNGKey(0), tokens)["cache"]
steps = []
for lo, hi in ((0, 5), (5, 6), (6, 7), (7, 8), (8, 9)):
    lg, state = dm.apply({"params": variables["params"], "cache": cache}, tokens[:, lo:hi], mutable=["cache"])
    cache = state["cache"]
    steps.append(np.asarray(lg))
out["decode_error"] = float(np.max(np.abs(np.concatenate(steps, 1) - want)) / np.max(np.abs(want)))
# The NNX layer of the same encoding, on its own weights.
layer = gnnx.PositionalAttention(N, in_features=E, kv_num_heads=K, head_dim=H, position_encoding=toy.NAME,
                                 rngs=nnx.Rngs(1))
x = rng.normal(size=(2, T, E))
got = np.asarray(layer(jnp.asarray(x, jnp.float32), is_causal=True))
w = f64(nnx.state(layer, nnx.Param).to_pure_dict())
want = attention64(w, x)
out["nnx_error"] = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
out["nnx_param"] = sorted(w)
print("RESULT " + json.dumps(out))
'''


def test_a_toy_encoding_is_one_module_in_the_lm_and_the_nnx_layer():
    out = json.loads(run_on_fake_devices(_SCRIPT, devices=1).split("RESULT ")[-1])
    assert out["param"], out
    assert out["lm_error"] < 1e-5 and out["decode_error"] < 1e-5, out
    assert out["nnx_error"] < 1e-5 and "toy_slope_raw" in out["nnx_param"], out
