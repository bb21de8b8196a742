"""Evaluation with each window split over devices: ``experiments.evaluate --mesh_context N``
(docs/training.md, Long context; docs/experiments.md).

A run that needed ``mesh.context > 1`` to train holds windows too long for one device, and the
first thing its user checks, the perplexity at 1x, 2x, ... its training length
(``--evals extrapolation``), needs the same split. :func:`on_mesh` puts a run on a mesh of N
devices whose one axis of more than one device is ``context`` (data, fsdp and tensor are 1: the
batch of windows is not split, and the host's other devices idle), its parameters replicated.
:func:`apply_fn` runs the model under that mesh and the run's own logical rules, as the trainer's
steps run (:func:`goat_jax.train.sharding.with_mesh_and_rules`): every activation is split over
its length, the LM head included, and attention crosses the shards with the run's own
``context_strategy`` ('all_gather' or 'ring', goat_jax/kernels/strategies.py): the model's
attention plan, built from the run's config by its task as the trainer's is; this module
chooses nothing about attention. Windows are scored in their
natural order: load balancing (``context_load_balance``) changes which device does which work,
not the numbers.

What runs split (:data:`SPLIT`): the evaluations that score whole windows in one forward pass,
what decodes with the KV cache (the standard passkey's answer, ``--chunk_size``'s windows in
query chunks): the cache's slots are split over the devices, each shard scores its own and the
partial softmaxes are merged (:func:`on_run_mesh`, goat_jax/kernels/decode_merge.py), and
lm_eval (goat_jax/eval/harness.py): its log-likelihood batches are padded on the right to lengths
the shards divide (:func:`window_multiple`; causal attention keeps the padding out of every
score) and scored by :func:`apply_fn`, its generations decode with the split cache. The others
are refused before any work (:func:`check_request`), naming the flag and the fix
(:data:`UNSPLIT`): sinks, documents and diagnostics read attention probabilities, which split
attention never forms. DNA's GC agreement samples 200 bases after 200-base prompts with the
replicated parameters and no split (each device repeats that short work).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from goat_jax.kernels import balance
from goat_jax.kernels.plan import AttentionPlan
from goat_jax.train import sharding

FLAG = "--mesh_context"

# The evaluations that run split: those that score whole windows with one forward pass, the
# standard passkey, which decodes its answer with the KV cache split over the devices
# (goat_jax/kernels/decode_merge.py), and lm_eval (its batches padded to lengths the shards divide).
SPLIT = ("extrapolation", "niah", "passkey", "dna", "lm_eval")
# Why each other evaluation cannot split a window (completes "--evals NAME ...").
UNSPLIT = {
    "sinks": "reads attention probabilities, which attention split over the context axis never forms",
    "documents": "reads attention probabilities (the mass on each document's first token), which "
                 "attention split over the context axis never forms",
    "diagnostics": "runs the KV cache in query chunks and reads attention probabilities",
}


def window_multiple(config: Any, context: int) -> int:
    """What a window must be a multiple of to be split over ``context`` devices with ``config``'s
    (a run's) attention: the shards, times the kernel's blocks where it has static ones
    (:func:`goat_jax.kernels.balance.length_multiple`; windows are scored in natural order, never
    load-balanced). 1 when ``context`` is 1."""
    implementation = (config.get("model") or {}).get("implementation")
    return balance.length_multiple(context, False, implementation)


def check_request(config: Any, workdir: str, evals: Sequence[str], multipliers: Sequence[int], context: int, *,
                  chunk_size: Optional[int] = None, lengths: Optional[Sequence[int]] = None,
                  num_devices: Optional[int] = None, lm_eval_length: Optional[int] = None) -> None:
    """Raises ValueError naming ``--mesh_context`` (or the flag in its way) and the fix unless
    every evaluation of the request can run with each window split over ``context`` devices:
    an evaluation that reads probabilities (:data:`UNSPLIT`), more devices than there are
    (``num_devices``, default ``jax.device_count()``), or a window (``m x seq_len`` for each of
    ``multipliers``, dna's ``lengths`` in bases, lm_eval's window ``lm_eval_length``, default
    ``seq_len``) that the shards do not divide. Reads only ``config`` (a run's config.json), so it
    runs before any work."""
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"{FLAG} must be an integer >= 1 (the devices each window is split over), got {context!r}.")
    if context == 1:
        return
    split = f"{FLAG} {context} splits each window over {context} devices"
    for name in evals:
        if name not in SPLIT:
            raise ValueError(f"{split}, but --evals {name} {UNSPLIT.get(name, 'does not score whole windows')} "
                             f"(run {workdir}); evaluate it in a command of its own with {FLAG} 1.")
    implementation = (config.get("model") or {}).get("implementation")
    multiple = window_multiple(config, context)
    kernel = f" x model.implementation={implementation!r}'s 128-token blocks" if multiple != context else ""
    window_evals = [e for e in evals if e != "lm_eval"]
    by_bases = bool(lengths) and "dna" in evals
    windows = (list(lengths) if by_bases else [int(m) * int(config.seq_len) for m in multipliers]) if window_evals else []
    bad = [n for n in windows if n % multiple]
    if bad:
        given = "--lengths" if by_bases else f"--multipliers x seq_len {int(config.seq_len)}"
        raise ValueError(f"{split}, but a window of {bad[0]} tokens ({given}) cannot be split: windows must be "
                         f"multiples of {multiple} ({FLAG}{kernel}). Change {given.split()[0]} or {FLAG}.")
    if "lm_eval" in evals:
        window = int(lm_eval_length) if lm_eval_length is not None else int(config.seq_len)
        if window % multiple:
            given = "--lm_eval_max_length" if lm_eval_length is not None else f"seq_len {int(config.seq_len)}"
            raise ValueError(f"{split}, but lm_eval's window of {window} tokens ({given}) cannot be split: it must "
                             f"be a multiple of {multiple} ({FLAG}{kernel}). Give --lm_eval_max_length a multiple "
                             f"of {multiple}, or change {FLAG}.")
    # Last: the request itself first (what cannot split a window cannot on any host).
    available = jax.device_count() if num_devices is None else num_devices
    if context > available:
        raise ValueError(f"{split}, but this host has {available}; give at most {FLAG} {available}.")


def on_mesh(run: Any, context: int, devices: Optional[Sequence[Any]] = None) -> Any:
    """``run`` (an :class:`goat_jax.eval.lm_run.LMRun`) with each window split over ``context``
    devices (the first of ``devices``, default all): its ``mesh`` set and its parameters
    replicated on that mesh, and its model under the run's plan (``run.plan``: its
    ``context_strategy`` crosses the shards). ``context == 1`` returns ``run`` unchanged (one
    device)."""
    if context == 1:
        return run
    devices = list(jax.devices() if devices is None else devices)[:context]
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "context": context, "tensor": 1}, devices)
    params = jax.device_put(run.params, NamedSharding(mesh, P()))
    model = run.model if run.model.plan == run.plan else run.model.clone(plan=run.plan)
    return dataclasses.replace(run, params=params, mesh=mesh, model=model)


def setup(plan: AttentionPlan, context: int) -> dict:
    """What results.json records of how a run was evaluated: ``mesh_context`` (``--mesh_context``)
    and the ``context_strategy`` attention crossed the shards with (the run's ``plan``'s; None when
    each window is on one device). Windows are scored in natural order, never load-balanced."""
    return {"mesh_context": int(context), "context_strategy": plan.context_strategy if context > 1 else None}


def apply_fn(model: Any, mesh: Any, config: Any) -> Callable[[Any, jax.Array], jax.Array]:
    """``(params, tokens [B, T]) -> logits [B, T, V]`` of ``model`` with the sequence split over
    ``mesh``'s ``context`` axis by the logical rules of ``config`` (a run's: its
    ``sharding_rules``) and attention crossing the shards with its ``context_strategy`` (the
    model's plan: the run's, :attr:`goat_jax.train.run.Run.plan`, which :func:`on_mesh` gives
    it); call it inside ``jax.jit`` with the parameters of :func:`on_mesh`, as the evaluations do."""
    rules = sharding.rules_from_config(config.sharding_rules)
    model = model.clone(plan=model.plan.replace(load_balanced=False))  # windows arrive in sequence order

    def apply(params, tokens):
        # The window enters split over its length, as every activation after it.
        tokens = nn.with_logical_constraint(tokens, ("batch", "length"))
        return model.apply({"params": params}, tokens)

    return sharding.with_mesh_and_rules(apply, mesh, rules)


def on_run_mesh(run: Any, fn: Callable) -> Callable:
    """``fn`` called inside ``run``'s mesh (:func:`on_mesh`; ``fn`` unchanged on one device):
    what decodes with the KV cache (the standard passkey's generator, ``--chunk_size``'s chunked
    windows) then splits the cache's slots over the ``context`` devices, each shard scoring its
    own and the partial softmaxes merged (goat_jax/kernels/decode_merge.py; docs/training.md,
    "Decoding with a sharded cache"). No logical rules are entered: the activations of a chunk
    of queries stay whole on every device, only the cache is split."""
    mesh = getattr(run, "mesh", None)
    if mesh is None:
        return fn

    def split(*args, **kwargs):
        with jax.set_mesh(mesh):
            return fn(*args, **kwargs)
    return split
