"""How attention runs is one value (goat_jax.kernels.plan.AttentionPlan), and a kernel or a context
strategy is one module: a toy kernel (tests/toy_kernel.py) and a toy strategy
(tests/toy_strategy.py), each one module outside the package, appear in the tables, the automatic
choice, the docs table and the config's choices, and run, with no other file touched. The plan
reaches every layer of a model built from a config, each default is stated once, and no
contextvar carries attention settings."""

import ast
import dataclasses
import os

import jax.numpy as jnp
import pytest

from goat_jax.kernels import plan as plan_lib
from goat_jax.kernels.plan import DEFAULT, AttentionPlan
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
from goat_jax.kernels.plan import AttentionPlan
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
    from goat_jax.train import tasks  # pylint: disable=g-import-not-at-top
    assert tasks.PLAN_FIELDS.default_values() == {"implementation": DEFAULT.implementation,
                                                  "max_documents_per_row": DEFAULT.max_documents_per_row}
    # The plan's fields are the plan's: the model's config holds no copy of them.
    assert not set(plan_lib.MODEL_SECTION_FIELDS) & set(specs_of(lm.LMConfig))
    # The model imports no kernel module for a default (models/lm.py used to read cudnn_packed's).
    with open(os.path.join(ROOT, "goat_jax", "models", "lm.py")) as f:
        tree = ast.parse(f.read())
    kernel_imports = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                      and (n.module or "").startswith("goat_jax.kernels.")]
    assert kernel_imports == ["goat_jax.kernels.plan"], kernel_imports  # the plan's value, no kernel


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
    model = lm_task.build_model(config, AttentionPlan.from_config(config))
    want = AttentionPlan(implementation="flash", context_strategy="ring", load_balanced=True, max_documents_per_row=8)
    assert model.plan == want == AttentionPlan.from_config(config)
    layer = lm.make_attention(model.config, False, model.plan)
    assert layer.plan == want
    assert want.document_bound() is None and AttentionPlan().document_bound() == DEFAULT.max_documents_per_row
    assert AttentionPlan(implementation="cudnn", max_documents_per_row=4).document_bound() == 4


def test_a_layer_takes_its_plan_or_its_fields_never_both():
    """``implementation=`` / ``max_documents_per_row=`` are a shorthand for a plan of those
    fields alone; given with ``plan=`` they are refused (one holder), naming the fix."""
    from goat_jax.layers.positional import PositionalAttention  # pylint: disable=g-import-not-at-top
    import jax  # pylint: disable=g-import-not-at-top
    from goat_jax.layers import core  # pylint: disable=g-import-not-at-top
    x = jnp.ones((1, 8, 16))
    alone = PositionalAttention(num_heads=2, position_encoding="rope", implementation="xla", max_documents_per_row=3)
    assert core.LayerSpec.of(alone.__dict__, "PositionalAttention").attention_plan() == \
        AttentionPlan(implementation="xla", max_documents_per_row=3)
    planned = PositionalAttention(num_heads=2, position_encoding="rope",
                                  plan=AttentionPlan(implementation="xla", context_strategy="ring"))
    params = planned.init(jax.random.key(0), x, is_causal=True)
    assert jnp.array_equal(planned.apply(params, x, is_causal=True), alone.apply(params, x, is_causal=True))
    both = PositionalAttention(num_heads=2, position_encoding="rope", implementation="xla",
                               plan=AttentionPlan(context_strategy="ring"))
    with pytest.raises(ValueError, match=r"implementation='xla' and plan= given together.*"
                                         r"plan=plan.replace\(implementation='xla'\)"):
        both.init(jax.random.key(0), x, is_causal=True)
    with pytest.raises(ValueError, match="max_documents_per_row must be a positive integer"):
        AttentionPlan(max_documents_per_row=0)


def test_the_models_refuse_the_plans_fields_naming_where_they_went():
    from goat_jax.models import lm, vit  # pylint: disable=g-import-not-at-top
    with pytest.raises(ValueError, match=r"\['implementation'\] are the attention plan's, not the model's: .*"
                                         r"plan=goat_jax.kernels.plan.AttentionPlan\(implementation=...\)"):
        lm.LMConfig.from_config({"implementation": "xla"})
    with pytest.raises(ValueError, match="max_documents_per_row.*are the attention plan's"):
        vit.ViTConfig.from_config({"max_documents_per_row": 4})
    # A config keeps them in its model section (the plan reads them there), every task.
    from goat_jax.train import tasks  # pylint: disable=g-import-not-at-top
    assert {"implementation", "max_documents_per_row"} <= tasks.get_task("lm").fields.schema()["model"]
    assert "implementation" in tasks.get_task("vit").fields.schema()["model"]


def test_a_task_written_for_the_old_contract_is_refused_in_one_line(monkeypatch):
    import sys  # pylint: disable=g-import-not-at-top
    import types  # pylint: disable=g-import-not-at-top
    from goat_jax.train import tasks  # pylint: disable=g-import-not-at-top
    module = types.ModuleType("old_contract_task")
    module.TASK = dataclasses.replace(tasks.get_task("lm"), build_model=lambda config: None)
    monkeypatch.setitem(sys.modules, "old_contract_task", module)
    with pytest.raises(ValueError, match=r"config.task='old_contract_task:TASK': its build_model cannot be called as "
                                         r"build_model\(config, plan\)"):
        tasks.get_task("old_contract_task:TASK")
    module.TASK = dataclasses.replace(tasks.get_task("lm"), make_datasets=lambda config, b, i, n: None)
    with pytest.raises(ValueError, match=r"its make_datasets cannot be called as make_datasets\(config, "
                                         r"global_batch_size, process_index, process_count, \*, plan\)"):
        tasks.get_task("old_contract_task:TASK")


def _from_config_calls(path):
    """The lines of ``path`` that call ``AttentionPlan.from_config``."""
    with open(path) as f:
        tree = ast.parse(f.read())
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == "from_config" and getattr(n.func.value, "id", "") == "AttentionPlan"]


def test_the_plan_is_built_once_per_entry_point_and_never_by_a_model_or_a_task():
    found = {}
    for dirpath, _, names in os.walk(os.path.join(ROOT, "goat_jax")):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                calls = _from_config_calls(path)
                if calls:
                    found[os.path.relpath(path, ROOT)] = calls
    assert not [p for p in found if p.startswith(("goat_jax/models/", "goat_jax/tasks/", "goat_jax/layers/",
                                                  "goat_jax/kernels/", "goat_jax/eval/", "goat_jax/aot/"))], found
    # train and compile: the config check (trainer.validate_config, which the trainer and both
    # compile steps call once, handing on its plan); evaluate: load_run; the export and each
    # reproduce row: their own entry point. One call in each.
    assert "goat_jax/train/trainer.py" in found and "goat_jax/train/run.py" in found, found
    assert all(len(lines) == 1 for lines in found.values()), found


def test_one_training_run_builds_its_plan_once_and_hands_the_same_value_to_the_model_and_the_data(
        tmp_path, monkeypatch):
    from goat_jax.tasks import lm as lm_task  # pylint: disable=g-import-not-at-top
    from goat_jax.train import tasks, trainer  # pylint: disable=g-import-not-at-top
    built, seen = [], {}
    original = AttentionPlan.from_config.__func__

    def counting(cls, config):
        built.append(original(cls, config))
        return built[-1]

    monkeypatch.setattr(AttentionPlan, "from_config", classmethod(counting))
    task = tasks.get_task("lm")

    def watch(name, fn):
        def wrapped(*args, **kwargs):
            seen[name] = kwargs.get("plan", args[1] if name == "model" else None)
            return fn(*args, **kwargs)
        return wrapped

    watched = dataclasses.replace(task, build_model=watch("model", task.build_model),
                                  make_datasets=watch("data", task.make_datasets))
    monkeypatch.setattr(tasks, "get_task", lambda name: watched)
    config = lm_smoke_config(num_train_steps=1, eval_every_steps=0,
                             **{"model.max_documents_per_row": 5})
    trainer.train_and_evaluate(config, str(tmp_path / "run"))
    assert len(built) == 1, built
    assert seen["model"] is seen["data"] is built[0]
    assert built[0].max_documents_per_row == 5 and lm_task.model_config(config) is not None


def test_the_mask_carries_visibility_only():
    from goat_jax.kernels.mask import AttentionMask  # pylint: disable=g-import-not-at-top
    assert [f.name for f in dataclasses.fields(AttentionMask)] == [
        "causal", "offset", "key_padding", "kv_lengths", "q_segment_ids", "kv_segment_ids", "window"]


def test_the_core_imports_no_variant_and_no_shell():
    """goat_jax/layers/core.py runs a call for any variant: it imports neither GOAT's nor the
    baselines' module, nor a shell (they import it)."""
    with open(os.path.join(ROOT, "goat_jax", "layers", "core.py")) as f:
        tree = ast.parse(f.read())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not {m for m in names for bad in ("layers.goat", "layers.positional", "layers.linen", "layers.nnx")
                if bad in m}, names
