"""Export a trained run to a Hugging Face folder (:func:`export_run`) and make a goat-jax run of
such a folder again (:func:`import_hf`). docs/export.md has the commands and the layout.

Every check runs before anything is read or written (one-line ValueErrors naming the argument);
the folder is written beside ``--out`` and moved into place when complete, so a failed export
leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Dict, Optional

from goat_jax.export import mapping, safetensors_io
from goat_jax.export import tokenizer as tokenizer_lib
from goat_jax.kernels.plan import AttentionPlan

DTYPES = ("float32", "bfloat16")
MODELING_FILES = ("configuration_goat.py", "modeling_goat.py")
HF_SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf")
DEFAULT_SHARD_SIZE = "5GB"
_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30}


def parse_size(text: Any) -> int:
    """Bytes of ``'5GB'``, ``'200MB'``, ``'1GiB'`` or a plain integer; ValueError naming
    ``--max_shard_size`` otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", str(text), re.IGNORECASE)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"--max_shard_size {text!r}: give a positive size such as 5GB, 200MB or 1GiB.")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def _run_model(config: Any):
    """``(task, LMConfig, window)`` of a run's config (ValueError for a task without the LM)."""
    from goat_jax.models.lm import TransformerLM  # pylint: disable=g-import-not-at-top
    from goat_jax.train import tasks as tasks_lib  # pylint: disable=g-import-not-at-top
    task = tasks_lib.get_task(config.task)
    config = tasks_lib.with_field_defaults(config, task)
    model = task.build_model(config, AttentionPlan.from_config(config))  # the export's one plan
    if not isinstance(model, TransformerLM):
        raise ValueError(f"config.task={config.task!r} trains a {type(model).__name__}; the export takes the "
                         "language model of the 'lm' and 'dna' tasks.")
    window = model.plan.window
    return task, config, model, window


def check_export(workdir: str, out: str, *, step: Optional[int] = None, dtype: str = "float32",
                 overwrite: bool = False, max_shard_size: Any = DEFAULT_SHARD_SIZE, tokenizer: str = "run"):
    """Every check of an export request, before any work; returns ``(config, model, max_shard_bytes)``."""
    from goat_jax.train import run as run_lib  # pylint: disable=g-import-not-at-top
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: the stored weights are one of {DTYPES}.")
    shard_bytes = parse_size(max_shard_size)
    if not os.path.isfile(run_lib.config_path(workdir)):
        raise ValueError(f"--workdir {workdir}: no config.json there, so not a run of experiments.train.")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out} exists and is not a directory; give a new folder.")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise ValueError(f"--out {out} exists and is not empty; give a new folder, or --overwrite to replace it.")
    run_lib.check_output_dir(out, "the export", "_hf")
    _, config, model, window = _run_model(run_lib.read_config(workdir))
    mapping.check_exportable(model.config, window)
    tokenizer_lib.check_tokenizer(config, tokenizer)
    steps = run_lib.checkpoint_steps(workdir)
    if not steps:
        raise ValueError(f"--workdir {workdir} holds no complete checkpoint yet.")
    if step is not None and step not in steps:
        raise ValueError(f"--step {step}: {workdir} has checkpoints at steps {list(steps)}.")
    return config, model, shard_bytes


def _eval_rows(workdir: str) -> Dict[str, float]:
    """The run's last logged evaluation (the ``eval_*`` values of its metrics), or {}."""
    from goat_jax.train import run as run_lib  # pylint: disable=g-import-not-at-top
    if not os.path.isfile(run_lib.metrics_path(workdir)):
        return {}
    rows = [r for r in run_lib.read_metrics(workdir) if any(k.startswith("eval_") for k in r)]
    if not rows:
        return {}
    return {"step": rows[-1].get("step"), **{k: v for k, v in rows[-1].items() if k.startswith("eval_")}}


def model_card(hf: Dict[str, Any], run_config: Any, step: int, evals: Dict[str, Any], dtype: str) -> str:
    """The folder's README.md: what the model is, its config, the run's evaluation, how to load it."""
    enc = hf["position_encoding"]
    what = "GOAT attention (learned log-prior packed into q/k channels, arXiv 2601.15380)" if enc == "goat" else (
        f"the {enc!r} position encoding")
    lines = ["---", "library_name: transformers", "tags: [goat-jax, custom_code]", "---", "",
             f"# goat-jax {run_config.task} model ({enc}, {hf['block']} blocks)", "",
             f"A decoder-only language model trained with goat-jax (task {run_config.task!r}, "
             f"{run_config.seq_len}-token windows, checkpoint step {step}) using {what}, exported to PyTorch for "
             f"`transformers` by `python -m experiments.export`; weights stored in {dtype}.", "",
             "## Config", "", "| setting | value |", "|---|---|"]
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "block", "position_encoding", "training_seq_len", "pos_rank", "abs_rank",
            "enable_key_bias", "prior_gate", "sink_extrapolation", "learn_frequencies", "qk_layout", "content_dim",
            "rope_base", "rope_scaling_factor", "logn_scaling", "tie_embeddings")
    lines += [f"| {k} | {hf[k]} |" for k in keys if k in hf]
    lines += ["", "## Evaluation", ""]
    if evals:
        lines += [f"The run's last held-out evaluation (step {evals.get('step')}):", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v:.6g} |" if isinstance(v, float) else f"| {k} | {v} |"
                  for k, v in evals.items() if k != "step"]
    else:
        lines += ["The run's workdir held no evaluation results."]
    lines += ["", "## Load", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
              "model = AutoModelForCausalLM.from_pretrained(FOLDER, trust_remote_code=True)",
              "tokenizer = AutoTokenizer.from_pretrained(FOLDER)",
              "ids = tokenizer('Hello', return_tensors='pt').input_ids",
              "out = model.generate(ids, max_new_tokens=32, do_sample=False)", "```", "",
              "Back to goat-jax: `python -m experiments.export --from_hf FOLDER --workdir NEW_RUN`.", ""]
    return "\n".join(lines)


def export_run(workdir: str, out: str, *, step: Optional[int] = None, dtype: str = "float32",
               overwrite: bool = False, max_shard_size: Any = DEFAULT_SHARD_SIZE, tokenizer: str = "run") -> str:
    """Writes the Hugging Face folder of ``workdir``'s checkpoint (``step``, default the newest)
    into ``out``: the weights (safetensors, PyTorch layout, ``dtype``; the prior's parameters stay
    float32), ``config.json``, the modeling files, the tokenizer (``tokenizer='none'``: none),
    ``generation_config.json`` and a README model card. Returns ``out``."""
    import ml_dtypes  # pylint: disable=g-import-not-at-top
    from goat_jax.train import run as run_lib  # pylint: disable=g-import-not-at-top
    config, model, shard_bytes = check_export(workdir, out, step=step, dtype=dtype, overwrite=overwrite,
                                              max_shard_size=max_shard_size, tokenizer=tokenizer)
    run = run_lib.load_run(workdir, step)
    cfg = model.config
    tensors = mapping.to_torch(run.params, cfg)
    if dtype == "bfloat16":
        tensors = {k: v if ".prior." in k else v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    staging = os.path.abspath(out).rstrip(os.sep) + ".export-tmp"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        safetensors_io.write_weights(staging, tensors, shard_bytes)
        for name in MODELING_FILES:
            shutil.copyfile(os.path.join(HF_SOURCE_DIR, name), os.path.join(staging, name))
        special = {}
        if tokenizer == "run":
            special = tokenizer_lib.write(staging, config, cfg.max_positions or int(config.seq_len))
        hf = mapping.hf_config(cfg, {**special, "dtype": dtype, "goat_jax": {
            "config": json.loads(json.dumps(config.to_dict(), default=str)), "step": run.step}})
        with open(os.path.join(staging, "config.json"), "w") as f:
            json.dump(hf, f, indent=1)
        generation = {"do_sample": False, **special}
        with open(os.path.join(staging, "generation_config.json"), "w") as f:
            json.dump(generation, f, indent=1)
        with open(os.path.join(staging, "README.md"), "w") as f:
            f.write(model_card(hf, config, run.step, _eval_rows(workdir), dtype))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.rename(staging, out)
    return out


def read_hf_config(folder: str) -> Dict[str, Any]:
    """The ``config.json`` of an exported folder; ValueError naming ``--from_hf`` when the folder
    was not written by :func:`export_run`."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"--from_hf {folder}: no config.json there; give a folder written by experiments.export.")
    with open(path) as f:
        hf = json.load(f)
    if hf.get("model_type") != mapping.MODEL_TYPE or not isinstance(hf.get("goat_jax"), dict):
        raise ValueError(f"--from_hf {folder}: config.json is not a goat-jax export (model_type "
                         f"{hf.get('model_type')!r}, no 'goat_jax' run config); only folders written by "
                         "experiments.export can be imported.")
    return hf


def import_hf(folder: str, workdir: str, *, step: Optional[int] = None) -> str:
    """Makes a goat-jax run in ``workdir`` (new or empty) of an exported ``folder``: its
    ``config.json`` (the run's config as exported) and a checkpoint at ``step`` (default the
    exported step) holding the folder's weights and a fresh optimizer state (resuming training
    from it restarts the optimizer's moments). Float32 weights come back bit-equal. Returns
    ``workdir``."""
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    import flax  # pylint: disable=g-import-not-at-top
    import ml_collections  # pylint: disable=g-import-not-at-top
    from goat_jax.train import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top
    from goat_jax.train import run as run_lib  # pylint: disable=g-import-not-at-top
    from goat_jax.train import tasks as tasks_lib  # pylint: disable=g-import-not-at-top

    hf = read_hf_config(folder)
    if os.path.exists(workdir) and (not os.path.isdir(workdir) or os.listdir(workdir)):
        raise ValueError(f"--workdir {workdir} exists and is not an empty directory; give a new folder for the run.")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"--step {step!r}: give an integer >= 0 (the imported checkpoint's step).")
    config = ml_collections.ConfigDict(hf["goat_jax"]["config"])
    task, full, model, _ = _run_model(config)
    step = int(hf["goat_jax"].get("step", 0)) if step is None else step
    shapes = flax.core.meta.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))
    params = mapping.from_torch(safetensors_io.read_weights(folder), model.config, shapes["params"])
    params = jax.tree.map(jnp.asarray, params)
    tx, _ = run_lib.make_optimizer(task, full)
    state = run_lib.TrainState(step=jnp.asarray(step, jnp.int32), params=params, opt_state=tx.init(params))
    os.makedirs(workdir, exist_ok=True)
    with open(run_lib.config_path(workdir), "w") as f:
        json.dump(config.to_dict(), f, indent=1, default=str)
    ckpt = checkpoint_lib.Checkpointer(run_lib.checkpoint_dir(workdir), config.to_dict(), keep=1, async_save=False,
                                       resume_safe_fields=task.resume_safe_fields,
                                       field_defaults=tasks_lib.field_defaults(task))
    try:
        ckpt.save(step, state, {}, wait=True)
    finally:
        ckpt.close()
    return workdir

