"""Native Flax NNX attention layers: :class:`Attention` (holding any position encoding),
:class:`GoatAttention` and :class:`PositionalAttention`, with the same math, parameters and kernels
as the Linen layers of the same names.

The NNX layer is the second shell of :mod:`goat_jax.layers.core` (beside the Linen one): it holds
the same encoding value, makes the declared parameters at construction and, at each call, plans
the call (:func:`goat_jax.layers.core.prepare`), runs it on its variables' values
(:func:`goat_jax.layers.core.run`) and writes back what the call returns. Nothing here packs,
encodes or masks.

* Construction is eager: ``GoatAttention(num_heads=8, in_features=512, prior=PriorSettings(...),
  rngs=nnx.Rngs(0))``. The keywords are the Linen module's fields, each with the Linen default
  (read from the Linen dataclass, never listed twice), plus ``in_features`` (E of the query),
  ``kv_features`` (E' of key/value, default ``in_features``) and ``rngs``. The parameters are
  made from the declarations of a planned first call (:func:`goat_jax.layers.core.declarations`),
  so every argument error the Linen layer raises at its first call is raised here, at
  construction, as the same one-line ``ValueError`` (a head too small for the prior, an
  encoding's settings, a kernel an encoding cannot run on, ...).
* The call is the Linen module's: ``layer(query, key=None, value=None, *, is_causal=False,
  key_padding_mask=None, spatial_shape=None, has_cls_token=None, position_offset_q=None,
  position_offset_k=None, q_positions=None, k_positions=None, segment_ids=None,
  kv_segment_ids=None)`` (:class:`goat_jax.layers.linen.Attention`).
* Parameters have the Linen names, shapes and dtypes (``q_proj/kernel``, ``prior/lambda_sym``,
  ``fox_gate``, ...), so ``nnx.state(layer, nnx.Param).to_pure_dict()`` is the Linen
  ``params`` tree; :func:`from_linen` / :func:`to_linen` move a layer both ways. Parameters the
  Linen module boxes with logical axis names carry the same names as ``out_sharding`` metadata
  (what ``nnx.bridge.ToNNX`` gives them; no eager sharding without a mesh).
* KV cache: build with ``decode=True``, call :meth:`Attention.init_cache` ``(batch_size,
  max_length)`` (the Linen ``init`` with a full-length input), then call the layer chunk by
  chunk or token by token (inside ``nnx.jit`` the cache updates propagate); equal to the full
  forward, with the Linen layer's checks and its NaN on overflow. A call of another batch than
  the cache's is refused naming both and ``init_cache``.
* Attention maps are sown as in Linen: with ``implementation='dense'`` (the only kernel that
  materializes the probabilities) every call sows ``attention_probs`` [B, N, T, S] float32 and
  the content ``attention_keys`` / ``attention_values`` as ``nnx.Intermediate`` (while decoding,
  the probabilities only); read them with ``nnx.pop(layer, nnx.Intermediate)``. Other kernels
  sow nothing.
* State changes only when a call returns: the core returns the cache's new values and the maps,
  and the layer writes them after it has returned, so a call that raises (a wrong input, a
  kernel's refusal) leaves the layer as it was, as a failed Linen ``apply`` leaves its
  variables. ``init_cache`` and :func:`load_linen_params` likewise check everything before they
  change anything. An input of another width than ``in_features`` / ``kv_features`` is refused
  naming them.

Initial values are drawn from ``rngs`` with the Linen initializers, but not the Linen module's
random streams: equal weights come from :func:`from_linen`, not from equal seeds.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import meta
from flax.nnx.bridge.variables import to_nnx_var

from goat_jax.kernels import mesh as kernels_mesh
from goat_jax.layers import core as attention_core
from goat_jax.layers import goat as goat_layer
from goat_jax.layers import linen
from goat_jax.layers import positional as positional_layer
from goat_jax.layers.encoding import ParamDecl

Array = jax.Array

# How this layer sizes its cache (named when a call's batch is not the cache's).
_RESIZE = "layer.init_cache({b}, max_length)"


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


def _check_axis_rules(layer: str, boxed: Any) -> None:
    """Raises a one-line ValueError naming the fix when a mesh is active and a logical axis name
    of the parameters ``boxed`` (their shapes) has no logical axis rule and is no mesh axis: NNX
    takes such a name for a mesh axis and fails with "Resource axis: embed ... not found"."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return
    rules = {name for name, _ in (nn.get_logical_axis_rules() or ())}
    names = {n for box in jax.tree.leaves(boxed, is_leaf=lambda b: isinstance(b, meta.Partitioned))
             if isinstance(box, meta.Partitioned) for n in box.names if n is not None}
    missing = sorted(n for n in names if n not in rules and n not in mesh.axis_names)
    if missing:
        raise ValueError(
            f"{layer} is built inside a mesh with axes {tuple(mesh.axis_names)}, but its parameters' logical "
            f"axis names {missing} have no logical axis rule (NNX would take them for mesh axes): build it "
            "inside `with flax.linen.logical_axis_rules(goat_jax.train.sharding.DEFAULT_RULES + (('kv', None),))` "
            "(or your own rules for those names), or outside the mesh.")


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


class Attention(nnx.Module):
    """The NNX attention layer: holds a position encoding (``encoding``, or the one a subclass
    builds from the Linen twin's fields) and the parameters its declarations name, made at
    construction; the call is the Linen layer's (module docstring). Subclasses name their Linen
    twin in ``_LINEN`` (whose fields they take as keywords)."""

    _LINEN: type = linen.Attention
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
        self.spec = attention_core.LayerSpec.of(values, type(self).__name__)
        self.spec.check()
        kernels_mesh.check_axis_types(kernels_mesh.ambient_mesh())
        self._encoding_field = values["encoding"]  # the Linen field (None but on Attention itself)
        self.encoding = self._LINEN.encoding_of(values)
        decls = attention_core.declarations(self.spec, self.encoding, in_features, self.kv_features,
                                            **self._first_call())
        keys = [rngs.params() for _ in decls]
        make = lambda ks: [d.init(k, *d.args) for d, k in zip(decls, keys)]
        _check_axis_rules(type(self).__name__, jax.eval_shape(make, keys))
        for decl, value in zip(decls, jax.jit(make)(keys)):
            node = self
            for part in decl.path[:-1]:
                if part not in vars(node):
                    setattr(node, part, _Group())
                node = getattr(node, part)
            setattr(node, decl.path[-1], _make(value))

    def _first_call(self) -> Dict[str, Any]:
        """The call keywords of the first call the construction plans (every parameter is
        declared): ``length`` of the input and the call's options."""
        return {"length": 1}

    def __call__(self, query: Array, key: Optional[Array] = None, value: Optional[Array] = None,
                 **options: Any) -> Array:
        """The Linen module's call (:class:`goat_jax.layers.linen.Attention`; ``options``: the
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
        cached_key = vars(self).get("cached_key")
        has_cache = self.spec.decode and isinstance(cached_key, nnx.Cache)
        if self.spec.decode and not has_cache:
            raise ValueError(f"{type(self).__name__} is decoding without a KV cache: call "
                             "layer.init_cache(batch_size, max_length) first.")
        plan = attention_core.prepare(self.spec, self.encoding, query, key, value,
                                      cache_shape=cached_key.get_value().shape if has_cache else None,
                                      resize=_RESIZE, **options)
        cache = {d.name: vars(self)[d.name].get_value() for d in plan.cache} if has_cache else None
        result = attention_core.run(plan, self._params(plan.params), cache, want_maps=True)
        for name, value_ in (result.cache or {}).items():
            vars(self)[name].set_value(value_)
        for name, value_ in result.maps.items():
            self.sow(nnx.Intermediate, name, value_)
        return result.out

    def _params(self, decls: Tuple[ParamDecl, ...]) -> Dict[str, Any]:
        """``{decl.name: value}`` of the parameters a call needs, read from the layer."""
        values = {}
        for decl in decls:
            node = self
            for part in decl.path:
                node = vars(node).get(part)
                if not isinstance(node, (nnx.Variable, _Group)):
                    raise ValueError(
                        f"{type(self).__name__}: this call needs the parameter {decl.name}, which the "
                        "construction did not make (it planned another call); build the layer with "
                        "the arguments that make it.")
            values[decl.name] = _read(node)
        return values

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = jnp.float32) -> None:
        """Sizes (or empties) the KV cache of a ``decode=True`` layer for ``batch_size`` rows of
        up to ``max_length`` tokens of inputs of ``dtype`` (the Linen ``init`` with a full-length
        input): ``cached_key`` [B, S, K, Hqk], ``cached_value`` [B, S, K, H], ``cache_index``
        (and 'fox''s ``fox_log_forget_sum``), as ``nnx.Cache`` variables. Then each call appends
        its tokens at the cache index and attends causally over the cache, as the Linen layer."""
        if not self.spec.decode:
            raise ValueError(f"{type(self).__name__}.init_cache needs a layer built with decode=True.")
        query = jax.ShapeDtypeStruct((batch_size, max_length, self.in_features), dtype)
        plan = attention_core.prepare(self.spec, self.encoding, query, is_causal=True)
        # The full-length forward, traced only, as Linen's init runs it: what only the call checks
        # (a bias table shorter than max_length, say) is refused before the cache changes.
        forward = lambda x, p: attention_core.run(
            attention_core.prepare(self.spec, self.encoding, x, is_causal=True), p).out
        jax.eval_shape(forward, query, self._params(plan.params))
        caches = {d.name: nnx.Cache(d.init(*d.args)) for d in plan.cache}
        for name, cache in caches.items():  # all made first: a failure leaves the old cache whole
            setattr(self, name, cache)

    def linen_fields(self) -> dict:
        """``{field: value}`` of the equivalent Linen module."""
        return {n: self._encoding_field if n == "encoding" else getattr(self, self._RENAMED.get(n, n))
                for n in _linen_fields(self._LINEN)}


# The NNX layer's earlier name (goat_jax.nnx.AttentionShell).
AttentionShell = Attention


def _linen_fields(cls: type) -> dict:
    """``{field: default}`` of a Linen layer's dataclass fields (``num_heads`` has none)."""
    return {f.name: (None if f.default is dataclasses.MISSING else f.default)
            for f in dataclasses.fields(cls) if f.name not in ("parent", "name")}


class GoatAttention(Attention):
    """GOAT attention as a Flax NNX module: :class:`goat_jax.layers.goat.GoatAttention`'s math,
    fields, call and parameters (module docstring). ``prior`` is the keyword of the
    :class:`goat_jax.prior.PriorSettings` (kept as ``prior_settings``), since ``prior`` is the
    parameter group, as in Linen: ``layer.prior.lambda_sym``."""

    _LINEN = goat_layer.GoatAttention
    _RENAMED = {"prior": "prior_settings"}

    def _first_call(self):
        if self.pos_encoding == "2d":
            return {"length": 1 + int(self.has_cls_token_default), "spatial_shape": (1, 1)}
        return {"length": 3}  # not a square grid, with or without CLS: 'auto' stays 1D


class PositionalAttention(Attention):
    """A baseline position encoding as a Flax NNX module: :class:`goat_jax.layers.positional.PositionalAttention`'s
    math, fields (``position_encoding``, ``settings`` or the settings' keywords, ...), call and
    parameters (module docstring)."""

    _LINEN = positional_layer.PositionalAttention

    def _first_call(self):
        if positional_layer.get_encoding(self.position_encoding).positions == "2d":
            return {"length": 1, "spatial_shape": (1, 1)}
        return {"length": 1}


_BY_LINEN = {GoatAttention._LINEN: GoatAttention, PositionalAttention._LINEN: PositionalAttention}


def _flat(tree: Any) -> dict:
    return {tuple(str(getattr(k, "key", k)) for k in path): v
            for path, v in jax.tree_util.tree_leaves_with_path(tree)}


def load_linen_params(layer: Attention, params: Any) -> Attention:
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
               rngs: Optional[nnx.Rngs] = None) -> Attention:
    """A new NNX layer with the Linen ``module``'s fields (fresh weights from ``rngs``)."""
    cls = _BY_LINEN.get(type(module))
    if cls is None:
        raise TypeError(f"goat_jax.nnx takes a goat_jax GoatAttention or PositionalAttention, got "
                        f"{type(module).__name__} (wrap other Linen modules with flax.nnx.bridge.ToNNX).")
    fields = {n: getattr(module, n) for n in _linen_fields(type(module))}
    return cls(fields.pop("num_heads"), in_features=in_features, kv_features=kv_features,
               rngs=rngs or nnx.Rngs(0), **fields)


def from_linen(module: nn.Module, variables: Any, *, rngs: Optional[nnx.Rngs] = None) -> Attention:
    """The NNX layer equal to the Linen ``module`` with ``variables`` (``{'params': ...}`` or the
    params tree): same fields, same parameter values."""
    params = meta.unbox(variables.get("params", variables))
    layer = like_linen(module, params["q_proj"]["kernel"].shape[0], kv_features=params["k_proj"]["kernel"].shape[0],
                       rngs=rngs)
    return load_linen_params(layer, params)


def to_linen(layer: Attention) -> Tuple[nn.Module, dict]:
    """``(Linen module, {'params': ...})`` equal to the NNX ``layer``."""
    return layer._LINEN(**layer.linen_fields()), {"params": nnx.state(layer, nnx.Param).to_pure_dict()}
