"""Shared by the export tests: runs to export (trained by the trainer, or initialized with random
parameters), the exported model loaded in ``transformers``, and the comparisons with goat-jax."""

import json
import os

import numpy as np

from goat_jax.kernels.plan import AttentionPlan
from tests.config_helpers import random_params, set_fields

# The tolerance of the issue: logits within 1e-4, relative to the largest logit, max over positions.
LOGIT_RTOL = 1e-4


def random_workdir(workdir: str, config, std: float = 0.2, seed: int = 0) -> str:
    """A workdir as experiments.train leaves it (config.json + a checkpoint at step 1) holding
    N(0, std) parameters of ``config``'s model: the export path without compiling a training step."""
    import jax.numpy as jnp
    from goat_jax.train import checkpoint as checkpoint_lib
    from goat_jax.train import run as run_lib
    from goat_jax.train import tasks

    task = tasks.get_task(config.task)
    filled = tasks.with_field_defaults(config, task)
    model = task.build_model(filled, AttentionPlan.from_config(filled))
    tx, _ = run_lib.make_optimizer(task, config)
    params = random_params(model, 8, np.random.default_rng(seed), std=std)
    state = run_lib.TrainState(step=jnp.ones((), jnp.int32), params=params, opt_state=tx.init(params))
    config_dict = config.to_dict()
    os.makedirs(workdir)
    with open(run_lib.config_path(workdir), "w") as f:
        json.dump(config_dict, f, default=str)
    ckpt = checkpoint_lib.Checkpointer(run_lib.checkpoint_dir(workdir), config_dict, keep=1, async_save=False,
                                       resume_safe_fields=task.resume_safe_fields,
                                       field_defaults=tasks.field_defaults(task))
    ckpt.save(1, state, {}, wait=True)
    ckpt.close()
    return workdir


def lm_config(encoding: str = "goat", block: str = "llama", **overrides):
    """``configs/lm_tiny.py:<encoding>,smoke`` (1 layer, width 64, 4 heads, GQA 2, 64 tokens) with
    ``block`` and dotted overrides."""
    from configs import lm_tiny  # pylint: disable=g-import-not-at-top
    config = lm_tiny.get_config(f"{encoding},smoke")
    config.progress_bar = False
    config.model.block = block
    if block == "gpt2":
        config.model.use_bias = True
        config.model.norm_eps = 1e-5
    return set_fields(config, **overrides)


def load_hf(folder: str, dtype=None):
    """The exported model in ``transformers`` (eval mode)."""
    import torch
    from transformers import AutoModelForCausalLM
    kwargs = {} if dtype is None else {"dtype": dtype}
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **kwargs).eval()


def hf_logits(model, tokens, attention_mask=None) -> np.ndarray:
    """float32 logits [B, T, V] of the exported model."""
    import torch
    with torch.no_grad():
        mask = None if attention_mask is None else torch.as_tensor(np.asarray(attention_mask))
        return model(torch.as_tensor(np.asarray(tokens)), attention_mask=mask).logits.float().numpy()


def goat_logits(run, tokens) -> np.ndarray:
    """goat-jax's logits [B, T, V] of a loaded run."""
    import jax.numpy as jnp
    return np.asarray(run.model.apply({"params": run.params}, jnp.asarray(tokens)))


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| over positions, relative to the largest |want|."""
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def hf_greedy(model, prompt, new: int) -> np.ndarray:
    """Greedy ``model.generate`` of ``new`` tokens (no early stop at EOS, as goat-jax's generate)."""
    import torch
    with torch.no_grad():
        return model.generate(torch.as_tensor(np.asarray(prompt)), max_new_tokens=new, min_new_tokens=0,
                              do_sample=False, eos_token_id=None).numpy()


def goat_greedy(run, prompt, new: int) -> np.ndarray:
    """goat-jax's greedy generate (goat_jax/models/sampling.py)."""
    import jax.numpy as jnp
    from goat_jax.models import sampling
    return np.asarray(sampling.generate(run.model, {"params": run.params}, jnp.asarray(prompt), new))


def check_export_matches(run, folder: str, rng: np.random.Generator, vocab: int, new: int = 32) -> dict:
    """The checks every exported model passes: logits within :data:`LOGIT_RTOL` on a prompt
    shorter and one longer than the training length, greedy generation of ``new`` tokens equal
    to goat-jax's, and a left-padded batch equal to its rows run alone. Returns the errors."""
    model = load_hf(folder)
    train_len = int(run.config.seq_len)
    errors = {}
    for length in (train_len // 2, 2 * train_len + 3):
        tokens = rng.integers(3, vocab, (2, length))
        errors[length] = rel_err(hf_logits(model, tokens), goat_logits(run, tokens))
        assert errors[length] < LOGIT_RTOL, (length, errors[length])
    prompt = rng.integers(3, vocab, (2, 7))
    np.testing.assert_array_equal(hf_greedy(model, prompt, new), goat_greedy(run, prompt, new))
    # Left padding: row 0 is 5 tokens shorter; its real tokens get the logits they get alone.
    tokens = rng.integers(3, vocab, (2, 12))
    mask = np.ones((2, 12), np.int64)
    mask[0, :5] = 0
    padded = hf_logits(model, tokens, mask)
    alone = hf_logits(model, tokens[:1, 5:])
    errors["left_padded"] = rel_err(padded[0, 5:], alone[0])
    assert errors["left_padded"] < LOGIT_RTOL, errors["left_padded"]
    import torch
    with torch.no_grad():
        batch = model.generate(torch.as_tensor(tokens), attention_mask=torch.as_tensor(mask), max_new_tokens=8,
                               do_sample=False, eos_token_id=None).numpy()
    np.testing.assert_array_equal(batch[0, 12:], hf_greedy(model, tokens[:1, 5:], 8)[0, 7:])
    return errors
