"""Mesh construction, logical-axis rules, and the 8-fake-device run against one device.

The multi-device checks run in a subprocess with XLA_FLAGS set before jax is imported, so the
rest of the suite keeps one device.
"""

import json
import os
import sys
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from goat_jax.train import sharding
from tests.config_helpers import run_on_fake_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mesh_config(data, fsdp, tensor, context=None):
    """A mesh config; ``context`` None leaves the field out (configs written before the context
    axis existed mean 1)."""
    out = {"data": data, "fsdp": fsdp, "tensor": tensor}
    if context is not None:
        out["context"] = context
    return out


# ----------------------------------------------------------------------------------------------
# Mesh shape
# ----------------------------------------------------------------------------------------------


# Sizes come back in MESH_AXES order: (data, fsdp, context, tensor).
@pytest.mark.parametrize("cfg,n,expected", [
    ((2, 2, 2), 8, (2, 2, 1, 2)), ((-1, 1, 1), 8, (8, 1, 1, 1)), ((1, -1, 2), 8, (1, 4, 1, 2)),
    ((1, 1, -1), 1, (1, 1, 1, 1)), ((2, 1, 1, 4), 8, (2, 1, 4, 1)), ((-1, 1, 2, 2), 8, (2, 1, 2, 2)),
    ((1, 1, 2, -1), 8, (1, 1, 4, 2)),
])
def test_mesh_shape_resolves_fill(cfg, n, expected):
    assert sharding.mesh_shape(_mesh_config(*cfg), n) == expected


@pytest.mark.parametrize("cfg,n,field", [
    ((3, 1, 1), 8, "mesh.data * mesh.fsdp * mesh.context * mesh.tensor"),  # product != device count
    ((1, 1, 1, 3), 8, "mesh.data * mesh.fsdp * mesh.context * mesh.tensor = 1 * 1 * 3 * 1"),
    ((-1, 1, 1, -1), 8, "mesh.data, mesh.context"),  # two fills, one of them the context axis
    ((1, 1, 1, 0), 8, "mesh.context=0"),
    ((-1, 3, 1), 8, "mesh.data=-1"),  # cannot fill
    ((-1, -1, 1), 8, "mesh.data"),  # two fills
    ((0, 1, 1), 8, "mesh.data=0"),
])
def test_mesh_shape_errors_name_the_field(cfg, n, field):
    with pytest.raises(ValueError, match=field.replace("*", r"\*").replace(".", r"\.")):
        sharding.mesh_shape(_mesh_config(*cfg), n)


def test_make_mesh_single_device():
    mesh = sharding.make_mesh(_mesh_config(-1, 1, 1))
    assert mesh.axis_names == sharding.MESH_AXES
    assert mesh.size == jax.device_count()


# ----------------------------------------------------------------------------------------------
# Rules
# ----------------------------------------------------------------------------------------------

RULES = (("batch", ("data", "fsdp")), ("embed", "fsdp"), ("mlp", "tensor"), ("heads", "tensor"),
         ("kv_heads", "tensor"), ("vocab", "tensor"))
FAKE_MESH = types.SimpleNamespace(shape={"data": 2, "fsdp": 2, "tensor": 2})


def test_rules_from_config_normalizes_and_rejects_unknown_axes():
    rules = sharding.rules_from_config([["batch", ["data", "fsdp"]], ["embed", None]])
    assert rules == (("batch", ("data", "fsdp")), ("embed", None))
    with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
        sharding.rules_from_config([("embed", "model")])


@pytest.mark.parametrize("names,shape,expected", [
    (("embed", "mlp"), (64, 128), P("fsdp", "tensor")),
    (("vocab", "embed"), (259, 64), P(None, "fsdp")),  # 259 is odd: vocab replicated
    (("embed", "heads", "kv"), (64, 4, 16), P("fsdp", "tensor", None)),
    (("batch", "length", "embed"), (8, 16, 64), P(("data", "fsdp"), None, None)),  # fsdp used
    (("batch", "length"), (2, 16), P("data", None)),  # batch 2: only 'data' divides
    (("layers", "embed"), (12, 64), P(None, "fsdp")),  # no rule: replicated
])
def test_resolve_rules_divisibility_and_reuse(names, shape, expected):
    assert sharding._resolve(names, shape, FAKE_MESH, RULES) == expected


def test_optimizer_state_shardings_follow_params():
    mesh = sharding.make_mesh(_mesh_config(-1, 1, 1))
    boxed = {"w": nn.LogicallyPartitioned(jax.ShapeDtypeStruct((4, 8), jnp.float32), ("embed", "mlp")),
             "b": jax.ShapeDtypeStruct((8,), jnp.float32)}
    param_sh = sharding.logical_shardings(boxed, mesh, RULES)
    assert param_sh["w"].spec == P("fsdp", "tensor") and param_sh["b"].spec == P()
    tx = optax.adamw(1e-3)
    abstract = jax.eval_shape(tx.init, {"w": jnp.zeros((4, 8)), "b": jnp.zeros((8,))})
    opt_sh = sharding.optimizer_shardings(tx, abstract, param_sh, mesh)
    adam = opt_sh[0]
    assert adam.mu["w"].spec == P("fsdp", "tensor") and adam.nu["w"].spec == P("fsdp", "tensor")
    assert adam.count.spec == P()


# ----------------------------------------------------------------------------------------------
# 8 fake devices, mesh 2 x 2 x 2, vs 1 device: the same per-step losses
# ----------------------------------------------------------------------------------------------

_SCRIPT = r"""
import json, sys
sys.path.insert(0, '.')
import jax
from goat_jax.config.files import load_config
from goat_jax.train import trainer, sharding, tasks
from goat_jax.kernels.plan import AttentionPlan
import flax.linen as nn
config = load_config('configs/lm_tiny.py:goat,smoke')
config.num_train_steps = 6
config.progress_bar = False
mesh_args = json.loads(sys.argv[2])
for k, v in mesh_args.items():
    config.mesh[k] = v
summary = trainer.train_and_evaluate(config, sys.argv[1])
out = {'devices': jax.device_count()}
if jax.device_count() > 1:
    mesh = sharding.make_mesh(config.mesh)
    model = tasks.get_task('lm').build_model(config, AttentionPlan.from_config(config))
    import jax.numpy as jnp
    abstract = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((4, 64), jnp.int32))['params']
    sh = sharding.logical_shardings(abstract, mesh, sharding.rules_from_config(config.sharding_rules))
    out['embed'] = str(sh['embed']['embedding'].spec)
    out['q_proj'] = str(sh['layer_0']['attention']['q_proj']['kernel'].spec)
    out['wi_0'] = str(sh['layer_0']['mlp']['wi_0']['kernel'].spec)
print('RESULT ' + json.dumps(out))
"""


def _run(workdir, devices, mesh):
    out = run_on_fake_devices(_SCRIPT, str(workdir), json.dumps(mesh), devices=devices, timeout=300)
    result = json.loads(out.split("RESULT ")[-1])
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    losses = [r["train_loss"] for r in rows if "train_loss" in r]
    return result, losses


@pytest.mark.slow(reason="trains on a 2x2x2 mesh and on one device to compare")
def test_eight_devices_2x2x2_match_one_device(tmp_path):
    """All three mesh axes at once (the default suite checks tensor and fsdp meshes from the
    compiled step, with loss parity, in test_compiled_step_partitions_...)."""
    one, losses_1 = _run(tmp_path / "one", 1, {"data": -1, "fsdp": 1, "tensor": 1})
    eight, losses_8 = _run(tmp_path / "eight", 8, {"data": 2, "fsdp": 2, "tensor": 2})
    assert one["devices"] == 1 and eight["devices"] == 8
    # Parameters really are sharded: FSDP over the model dim, Megatron over heads / MLP, and the
    # odd byte vocabulary (259) falls back to replication.
    assert eight["embed"] == str(P(None, "fsdp"))
    assert eight["q_proj"] == str(P("fsdp", "tensor", None))
    assert eight["wi_0"] == str(P("fsdp", "tensor"))
    assert len(losses_1) == len(losses_8) == 6
    np.testing.assert_allclose(losses_8, losses_1, rtol=1e-4)
    assert losses_1[-1] < losses_1[0]


# ----------------------------------------------------------------------------------------------
# Activations really are partitioned: the compiled train step on 8 fake devices
# ----------------------------------------------------------------------------------------------

_COMPILED_SCRIPT = r"""
import json, re, sys
sys.path.insert(0, '.')
import jax
from goat_jax.config.files import load_config
from goat_jax.train import trainer, sharding, tasks
from goat_jax.kernels.plan import AttentionPlan
config = load_config('configs/lm_tiny.py:goat,smoke')  # batch 8, length 64, embed 64, mlp 128, vocab 259
task = tasks.get_task('lm')
rules = sharding.rules_from_config(config.sharding_rules)
plan = AttentionPlan.from_config(config)
data = task.make_datasets(config, config.global_batch_size, 0, 1, plan=plan)
batches = [next(data.train) for _ in range(3)]
out = {}
for name, mesh_cfg, devices in [('one', {'data': 1, 'fsdp': 1, 'tensor': 1}, jax.devices()[:1]),
                                ('tensor', {'data': 4, 'fsdp': 1, 'tensor': 2}, None),
                                ('fsdp', {'data': 2, 'fsdp': 4, 'tensor': 1}, None)]:
    mesh = sharding.make_mesh(mesh_cfg, devices)
    bsh = {k: sharding.batch_sharding(mesh, v.ndim) for k, v in batches[0].items()}
    steps = trainer.make_sharded_steps(task, config, mesh, rules, bsh, plan=plan)
    abstract = lambda tree, shardings: jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)
    lowered = steps.train_step.lower(abstract(steps.abstract_state, steps.state_shardings),
                                     abstract(batches[0], bsh))
    compiled = lowered.compile()
    params = compiled.input_shardings[0][0].params
    state = steps.init(jax.random.PRNGKey(config.seed))
    losses = []
    for b in batches:
        state, m = steps.train_step(state, {k: jax.device_put(v, bsh[k]) for k, v in b.items()})
        losses.append(float(m['train_loss']))
    out[name] = {
        'losses': losses,
        # (shape, spec) of every sharding constraint the model's logical names put in the step
        'constraints': sorted({(shape, spec.replace('"', '')) for spec, shape in re.findall(
            r'sdy\.sharding_constraint %\S+ <@mesh, \[(.*?)\]> : tensor<([\dx]+)xf32>', lowered.as_text())}),
        # per-device array shapes after SPMD partitioning
        'shapes': sorted(set(re.findall(r'f32\[([\d,]+)\]', compiled.as_text()))),
        'embed': str(params['embed']['embedding'].spec),
        'q_proj': str(params['layer_0']['attention']['q_proj']['kernel'].spec),
        'wi_0': str(params['layer_0']['mlp']['wi_0']['kernel'].spec),
    }
print('RESULT ' + json.dumps(out))
"""


@pytest.mark.slow(reason="a subprocess compiling the step on 8 fake devices")
def test_compiled_step_partitions_activations_and_params_tensor_and_fsdp():
    """The model's nn.with_logical_constraint names become sharding constraints in the
    compiled train step (they were no-ops without the mesh and rules context), the partitioned
    step holds only per-device slices of the activations, parameters follow the rules, and the
    losses equal one device's to 1e-4. One subprocess, 8 fake CPU devices."""
    out = json.loads(run_on_fake_devices(_COMPILED_SCRIPT, timeout=600).split("RESULT ")[-1])
    one, tensor, fsdp = out["one"], out["tensor"], out["fsdp"]
    for run in (tensor, fsdp):
        # residual stream: batch over data x fsdp; MLP hidden and logits: features over tensor
        # (the length is constrained to the context axis too: size 1 here, so not split)
        assert ["8x64x64", "{data, fsdp}, {context}, {}"] in run["constraints"]
        assert ["8x64x128", "{data, fsdp}, {context}, {tensor}"] in run["constraints"]
        assert ["8x64x259", "{data, fsdp}, {context}, {tensor}"] in run["constraints"]
        np.testing.assert_allclose(run["losses"], one["losses"], rtol=1e-4)
    # One device holds whole activations; the meshes hold slices of them.
    assert "8,64,128" in one["shapes"] and "8,64,259" in one["shapes"]
    # tensor=2 (data=4): 2 rows each; MLP hidden 128 -> 64 and the odd vocabulary 259 -> 130
    # (padded) per device; no device holds a whole-batch residual or MLP activation.
    assert "2,64,130" in tensor["shapes"] and "2,64,64" in tensor["shapes"]
    assert not {"8,64,64", "8,64,128", "8,64,259"} & set(tensor["shapes"])
    # fsdp=4 (data=2): 1 row each; the parameters' embed dim 64 -> 16 per device.
    assert "1,64,64" in fsdp["shapes"] and "1,64,128" in fsdp["shapes"] and "259,16" in fsdp["shapes"]
    assert not {"8,64,64", "8,64,128", "4,64,64", "4,64,128"} & set(fsdp["shapes"])
    assert tensor["q_proj"] == str(P("fsdp", "tensor", None)) and tensor["wi_0"] == str(P("fsdp", "tensor"))
    assert tensor["embed"] == str(P(None, "fsdp"))  # 259 does not split over tensor=2
    assert fsdp["embed"] == str(P("tensor", "fsdp")) and fsdp["wi_0"] == str(P("fsdp", "tensor"))


def test_batch_groups_from_the_devices_rows(monkeypatch):
    """Processes holding the same rows form one group (a context group across hosts); a
    process's rows may be interleaved with another's (a topology-aware mesh); unequal or
    overlapping parts are refused."""
    import collections  # pylint: disable=g-import-not-at-top
    import types  # pylint: disable=g-import-not-at-top
    device = collections.namedtuple("Device", "process_index id")

    def layout(rows_by_device):  # [(process, start, stop)] -> a fake batch sharding
        devices = {device(p, i): (slice(a, b),)
                   for i, (p, a, b) in enumerate(rows_by_device)}
        monkeypatch.setattr(sharding, "batch_sharding", lambda mesh, ndim: types.SimpleNamespace(
            devices_indices_map=lambda shape: {d: idx for d, idx in devices.items()}))

    layout([(0, 0, 8), (0, 0, 8), (1, 0, 8), (1, 0, 8)])  # data 1, context over both hosts
    assert [sharding.batch_groups(None, 8, p) for p in (0, 1)] == [(0, 1), (0, 1)]
    layout([(0, 0, 2), (1, 2, 4), (0, 4, 6), (1, 6, 8)])  # interleaved hosts, data 4
    assert [sharding.batch_groups(None, 8, p) for p in (0, 1)] == [(0, 2), (1, 2)]
    layout([(0, 0, 4), (0, 4, 8), (1, 0, 4), (1, 4, 8), (2, 0, 8)])
    assert sharding.batch_groups(None, 8, 0)[1] == 1  # the same rows: one group
    layout([(0, 0, 6), (1, 4, 8)])
    with pytest.raises(ValueError, match="equal disjoint parts"):
        sharding.batch_groups(None, 8, 0)
