"""A language-model run read back from its workdir: :class:`LMRun` (the properties the
language evaluations compare runs by) and :func:`load_lm_run`. Its own module, below both
:mod:`goat_jax.eval.runs` (the evaluations by name) and :mod:`goat_jax.eval.harness` (the
lm-evaluation-harness adapter), so that each reads runs without importing the other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

import ml_collections

from goat_jax.config.fields import value_of
from goat_jax.data import synthetic
from goat_jax.eval import checks, context, extrapolation
from goat_jax.models.lm import LMConfig, TransformerLM
from goat_jax.positional import rope_scaling
from goat_jax.train import run as run_lib


@dataclasses.dataclass
class LMRun(run_lib.Run):
    """A run of the 'lm' task (:func:`goat_jax.train.run.load_run`) with the properties the
    language evaluations compare runs by. ``mesh``: None (one device), or the mesh whose
    ``context`` axis each window is split over (:func:`goat_jax.eval.context.on_mesh`)."""

    mesh: Any = None

    @property
    def apply_fn(self):
        """``(params, tokens [B, T]) -> logits [B, T, V]`` of the run's model, each window split
        over :attr:`mesh`'s ``context`` axis (with the run's ``context_strategy``) when there is one
        (:func:`goat_jax.eval.context.apply_fn`)."""
        if self.mesh is None:
            return extrapolation.model_apply_fn(self.model)
        return context.apply_fn(self.model, self.mesh, self.config)

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
        return synthetic.is_synthetic(self.config)


def load_lm_run(workdir: str, step: Optional[int] = None) -> LMRun:
    """:func:`goat_jax.train.run.load_run` (read-only: safe on a run still training) for a run
    whose task is the language model; ValueError naming ``config.task`` otherwise."""
    run = run_lib.load_run(workdir, step)
    if not isinstance(run.model, TransformerLM):  # the task built its model: 'lm' and 'dna' build the LM
        raise ValueError(f"{workdir}: config.task={run.config.task!r} trained a "
                         f"{type(run.model).__name__}; the language evaluations need the LM (TransformerLM).")
    return LMRun(**{f.name: getattr(run, f.name) for f in dataclasses.fields(run)})


# Encodings that read a RoPE run's parameters unchanged at evaluation time: the same projections,
# no parameters of their own; only the rotation frequencies (and YaRN's temperature) differ.
SWAPS = {"rope": ("yarn", "ntk", "rope_pi")}


# Encodings whose factor, when not fixed (rope_scaling_factor None), follows the key length of
# the whole call: in a window of packed documents that is the window's, not each document's, so
# they refuse packed windows longer than the training length without a fixed factor.
WINDOW_FACTOR = (rope_scaling.Ntk.name, rope_scaling.Yarn.name)


def check_swap(config: ml_collections.ConfigDict, workdir: str, position_encoding: Optional[str] = None,
               logn_scaling: Optional[str] = None, rope_scaling_factor: Optional[float] = None) -> None:
    """Raises ValueError naming the flag unless a run with ``config`` (its config.json) can be
    evaluated with ``position_encoding`` / ``logn_scaling`` / a fixed ``rope_scaling_factor``
    ('yarn' and 'ntk' only) on its own parameters (:func:`swap_encoding`); reads nothing else,
    so it runs before any work."""
    trained = str(value_of(LMConfig, config.model, "position_encoding"))
    if rope_scaling_factor is not None:
        encoding = position_encoding or trained
        if encoding not in WINDOW_FACTOR:
            raise ValueError(f"--rope_scaling_factor fixes the factor of {' / '.join(map(repr, WINDOW_FACTOR))}; "
                             f"{workdir} would be evaluated as {encoding!r}: add --position_encoding yarn "
                             "(or ntk), or drop --rope_scaling_factor.")
        try:
            rope_scaling.check_scaling_factor(rope_scaling_factor)
        except ValueError as e:
            raise ValueError(f"--rope_scaling_factor {rope_scaling_factor}: {e}") from None
    if position_encoding is not None and position_encoding != trained:
        allowed = SWAPS.get(trained, ())
        if position_encoding not in allowed:
            fits = (f"a {trained!r} run takes {', '.join(repr(e) for e in allowed)}" if allowed else
                    f"only 'rope' runs can be evaluated as "
                    f"{', '.join(repr(e) for e in SWAPS['rope'])}")
            raise ValueError(f"--position_encoding {position_encoding} does not share the parameters of "
                             f"{workdir} (trained with {trained!r}): {fits}.")
    if (logn_scaling is not None and (position_encoding or trained) == "goat"
            and value_of(LMConfig, config.model, "training_seq_len") is None):
        raise ValueError(f"--logn_scaling needs model.training_seq_len, which the GOAT run {workdir} left "
                         "unset; setting it now would also change its sink (normalized by it), so this "
                         "run cannot take log-n scaling at evaluation.")


def check_request(config: ml_collections.ConfigDict, workdir: str, evals: Sequence[str],
                  multipliers: Sequence[int], position_encoding: Optional[str] = None,
                  logn_scaling: Optional[str] = None, rope_scaling_factor: Optional[float] = None) -> None:
    """Every check of one run's evaluation request that its config.json can answer, before any
    work: the swap (:func:`check_swap`), a passkey request whose every length is too short for
    the prompt (:func:`goat_jax.eval.checks.check_passkey_lengths`), and packed documents
    (``'documents'`` in ``evals``) longer than the training length with a factor that follows the window ('yarn' / 'ntk'
    without a fixed factor), refused naming ``--rope_scaling_factor``: the layer would refuse
    it only after every evaluation before it had run."""
    check_swap(config, workdir, position_encoding, logn_scaling, rope_scaling_factor)
    if "passkey" in evals:
        checks.check_passkey_lengths(config, workdir, multipliers)
    encoding = position_encoding or str(value_of(LMConfig, config.model, "position_encoding"))
    factor = (rope_scaling_factor if rope_scaling_factor is not None
              else value_of(LMConfig, config.model, "rope_scaling_factor"))
    longest = max(multipliers, default=1)
    if "documents" in evals and encoding in WINDOW_FACTOR and factor is None and longest > 1:
        raise ValueError(
            f"--evals documents on {workdir} as {encoding!r} with the dynamic factor: a window of {longest}x "
            "packs several documents, and the factor would follow the window's length, not each "
            f"document's. Give a fixed factor, e.g. --rope_scaling_factor {longest} (the longest "
            "multiplier), or evaluate the documents at --multipliers 1.")


def swap_encoding(run: LMRun, position_encoding: Optional[str] = None,
                  logn_scaling: Optional[str] = None, rope_scaling_factor: Optional[float] = None) -> LMRun:
    """``run`` evaluated with another, parameter-compatible attention: ``position_encoding``
    ('yarn', 'ntk' or 'rope_pi' for a 'rope' run: the usual way to run RoPE past its training
    length without retraining) and/or ``logn_scaling`` ('content' / 'all', any encoding of the
    LM, GOAT included). The parameters are the run's own; the config and model are rebuilt, with
    ``model.training_seq_len`` set to the run's ``seq_len`` when a non-GOAT run left it unset
    (it changes nothing else there). Raises ValueError naming the flag for a combination that
    does not share the parameters (:func:`check_swap`). ``rope_scaling_factor``: a fixed factor
    for 'yarn' / 'ntk' instead of the dynamic one."""
    if position_encoding is None and logn_scaling is None and rope_scaling_factor is None:
        return run
    check_swap(run.config, run.workdir, position_encoding, logn_scaling, rope_scaling_factor)
    config = ml_collections.ConfigDict(run.config.to_dict())
    if position_encoding is not None:
        config.model.position_encoding = position_encoding
    if rope_scaling_factor is not None:
        config.model.rope_scaling_factor = float(rope_scaling_factor)
    if logn_scaling is not None:
        config.model.logn_scaling = logn_scaling
    if value_of(LMConfig, config.model, "training_seq_len") is None and config.model.position_encoding != "goat":
        config.model.training_seq_len = int(config.seq_len)
    return dataclasses.replace(run, config=config, model=run.task.build_model(config, run.plan))
