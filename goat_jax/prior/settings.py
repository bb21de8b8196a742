"""The GOAT prior's hyper-parameters: :class:`PriorSettings` (declared once, taken by layers and
models) and :class:`PriorSpec` (the settings plus a layer's head counts, what the pure functions
of :mod:`goat_jax.prior` read). No JAX in this file.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple

from goat_jax.config.fields import Bool, Float, Int, Str, check_instance, declare

# How the sink MLP's output is defined past the training window (PriorSettings.sink_extrapolation).
SINK_EXTRAPOLATIONS = ("official", "linear")
# The prior's initial state (PriorSettings.prior_init) and query-side gate (PriorSettings.prior_gate).
PRIOR_INITS = ("seeded", "uniform")
PRIOR_GATES = ("none", "query_norm")
# Where the sink's extra channels come from (PriorSettings.qk_layout; docs/layer.md, Packed width).
QK_LAYOUTS = ("official", "lane_aligned")
# The sink channels 'lane_aligned' carves from every head, whatever the compute dtype: the most
# any supported dtype needs (bfloat16's 3), so the content width, and with it the function and
# its 1/sqrt(d_c) scale, is the same in float32, float16 and bfloat16 (the channels bfloat16 does
# not need are exactly 0 in float32: goat_jax.prior.packing.packed_sink_channels).
LANE_ALIGNED_SINK_CHANNELS = 3


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
        :func:`goat_jax.prior.sink_term.sink_mlp_values`). 'linear' needs ``training_seq_len`` and 1D positions.
      learn_frequencies: the relative prior's frequencies ``w_r`` become a parameter
        ``pos_freqs`` [K, R] (per KV head, like the amplitudes), initialised to the fixed
        geometric ladder; in 2D mode the row and column frequencies are both in it. False
        (default): the fixed ladder, no extra parameter, the official module exactly. The sink
        MLP's absolute frequencies stay fixed (an MLP of them is already learned).
      qk_layout: 'official' (default): the prior takes ``2R + 1`` of the head dims, as the
        official package, and the sink's extra exact-split channels (2 more in bfloat16, 1 in
        float16) widen q/k past the head dim: 130 for a 128 head in bf16, which TPU's 128-lane
        tiles pad to 256 (benchmarks/packed_head_dim.md). 'lane_aligned': the sink takes
        :data:`LANE_ALIGNED_SINK_CHANNELS` (3, what bfloat16 needs) channels carved from the
        content dims in *every* dtype (``d_c = head_dim - 2R - 3``; the two bfloat16 does not
        need are exactly 0 in float32), so q/k stay exactly ``head_dim`` wide and a checkpoint is
        one function in float32, float16 and bfloat16; the same parameters, two fewer content
        dims than 'official', not the official function (use 'official' to load or compare
        with official weights). Identical to 'official' without the sink.
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
    learn_frequencies: bool = declare(False, Bool(doc="learn the relative Fourier frequencies (per KV "
                                                      "head, initialised to the ladder); not in the official package"))
    qk_layout: str = declare("official", Str(choices=QK_LAYOUTS, doc="'lane_aligned': the sink's extra bf16 "
                                             "channels carved from the content dims, q/k exactly head_dim wide"))

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
    """Everything the pure functions of :mod:`goat_jax.prior` need: :class:`PriorSettings` plus the head counts.

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
        """Query heads per KV head (1 for multi-head attention, more for GQA)."""
        return self.num_heads // self.kv_num_heads

    def content_dim(self, head_dim: int, sink_channels: Optional[int] = None) -> int:
        """Content dims: ``head_dim - prior_dim``, or with ``qk_layout='lane_aligned'`` and the
        sink ``head_dim - 2R - sink_channels`` (every packed channel carved from the head), where
        ``sink_channels`` None is the layout's own :data:`LANE_ALIGNED_SINK_CHANNELS` in every
        dtype (a layer passes :func:`goat_jax.prior.packing.packed_sink_channels`); raises if
        the head is too small."""
        if sink_channels is None:
            sink_channels = LANE_ALIGNED_SINK_CHANNELS
        taken = self.prior_dim
        if self.qk_layout == "lane_aligned" and self.enable_key_bias:
            taken = 2 * self.pos_rank + max(1, sink_channels)
        d_c = head_dim - taken
        if d_c < 1:
            sink = ""
            if self.enable_key_bias:
                sink = (f" + {max(1, sink_channels)} (key bias, lane-aligned)" if taken != self.prior_dim
                        else " + 1 (key bias)")
            raise ValueError(
                f"head_dim={head_dim} is too small for the prior: it needs 2*pos_rank"
                f"{sink} = {taken} dims and "
                "at least one content dim. Increase the head dim (embed_dim / num_heads) or "
                "reduce pos_rank."
            )
        return d_c
