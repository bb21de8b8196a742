"""The official C4 weight-decay grouping (``optimizer.decay_grouping='official_c4'``).

The official script decays every parameter whose name contains none of ``.bias``, ``ln``,
``norm``, ``lambda_``, ``key_bias`` (docs/protocols.md, C4 125M). Checked by name against the
official ``goat.GoatAttention``'s parameters, mapped to ours through the interop conversion,
and end to end through the engine's optimizer.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import lm_tiny
from tests.config_helpers import set_fields
from goat_jax import interop
from goat_jax.models import lm
from goat_jax.tasks import lm as lm_task
from goat_jax.train import run as run_lib
from goat_jax.train import tasks
from goat_jax.train import trainer

torch = pytest.importorskip("torch")
goat = pytest.importorskip("goat")

OFFICIAL_EXCLUDED = (".bias", "ln", "norm", "lambda_", "key_bias")  # train_c4.py's substrings


def _dotted(path):
    names = (getattr(k, "key", getattr(k, "name", None)) for k in path)
    return ".".join(str(n) for n in names if n not in (None, "value"))


def test_official_grouping_selects_the_official_attention_parameters():
    """Each official parameter is filled with its own index; the converted module's leaves then
    name the official parameter they came from, and our mask must decay exactly the official
    set (the script's substring rule on ``blocks.0.attn.<name>``)."""
    m = goat.GoatAttention(64, 4, pos_rank=4, abs_rank=4, training_seq_len=32, bias=True,
                           batch_first=True)
    names = [n for n, _ in m.named_parameters()]
    with torch.no_grad():
        for i, (_, p) in enumerate(m.named_parameters()):
            p.fill_(float(i + 1))
    official_decayed = {n for n in names
                        if not any(s in f"blocks.0.attn.{n}" for s in OFFICIAL_EXCLUDED)}
    # The rule's consequences, spelled out: the sink's gain, bump and slope and the gates are
    # decayed; the Fourier coefficients, the sink MLP and every bias are not.
    assert official_decayed == {
        "q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight", "sink_gain",
        "sink_bump", "recency_slope_raw", "prior_gate_scale_raw", "prior_gate_bias"}

    _, variables = interop.from_official(m)
    params = {"layer_0": {"attention": variables["params"]}}
    mask = lm_task.official_c4_decay_mask(params)
    ours = {}
    for (path, leaf), (_, decayed) in zip(jax.tree_util.tree_leaves_with_path(params),
                                          jax.tree_util.tree_leaves_with_path(mask)):
        index = int(np.asarray(leaf).flat[0]) - 1
        assert np.all(np.asarray(leaf) == index + 1), _dotted(path)  # one official source each
        ours[names[index]] = decayed
    assert set(ours) == set(names)  # every official parameter has exactly one counterpart
    assert {n for n, decayed in ours.items() if decayed} == official_decayed


def test_official_grouping_on_the_gpt2_lm():
    """Embedding and every kernel decayed; biases, LayerNorms, lambda_* and the sink MLP not."""
    cfg = lm.LMConfig(block="gpt2", use_bias=True, norm_eps=1e-5, pos_rank=4, abs_rank=4,
                      num_layers=1, embed_dim=64, mlp_dim=64, training_seq_len=16)
    boxed = jax.eval_shape(lm.TransformerLM(cfg).init, jax.random.PRNGKey(0),
                           jnp.zeros((1, 8), jnp.int32))["params"]
    mask = lm_task.official_c4_decay_mask(boxed)
    flat = {_dotted(p): bool(v) for p, v in jax.tree_util.tree_leaves_with_path(mask)}
    decayed = {k for k, v in flat.items() if v}
    attn = "layer_0.attention."
    assert decayed == {
        "embed.embedding", "layer_0.mlp.wi.kernel", "layer_0.mlp.wo.kernel",
        *(f"{attn}{p}.kernel" for p in ("q_proj", "k_proj", "v_proj", "out_proj")),
        *(f"{attn}prior.{p}" for p in ("sink_gain", "sink_bump", "recency_slope_raw",
                                       "prior_gate_scale_raw", "prior_gate_bias"))}
    assert not flat["final_norm.scale"] and not flat["layer_0.attention.prior.lambda_sym"]
    assert not flat["layer_0.attention.prior.key_bias.fc1.kernel"]


def _smoke(grouping=None):
    config = set_fields(lm_tiny.get_config("goat,smoke"))  # with the engine's defaults, as a run has them
    if grouping is not None:
        config.optimizer.decay_grouping = grouping
    return config


def test_engine_applies_the_chosen_grouping():
    """With zero gradients, AdamW's update is -lr * wd * param on decayed leaves, 0 elsewhere."""
    task = tasks.get_task("lm")
    params = {"layer_0": {"attention": {"prior": {
        "sink_gain": jnp.full((4,), 2.0), "lambda_sym": jnp.full((4, 4), 2.0)},
        "q_proj": {"kernel": jnp.full((8, 4, 2), 2.0), "bias": jnp.full((4, 2), 2.0)}}}}
    zeros = jax.tree.map(jnp.zeros_like, params)
    for grouping, gain_decayed in ((None, False), ("default", False), ("official_c4", True)):
        config = _smoke(grouping)
        tx, schedule = run_lib.make_optimizer(task, config)
        updates, _ = tx.update(zeros, tx.init(params), params)
        step = -float(schedule(0)) * config.optimizer.weight_decay * 2.0
        prior = updates["layer_0"]["attention"]["prior"]
        np.testing.assert_allclose(prior["sink_gain"], step if gain_decayed else 0.0, rtol=1e-6)
        np.testing.assert_allclose(prior["lambda_sym"], 0.0)
        q = updates["layer_0"]["attention"]["q_proj"]
        np.testing.assert_allclose(q["kernel"], step, rtol=1e-6)
        np.testing.assert_allclose(q["bias"], 0.0)


def test_unknown_grouping_is_refused_naming_the_field():
    trainer.validate_config(_smoke("official_c4"), num_devices=1)
    trainer.validate_config(_smoke(), num_devices=1)  # the field is optional
    with pytest.raises(ValueError, match=r"optimizer.decay_grouping='gpt3'.*official_c4"):
        trainer.validate_config(_smoke("gpt3"), num_devices=1)
