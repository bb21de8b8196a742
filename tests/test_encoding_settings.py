"""An encoding's settings are declared once, by the encoding (goat_jax/positional/base.py,
``EncodingSettings``): the model configs borrow them under their names, the models pass one
settings object to the layer, a layer built by hand takes them as keywords, and each requirement
is checked by the settings class alone. Adding an encoding with a knob is its module plus one
registry entry: a toy encoding registered in a fresh interpreter gets its knob set from the
command line's ``--config.model.<knob>=...`` and the layer receives it."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from goat_jax import positional
from goat_jax.config import fields
from goat_jax.models import lm, vit
from goat_jax.layers.positional import PositionalAttention
from goat_jax.layers import positional as layer_lib
from goat_jax.positional import registry
from goat_jax.positional import naive_prior, rope, rope_mixed, rope_scaling

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_config_fields_are_the_encodings_declarations():
    """Every setting of an encoding a model offers is a field of its config, with the very spec
    object the encoding declares (borrowed, never restated); the layer's keywords are the
    registry's setting names."""
    for cls, baselines in ((lm.LMConfig, lm.BASELINES), (vit.ViTConfig, vit.BASELINES)):
        own = fields.specs_of(cls)
        for name, (_, spec) in registry.settings_fields(baselines).items():
            assert own[name] is spec, (cls.__name__, name)
    lm_names = set(registry.settings_fields(lm.BASELINES))
    assert lm_names == {"rope_base", "training_seq_len", "rope_scaling_factor", "yarn_beta_fast",
                        "yarn_beta_slow", "max_len", "fire_threshold_init", "fox_gate_bias_init"}
    assert set(registry.settings_fields(vit.BASELINES)) == {"rope_base", "rope_mixed_base"}
    # Defaults the models choose (the declarations' own for the others).
    assert (lm.LMConfig().max_len, vit.ViTConfig().rope_base, vit.ViTConfig().rope_mixed_base) == (2048, 100.0, 10.0)
    assert lm.LMConfig().yarn_beta_fast == rope_scaling.YarnSettings(training_seq_len=8).yarn_beta_fast == 32.0
    assert fields.specs_of(lm.LMConfig)["baseline_attention_scale"] is registry.ATTENTION_SCALE
    keywords = set(layer_lib.KEYWORDS) | {"training_seq_len"}
    assert keywords == set(registry.settings_fields(positional.ENCODINGS)) | {"rope_base"}
    assert keywords <= {f.name for f in dataclasses.fields(PositionalAttention)}


def test_a_shared_setting_declared_twice_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Other(positional.EncodingSettings):
        rope_base: float = fields.declare(10_000.0, fields.Float(min=1.0))

    class Enc(positional.PositionEncoding):
        name, settings_class = "other", Other

    with pytest.raises(TypeError, match="Other.rope_base is declared apart from RopeSettings.rope_base"):
        registry.settings_fields(positional.ENCODINGS + (Enc(),))

    @dataclasses.dataclass(frozen=True)
    class Config:
        rope_base: float = fields.declare(10.0, fields.Float(min=1.0))

    with pytest.raises(TypeError, match="Config.rope_base is declared apart"):
        registry.add_settings_fields(Config, (rope.ROPE,))


@pytest.mark.parametrize("config, expected", [
    (lm.LMConfig(position_encoding="yarn", training_seq_len=8, yarn_beta_fast=16.0, rope_base=500.0),
     rope_scaling.YarnSettings(rope_base=500.0, training_seq_len=8, yarn_beta_fast=16.0)),
    (lm.LMConfig(position_encoding="naive_prior", max_len=64), naive_prior.NaivePriorSettings(max_len=64)),
    (lm.LMConfig(position_encoding="learned"), positional.EncodingSettings()),
    (vit.ViTConfig(position_encoding="rope_mixed"), rope_mixed.RopeMixedSettings(rope_mixed_base=10.0)),
    (vit.ViTConfig(position_encoding="rope2d"), rope.RopeSettings(rope_base=100.0)),
    (vit.ViTConfig(position_encoding="ape"), positional.EncodingSettings()),
])
def test_models_pass_one_settings_object(config, expected):
    module = (lm.make_attention(config, decode=False) if isinstance(config, lm.LMConfig)
              else vit.make_attention(config))
    assert module.settings == expected and module.encoding_settings() == expected
    assert all(getattr(module, n) is None for n in layer_lib.KEYWORDS)  # nothing passed twice


def test_hand_built_keywords_are_the_settings():
    """The documented keywords build the same settings, and the same layer, as the object."""
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 12, 16))
    by_hand = PositionalAttention(num_heads=2, position_encoding="yarn", training_seq_len=4,
                                  rope_scaling_factor=3.0, yarn_beta_slow=2.0)
    settings = rope_scaling.YarnSettings(training_seq_len=4, rope_scaling_factor=3.0, yarn_beta_slow=2.0)
    assert by_hand.encoding_settings() == settings
    params = by_hand.init(jax.random.PRNGKey(0), x, is_causal=True)
    as_object = PositionalAttention(num_heads=2, position_encoding="yarn", settings=settings)
    np.testing.assert_array_equal(by_hand.apply(params, x, is_causal=True), as_object.apply(params, x, is_causal=True))
    # Keywords of other encodings are ignored; a keyword agreeing with the object is accepted.
    assert PositionalAttention(num_heads=2, position_encoding="rope", max_len=3).encoding_settings() == rope.RopeSettings()
    assert as_object.clone(training_seq_len=4).encoding_settings() == settings
    with pytest.raises(ValueError, match=r"keyword\(s\) \{'training_seq_len': 8\} disagree with settings="):
        as_object.clone(training_seq_len=8).encoding_settings()
    with pytest.raises(TypeError, match="'yarn' takes settings=YarnSettings"):
        as_object.clone(settings=rope.RopeSettings()).encoding_settings()
    # 'rope_mixed': rope_base is its older keyword for rope_mixed_base; a hand-built default is unchanged.
    mixed = PositionalAttention(num_heads=2, position_encoding="rope_mixed", rope_base=10.0)
    assert mixed.encoding_settings() == rope_mixed.RopeMixedSettings(rope_mixed_base=10.0)
    assert mixed.clone(rope_base=None).encoding_settings().rope_mixed_base == 10_000.0
    with pytest.raises(ValueError, match="rope_mixed_base is given twice"):
        mixed.clone(rope_mixed_base=100.0).encoding_settings()


@pytest.mark.parametrize("encoding, match", [
    ("rope_pi", "position_encoding='rope_pi' needs training_seq_len"),
    ("yarn", "position_encoding='yarn' needs training_seq_len"),
    ("ntk", "position_encoding='ntk' needs training_seq_len"),
])
def test_each_requirement_is_checked_by_the_settings_alone(encoding, match):
    """The config's validation and the layer raise the same error: the settings class's."""
    with pytest.raises(ValueError, match=match) as from_config:
        lm.LMConfig(position_encoding=encoding)
    with pytest.raises(ValueError, match=match) as from_layer:
        PositionalAttention(num_heads=2, position_encoding=encoding).init(jax.random.PRNGKey(0), jnp.ones((1, 4, 8)))
    assert str(from_config.value) == str(from_layer.value).split("\n")[0]
    lm.LMConfig(position_encoding="ntk", rope_scaling_factor=2.0)  # a fixed factor needs no length
    with pytest.raises(ValueError, match=r"NaivePriorSettings.max_len=None is not set"):
        PositionalAttention(num_heads=2, position_encoding="naive_prior").init(jax.random.PRNGKey(0), jnp.ones((1, 4, 8)))


@pytest.mark.parametrize("encoding", ["rope2d", "rope_mixed"])
def test_head_dim_requirement_is_the_encodings(encoding):
    """A head size the encoding cannot run on: the ViT config's error is the encoding's own."""
    with pytest.raises(ValueError, match=f"'{encoding}' needs a head dim divisible by 4") as from_config:
        vit.ViTConfig(embed_dim=12, num_heads=2, position_encoding=encoding)
    with pytest.raises(ValueError, match="divisible by 4") as from_layer:
        PositionalAttention(num_heads=2, position_encoding=encoding).init(
            jax.random.PRNGKey(0), jnp.zeros((1, 4, 12)), spatial_shape=(2, 2))
    assert str(from_config.value) == str(from_layer.value).split("\n")[0]


# A new encoding with one knob, written only against the protocol, and registered (the one entry)
# before the models are imported, as an entry of ENCODINGS is. It divides the logits by its knob.
_TOY = textwrap.dedent('''
    import dataclasses, json, sys
    import jax, jax.numpy as jnp
    from absl import flags
    from goat_jax import positional
    from goat_jax.config.fields import Float, declare
    from goat_jax.layers.positional import PositionalAttention

    @dataclasses.dataclass(frozen=True)
    class ToySettings(positional.EncodingSettings):
        toy_temperature: float = declare(1.0, Float(min=0.0, min_inclusive=False, doc="'toy': logits / it"))

    SEEN = []

    class Toy(positional.PositionEncoding):
        name, settings_class = "toy", ToySettings

        def encode(self, layer, ctx, q, k):
            SEEN.append(ctx.settings.toy_temperature)
            return q, k, ctx.scale / ctx.settings.toy_temperature

    positional.register(Toy())

    from goat_jax.config import files as config_files
    from goat_jax.kernels.plan import AttentionPlan
    from goat_jax.tasks import lm as lm_task
    from goat_jax.train import trainer

    def command_line(*overrides):  # experiments.train's --config flag, parsed as the CLI parses it
        values = flags.FlagValues()
        holder = config_files.define_config_flag("config", None, "", flag_values=values)
        sys.argv = ["train", "--config=configs/lm_tiny.py:toy,smoke", *overrides]  # ml_collections reads it
        values(sys.argv)
        return holder.value

    out = {}
    config = command_line("--config.model.toy_temperature=4.0")
    trainer.validate_config(config, num_devices=1)
    model = lm_task.build_model(config, AttentionPlan.from_config(config))
    tokens = jnp.arange(3, 11, dtype=jnp.int32)[None]  # distinct tokens: the logits depend on the knob
    params = model.init(jax.random.PRNGKey(0), tokens)["params"]
    out["seen"] = sorted(set(SEEN))
    out["config"] = repr(model.config.encoding_settings)
    out["written"] = config.model.to_dict()["toy_temperature"]
    out["default"] = lm_task.TASK.fields.defaults()["model.toy_temperature"]
    cool = lm_task.build_model(command_line(), AttentionPlan.from_config(command_line())).apply({"params": params}, tokens)
    out["differs"] = bool(jnp.any(cool != model.apply({"params": params}, tokens)))
    try:
        trainer.validate_config(command_line("--config.model.toy_temperature=-1.0"), num_devices=1)
    except ValueError as e:
        out["refused"] = str(e)
    by_hand = PositionalAttention(num_heads=2, position_encoding="toy", settings=ToySettings(2.0))
    by_hand.init(jax.random.PRNGKey(0), jnp.ones((1, 4, 8)))
    out["by_hand"] = SEEN[-1]
    print("RESULT " + json.dumps(out))
''')


def test_new_encoding_knob_reaches_the_layer_from_the_command_line():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-c", _TOY], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["seen"] == [4.0]  # the layer received the flag's value (every layer, init and apply)
    assert out["config"] == "ToySettings(toy_temperature=4.0)" and out["written"] == 4.0
    assert out["default"] == 1.0  # a config without the field resumes under its declared default
    assert out["differs"]  # the knob changes the function (the default 1.0 gives other logits)
    assert out["refused"].startswith("model.toy_temperature=-1.0 is out of range: allowed is a number "
                                     "finite in float32 > 0 ('toy': logits / it)")
    assert out["by_hand"] == 2.0
