"""What a position encoding is to the attention layer: a value the layer holds and calls.

An encoding (GOAT's prior, :class:`goat_jax.layers.goat.GoatEncoding`; every baseline,
:class:`goat_jax.layers.positional.BaselineEncoding`; a plugin written against this module) is
an immutable value with three steps, which :mod:`goat_jax.layers.core` calls in this order, once
per call, and never the other way round (the encoding asks nothing of the layer that holds it):

* :meth:`Encoding.prepare` ``(call, shape, request, decode)``: validates everything about the
  call that the encoding rules on, before any parameter or cache exists; chooses the kernel once
  (``request.choose(qk_dim, bias)``) and returns a :class:`Prepared`: the packed width the kernel
  and the KV cache see, the choice, the encoding's parameters as declarations
  (:class:`ParamDecl`: names, initializers, shapes: data, not calls), its own cache slots
  (:class:`CacheDecl`), and whatever :meth:`Encoding.encode` needs (``detail``).
* :meth:`Encoding.positions` ``(call, prepared, t, s, decoding)``: the query and key positions
  (:class:`goat_jax.prior.Positions`); the default is 1D (:func:`positions_1d`).
* :meth:`Encoding.encode` ``(call, shape, prepared, params, q, k, q_pos, k_pos, cache)``: the
  raw projections q [B, T, N, H], k [B, S, K, H] and the parameter values ``params`` (``{name:
  value}`` of its declarations) to what the kernel takes (:class:`goat_jax.layers.call.Encoded`),
  plus the new values of its own cache slots while decoding.

:meth:`Encoding.declarations` gives the parameter declarations from the layer's sizes alone (no
input), so the NNX layer makes its parameters at construction from them.

Shape legend: B batch, T new tokens, S keys, N query heads, K kv heads, H head dim.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Mapping, NamedTuple, Optional, Tuple

import jax

from goat_jax import prior as prior_lib
from goat_jax.layers.call import AttentionCall, Encoded, KernelRequest, LayerShape

Array = jax.Array


class ParamDecl(NamedTuple):
    """One parameter, declared: ``path`` under the layer (``('fox_gate',)``, ``('prior',
    'lambda_sym')``), ``init(rng, *args)`` (Flax's initializer signature; it may return a value
    boxed with logical axis names) and its ``args`` (``(shape, dtype)``, or ``()`` for an
    initializer that knows its own shapes). The order of a layer's declarations is the order in
    which the parameters are made (and their random numbers drawn)."""

    path: Tuple[str, ...]
    init: Callable[..., Any]
    args: Tuple[Any, ...]

    @property
    def name(self) -> str:
        """The path as one string (``prior/lambda_sym``)."""
        return "/".join(self.path)


class CacheDecl(NamedTuple):
    """One slot of the KV cache collection ('cache'), declared: its name, ``init(*args)`` (no
    random numbers) and ``args``."""

    name: str
    init: Callable[..., Any]
    args: Tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What an encoding's parameter declarations may depend on: the head counts and head dim,
    the key/value input width (E' of ``key``), the parameters' dtype and whether the layer keeps
    a KV cache."""

    num_heads: int
    kv_heads: int
    head_dim: int
    kv_features: int
    param_dtype: Any
    decode: bool = False


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What an encoding decided about one call before any work (:meth:`Encoding.prepare`).

    Attributes:
      qk_dim: the key width the kernel and the KV cache see (H plus any packed channels).
      choice: the :class:`goat_jax.kernels.Choice` (the kernel that runs the call).
      params: the encoding's parameter declarations, in creation order.
      cache: the encoding's own cache slots (besides the keys, values and index every decoding
        layer keeps), made only when the layer decodes.
      detail: the encoding's own decisions, read back by its :meth:`Encoding.positions` and
        :meth:`Encoding.encode`.
    """

    qk_dim: int
    choice: Any
    params: Tuple[ParamDecl, ...] = ()
    cache: Tuple[CacheDecl, ...] = ()
    detail: Any = None

    @property
    def implementation(self) -> str:
        """The chosen kernel's name."""
        return self.choice.implementation


class Encoding:
    """The interface of a position encoding the attention layer holds (module docstring). Every
    encoding is an immutable value (a frozen dataclass); subclasses override :meth:`prepare`,
    :meth:`encode` and :meth:`declarations`, and :meth:`positions` for positions other than 1D.

    Attributes:
      training_len: the training context length log-n scaling divides by (None: not known).
    """

    training_len: Optional[int] = None

    def declarations(self, sizes: Sizes) -> Tuple[ParamDecl, ...]:
        """The encoding's parameters for a layer of ``sizes`` (:class:`Sizes`), in creation order
        (those :meth:`prepare` also returns)."""
        return ()

    def prepare(self, call: AttentionCall, shape: LayerShape, request: KernelRequest,
                sizes: Sizes) -> Prepared:
        """Validates the call and chooses the kernel once; returns a :class:`Prepared`."""
        raise NotImplementedError(f"{type(self).__name__} must define prepare (goat_jax.layers.encoding).")

    def positions(self, call: AttentionCall, prepared: Prepared, t: int, s: int, decoding: bool):
        """``(q_pos, k_pos)`` :class:`goat_jax.prior.Positions` of the T queries and S keys."""
        return positions_1d(call, t, s, decoding)

    def encode(self, call: AttentionCall, shape: LayerShape, prepared: Prepared, params: Mapping[str, Any],
               q: Array, k: Array, q_pos: Any, k_pos: Any,
               cache: Optional[Mapping[str, Any]]) -> Tuple[Encoded, Dict[str, Any]]:
        """``(Encoded, cache updates)`` from q [B, T, N, H], k [B, S, K, H]; ``params``: ``{name:
        value}`` of :attr:`Prepared.params` (by :attr:`ParamDecl.name`); ``cache``: None unless
        decoding, else every cache slot's value before this call (``cache_length`` the capacity);
        the updates are the new values of the encoding's own slots (``{}`` for most)."""
        raise NotImplementedError(f"{type(self).__name__} must define encode (goat_jax.layers.encoding).")


def positions_1d(call: AttentionCall, t: int, s: int, decoding: bool):
    """1D :class:`goat_jax.prior.Positions` ``(q_pos, k_pos)`` of the T queries and S keys: the
    explicit positions, else ``arange + offset``. Errors name what the caller passed: the
    explicit positions, the offset, or, while decoding, the KV cache (its index is the offset;
    its length is the length init / ``init_cache`` sized it for)."""
    out = []
    for name, length, offset, explicit in (("q", t, call.position_offset_q, call.q_positions),
                                           ("k", s, call.position_offset_k, call.k_positions)):
        if isinstance(offset, (tuple, list)):
            raise ValueError(f"position_offset_{name} must be an integer (1D positions), got {offset}.")
        if decoding:
            offset_name, length_name = "the KV cache index", (
                "the KV cache length (init's input length, or init_cache's max_length)")
        else:
            offset_name = f"position_offset_{name}"
            length_name = f"the {'query' if name == 'q' else 'key'} length"
        out.append(prior_lib.positions_1d(length, 0 if offset is None else offset, explicit,
                                          name=f"{name}_positions", offset_name=offset_name,
                                          length_name=length_name))
    return tuple(out)
