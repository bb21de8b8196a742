"""The engine's own config fields (:data:`ENGINE_FIELDS`), declared with the field-spec
machinery of :mod:`goat_jax.config.fields`.

Each config section has a spec: ``{field name: Field(...)}``. The engine declares its own here
(top-level cadences, ``mesh``, ``optimizer``); a task declares its ``model`` and ``data`` specs
next to the code that reads them (derived from ``goat_jax.models.lm.LMConfig``'s field metadata,
``goat_jax.data.text.FIELD_SPECS``, ...) and hands them to the engine through
``Task.field_specs``; :func:`goat_jax.config.fields.check_config` checks a run's config against
both before any work.
"""

from __future__ import annotations

from typing import Dict

from goat_jax.config.fields import Bool, Field, Float, Int, Ints, Str
from goat_jax.train import wandb_logger

__all__ = ["ENGINE_FIELDS"]


# ----------------------------------------------------------------------------------------------
# The engine's own fields (goat_jax/train/trainer.py documents their meaning)
# ----------------------------------------------------------------------------------------------

_MESH_AXIS = Int(min=1, also=(-1,), doc="shards along this mesh axis; -1: the remaining devices")

ENGINE_FIELDS: Dict[str, Dict[str, Field]] = {
    "": {
        "seed": Int(min=0, max=2**32 - 1, doc="PRNG seed"),
        "task": Str(nonempty=True),
        "num_train_steps": Int(min=1),
        "global_batch_size": Int(min=1, optional=True),
        "per_device_batch_size": Int(min=1, optional=True),
        "grad_accum_steps": Int(min=1),
        "log_every_steps": Int(min=1),
        "eval_every_steps": Int(min=0, doc="0: never"),
        "checkpoint_every_steps": Int(min=1),
        "keep_checkpoints": Int(min=1),
        "distributed": Bool(),
        "progress_bar": Bool(),
        "peak_flops_per_device": Float(min=0.0, doc="0: look up by device kind"),
        "profile_steps": Ints(min=1, lengths=(0, 2), doc="first and last step traced; () = off"),
    },
    "wandb": {
        "project": Str(optional=True), "name": Str(optional=True), "entity": Str(optional=True),
        "mode": Str(choices=wandb_logger.MODES, doc="'disabled' = off"),
    },
    "mesh": {"data": _MESH_AXIS, "fsdp": _MESH_AXIS, "tensor": _MESH_AXIS},
    "optimizer": {
        "learning_rate": Float(min=0.0, min_inclusive=False, doc="peak learning rate"),
        "warmup_steps": Int(min=0, doc="linear warmup updates"),
        "min_lr_ratio": Float(min=0.0, max=1.0, doc="cosine floor as a fraction of the peak"),
        "b1": Float(min=0.0, max=1.0, max_inclusive=False, doc="Adam first-moment decay"),
        "b2": Float(min=0.0, max=1.0, max_inclusive=False, doc="Adam second-moment decay"),
        "eps": Float(min=0.0, min_inclusive=False, doc="Adam epsilon; 0 divides 0 by 0 for unused parameters"),
        "weight_decay": Float(min=0.0, doc="decoupled weight decay"),
        "grad_clip": Float(min=0.0, doc="global-norm clip; 0: off"),
        "decay_grouping": Str(nonempty=True, doc="optional; 'default' or a task's grouping"),
    },
}
