"""Where each token sits: :class:`Positions` (1D integer positions, or a 2D (row, col) grid
with an optional CLS token whose Fourier features are zero, the official convention), their
validation, and the dtype the prior is computed in.

Valid positions are integers in ``[0, MAX_POSITION)``, ``MAX_POSITION = 2**24`` (16,777,216;
:func:`validate_positions`). Negative positions have no meaning for the sink (``log1p(t)`` is NaN
below -1, the official package too gives NaN). The upper bound is where float32, which holds the
positions, stops holding every integer, and where :mod:`goat_jax.prior.angles` (two 12-bit
limbs per position) ends. Below it the phases ``w * p`` are exact integer phases, so the prior's
error is float32 round-off at every position: the same at 16M as at 1,000 (before, the float32
product ``w * p`` made it grow linearly, 1-3e-2 logits at 2**17, which was then the bound;
benchmarks/positions.md has both tables, tests/test_positions.py re-measures them).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def real_dtype():
    """float32, or float64 when JAX runs with x64 enabled (float64 gradient checks). The prior is
    never computed below float32: positions times frequencies need the mantissa."""
    return jnp.result_type(float)



class Positions(NamedTuple):
    """Where each token sits.

    Attributes:
      index: [..., L] sequence index of each token (float32). In 1D it is the position itself;
        in 2D it is the token's index in the flattened sequence (CLS = 0), which the official
        package uses for the sink MLP's linear/log inputs, the first-token bump and the causal
        recency slope.
      coords: [..., L] (1D positions) or [..., L, 2] ((row, col)) float32 coordinates entering
        the Fourier features.
      is_cls: None, or [..., L] bool; CLS tokens get zero Fourier features (2D only).
    """

    index: Array
    coords: Array
    is_cls: Optional[Array] = None

    @property
    def is_2d(self) -> bool:
        """Whether the positions are 2D grid coordinates (one (row, column) per token)."""
        return self.coords.ndim == self.index.ndim + 1


# Positions must lie in [0, MAX_POSITION): float32 holds every integer below it, and the exact
# phases of goat_jax.prior.angles take positions of two 12-bit limbs (module docstring).
MAX_POSITION = 2 ** 24


def concrete_range(x: Any) -> Optional[Tuple[int, int]]:
    """``(min(x), max(x))`` as Python ints when ``x`` is known at trace time (not a tracer),
    else None. Empty ``x`` gives None."""
    try:
        arr = np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None
    if arr.size == 0:
        return None
    return int(np.min(arr)), int(np.max(arr))


def widen(positions: Any) -> Any:
    """``positions`` (or an offset) with an integer dtype narrower than 32 bits as int32, anything
    else unchanged. Where positions enter (the layers' call, the LM's ``positions=``, every
    check here), so that no comparison with ``MAX_POSITION = 2**24``, a weak Python int, is made
    in a dtype it wraps in (int8 ``p < 2**24`` is ``p < 0``), and no offset difference wraps."""
    dtype = getattr(positions, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer) or jnp.iinfo(dtype).bits >= 32:
        return positions
    if isinstance(positions, jax.Array):  # concrete or traced
        return positions.astype(jnp.int32)
    if isinstance(positions, np.integer):  # a NumPy scalar stays a static integer
        return np.int32(positions)
    return np.asarray(positions, np.int32)


def validate_positions(positions: Any, name: str) -> Array:
    """Integer positions -> float positions (``real_dtype``), checked to lie in
    ``[0, MAX_POSITION)``.

    The dtype is checked at trace time (float positions raise). Values known at trace time
    (Python ints, NumPy arrays, concrete jax arrays) raise ValueError when out of range.
    Traced values cannot raise inside ``jit``; out-of-range ones become NaN, so the attention
    output is NaN where they are used: loud (the trainer's NaN guard stops), never a silently
    wrong prior, and without ``checkify`` at every call site.

    Args:
      positions: [...] integer positions (a Python int, NumPy or JAX array).
      name: the argument's name, for the error message.
    Returns:
      [...] float positions, NaN where out of range (traced inputs only).
    """
    if isinstance(positions, (bool, np.bool_)) or not (
            isinstance(positions, (int, np.integer))
            or jnp.issubdtype(getattr(positions, "dtype", np.float64), jnp.integer)):
        raise ValueError(
            f"{name} must be integer token positions, got {getattr(positions, 'dtype', type(positions).__name__)}. "
            "Positions index tokens; pass e.g. jnp.arange(T, dtype=jnp.int32) + offset.")
    positions = widen(positions)
    span = concrete_range(positions)
    if span is not None:
        if span[0] < 0 or span[1] >= MAX_POSITION:
            raise ValueError(
                f"{name} spans [{span[0]}, {span[1]}], outside [0, MAX_POSITION={MAX_POSITION}). "
                "Positions must be >= 0 (shift them so the first token is 0), and below "
                "MAX_POSITION = 2**24, the last integer float32 positions hold exactly "
                "(goat_jax/prior/positions.py module docstring): shift or shorten them.")
        return jnp.asarray(np.asarray(positions), real_dtype())
    p = jnp.asarray(positions)
    ok = (p >= 0) & (p < MAX_POSITION)
    return jnp.where(ok, p.astype(real_dtype()), jnp.nan)


def positions_1d(length: int, offset: Any = 0, positions: Optional[Array] = None,
                 name: str = "positions", offset_name: Optional[str] = None,
                 length_name: Optional[str] = None) -> Positions:
    """1D positions ``offset + arange(length)``, or explicit integer ``positions`` [L] / [B, L].

    ``offset`` may be a traced integer scalar (KV-cache decoding). Positions are validated by
    :func:`validate_positions`: integers in ``[0, MAX_POSITION)``. The errors name what the
    caller passed: ``name`` the explicit positions, ``offset_name`` the offset (default "the
    position offset of {name}"), ``length_name`` the length (default ``name``).
    """
    if positions is None:
        off = validate_positions(offset, offset_name or f"the position offset of {name}")
        span = concrete_range(offset)
        if span is not None and span[1] + length > MAX_POSITION:
            what = (f"{offset_name or 'offset'}={span[1]} + {length} tokens" if span[1]
                    else f"{length_name or name}: {length} tokens")
            raise ValueError(
                f"{what} reaches past MAX_POSITION={MAX_POSITION} = 2**24, the last integer float32 "
                "positions hold exactly (goat_jax/prior/positions.py module docstring): lower the offset "
                "or the length.")
        pos = jnp.arange(length, dtype=real_dtype()) + off
        if span is None:  # traced offset: the last position may pass the bound
            pos = jnp.where(pos < MAX_POSITION, pos, jnp.nan)
    else:
        pos = validate_positions(positions, name)
        if pos.shape[-1] != length:
            raise ValueError(
                f"{name} has length {pos.shape[-1]} but the sequence has {length} tokens."
            )
    return Positions(index=pos, coords=pos, is_cls=None)


def check_grid(length: int, spatial_shape: Sequence[int], has_cls: bool, name: str = "spatial_shape"):
    """Raises ValueError unless ``length == H * W + has_cls``."""
    if len(spatial_shape) != 2:
        raise ValueError(f"{name} must be (rows, cols), got {spatial_shape!r}.")
    h, w = int(spatial_shape[0]), int(spatial_shape[1])
    if h < 1 or w < 1 or h * w + int(has_cls) != length:
        raise ValueError(
            f"{name}={tuple(spatial_shape)} with has_cls_token={has_cls} describes "
            f"{h * w + int(has_cls)} tokens but the sequence has {length}. Pass the patch grid "
            "(rows, cols) of this input and set has_cls_token to whether token 0 is a CLS token."
        )


def positions_2d(
    spatial_shape: Sequence[int], has_cls: bool, offset: Tuple[Any, Any] = (0, 0), name: str = "2D offset"
) -> Positions:
    """Row-major (row, col) grid positions, CLS (if any) first with zero features.

    Returns Positions with ``index`` = arange(L), ``coords`` [L, 2] = (row + offset_row,
    col + offset_col) (0 for CLS), ``is_cls`` [L]. The offsets are integers, concrete or traced
    (as 1D offsets may be); like 1D positions, every index and coordinate must stay below
    ``MAX_POSITION``: concrete values past it raise ValueError naming the argument, traced ones
    give NaN coordinates (:func:`validate_positions`). ``name``: the offset's name in errors.
    """
    h, w = int(spatial_shape[0]), int(spatial_shape[1])
    length = h * w + int(bool(has_cls))
    if length > MAX_POSITION:
        raise ValueError(
            f"spatial_shape={(h, w)} with has_cls_token={bool(has_cls)} is {length} tokens, more than "
            f"MAX_POSITION={MAX_POSITION} = 2**24, the last integer float32 sequence indices hold exactly "
            "(goat_jax/prior/positions.py module docstring): use a smaller grid.")
    axes = []
    for axis, (o, size) in enumerate(zip(offset, (h, w))):
        o = widen(o)
        start = validate_positions(o, f"{name}[{axis}]")
        span = concrete_range(o)
        if span is not None and span[1] + size > MAX_POSITION:
            raise ValueError(f"{name}[{axis}]={span[1]} + {size} reaches past MAX_POSITION={MAX_POSITION} "
                             "(= 2**24, goat_jax/prior/positions.py): lower the offset.")
        along = jnp.arange(size, dtype=real_dtype()) + start
        if span is None:  # traced offset: the last row/col may pass the bound
            along = jnp.where(along < MAX_POSITION, along, jnp.nan)
        axes.append(along)
    rows, cols = jnp.meshgrid(axes[0], axes[1], indexing="ij")
    coords = jnp.stack([rows.reshape(-1), cols.reshape(-1)], axis=-1)  # [H * W, 2]
    is_cls = np.zeros(h * w, bool)
    if has_cls:
        coords = jnp.concatenate([jnp.zeros((1, 2), coords.dtype), coords], axis=0)
        is_cls = np.concatenate([[True], is_cls])
    return Positions(
        index=jnp.arange(length, dtype=real_dtype()),
        coords=coords,
        is_cls=jnp.asarray(is_cls),
    )
