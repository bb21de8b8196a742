"""The paper runs at a glance: model size, token budget, and where each config departs from the
official recipe. ``python -m experiments.reproduce --suite paper --dry_run`` prints it (as shell
comments) before the commands.

The official recipes are written out here field by field from docs/protocols.md -- independently
of the config files, so the table checks the configs rather than repeating them:

* C4 125M: the official ``train_c4.py`` (docs/protocols.md, C4 125M). Every field it fixes.
* FineWeb 1.23B: there is no official script. The paper fixes the model shape, the data and the
  training length only; those are checked, and every other choice in the config is ours.
* Synthetic passkey / NIAH: the official ``synthetic.py`` settings (docs/protocols.md, Passkey
  and NIAH): GOAT R = M = 8 and ``init_scale_prior`` 3e-3, the loss (global + 10 * span) / 11,
  the baselines at attention scale 1, NIAH trained at 256. Sizes the docs do not state are ours.
* The toy copy mixture (paper Figure 1) has no official script.

Parameter counts come from ``jax.eval_shape`` of each run's own ``init`` (nothing allocated).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Optional

import jax
import numpy as np

from goat_jax.config.files import load_config
from goat_jax.models import lm
from goat_jax.reproduce.suites import Job
from goat_jax.train import tasks
from goat_jax.kernels.plan import AttentionPlan

C4_TOKENS = 4_000_000_000  # the official token budget (train_c4.py)
C4_SEQ, C4_BATCH = 2048, 128  # 128 x 2048 = 262,144 tokens per step


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What a run is compared against: ``source`` (where the values come from) and ``fields``
    (dotted config field -> official value) for the fields that source fixes."""

    source: str
    fields: dict


def _c4(encoding: str) -> Recipe:
    return Recipe("official train_c4.py (docs/protocols.md, C4 125M)", {
        "seq_len": C4_SEQ, "seed": 1337 + (33 if encoding == "goat" else 0),
        "global_batch_size": C4_BATCH, "grad_accum_steps": 8,
        "num_train_steps": -(-C4_TOKENS // (C4_BATCH * C4_SEQ)),  # 4B tokens, last step rounded up
        "eval_every_steps": 2000,
        "optimizer.learning_rate": 1e-4, "optimizer.min_lr_ratio": 3e-5 / 1e-4,
        "optimizer.warmup_steps": 2000, "optimizer.weight_decay": 0.1,
        "optimizer.decay_grouping": "official_c4",
        "model.block": "gpt2", "model.num_layers": 12, "model.embed_dim": 768, "model.num_heads": 12,
        "model.kv_num_heads": 12, "model.mlp_dim": 3072, "model.vocab_size": 50_257,
        "model.use_bias": True, "model.norm_eps": 1e-5, "model.tie_embeddings": True,
        "model.init_std": 0.02, "model.attention_init_std": 0.02,
        "model.pos_rank": 4, "model.abs_rank": 4, "model.init_scale_prior": 1e-3,
        "model.enable_key_bias": True,
        "model.training_seq_len": C4_SEQ,
        "data.tokenizer": "gpt2", "data.bos_windows": True, "data.num_eval_batches": 50,
        "data.tfds_name": "c4/en",
    })


def _fineweb(encoding: str) -> Recipe:
    del encoding
    return Recipe("no official script: the paper fixes the Llama 3.2 1B shape, FineWeb and the "
                  "2048-token training length; every other choice is ours", {
                      "seq_len": 2048, "model.block": "llama", "model.num_layers": 16,
                      "model.embed_dim": 2048, "model.num_heads": 32, "model.kv_num_heads": 8,
                      "model.mlp_dim": 8192, "model.vocab_size": 128_256,
                      "model.tie_embeddings": True,
                  })


def _synthetic(task: str, encoding: str) -> Recipe:
    fields = {"data.span_loss_weight": 10.0}
    if encoding == "goat":
        fields.update({"model.pos_rank": 8, "model.abs_rank": 8, "model.init_scale_prior": 3e-3})
    else:
        fields["model.baseline_attention_scale"] = 1.0
    if task == "niah":
        fields["seq_len"] = 256  # trained at 256, tested 512-16384
    return Recipe("official synthetic.py settings (docs/protocols.md, Passkey / NIAH); model sizes, "
                  "steps and the passkey length ours", fields)


def official_recipe(kind: str, dataset: str, encoding: str) -> Optional[Recipe]:
    """The recipe a paper run (a :class:`~goat_jax.reproduce.suites.Job`'s kind and dataset) is
    compared against; None for the toy, which has no official script."""
    if kind == "lm" and dataset == "c4_125m":
        return _c4(encoding)
    if kind == "lm" and dataset == "fineweb_1b":
        return _fineweb(encoding)
    if kind in ("passkey", "niah"):
        return _synthetic(kind, encoding)
    return None


def _get(config, dotted: str):
    """The run's value of ``dotted``; a ``model.*`` field the config leaves out is the model
    config's default (what the run builds), any other missing field '<absent>'."""
    section, _, field = dotted.rpartition(".")
    node = config
    for part in filter(None, section.split(".")):
        node = node.get(part, {})
    if field in node:
        return node[field]
    if section == "model" and config.task in ("lm", "dna"):  # the tasks that build the LM
        return getattr(lm.LMConfig(), field, "<absent>")
    return "<absent>"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return not isinstance(b, bool) and math.isclose(a, b, rel_tol=1e-9)
    return a == b


def differences(config, recipe: Recipe) -> dict:
    """``{field: (config value, official value)}`` for every field of ``recipe`` the config sets
    otherwise (a missing field shows as '<absent>')."""
    return {k: (_get(config, k), v) for k, v in recipe.fields.items() if not _same(_get(config, k), v)}


def parameter_count(config) -> int:
    """Parameters of the run's model, from ``jax.eval_shape`` of its task's ``init`` on the
    training input shapes (nothing is allocated, so 1B models count in seconds on a CPU)."""
    task = tasks.get_task(config.task)
    model = task.build_model(config, AttentionPlan.from_config(config))
    batch = task.dummy_batch(config, 1)
    inputs = [jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype) for x in task.model_inputs(batch)]
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), *inputs)
    return int(sum(np.prod(leaf.shape, dtype=np.int64) for leaf in jax.tree_util.tree_leaves(shapes["params"])))


@dataclasses.dataclass(frozen=True)
class Row:
    """One paper run: its name and config spec, size, budget, and recipe comparison."""

    name: str
    spec: str
    params: int
    tokens_per_step: int
    steps: int
    recipe: Optional[Recipe]
    diffs: dict

    @property
    def total_tokens(self) -> int:
        """Training tokens over the whole run (tokens per step x steps)."""
        return self.tokens_per_step * self.steps


def rows(jobs: Sequence[Job]) -> list[Row]:
    """A :class:`Row` per job, from the config its ``spec`` and ``overrides`` build."""
    out = []
    for job in jobs:
        config = load_config(job.spec, job.overrides)
        task = tasks.get_task(config.task)
        recipe = official_recipe(job.kind, job.dataset, job.encoding)
        out.append(Row(job.name, job.spec, parameter_count(config),
                       int(config.global_batch_size) * int(task.tokens_per_example(config)),
                       int(config.num_train_steps), recipe,
                       differences(config, recipe) if recipe else {}))
    return out


def _short(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def render(table: Sequence[Row]) -> str:
    """The table as Markdown lines prefixed with '# ' (valid shell comments, so the dry run's
    output stays a runnable script), then each recipe's source once."""
    lines = ["| run | config | parameters | tokens/step | steps | total tokens | differs from the official recipe |",
             "|---|---|---|---|---|---|---|"]
    sources = {}
    for r in table:
        if r.recipe is None:
            diff = "no official recipe (ours)"
        elif r.diffs:
            diff = "; ".join(f"{k} = {v!r} (official {o!r})" for k, (v, o) in r.diffs.items())
        else:
            diff = "none"
        if r.recipe is not None and r.recipe.source.startswith("no official"):
            diff = f"{diff} (of the paper's stated fields; no official script, every other choice ours)"
        if r.recipe is not None:
            datasets = sources.setdefault(r.recipe.source, [])
            if r.name.split("/")[1] not in datasets:
                datasets.append(r.name.split("/")[1])
        lines.append(f"| {r.name} | {r.spec} | {r.params:,} ({_short(r.params)}) | {r.tokens_per_step:,} | "
                     f"{r.steps:,} | {r.total_tokens:,} ({_short(r.total_tokens)}) | {diff} |")
    lines.append("")
    lines += [f"{', '.join(datasets)}: {source}." for source, datasets in sources.items()]
    return "\n".join("# " + line if line else "#" for line in lines)
