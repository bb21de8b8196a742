"""The protocol every position encoding of :class:`goat_jax.layers.positional.PositionalAttention`
follows (how to add one: the :mod:`goat_jax.positional` package docstring).

An encoding is a :class:`PositionEncoding` instance: a few class attributes that say where it
runs, the class of its settings (an :class:`EncodingSettings` dataclass: each knob declared once,
with its default, range and doc, and the rules between knobs), its parameters and cache slots as
declarations (data: names, initializers, shapes), and hooks that take values (the parameters'
values, an :class:`EncodingContext`) and return values. The attention layer holds it inside a
:class:`goat_jax.layers.positional.BaselineEncoding` and owns everything else (call signature,
projections, positions, KV cache, kernel call, sowing: :mod:`goat_jax.layers.core`), so an
encoding is only its own math and its own settings; it never sees the layer.

Shape legend: B batch, T queries, S keys (the cache while decoding), N query heads, K kv heads,
G = N // K, H head dim, c split channels (``goat_jax.prior.packing.default_sink_channels``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Dict, Mapping, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp

from goat_jax.config.fields import check_instance

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class EncodingSettings:
    """An encoding's settings, declared once: the base of every encoding's settings dataclass
    (this one, with no field, is the settings of the encodings that have none).

    A subclass is a frozen dataclass next to its encoding, one field per knob declared with
    :func:`goat_jax.config.fields.declare` (default, type, range, doc) or taken with
    :func:`goat_jax.config.fields.borrow` from another declaration (``training_seq_len`` from
    :class:`goat_jax.prior.PriorSettings`, ``rope_base`` by inheriting ``RopeSettings``); a
    knob two encodings share is one declaration. Everything else reads these declarations: the
    model configs expose each field under its name (``model.yarn_beta_fast``, defaulted and
    range-checked by it), the models build the object with :meth:`from_fields` and pass it to the
    layer (``PositionalAttention(settings=...)``), and the layer's hand-built keywords
    (``PositionalAttention(rope_base=...)``) are its field names.

    ``__post_init__`` checks each field against its declaration, then the subclass's own rules
    between fields (``'rope_pi'`` needs ``training_seq_len``): the one place each requirement is
    checked, whether the object is built by a config's validation or by a layer.

    ``ALIASES``: ``{layer keyword: field}``, older keywords of the layer that set a field of
    another name (``'rope_mixed'``: ``rope_base`` sets ``rope_mixed_base``).
    """

    ALIASES: ClassVar[Mapping[str, str]] = {}

    def __post_init__(self):
        check_instance(self)

    @classmethod
    def names(cls) -> Tuple[str, ...]:
        """The setting names."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_fields(cls, obj: Any) -> "EncodingSettings":
        """The settings named by ``obj``'s attributes (a flat model config, e.g. ``LMConfig``);
        settings ``obj`` does not have keep their declared defaults."""
        return cls(**{n: getattr(obj, n) for n in cls.names() if hasattr(obj, n)})

    @classmethod
    def keyword_values(cls, keywords: Mapping[str, Any]) -> Dict[str, Any]:
        """``{field: value}`` of a layer's keywords (``{name: value}``, None = not given): the
        ones this class has, under their names or :attr:`ALIASES`; the others are not this
        encoding's and are left out. A field given twice (its name and an alias) must agree."""
        values: Dict[str, Any] = {}
        for key, value in keywords.items():
            name = cls.ALIASES.get(key, key)
            if value is None or name not in cls.names():
                continue
            if name in values and values[name] != value:
                raise ValueError(f"{cls.__name__}.{name} is given twice with different values: "
                                 f"{values[name]!r} and {key}={value!r}.")
            values[name] = value
        return values


class EncodingContext(NamedTuple):
    """What an encoding's hooks may read about the current call.

    Attributes:
      call: the call's arguments (``query`` [B, T, E] is the layer input, e.g. for a
        data-dependent encoding); offsets are the cache index while decoding.
      shape: head counts, head dim and compute dtype (:class:`goat_jax.layers.call.LayerShape`).
      q_pos: [T] or [B, T] float positions of the queries (1D).
      k_pos: [S] or [B, S] float positions of this call's keys (what :meth:`PositionEncoding.encode`
        encodes, and what the KV cache then stores).
      attended_k_pos: positions of the keys the kernel attends over, for a bias: ``k_pos``, or
        the whole cache from position 0 while decoding.
      key_len: S attended (the cache length while decoding).
      decoding: True when this call appends to a KV cache.
      channels: c, the parts an unbounded packed term is split into (1 in float32, 3 in bf16).
      scale: the layer's factor on ``q . k`` (``attention_scale`` or ``1 / sqrt(H)``).
      settings: the layer's :attr:`PositionEncoding.settings_class` instance (checked).
      attention_scale: the layer's ``attention_scale`` field as given (None: ``1 / sqrt(H)``),
        for an encoding that folds the scale into packed queries.
      cache: while decoding, the cache's values before this call (``{slot: value}``: the
        encoding's own :meth:`PositionEncoding.cache_slots` among them); None otherwise.
    """

    call: Any  # goat_jax.layers.call.AttentionCall
    shape: Any  # goat_jax.layers.call.LayerShape
    q_pos: Array
    k_pos: Array
    attended_k_pos: Array
    key_len: int
    decoding: bool
    channels: int
    scale: float
    settings: Any = None
    attention_scale: Optional[float] = None
    cache: Optional[Mapping[str, Any]] = None


class PositionEncoding:
    """One position encoding inside attention. Subclasses set the class attributes and override
    the hooks they need; an instance is registered in ``goat_jax.positional.registry.ENCODINGS``.

    Attributes:
      name: the ``position_encoding`` value.
      positions: '1d' (sequence positions), '2d' (needs ``spatial_shape``; self-attention over
        one patch grid, no offsets, no decoding) or 'any' (accepts a ``spatial_shape`` and
        ignores it).
      causal_only: '' or the reason the encoding needs ``is_causal=True`` (the error says it).
      materialized_bias: True when :meth:`bias` returns a [.., N, T, S] array, which only the
        'xla' and 'dense' kernels take ('xla' is the automatic choice then); False means the
        encoding runs on every kernel (flash, cuDNN, splash).
      flash_alternative: for a bias encoding, the encoding to name in the error a flash kernel
        raises (e.g. "'alibi_packed' (causal)"), or None.
      settings_class: the :class:`EncodingSettings` subclass of its knobs (declared in its
        module); the hooks read the layer's instance of it as ``ctx.settings``.
    """

    name: str = ""
    positions: str = "1d"
    causal_only: str = ""
    materialized_bias: bool = False
    flash_alternative: Optional[str] = None
    settings_class: type = EncodingSettings

    def check_layer(self, sizes: Any) -> None:
        """Raises ValueError for a layer the encoding cannot run in (``sizes``: the layer's
        :class:`goat_jax.layers.encoding.Sizes`: heads, head dim, key width, parameter dtype,
        whether it decodes); its settings' own rules are checked when the settings are built, in
        ``settings_class.__post_init__``."""

    def check_head_dim(self, head_dim: int) -> None:
        """Raises ValueError unless the encoding runs on heads of ``head_dim`` dims (called by the
        layer before any parameter is made, and by a model config's validation)."""

    def extra_qk_dims(self, shape: Any, channels: int) -> int:
        """Channels the encoding appends to each q/k head (0 unless it packs a term into q/k);
        ``shape`` is the call's :class:`goat_jax.layers.call.LayerShape`."""
        return 0

    def parameters(self, sizes: Any, settings: EncodingSettings) -> Tuple[Tuple[str, Any, Tuple[Any, ...]], ...]:
        """The encoding's parameters, declared: ``((name, init, (shape, dtype)), ...)`` in creation
        order, for a layer of ``sizes`` (:class:`goat_jax.layers.encoding.Sizes`) and these
        checked ``settings``; ``init`` is a Flax initializer (boxed with logical axis names where
        the parameter is sharded). The layer makes them (Linen at ``init``, NNX at construction)
        and hands their values to :meth:`encode` and :meth:`bias` as ``params`` (``{name: value}``)."""
        return ()

    def cache_slots(self, sizes: Any, batch: int) -> Tuple[Tuple[str, Any, Tuple[Any, ...]], ...]:
        """Slots of its own in the KV cache collection, ``((name, init, args), ...)`` for a cache of
        ``batch`` rows (made when the layer decodes; read as ``ctx.cache[name]``, advanced by
        :meth:`cache_update`)."""
        return ()

    def encode(self, params: Mapping[str, Any], ctx: EncodingContext, q: Array, k: Array) -> Tuple[Array, Array, float]:
        """``(q, k, scale)`` for the kernel from the raw projections q [B, T, N, H], k [B, S, K, H]
        (k as the cache will store it); ``params``: the values of :meth:`parameters`."""
        return q, k, ctx.scale

    def bias(self, params: Mapping[str, Any], ctx: EncodingContext) -> Optional[Array]:
        """None, or the additive [B or 1, N, T, S attended] float32 bias (``materialized_bias``);
        added to the scaled logits, unscaled."""
        return None

    def cache_update(self, params: Mapping[str, Any], ctx: EncodingContext) -> Dict[str, Any]:
        """While decoding, the new values of :meth:`cache_slots` after this call's tokens."""
        return {}

    def __repr__(self) -> str:
        return f"<position encoding {self.name!r}>"


def as_batched(positions: Any) -> Array:
    """[L] -> [1, L]; [B, L] unchanged; float32 (integer positions are exact up to 2**24)."""
    p = jnp.asarray(positions, jnp.float32)
    return p[None] if p.ndim == 1 else p


def check_max_len(max_len: int, span: Optional[Tuple[int, int]], what: str) -> None:
    """Raises ValueError naming ``max_len`` unless ``0 <= positions < max_len`` (when known)."""
    if span is not None and (span[0] < 0 or span[1] >= max_len):
        raise ValueError(
            f"{what}: positions span [{span[0]}, {span[1]}], beyond [0, max_len={max_len}). "
            "Increase max_len or use a relative encoding that extrapolates.")
