"""Config fields declared once (goat_jax/config/fields.py), and runs from before that change.

* Every choice tuple of a spec is written once in the library (an AST scan of goat_jax/,
  configs/ and experiments/), and no module restates a spec'd field's numeric bound.
* The GOAT fields of LMConfig and ViTConfig are PriorSettings' declarations (same spec objects).
* A checkpoint whose config still names ``model.name`` (the registry era: the fixture
  ``tests/fixtures/old_lm_smoke_config.json`` is ``configs/lm_tiny.py:goat,smoke`` as main @
  aff7b72 resolved it, ``lm_tiny.get_config('goat,smoke').to_dict()`` written with ``json.dump``)
  resumes under today's config, which no longer has the field.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import warnings

import jax.numpy as jnp
import ml_collections
import pytest

from configs import lm_tiny
from goat_jax.config import fields
from goat_jax.data import dna, images, synthetic, text
from goat_jax.models import lm, vit
from goat_jax.prior import PriorSettings
from goat_jax.tasks import lm as lm_task
from goat_jax.train import checkpoint, tasks, validation
from goat_jax.kernels.plan import AttentionPlan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLD_CONFIG = os.path.join(ROOT, "tests", "fixtures", "old_lm_smoke_config.json")

ALL_SPECS = {
    "model@lm": lm.FIELD_SPECS, "model@vit": vit.FIELD_SPECS, "prior": fields.specs_of(PriorSettings),
    "data@text": text.FIELD_SPECS, "data@synthetic": synthetic.FIELD_SPECS, "data@dna": dna.FIELD_SPECS,
    "data@images": images.FIELD_SPECS, **{f"engine:{k}": v for k, v in validation.ENGINE_FIELDS.items()},
}


def _library_files():
    for top in ("goat_jax", "configs", "experiments"):
        for dirpath, _, names in os.walk(os.path.join(ROOT, top)):
            yield from (os.path.join(dirpath, n) for n in sorted(names) if n.endswith(".py"))


def _literal_tuples(tree):
    """``[(tuple of str, line)]`` of every tuple/list literal of >= 2 string constants."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List)) and len(node.elts) >= 2 and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
            out.append((tuple(e.value for e in node.elts), node.lineno))
    return out


# Literal tuples equal to a spec's choices that are selections, not declarations.
_SELECTIONS = {(path, ("goat", "ape", "sincos2d", "rope2d", "nope"))  # the report runs all five
               for path in ("experiments/reproduce.py", "goat_jax/reproduce/suites.py")}


def test_each_choice_tuple_is_written_once():
    choice_sets = {frozenset(spec.choices) for specs in ALL_SPECS.values() for spec in specs.values()
                   if spec.choices is not None and len(spec.choices) >= 2
                   and all(isinstance(c, str) for c in spec.choices)}
    assert len(choice_sets) >= 12  # the scan sees the declarations it is about
    where = {}
    for path in _library_files():
        with open(path) as f:
            tree = ast.parse(f.read())
        for values, line in _literal_tuples(tree):
            if frozenset(values) in choice_sets and (os.path.relpath(path, ROOT), values) not in _SELECTIONS:
                where.setdefault(frozenset(values), []).append(f"{os.path.relpath(path, ROOT)}:{line}")
    repeated = {tuple(sorted(k)): v for k, v in where.items() if len(v) > 1}
    assert not repeated, f"choices written more than once (import the tuple instead): {repeated}"
    # The scan finds the declarations themselves (a few choice sets are built, e.g. from dict keys:
    # the kernels' names are the rows the kernel modules register, the context strategies the
    # modules goat_jax/kernels/strategies.py registers).
    assert len(where) >= len(choice_sets) - 5, sorted(map(sorted, choice_sets - set(where)))


# Order comparisons of a spec'd field's name with a constant that are not config range checks:
# a value's documented meaning (< 0: a random needle depth) or a layer's own argument check
# (layers are used without configs: PositionalAttention.max_len, PriorSpec's head counts).
# Keyed by (field, path prefix): goat_jax/positional and goat_jax/prior may be modules or packages.
_SEMANTIC = {("num_eval_batches", "goat_jax/data/text.py"), ("num_eval_batches", "goat_jax/data/dna.py"),
             ("num_eval_batches", "goat_jax/data/images.py"),  # <= 0: the whole held-out split
             ("depth", "goat_jax/data/synthetic.py"), ("max_len", "goat_jax/positional"),
             ("num_heads", "goat_jax/prior"), ("kv_num_heads", "goat_jax/prior")}
_ORDER = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def test_no_module_restates_a_numeric_bound():
    """``cfg.read_threads < 0`` next to ``read_threads: Int(min=0)`` was the issue's example: a
    spec'd numeric field compared with a constant outside its declaration is flagged."""
    numeric = {name for specs in ALL_SPECS.values() for name, spec in specs.items()
               if spec.kind in ("int", "float") and (spec.min is not None or spec.max != fields.FLOAT32_MAX)}
    found = []
    for path in _library_files():
        rel = os.path.relpath(path, ROOT)
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare) or not isinstance(node.left, ast.Attribute):
                continue
            exempt = any(node.left.attr == f and rel.startswith(prefix) for f, prefix in _SEMANTIC)
            if (node.left.attr in numeric and not exempt and
                    all(isinstance(op, _ORDER) for op in node.ops) and
                    all(isinstance(c, ast.Constant) and isinstance(c.value, (int, float))
                        and not isinstance(c.value, bool) for c in node.comparators)):
                found.append(f"{rel}:{node.lineno} {node.left.attr}")
    assert not found, f"range checks restated outside the field declarations: {found}"


def test_goat_fields_are_the_prior_declarations():
    prior = fields.specs_of(PriorSettings)
    for cls in (lm.LMConfig, vit.ViTConfig):
        own = fields.specs_of(cls)
        shared = set(own) & set(prior)
        assert {"pos_rank", "abs_rank", "prior_init", "enable_key_bias"} <= shared
        for name in shared:
            assert own[name] is prior[name], (cls.__name__, name)
    assert vit.ViTConfig().prior == PriorSettings(pos_rank=16, abs_rank=2, prior_init="uniform")
    assert lm.LMConfig().prior == PriorSettings()


def test_instances_are_checked_against_their_declarations():
    assert lm.LMConfig(dtype=jnp.bfloat16).compute_dtype == jnp.bfloat16  # dtype objects count
    with pytest.raises(ValueError, match=r"^LMConfig.num_layers=0 is out of range: allowed is an integer "
                                         r">= 1 \(decoder blocks\). Set --config.model.num_layers"):
        lm.LMConfig(num_layers=0)
    with pytest.raises(ValueError, match=r"^ViTConfig.dtype='float64' is not allowed"):
        vit.ViTConfig(dtype="float64")
    with pytest.raises(ValueError, match=r"^PriorSettings.abs_rank=-1 is out of range.*Pass an allowed value\.$"):
        PriorSettings(abs_rank=-1)
    data = text.default_data_config()
    data.read_threads = -1  # refused by its declaration before any file is read
    with pytest.raises(ValueError, match=r"^data.read_threads=-1 is out of range: allowed is an integer >= 0"):
        text.make_lm_datasets(data, seq_len=8, global_batch_size=2, seed=0)
    with pytest.raises(TypeError, match="spec must be a goat_jax.config.fields.Field"):
        fields.declare(1, "int")
    with pytest.raises(ValueError, match="PriorSettings has no declared field 'rank'"):
        fields.borrow(PriorSettings, "rank")


def _old_config():
    with open(OLD_CONFIG) as f:
        return json.load(f)


def test_old_model_name_checkpoint_resumes_under_the_new_config(tmp_path):
    """Checkpointer level (what the trainer calls before restoring): the old config's extra
    ``model.name='lm'`` is no difference, because the task declares it as the field's default;
    without that declaration it would be refused, so the check can fail."""
    old = _old_config()
    assert old["model"]["name"] == "lm"
    new = lm_tiny.get_config("goat,smoke").to_dict()
    assert "name" not in new["model"]
    task = lm_task.TASK
    ckpt = checkpoint.Checkpointer(str(tmp_path), old, resume_safe_fields=task.resume_safe_fields)
    ckpt.save(3, {"w": jnp.ones((2,))}, {"i": 3}, wait=True)
    ckpt.close()
    ckpt = checkpoint.Checkpointer(str(tmp_path), new, resume_safe_fields=task.resume_safe_fields,
                                   field_defaults=tasks.field_defaults(task))
    assert ckpt.check_compatible() == {}
    ckpt.close()
    defaults = {k: v for k, v in tasks.field_defaults(task).items() if k != "model.name"}
    ckpt = checkpoint.Checkpointer(str(tmp_path), new, resume_safe_fields=task.resume_safe_fields,
                                   field_defaults=defaults)
    with pytest.raises(checkpoint.IncompatibleCheckpointError, match="model.name: checkpoint 'lm'"):
        ckpt.check_compatible()
    ckpt.close()


def test_old_config_builds_the_same_model_with_a_warning():
    old = ml_collections.ConfigDict(_old_config())
    new = lm_tiny.get_config("goat,smoke")
    with pytest.warns(FutureWarning, match="model.name='lm' is deprecated"):
        assert lm_task.build_model(old, AttentionPlan.from_config(old)).config == lm_task.build_model(new, AttentionPlan.from_config(new)).config
    old.model.name = "vit"
    with pytest.raises(ValueError, match="model.name='vit': task 'lm' builds the model 'lm'"):
        lm_task.build_model(old, AttentionPlan.from_config(old))


@pytest.mark.slow(reason="trains and resumes through the CLI; the fixture configs are checked without training in the default suite")
def test_run_started_from_an_old_config_resumes_under_the_new_one(tmp_path):
    """End to end through the trainer: 2 steps under the old config (model.name set), then the
    same workdir continues to step 4 under today's config file."""
    from goat_jax.train import trainer  # pylint: disable=g-import-not-at-top

    def short(config):
        config.num_train_steps, config.checkpoint_every_steps, config.eval_every_steps = 2, 2, 0
        config.progress_bar = False
        return config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        old = short(ml_collections.ConfigDict(_old_config()))
        assert trainer.train_and_evaluate(old, str(tmp_path))["step"] == 2
    new = short(lm_tiny.get_config("goat,smoke"))
    new.num_train_steps = 4
    summary = trainer.train_and_evaluate(new, str(tmp_path), resume_with_changes=True)
    assert summary["step"] == 4


def test_section_declares_default_and_spec_once():
    section = fields.Section(n=(4, fields.Int(min=0, doc="threads")), w=(None, fields.Float(min=0.0, optional=True)),
                             m=((0.5, 0.5), fields.Floats(nonempty=True)))
    c = section.defaults()
    assert c.n == 4 and c.w is None and c.m == (0.5, 0.5) and list(section.specs) == ["n", "w", "m"]
    c.w = 2.5  # a typed placeholder: the command line can set the None default
    with pytest.raises(TypeError):
        c.w = "x"
    with pytest.raises(ValueError, match=r"^data.m=\(\) is empty: allowed is a non-empty tuple of finite numbers\. "
                                         r"Repeat --config.data.m=ELEMENT"):
        fields.check_section({"m": ()}, section.specs, "data")
    with pytest.raises(ValueError, match=r"data.m=\(1.0, nan\) is not finite"):
        fields.check_section({"m": (1.0, float("nan"))}, section.specs, "data")
    with pytest.raises(ValueError, match=r"Section field 'n': the default -1 is out of range"):
        fields.Section(n=(-1, fields.Int(min=0)))
    with pytest.raises(TypeError, match=r"must be \(default, Field\)"):
        fields.Section(n=4)
    # The data pipelines' defaults and specs come from one declaration each.
    for defaults, specs in ((text.default_data_config(), text.FIELD_SPECS), (dna.default_dna_data_config(), dna.FIELD_SPECS),
                            (images.default_data_config(), images.FIELD_SPECS)):
        assert set(defaults) == set(specs)


def _imports(path):
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):  # function-local imports count too
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            if node.module == "goat_jax":  # `from goat_jax import x` names the module goat_jax.x
                yield from (f"goat_jax.{a.name}" for a in node.names)


def test_lower_layers_do_not_import_the_engine():
    """Models and data pipelines import the ground-floor config module, not the engine (nor the
    tasks above it); goat_jax/config imports nothing else from goat_jax but the leaf module
    goat_jax._extras (the one-line error for a missing optional package), except the config-file
    loader's completion with the declared defaults, imported where it runs: importing the package
    imports no engine module."""
    lower = [os.path.join(ROOT, "goat_jax", d, n) for d in ("models", "data")
             for n in sorted(os.listdir(os.path.join(ROOT, "goat_jax", d))) if n.endswith(".py")]
    prior = os.path.join(ROOT, "goat_jax", "prior")  # a module or a package
    lower += ([os.path.join(prior, n) for n in sorted(os.listdir(prior)) if n.endswith(".py")]
              if os.path.isdir(prior) else [prior + ".py"])
    bad = {os.path.relpath(p, ROOT): m for p in lower for m in _imports(p)
           if m.startswith(("goat_jax.train", "goat_jax.tasks", "goat_jax.eval"))}
    assert not bad, bad
    config_dir = os.path.join(ROOT, "goat_jax", "config")
    # The one exception: files.py (loading a config file for a command line) completes the file
    # with the engine's and the task's declared defaults, importing them where it does so.
    loading = {("files.py", "goat_jax.train")}  # from goat_jax.train import tasks, validation
    bad = {n: m for n in os.listdir(config_dir) if n.endswith(".py")
           for m in _imports(os.path.join(config_dir, n)) if m.startswith("goat_jax.")
           and not m.startswith(("goat_jax.config", "goat_jax._extras")) and (n, m) not in loading}
    assert not bad, bad
    with open(os.path.join(config_dir, "files.py")) as f:
        top = [n for n in ast.parse(f.read()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not [getattr(n, "module", None) for n in top if (getattr(n, "module", None) or "").startswith("goat_jax.train")]
    # So importing the config package, the loader included, imports no engine module.
    script = ("import sys, goat_jax.config, goat_jax.config.files, goat_jax.config.args\n"
              "print(sorted(m for m in sys.modules if m.startswith(('goat_jax.train', 'goat_jax.tasks'))))")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    assert "goat_jax.config.fields" in set(_imports(os.path.join(ROOT, "goat_jax", "models", "lm.py")))


def test_every_model_field_is_settable_though_the_file_does_not_list_it():
    """load_config adds the task's model fields a config file leaves out, at their defaults
    (None ones as typed placeholders), so overrides and --config flags can set any of them; the
    file's field references still follow what they point at; a typo is still refused."""
    import dataclasses
    import importlib.util

    from goat_jax.config.files import load_config, resolve_path
    from goat_jax.models import lm

    path = resolve_path("configs/retrieval_tiny.py")
    spec = importlib.util.spec_from_file_location("retrieval_tiny_raw", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    listed = set(module.get_config("passkey,fox").model.keys())
    assert "fox_gate_bias_init" not in listed and "rope_scaling_factor" not in listed  # the premise
    config = load_config("configs/retrieval_tiny.py:passkey,fox",
                         {"model.fox_gate_bias_init": 5.0, "model.rope_scaling_factor": 2.0, "seq_len": 96})
    defaults = {f.name: f.default for f in dataclasses.fields(lm.LMConfig) if f.default is not dataclasses.MISSING}
    assert set(defaults) - {"name"} <= set(config.model.keys())
    assert config.model.fox_gate_bias_init == 5.0 and config.model.rope_scaling_factor == 2.0
    assert config.model.training_seq_len == 96  # the file's reference to seq_len survives
    fresh = load_config("configs/retrieval_tiny.py:passkey,fox")
    assert fresh.model.fox_gate_bias_init == defaults["fox_gate_bias_init"]
    assert fresh.model.logn_scaling is None  # a None default, settable from the command line
    with pytest.raises(ValueError, match="override model.fox_gate_bias_int: .* has no such field"):
        load_config("configs/retrieval_tiny.py:passkey,fox", {"model.fox_gate_bias_int": 5.0})
