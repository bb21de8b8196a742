"""The engine's own config fields, declared once (:data:`ENGINE`): one :class:`Section` per
engine section, each field with its default, type, range and doc. Everything about the engine's
fields derives from it: the schema (which names each section takes), the specs checked before
any work (:data:`ENGINE_FIELDS`), the defaults a config file may leave out
(:func:`with_engine_defaults`: the resolved config written to the workdir still shows every
value) and the fields every config must set (:data:`ENGINE_REQUIRED`).

A task declares its ``model`` and ``data`` fields the same way, next to the code that reads them
(:class:`goat_jax.train.tasks.TaskFields`); :func:`goat_jax.config.fields.check_config` checks
a run's config against both. A config file therefore states only what its experiment decides
(the task, its model and data, the step count, the batch, the learning rate, and every engine
value it wants different from the defaults below).
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

from goat_jax.config.fields import REQUIRED, Bool, Field, Float, Int, Ints, Opaque, Section, Str
from goat_jax.train import sharding, wandb_logger

__all__ = ["ENGINE", "ENGINE_FIELDS", "ENGINE_REQUIRED", "ENGINE_SECTIONS", "engine_defaults", "engine_specs",
           "with_engine_defaults", "add_engine_defaults"]

_MESH_AXIS = Int(min=1, also=(-1,), doc="shards along this mesh axis; -1: the remaining devices")

# Each engine section: {name: (default, Field)}; REQUIRED has no default.
ENGINE: Dict[str, Section] = {
    "": Section(
        task=(REQUIRED, Str(nonempty=True, doc="the task: a module of goat_jax/tasks/ or 'package.module:ATTR'")),
        num_train_steps=(REQUIRED, Int(min=1, doc="optimizer updates")),
        seed=(0, Int(min=0, max=2**32 - 1, doc="PRNG seed: parameter init, data order, dropout")),
        global_batch_size=(None, Int(min=1, optional=True,
                                     doc="examples per step over all devices; or per_device_batch_size")),
        per_device_batch_size=(None, Int(min=1, optional=True,
                                         doc="examples per step per device; or global_batch_size")),
        grad_accum_steps=(1, Int(min=1, doc="microbatches per optimizer step")),
        log_every_steps=(50, Int(min=1, doc="metrics.jsonl / TensorBoard cadence")),
        eval_every_steps=(1000, Int(min=0, doc="held-out evaluation cadence; 0: never")),
        checkpoint_every_steps=(1000, Int(min=1, doc="checkpoint cadence (also at the end and on SIGTERM)")),
        keep_checkpoints=(3, Int(min=1, doc="the newest N checkpoints are kept")),
        distributed=(False, Bool(doc="call jax.distributed.initialize() (multi-host)")),
        progress_bar=(True, Bool(doc="a tqdm bar on stderr")),
        peak_flops_per_device=(0.0, Float(min=0.0, doc="for MFU; 0: look up by device kind")),
        profile_steps=((), Ints(min=1, lengths=(0, 2),
                                doc="first and last step of a jax.profiler trace into WORKDIR/profile/; () = off")),
        sharding_rules=(sharding.DEFAULT_RULES, Opaque(doc="logical axis -> mesh axis (goat_jax/train/sharding.py)")),
        context_load_balance=(False, Bool(doc="with mesh.context > 1: reorder each causal sequence once "
                                              "(dual-chunk swap) so every context shard does the same "
                                              "attention work; same results (goat_jax/context.py)")),
    ),
    "mesh": Section(**{axis: (-1 if axis == "data" else 1, _MESH_AXIS) for axis in sharding.MESH_AXES}),
    "optimizer": Section(
        learning_rate=(REQUIRED, Float(min=0.0, min_inclusive=False, doc="peak learning rate")),
        warmup_steps=(0, Int(min=0, doc="linear warmup updates")),
        min_lr_ratio=(0.1, Float(min=0.0, max=1.0, doc="cosine floor as a fraction of the peak")),
        b1=(0.9, Float(min=0.0, max=1.0, max_inclusive=False, doc="Adam first-moment decay")),
        b2=(0.95, Float(min=0.0, max=1.0, max_inclusive=False, doc="Adam second-moment decay")),
        eps=(1e-8, Float(min=0.0, min_inclusive=False, doc="Adam epsilon; 0 divides 0 by 0 for unused parameters")),
        weight_decay=(0.1, Float(min=0.0, doc="decoupled weight decay")),
        grad_clip=(1.0, Float(min=0.0, doc="global-norm clip; 0: off")),
        decay_grouping=("default", Str(nonempty=True, doc="'default' or one of the task's decay_groupings")),
    ),
    "wandb": wandb_logger.FIELDS,  # declared next to the code that reads it
}

ENGINE_SECTIONS = tuple(s for s in ENGINE if s)  # the engine's own sub-sections


def engine_specs() -> Dict[str, Dict[str, Field]]:
    """``{section: {field: Field}}`` of :data:`ENGINE` ('' for the top level): what
    :func:`goat_jax.config.fields.check_config` checks on every run's config."""
    return {section: s.specs for section, s in ENGINE.items()}


ENGINE_FIELDS: Dict[str, Dict[str, Field]] = engine_specs()  # the same, as a constant
ENGINE_REQUIRED: Tuple[str, ...] = tuple(f"{section}.{name}" if section else name
                                         for section, s in ENGINE.items() for name in s.required)


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
