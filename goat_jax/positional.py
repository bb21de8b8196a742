"""Positional-encoding baselines behind GoatAttention's interface, for fair comparisons.

Relative encodings act inside attention, in :class:`PositionalAttention` (same call signature,
projection names and cache collection as :class:`goat_jax.attention.GoatAttention`, so models
swap the two freely), chosen by ``position_encoding``:

=================  =============================================================================
'nope'             no positional information in attention (Kazemnejad et al. 2023)
'rope'             rotary embeddings (Su et al. 2021), rotate-half layout
'rope_pi'          RoPE with position interpolation (Chen et al. 2023): positions times
                   ``training_seq_len / key_length`` once the keys outgrow the training length
'alibi'            ALiBi (Press et al. 2022) as a materialized [N, T, S] additive bias: the
                   textbook form; XLA / dense kernels only
'alibi_packed'     the same ALiBi logits packed into q/k channels exactly like GOAT's causal
                   recency slope, so it runs on flash kernels; causal only
'naive_prior'      a learned dense per-head [N, max_len, max_len] log-prior: the L x L prior that
                   GOAT's packing avoids (its memory is the point of the comparison)
'rope2d'           axial 2D RoPE for patch grids (Heo et al. 2024, "RoPE-Axial"): half of each
                   head rotated by the row, half by the column; needs ``spatial_shape``
=================  =============================================================================

Absolute encodings are added to the token embeddings before the first layer, not inside
attention: :func:`sinusoidal_embedding` (Vaswani et al. 2017), :func:`sincos_2d_embedding`
(big_vision's ViT default) and :class:`LearnedPositionEmbedding`. A model using them runs its attention with
``position_encoding='nope'``.

Shape legend: B batch, T queries, S keys, E model dim, N query heads, K kv heads, G = N // K,
H head dim, c split channels (``goat_jax.attention.default_sink_channels``).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from goat_jax import kernels
from goat_jax import layers
from goat_jax import prior as prior_lib
from goat_jax.attention import Offset, default_sink_channels, split_exact

Array = jax.Array
Dtype = Any

POSITION_ENCODINGS = ("nope", "rope", "rope_pi", "alibi", "alibi_packed", "naive_prior", "rope2d")
_2D_ENCODINGS = ("nope", "rope2d")  # accept a spatial_shape
_BIAS_ENCODINGS = ("alibi", "naive_prior")  # materialize a [.., N, T, S] bias


# ----------------------------------------------------------------------------------------------
# Pure functions
# ----------------------------------------------------------------------------------------------


def rope_frequencies(dim: int, base: float = 10_000.0) -> Array:
    """RoPE inverse frequencies ``theta_i = base ** (-2 i / dim)``, i = 0..dim/2-1; [dim/2] f32."""
    if dim < 2 or dim % 2:
        raise ValueError(f"RoPE needs an even head dim >= 2, got {dim}.")
    # float64 on the host, so the lowest frequencies are correctly rounded once.
    return jnp.asarray(base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim), jnp.float32)


def apply_rope(x: Array, positions: Array, base: float = 10_000.0, scale: float = 1.0) -> Array:
    """Rotates ``x`` by its positions (rotate-half layout, as GPT-NeoX / Llama).

    Dim ``i < H/2`` is paired with dim ``i + H/2`` and the pair is rotated by the angle
    ``(p / scale) * theta_i`` (:func:`rope_frequencies`). Then ``apply_rope(q, p_i) .
    apply_rope(k, p_j)`` depends on the positions only through ``p_i - p_j``. ``scale > 1`` is
    position interpolation (positions divided by ``scale``).

    Args:
      x: [B, T, N, H].
      positions: [T] or [B, T] (integer or float) positions.
    Returns:
      [B, T, N, H] in ``x``'s dtype; the rotation is computed in float32 (angles reach
      ``p * theta_0 = p`` radians, too coarse in bfloat16).
    """
    h = x.shape[-1]
    angle = (jnp.asarray(positions, jnp.float32) / scale)[..., None] * rope_frequencies(h, base)
    cos = jnp.cos(angle)[..., None, :]  # [(B,) T, 1, H/2]
    sin = jnp.sin(angle)[..., None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : h // 2], xf[..., h // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def apply_rope_2d(x: Array, coords: Array, base: float = 100.0) -> Array:
    """Axial 2D RoPE (Heo et al. 2024, "Rotary Position Embedding for Vision Transformer").

    The first half of each head is rotated by the row, the second half by the column, each half
    with :func:`apply_rope` (rotate-half layout, frequencies ``base ** (-4 i / H)``, i <
    H/4). Then ``q . k`` depends on the positions only through the row and column differences.
    A CLS token at coordinates (0, 0) is not rotated (the angle is 0), as in Heo et al.

    Args:
      x: [B, L, N, H] with H divisible by 4.
      coords: [L, 2] (row, col) positions (``prior.positions_2d(...).coords``).
      base: frequency base; Heo et al. use 100 for 14x14 grids.
    Returns:
      [B, L, N, H] in ``x``'s dtype (the rotation is computed in float32).
    """
    h = x.shape[-1]
    if h % 4:
        raise ValueError(f"position_encoding='rope2d' needs a head dim divisible by 4 (two axes of "
                         f"rotated pairs), got {h}.")
    return jnp.concatenate([apply_rope(x[..., : h // 2], coords[..., 0], base),
                            apply_rope(x[..., h // 2:], coords[..., 1], base)], axis=-1)


def _as_batched(positions: Array) -> Array:
    """[L] -> [1, L]; [B, L] unchanged; float32 (integer positions are exact up to 2**24)."""
    p = jnp.asarray(positions, jnp.float32)
    return p[None] if p.ndim == 1 else p


def alibi_bias(num_heads: int, q_positions: Array, k_positions: Array) -> Array:
    """ALiBi bias ``-m_h |p_i - p_j|`` with the ALiBi slopes ``m_h`` (``prior.alibi_slopes``).

    Under a causal mask this is the paper's ``-m_h (p_i - p_j)``; the absolute value is the usual
    bidirectional extension.

    Args:
      q_positions: [T] or [B, T]; k_positions: [S] or [B, S].
    Returns:
      [1 or B, N, T, S] float32.
    """
    slopes = jnp.asarray(prior_lib.alibi_slopes(num_heads), jnp.float32)
    dist = jnp.abs(_as_batched(q_positions)[:, :, None] - _as_batched(k_positions)[:, None, :])
    return -slopes[:, None, None] * dist[:, None]  # [B|1, N, T, S]


def pack_alibi_query(q: Array, group_size: int, channels: int, dtype: Dtype,
                     scale: Optional[float] = None) -> Array:
    """Queries for packed causal ALiBi: ``[q * scale, onehot_g x c]`` (``scale`` default
    ``1 / sqrt(H)``).

    Query head ``n`` (group member ``g = n % G`` of KV head ``n // G``) carries ones in the
    ``c`` channels of its own slope block ``g`` and zeros in the other ``G - 1`` blocks, so each
    query head picks its own slope from a key shared by its GQA group.

    Args:
      q: [B, T, N, H] raw queries.
    Returns:
      [B, T, N, H + G c] in ``dtype`` (use with attention scale 1).
    """
    b, t, n, h = q.shape
    # The scale is folded in float32 before the cast, as in attention.pack_query.
    q32 = q.astype(jnp.float32)
    scaled = (q32 / math.sqrt(h) if scale is None else q32 * scale).astype(dtype)
    onehot = jnp.repeat(jnp.eye(group_size, dtype=dtype), channels, axis=-1)  # [G, G c]
    select = jnp.tile(onehot, (n // group_size, 1))  # [N, G c]; row n -> block n % G
    return jnp.concatenate([scaled, jnp.broadcast_to(select, (b, t, n, select.shape[-1]))], axis=-1)


def pack_alibi_key(k: Array, k_positions: Array, num_heads: int, channels: int, dtype: Dtype) -> Array:
    """Keys for packed causal ALiBi: ``[k, split(m_g p_j) for g in group]``.

    ``q~ . k~ = q . k / sqrt(H) + m_n p_j``, which is ALiBi's ``-m_n (p_i - p_j)`` up to the
    row constant ``m_n p_i`` that softmax ignores: valid under a causal mask with positions
    increasing along the sequence. ``m p_j`` grows with position, so it is split exactly into
    ``c`` parts of ``dtype`` (``attention.split_exact``, as GOAT's sink): bf16 inputs multiply
    exactly and accumulate in float32, so the slope reaches the logits at float32 accuracy.

    Args:
      k: [B, S, K, H]; k_positions: [S] or [B, S].
    Returns:
      [B, S, K, H + G c] in ``dtype``.
    """
    b, s, kh, h = k.shape
    g = num_heads // kh
    slopes = jnp.asarray(prior_lib.alibi_slopes(num_heads), jnp.float32).reshape(kh, g)  # [K, G]
    u = _as_batched(k_positions)[:, :, None, None] * slopes  # [B|1, S, K, G]
    parts = split_exact(u, channels, dtype).reshape(u.shape[:3] + (g * channels,))  # [B|1, S, K, G c]
    return jnp.concatenate([k.astype(dtype), jnp.broadcast_to(parts, (b, s, kh, g * channels))], axis=-1)


def naive_prior_bias(table: Array, q_positions: Array, k_positions: Array) -> Array:
    """Gathers the learned dense log-prior ``table[h, p_i, p_j]``.

    Args:
      table: [N, max_len, max_len]; q_positions: [T] or [B, T]; k_positions: [S] or [B, S]
        (integer-valued).
    Returns:
      [1 or B, N, T, S] float32. Out-of-range positions give NaN (reachable only with traced
      positions, whose range cannot be checked at trace time): loud, never a silent clamp.
    """
    qi = _as_batched(q_positions).astype(jnp.int32)[:, :, None]  # [B|1, T, 1]
    ki = _as_batched(k_positions).astype(jnp.int32)[:, None, :]  # [B|1, 1, S]
    bias = table.astype(jnp.float32).at[:, qi, ki].get(
        mode="fill", fill_value=jnp.nan, wrap_negative_indices=False)  # [N, B|1, T, S]
    return jnp.moveaxis(bias, 0, 1)


def sinusoidal_embedding(positions: Array, dim: int, base: float = 10_000.0) -> Array:
    """Vaswani et al. (2017) absolute encoding: ``PE[p, 2i] = sin(p / base**(2i/dim))``,
    ``PE[p, 2i+1] = cos(p / base**(2i/dim))`` (interleaved, as in the paper).

    Args:
      positions: [...] integer or float positions.
    Returns:
      [..., dim] float32, added to the token embeddings (attention then uses 'nope').
    """
    angle = jnp.asarray(positions, jnp.float32)[..., None] * rope_frequencies(dim, base)  # [..., dim/2]
    return jnp.stack([jnp.sin(angle), jnp.cos(angle)], axis=-1).reshape(angle.shape[:-1] + (dim,))


def sincos_2d_embedding(rows: int, cols: int, width: int, temperature: float = 10_000.0) -> Array:
    """big_vision's fixed 2D sin-cos patch embedding (``posemb_sincos_2d``, its ViT default).

    With ``omega_i = temperature ** (-i / (width/4 - 1))``, i < width/4, the patch at (r, c)
    gets ``[sin(c omega), cos(c omega), sin(r omega), cos(r omega)]`` (that order).

    Returns:
      [rows * cols, width] float32, row-major over the grid; added to the patch embeddings
      (a CLS token gets none, as in big_vision).
    """
    if width % 4 or width < 8:
        raise ValueError(f"sincos_2d_embedding needs a width divisible by 4 and >= 8, got {width}.")
    quarter = width // 4
    omega = 1.0 / temperature ** (np.arange(quarter, dtype=np.float64) / (quarter - 1))  # host f64
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    y = r.reshape(-1)[:, None] * omega  # [L, W/4]
    x = c.reshape(-1)[:, None] * omega
    return jnp.asarray(np.concatenate([np.sin(x), np.cos(x), np.sin(y), np.cos(y)], axis=1), jnp.float32)


def _check_max_len(max_len: int, span: Optional[Tuple[int, int]], what: str) -> None:
    """Raises ValueError naming ``max_len`` unless ``0 <= positions < max_len`` (when known)."""
    if span is not None and (span[0] < 0 or span[1] >= max_len):
        raise ValueError(
            f"{what}: positions span [{span[0]}, {span[1]}], beyond [0, max_len={max_len}). "
            "Increase max_len or use a relative encoding that extrapolates.")


# ----------------------------------------------------------------------------------------------
# Absolute position embeddings (applied to token embeddings)
# ----------------------------------------------------------------------------------------------


class LearnedPositionEmbedding(nn.Module):
    """A learned absolute position table (GPT-2 / BERT style), added to token embeddings.

    ``module(positions)`` with integer ``positions`` [...] (e.g. ``arange(T)``) returns
    [..., features]. Positions >= ``max_len`` raise ValueError when known at trace time and give
    NaN when traced (no silent clamping). Attention then uses ``position_encoding='nope'``.
    """

    max_len: int
    features: int
    dtype: Optional[Dtype] = None
    param_dtype: Dtype = jnp.float32
    embedding_init: Any = nn.initializers.normal(stddev=0.02)

    @nn.compact
    def __call__(self, positions: Array) -> Array:
        _check_max_len(self.max_len, prior_lib.concrete_range(positions), "LearnedPositionEmbedding")
        table = self.param(
            "embedding", layers.with_logical_partitioning(self.embedding_init, (None, "embed")),
            (self.max_len, self.features), self.param_dtype)
        idx = jnp.asarray(positions).astype(jnp.int32)
        out = jnp.asarray(table).at[idx].get(mode="fill", fill_value=jnp.nan, wrap_negative_indices=False)
        return out.astype(self.dtype or self.param_dtype)


# ----------------------------------------------------------------------------------------------
# PositionalAttention
# ----------------------------------------------------------------------------------------------


class PositionalAttention(nn.Module):
    """Multi-head attention with a baseline positional encoding, GoatAttention's interface.

    Call: ``module(query, key=None, value=None, *, is_causal=False, key_padding_mask=None,
    spatial_shape=None, has_cls_token=None, position_offset_q=None, position_offset_k=None,
    q_positions=None, k_positions=None)``; ``query`` [B, T, E], ``key``/``value`` [B, S, E']
    (default ``query``). Returns [B, T, out_features or E]. Conventions as GoatAttention:
    ``key_padding_mask`` [B, S] True = padding; positions ``arange + position_offset_*`` or
    explicit ``q_positions``/``k_positions`` ([T] / [B, T]; they move the encoding only, causal
    masking is by sequence index). Positions are 1D except for 'rope2d', which needs
    ``spatial_shape`` (rows, cols) and ``has_cls_token`` as GoatAttention's 2D mode; 'nope'
    accepts (and ignores) them, the choice for ViTs with absolute embeddings.

    ``decode=True``: KV-cache decoding in the 'cache' collection (``cached_key``,
    ``cached_value``, ``cache_index``), as GoatAttention: ``init`` with a full-length input
    sizes the cache; each ``apply(..., mutable=['cache'])`` appends the new tokens and attends
    causally over the cache. The cache holds keys as the kernel sees them (rotated for RoPE,
    packed for 'alibi_packed'). 'rope_pi' scales by the cache length while decoding, i.e. by
    the length of the full forward it reproduces.

    With ``implementation='dense'`` and ``mutable=['intermediates']``, the layer sows its
    attention probabilities, pre-encoding keys and values
    (:func:`goat_jax.layers.sow_attention_maps`); while decoding, the probabilities of the
    chunk over the cache only.

    ``kernel_init_std``: None draws the projection kernels Xavier-uniform, a float
    ``N(0, kernel_init_std)`` (as :class:`goat_jax.attention.GoatAttention`).
    ``attention_scale``: the factor on ``q . k`` before the softmax; None is ``1 / sqrt(head_dim)``,
    1.0 is the official synthetic script's baselines (queries multiplied by ``sqrt(head_dim)``
    before a default-scaled kernel; docs/protocols.md, Passkey). Biases ('alibi', 'naive_prior')
    are added unscaled either way.

    Variant-specific fields: ``rope_base`` ('rope', 'rope_pi', 'rope2d'); ``training_seq_len`` ('rope_pi', required);
    ``max_len`` ('naive_prior', required: the table is [N, max_len, max_len]).
    """

    num_heads: int
    kv_num_heads: Optional[int] = None
    head_dim: Optional[int] = None
    out_features: Optional[int] = None
    position_encoding: str = "rope"
    rope_base: float = 10_000.0
    training_seq_len: Optional[int] = None
    max_len: Optional[int] = None
    use_bias: bool = True
    dtype: Optional[Dtype] = None
    param_dtype: Dtype = jnp.float32
    implementation: Optional[str] = None
    decode: bool = False
    kernel_init_std: Optional[float] = None
    attention_scale: Optional[float] = None

    def _validate(self) -> None:
        enc = self.position_encoding
        if self.attention_scale is not None and not self.attention_scale > 0:
            raise ValueError(f"attention_scale must be > 0 (or None for 1 / sqrt(head_dim)), got "
                             f"{self.attention_scale}.")
        if enc not in POSITION_ENCODINGS:
            raise ValueError(
                f"Unknown position_encoding={enc!r}; choose one of {POSITION_ENCODINGS} (absolute "
                "'sinusoidal'/'learned' encodings go on the embeddings, with 'nope' here).")
        if enc == "rope_pi" and self.training_seq_len is None:
            raise ValueError("position_encoding='rope_pi' needs training_seq_len (the length the "
                             "positions are interpolated back to).")
        if enc == "naive_prior" and (self.max_len is None or self.max_len < 1):
            raise ValueError("position_encoding='naive_prior' needs max_len >= 1 (the learned "
                             f"prior table is [num_heads, max_len, max_len]); got {self.max_len}.")

    def _implementation(self, dtype: Dtype, qk_dim: int, logits_shape) -> str:
        """Kernel choice; bias-based encodings need a kernel that takes an additive bias."""
        impl = self.implementation
        if self.position_encoding not in _BIAS_ENCODINGS:
            return kernels.resolve_implementation(impl, dtype, qk_dim, logits_shape)
        if impl is None or impl == "auto":
            kernels.log_once(f"goat_jax: position_encoding={self.position_encoding!r} uses "
                             "implementation 'xla' (it needs an additive bias).")
            return "xla"
        if impl in kernels.IMPLEMENTATIONS and impl not in ("xla", "dense"):
            raise ValueError(
                f"position_encoding={self.position_encoding!r} adds a materialized [N, T, S] bias, "
                f"which implementation={impl!r} (a flash kernel) does not take; use 'xla' or "
                "'dense'" + (", or position_encoding='alibi_packed' (causal)."
                             if self.position_encoding == "alibi" else "."))
        return kernels.resolve_implementation(impl, dtype, qk_dim)

    @nn.compact
    def __call__(
        self,
        query: Array,
        key: Optional[Array] = None,
        value: Optional[Array] = None,
        *,
        is_causal: bool = False,
        key_padding_mask: Optional[Array] = None,
        spatial_shape: Optional[Sequence[int]] = None,
        has_cls_token: Optional[bool] = None,
        position_offset_q: Offset = None,
        position_offset_k: Offset = None,
        q_positions: Optional[Array] = None,
        k_positions: Optional[Array] = None,
    ) -> Array:
        self._validate()
        enc = self.position_encoding
        key = query if key is None else key
        value = key if value is None else value
        layers.check_qkv(query, key, value)
        if spatial_shape is not None and enc not in _2D_ENCODINGS:
            raise ValueError(
                f"position_encoding={enc!r} is 1D; for 2D inputs use 'rope2d', GoatAttention, or "
                "'nope' with absolute position embeddings on the patches.")
        if enc == "rope2d":
            if spatial_shape is None:
                raise ValueError("position_encoding='rope2d' needs spatial_shape=(rows, cols) of the patch grid.")
            if self.decode or key is not query:
                raise ValueError("position_encoding='rope2d' supports self-attention over one patch "
                                 "grid only (no cross-attention, no decoding).")
            if any(a is not None for a in (position_offset_q, position_offset_k, q_positions, k_positions)):
                raise ValueError("position_encoding='rope2d' takes positions from spatial_shape; "
                                 "position offsets and explicit positions are not supported.")
        if enc == "alibi_packed" and not is_causal:
            raise ValueError(
                "position_encoding='alibi_packed' needs is_causal=True: it drops ALiBi's row "
                "constant m * p_i, which is exact only when every visible key precedes the query. "
                "Use 'alibi' (materialized bias) for bidirectional attention.")

        embed_dim = query.shape[-1]
        n = self.num_heads
        kv_heads, head_dim = layers.head_dims(n, self.kv_num_heads, self.head_dim, embed_dim)
        dtype = self.dtype or jnp.result_type(query.dtype, self.param_dtype)
        group = n // kv_heads
        channels = default_sink_channels(dtype)
        qk_dim = head_dim + (group * channels if enc == "alibi_packed" else 0)
        impl = self._implementation(dtype, qk_dim, (query.shape[0], n, query.shape[1],
                                                    layers.attended_length(self, self.decode, key.shape[1])))

        proj = lambda x, name, heads, axes: layers.project_heads(
            x, name, heads, head_dim, axes, self.use_bias, dtype, self.param_dtype, self.kernel_init_std)
        q = proj(query, "q_proj", n, ("heads", "kv"))
        k = proj(key, "k_proj", kv_heads, ("kv_heads", "kv"))
        v = proj(value, "v_proj", kv_heads, ("kv_heads", "kv"))
        b, t, s = q.shape[0], q.shape[1], k.shape[1]  # q [B, T, N, H], k/v [B, S, K, H]

        cache = None
        if self.decode:
            cache = layers.open_decode_cache(
                self, query=query, key=key, is_causal=is_causal,
                positions_given=q_positions is not None or position_offset_q is not None,
                key_padding_mask=key_padding_mask, key_shape=(b, s, kv_heads, qk_dim),
                value_shape=(b, s, kv_heads, head_dim), dtype=dtype)
            if cache is not None:
                position_offset_q = position_offset_k = cache.start
        for name, offset in (("position_offset_q", position_offset_q), ("position_offset_k", position_offset_k)):
            if isinstance(offset, (tuple, list)):
                raise ValueError(f"{name} must be an integer (1D positions), got {offset}.")
        q_pos = prior_lib.positions_1d(t, 0 if position_offset_q is None else position_offset_q, q_positions,
                                       name="q_positions").index
        k_pos = prior_lib.positions_1d(s, 0 if position_offset_k is None else position_offset_k, k_positions,
                                       name="k_positions").index
        key_len = s if cache is None else cache.length  # the cache while decoding

        # --- the encoding on q/k (what the cache stores) ----------------------------------------
        content_keys = k  # before the encoding: what a key-norm "sink" statistic reads
        scale = 1.0 / math.sqrt(head_dim) if self.attention_scale is None else self.attention_scale
        if enc in ("rope", "rope_pi"):
            pi = max(1.0, key_len / self.training_seq_len) if enc == "rope_pi" else 1.0
            q = apply_rope(q, q_pos, self.rope_base, pi)
            k = apply_rope(k, k_pos, self.rope_base, pi)
        elif enc == "rope2d":
            has_cls = bool(has_cls_token)  # a CLS token is not rotated (coordinates (0, 0))
            prior_lib.check_grid(t, spatial_shape, has_cls)
            coords = prior_lib.positions_2d(spatial_shape, has_cls).coords  # [L, 2]
            q = apply_rope_2d(q, coords, self.rope_base)
            k = apply_rope_2d(k, coords, self.rope_base)
        elif enc == "alibi_packed":
            q = pack_alibi_query(q, group, channels, dtype, self.attention_scale)  # [B, T, N, H + G c], scale folded in
            k = pack_alibi_key(k, k_pos, n, channels, dtype)  # [B, S, K, H + G c]
            scale = 1.0

        causal_offset, kv_lengths = 0, None
        if cache is not None:
            k, v, causal_offset, kv_lengths, is_causal = layers.append_to_cache(cache, k, v)
            k_pos = jnp.arange(key_len, dtype=jnp.float32)  # the whole cache, from position 0

        # --- materialized biases ---------------------------------------------------------------
        bias = None
        if enc == "alibi":
            bias = alibi_bias(n, q_pos, k_pos)  # [B|1, N, T, S] float32
        elif enc == "naive_prior":
            if cache is None:  # while decoding, the cache length was checked at init
                for what, p, explicit, offset, length in (
                        ("queries", q_pos, q_positions, position_offset_q, t),
                        ("keys", k_pos, k_positions, position_offset_k, s)):
                    if explicit is None and isinstance(offset, (type(None), int, np.integer)):
                        span = (int(offset or 0), int(offset or 0) + length - 1)  # static, even under jit
                    else:
                        span = prior_lib.concrete_range(p)
                    _check_max_len(self.max_len, span, f"naive_prior {what}")
            table = self.param(
                "naive_prior", layers.with_logical_partitioning(nn.initializers.zeros, ("heads", None, None)),
                (n, self.max_len, self.max_len), self.param_dtype)
            bias = naive_prior_bias(jnp.asarray(table), q_pos, k_pos)  # [B|1, N, T, S] float32

        sow = layers.wants_attention_maps(self, impl)
        out = kernels.attend(q, k, v, implementation=impl, scale=scale, is_causal=is_causal,
                             causal_offset=causal_offset, key_padding_mask=key_padding_mask,
                             kv_lengths=kv_lengths, bias=bias, return_probs=sow)  # [B, T, N, H]
        if sow and cache is None:
            out, probs = out
            layers.sow_attention_maps(self, probs, content_keys, v)
        elif sow:
            out, probs = out
            layers.sow_attention_probs(self, probs)
        if cache is not None:
            out = layers.poison_overflow(cache, t, out)
        return layers.project_out(out, self.out_features or embed_dim, self.use_bias, dtype, self.param_dtype,
                                  self.kernel_init_std)
