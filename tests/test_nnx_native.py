"""The native NNX layers (goat_jax.nnx): with the Linen module's weights, the same outputs and
gradients (nnx.grad vs jax.grad) on 'xla' and 'flash'; the Linen parameter tree, dtypes and
logical axis names; nnx.jit; KV-cache decoding; one-line construction errors. Tiny shapes."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from goat_jax import nnx as gnnx
from goat_jax.layers import core as attention_core
from goat_jax.layers import nnx as nnx_layers
from goat_jax.layers.positional import PositionalAttention
from tests import goat_reference as ref

B, T, E = 2, 8, 32


def _goat(**kw):
    return ref.goat_module(num_heads=4, kv_num_heads=2, pos_rank=2, abs_rank=2, training_seq_len=16, **kw)


# name: (Linen module, call keywords, input length). Each runs on 'xla' and 'flash'.
CASES = {
    "goat": (lambda impl: _goat(implementation=impl), {"is_causal": True}, T),
    "goat_segments_logn": (lambda impl: _goat(implementation=impl, logn_scaling="content"),
                           {"is_causal": True, "segment_ids": np.array([[0, 0, 0, 1, 1, 1, 1, 1]] * B)}, T),
    "rope": (lambda impl: PositionalAttention(num_heads=4, kv_num_heads=2, position_encoding="rope",
                                              implementation=impl), {"is_causal": True}, T),
    "alibi_packed": (lambda impl: PositionalAttention(num_heads=4, position_encoding="alibi_packed",
                                                      implementation=impl), {"is_causal": True}, T),
    "fox": (lambda impl: PositionalAttention(num_heads=4, position_encoding="fox", implementation=impl),
            {"is_causal": True}, T),
    # A 2x2 patch grid with a CLS token first (5 tokens), non-causal.
    "rope2d_cls": (lambda impl: PositionalAttention(num_heads=4, position_encoding="rope2d", implementation=impl),
                   {"spatial_shape": (2, 2), "has_cls_token": True}, 5),
    "rope_mixed_cls": (lambda impl: PositionalAttention(num_heads=4, position_encoding="rope_mixed",
                                                        implementation=impl),
                       {"spatial_shape": (2, 2), "has_cls_token": True}, 5),
}
# Every other 1D encoding of the layer, past its training length where it has one (T = 8 > 4).
for _enc, _kw in (("nope", {}), ("rope_pi", {"training_seq_len": 4}), ("ntk", {"training_seq_len": 4}),
                  ("yarn", {"training_seq_len": 4}), ("naive_prior", {"max_len": 16}), ("alibi", {}),
                  ("fire", {}), ("kerple_log", {})):
    CASES[_enc] = (lambda impl, _enc=_enc, _kw=_kw: PositionalAttention(
        num_heads=4, position_encoding=_enc, implementation=impl, **_kw), {"is_causal": True}, T)
# GOAT on the Pallas splash kernel in interpret mode (lengths a multiple of 128).
CASES["goat_splash"] = (lambda impl: _goat(implementation=impl), {"is_causal": True}, 128)
# The encodings that materialize a bias run on the XLA kernel only (a flash kernel is refused by name).
BIAS_ONLY = {"alibi", "fire", "kerple_log", "naive_prior"}
DEFAULT = {("goat", "xla"), ("goat_segments_logn", "flash"), ("rope", "flash"), ("fox", "xla"), ("rope2d_cls", "xla"),
           ("alibi", "xla")}


def _cases():
    for name in CASES:
        impls = ("splash_interpret",) if name == "goat_splash" else ("xla",) if name in BIAS_ONLY else ("xla", "flash")
        for impl in impls:
            marks = [] if (name, impl) in DEFAULT else [pytest.mark.slow(reason="the default suite runs one kernel per encoding")]
            yield pytest.param(name, impl, marks=marks, id=f"{name}-{impl}")


def nn_unbox(tree):
    return nn.meta.unbox(tree)


def _flat(tree):
    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("name,impl", list(_cases()))
def test_outputs_and_gradients_equal_linen(name, impl, rng):
    make, call, length = CASES[name]
    module = make(impl)
    x = jnp.asarray(rng.normal(size=(B, length, E)), jnp.float32)
    # The Linen params of a native layer (to_linen), moved off their initial values, then back
    # into a new native layer (from_linen): both directions of the weight transfer.
    _, variables = gnnx.to_linen(gnnx.like_linen(module, E, rngs=nnx.Rngs(0)))
    params = jax.tree.map(lambda p: p + 0.1 * jnp.asarray(rng.normal(size=p.shape), p.dtype), variables["params"])
    layer = gnnx.from_linen(module, {"params": params})
    target = jnp.asarray(rng.normal(size=(B, length, E)), jnp.float32)

    def loss(y):
        return jnp.sum((y - target) ** 2), y

    (_, y_nnx), g_nnx = nnx.jit(nnx.value_and_grad(lambda m: loss(m(x, **call)), has_aux=True))(layer)
    (_, y_linen), g_linen = jax.jit(jax.value_and_grad(
        lambda p: loss(module.apply({"params": p}, x, **call)), has_aux=True))(params)
    np.testing.assert_allclose(np.asarray(y_nnx), np.asarray(y_linen), rtol=1e-5, atol=1e-6)
    g_nnx, g_linen = _flat(g_nnx.to_pure_dict()), _flat(g_linen)
    assert set(g_nnx) == set(g_linen)
    for path, g in g_linen.items():
        np.testing.assert_allclose(np.asarray(g_nnx[path]), np.asarray(g), rtol=1e-4, atol=1e-5, err_msg=path)
    assert np.abs(np.asarray(g_linen["['q_proj']['kernel']"])).max() > 0


def test_parameters_are_the_linen_tree_with_its_axis_names_and_dtypes():
    """Eager construction makes the Linen init's tree: names, shapes, dtypes (bfloat16
    params where asked, the prior float32) and, for every logically boxed Linen parameter, the
    same names as the NNX variable's ``out_sharding``; to_linen gives back the module and tree."""
    x = jnp.zeros((1, 3, E))
    for linen, layer in (
            (_goat(param_dtype=jnp.bfloat16),
             gnnx.GoatAttention(4, in_features=E, kv_num_heads=2, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0),
                                prior=_goat().prior)),
            (PositionalAttention(num_heads=4, position_encoding="fox"),
             gnnx.PositionalAttention(4, in_features=E, position_encoding="fox", rngs=nnx.Rngs(1)))):
        boxed = jax.eval_shape(lambda: linen.init(jax.random.key(0), x, is_causal=True))["params"]
        want = _flat(nn_unbox(boxed))
        state = nnx.state(layer, nnx.Param)
        got = _flat(state.to_pure_dict())
        assert {p: (v.shape, v.dtype) for p, v in got.items()} == {p: (v.shape, v.dtype) for p, v in want.items()}
        names = {jax.tree_util.keystr(p): b.names for p, b in jax.tree_util.tree_leaves_with_path(
            boxed, is_leaf=lambda b: hasattr(b, "names")) if hasattr(b, "names")}
        assert names and any("prior" not in p for p in names)
        variables = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(
            state, is_leaf=lambda v: isinstance(v, nnx.Variable))}
        for path, axes in names.items():
            assert variables[path].get_metadata()["out_sharding"] == axes, path
        module, variables = gnnx.to_linen(layer)
        fields = nnx_layers._linen_fields(type(linen))
        assert type(module) is type(linen) and all(getattr(module, f) == getattr(linen, f) for f in fields)
        assert _flat(variables["params"]).keys() == want.keys()


def test_nnx_jit_and_update_from_linen_params(rng):
    module = _goat(implementation="xla")
    x = jnp.asarray(rng.normal(size=(B, T, E)), jnp.float32)
    params = module.init(jax.random.key(3), x, is_causal=True)
    layer = gnnx.GoatAttention(4, in_features=E, kv_num_heads=2, prior=module.prior, implementation="xla",
                               rngs=nnx.Rngs(0))
    gnnx.load_linen_params(layer, params)  # plain nnx.update on the same tree, boxed params accepted
    y = nnx.jit(lambda m, x: m(x, is_causal=True))(layer, x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(module.apply(params, x, is_causal=True)),
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="missing.*out_proj"):
        gnnx.load_linen_params(layer, {k: v for k, v in params["params"].items() if k != "out_proj"})


@pytest.mark.parametrize("build,match", [
    (lambda: gnnx.GoatAttention(4, in_features=8, prior=ref.goat_module(num_heads=4, pos_rank=2).prior,
                                rngs=nnx.Rngs(0)), "head_dim=2 is too small for the prior"),
    (lambda: gnnx.GoatAttention(4, in_features=E, rngs=nnx.Rngs(0), prior=_goat().prior).init_cache(1, 4),
     "needs a layer built with decode=True"),
    (lambda: gnnx.GoatAttention(4, in_features=E, decode=True, rngs=nnx.Rngs(0),
                                prior=ref.goat_module(num_heads=4, pos_rank=2, abs_rank=2).prior),
     "KV-cache decoding needs training_seq_len"),
    (lambda: gnnx.GoatAttention(3, in_features=E, kv_num_heads=2, rngs=nnx.Rngs(0)), "multiple of kv_num_heads"),
    (lambda: gnnx.GoatAttention(4, in_features=E, logn_scaling="content", rngs=nnx.Rngs(0),
                                prior=ref.goat_module(num_heads=4, pos_rank=2, abs_rank=2).prior),
     "needs training_seq_len"),
    (lambda: gnnx.PositionalAttention(4, in_features=E, position_encoding="rotary", rngs=nnx.Rngs(0)),
     "Unknown position_encoding='rotary'"),
    (lambda: gnnx.PositionalAttention(4, in_features=24, position_encoding="rope2d", rngs=nnx.Rngs(0)),
     "rope2d"),
    (lambda: gnnx.PositionalAttention(4, in_features=E, position_encoding="alibi", implementation="flash",
                                      rngs=nnx.Rngs(0)), "does not take"),
    (lambda: gnnx.PositionalAttention(4, in_features=E, position_encoding="naive_prior", rngs=nnx.Rngs(0)),
     "max_len"),
])
def test_construction_errors_are_one_line(build, match):
    with pytest.raises(ValueError, match=match) as err:
        build()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["goat", pytest.param("fox", marks=pytest.mark.slow(
    reason="goat covers the NNX cache; fox adds its own cache variable"))])
def test_decoding_with_the_kv_cache_equals_the_full_forward(name, rng):
    """A prompt chunk then token by token under nnx.jit, the cache in nnx.Cache variables, equals
    the Linen full forward with the same weights; an overflowing cache gives NaN, and decoding
    before init_cache names it."""
    module = CASES[name][0]("xla")
    x = jnp.asarray(rng.normal(size=(B, T, E)), jnp.float32)
    _, variables = gnnx.to_linen(gnnx.like_linen(module, E, rngs=nnx.Rngs(0)))
    layer = gnnx.from_linen(module.clone(decode=True), variables)
    with pytest.raises(ValueError, match="init_cache"):
        layer(x[:, :1], is_causal=True)
    layer.init_cache(B, T)
    step = nnx.jit(lambda m, x: m(x, is_causal=True))
    y = jnp.concatenate([step(layer, x[:, :4])] + [step(layer, x[:, i:i + 1]) for i in range(4, T)], axis=1)
    np.testing.assert_allclose(np.asarray(y), np.asarray(module.apply(variables, x, is_causal=True)),
                               rtol=1e-5, atol=1e-5)
    assert int(nnx.state(layer, nnx.Cache)["cache_index"].get_value()) == T
    assert np.isnan(np.asarray(step(layer, x[:, :1]))).all()


def test_unknown_keyword_names_the_fields():
    with pytest.raises(TypeError, match=r"unexpected keyword\(s\) \['heads'\]"):
        gnnx.GoatAttention(4, in_features=E, heads=2, rngs=nnx.Rngs(0))


def test_construction_under_a_mesh_shards_by_the_logical_rules():
    """Under a mesh (Auto axes) and Linen logical-axis rules, parameters are made sharded to the
    rules' mesh axes, as nnx.bridge makes the Linen module's (one device: the spec is checked).
    An Explicit-axes mesh fails for both alike (with_sharding_constraint as an assert)."""
    mesh = jax.make_mesh((1,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    rules = (("heads", "model"), ("kv_heads", "model"), ("embed", None), ("kv", None))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        layer = gnnx.PositionalAttention(4, in_features=E, position_encoding="fox", rngs=nnx.Rngs(0))
    params = nnx.state(layer, nnx.Param)
    assert params["q_proj"]["kernel"].get_value().sharding.spec == jax.sharding.PartitionSpec(None, "model", None)
    assert params["fox_gate"].get_value().sharding.spec == jax.sharding.PartitionSpec(None, "model")


def test_building_in_a_mesh_without_axis_rules_names_the_fix():
    """Issue #53, item 16: inside a mesh but without logical axis rules, NNX took the parameters'
    logical names for mesh axes ("Resource axis: embed ... not found"); now one line names the
    rules to enter. With them the same layer builds."""
    from goat_jax.train import sharding

    mesh = jax.make_mesh((1, 1, 1, 1), sharding.MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 4)
    build = lambda: gnnx.GoatAttention(4, in_features=E, kv_num_heads=2, prior=_goat().prior, rngs=nnx.Rngs(0))
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match=r"^GoatAttention is built inside a mesh .* logical axis names "
                                             r"\['embed', 'heads', 'kv', 'kv_heads'\] have no logical axis rule.*"
                                             r"logical_axis_rules\(goat_jax.train.sharding.DEFAULT_RULES") as info:
            build()
        assert "\n" not in str(info.value)
        with nn.logical_axis_rules(tuple(sharding.DEFAULT_RULES) + (("kv", None),)):
            assert nnx.state(build(), nnx.Param)["q_proj"]["kernel"].get_value().shape == (E, 4, E // 4)
    build()  # outside a mesh: no rules needed


_SHARDED_STEP = """
import jax, jax.numpy as jnp, numpy as np, flax.linen as nn
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from goat_jax import nnx as gnnx
from goat_jax.prior import PriorSettings
from goat_jax.train import sharding

assert jax.device_count() == 8
mesh = jax.make_mesh((4, 1, 1, 2), sharding.MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 4)
prior = PriorSettings(pos_rank=2, abs_rank=2, training_seq_len=16)
# NNX resolves every logical name through the rules (an unlisted one is taken for a mesh axis), so
# the names the engine leaves replicated are listed with None.
rules = tuple(sharding.DEFAULT_RULES) + (("kv", None),)
with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    layer = gnnx.GoatAttention(4, in_features=32, kv_num_heads=2, prior=prior, rngs=nnx.Rngs(0))
    kernel = nnx.state(layer, nnx.Param)["q_proj"]["kernel"].get_value()
    assert "tensor" in kernel.sharding.spec and len(kernel.sharding.device_set) == 8, kernel.sharding
    x = jax.device_put(jnp.asarray(np.random.default_rng(0).normal(size=(8, 16, 32)), jnp.float32),
                       NamedSharding(mesh, P("data")))

    @nnx.jit
    def step(m, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x, is_causal=True) ** 2))(m)
        return loss, grads, m(x, is_causal=True)

    loss, grads, y = step(layer, x)
    assert y.sharding.spec[0] == "data" or y.sharding.is_equivalent_to(x.sharding, 3), y.sharding
# The same weights on one device, through the Linen module: the same output and gradients.
module, variables = gnnx.to_linen(layer)
params = jax.device_get(variables["params"])
x1 = jax.device_get(x)
f = lambda p: jnp.mean(module.apply({"params": p}, x1, is_causal=True) ** 2)
loss1, grads1 = jax.value_and_grad(f)(params)
np.testing.assert_allclose(np.asarray(y), np.asarray(module.apply({"params": params}, x1, is_causal=True)),
                           rtol=1e-5, atol=1e-6)
np.testing.assert_allclose(float(loss), float(loss1), rtol=1e-5)
g = jax.device_get(grads.to_pure_dict())
for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(grads1)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
print("OK")
"""


def test_a_jitted_step_on_8_devices_runs_sharded_and_equals_one_device():
    """On 8 fake CPU devices (a 4 x 1 x 2 data/fsdp/tensor mesh, the engine's logical rules): the
    native layer's parameters are made sharded over the mesh, a jitted value-and-grad step runs on
    a batch sharded over ``data``, and its output, loss and gradients equal the same weights' on one
    device through the Linen module."""
    from tests.config_helpers import run_on_fake_devices

    assert run_on_fake_devices(_SHARDED_STEP, timeout=600).strip().endswith("OK")


def test_stacked_layers_under_nnx_vmap_and_scan_equal_the_layers_one_by_one():
    """Two GOAT layers made at once (``nnx.split_rngs`` + ``nnx.vmap``: one stacked state) and
    applied with ``nnx.scan`` over the stack (a residual carry) give what the same two layers,
    sliced out of the stack, give applied one after the other."""
    prior = _goat().prior

    @nnx.split_rngs(splits=2)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return gnnx.GoatAttention(4, in_features=E, kv_num_heads=2, prior=prior, rngs=rngs)

    layers = make(nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(B, T, E)), jnp.float32)

    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def forward(layer, h):
        return h + layer(h, is_causal=True)

    y = forward(layers, x)
    graphdef, state = nnx.split(layers)
    assert nnx.state(layers, nnx.Param)["q_proj"]["kernel"].get_value().shape[0] == 2  # stacked
    h = x
    for i in range(2):
        h = h + nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))(h, is_causal=True)
    np.testing.assert_allclose(np.asarray(y), np.asarray(h), rtol=1e-6, atol=1e-6)
    assert not np.allclose(np.asarray(y), np.asarray(x))


def test_the_dense_kernel_sows_the_linen_layers_attention_maps():
    """With implementation='dense' every call sows the attention probabilities, content keys and
    values as ``nnx.Intermediate`` (the Linen layer's ``intermediates``), equal to the Linen
    layer's with the same weights, under ``nnx.jit`` too; other kernels sow nothing."""
    module = _goat(implementation="dense")
    layer = gnnx.like_linen(module, E, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(B, T, E)), jnp.float32)
    _, variables = gnnx.to_linen(layer)
    _, state = module.apply(variables, x, is_causal=True, mutable=["intermediates"])
    for call in (lambda m: m(x, is_causal=True), nnx.jit(lambda m: m(x, is_causal=True))):
        call(layer)
        sown = nnx.pop(layer, nnx.Intermediate).to_pure_dict()
        assert set(sown) == {"attention_probs", "attention_keys", "attention_values"}
        for name, (want,) in state["intermediates"].items():
            np.testing.assert_allclose(np.asarray(sown[name][0]), np.asarray(want), rtol=1e-6, atol=1e-7, err_msg=name)
    plain = gnnx.like_linen(_goat(implementation="xla"), E, rngs=nnx.Rngs(0))
    plain(x, is_causal=True)
    assert not nnx.pop(plain, nnx.Intermediate).to_pure_dict()


def _cache(layer):
    return {k: np.asarray(v) for k, v in nnx.state(layer, nnx.Cache).to_pure_dict().items()}


def test_a_call_with_another_batch_than_the_cache_is_refused_and_changes_nothing(rng):
    """After init_cache(2, 16), a call of batch 1 wrote the cache and moved its index before the
    kernel refused it (``Incompatible q ... k``), and the next correct call was wrong by O(1)
    with no error; batch 3 failed inside dynamic_update_slice. Now both are refused before any
    write, naming the cache's batch, the call's and init_cache; the next call is exact."""
    module = _goat(implementation="xla")
    _, variables = gnnx.to_linen(gnnx.like_linen(module, E, rngs=nnx.Rngs(0)))
    layer = gnnx.from_linen(module.clone(decode=True), variables)
    layer.init_cache(2, 16)
    x = jnp.asarray(rng.normal(size=(2, 4, E)), jnp.float32)
    before = _cache(layer)
    for bad in (x[:1], jnp.concatenate([x, x[:1]])):
        with pytest.raises(ValueError, match=rf"decode=True: this call has batch {bad.shape[0]}, but the KV cache "
                                             r"holds batch 2 .*init_cache\(" + str(bad.shape[0])) as err:
            layer(bad, is_causal=True)
        assert "\n" not in str(err.value)
        after = _cache(layer)
        assert all(np.array_equal(after[k], before[k]) for k in before)
    np.testing.assert_allclose(np.asarray(layer(x, is_causal=True)),
                               np.asarray(module.apply(variables, x, is_causal=True)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["goat", "fox"])
def test_a_call_that_fails_after_writing_leaves_the_cache_untouched(name, rng, monkeypatch):
    """The class of item 3: whatever fails during a decoding call (here the kernel, after the
    cache write and fox's running forget sum), the layer's cache is as before the call, eager
    and under nnx.jit."""

    module = CASES[name][0]("xla")
    layer = gnnx.like_linen(module.clone(decode=True), E, rngs=nnx.Rngs(0))
    layer.init_cache(B, T)
    x = jnp.asarray(rng.normal(size=(B, 3, E)), jnp.float32)
    layer(x, is_causal=True)
    before = _cache(layer)

    def broken(*args, **kwargs):
        raise RuntimeError("the kernel failed")

    monkeypatch.setattr(attention_core.kernels, "attend", broken)
    for call in (lambda m, x: m(x, is_causal=True), nnx.jit(lambda m, x: m(x, is_causal=True))):
        with pytest.raises(RuntimeError, match="the kernel failed"):
            call(layer, x[:, :1])
        after = _cache(layer)
        assert set(after) == set(before) and all(np.array_equal(after[k], before[k]) for k in before)


def test_a_call_that_fails_after_attending_sows_nothing(rng, monkeypatch):
    """Sown attention maps ('dense') are kept only from calls that return: an error in the
    output projection, after the kernel, leaves no Intermediate behind."""
    layer = gnnx.like_linen(_goat(implementation="dense"), E, rngs=nnx.Rngs(0))
    x = jnp.asarray(rng.normal(size=(B, T, E)), jnp.float32)
    project = attention_core.project

    def broken(projection, *args):
        if projection.name == "out_proj":
            raise RuntimeError("the projection failed")
        return project(projection, *args)

    monkeypatch.setattr(attention_core, "project", broken)
    with pytest.raises(RuntimeError, match="the projection failed"):
        layer(x, is_causal=True)
    assert not nnx.pop(layer, nnx.Intermediate).to_pure_dict()


def test_an_input_of_another_width_names_in_features():
    """in_features=32 called on width 24 failed inside opt_einsum ("Size of label 'e' ...")."""
    layer = gnnx.GoatAttention(4, in_features=E, rngs=nnx.Rngs(0), prior=_goat().prior)
    with pytest.raises(ValueError, match=rf"^GoatAttention was built with in_features={E}, but query has width 24"):
        layer(jnp.zeros((B, T, 24)), is_causal=True)
    cross = gnnx.GoatAttention(4, in_features=E, kv_features=16, rngs=nnx.Rngs(0), prior=_goat().prior)
    with pytest.raises(ValueError, match=r"^GoatAttention was built with kv_features=16, but key has width 24"):
        cross(jnp.zeros((B, T, E)), jnp.zeros((B, T, 24)))
    with pytest.raises(ValueError, match=r"^GoatAttention was built with kv_features=16, but value has width 24"):
        cross(jnp.zeros((B, T, E)), jnp.zeros((B, T, 16)), jnp.zeros((B, T, 24)))


def test_init_cache_and_load_linen_params_that_raise_change_nothing(rng):
    """The other NNX methods that change a layer: a refused init_cache keeps the cache it had,
    refused Linen params keep the parameters."""
    layer = gnnx.PositionalAttention(4, in_features=E, rngs=nnx.Rngs(0), position_encoding="naive_prior",
                                     max_len=16, decode=True)
    layer.init_cache(B, 8)
    layer(jnp.asarray(rng.normal(size=(B, 3, E)), jnp.float32), is_causal=True)
    before = _cache(layer)
    with pytest.raises(ValueError, match="max_len"):
        layer.init_cache(B, 32)  # past the bias table
    after = _cache(layer)
    assert all(np.array_equal(after[k], before[k]) for k in before)
    params = nnx.state(layer, nnx.Param).to_pure_dict()
    bad = jax.tree.map(np.asarray, params)
    bad["q_proj"]["kernel"] = np.zeros((E + 1, 4, 8), np.float32)
    bad["out_proj"]["kernel"] = bad["out_proj"]["kernel"] + 1.0
    with pytest.raises(ValueError, match="shapes"):
        gnnx.load_linen_params(layer, bad)
    now = nnx.state(layer, nnx.Param).to_pure_dict()
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(now), jax.tree.leaves(params)))
