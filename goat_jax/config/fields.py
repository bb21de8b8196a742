"""Declarative type and range checks of config fields, run before a run touches anything.

Each config section has a spec: ``{field name: Field(...)}``. The engine declares its own
(top-level cadences, ``mesh``, ``optimizer``: :data:`ENGINE_FIELDS`); a task declares its
``model`` and ``data`` specs next to the code that reads them (``goat_jax.models.lm.FIELD_SPECS``,
``goat_jax.data.text.FIELD_SPECS``, ``goat_jax.data.synthetic.FIELD_SPECS``) and hands them to
the engine through ``Task.field_specs``. :func:`check_section` walks one section against its spec
and raises a one-line ValueError naming the dotted field, the value, what is allowed and the fix::

    optimizer.learning_rate=-1.0 is out of range: allowed is a number finite in float32 > 0 (peak
    learning rate). Set --config.optimizer.learning_rate to an allowed value.

Fields without a spec are not checked here (unknown fields are refused by the schema check).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

# float32 is what the device computes with: a larger "finite" value is inf there.
FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class Field:
    """What one config field may hold.

    Attributes:
      kind: 'int', 'float', 'bool', 'str' or 'strs' (a tuple of strings, e.g. file globs).
      min, max: bounds of a number (None: unbounded); ``min_inclusive`` / ``max_inclusive``
        say whether the bound itself is allowed.
      also: extra allowed values outside the range (e.g. ``-1``: "the remaining devices").
      choices: the allowed values of a 'str' field (or of a number, instead of a range).
      optional: None is allowed too.
      nonempty: a 'str' / 'strs' field must not be empty ('strs': no empty element either).
      doc: what the field means, shown in the error.
    """

    kind: str
    min: Optional[float] = None
    max: Optional[float] = None
    min_inclusive: bool = True
    max_inclusive: bool = True
    also: Tuple[Any, ...] = ()
    choices: Optional[Tuple[Any, ...]] = None
    optional: bool = False
    nonempty: bool = False
    doc: str = ""

    def allowed(self) -> str:
        """A phrase saying what is allowed, e.g. 'an integer >= 1 (decoder blocks)'."""
        if self.choices is not None:
            text = f"one of {list(self.choices)}"
        elif self.kind in ("int", "float"):
            bounds = []
            if self.min is not None:
                bounds.append(f"{'>=' if self.min_inclusive else '>'} {self.min:g}")
            if self.max is not None and self.max != FLOAT32_MAX:
                bounds.append(f"{'<=' if self.max_inclusive else '<'} {self.max:g}")
            text = ("an integer" if self.kind == "int" else "a number finite in float32") + (
                " " + " and ".join(bounds) if bounds else "")
            if self.also:
                text += " or " + " or ".join(repr(a) for a in self.also)
        elif self.kind == "bool":
            text = "True or False"
        elif self.kind == "strs":
            text = "a tuple of " + ("non-empty " if self.nonempty else "") + "strings"
        else:
            text = "a non-empty string" if self.nonempty else "a string"
        if self.optional:
            text += " or None"
        return text + (f" ({self.doc})" if self.doc else "")


def Int(min=None, max=None, **kw) -> Field:  # pylint: disable=invalid-name,redefined-builtin
    """An integer field (bools are refused) within ``[min, max]``."""
    return Field("int", min=min, max=max, **kw)


def Float(min=None, max=FLOAT32_MAX, **kw) -> Field:  # pylint: disable=invalid-name,redefined-builtin
    """A finite number (ints accepted) within the bounds, representable in float32."""
    return Field("float", min=min, max=max, **kw)


def Bool(**kw) -> Field:  # pylint: disable=invalid-name
    """True or False."""
    return Field("bool", **kw)


def Str(choices=None, **kw) -> Field:  # pylint: disable=invalid-name
    """A string, optionally one of ``choices``."""
    return Field("str", choices=tuple(choices) if choices is not None else None, **kw)


def Strs(**kw) -> Field:  # pylint: disable=invalid-name
    """A tuple (or list) of strings; on the command line, repeat the flag once per element."""
    return Field("strs", **kw)


def _problem(spec: Field, value: Any) -> Optional[str]:
    """None if ``value`` satisfies ``spec``, else 'has the wrong type' / 'is out of range'."""
    if value is None:
        return None if spec.optional else "is not set"
    if spec.kind == "bool":
        return None if isinstance(value, (bool, np.bool_)) else "has the wrong type"
    if spec.kind == "str":
        if not isinstance(value, str):
            return "has the wrong type"
        if spec.nonempty and not value:
            return "is empty"
        return None if spec.choices is None or value in spec.choices else "is not allowed"
    if spec.kind == "strs":
        if isinstance(value, str) or not isinstance(value, (tuple, list)):
            return "has the wrong type"
        if not all(isinstance(v, str) for v in value):
            return "has the wrong type"
        if spec.nonempty and (not value or not all(value)):
            return "is empty or has an empty element"
        return None
    # Numbers. bool is an int subclass in Python; a flag typo like True for a step count is refused.
    if isinstance(value, (bool, np.bool_)):
        return "has the wrong type"
    if spec.kind == "int" and not isinstance(value, (int, np.integer)):
        return "has the wrong type"
    if spec.kind == "float" and not isinstance(value, (int, float, np.integer, np.floating)):
        return "has the wrong type"
    if value in spec.also:
        return None
    if spec.choices is not None:
        return None if value in spec.choices else "is not allowed"
    if spec.kind == "float" and not math.isfinite(float(value)):
        return "is not finite"
    if spec.min is not None and (value < spec.min or (value == spec.min and not spec.min_inclusive)):
        return "is out of range"
    if spec.max is not None and (value > spec.max or (value == spec.max and not spec.max_inclusive)):
        return "is out of range"
    return None


def check_section(values: Mapping[str, Any], specs: Mapping[str, Field], section: str = "") -> None:
    """Checks every field of ``values`` that has a spec; raises a one-line ValueError naming
    the first offending field (``section.field``), its value, what is allowed and the fix."""
    prefix = f"{section}." if section else ""
    for name, spec in specs.items():
        if name not in values:
            continue
        value = values[name]
        problem = _problem(spec, value)
        if problem:
            fix = f"Set --config.{prefix}{name} to an allowed value."
            if spec.kind == "strs":
                fix = (f"Repeat --config.{prefix}{name}=ELEMENT once per element" +
                       ("." if spec.nonempty else f", or pass --config.{prefix}{name}='()' for none."))
            raise ValueError(f"{prefix}{name}={value!r} {problem}: allowed is {spec.allowed()}. {fix}")


def check_config(config: Any, specs: Mapping[str, Mapping[str, Field]]) -> None:
    """Runs :func:`check_section` for each ``{section: spec}`` ('' is the top level) that the
    config has."""
    for section, spec in specs.items():
        node = config if not section else config.get(section)
        if node is not None:
            check_section(node, spec, section)


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
