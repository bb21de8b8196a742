"""Config fields declared once: type, range or choices, doc (and, on a dataclass, the default).

The ground floor of the config system: it imports nothing from goat_jax, so models, data
pipelines, tasks and the engine can all declare and check their fields with it.

A field's spec is a :class:`Field` (``Int(min=1, doc=...)``, ``Str(choices=SOME_TUPLE)``, ...).
It is declared in one place:

* on a config dataclass (``LMConfig``, ``ViTConfig``, ``PriorSettings``) as the field's metadata,
  ``num_layers: int = declare(2, Int(min=1, doc="decoder blocks"))``; :func:`specs_of` derives
  the section's ``FIELD_SPECS`` from it and :func:`check_instance` checks an instance against it
  (so ``__post_init__`` only holds the cross-field rules); a dataclass exposing another one's
  field under the same name (a model's GOAT fields) takes its spec with :func:`borrow`;
* in a :class:`Section` next to the code that reads a ``ml_collections`` section (the data
  pipelines): ``{name: (default, Field)}``, from which both the section's default ConfigDict
  and its ``FIELD_SPECS`` come; the pipeline's own cross-field checks call
  :func:`check_section` first.

Choices that belong to a module (the prior's ``PRIOR_INITS``, the kernels' ``IMPLEMENTATIONS``)
are imported from it, never restated. The engine declares its own sections in
:data:`goat_jax.train.validation.ENGINE_FIELDS` and checks each run's config with
:func:`check_config` before any work; a violation is a one-line ValueError naming the dotted
field, the value, what is allowed and the fix::

    optimizer.learning_rate=-1.0 is out of range: allowed is a number finite in float32 > 0 (peak
    learning rate). Set --config.optimizer.learning_rate to an allowed value.

Fields without a spec are not checked here (unknown fields are refused by the engine's schema
check).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Tuple

import numpy as np

from goat_jax import _extras  # the leaf module of optional-package errors

if TYPE_CHECKING:  # annotations only: ml_collections is imported where it is used
    import ml_collections

# float32 is what the device computes with: a larger "finite" value is inf there.
FLOAT32_MAX = float(np.finfo(np.float32).max)

# What a change of a field between a run and its resumption is (``Field.resume``).
RESUME_FIXED, RESUME_SAFE, RESUME_ADJUSTABLE = "fixed", "safe", "adjustable"
RESUME_BEHAVIOURS = (RESUME_FIXED, RESUME_SAFE, RESUME_ADJUSTABLE)


@dataclasses.dataclass(frozen=True)
class Field:
    """What one config field may hold.

    Attributes:
      kind: 'int', 'float', 'bool', 'str', 'strs' (a tuple of strings, e.g. file globs) or
        'ints' (a tuple of integers, each within ``min``/``max``), 'floats' (a tuple of finite
        numbers, e.g. per-channel means), 'opaque' (not checked here: its owner checks it) or
        'dtype' (a dtype name among ``choices``, or a
        numpy/JAX dtype of that name).
      min, max: bounds of a number (None: unbounded); ``min_inclusive`` / ``max_inclusive``
        say whether the bound itself is allowed.
      also: extra allowed values outside the range (e.g. ``-1``: "the remaining devices").
      choices: the allowed values of a 'str' field (or of a number, instead of a range).
      optional: None is allowed too.
      nonempty: a 'str' / 'strs' field must not be empty ('strs': no empty element either).
      lengths: the allowed lengths of an 'ints' tuple (None: any).
      doc: what the field means, shown in the error.
      resume: what a checkpoint makes of a change of the field between a run and its
        resumption (:data:`RESUME_BEHAVIOURS`): 'fixed' (fingerprinted: a change is another run,
        refused), 'safe' (left out of the fingerprint: cadences, device layout; it changes
        nothing computed) or 'adjustable' (may change when asked for, ``--resume_with_changes``:
        the optimization from the resumed step on). None: not declared (the engine declares
        every one of its fields; :mod:`goat_jax.train.checkpoint` reads them).
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
    lengths: Optional[Tuple[int, ...]] = None
    doc: str = ""
    resume: Optional[str] = None

    def __post_init__(self):
        if self.resume is not None and self.resume not in RESUME_BEHAVIOURS:
            raise ValueError(f"Field(resume={self.resume!r}): allowed is one of {list(RESUME_BEHAVIOURS)} or None.")

    def allowed(self) -> str:
        """A phrase saying what is allowed, e.g. 'an integer >= 1 (decoder blocks)'."""
        if self.choices is not None:
            text = f"one of {list(self.choices)}"
        elif self.kind in ("int", "float"):
            bounds = []
            # Integer bounds in full: ':g' would print MAX_POSITION = 2**24 as 1.67772e+07.
            num = (lambda v: str(int(v))) if self.kind == "int" else (lambda v: f"{v:g}")
            if self.min is not None:
                bounds.append(f"{'>=' if self.min_inclusive else '>'} {num(self.min)}")
            if self.max is not None and self.max != FLOAT32_MAX:
                bounds.append(f"{'<=' if self.max_inclusive else '<'} {num(self.max)}")
            text = ("an integer" if self.kind == "int" else "a number finite in float32") + (
                " " + " and ".join(bounds) if bounds else "")
            if self.also:
                text += " or " + " or ".join(repr(a) for a in self.also)
        elif self.kind == "bool":
            text = "True or False"
        elif self.kind == "strs":
            text = "a tuple of " + ("non-empty " if self.nonempty else "") + "strings"
        elif self.kind == "ints":
            sizes = " or ".join(str(n) for n in self.lengths) if self.lengths else "any number of"
            text = f"a tuple of {sizes} integers" + (f" >= {self.min:g}" if self.min is not None else "")
        elif self.kind == "floats":
            text = ("a non-empty" if self.nonempty else "a") + " tuple of finite numbers"
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


def Ints(min=None, max=None, lengths=None, **kw) -> Field:  # pylint: disable=invalid-name,redefined-builtin
    """A tuple (or list) of integers within ``[min, max]`` whose length is one of ``lengths``;
    on the command line, repeat the flag once per element."""
    return Field("ints", min=min, max=max, lengths=tuple(lengths) if lengths else None, **kw)


def Floats(**kw) -> Field:  # pylint: disable=invalid-name
    """A tuple (or list) of finite numbers; on the command line, repeat the flag per element."""
    return Field("floats", **kw)


def Opaque(**kw) -> Field:  # pylint: disable=invalid-name
    """A field whose value this module does not check (its owner does, e.g. the sharding rules,
    validated by ``goat_jax.train.sharding``): declared for its default and doc only."""
    return Field("opaque", **kw)


def Dtype(choices, **kw) -> Field:  # pylint: disable=invalid-name
    """A dtype: one of the names ``choices`` ('bfloat16'), or a dtype object of such a name."""
    return Field("dtype", choices=tuple(choices), **kw)


def _problem(spec: Field, value: Any) -> Optional[str]:
    """None if ``value`` satisfies ``spec``, else 'has the wrong type' / 'is out of range'."""
    if spec.kind == "opaque":
        return None
    if value is None:
        return None if spec.optional else "is not set"
    if spec.kind == "dtype":
        if not isinstance(value, str):
            try:  # a dtype object (jnp.bfloat16, np.dtype('float32')) stands for its name
                value = np.dtype(value).name
            except TypeError:
                return "has the wrong type"
        return None if value in spec.choices else "is not allowed"
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
    if spec.kind == "ints":
        if isinstance(value, str) or not isinstance(value, (tuple, list)):
            return "has the wrong type"
        if spec.lengths is not None and len(value) not in spec.lengths:
            return "has the wrong length"
        element = Int(min=spec.min, max=spec.max)
        return next((p for p in (_problem(element, v) for v in value) if p), None)
    if spec.kind == "floats":
        if isinstance(value, str) or not isinstance(value, (tuple, list)):
            return "has the wrong type"
        if not all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
                   for v in value):
            return "has the wrong type"
        if not all(math.isfinite(float(v)) for v in value):
            return "is not finite"
        return "is empty" if spec.nonempty and not value else None
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


def check_section(values: Mapping[str, Any], specs: Mapping[str, Field], section: Optional[str] = "",
                  owner: Optional[str] = None) -> None:
    """Checks every field of ``values`` that has a spec; raises a one-line ValueError naming
    the first offending field (``section.field``), its value, what is allowed and the fix.

    ``owner`` (a class name, for :func:`check_instance`) names the field ``Owner.field`` instead;
    ``section=None`` then means the values are not a config section, so no flag is suggested.
    """
    prefix = f"{section}." if section else ""
    for name, spec in specs.items():
        if name not in values:
            continue
        value = values[name]
        problem = _problem(spec, value)
        if problem:
            if section is None:
                fix = "Pass an allowed value."
            elif spec.kind in ("strs", "ints", "floats"):
                fix = (f"Repeat --config.{prefix}{name}=ELEMENT once per element" +
                       ("." if spec.nonempty else f", or pass --config.{prefix}{name}='()' for none."))
                numbers = [v for v in value if isinstance(v, (int, float)) and not isinstance(v, bool)] \
                    if spec.kind == "strs" and isinstance(value, (tuple, list)) else []
                if numbers:  # absl reads an element that looks like a number as one: 22 for chr 22
                    fix += (f" The command line reads {numbers[0]!r} as a number; quote a string that "
                            f"looks like one: --config.{prefix}{name}=\"'{numbers[0]}'\".")
            else:
                fix = f"Set --config.{prefix}{name} to an allowed value."
            where = f"{owner}.{name}" if owner else f"{prefix}{name}"
            raise ValueError(f"{where}={value!r} {problem}: allowed is {spec.allowed()}. {fix}")


def check_config(config: Any, specs: Mapping[str, Mapping[str, Field]]) -> None:
    """Runs :func:`check_section` for each ``{section: spec}`` ('' is the top level) that the
    config has."""
    for section, spec in specs.items():
        node = config if not section else config.get(section)
        if node is not None:
            check_section(node, spec, section)


# ----------------------------------------------------------------------------------------------
# Specs as dataclass field metadata: one declaration gives the default, the type/range and the doc
# ----------------------------------------------------------------------------------------------

_SPEC_KEY = "goat_jax.config.spec"


def declare(default: Any, spec: Field) -> Any:
    """A dataclass field with ``default`` whose spec is ``spec``:
    ``num_layers: int = declare(2, Int(min=1, doc="decoder blocks"))``."""
    if not isinstance(spec, Field):
        raise TypeError(f"declare(default, spec): spec must be a goat_jax.config.fields.Field, got {spec!r}.")
    return dataclasses.field(default=default, metadata={_SPEC_KEY: spec})


def borrow(cls: Any, name: str, default: Any = dataclasses.MISSING) -> Any:
    """A dataclass field declared like ``cls``'s field ``name`` (same spec; ``cls``'s default
    unless ``default`` is given): how a flat model config exposes the GOAT prior's fields
    under their own names without restating their range."""
    source = {f.name: f for f in dataclasses.fields(cls)}.get(name)
    if source is None or _SPEC_KEY not in source.metadata:
        raise ValueError(f"borrow: {cls.__name__} has no declared field {name!r}.")
    return declare(source.default if default is dataclasses.MISSING else default,
                   source.metadata[_SPEC_KEY])


def specs_of(cls: Any) -> Dict[str, Field]:
    """``{field name: Field}`` of a dataclass's declared fields (in declaration order): the
    ``FIELD_SPECS`` of the config section it describes."""
    return {f.name: f.metadata[_SPEC_KEY] for f in dataclasses.fields(cls) if _SPEC_KEY in f.metadata}


def check_instance(obj: Any, section: Optional[str] = None) -> None:
    """Checks every declared field of the dataclass instance ``obj`` against its spec (what
    ``__post_init__`` calls before its cross-field rules). The error names ``Class.field``;
    ``section`` (e.g. 'model', when the class is a config section) adds the flag to set."""
    specs = specs_of(type(obj))
    check_section({name: getattr(obj, name) for name in specs}, specs, section, owner=type(obj).__name__)


# ----------------------------------------------------------------------------------------------
# A ml_collections section declared once: each field's default next to its spec
# ----------------------------------------------------------------------------------------------

_PLACEHOLDER_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


class _Required:
    """The default of a :class:`Section` field that every config must set (no default)."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = _Required()


def value_of(declared: type, node: Optional[Mapping[str, Any]], name: str) -> Any:
    """Field ``name`` of the config section ``node`` whose fields the dataclass ``declared``
    declares (e.g. ``config.model`` and :class:`goat_jax.models.lm.LMConfig`), or the field's
    declared default where ``node`` leaves it out: :meth:`Section.value` for a section declared
    by a dataclass, so that no reader restates a default (``node.get(name, <default again>)``)."""
    if node is not None and name in node:
        return node[name]
    field = next((f for f in dataclasses.fields(declared) if f.name == name), None)
    if field is None or field.default is dataclasses.MISSING:
        raise KeyError(f"{declared.__name__} declares no field {name!r} with a default")
    return field.default


class Section:
    """The fields of one ``ml_collections`` config section, each declared once as
    ``name=(default, Field)``::

        DATA = Section(read_threads=(4, Int(min=0, doc="threads reading ahead")), ...)
        FIELD_SPECS = DATA.specs          # checked by the engine before any work
        def default_data_config(): return DATA.defaults()

    A None default of an optional number or string becomes a typed placeholder, so
    ``--config.data.x=...`` can still set it from the command line. A field declared
    ``(REQUIRED, Field)`` has no default: every config must set it (:attr:`required`).
    """

    def __init__(self, **declared: Tuple[Any, Field]):
        for name, entry in declared.items():
            if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], Field)):
                raise TypeError(f"Section field {name!r} must be (default, Field), got {entry!r}.")
            if entry[0] is REQUIRED:
                continue
            problem = _problem(entry[1], entry[0])
            if problem:  # a declaration whose own default it refuses is a bug in the declaration
                raise ValueError(f"Section field {name!r}: the default {entry[0]!r} {problem} "
                                 f"({entry[1].allowed()}).")
        self._declared = dict(declared)

    @property
    def specs(self) -> Dict[str, Field]:
        """``{name: Field}`` in declaration order (the section's ``FIELD_SPECS``)."""
        return {name: spec for name, (_, spec) in self._declared.items()}

    @property
    def resume(self) -> Dict[str, Optional[str]]:
        """``{name: Field.resume}`` in declaration order: what a checkpoint makes of a change of
        each field on resume (None where the declaration says nothing)."""
        return {name: spec.resume for name, (_, spec) in self._declared.items()}

    @property
    def required(self) -> Tuple[str, ...]:
        """The fields declared ``REQUIRED``: no default, every config sets them."""
        return tuple(name for name, (default, _) in self._declared.items() if default is REQUIRED)

    def default_values(self) -> Dict[str, Any]:
        """``{name: default}`` of every field with a default (None stays None, no placeholder):
        what a config that leaves the field out computes with."""
        return {name: default for name, (default, _) in self._declared.items() if default is not REQUIRED}

    def default(self, name: str) -> Any:
        """The declared default of field ``name`` (None stays None). KeyError for a field the
        section does not declare or declares ``REQUIRED`` (it has no default to fall back on)."""
        if name not in self._declared:
            raise KeyError(f"the section declares no field {name!r} (it has {sorted(self._declared)})")
        default = self._declared[name][0]
        if default is REQUIRED:
            raise KeyError(f"field {name!r} is REQUIRED: it has no default")
        return default

    def value(self, node: Optional[Mapping[str, Any]], name: str) -> Any:
        """Field ``name`` of the config section ``node`` (a ConfigDict or dict; None: the config
        has no such section), or the declared default where ``node`` leaves it out: how code
        that may get a config without the defaults filled in (an old run's config, a test's)
        reads a field without restating its default (``node.get(name, <default again>)``)."""
        if node is not None and name in node:
            return node[name]
        return self.default(name)

    def placeholder(self, name: str) -> Any:
        """The value :meth:`defaults` gives field ``name``: its default, or a typed placeholder
        for a None default of a plain kind (so the command line can still set it)."""
        default, spec = self._declared[name]
        if default is None and spec.kind in _PLACEHOLDER_TYPES:
            with _extras.imports(__name__):
                from ml_collections import config_dict  # pylint: disable=g-import-not-at-top
            return config_dict.placeholder(_PLACEHOLDER_TYPES[spec.kind])
        return default

    def defaults(self) -> "ml_collections.ConfigDict":
        """A fresh ConfigDict holding every field's default (required fields are left out)."""
        # Imported here, not at the top: the prior's settings import this module, and the core
        # install (the layer alone: jax, flax, numpy) has no ml_collections.
        with _extras.imports(__name__):
            import ml_collections  # pylint: disable=g-import-not-at-top
        c = ml_collections.ConfigDict()
        for name in self.default_values():
            c[name] = self.placeholder(name)
        return c
