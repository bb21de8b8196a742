"""Attention layers keep their parameters and outputs across refactors.

``tests/data/attention_fingerprints.npz`` holds, for GoatAttention and every
PositionalAttention encoding (plus the absolute embeddings), the initial parameters at a fixed
seed and the outputs on fixed inputs, recorded from main @ aff7b72 (before the position
encodings became a package and ``goat_jax/prior.py`` was split). Parameters must match bit for
bit (the same names, shapes and draws); outputs to float32 rounding, since another CPU may
fuse the same XLA program differently.

Re-record (only when a change of parameters or numerics is intended, and say so in the commit):
``PYTHONPATH=$PWD python tests/test_attention_fingerprints.py --record``.
"""

import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from goat_jax import PriorSettings
from goat_jax.layers.goat import GoatAttention
from goat_jax.layers.positional import PositionalAttention
from goat_jax.positional import LearnedPositionEmbedding, sincos_2d_embedding, sinusoidal_embedding
from tests.marks import SLOW_CASE

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "attention_fingerprints.npz")
E, T, S = 16, 8, 6  # model dim, query length, cross-attention key length
LAYER = dict(num_heads=4, kv_num_heads=2, head_dim=8)  # GQA groups of 2
PRIOR = PriorSettings(pos_rank=2, abs_rank=2, training_seq_len=8)


def _inputs():
    """Fixed inputs (NumPy's generator is the same on every platform)."""
    g = np.random.default_rng(1234)
    x = jnp.asarray(g.normal(size=(2, T, E)), jnp.float32)
    kv = jnp.asarray(g.normal(size=(2, S, E)), jnp.float32)
    pad = jnp.asarray(np.arange(S)[None, :] >= np.array([[S], [S - 2]]))  # batch 1: 2 padded keys
    return x, kv, pad


def _flat(tree, prefix):
    leaves = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(tree))[0]
    return {prefix + jax.tree_util.keystr(path): np.asarray(leaf, np.float32) for path, leaf in leaves}


def _layer_case(module, call_kwargs=None, init_args=None, mutable_intermediates=False):
    """Init at seed 0, then one forward; returns {'params...': ..., 'out': ..., 'probs': ...}."""
    x = _inputs()[0]
    call_kwargs = call_kwargs or {}
    init_args = init_args or (x,)
    variables = module.init(jax.random.PRNGKey(0), *init_args, **call_kwargs)
    result = _flat(variables["params"], "params")
    if mutable_intermediates:
        out, state = module.apply(variables, *init_args, **call_kwargs, mutable=["intermediates"])
        result.update(_flat(state["intermediates"], "intermediates"))
    else:
        out = module.apply(variables, *init_args, **call_kwargs)
    result["out"] = np.asarray(out, np.float32)
    return result


def _decode_case(module):
    """Init sizes the cache from a full-length input; then a chunk of 3 tokens and one token."""
    x = _inputs()[0]
    variables = module.init(jax.random.PRNGKey(0), x, is_causal=True)
    result = _flat(variables["params"], "params")
    cache = variables["cache"]
    for i, (lo, hi) in enumerate(((0, 3), (3, 4))):
        out, state = module.apply({"params": variables["params"], "cache": cache}, x[:, lo:hi],
                                  is_causal=True, mutable=["cache"])
        cache = state["cache"]
        result[f"out{i}"] = np.asarray(out, np.float32)
    result.update(_flat(cache, "cache"))
    return result


def _cases():
    x, kv, pad = _inputs()
    goat = lambda **kw: GoatAttention(**LAYER, prior=kw.pop("prior", PRIOR), **kw)
    pos = lambda enc, **kw: PositionalAttention(**LAYER, position_encoding=enc, training_seq_len=4,
                                                max_len=16, **kw)
    causal = {"is_causal": True}
    offsets = {"is_causal": True, "position_offset_q": 3, "position_offset_k": 3}
    cases = {
        "goat_causal_offsets": lambda: _layer_case(goat(), offsets),
        "goat_cross_padding_gate": lambda: _layer_case(
            goat(prior=PriorSettings(pos_rank=2, abs_rank=2, prior_gate="query_norm"), out_features=12),
            {"key_padding_mask": pad}, (x, kv)),
        "goat_2d_cls": lambda: _layer_case(goat(pos_encoding="2d"), {"spatial_shape": (2, 3),
                                                                    "has_cls_token": True},
                                           (x[:, :7],)),
        "goat_dense_sown": lambda: _layer_case(goat(implementation="dense"), causal,
                                               mutable_intermediates=True),
        "goat_flash": lambda: _layer_case(goat(implementation="flash"), causal),
        "goat_bf16": lambda: _layer_case(goat(dtype=jnp.bfloat16, kernel_init_std=0.02), causal),
        "goat_decode": lambda: _decode_case(goat(decode=True)),
        "rope2d_cls": lambda: _layer_case(pos("rope2d", rope_base=100.0),
                                          {"spatial_shape": (2, 3), "has_cls_token": True}, (x[:, :7],)),
        "nope_2d": lambda: _layer_case(pos("nope"), {"spatial_shape": (2, 4)}),
        "rope_dense_sown": lambda: _layer_case(pos("rope", implementation="dense"), causal,
                                               mutable_intermediates=True),
        "alibi_packed_flash": lambda: _layer_case(pos("alibi_packed", implementation="flash"), causal),
        "alibi_cross_padding": lambda: _layer_case(pos("alibi", attention_scale=1.0),
                                                   {"key_padding_mask": pad}, (x, kv)),
        "naive_prior_positions": lambda: _layer_case(
            pos("naive_prior"), {"q_positions": jnp.arange(T) + 2, "k_positions": jnp.arange(T) * 2}),
        "rope_bf16": lambda: _layer_case(pos("rope", dtype=jnp.bfloat16), causal),
        "alibi_packed_bf16": lambda: _layer_case(pos("alibi_packed", dtype=jnp.bfloat16), causal),
        "absolute_embeddings": lambda: {
            **_layer_case(LearnedPositionEmbedding(max_len=10, features=E), init_args=(jnp.arange(T),)),
            "sinusoidal": np.asarray(sinusoidal_embedding(jnp.arange(T) + 5, E)),
            "sincos2d": np.asarray(sincos_2d_embedding(2, 3, E))},
    }
    for enc in ("nope", "rope", "rope_pi", "alibi", "alibi_packed", "naive_prior"):
        cases[f"{enc}_causal_offsets"] = lambda enc=enc: _layer_case(pos(enc), offsets)
        cases[f"{enc}_decode"] = lambda enc=enc: _decode_case(pos(enc, decode=True))
    return cases


CASES = _cases()
# The default suite keeps one GOAT case (its parameters; eager GOAT layers cost most of the time)
# and every encoding's; the other paths (also tested against float64 references elsewhere) are slow.
SLOW = ("goat_cross_padding_gate", "goat_2d_cls", "goat_decode", "goat_dense_sown", "goat_flash", "goat_bf16",
        "alibi_packed_flash", "rope_bf16", "alibi_packed_bf16", "alibi_cross_padding", "rope2d_cls",
        "naive_prior_positions")


def _record():
    arrays = {}
    for name, case in CASES.items():
        arrays.update({f"{name}/{key}": value for key, value in case().items()})
    os.makedirs(os.path.dirname(FIXTURE), exist_ok=True)
    np.savez_compressed(FIXTURE, **arrays)
    print(f"wrote {len(arrays)} arrays to {FIXTURE}")


@pytest.fixture(scope="module")
def recorded():
    with np.load(FIXTURE) as f:
        return {key: f[key] for key in f.files}


_SCRIPT = ("import sys, numpy as np; from tests.test_attention_fingerprints import CASES; "
           "np.savez(sys.argv[2], **{f'{n}/{k}': v for n in sys.argv[1].split(',') for k, v in CASES[n]().items()})")


@pytest.fixture(scope="module")
def at_defaults(tmp_path_factory):
    """A case's arrays computed at XLA's default optimization level, as recorded
    (:func:`tests.config_helpers.run_at_xla_defaults`): every default case in one process on
    the first call, any other case in a process of its own."""
    from tests import config_helpers  # pylint: disable=g-import-not-at-top

    def compute(names):
        path = str(tmp_path_factory.mktemp("fingerprints") / "arrays.npz")
        config_helpers.run_at_xla_defaults(_SCRIPT, ",".join(names), path)
        with np.load(path) as f:
            return {n: {key.split("/", 1)[1]: f[key] for key in f.files if key.startswith(n + "/")} for n in names}
    return config_helpers.computed_in_batches(compute, [n for n in sorted(CASES) if n not in SLOW])


@pytest.mark.parametrize("name", [pytest.param(n, marks=SLOW_CASE) if n in SLOW else n
                                  for n in sorted(CASES)])
def test_parameters_and_outputs_match_the_recording(name, recorded, at_defaults):
    got = at_defaults(name)
    want = {key.split("/", 1)[1]: value for key, value in recorded.items() if key.startswith(name + "/")}
    assert sorted(got) == sorted(want), "parameter/cache names changed"
    for key, value in want.items():
        assert got[key].shape == value.shape, key
        if key.startswith("params"):
            np.testing.assert_array_equal(got[key], value, err_msg=key)  # bit for bit
        else:  # bf16 layers: one bf16 rounding step (2**-8) of another CPU's fusion
            tol = 8e-3 if "bf16" in name else 2e-6
            np.testing.assert_allclose(got[key], value, rtol=tol, atol=tol, err_msg=key)


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: PYTHONPATH=$PWD python tests/test_attention_fingerprints.py --record")
    _record()
