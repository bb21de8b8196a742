"""The registry of position encodings: every encoding :class:`goat_jax.layers.positional.PositionalAttention`
runs (:data:`ENCODINGS`, in documentation order), looked up by name, extended with :func:`register`,
and the encodings' settings as model config fields (:func:`add_settings_fields`).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Dict, Iterable, Tuple

from goat_jax.config.fields import Float, specs_of
from goat_jax.positional import alibi, fire, fox, kerple, naive_prior, nope, rope, rope_mixed, rope_scaling
from goat_jax.positional.base import PositionEncoding

# Every encoding PositionalAttention runs, in documentation order. A new encoding is one module
# (its PositionEncoding and, if it has knobs, their EncodingSettings) and one entry here: the
# layer's keywords, the models' choices and their config fields are read from this registry.
ENCODINGS = (nope.NOPE, rope.ROPE, rope.ROPE_PI, alibi.ALIBI, alibi.ALIBI_PACKED, naive_prior.NAIVE_PRIOR,
             rope_scaling.NTK, rope_scaling.YARN, rope.ROPE2D, rope_mixed.ROPE_MIXED, fire.FIRE, kerple.KERPLE_LOG,
             fox.FOX)
POSITION_ENCODINGS = tuple(e.name for e in ENCODINGS)
_BY_NAME = {e.name: e for e in ENCODINGS}

# The baselines' factor on q . k (PositionalAttention.attention_scale; the models'
# ``baseline_attention_scale``), declared once.
ATTENTION_SCALE = Float(min=0.0, min_inclusive=False, optional=True,
                        doc="non-GOAT q.k factor; None: 1 / sqrt(head_dim) (official synthetic: 1)")


def get_encoding(name: str) -> PositionEncoding:
    """The registered encoding called ``name``; ValueError listing the choices otherwise."""
    if name not in _BY_NAME:
        raise ValueError(
            f"Unknown position_encoding={name!r}; choose one of {POSITION_ENCODINGS} (absolute "
            "'sinusoidal'/'learned' encodings go on the embeddings, with 'nope' here).")
    return _BY_NAME[name]


def settings_fields(encodings: Iterable[PositionEncoding]) -> Dict[str, Tuple[dataclasses.Field, Any]]:
    """``{name: (dataclass field, spec)}`` of every setting of ``encodings``, each name once, in
    registry order. A name two encodings share must be one declaration (inherited or borrowed:
    the same spec object); TypeError naming both otherwise."""
    out: Dict[str, Tuple[dataclasses.Field, Any, type]] = {}
    for enc in encodings:
        specs = specs_of(enc.settings_class)
        for field in dataclasses.fields(enc.settings_class):
            if field.name in out and out[field.name][1] is not specs[field.name]:
                raise TypeError(f"{enc.settings_class.__name__}.{field.name} is declared apart from "
                                f"{out[field.name][2].__name__}.{field.name}: a setting two encodings share is "
                                "one declaration (inherit it or goat_jax.config.fields.borrow it).")
            out.setdefault(field.name, (field, specs[field.name], enc.settings_class))
    return {name: (field, spec) for name, (field, spec, _) in out.items()}


def add_settings_fields(config_cls: type, encodings: Iterable[PositionEncoding]) -> type:
    """The model config ``config_cls`` (a frozen dataclass) completed with every setting of
    ``encodings`` it does not declare, each under its name and from the encoding's declaration:
    ``config_cls`` itself when it has them all, else a subclass of the same name adding them (so
    a registered encoding's new knob is a ``model.<knob>`` field with no line in the model). A
    field it declares under a setting's name must be that declaration (``borrow``; its own
    default allowed); TypeError otherwise."""
    own = specs_of(config_cls)
    missing = []
    for name, (field, spec) in settings_fields(encodings).items():
        if name not in own:
            missing.append((name, field.type, dataclasses.field(default=field.default, metadata=field.metadata)))
        elif own[name] is not spec:
            raise TypeError(f"{config_cls.__name__}.{name} is declared apart from the encodings' setting "
                            f"{name!r}: take it with goat_jax.config.fields.borrow.")
    if not missing:
        return config_cls
    cls = dataclasses.make_dataclass(config_cls.__name__, missing, bases=(config_cls,), frozen=True)
    cls.__module__, cls.__qualname__, cls.__doc__ = config_cls.__module__, config_cls.__qualname__, config_cls.__doc__
    return cls


def register(encoding: PositionEncoding) -> None:
    """Adds ``encoding`` (defined outside this package: a plugin, a test) to the registry, as an
    entry of :data:`ENCODINGS` does. Call it before importing :mod:`goat_jax.models`, whose
    choices and config fields are read from the registry when they are imported; a built layer
    takes its settings as ``PositionalAttention(settings=...)`` (the keywords are the built-in
    encodings'). ``goat_jax.positional.ENCODINGS`` / ``POSITION_ENCODINGS`` read this module's
    tables when asked, so they include it from then on."""
    global ENCODINGS, POSITION_ENCODINGS  # pylint: disable=global-statement
    if encoding.name in _BY_NAME:
        raise ValueError(f"position_encoding={encoding.name!r} is registered already.")
    loaded = sorted(m for m in ("goat_jax.models.lm", "goat_jax.models.vit") if m in sys.modules)
    if loaded:
        raise RuntimeError(f"register({encoding.name!r}) after {loaded} read the registry: register "
                           "encodings before importing goat_jax.models.")
    settings_fields(ENCODINGS + (encoding,))  # its settings agree with the registered ones
    ENCODINGS = ENCODINGS + (encoding,)
    POSITION_ENCODINGS = tuple(e.name for e in ENCODINGS)
    _BY_NAME[encoding.name] = encoding
