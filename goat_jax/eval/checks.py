"""Checks ``experiments.evaluate`` makes before any evaluation runs: which evaluations apply to
which runs (:data:`EVAL_TASKS`); whether ``--out`` can take the results without writing into a
run is :func:`goat_jax.train.run.check_output_dir`, shared with the compile tool. They read only
each run's ``config.json``, so a refused command has done no work.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Optional

from goat_jax.data import synthetic
from goat_jax.train import run as run_lib

# Each evaluation and the training tasks (``config.task``) of the runs it applies to: the
# language evaluations (and lm-eval's text tasks) read a text or synthetic LM run's own data and
# tokenizer, 'dna' scores FASTA bases with a genome run, 'resolution' (goat_jax.eval.vision) a
# ViT. A mismatch is refused before any work by :func:`check_evals_fit`.
EVAL_TASKS = {
    "extrapolation": ("lm",), "passkey": ("lm",), "niah": ("lm",), "sinks": ("lm",),
    "diagnostics": ("lm",), "documents": ("lm",), "dna": ("dna",), "lm_eval": ("lm",), "resolution": ("vit",),
}

def evals_for_task(task: str) -> list[str]:
    """The evaluations that apply to a run of ``config.task = task`` (:data:`EVAL_TASKS`)."""
    return [e for e, tasks in EVAL_TASKS.items() if task in tasks]


def check_evals_fit(workdirs: Sequence[str], evals: Sequence[str]) -> None:
    """Refuses, before any work, an evaluation that does not apply to a run's task (e.g.
    ``passkey`` on a DNA run), or an unknown one; reads only each ``config.json``.

    Raises:
      ValueError: naming the evaluation, the run and its task, and listing the evaluations
        that fit it.
    """
    unknown = sorted(set(evals) - set(EVAL_TASKS))
    if unknown:
        raise ValueError(f"unknown evaluation(s) {unknown}; choose from {tuple(EVAL_TASKS)}.")
    for workdir in workdirs:
        task = str(run_lib.read_config(workdir).get("task"))
        wrong = [e for e in evals if task not in EVAL_TASKS[e]]
        if wrong:
            fits = evals_for_task(task)
            raise ValueError(
                f"--evals {','.join(wrong)} does not apply to {workdir}, a run of "
                f"config.task={task!r}; the evaluations for it are: "
                f"{', '.join(fits) if fits else 'none (no evaluation knows this task)'}.")


def passkey_lengths(config, multipliers: Sequence[int],
                    variant: Optional[str] = None) -> tuple[str, list[int], list[int], int]:
    """``(variant, lengths evaluated, lengths skipped, shortest length it takes)`` of the passkey
    evaluation of a run with ``config`` at ``m x seq_len`` for each multiplier. ``variant``
    (default: the run's, as experiments.evaluate scores it): 'synthetic' (a synthetic run's own
    task), which needs the needle and the query, or 'standard' (the Landmark prompt), which needs
    the fixed task text, needle and question (~280 bytes). Shorter lengths cannot hold the
    prompt and are skipped."""
    if variant is None:
        variant = "synthetic" if synthetic.is_synthetic(config) else "standard"
    lengths = [int(m * int(config.seq_len)) for m in multipliers]
    if variant == "synthetic":
        key_len = int(synthetic.SYNTHETIC.value(config.data, "key_len"))
        shortest = 1 + len(synthetic.PASSKEY_NEEDLE) + len(synthetic.PASSKEY_QUERY) + 2 * key_len
    else:
        shortest = synthetic.passkey_prompt_length(key=synthetic.PASSKEY_MAX_KEY)
    return variant, [n for n in lengths if n >= shortest], [n for n in lengths if n < shortest], shortest


def check_passkey_lengths(config, workdir: str, multipliers: Sequence[int]) -> None:
    """Refuses, before any work, a passkey request none of whose lengths can hold the prompt
    (it gave an empty table and figure, and exit status 0)."""
    variant, ok, skipped, shortest = passkey_lengths(config, multipliers)
    if not ok:
        need = -(-shortest // int(config.seq_len))
        raise ValueError(
            f"--evals passkey on {workdir}: every length ({', '.join(map(str, skipped))} tokens: "
            f"--multipliers x seq_len {int(config.seq_len)}) is shorter than the {shortest} tokens "
            f"the {variant} passkey prompt needs (task, needle and question), so nothing would be "
            f"evaluated; give --multipliers of at least {need}.")
