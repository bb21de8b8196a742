"""Edge cases of the layers: rows without visible keys, invalid positions, official-module
settings without an equivalent. Each is checked against a float64 reference or an expected
error, on every kernel that runs on CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from goat_jax import kernels
from goat_jax import prior as prior_lib
from goat_jax.layers.positional import PositionalAttention
from tests import goat_reference as ref
from tests import jitted
from tests.marks import SLOW_CASE

CPU_KERNELS = ["dense", "xla", "flash", "splash_interpret"]


def _reference_attention(q, k, v, scale, mask):
    """float64 softmax attention with a [B, 1, T, S] boolean mask; rows without a visible key
    are zeros (the masking contract)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
    logits = np.where(mask, logits, -np.inf)
    has_key = mask.any(axis=-1, keepdims=True)
    logits = np.where(has_key, logits, 0.0)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w = np.where(mask, w, 0.0)
    w = np.where(has_key, w / np.maximum(w.sum(-1, keepdims=True), 1e-300), 0.0)
    return np.einsum("bnts,bsnh->btnh", w, v)


# (is_causal, causal_offset, padding rows, kv_lengths): every case has rows with no visible key.
EMPTY_ROW_CASES = {
    "all_keys_padded": (False, 0, "batch1_all", None),
    "causal_leading_padding": (True, 0, "leading5", None),
    "causal_negative_offset": (True, -7, None, None),
    "zero_kv_length": (False, 0, None, [128, 0]),
}


@pytest.mark.parametrize("implementation", CPU_KERNELS)
@pytest.mark.parametrize("case", [
    pytest.param(c, marks=[SLOW_CASE] if c in ("causal_leading_padding",) else [])
    for c in EMPTY_ROW_CASES])
def test_rows_without_keys_are_zero_with_zero_gradient(case, implementation, rng):
    is_causal, offset, padding, lengths = EMPTY_ROW_CASES[case]
    if implementation.startswith("splash") and lengths is not None:
        pytest.skip("kv_lengths is a decoding feature; splash decodes nothing")
    b, t, n, kh, h = 2, 128, 2, 1, 8  # one whole splash block, so no padded rows
    q = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, t, kh, h)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, t, kh, h)), jnp.float32)
    pad = np.zeros((b, t), bool)
    if padding == "batch1_all":
        pad[1] = True
    elif padding == "leading5":
        pad[:, :5] = True
    pad_arg = jnp.asarray(pad) if padding else None
    len_arg = jnp.asarray(lengths, jnp.int32) if lengths else None

    mask = np.ones((b, 1, t, t), bool)
    if is_causal:
        mask &= np.arange(t)[None, :] <= np.arange(t)[:, None] + offset
    mask &= ~pad[:, None, None, :]
    if lengths:
        mask &= (np.arange(t)[None, :] < np.asarray(lengths)[:, None])[:, None, None, :]
    empty = ~mask.any(-1)[:, 0]  # [B, T]
    assert empty.any() and (~empty).any()

    @jax.jit
    def f(q, k, v):
        return kernels.attend(q, k, v, implementation=implementation, scale=0.25,
                              is_causal=is_causal, causal_offset=offset,
                              key_padding_mask=pad_arg, kv_lengths=len_arg)

    out = np.asarray(f(q, k, v))
    np.testing.assert_allclose(out, _reference_attention(q, k, v, 0.25, mask), atol=2e-5)
    assert np.all(out[empty] == 0.0)

    # No gradient flows through the empty rows (whatever their cotangent), and none is NaN.
    cotangent = jnp.asarray(rng.normal(size=out.shape), jnp.float32)
    _, vjp = jax.vjp(f, q, k, v)
    only_empty = vjp(jnp.where(jnp.asarray(empty)[:, :, None, None], cotangent, 0.0))
    assert all(np.all(np.asarray(g) == 0.0) for g in only_empty)
    grads = vjp(cotangent)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    assert np.all(np.asarray(grads[0])[empty] == 0.0)


def test_rows_with_keys_static_shortcut():
    assert kernels.AttentionMask(causal=True, offset=0).rows_with_keys(8, 8) is None
    assert kernels.AttentionMask(causal=True, offset=3).rows_with_keys(8, 8) is None
    rows = kernels.AttentionMask(causal=True, offset=-2).rows_with_keys(4, 8)
    np.testing.assert_array_equal(np.asarray(rows), [[False, False, True, True]])


@pytest.mark.parametrize("implementation", ["dense", "xla"])
def test_goat_layer_with_a_fully_padded_example_outputs_the_out_bias(implementation, rng):
    module = ref.goat_module(num_heads=4, pos_rank=2, abs_rank=2, implementation=implementation)
    x = jnp.asarray(rng.normal(size=(2, 16, 32)), jnp.float32)
    params = jitted.init(module, jax.random.key(0), x)
    params = jax.tree_util.tree_map(lambda a: a + 0.1, params)  # a non-zero out_proj bias
    pad = jnp.asarray(np.stack([np.zeros(16, bool), np.ones(16, bool)]))
    out = np.asarray(jitted.apply(module, params, x, key_padding_mask=pad))
    bias = np.asarray(ref.unboxed(params)["out_proj"]["bias"])
    np.testing.assert_allclose(out[1], np.broadcast_to(bias, out[1].shape), rtol=1e-6)
    expected0 = ref.goat_attention(params, dict(num_heads=4, kv_num_heads=4, head_dim=8,
                                                pos_rank=2, abs_rank=2), x[:1], x[:1], x[:1])
    np.testing.assert_allclose(out[:1], expected0, atol=1e-5)


# ------------------------------------------------------------------------------------------
# Positions
# ------------------------------------------------------------------------------------------

LAYERS = {
    "goat": lambda: ref.goat_module(num_heads=2, pos_rank=2, abs_rank=2, implementation="xla"),
    "rope": lambda: PositionalAttention(num_heads=2, position_encoding="rope", implementation="xla"),
}


@pytest.mark.parametrize("layer", list(LAYERS))
def test_invalid_positions_raise_naming_the_argument(layer):
    module = LAYERS[layer]()
    x = jnp.ones((1, 8, 32))
    params = jitted.init(module, jax.random.key(0), x)
    ok = jnp.arange(8, dtype=jnp.int32)
    cases = [
        (dict(q_positions=ok.astype(jnp.float32), k_positions=ok), r"q_positions must be integer"),
        (dict(q_positions=ok, k_positions=ok - 3), r"k_positions spans \[-3, 4\]"),
        (dict(q_positions=ok + prior_lib.MAX_POSITION - 4, k_positions=ok), r"q_positions spans"),
        (dict(q_positions=np.arange(8, dtype=np.int64) + 2 ** 40, k_positions=ok), r"outside \[0, MAX_POSITION"),
        (dict(position_offset_q=-1), r"^position_offset_q spans \[-1, -1\]"),
        (dict(position_offset_q=1.5), r"must be integer"),
        (dict(position_offset_k=prior_lib.MAX_POSITION - 2), r"^position_offset_k=16777214 \+ 8 tokens reaches past MAX_POSITION"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            module.apply(params, x, **kwargs)
    # The largest valid positions run and are finite.
    top = ok + prior_lib.MAX_POSITION - 8
    assert np.isfinite(np.asarray(module.apply(params, x, q_positions=top, k_positions=top))).all()


def test_position_errors_name_what_the_caller_passed():
    """Issue #53, item 18: a long input, a long KV cache (Linen init, NNX ``init_cache``) and an
    offset are named as such, not as ``q_positions`` nobody passed (shapes only: eval_shape)."""
    from flax import nnx
    from goat_jax import nnx as gnnx

    module = LAYERS["goat"]()
    x = jnp.ones((1, 8, 32))
    params = jitted.init(module, jax.random.key(0), x)
    long = jax.ShapeDtypeStruct((1, prior_lib.MAX_POSITION + 1, 32), jnp.float32)
    with pytest.raises(ValueError, match=r"^the key length: 16777217 tokens reaches past MAX_POSITION=16777216"):
        jax.eval_shape(lambda k: module.apply(params, x, k), long)
    with pytest.raises(ValueError, match=r"^the query length: 16777217 tokens reaches past"):
        jax.eval_shape(lambda q: module.apply(params, q), long)
    decoding = ref.goat_module(num_heads=2, pos_rank=2, abs_rank=2, implementation="xla", training_seq_len=16)
    with pytest.raises(ValueError, match=r"^the KV cache length \(init's input length, or init_cache's max_length\): "
                                         r"16777217 tokens reaches past"):
        jax.eval_shape(lambda q: decoding.clone(decode=True).init(jax.random.key(0), q, is_causal=True), long)
    layer = gnnx.GoatAttention(2, in_features=32, prior=decoding.prior, decode=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"^the KV cache length .*init_cache's max_length\): 16777217 tokens"):
        layer.init_cache(1, prior_lib.MAX_POSITION + 1)
    with pytest.raises(ValueError, match=r"^position_offset_q=16777210 \+ 8 tokens reaches past"):
        module.apply(params, x, position_offset_q=prior_lib.MAX_POSITION - 6)
    from goat_jax.models import LMConfig, TransformerLM  # the LM's positions= is named positions
    lm = TransformerLM(LMConfig(vocab_size=11, num_layers=1, embed_dim=32, num_heads=2, mlp_dim=32, pos_rank=2,
                                abs_rank=2, training_seq_len=None))
    tokens = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(ValueError, match=r"^positions spans \[-1, 6\], outside \[0, MAX_POSITION"):
        lm.init(jax.random.key(0), tokens, positions=np.arange(8) - 1)


@pytest.mark.parametrize("layer", list(LAYERS))
def test_traced_invalid_positions_give_nan_not_a_wrong_prior(layer):
    module = LAYERS[layer]()
    x = jnp.ones((1, 8, 32))
    params = jitted.init(module, jax.random.key(0), x)
    run = jax.jit(lambda p: module.apply(params, x, q_positions=p, k_positions=p))
    good = jnp.arange(8, dtype=jnp.int32)
    assert np.isfinite(np.asarray(run(good))).all()
    for bad in (good - 1, good + prior_lib.MAX_POSITION - 4):
        out = np.asarray(run(bad))
        assert np.isnan(out).any()


def test_2d_offsets_are_validated():
    module = ref.goat_module(num_heads=2, pos_rank=2, abs_rank=2, pos_encoding="2d")
    x = jnp.ones((1, 6, 32))
    params = jitted.init(module, jax.random.key(0), x, spatial_shape=(2, 3))
    with pytest.raises(ValueError, match=r"^position_offset_q\[0\] spans \[-1, -1\]"):
        module.apply(params, x, spatial_shape=(2, 3), position_offset_q=(-1, 0))
    with pytest.raises(ValueError, match=r"^position_offset_k\[1\] must be integer"):
        module.apply(params, x, spatial_shape=(2, 3), position_offset_k=(0, 0.5))


@pytest.mark.parametrize("pos_encoding", ["2d", "auto"])
def test_2d_goat_refuses_explicit_positions(pos_encoding):
    """Issue #53, item 6: a 2D GOAT layer takes its positions from spatial_shape; explicit 1D
    positions, even out of range, were silently ignored. Refused in one line, as rope2d does."""
    module = ref.goat_module(num_heads=2, pos_rank=2, abs_rank=2, pos_encoding=pos_encoding)
    x = jnp.ones((1, 6, 32))
    params = jitted.init(module, jax.random.key(0), x, spatial_shape=(2, 3))
    for kwargs in (dict(q_positions=jnp.arange(6)), dict(k_positions=jnp.arange(6) + 2 ** 30)):
        with pytest.raises(ValueError, match=rf"^pos_encoding='{pos_encoding}' chose 2D .*q_positions/k_positions "
                                             r"are 1D and are not supported") as info:
            module.apply(params, x, spatial_shape=(2, 3), **kwargs)
        assert "\n" not in str(info.value)


def test_2d_offsets_may_be_traced_and_grids_past_the_bound_are_refused():
    """Issue #53, items 14 and 8: a traced (row, col) offset gives what the concrete one gives
    (it raised TracerBoolConversionError), a traced scalar is refused naming the argument; a grid
    of more than 2**24 tokens is refused like a 1D sequence (its float32 indices repeated)."""
    module = ref.goat_module(num_heads=2, pos_rank=2, abs_rank=2, pos_encoding="2d", implementation="xla")
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 7, 32)), jnp.float32)
    kw = dict(spatial_shape=(2, 3), has_cls_token=True)
    params = jitted.init(module, jax.random.key(0), x, **kw)
    want = jitted.apply(module, params, x, position_offset_q=(5, 9), position_offset_k=(5, 9), **kw)
    pair = jax.jit(lambda o: module.apply(params, x, position_offset_q=o, position_offset_k=o, **kw))
    np.testing.assert_allclose(np.asarray(pair(jnp.asarray([5, 9], jnp.int32))), np.asarray(want), rtol=1e-5, atol=1e-6)
    row = jax.jit(lambda r: module.apply(params, x, position_offset_q=(r, 9), position_offset_k=(r, 9), **kw))
    np.testing.assert_allclose(np.asarray(row(jnp.int32(5))), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert np.isnan(np.asarray(row(jnp.int32(prior_lib.MAX_POSITION - 1)))).any()  # past the bound: NaN
    with pytest.raises(ValueError, match=r"^position_offset_q must be a \(row, col\) pair of integers in 2D mode"):
        jax.jit(lambda r: module.apply(params, x, position_offset_q=r, **kw))(jnp.int32(5))
    with pytest.raises(ValueError, match=r"^spatial_shape=\(4097, 4097\) with has_cls_token=True is 16785410 "
                                         r"tokens, more than MAX_POSITION=16777216"):
        prior_lib.positions_2d((4097, 4097), True)


# ------------------------------------------------------------------------------------------
# One declaration of the prior's settings
# ------------------------------------------------------------------------------------------


def test_prior_settings_are_the_one_source_and_the_param_tree_is_unchanged():
    from goat_jax.layers.goat import GoatAttention
    from goat_jax.models import LMConfig
    from goat_jax.models.lm import make_attention

    # The LM's flat config names are defaulted and validated by PriorSettings and reach the
    # layer as one object.
    assert LMConfig().prior == prior_lib.PriorSettings()
    cfg = LMConfig(pos_rank=3, abs_rank=5, prior_gate="query_norm", training_seq_len=64)
    layer = make_attention(cfg, decode=False)
    assert layer.prior == prior_lib.PriorSettings(pos_rank=3, abs_rank=5, prior_gate="query_norm",
                                                  training_seq_len=64)
    with pytest.raises(ValueError, match=r"LMConfig.prior_init='flat' is not allowed: allowed is one of \['seeded', 'uniform'\]"):
        LMConfig(prior_init="flat")
    with pytest.raises(ValueError, match="GoatAttention.prior must be a goat_jax.prior.PriorSettings"):
        GoatAttention(num_heads=2, prior={"pos_rank": 2}).init(jax.random.key(0), jnp.ones((1, 4, 32)))

    # Parameter names and shapes as before the refactor (and as the official package):
    # N=4, K=2, H=16, E=64, R=3, M=5 -> MLP in 2M + 2 = 12, hidden min(24, 4) = 4.
    import flax

    abstract = jax.eval_shape(ref.goat_module(num_heads=4, kv_num_heads=2, pos_rank=3, abs_rank=5).init,
                              jax.random.key(0), jnp.ones((1, 8, 64)))
    shapes = jax.tree_util.tree_map(jnp.shape, flax.core.meta.unbox(abstract))["params"]
    assert shapes == {
        "q_proj": {"kernel": (64, 4, 16), "bias": (4, 16)},
        "k_proj": {"kernel": (64, 2, 16), "bias": (2, 16)},
        "v_proj": {"kernel": (64, 2, 16), "bias": (2, 16)},
        "out_proj": {"kernel": (4, 16, 64), "bias": (64,)},
        "prior": {"lambda_sym": (2, 3), "lambda_asym": (2, 3), "prior_gate_scale_raw": (4,),
                  "prior_gate_bias": (4,), "sink_gain": (2,), "sink_bump": (2,),
                  "recency_slope_raw": (2,),
                  "key_bias": {"fc1": {"kernel": (12, 4), "bias": (4,)},
                               "fc2": {"kernel": (4, 1), "bias": (1,)}}},
    }


@pytest.mark.parametrize("encoding", ["rope_pi", "yarn", "ntk"])
@pytest.mark.parametrize("length", [0, -5])
def test_non_positive_training_seq_len_is_refused(encoding, length):
    """training_seq_len <= 0 is one error naming it, before any division by it."""
    layer = PositionalAttention(num_heads=2, position_encoding=encoding, training_seq_len=length)
    x = jnp.ones((1, 8, 16))
    with pytest.raises(ValueError, match=rf"training_seq_len={length} is out of range: allowed is an integer >= 1"):
        layer.init(jax.random.PRNGKey(0), x)


@pytest.mark.parametrize("encoding", ["yarn", "ntk"])
@pytest.mark.parametrize("factor", [float("inf"), float("nan"), 0.0, -2.0])
def test_invalid_rope_scaling_factor_is_refused(encoding, factor):
    """A non-finite or < 1 rope_scaling_factor is one error naming it, not NaN outputs."""
    layer = PositionalAttention(num_heads=2, position_encoding=encoding, training_seq_len=8,
                                rope_scaling_factor=factor)
    x = jnp.ones((1, 8, 16))
    with pytest.raises(ValueError, match=r"rope_scaling_factor=\S+ is (out of range|not finite): allowed is a "
                                         r"number finite in float32 >= 1"):
        layer.init(jax.random.PRNGKey(0), x)


def test_docs_capability_table_is_the_codes():
    """docs/layer.md's kernel capability table is ``capabilities.markdown_table()`` verbatim."""
    import os  # pylint: disable=g-import-not-at-top
    from goat_jax.kernels import capabilities  # pylint: disable=g-import-not-at-top
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "layer.md")) as f:
        text = f.read()
    inside = text.split("<!-- capability-table -->\n")[1].split("\n<!-- /capability-table -->")[0]
    assert inside == capabilities.markdown_table(), "regenerate the table in docs/layer.md"


@pytest.mark.parametrize("layer", ["goat", "rope"])
def test_a_decoding_call_of_another_batch_than_the_cache_names_both(layer, rng):
    """A Linen cache made by init on batch 2, called with batch 1 or 3: the error named JAX
    internals (``Incompatible q ... k ...``, ``dynamic_update_slice ...``) and never the cache."""
    module = (ref.goat_module(num_heads=4, pos_rank=2, abs_rank=2, training_seq_len=16, decode=True)
              if layer == "goat" else PositionalAttention(num_heads=4, position_encoding="rope", decode=True))
    x = jnp.asarray(rng.normal(size=(2, 8, 32)), jnp.float32)
    variables = jitted.init(module, jax.random.key(0), x, is_causal=True)
    for batch in (1, 3):
        with pytest.raises(ValueError, match=rf"^decode=True: this call has batch {batch}, but the KV cache holds "
                                             rf"batch 2 .*init \(its 'cache' collection\) on an input of batch {batch}"):
            module.apply(variables, jnp.zeros((batch, 1, 32)), is_causal=True, mutable=["cache"])
    jitted.apply(module, variables, x[:, :1], is_causal=True, mutable=["cache"])  # the cache's batch decodes
