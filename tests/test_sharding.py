"""Mesh construction, logical-axis rules, and the 8-fake-device run against one device.

The multi-device checks run in a subprocess with XLA_FLAGS set before jax is imported, so the
rest of the suite keeps one device.
"""

import json
import os
import subprocess
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mesh_config(data, fsdp, tensor):
    return {"data": data, "fsdp": fsdp, "tensor": tensor}


# ----------------------------------------------------------------------------------------------
# Mesh shape
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg,n,expected", [
    ((2, 2, 2), 8, (2, 2, 2)), ((-1, 1, 1), 8, (8, 1, 1)), ((1, -1, 2), 8, (1, 4, 2)),
    ((1, 1, -1), 1, (1, 1, 1)),
])
def test_mesh_shape_resolves_fill(cfg, n, expected):
    assert sharding.mesh_shape(_mesh_config(*cfg), n) == expected


@pytest.mark.parametrize("cfg,n,field", [
    ((3, 1, 1), 8, "mesh.data * mesh.fsdp * mesh.tensor"),  # product != device count
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
from configs import lm_tiny
from goat_jax.train import trainer, sharding, tasks
import flax.linen as nn
config = lm_tiny.get_config('goat,smoke')
config.num_train_steps = 6
config.progress_bar = False
mesh_args = json.loads(sys.argv[2])
for k, v in mesh_args.items():
    config.mesh[k] = v
summary = trainer.train_and_evaluate(config, sys.argv[1])
out = {'devices': jax.device_count()}
if jax.device_count() > 1:
    mesh = sharding.make_mesh(config.mesh)
    model = tasks.get_task('lm').build_model(config)
    import jax.numpy as jnp
    abstract = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((4, 64), jnp.int32))['params']
    sh = sharding.logical_shardings(abstract, mesh, sharding.rules_from_config(config.sharding_rules))
    out['embed'] = str(sh['embed']['embedding'].spec)
    out['q_proj'] = str(sh['layer_0']['attention']['q_proj']['kernel'].spec)
    out['wi_0'] = str(sh['layer_0']['mlp']['wi_0']['kernel'].spec)
print('RESULT ' + json.dumps(out))
"""


def _run(workdir, devices, mesh):
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(workdir), json.dumps(mesh)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ")[-1])
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    losses = [r["train_loss"] for r in rows if "train_loss" in r]
    return result, losses


def test_eight_devices_2x2x2_match_one_device(tmp_path):
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
