"""How attention runs is one value (goat_jax.plan.AttentionPlan), and a kernel or a context
strategy is one module: a toy kernel (tests/toy_kernel.py) and a toy strategy
(tests/toy_strategy.py), each one module outside the package, appear in the tables, the automatic
choice, the docs table and the config's choices, and run, with no other file touched. The plan
reaches every layer of a model built from a config, each default is stated once, and no
contextvar carries attention settings."""

import ast
import os

import jax.numpy as jnp
import pytest

from goat_jax import plan as plan_lib
from goat_jax.plan import DEFAULT, AttentionPlan
from tests.config_helpers import lm_smoke_config, run_on_fake_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_TOY_KERNEL = r'''
import json
import jax, jax.numpy as jnp, numpy as np
import tests.toy_kernel  # the one module: it registers its row
from goat_jax import GoatAttention, PriorSettings, kernels
from goat_jax.kernels import capabilities as caps
from tests import goat_reference as ref

out = {"in_table": "toy" in caps.CAPABILITIES and "toy" in kernels.IMPLEMENTATIONS,
       "preferred": caps.preferred("cpu"),
       "auto": kernels.resolve_implementation(None, jnp.float32, 8, (2, 4, 16, 16)),
       "auto_with_bias": kernels.resolve_implementation(None, jnp.float32, 8, (2, 4, 16, 16), bias=True),
       "docs_row": [line for line in caps.markdown_table().splitlines() if line.startswith("| `toy` |")]}
rng = np.random.default_rng(0)
q, k, v, ct = (rng.normal(size=s) for s in ((2, 16, 4, 8), (2, 16, 2, 8), (2, 16, 2, 8), (2, 16, 4, 8)))
ids = np.repeat(np.array([[0] * 6 + [1] * 10, [0] * 11 + [1] * 5]), 1, axis=0).astype(np.int32)
want = ref.attention_and_grads(q, k, v, ct, scale=0.5, is_causal=True, q_segment_ids=ids, kv_segment_ids=ids)
f = lambda a, b, c: kernels.attend(a, b, c, scale=0.5, is_causal=True, segment_ids=jnp.asarray(ids))
with kernels.record_choices() as chosen:
    got, vjp = jax.vjp(f, *(jnp.asarray(x, jnp.float32) for x in (q, k, v)))
grads = vjp(jnp.asarray(ct, jnp.float32))
out["attend_chose"] = sorted({c["implementation"] for c in chosen})
out["errors"] = [float(np.abs(np.asarray(g) - w).max() / np.abs(w).max()) for g, w in zip((got,) + grads, want)]
layer = GoatAttention(num_heads=4, prior=PriorSettings(pos_rank=2, abs_rank=2))
x = jnp.asarray(rng.normal(size=(2, 16, 32)), jnp.float32)
with kernels.record_choices() as chosen:
    params = layer.init(jax.random.key(0), x, is_causal=True)
    toy = layer.apply(params, x, is_causal=True)
xla = layer.clone(implementation="xla").apply(params, x, is_causal=True)
out["layer_chose"] = sorted({c["implementation"] for c in chosen})
out["layer_vs_xla"] = float(jnp.max(jnp.abs(toy - xla)))
print("RESULT " + json.dumps(out))
'''


def test_a_toy_kernel_is_one_module_in_the_table_the_choice_and_the_docs():
    import json  # pylint: disable=g-import-not-at-top
    out = json.loads(run_on_fake_devices(_TOY_KERNEL, devices=1).split("RESULT ")[-1])
    assert out["in_table"] and out["preferred"] == ["toy"]
    assert out["auto"] == "toy"  # tried first on CPU, as its row says
    assert out["auto_with_bias"] == "xla"  # its row takes no bias: passed over, from the row alone
    assert len(out["docs_row"]) == 1 and "| cpu |" in out["docs_row"][0]
    assert out["attend_chose"] == ["toy"] and max(out["errors"]) < 1e-5, out
    assert out["layer_chose"] == ["toy"] and out["layer_vs_xla"] < 1e-5, out


_TOY_STRATEGY = r'''
import json
import jax, jax.numpy as jnp, numpy as np
import tests.toy_strategy  # the one module: it registers its row
from goat_jax import kernels
from goat_jax.kernels import strategies
from goat_jax.plan import AttentionPlan
from goat_jax.train import validation
from tests import goat_reference as ref

out = {"names": list(strategies.names()),
       "config_choices": "toy" in str(validation.ENGINE[""].specs["context_strategy"].choices)}
rng = np.random.default_rng(1)
q, k, v, ct = (rng.normal(size=s) for s in ((2, 16, 4, 8), (2, 16, 2, 8), (2, 16, 2, 8), (2, 16, 4, 8)))
want = ref.attention_and_grads(q, k, v, ct, scale=0.5, is_causal=True)
mesh = jax.make_mesh((1, 1, 2, 1), ("data", "fsdp", "context", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 4)
f = lambda a, b, c: kernels.attend(a, b, c, implementation="flash", scale=0.5, is_causal=True,
                                   plan=AttentionPlan(context_strategy="toy"))
with jax.set_mesh(mesh):
    got, vjp = jax.vjp(f, *(jnp.asarray(x, jnp.float32) for x in (q, k, v)))
    grads = vjp(jnp.asarray(ct, jnp.float32))
out["calls"] = tests.toy_strategy.CALLS
out["errors"] = [float(np.abs(np.asarray(g) - w).max() / np.abs(w).max()) for g, w in zip((got,) + grads, want)]
print("RESULT " + json.dumps(out))
'''


def test_a_toy_context_strategy_is_one_module_among_the_strategies_and_the_config_choices():
    import json  # pylint: disable=g-import-not-at-top
    out = json.loads(run_on_fake_devices(_TOY_STRATEGY, devices=2).split("RESULT ")[-1])
    assert out["names"] == ["all_gather", "ring", "ulysses", "toy"] and out["config_choices"], out
    assert out["calls"] == ["flash"] and max(out["errors"]) < 1e-5, out


def test_each_default_of_the_plan_is_stated_once_and_read_everywhere():
    from goat_jax.models import lm  # pylint: disable=g-import-not-at-top
    from goat_jax.config.fields import specs_of  # pylint: disable=g-import-not-at-top
    from goat_jax.train import validation  # pylint: disable=g-import-not-at-top
    assert AttentionPlan.from_config({}) == DEFAULT
    top = validation.ENGINE[""]
    assert top.default("context_strategy") == DEFAULT.context_strategy
    assert top.default("context_load_balance") == DEFAULT.load_balanced
    assert lm.LMConfig().max_documents_per_row == DEFAULT.max_documents_per_row
    assert "max_documents_per_row" in specs_of(lm.LMConfig)
    # The model imports no kernel module for a default (models/lm.py used to read cudnn_packed's).
    with open(os.path.join(ROOT, "goat_jax", "models", "lm.py")) as f:
        tree = ast.parse(f.read())
    kernel_imports = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                      and (n.module or "").startswith("goat_jax.kernels.")]
    assert kernel_imports == [], kernel_imports


def test_no_contextvar_carries_attention_settings():
    """Strategy, balancing and the window travel in the plan, never as ambient state."""
    found = []
    for dirpath, _, names in os.walk(os.path.join(ROOT, "goat_jax")):
        for name in names:
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name)) as f:
                    if "contextvars" in f.read():
                        found.append(os.path.relpath(os.path.join(dirpath, name), ROOT))
    assert found == []


def test_a_model_built_from_a_config_carries_the_runs_plan_to_every_layer():
    from goat_jax.models import lm  # pylint: disable=g-import-not-at-top
    from goat_jax.tasks import lm as lm_task  # pylint: disable=g-import-not-at-top
    config = lm_smoke_config(**{"context_strategy": "ring", "context_load_balance": True,
                                "model.implementation": "flash", "model.max_documents_per_row": 8})
    model = lm_task.build_model(config)
    want = AttentionPlan(implementation="flash", context_strategy="ring", load_balanced=True, max_documents_per_row=8)
    assert model.plan == want == AttentionPlan.from_config(config)
    layer = lm.make_attention(model.config, False, model.plan)
    assert layer.plan == want
    assert want.document_bound() is None and AttentionPlan().document_bound() == DEFAULT.max_documents_per_row
    assert AttentionPlan(implementation="cudnn", max_documents_per_row=4).document_bound() == 4


def test_a_layer_takes_its_plan_or_its_fields_and_refuses_two_that_disagree():
    from goat_jax.layers.positional import PositionalAttention  # pylint: disable=g-import-not-at-top
    import jax  # pylint: disable=g-import-not-at-top
    x = jnp.ones((1, 8, 16))
    ok = PositionalAttention(num_heads=2, position_encoding="rope", implementation="xla",
                             plan=AttentionPlan(context_strategy="ring"))
    ok.init(jax.random.key(0), x, is_causal=True)
    bad = PositionalAttention(num_heads=2, position_encoding="rope", implementation="xla",
                              plan=AttentionPlan(implementation="flash"))
    with pytest.raises(ValueError, match="implementation='xla' disagrees with plan.implementation='flash'"):
        bad.init(jax.random.key(0), x, is_causal=True)
    with pytest.raises(ValueError, match="max_documents_per_row must be a positive integer"):
        AttentionPlan(max_documents_per_row=0)
    assert plan_lib.AttentionPlan.merged(None, implementation="xla") == AttentionPlan(implementation="xla")


def test_the_core_imports_no_variant_and_no_shell():
    """goat_jax/layers/core.py runs a call for any variant: it imports neither GOAT's nor the
    baselines' module, nor a shell (they import it)."""
    with open(os.path.join(ROOT, "goat_jax", "layers", "core.py")) as f:
        tree = ast.parse(f.read())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not {m for m in names for bad in ("layers.goat", "layers.positional", "layers.linen", "layers.nnx")
                if bad in m}, names
