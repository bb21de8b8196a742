"""Native Flax NNX attention layers: :class:`GoatAttention` and :class:`PositionalAttention`,
with the same math, parameters and kernels as the Linen modules of the same names.

Both are thin NNX *shells* of :func:`goat_jax.layers.core.run`, the one attention call
(resolving the call, positions, encoding q/k, the kernel, masking), and inherit the same variant
logic as the Linen layers (:class:`goat_jax.layers.goat.GoatLogic`,
:class:`goat_jax.layers.positional.PositionalLogic`): nothing here packs, encodes or masks.

* Construction is eager: ``GoatAttention(num_heads=8, in_features=512, prior=PriorSettings(...),
  rngs=nnx.Rngs(0))``. The keywords are the Linen module's fields, each with the Linen default
  (read from the Linen dataclass, never listed twice), plus ``in_features`` (E of the query),
  ``kv_features`` (E' of key/value, default ``in_features``) and ``rngs``. The parameters are
  made by one dry call of the shared core on a tiny input (traced, no kernel runs), so every argument
  error the Linen layer raises at its first call is raised here, at construction, as the same
  one-line ``ValueError`` (a head too small for the prior, an encoding's settings, a kernel an
  encoding cannot run on, ...).
* The call is the Linen module's: ``layer(query, key=None, value=None, *, is_causal=False,
  key_padding_mask=None, spatial_shape=None, has_cls_token=None, position_offset_q=None,
  position_offset_k=None, q_positions=None, k_positions=None, segment_ids=None,
  kv_segment_ids=None)`` (:class:`goat_jax.layers.linen.AttentionBase`).
* Parameters have the Linen names, shapes and dtypes (``q_proj/kernel``, ``prior/lambda_sym``,
  ``fox_gate``, ...), so ``nnx.state(layer, nnx.Param).to_pure_dict()`` is the Linen
  ``params`` tree; :func:`from_linen` / :func:`to_linen` move a layer both ways. Parameters the
  Linen module boxes with logical axis names carry the same names as ``out_sharding`` metadata
  (what ``nnx.bridge.ToNNX`` gives them; no eager sharding without a mesh).
* KV cache: build with ``decode=True``, call :meth:`AttentionShell.init_cache` ``(batch_size,
  max_length)`` (the Linen ``init`` with a full-length input), then call the layer chunk by
  chunk or token by token (inside ``nnx.jit`` the cache updates propagate); equal to the full
  forward, with the Linen layer's checks and its NaN on overflow. A call of another batch than
  the cache's is refused naming both and ``init_cache``.
* Attention maps are sown as in Linen: with ``implementation='dense'`` (the only kernel that
  materializes the probabilities) every call sows ``attention_probs`` [B, N, T, S] float32 and
  the content ``attention_keys`` / ``attention_values`` as ``nnx.Intermediate`` (while decoding,
  the probabilities only); read them with ``nnx.pop(layer, nnx.Intermediate)``. Other kernels
  sow nothing.
* State changes only when a call returns: the cache writes and sown maps of a call wait until it
  has returned, so a call that raises (a wrong input, a kernel's refusal) leaves the layer as it
  was, as a failed Linen ``apply`` leaves its variables. ``init_cache`` and
  :func:`load_linen_params` likewise check everything before they change anything. An input of
  another width than ``in_features`` / ``kv_features`` is refused naming them.

Initial values are drawn from ``rngs`` with the Linen initializers, but not the Linen module's
random streams: equal weights come from :func:`from_linen`, not from equal seeds.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import meta
from flax.nnx.bridge.variables import to_nnx_var

from goat_jax.layers import goat as attention_lib
from goat_jax.layers import core as attention_core
from goat_jax.layers import linen
from goat_jax.layers import positional as positional_layer

Array = jax.Array

# The layer being constructed and its key source, while its dry call makes the parameters.
_BUILD = threading.local()
# While a layer is called: {id(layer): _Pending}, what the call writes (cache values, sown maps),
# applied to the layer only when the call returns, so a call that raises changes nothing.
_CALLS = threading.local()


class _Pending:
    """What one call of a layer will write: cache variable -> new value, and the maps to sow."""

    def __init__(self):
        self.values: dict = {}  # nnx.Cache -> value (keyed by identity: variables do not hash by value)
        self.sows: list = []

    def read(self, var: nnx.Variable) -> Any:
        return self.values[id(var)][1] if id(var) in self.values else var.get_value()

    def write(self, var: nnx.Variable, value: Any) -> None:
        self.values[id(var)] = (var, value)

    def apply(self, layer: "AttentionShell") -> None:
        for var, value in self.values.values():
            var.set_value(value)
        for name, value in self.sows:
            layer.sow(nnx.Intermediate, name, value)


class _Group(nnx.Module):
    """A node of the parameter tree: a Linen submodule's parameters (``q_proj``, ``prior``) or
    a dictionary-valued Linen parameter (``prior/key_bias/fc1``)."""


def _children(node: nnx.Module):
    return [(n, v) for n, v in vars(node).items() if isinstance(v, (nnx.Variable, _Group))]


def _read(node) -> Any:
    """The value of a parameter, or the ``{name: value}`` tree of a group."""
    if isinstance(node, nnx.Variable):
        return node.get_value()
    return {n: _read(v) for n, v in _children(node)}


def _make(value: Any) -> Any:
    """An ``nnx.Param`` (with the box's metadata, as ``nnx.bridge`` makes it) or, for a dict
    value, a :class:`_Group` of them."""
    if isinstance(value, dict):
        group = _Group()
        for n, v in value.items():
            setattr(group, n, _make(v))
        return group
    if isinstance(value, meta.AxisMetadata):
        return to_nnx_var("params", value)
    return nnx.Param(value)


class _Slot:
    """A cache variable as the core reads and writes it (``.value``): over an ``nnx.Cache``, whose
    writes wait in the call's :class:`_Pending` until the call returns, or a stand-in value
    while the cache is being sized."""

    def __init__(self, var: Optional[nnx.Variable], value: Any = None, pending: Optional[_Pending] = None):
        self.var, self._value, self._pending = var, value, pending

    @property
    def value(self) -> Any:
        if self.var is None:
            return self._value
        return self._pending.read(self.var) if self._pending is not None else self.var.get_value()

    @value.setter
    def value(self, value: Any) -> None:
        if self.var is None:
            self._value = value
        elif self._pending is not None:
            self._pending.write(self.var, value)
        else:
            self.var.set_value(value)


class AttentionShell(nnx.Module):
    """The NNX shell of :func:`goat_jax.layers.core.run` (its contract: that module's
    docstring), the base of :class:`GoatAttention` and :class:`PositionalAttention`: eager
    construction, parameters and cache as NNX variables, the Linen call. Subclasses add a
    variant mixin and name their Linen twin in ``_LINEN``."""

    _LINEN: type = nn.Module
    _RENAMED: dict = {}  # Linen field -> attribute, where the Linen name is a parameter group's

    def __init__(self, num_heads: int, *, in_features: int, rngs: nnx.Rngs,
                 kv_features: Optional[int] = None, **fields):
        known = _linen_fields(self._LINEN)
        unknown = sorted(set(fields) - set(known))
        if unknown:
            raise TypeError(f"{type(self).__name__} got unexpected keyword(s) {unknown}; it takes the "
                            f"Linen module's fields {sorted(known)} and in_features, kv_features, rngs.")
        values = {**known, **fields, "num_heads": num_heads}
        for name, value in values.items():
            setattr(self, self._RENAMED.get(name, name), value)
        self.in_features, self.kv_features = in_features, kv_features or in_features
        length, spatial_shape = self._dummy_call()
        query = jnp.zeros((1, length, in_features), self.param_dtype)
        key = None if self.kv_features == in_features else jnp.zeros((1, length, self.kv_features), self.param_dtype)
        # The dry call is traced only (it records what each param() makes); then every
        # initializer runs in one compiled program, and the variables are set outside any trace.
        _BUILD.current, _BUILD.records = self, {}
        try:
            jax.eval_shape(lambda: attention_core.run(self, query, key, is_causal=True, spatial_shape=spatial_shape,
                                                      skip_kernel=True))
        finally:
            records, _BUILD.current, _BUILD.records = _BUILD.records, None, {}
        paths = list(records)
        keys = [rngs.params() for _ in paths]
        values = jax.jit(lambda ks: [records[p][0](k, *records[p][1]) for p, k in zip(paths, ks)])(keys)
        for path, value in zip(paths, values):
            node = self
            for part in path[:-1]:
                if part not in vars(node):
                    setattr(node, part, _Group())
                node = getattr(node, part)
            setattr(node, path[-1], _make(value))

    def _dummy_call(self) -> Tuple[int, Optional[Tuple[int, int]]]:
        """``(length, spatial_shape)`` of the construction's dry call (every parameter is made)."""
        return 1, None

    def __call__(self, query: Array, key: Optional[Array] = None, value: Optional[Array] = None,
                 **options: Any) -> Array:
        """The Linen module's call (:class:`goat_jax.layers.linen.AttentionBase`; ``options``: the
        keywords of :class:`goat_jax.layers.call.CallOptions`); [B, T, out_features or E].
        The cache and the sown maps change only if the call returns: one that raises (a cache of
        another batch, a kernel's refusal) leaves the layer as it was."""
        for name, x, width, field in (("query", query, self.in_features, "in_features"),
                                      ("key", key, self.kv_features, "kv_features"),
                                      ("value", value, self.kv_features, "kv_features")):
            if x is not None and jnp.ndim(x) >= 1 and jnp.shape(x)[-1] != width:
                raise ValueError(
                    f"{type(self).__name__} was built with {field}={width}, but {name} has width "
                    f"{jnp.shape(x)[-1]} (shape {tuple(jnp.shape(x))}); give inputs [batch, length, "
                    f"{width}], or build the layer with {field}={jnp.shape(x)[-1]}.")
        calls = vars(_CALLS).setdefault("pending", {})
        pending = calls[id(self)] = _Pending()
        try:
            out = attention_core.run(self, query, key, value, **options)
        finally:
            del calls[id(self)]
        pending.apply(self)
        return out

    # The shell contract of attention_core.run.

    def param(self, name, init, *args) -> Any:
        """Linen's ``Module.param``: records the parameter at ``name`` (a name or a path) during
        the construction's dry call, reads it afterwards."""
        path = (name,) if isinstance(name, str) else tuple(name)
        if getattr(_BUILD, "current", None) is self:
            records = _BUILD.records
            if path in records:
                raise ValueError(f"{type(self).__name__}: parameter {'/'.join(path)} is made twice.")
            records[path] = (init, args)
            return meta.unbox(init(jax.random.key(0), *args))  # traced: shapes for the dry call
        node = self
        for part in path:
            node = vars(node).get(part)
            if not isinstance(node, (nnx.Variable, _Group)):
                raise ValueError(
                    f"{type(self).__name__}: this call needs the parameter {'/'.join(path)}, which the "
                    "construction did not make (its dry call took another path); build the layer with "
                    "the arguments that make it.")
        return _read(node)

    def _projection(self, name: str, spec: str, x: Array, kernel_shape: Tuple[int, ...],
                    kernel_axes: Tuple[str, ...], fan_in_dims: int, dtype: Any) -> Array:
        return linen.projection(lambda n, *a: self.param((name, n), *a), spec, x, kernel_shape, kernel_axes,
                                 fan_in_dims, self.use_bias, dtype, self.param_dtype, self.kernel_init_std)

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = jnp.float32) -> None:
        """Sizes (or empties) the KV cache of a ``decode=True`` layer for ``batch_size`` rows of
        up to ``max_length`` tokens of inputs of ``dtype`` (the Linen ``init`` with a full-length
        input): ``cached_key`` [B, S, K, Hqk], ``cached_value`` [B, S, K, H], ``cache_index``
        (and 'fox''s ``fox_log_forget_sum``), as ``nnx.Cache`` variables. Then each call appends
        its tokens at the cache index and attends causally over the cache, as the Linen layer."""
        if not self.decode:
            raise ValueError(f"{type(self).__name__}.init_cache needs a layer built with decode=True.")
        query = jnp.zeros((batch_size, max_length, self.in_features), dtype)
        _BUILD.sizing, _BUILD.records = self, {}
        try:
            jax.eval_shape(lambda: attention_core.run(self, query, is_causal=True, skip_kernel=True))
        finally:
            records, _BUILD.sizing, _BUILD.records = _BUILD.records, None, {}
        caches = {name: nnx.Cache(init(*args)) for name, (init, args) in records.items()}
        for name, cache in caches.items():  # all made first: a failure leaves the old cache whole
            setattr(self, name, cache)

    def variable(self, collection: str, name: str, init, *args) -> "_Slot":
        """Linen's ``Module.variable`` for the 'cache' collection: recorded while
        :meth:`init_cache` sizes the cache, an ``nnx.Cache`` afterwards."""
        if getattr(_BUILD, "current", None) is self:  # constructing: no cache yet
            return _Slot(None, init(*args))
        if getattr(_BUILD, "sizing", None) is self:
            _BUILD.records.setdefault(name, (init, args))
            return _Slot(None, init(*args))
        if collection != "cache" or not isinstance(vars(self).get(name), nnx.Cache):
            raise ValueError(f"{type(self).__name__} is decoding without a KV cache: call "
                             "layer.init_cache(batch_size, max_length) first.")
        return _Slot(vars(self)[name], pending=getattr(_CALLS, "pending", {}).get(id(self)))

    def _attended_length(self, key_len: int) -> int:
        cache = vars(self).get("cached_key")
        return cache.get_value().shape[1] if self.decode and isinstance(cache, nnx.Cache) else key_len

    def _open_cache(self, **kwargs):
        attention_core.check_decode_call(**{n: kwargs[n] for n in (
            "query", "key", "is_causal", "positions_given", "key_padding_mask")})
        slots = [self.variable("cache", "cached_key", jnp.zeros, kwargs["key_shape"], kwargs["dtype"]),
                 self.variable("cache", "cached_value", jnp.zeros, kwargs["value_shape"], kwargs["dtype"]),
                 self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))]
        if slots[0].var is None:  # constructing or sizing: an ordinary forward
            return None
        attention_core.check_cache_batch(slots[0].value.shape[0], kwargs["key_shape"][0],
                                         "layer.init_cache({b}, max_length)")
        return attention_core.DecodeCache(*slots, slots[2].value)

    def _wants_attention_maps(self, implementation: str) -> bool:
        """The 'dense' kernel (the only one with materialized probabilities) sows them on every
        call, outside construction and cache sizing; read them with
        ``nnx.pop(layer, nnx.Intermediate)`` (Linen: ``mutable=['intermediates']``)."""
        building = self in (getattr(_BUILD, "current", None), getattr(_BUILD, "sizing", None))
        return implementation == "dense" and not building

    def _sow_maps(self, probs: Array, keys: Array, values: Array) -> None:
        """``attention_probs`` [B, N, T, S] float32, ``attention_keys`` and ``attention_values``
        (the content keys and values, as the Linen layer sows them) as ``nnx.Intermediate``."""
        self._pending_sows().extend([("attention_probs", probs), ("attention_keys", keys),
                                     ("attention_values", values)])

    def _sow_probs(self, probs: Array) -> None:
        """While decoding only the probabilities are sown (the cache holds packed keys)."""
        self._pending_sows().append(("attention_probs", probs))

    def _pending_sows(self) -> list:
        """The sows of the call in progress (applied when it returns, see :meth:`__call__`)."""
        return _CALLS.pending[id(self)].sows

    def linen_fields(self) -> dict:
        """``{field: value}`` of the equivalent Linen module."""
        return {n: getattr(self, self._RENAMED.get(n, n)) for n in _linen_fields(self._LINEN)}


def _linen_fields(cls: type) -> dict:
    """``{field: default}`` of a Linen layer's dataclass fields (``num_heads`` has none)."""
    return {f.name: (None if f.default is dataclasses.MISSING else f.default)
            for f in dataclasses.fields(cls) if f.name not in ("parent", "name")}


class GoatAttention(attention_lib.GoatLogic, AttentionShell):
    """GOAT attention as a Flax NNX module: :class:`goat_jax.layers.goat.GoatAttention`'s math,
    fields, call and parameters (module docstring). ``prior`` is the keyword of the
    :class:`goat_jax.prior.PriorSettings` (kept as ``prior_settings``), since ``prior`` is the
    parameter group, as in Linen: ``layer.prior.lambda_sym``."""

    _LINEN = attention_lib.GoatAttention
    _RENAMED = {"prior": "prior_settings"}

    def _prior_settings(self):
        return self.prior_settings

    def _prior_params(self, spec) -> dict:
        return {name: self.param(("prior", name), init, *args)
                for name, init, args in attention_lib.prior_declarations(spec)}

    def _dummy_call(self):
        if self.pos_encoding == "2d":
            return 1 + int(self.has_cls_token_default), (1, 1)
        return 3, None  # not a square grid, with or without CLS: 'auto' stays 1D


class PositionalAttention(positional_layer.PositionalLogic, AttentionShell):
    """A baseline position encoding as a Flax NNX module: :class:`goat_jax.layers.positional.PositionalAttention`'s
    math, fields (``position_encoding``, ``settings`` or the settings' keywords, ...), call and
    parameters (module docstring)."""

    _LINEN = positional_layer.PositionalAttention

    def _dummy_call(self):
        if positional_layer.get_encoding(self.position_encoding).positions == "2d":
            return 1, (1, 1)
        return 1, None


_BY_LINEN = {GoatAttention._LINEN: GoatAttention, PositionalAttention._LINEN: PositionalAttention}


def _flat(tree: Any) -> dict:
    return {tuple(str(getattr(k, "key", k)) for k in path): v
            for path, v in jax.tree_util.tree_leaves_with_path(tree)}


def load_linen_params(layer: AttentionShell, params: Any) -> AttentionShell:
    """Sets ``layer``'s parameters to the Linen ``params`` tree (``variables['params']``, boxed or
    not); ValueError naming the paths or shapes that differ. Returns ``layer``."""
    params = meta.unbox(params.get("params", params) if isinstance(params, dict) else params)
    state = nnx.state(layer, nnx.Param)
    ours, theirs = _flat(state.to_pure_dict()), _flat(params)
    if set(ours) != set(theirs):
        raise ValueError(f"Linen params do not fit {type(layer).__name__}: missing "
                         f"{sorted('/'.join(p) for p in set(ours) - set(theirs))}, unexpected "
                         f"{sorted('/'.join(p) for p in set(theirs) - set(ours))}.")
    bad = {"/".join(p): (jnp.shape(theirs[p]), jnp.shape(v)) for p, v in ours.items() if jnp.shape(v) != jnp.shape(theirs[p])}
    if bad:
        raise ValueError(f"Linen params do not fit {type(layer).__name__}: shapes (given, expected) {bad}.")
    state.replace_by_pure_dict(jax.tree.map(jnp.asarray, params))
    nnx.update(layer, state)
    return layer


def like_linen(module: nn.Module, in_features: int, *, kv_features: Optional[int] = None,
               rngs: Optional[nnx.Rngs] = None) -> AttentionShell:
    """A new NNX layer with the Linen ``module``'s fields (fresh weights from ``rngs``)."""
    cls = _BY_LINEN.get(type(module))
    if cls is None:
        raise TypeError(f"goat_jax.nnx takes a goat_jax GoatAttention or PositionalAttention, got "
                        f"{type(module).__name__} (wrap other Linen modules with flax.nnx.bridge.ToNNX).")
    fields = {n: getattr(module, n) for n in _linen_fields(type(module))}
    return cls(fields.pop("num_heads"), in_features=in_features, kv_features=kv_features,
               rngs=rngs or nnx.Rngs(0), **fields)


def from_linen(module: nn.Module, variables: Any, *, rngs: Optional[nnx.Rngs] = None) -> AttentionShell:
    """The NNX layer equal to the Linen ``module`` with ``variables`` (``{'params': ...}`` or the
    params tree): same fields, same parameter values."""
    params = meta.unbox(variables.get("params", variables))
    layer = like_linen(module, params["q_proj"]["kernel"].shape[0], kv_features=params["k_proj"]["kernel"].shape[0],
                       rngs=rngs)
    return load_linen_params(layer, params)


def to_linen(layer: AttentionShell) -> Tuple[nn.Module, dict]:
    """``(Linen module, {'params': ...})`` equal to the NNX ``layer``."""
    return layer._LINEN(**layer.linen_fields()), {"params": nnx.state(layer, nnx.Param).to_pure_dict()}
