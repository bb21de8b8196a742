"""The experiment configs: they load and validate, parameter counts of the paper shapes (via
jax.eval_shape: nothing allocated), and bad values fail before training, naming the field."""

import ast
import os
import subprocess
import sys

import pytest

from configs import lm_c4_125m, lm_fineweb_1b, lm_tiny
from goat_jax.models import count_params
from goat_jax.train import tasks
from goat_jax.train import trainer, validation
from tests.config_helpers import set_fields
from goat_jax.kernels.plan import AttentionPlan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {"lm_tiny": lm_tiny, "lm_c4_125m": lm_c4_125m, "lm_fineweb_1b": lm_fineweb_1b}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("encoding", ["goat", "rope", "nope", "alibi", "learned"])
def test_configs_validate(name, encoding):
    config = CONFIGS[name].get_config(encoding)
    assert config.model.position_encoding == encoding
    assert trainer.validate_config(config, num_devices=8).global_batch == config.global_batch_size
    assert config.model.training_seq_len == config.seq_len
    assert tasks.get_task(config.task).flops_per_token(config) > 0


def test_tiny_smoke_variant():
    config = lm_tiny.get_config("rope,smoke")
    assert config.model.position_encoding == "rope" and config.seq_len == 64
    assert config.model.training_seq_len == 64  # follows seq_len through the FieldReference
    trainer.validate_config(config, num_devices=1)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_field_has_a_comment(name):
    """Configs read like a paper appendix: each top-level assignment in get_config says why."""
    path = os.path.join(ROOT, "configs", f"{name}.py")
    source = open(path).read().splitlines()
    tree = ast.parse("\n".join(source))
    func = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "get_config")
    for node in func.body:  # the smoke block of lm_tiny overrides already-commented fields
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]).count(".") >= 1:
            line = source[node.lineno - 1]
            if ast.unparse(node.value).startswith("ml_collections.ConfigDict"):
                continue
            assert "#" in line, f"{path}:{node.lineno} has no comment: {line.strip()}"


# ----------------------------------------------------------------------------------------------
# Parameter counts of the paper shapes
# ----------------------------------------------------------------------------------------------


def _params(config):
    model = tasks.get_task("lm").build_model(config, AttentionPlan.from_config(config))
    return count_params(model, (1, 16))


def test_125m_llama_variant_param_count():
    """All parameters, the tied token embedding counted once, GOAT prior included:
    12 x (4 x 768^2 + 3 x 768 x 2560 + 2 x 768) + 32000 x 768 + 768 + prior = 123.69M."""
    config = lm_c4_125m.get_config("goat,llama")
    n = _params(config)
    e, f, v, layers = 768, 2560, 32_000, 12
    dense = layers * (4 * e * e + 3 * e * f + 2 * e) + v * e + e
    assert 0 < n - dense < 10_000  # the GOAT prior: a few hundred numbers per layer
    assert n == pytest.approx(125e6, rel=0.02)
    assert abs(_params(lm_c4_125m.get_config("rope,llama")) - dense) == 0


def test_125m_official_recipe_param_count():
    """GPT-2 block: 12 x (4 x 768^2 + 4 x 768 attention biases + 2 x 768 x 3072 + 3072 + 768 MLP
    + 4 x 768 LayerNorm) + 50257 x 768 + 2 x 768 final LayerNorm (tied embedding) = 123.65M."""
    e, f, v, layers = 768, 3072, 50_257, 12
    dense = layers * (4 * e * e + 4 * e + 2 * e * f + f + e + 4 * e) + v * e + 2 * e
    n = _params(lm_c4_125m.get_config("goat"))
    # The GOAT prior with R = M = 4 per layer: lambda_sym/asym 2 x 12 x 4, gates 2 x 12, sink
    # gain/bump/slope 3 x 12, sink MLP (2M + 2 = 10 -> 4 -> 1) 10 x 4 + 4 + 4 + 1.
    prior = 2 * 12 * 4 + 2 * 12 + 3 * 12 + (10 * 4 + 4 + 4 + 1)
    assert n == dense + layers * prior
    assert _params(lm_c4_125m.get_config("rope")) == dense


def test_125m_official_recipe_fields():
    """Every field the official train_c4.py fixes has its value (docs/protocols.md, C4 125M)."""
    from goat_jax.reproduce import paper_table  # the recipe, written out field by field from the docs

    c = validation.add_engine_defaults(lm_c4_125m.get_config("goat"))  # as a run has it
    assert paper_table.differences(c, paper_table.official_recipe("lm", "c4_125m", "goat")) == {}
    assert c.optimizer.learning_rate * c.optimizer.min_lr_ratio == pytest.approx(3e-5)
    tokens = c.num_train_steps * c.global_batch_size * c.seq_len
    assert 4e9 <= tokens < 4e9 + c.global_batch_size * c.seq_len  # 4B tokens, one step rounded up
    assert lm_c4_125m.get_config("rope").seed == 1337  # baselines: the script's seed itself
    # The drawn init (N(0, 0.02) projections, the sink MLP at N(0, 1e-3)) is measured in
    # tests/test_official_recipes.py.


def test_1b_param_count_matches_llama_3_2_1b():
    """Llama 3.2 1B: 1,235,814,400 parameters (tied embeddings); GOAT adds its prior only."""
    n_rope = _params(lm_fineweb_1b.get_config("rope"))
    n_goat = _params(lm_fineweb_1b.get_config("goat"))
    assert n_rope == 1_235_814_400
    assert n_goat == pytest.approx(1.23e9, rel=0.01) and 0 < n_goat - n_rope < 10_000


# ----------------------------------------------------------------------------------------------
# Bad values fail before training, naming the field
# ----------------------------------------------------------------------------------------------


def _tiny(**changes):
    return set_fields(validation.add_engine_defaults(lm_tiny.get_config()), **changes)


@pytest.mark.parametrize("mutate,devices,pattern", [
    (lambda c: c.__setattr__("num_trian_steps", 5), 1, r"Unknown config field num_trian_steps\. Did you mean num_train_steps"),
    (lambda c: c.model.__setattr__("embed_dims", 5), 1, r"Unknown config field model\.embed_dims\. Did you mean model\.embed_dim"),
    (lambda c: c.data.__setattr__("tokeniser", "byte"), 1, r"Unknown config field data\.tokeniser"),
    (lambda c: c.optimizer.__delattr__("learning_rate"), 1, r"missing field\(s\) \['optimizer\.learning_rate'\]"),
    (lambda c: c.mesh.__setattr__("data", 3), 8, r"mesh\.data \* mesh\.fsdp \* mesh\.context \* mesh\.tensor = 3 \* 1 \* 1 \* 1 = 3, but there are 8 devices"),
    (lambda c: (c.mesh.__setattr__("data", 8), c.__setattr__("global_batch_size", 12)), 8,
     r"global_batch_size=12 .* divisible by mesh\.data \* mesh\.fsdp \* grad_accum_steps"),
    (lambda c: c.__setattr__("grad_accum_steps", 3), 1, r"global_batch_size=16 .* grad_accum_steps = 1 \* 1 \* 3"),
    (lambda c: c.__setattr__("per_device_batch_size", 2), 1, r"exactly one of global_batch_size and per_device_batch_size"),
    (lambda c: (c.model.__setattr__("position_encoding", "learned"), c.model.__setattr__("max_len", 64)), 1,
     r"seq_len=128 exceeds model\.max_len=64"),
    (lambda c: c.__setattr__("task", "lm2"), 1, r"config\.task='lm2': no module 'goat_jax\.tasks\.lm2'"),
    (lambda c: c.__setattr__("log_every_steps", 0), 1, r"log_every_steps=0 is out of range: allowed is an integer >= 1"),
])
def test_bad_values_raise_naming_the_field(mutate, devices, pattern):
    config = _tiny()
    mutate(config)
    with pytest.raises(ValueError, match=pattern):
        trainer.validate_config(config, num_devices=devices)


def test_per_device_batch_size_resolves():
    config = _tiny(global_batch_size=None, per_device_batch_size=4)
    config.mesh.data = 8
    assert trainer.validate_config(config, num_devices=8).global_batch == 32


def _train(workdir, *overrides):
    return subprocess.run(
        [sys.executable, "-m", "experiments.train", "--config", "configs/lm_tiny.py:goat,smoke",
         "--workdir", str(workdir), "--config.progress_bar=False", *overrides],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_command_line_errors_stop_before_training(tmp_path):
    proc = _train(tmp_path / "mesh", "--config.mesh.data=3")
    assert proc.returncode != 0 and "mesh.data * mesh.fsdp * mesh.context * mesh.tensor = 3 * 1 * 1 * 1 = 3" in proc.stderr
    assert not (tmp_path / "mesh").exists() or not os.listdir(tmp_path / "mesh")
    proc = _train(tmp_path / "typo", "--config.model.embed_dims=32")
    assert proc.returncode != 0 and "embed_dims" in proc.stderr
    assert not (tmp_path / "typo").exists()


def test_ablation_script_configs_are_valid():
    """Every ``experiments.train`` command of scripts/ablations_tiny.sh builds a valid config
    (the spec with its --config.<field>=<value> flags, validated as the trainer does first),
    so the documented ablations cannot rot while nobody reruns them."""
    import ast
    import shlex

    from goat_jax.config.files import load_config
    from goat_jax.train import trainer

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "scripts", "ablations_tiny.sh")) as f:
        text = f.read().replace("\\\n", " ")
    commands = [shlex.split(line.replace('"$PY"', "python").replace("$task", "passkey"))
                for line in text.splitlines() if "experiments.train" in line and not line.lstrip().startswith("#")]
    assert len(commands) == 2, commands
    for argv in commands:
        spec = argv[argv.index("--config") + 1]
        overrides = {}
        for arg in argv:
            if arg.startswith("--config."):
                key, value = arg[len("--config."):].split("=", 1)
                overrides[key] = ast.literal_eval(value)
        config = load_config(spec, overrides)
        assert trainer.validate_config(config, 1).global_batch > 0, spec
