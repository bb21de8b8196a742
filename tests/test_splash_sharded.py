"""Splash attention on a mesh: inside a mesh of several devices the splash path runs under
``jax.shard_map`` over the batch axes (and the heads, where the tensor axis splits them), since
XLA cannot partition a Mosaic kernel (goat_jax/kernels/splash.py; ``goat_jax.kernels.mesh.partition``). On 8 fake
CPU devices, 'splash_interpret' (the same Pallas kernel in interpret mode) under shard_map must
give the unsharded result, values and gradients, for GOAT and RoPE, with and without segment ids,
with GQA and MQA, under the trainer's logical rules and under a bare ``jax.set_mesh``.

One subprocess (the fake devices need XLA_FLAGS before JAX starts) runs every case and prints
one JSON line; the tests read it."""

import json

import pytest

from tests.config_helpers import run_on_fake_devices

_SCRIPT = r'''
import json
import sys
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from goat_jax import kernels
from goat_jax.kernels import mesh as mesh_lib
from goat_jax.layers.positional import PositionalAttention
from tests import goat_reference as ref
from tests import jitted

B, T, E, H = 4, 128, 16, 8
RULES = (("batch", ("data", "fsdp")), ("heads", "tensor"), ("kv_heads", "tensor"), ("embed", None))
mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
rng = np.random.default_rng(0)
results = {}
# (layer, query heads, kv heads, segment ids, mesh contexts): each of GOAT / RoPE with and without
# segment ids once, GQA (kv heads split with the query heads) and MQA (one kv head kept whole)
# and both contexts spread over them (each case compiles twice in interpret mode: ~8 s).
CASES = (("goat", 4, 2, False, ("rules",)), ("goat", 4, 1, True, ("set_mesh",)),
         ("rope", 4, 2, True, ("rules",)), ("rope", 4, 1, False, ("set_mesh",)))


def layer(name, n, k):
    common = dict(num_heads=n, kv_num_heads=k, head_dim=H, implementation="splash_interpret")
    if name == "goat":
        return ref.goat_module(pos_rank=2, abs_rank=2, training_seq_len=T, **common)
    return PositionalAttention(position_encoding="rope", **common)


WANTED = json.loads(sys.argv[1])  # which of CASES to run: (layer, query heads, kv heads) triples
for name, n, k, with_segments, hows in CASES:
    if [name, n, k] not in WANTED:
        continue
    module = layer(name, n, k)
    x = jnp.asarray(rng.normal(size=(B, T, E)), jnp.float32)
    seg = None
    if with_segments:  # documents of different lengths per row
        cuts = np.sort(rng.integers(1, T, size=(B, 3)), axis=1)
        seg = jnp.asarray((np.arange(T)[None, :, None] >= cuts[:, None, :]).sum(-1), jnp.int32)
    params = flax.core.meta.unbox(jitted.init(module, jax.random.key(0), x[:, :T], is_causal=True))
    params = jax.tree.map(lambda a: jnp.asarray(rng.normal(0, 0.5, a.shape), a.dtype), params)

    def loss(p, x, seg):
        y = module.apply(p, x, is_causal=True, segment_ids=seg)
        return jnp.sum(y * jnp.cos(jnp.arange(y.size).reshape(y.shape))), y

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (_, want), want_g = step(params, x, seg)
    for how in hows:
        xs = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"))))
        segs = None if seg is None else jax.device_put(seg, NamedSharding(mesh, P(("data", "fsdp"))))
        if how == "rules":
            ctx = [jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(RULES)]
        else:
            ctx = [jax.set_mesh(mesh)]
        for c in ctx:
            c.__enter__()
        try:
            jaxpr = str(jax.make_jaxpr(loss)(params, xs, segs))
            part = mesh_lib.partition(mesh_lib.ambient_mesh(), B, n, k)
            (_, got), got_g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, xs, segs)
        finally:
            for c in reversed(ctx):
                c.__exit__(None, None, None)
        scale = float(jnp.max(jnp.abs(want)))
        # Relative to each leaf's scale, floored at 1e-2 of the largest: some leaves'
        # gradients are ~0 (k_proj's bias: softmax ignores a shift of every logit).
        top = max(float(jnp.max(jnp.abs(b_))) for b_ in jax.tree.leaves(want_g))
        gerr = max(float(jnp.max(jnp.abs(a - b_))) / max(float(jnp.max(jnp.abs(b_))), 1e-2 * top)
                   for a, b_ in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)))
        results[f"{name}-{n}x{k}-{'seg' if with_segments else 'noseg'}-{how}"] = dict(
            value_err=float(jnp.max(jnp.abs(got - want))) / scale, grad_err=gerr,
            shard_map="shard_map" in jaxpr, batch=list(part[1]), heads=list(part[2]),
            shard_kv=bool(part[3]))
# Inside the caller's own shard_map over 'data' (manual there): splash maps over the rest.
q = jnp.asarray(rng.normal(size=(B, T, 4, H)), jnp.float32)
attend = lambda q: kernels.attend(q, q[:, :, :2], q[:, :, :2], implementation="splash_interpret", is_causal=True)
want = attend(q)
with jax.set_mesh(mesh):
    inner = jax.shard_map(lambda q: (parts.append(mesh_lib.partition(mesh_lib.ambient_mesh(), q.shape[0], 4, 2)), attend(q))[1],
                          in_specs=P("data"), out_specs=P("data"), axis_names={"data"})
    parts = []
    got = jax.jit(inner)(jax.device_put(q, NamedSharding(mesh, P("data"))))
results["inside-shard_map"] = dict(value_err=float(jnp.max(jnp.abs(got - want))), batch=list(parts[0][1]),
                                   heads=list(parts[0][2]))
print("RESULTS " + json.dumps(results))
'''


def _run(cases):
    wanted = json.dumps([[c.split("-")[0], *map(int, c.split("-")[1].split("x"))] for c in cases])
    return json.loads(run_on_fake_devices(_SCRIPT, wanted, timeout=600).split("RESULTS ")[-1])


# The default suite runs GOAT's two cases (GQA under the trainer's rules, MQA with segment ids
# under a bare mesh: both contexts, both head layouts, with and without segment ids); RoPE's two,
# the same kernel on other q/k, run in the slow suite (~8 s of interpreted splash each).
DEFAULT_CASES = ["goat-4x2-noseg-rules", "goat-4x1-seg-set_mesh"]
SLOW_CASES = ["rope-4x2-seg-rules", "rope-4x1-noseg-set_mesh"]


@pytest.fixture(scope="module")
def results():
    return _run(DEFAULT_CASES)


def _check_case(r):
    assert r["shard_map"], r  # the kernel ran under shard_map, not partitioned by XLA
    assert r["value_err"] < 1e-5 and r["grad_err"] < 1e-4, r


@pytest.mark.parametrize("case", DEFAULT_CASES)
def test_sharded_splash_equals_unsharded(results, case):
    _check_case(results[case])


@pytest.mark.slow(reason="RoPE's two cases: two more interpreted splash compiles per case")
def test_sharded_splash_equals_unsharded_for_rope():
    out = _run(SLOW_CASES)
    for case in SLOW_CASES:
        _check_case(out[case])


def test_partition_follows_the_rules_and_the_heads(results):
    # The trainer's rules: batch over data x fsdp (4 examples over 2 x 2), heads over tensor, and
    # GQA's 2 KV heads split with their query heads; without rules the axes named data/fsdp carry
    # the batch and tensor the query heads, while MQA's one KV head stays whole on every device.
    for case in ("goat-4x2-noseg-rules", "goat-4x1-seg-set_mesh"):
        assert results[case]["batch"] == ["data", "fsdp"] and results[case]["heads"] == ["tensor"], case
    assert results["goat-4x2-noseg-rules"]["shard_kv"]
    assert not results["goat-4x1-seg-set_mesh"]["shard_kv"]


def test_inside_a_callers_shard_map_the_manual_axes_are_left_alone(results):
    # The caller's shard_map made 'data' manual: splash maps over what is left (fsdp, tensor).
    r = results["inside-shard_map"]
    assert r["value_err"] < 1e-5 and "data" not in r["batch"] and r["heads"] == ["tensor"], r
