"""The engine's own config fields, declared once (:data:`ENGINE`): one :class:`Section` per
engine section, each field with its default, type, range and doc. Everything about the engine's
fields derives from it: the schema (which names each section takes), the specs checked before
any work (:data:`ENGINE_FIELDS`), the defaults a config file may leave out
(:func:`with_engine_defaults`: the resolved config written to the workdir still shows every
value), the fields every config must set (:data:`ENGINE_REQUIRED`) and which fields may change
when a run resumes from a checkpoint (:func:`resume_fields`, each field's ``resume=``).

A task declares its ``model`` and ``data`` fields the same way, next to the code that reads them
(:class:`goat_jax.train.tasks.TaskFields`); :func:`goat_jax.config.fields.check_config` checks
a run's config against both. A config file therefore states only what its experiment decides
(the task, its model and data, the step count, the batch, the learning rate, and every engine
value it wants different from the defaults below).
"""

from __future__ import annotations

from typing import Any, Dict, FrozenSet, Tuple

from goat_jax.config.fields import (REQUIRED, RESUME_ADJUSTABLE as ADJUSTABLE, RESUME_BEHAVIOURS,
                                    RESUME_FIXED as FIXED, RESUME_SAFE as SAFE, Bool, Field, Float, Int, Ints,
                                    Opaque, Section, Str)
from goat_jax.kernels import strategies
from goat_jax.kernels.plan import DEFAULT as PLAN
from goat_jax.train import sharding, wandb_logger

__all__ = ["ENGINE", "ENGINE_FIELDS", "ENGINE_REQUIRED", "ENGINE_SECTIONS", "engine_defaults", "engine_specs",
           "resume_fields", "with_engine_defaults", "add_engine_defaults"]

_MESH_AXIS = Int(min=1, also=(-1,), resume=SAFE, doc="shards along this mesh axis; -1: the remaining devices")

# Each engine section: {name: (default, Field)}; REQUIRED has no default. Every field says what a
# change of it on resume is (``resume=``; goat_jax/train/checkpoint.py reads it): FIXED changes
# what is computed (refused), SAFE changes cadences, the device layout (the state is resharded
# on restore; load balancing of the context axis reorders tokens, not results) or the batch split
# over devices (the resolved global_batch_size is what is fingerprinted), ADJUSTABLE changes the
# optimization from the resumed step on, not the model or the data, so the restored state still
# fits (allowed with --resume_with_changes: how a run stopped by a non-finite loss continues from
# its last finite checkpoint with a lower learning rate).
ENGINE: Dict[str, Section] = {
    "": Section(
        task=(REQUIRED, Str(nonempty=True, resume=FIXED,
                            doc="the task: a module of goat_jax/tasks/ or 'package.module:ATTR'")),
        num_train_steps=(REQUIRED, Int(min=1, resume=ADJUSTABLE, doc="optimizer updates")),
        seed=(0, Int(min=0, max=2**32 - 1, resume=FIXED, doc="PRNG seed: parameter init, data order, dropout")),
        global_batch_size=(None, Int(min=1, optional=True, resume=FIXED,
                                     doc="examples per step over all devices; or per_device_batch_size")),
        per_device_batch_size=(None, Int(min=1, optional=True, resume=SAFE,
                                         doc="examples per step per device; or global_batch_size")),
        grad_accum_steps=(1, Int(min=1, resume=FIXED, doc="microbatches per optimizer step")),
        log_every_steps=(50, Int(min=1, resume=SAFE, doc="metrics.jsonl / TensorBoard cadence")),
        eval_every_steps=(1000, Int(min=0, resume=SAFE, doc="held-out evaluation cadence; 0: never")),
        checkpoint_every_steps=(1000, Int(min=1, resume=SAFE,
                                          doc="checkpoint cadence (also at the end and on SIGTERM)")),
        keep_checkpoints=(3, Int(min=1, resume=SAFE, doc="the newest N checkpoints are kept")),
        distributed=(False, Bool(resume=SAFE, doc="call jax.distributed.initialize() (multi-host)")),
        progress_bar=(True, Bool(resume=SAFE, doc="a tqdm bar on stderr")),
        peak_flops_per_device=(0.0, Float(min=0.0, resume=SAFE, doc="for MFU; 0: look up by device kind")),
        profile_steps=((), Ints(min=1, lengths=(0, 2), resume=SAFE,
                                doc="first and last step of a jax.profiler trace into WORKDIR/profile/; () = off")),
        sharding_rules=(sharding.DEFAULT_RULES, Opaque(resume=SAFE,
                                                       doc="logical axis -> mesh axis (goat_jax/train/sharding.py)")),
        context_load_balance=(PLAN.load_balanced, Bool(resume=SAFE,
                                          doc="with mesh.context > 1: reorder each causal sequence once "
                                              "(dual-chunk swap) so every context shard does the same "
                                              "attention work; same results (goat_jax/kernels/balance.py)")),
        context_strategy=(PLAN.context_strategy, Str(choices=strategies.names(), resume=SAFE,
                                            doc="with mesh.context > 1, how attention crosses the shards: "
                                                "'all_gather' (every device gathers all keys: K/V memory O(T)) "
                                                "or 'ring' (keys pass around the ring: O(T / c); "
                                                "goat_jax/kernels/ring.py); same results")),
        gpu_xla_flags=(False, Bool(resume=SAFE, doc="compile the steps with XLA's GPU throughput options "
                                                   "(goat_jax.platforms.GPU_XLA_FLAGS: latency-hiding scheduler, ...); "
                                                   "applied only when the mesh's devices are GPUs")),
    ),
    "mesh": Section(**{axis: (-1 if axis == "data" else 1, _MESH_AXIS) for axis in sharding.MESH_AXES}),
    "optimizer": Section(
        learning_rate=(REQUIRED, Float(min=0.0, min_inclusive=False, resume=ADJUSTABLE, doc="peak learning rate")),
        warmup_steps=(0, Int(min=0, resume=ADJUSTABLE, doc="linear warmup updates")),
        min_lr_ratio=(0.1, Float(min=0.0, max=1.0, resume=ADJUSTABLE, doc="cosine floor as a fraction of the peak")),
        b1=(0.9, Float(min=0.0, max=1.0, max_inclusive=False, resume=ADJUSTABLE, doc="Adam first-moment decay")),
        b2=(0.95, Float(min=0.0, max=1.0, max_inclusive=False, resume=ADJUSTABLE, doc="Adam second-moment decay")),
        eps=(1e-8, Float(min=0.0, min_inclusive=False, resume=ADJUSTABLE,
                         doc="Adam epsilon; 0 divides 0 by 0 for unused parameters")),
        weight_decay=(0.1, Float(min=0.0, resume=ADJUSTABLE, doc="decoupled weight decay")),
        grad_clip=(1.0, Float(min=0.0, resume=ADJUSTABLE, doc="global-norm clip; 0: off")),
        decay_grouping=("default", Str(nonempty=True, resume=FIXED,
                                       doc="'default' or one of the task's decay_groupings")),
    ),
    "wandb": wandb_logger.FIELDS,  # declared next to the code that reads it (every field SAFE)
}

ENGINE_SECTIONS = tuple(s for s in ENGINE if s)  # the engine's own sub-sections


def engine_specs() -> Dict[str, Dict[str, Field]]:
    """``{section: {field: Field}}`` of :data:`ENGINE` ('' for the top level): what
    :func:`goat_jax.config.fields.check_config` checks on every run's config."""
    return {section: s.specs for section, s in ENGINE.items()}


ENGINE_FIELDS: Dict[str, Dict[str, Field]] = engine_specs()  # the same, as a constant
ENGINE_REQUIRED: Tuple[str, ...] = tuple(f"{section}.{name}" if section else name
                                         for section, s in ENGINE.items() for name in s.required)


def resume_fields(behaviour: str) -> FrozenSet[str]:
    """The engine fields declared ``resume=behaviour`` (:data:`goat_jax.config.fields.RESUME_BEHAVIOURS`),
    dotted (``'optimizer.learning_rate'``; top-level fields without a dot), read by
    :mod:`goat_jax.train.checkpoint`. For 'safe', a section whose every field is safe is named
    as a whole (``'mesh'``, ``'wandb'``): any field it holds, one it gains or loses included,
    is left out of the fingerprint."""
    if behaviour not in RESUME_BEHAVIOURS:
        raise ValueError(f"resume_fields({behaviour!r}): allowed is one of {list(RESUME_BEHAVIOURS)}.")
    out = set()
    for section, s in ENGINE.items():
        if section and behaviour == SAFE and all(r == SAFE for r in s.resume.values()):
            out.add(section)
            continue
        out |= {f"{section}.{name}" if section else name for name, r in s.resume.items() if r == behaviour}
    return frozenset(out)


def engine_defaults() -> Dict[str, Any]:
    """``{'section.field': default}`` of every engine field with a default (top-level fields
    without a dot): the values a config that leaves a field out computes with, so a checkpoint
    of a config that wrote the field resumes under one that does not, and vice versa."""
    return {(f"{section}.{name}" if section else name): value
            for section, s in ENGINE.items() for name, value in s.default_values().items()}


def add_engine_defaults(config: Any) -> Any:
    """Adds to ``config`` (an ml_collections ConfigDict; in place, returned) every engine field
    it leaves out, at its default (a None default as a typed placeholder, so the command line
    can still set it), and any engine section it lacks. Fields it sets (and their field
    references) are untouched."""
    import ml_collections  # pylint: disable=g-import-not-at-top  # configs have it already

    for section, s in ENGINE.items():
        if section and section not in config:
            config[section] = ml_collections.ConfigDict()
        node = config[section] if section else config
        for name in s.default_values():
            if name not in node:
                node[name] = s.placeholder(name)
    return config


def with_engine_defaults(config: Any) -> Any:
    """A copy of ``config`` with :func:`add_engine_defaults` applied (``config`` is unchanged)."""
    return add_engine_defaults(type(config)(config.to_dict()))
