"""The GOAT log-prior as pure functions (no Flax in this file).

GOAT (arXiv 2601.15380, section 3) replaces the hidden uniform prior of softmax attention by a
learned one. For query position ``p_i`` and key position ``p_j`` of head ``h``::

    log pi_h(i, j) = kappa_h(p_i - p_j) + u_h(j)

* ``kappa_h(d) = sum_r A[h, r] cos(w_r d) + B[h, r] sin(w_r d)``: a truncated Fourier series
  in the position difference (translation-equivariant), ``w_r = pos_base ** (-r / max(R-1, 1))``.
* ``u_h(j) = gain_h * mlp(phi(j)) + bump_h * [t_j == 0] + [causal] softplus(slope_h) * t_j``:
  a key-only "sink" term. ``phi(j)`` are absolute Fourier features of the key position plus
  ``t_j / L_n`` and ``log1p(t_j) / log1p(L_n)``.
* Option ``sink_extrapolation='linear'`` (ours, not in the official package; off by default):
  beyond the training window the sink MLP's output continues along a straight line instead of
  being evaluated on inputs it never saw (:func:`sink_mlp_values`; why: docs/extrapolation.md).

The parametrization (names, shapes, initial values, frequency formula, 2D frequency split)
is exactly that of the official PyTorch package ``goat-attention`` 0.1.1, so parameters map
one to one (see ``goat_jax.interop``).

Shape legend used in docstrings:
  B batch, T query length, S key length, N query heads, K key/value heads, G = N // K,
  R relative rank (``pos_rank``), M absolute rank (``abs_rank``).

Positions are described by :class:`Positions`: 1D integer positions, or a 2D (row, col) grid
with an optional CLS token whose Fourier features are zero (the official convention).

Valid positions are integers in ``[0, MAX_POSITION)`` (:func:`validate_positions`). Negative
positions have no meaning for the sink (``log1p(t)`` is NaN below -1, the official package too
gives NaN), and the float32 phases ``w * p`` lose accuracy linearly in ``p``: measured against a
float64 reference with O(1) prior coefficients (R = M = 8), the row-centred logit error is
6.5e-3 at p ~ 2**16, 1-3e-2 at 2**17, 0.11 at 2**20 and 4.3 at 2**24 (where float32 stops
holding integers; tests/test_layer_edges.py re-measures the bound). ``MAX_POSITION = 2**17``
keeps it at the level of bf16 rounding of the content logits (~1e-2) and covers 64x the
paper's training length.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from goat_jax.config.fields import Bool, Float, Int, Str, check_instance, declare

Array = jax.Array
Params = Mapping[str, Any]

# ALiBi (Press et al. 2022) slopes: the official package seeds the causal recency slopes with them.


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi slopes ``m_i`` for ``num_heads`` heads, shape [num_heads], float64.

    Power of two ``n``: ``m_i = 2 ** (-8 i / n)``, i = 1..n. Otherwise the slopes of the largest
    power of two ``c < n`` followed by every other slope of ``2c`` (the ALiBi paper's recipe).
    """
    if num_heads < 1:
        raise ValueError(f"alibi_slopes: num_heads must be >= 1, got {num_heads}.")

    def power_of_two(n: int) -> list:
        return [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]

    if num_heads & (num_heads - 1) == 0:
        return np.asarray(power_of_two(num_heads))
    c = 2 ** int(math.floor(math.log2(num_heads)))
    return np.asarray(power_of_two(c) + power_of_two(2 * c)[0::2][: num_heads - c])


def inverse_softplus(y: np.ndarray) -> np.ndarray:
    """``x`` with ``softplus(x) = y`` for ``y > 0`` (used to seed raw slope parameters)."""
    y = np.asarray(y, np.float64)
    if np.any(y <= 0):
        raise ValueError("inverse_softplus: all values must be > 0.")
    return np.log(np.expm1(y))


# ----------------------------------------------------------------------------------------------
# Hyper-parameters
# ----------------------------------------------------------------------------------------------

# How the sink MLP's output is defined past the training window (PriorSettings.sink_extrapolation).
SINK_EXTRAPOLATIONS = ("official", "linear")
# The prior's initial state (PriorSettings.prior_init) and query-side gate (PriorSettings.prior_gate).
PRIOR_INITS = ("seeded", "uniform")
PRIOR_GATES = ("none", "query_norm")


@dataclasses.dataclass(frozen=True)
class PriorSettings:
    """The GOAT prior's hyper-parameters, declared once.

    Layers (``GoatAttention(prior=...)``), models (``LMConfig.prior``) and the parameter
    module (:class:`PriorSpec` adds the head counts) all take this one object, so a setting is
    added, documented, defaulted and validated here only: each field's type, range and doc is
    its :func:`goat_jax.config.fields.declare` metadata, and a model config exposing a setting
    flat (``model.pos_rank``) takes it with :func:`goat_jax.config.fields.borrow`.

    Attributes:
      pos_rank: R, number of relative frequencies (0 disables kappa); uses 2R head dims.
      abs_rank: M, number of absolute frequencies fed to the sink MLP.
      pos_base, abs_base: geometric frequency bases.
      enable_key_bias: whether the sink u(j) exists (one extra q/k channel).
      training_seq_len: ``L_n`` normalizing the sink MLP's linear/log position inputs. ``None``
        means "current key length - 1" (the official default); set it for KV-cache decoding and
        length extrapolation, where the key length changes.
      prior_gate: 'none' or 'query_norm' (``g = sigmoid(b_h - softplus(s_h) * ||q_c||)``
        multiplies the query-side prior features).
      prior_init: 'seeded' (lambda_sym ~ N(0, 1e-2), ALiBi recency slopes) or 'uniform' (flat
        prior: zero coefficients, zero MLP output, no recency), as the official package.
      init_scale_prior: std of the sink MLP's initial weights.
      sink_extrapolation: 'official' (the sink MLP is evaluated at every key position, as the
        official package does) or 'linear' (ours: on the keys of a training window, indices
        ``0 .. training_seq_len - 1``, exactly the official sink; beyond, the MLP's output
        continues along its secant over the window's second half, see
        :func:`sink_mlp_values`). 'linear' needs ``training_seq_len`` and 1D positions.
    """

    pos_rank: int = declare(8, Int(min=0, doc="GOAT relative rank R"))
    abs_rank: int = declare(8, Int(min=0, doc="GOAT absolute rank M"))
    pos_base: float = declare(10_000.0, Float(min=1.0, min_inclusive=False, doc="relative frequency base"))
    abs_base: float = declare(10_000.0, Float(min=1.0, min_inclusive=False, doc="absolute frequency base"))
    enable_key_bias: bool = declare(True, Bool(doc="the learned key-only sink u(j)"))
    training_seq_len: Optional[int] = declare(None, Int(min=1, optional=True, doc="training context"))
    prior_gate: str = declare("none", Str(choices=PRIOR_GATES))
    prior_init: str = declare("seeded", Str(choices=PRIOR_INITS))
    init_scale_prior: float = declare(1e-3, Float(min=0.0, doc="std of the sink MLP's initial kernels"))
    sink_extrapolation: str = declare("official", Str(choices=SINK_EXTRAPOLATIONS,
                                                      doc="'linear' needs training_seq_len"))

    def __post_init__(self):
        check_instance(self)
        if self.sink_extrapolation == "linear" and (self.training_seq_len or 0) < 2:
            raise ValueError(
                f"sink_extrapolation='linear' continues the sink beyond the training window, so it "
                f"needs training_seq_len >= 2 (the training context length), got "
                f"training_seq_len={self.training_seq_len}.")

    @classmethod
    def names(cls) -> Tuple[str, ...]:
        """The setting names (what a flat config section may hold)."""
        return tuple(f.name for f in dataclasses.fields(PriorSettings))

    @classmethod
    def from_fields(cls, obj: Any) -> "PriorSettings":
        """The settings named by ``obj``'s attributes (a flat model config such as ``LMConfig``);
        settings ``obj`` does not have keep their defaults."""
        return cls(**{n: getattr(obj, n) for n in cls.names() if hasattr(obj, n)})

    def for_heads(self, num_heads: int, kv_num_heads: int) -> "PriorSpec":
        """The :class:`PriorSpec` of a layer with ``num_heads`` query / ``kv_num_heads`` KV heads."""
        return PriorSpec(num_heads=num_heads, kv_num_heads=kv_num_heads,
                         **{n: getattr(self, n) for n in PriorSettings.names()})


@dataclasses.dataclass(frozen=True, kw_only=True)
class PriorSpec(PriorSettings):
    """Everything the pure functions below need: :class:`PriorSettings` plus the head counts.

    Attributes:
      num_heads: query heads N.
      kv_num_heads: key/value heads K (N % K == 0); the relative coefficients and the sink are
        per KV head and shared across each group of G = N // K query heads, as in the official
        package.
    """

    num_heads: int
    kv_num_heads: int

    def __post_init__(self):
        super().__post_init__()
        if self.num_heads < 1 or self.kv_num_heads < 1:
            raise ValueError(
                f"num_heads ({self.num_heads}) and kv_num_heads ({self.kv_num_heads}) must be >= 1."
            )
        if self.num_heads % self.kv_num_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of kv_num_heads="
                f"{self.kv_num_heads}; GQA/MQA needs each KV head to serve a whole group of "
                "query heads. Choose kv_num_heads among the divisors of num_heads."
            )

    @property
    def prior_dim(self) -> int:
        """Head dims the prior takes from q/k in the official layout: ``2R + [key bias]``."""
        return 2 * self.pos_rank + int(self.enable_key_bias)

    @property
    def group_size(self) -> int:
        return self.num_heads // self.kv_num_heads

    def content_dim(self, head_dim: int) -> int:
        """Content dims ``d_c = head_dim - prior_dim``; raises if the head is too small."""
        d_c = head_dim - self.prior_dim
        if d_c < 1:
            raise ValueError(
                f"head_dim={head_dim} is too small for the prior: it needs 2*pos_rank"
                f"{' + 1 (key bias)' if self.enable_key_bias else ''} = {self.prior_dim} dims and "
                "at least one content dim. Increase the head dim (embed_dim / num_heads) or "
                "reduce pos_rank."
            )
        return d_c


def real_dtype():
    """float32, or float64 when JAX runs with x64 enabled (float64 gradient checks). The prior is
    never computed below float32: positions times frequencies need the mantissa."""
    return jnp.result_type(float)


def frequencies(rank: int, base: float) -> Array:
    """Geometric frequencies ``w_r = base ** (-r / max(rank - 1, 1))``, r = 0..rank-1; [rank] f32.

    Note the ``rank - 1`` denominator (official convention): the lowest frequency is ``1/base``.
    """
    r = np.arange(rank, dtype=np.float64)
    return jnp.asarray(base ** (-r / max(rank - 1, 1)), real_dtype())


# ----------------------------------------------------------------------------------------------
# Positions
# ----------------------------------------------------------------------------------------------


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
        return self.coords.ndim == self.index.ndim + 1


# Positions must lie in [0, MAX_POSITION): see the module docstring for the measurement.
MAX_POSITION = 2 ** 17


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
    span = concrete_range(positions)
    if span is not None:
        if span[0] < 0 or span[1] >= MAX_POSITION:
            raise ValueError(
                f"{name} spans [{span[0]}, {span[1]}], outside [0, MAX_POSITION={MAX_POSITION}). "
                "Positions must be >= 0 (shift them so the first token is 0), and below "
                "MAX_POSITION, where the float32 prior stays accurate (goat_jax/prior.py "
                "module docstring).")
        return jnp.asarray(np.asarray(positions), real_dtype())
    p = jnp.asarray(positions)
    ok = (p >= 0) & (p < MAX_POSITION)
    return jnp.where(ok, p.astype(real_dtype()), jnp.nan)


def positions_1d(length: int, offset: Any = 0, positions: Optional[Array] = None,
                 name: str = "positions") -> Positions:
    """1D positions ``offset + arange(length)``, or explicit integer ``positions`` [L] / [B, L].

    ``offset`` may be a traced integer scalar (KV-cache decoding). Positions are validated by
    :func:`validate_positions` (``name`` is used in its messages): integers in
    ``[0, MAX_POSITION)``.
    """
    if positions is None:
        off = validate_positions(offset, f"the position offset of {name}")
        span = concrete_range(offset)
        if span is not None and span[1] + length > MAX_POSITION:
            raise ValueError(
                f"{name}: offset {span[1]} + {length} tokens reaches past MAX_POSITION="
                f"{MAX_POSITION} (goat_jax/prior.py module docstring).")
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
    spatial_shape: Sequence[int], has_cls: bool, offset: Tuple[int, int] = (0, 0)
) -> Positions:
    """Row-major (row, col) grid positions, CLS (if any) first with zero features.

    Returns Positions with ``index`` = arange(L), ``coords`` [L, 2] = (row + offset_row,
    col + offset_col) (0 for CLS), ``is_cls`` [L].
    """
    h, w = int(spatial_shape[0]), int(spatial_shape[1])
    for axis, (o, size) in enumerate(zip(offset, (h, w))):
        validate_positions(o, f"2D offset[{axis}]")
        if o + size > MAX_POSITION:
            raise ValueError(f"2D offset[{axis}]={o} + {size} reaches past MAX_POSITION={MAX_POSITION}.")
    rows, cols = np.meshgrid(np.arange(h) + offset[0], np.arange(w) + offset[1], indexing="ij")
    coords = np.stack([rows.reshape(-1), cols.reshape(-1)], axis=-1).astype(np.float32)
    is_cls = np.zeros(h * w, bool)
    if has_cls:
        coords = np.concatenate([np.zeros((1, 2), np.float32), coords], axis=0)
        is_cls = np.concatenate([[True], is_cls])
    length = coords.shape[0]
    return Positions(
        index=jnp.arange(length, dtype=real_dtype()),
        coords=jnp.asarray(coords, real_dtype()),
        is_cls=jnp.asarray(is_cls),
    )


# ----------------------------------------------------------------------------------------------
# Fourier features
# ----------------------------------------------------------------------------------------------


def fourier_features(pos: Positions, freqs: Array) -> Array:
    """``[cos(w . p), sin(w . p)]`` of each token, [..., L, 2F] float32 for F frequencies.

    1D: ``p`` is the position. 2D: the first ``F - F // 2`` frequencies go to the row, the
    remaining ``F // 2`` to the column, laid out ``[cos_row, cos_col, sin_row, sin_col]``
    (official order), so the dot product of two tokens' features is a separable sum over axes.
    CLS tokens get zeros.
    """
    f = freqs.shape[0]
    if not pos.is_2d:
        phase = pos.coords[..., None] * freqs  # [..., L, F]
    else:
        f_row = f - f // 2
        phase = jnp.concatenate(
            [pos.coords[..., 0:1] * freqs[:f_row], pos.coords[..., 1:2] * freqs[f_row:]], axis=-1
        )  # [..., L, F]
    feats = jnp.concatenate([jnp.cos(phase), jnp.sin(phase)], axis=-1)
    if pos.is_cls is not None:
        feats = jnp.where(pos.is_cls[..., None], 0.0, feats)
    return feats


def kappa(delta: Array, lam_sym: Array, lam_asym: Array, freqs: Array) -> Array:
    """The relative prior ``kappa(d) = sum_r A_r cos(w_r d) + B_r sin(w_r d)``.

    Args:
      delta: [...] position differences ``p_i - p_j`` (1D).
      lam_sym, lam_asym: [H, R] coefficients A, B.
      freqs: [R].
    Returns:
      [H, ...] float32.
    """
    phase = jnp.asarray(delta, real_dtype())[..., None] * freqs  # [..., R]
    out = jnp.einsum("...r,hr->h...", jnp.cos(phase), lam_sym) + jnp.einsum(
        "...r,hr->h...", jnp.sin(phase), lam_asym
    )
    return out


# ----------------------------------------------------------------------------------------------
# Query-side and key-side features (what gets packed into the extra q/k channels)
# ----------------------------------------------------------------------------------------------


def _per_query_head(x: Array, spec: PriorSpec) -> Array:
    """[K, ...] per-KV-head parameter -> [N, ...], each KV head repeated over its group."""
    return jnp.repeat(x, spec.group_size, axis=0)


def query_gate(spec: PriorSpec, params: Params, q_content: Optional[Array]) -> Optional[Array]:
    """The ``query_norm`` prior gate ``g = sigmoid(b_h - softplus(s_h) * ||q_c||)``.

    Args:
      q_content: [B, T, N, d_c] raw (unscaled) query content dims.
    Returns:
      None when ``prior_gate == 'none'``, else [B, T, N] float32.
    """
    if spec.prior_gate == "none":
        return None
    if q_content is None:
        raise ValueError("prior_gate='query_norm' needs the query content (q_content).")
    norm = jnp.sqrt(jnp.sum(jnp.square(q_content.astype(real_dtype())), axis=-1))
    scale = jax.nn.softplus(params["prior_gate_scale_raw"].astype(real_dtype()))
    return jax.nn.sigmoid(params["prior_gate_bias"].astype(real_dtype()) - scale * norm)


def query_features(
    spec: PriorSpec, params: Params, q_pos: Positions, gate: Optional[Array] = None
) -> Tuple[Array, Array]:
    """Query-side prior channels.

    Returns:
      q_rel: [..., T, N, 2R] = ``[A cos(w p_i) + B sin(w p_i), A sin(w p_i) - B cos(w p_i)]``
        (times the gate, if any), float32.
      q_sink: [..., T, N] coefficient of the sink channel: 1, or the gate. float32.
      The leading dims are those of ``q_pos`` broadcast with the gate's [B, T].
    """
    r = spec.pos_rank
    feats = fourier_features(q_pos, frequencies(r, spec.pos_base))  # [..., T, 2R]
    cos, sin = feats[..., None, :r], feats[..., None, r:]  # [..., T, 1, R]
    a = _per_query_head(params["lambda_sym"], spec).astype(real_dtype()) if r else None
    b = _per_query_head(params["lambda_asym"], spec).astype(real_dtype()) if r else None
    if r:
        q_rel = jnp.concatenate([a * cos + b * sin, a * sin - b * cos], axis=-1)  # [..., T, N, 2R]
    else:
        q_rel = jnp.zeros(feats.shape[:-1] + (spec.num_heads, 0), real_dtype())
    q_sink = jnp.ones(q_rel.shape[:-1], real_dtype())
    if gate is not None:
        q_rel = q_rel * gate[..., None]
        q_sink = q_sink * gate
    return q_rel, q_sink


def sink_mlp_inputs(spec: PriorSpec, k_pos: Positions) -> Array:
    """Inputs of the sink MLP: ``[cos(w_abs p), sin(w_abs p), t / L_n, log1p(t) / log1p(L_n)]``.

    ``t`` is the key's sequence index and ``L_n = training_seq_len`` (or key length - 1).
    Returns [..., S, 2M + 2] float32.
    """
    s = k_pos.index.shape[-1]
    denom = float(spec.training_seq_len if spec.training_seq_len is not None else max(s - 1, 1))
    t = k_pos.index.astype(real_dtype())[..., None]
    extra = jnp.concatenate([t / denom, jnp.log1p(t) / math.log1p(denom)], axis=-1)
    abs_feats = fourier_features(k_pos, frequencies(spec.abs_rank, spec.abs_base))
    abs_feats = jnp.broadcast_to(abs_feats, extra.shape[:-1] + abs_feats.shape[-1:])
    return jnp.concatenate([abs_feats, extra], axis=-1)


def sink_mlp(mlp_params: Params, x: Array) -> Array:
    """The sink MLP ``fc2(silu(fc1(x)))`` in float32; [..., in] -> [...]."""
    def dense(layer, h):
        return h @ mlp_params[layer]["kernel"].astype(real_dtype()) + mlp_params[layer]["bias"].astype(real_dtype())
    return dense("fc2", jax.nn.silu(dense("fc1", x)))[..., 0]


def sink_mlp_values(spec: PriorSpec, mlp_params: Params, k_pos: Positions) -> Array:
    """The sink MLP's output ``m(t)`` at each key, [..., S] float32.

    'official': ``m(t) = mlp(phi(t))`` at every key.

    'linear' (1D positions): with ``e = L_n - 1`` (the last key index of a training window,
    ``L_n = training_seq_len``) and ``h = L_n // 2``::

        m(t) = mlp(phi(t))                                          t <= e
        m(t) = mlp(phi(e)) + (t - e) * (mlp(phi(e)) - mlp(phi(e - h))) / h   t > e

    Why: trained at one length, the MLP learns a ramp in ``t`` that acts as extra recency (the
    causal softmax only sees differences of ``u`` between keys), from inputs (``t / L_n``,
    ``log1p(t)``, slow Fourier features) whose values beyond ``L_n`` it never saw, so past the
    window the ramp stalls or turns over and the heads lose their locality. The secant carries the
    learned ramp on as the ALiBi-like linear term it acts as; a linear ``u`` is exactly
    translation invariant. The second half of the window sets the slope so that a sink shaped
    at the first tokens does not tilt it. Measurements: docs/extrapolation.md.
    """
    if spec.sink_extrapolation == "official":
        return sink_mlp(mlp_params, sink_mlp_inputs(spec, k_pos))
    if k_pos.is_2d:
        raise ValueError("sink_extrapolation='linear' is defined for 1D positions (a sequence "
                         "longer than training_seq_len); use 'official' for 2D grids.")
    end, half = float(spec.training_seq_len - 1), float(spec.training_seq_len // 2)
    t = k_pos.index.astype(real_dtype())
    inside = jnp.minimum(t, end)  # NaN (invalid traced positions) stays NaN
    m_inside = sink_mlp(mlp_params, sink_mlp_inputs(spec, Positions(index=inside, coords=inside)))
    anchors = jnp.asarray([end, end - half], real_dtype())
    m_end, m_mid = sink_mlp(mlp_params, sink_mlp_inputs(spec, Positions(index=anchors, coords=anchors)))
    extended = m_end + (t - end) * ((m_end - m_mid) / half)
    return jnp.where(t > end, extended, m_inside)  # exactly the official m(t) inside the window


def sink(spec: PriorSpec, params: Params, k_pos: Positions, is_causal: bool) -> Array:
    """The key-only log-prior ``u_h(j)``, [..., S, K] float32 (zeros [..., S, 0] if disabled).

    ``u = gain_h * m(t_j) + bump_h * [t_j == 0] + [causal] softplus(slope_h) * t_j`` with
    ``m`` the sink MLP's output (:func:`sink_mlp_values`). The recency slope is only added
    under causal masking, where ``slope * t_j`` equals the ALiBi penalty ``-slope * (t_i - t_j)``
    up to a per-row constant that softmax ignores.
    """
    if not spec.enable_key_bias:
        return jnp.zeros(k_pos.index.shape + (0,), real_dtype())
    m = sink_mlp_values(spec, params["key_bias"], k_pos)[..., None]  # [..., S, 1]
    t = k_pos.index.astype(real_dtype())[..., None]  # [..., S, 1]
    u = params["sink_gain"].astype(real_dtype()) * m + params["sink_bump"].astype(real_dtype()) * (
        t == 0
    ).astype(real_dtype())
    if is_causal:
        u = u + jax.nn.softplus(params["recency_slope_raw"].astype(real_dtype())) * t
    return u


def key_features(spec: PriorSpec, params: Params, k_pos: Positions, is_causal: bool) -> Tuple[Array, Array]:
    """Key-side prior channels: ``k_rel`` [..., S, 2R] (``[cos(w p_j), sin(w p_j)]``) and ``u``
    [..., S, K] (see :func:`sink`), float32."""
    k_rel = fourier_features(k_pos, frequencies(spec.pos_rank, spec.pos_base))
    return k_rel, sink(spec, params, k_pos, is_causal)


# ----------------------------------------------------------------------------------------------
# Dense log-prior (plots, the 'dense' reference implementation, tests)
# ----------------------------------------------------------------------------------------------


def log_prior(
    spec: PriorSpec,
    params: Params,
    q_pos: Positions,
    k_pos: Positions,
    *,
    is_causal: bool,
    gate: Optional[Array] = None,
) -> Array:
    """The materialized log-prior ``kappa_h(p_i - p_j) + u_h(j)`` (gated if a gate is given).

    kappa is evaluated from position *differences* (not through the packed features), so this
    is an independent check of the packing. No causal mask is applied here.

    Args:
      q_pos, k_pos: query and key positions (both 1D or both 2D); leading dims [B] optional.
      gate: None or [B, T, N] from :func:`query_gate`.
    Returns:
      [B or 1, N, T, S] float32.
    """
    r = spec.pos_rank
    freqs = frequencies(r, spec.pos_base)
    a = _per_query_head(params["lambda_sym"], spec).astype(real_dtype()) if r else None
    b = _per_query_head(params["lambda_asym"], spec).astype(real_dtype()) if r else None
    qc, kc = q_pos.coords, k_pos.coords
    if qc.ndim == (2 if q_pos.is_2d else 1):
        qc = qc[None]
    if kc.ndim == (2 if k_pos.is_2d else 1):
        kc = kc[None]
    if r == 0:
        rel = jnp.zeros((1, spec.num_heads, qc.shape[1], kc.shape[1]), real_dtype())
    elif not q_pos.is_2d:
        delta = qc[:, :, None] - kc[:, None, :]  # [B, T, S]
        rel = jnp.moveaxis(kappa(delta, a, b, freqs), 0, 1)  # [B, N, T, S]
    else:
        r_row = r - r // 2
        d_row = qc[:, :, None, 0] - kc[:, None, :, 0]
        d_col = qc[:, :, None, 1] - kc[:, None, :, 1]
        rel = kappa(d_row, a[:, :r_row], b[:, :r_row], freqs[:r_row]) + kappa(
            d_col, a[:, r_row:], b[:, r_row:], freqs[r_row:]
        )
        rel = jnp.moveaxis(rel, 0, 1)  # [B, N, T, S]
        cls_q = q_pos.is_cls if q_pos.is_cls is not None else jnp.zeros(qc.shape[1], bool)
        cls_k = k_pos.is_cls if k_pos.is_cls is not None else jnp.zeros(kc.shape[1], bool)
        keep = ~(cls_q[..., :, None] | cls_k[..., None, :])  # CLS has zero relative features
        rel = jnp.where(keep, rel, 0.0)
    if gate is not None:
        rel = rel * jnp.moveaxis(gate, -1, -2)[..., None]  # gate [B, T, N] -> [B, N, T, 1]
    u = sink(spec, params, k_pos, is_causal)  # [..., S, K]
    if u.shape[-1]:
        u = _per_query_head(jnp.moveaxis(u, -1, 0), spec)  # [N, ..., S]
        u = jnp.moveaxis(u, 0, -2) if u.ndim == 3 else u[None]  # [B or 1, N, S]
        u = u[..., None, :]  # [B, N, 1, S]
        if gate is not None:
            u = u * jnp.moveaxis(gate, -1, -2)[..., None]
        rel = rel + u
    return rel
