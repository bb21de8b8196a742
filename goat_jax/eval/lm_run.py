"""A language-model run read back from its workdir: :class:`LMRun` (the properties the
language evaluations compare runs by) and :func:`load_lm_run`. Its own module, below both
:mod:`goat_jax.eval.runs` (the evaluations by name) and :mod:`goat_jax.eval.harness` (the
lm-evaluation-harness adapter), so that each reads runs without importing the other.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from goat_jax.models.lm import TransformerLM
from goat_jax.train import run as run_lib


class LMRun(run_lib.Run):
    """A run of the 'lm' task (:func:`goat_jax.train.run.load_run`) with the properties the
    language evaluations compare runs by."""

    @property
    def label(self) -> str:
        """The position encoding: what the comparisons are about."""
        return str(self.config.model.position_encoding)

    @property
    def train_len(self) -> int:
        """The training context length."""
        return int(self.config.seq_len)

    @property
    def is_synthetic(self) -> bool:
        """Whether the run trained on a synthetic task (copy mixture, passkey, NIAH)."""
        return self.config.data.get("source") == "synthetic"


def load_lm_run(workdir: str, step: Optional[int] = None) -> LMRun:
    """:func:`goat_jax.train.run.load_run` (read-only: safe on a run still training) for a run
    whose task is the language model; ValueError naming ``config.task`` otherwise."""
    run = run_lib.load_run(workdir, step)
    if not isinstance(run.model, TransformerLM):  # the task built its model: 'lm' and 'dna' build the LM
        raise ValueError(f"{workdir}: config.task={run.config.task!r} trained a "
                         f"{type(run.model).__name__}; the language evaluations need the LM (TransformerLM).")
    return LMRun(**{f.name: getattr(run, f.name) for f in dataclasses.fields(run)})
