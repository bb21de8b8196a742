"""A Llama-style decoder-only language model whose attention is GOAT or a positional baseline.

Architecture (Llama / MaxText): token embedding -> ``num_layers`` x [RMSNorm -> causal
attention (GQA) -> residual, RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> logits (tied or
untied output embedding). ``block='gpt2'`` swaps in the GPT-2 block of the official GOAT C4 and
genome recipes: LayerNorm instead of RMSNorm and a GELU(tanh) MLP ``wo(gelu(x wi + b) ) + b``
(set ``use_bias=True`` and ``norm_eps=1e-5`` for GPT-2 itself). Only the attention module (and, for 'sinusoidal' / 'learned', an
absolute embedding added to the token embeddings) changes with ``position_encoding``;
everything else -- widths, norms, MLP, initialization -- is identical, so comparisons between
encodings are fair (``baseline_attention_scale``, the official synthetic script's logit scale for
the baselines, is the one field that applies to the baselines only).

Sharding: every parameter carries logical axis names (``nn.with_logical_partitioning``) and the
residual stream, MLP hidden and logits carry ``nn.with_logical_constraint`` names; a trainer
maps them to mesh axes with ~10 lines of rules. Names used: 'batch', 'length', 'embed', 'mlp',
'heads', 'kv_heads', 'kv', 'vocab', and 'layers' (the stacked axis under ``scan_layers``).

Shape legend: B batch, T length, E embed_dim, F mlp_dim, V vocab_size, L num_layers,
N query heads, K kv heads, H head dim.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from goat_jax import positional
from goat_jax.prior import segments
from goat_jax.layers.goat import GoatAttention
from goat_jax.kernels.plan import DEFAULT, AttentionPlan, plan_fields_hint
from goat_jax.config.fields import Bool, Dtype, Float, Int, Str, borrow, check_instance, declare, specs_of
from goat_jax.layers.call import LOGN_MODES, check_logn
from goat_jax.positional import fire, fox, naive_prior, rope, rope_scaling
from goat_jax.layers import positional as positional_layer
from goat_jax.positional import registry
from goat_jax.prior import PriorSettings, validate_positions, widen
from goat_jax import losses

Array = jax.Array

# Encodings that add an absolute embedding to the token embeddings and use position-free attention.
ABSOLUTE_ENCODINGS = ("sinusoidal", "learned")
# Every 1D encoding of the positional package (read from its registry, so a new encoding there is
# offered here, with its settings as config fields, without a second list).
BASELINES = tuple(e for e in positional.ENCODINGS if e.positions != "2d")
# 'goat', the baselines and the absolute embeddings.
POSITION_ENCODINGS = ("goat",) + tuple(e.name for e in BASELINES) + ABSOLUTE_ENCODINGS
BLOCKS = ("llama", "gpt2")
# Encodings with a position table of size max_len: longer sequences cannot be represented.
TABLE_ENCODINGS = ("learned", "naive_prior")
DTYPES = ("float32", "bfloat16", "float16")
# What ``remat=True`` keeps from the forward pass of each block (the rest is recomputed in the
# backward): 'full' nothing (the least memory), 'dots' every matmul output, 'dots_no_batch' the
# matmuls without a batch dimension (the projections' outputs; not attention's T x S products):
# ``jax.checkpoint_policies``' nothing_saveable / dots_saveable / dots_with_no_batch_dims_saveable.
REMAT_POLICIES = ("full", "dots", "dots_no_batch")


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """Hyper-parameters of :class:`TransformerLM`: the fields of a config's ``model`` section
    (build from ml_collections with :meth:`from_config`). Dtypes may be given as strings
    ('bfloat16') or dtypes.

    Each field is declared once: default, type, range and doc (its
    :func:`goat_jax.config.fields.declare` metadata, from which :data:`FIELD_SPECS` is derived).
    The GOAT fields keep their config names (``pos_rank``, ...) but are declared by
    :class:`goat_jax.prior.PriorSettings` and borrowed; the model passes the one object
    :attr:`prior`. Likewise the baselines' settings (``rope_base``, ``yarn_beta_fast``, ...) are
    declared by their encodings (``goat_jax.positional.rope.RopeSettings``, ...) and borrowed
    under the same names, and the model passes the one object :attr:`encoding_settings`; a
    registered encoding's setting that is not borrowed here is added as a field of its own name
    (:func:`goat_jax.positional.registry.add_settings_fields`). Cross-field rules are in
    ``__post_init__``; the encodings' own rules are their settings' (checked by building
    :attr:`encoding_settings`).
    """

    vocab_size: int = declare(259, Int(min=1, doc="tokens in the vocabulary (byte tokenizer: 256 bytes + 3 specials)"))
    vocab_pad_multiple: int = declare(1, Int(min=1, doc="embedding / output table rows rounded up to a multiple of "
                                                       "this (128: aligned matmuls on GPUs); the padded logits never "
                                                       "leave the model or enter the loss; 1: no padding"))
    num_layers: int = declare(2, Int(min=1, doc="decoder blocks"))
    embed_dim: int = declare(64, Int(min=1, doc="residual stream width E"))
    num_heads: int = declare(4, Int(min=1, doc="query heads N"))
    kv_num_heads: Optional[int] = declare(None, Int(min=1, optional=True, doc="key/value heads K (GQA/MQA); None: num_heads"))
    head_dim: Optional[int] = declare(None, Int(min=1, optional=True, doc="per-head dim H; None: embed_dim // num_heads"))
    mlp_dim: int = declare(256, Int(min=1, doc="MLP hidden width F (SwiGLU for 'llama', GELU for 'gpt2')"))
    block: str = declare("llama", Str(choices=BLOCKS, doc="'llama' (RMSNorm, SwiGLU) or 'gpt2' (LayerNorm, GELU(tanh) MLP)"))
    position_encoding: str = declare("goat", Str(choices=POSITION_ENCODINGS))
    tie_embeddings: bool = declare(True, Bool(doc="output projection = token embedding transposed (Llama 3.2 1B)"))
    # The table size of 'naive_prior' (declared there), and of the 'learned' embedding.
    max_len: int = borrow(naive_prior.NaivePriorSettings, "max_len", default=2048)
    # Shared by GOAT's sink normalization, RoPE-PI's scale, 'ntk' / 'yarn' and log-n scaling.
    training_seq_len: Optional[int] = borrow(PriorSettings, "training_seq_len")
    rope_base: float = borrow(rope.RopeSettings, "rope_base")  # 'rope', 'rope_pi', 'ntk', 'yarn'
    # 'ntk' / 'yarn' (goat_jax/positional/rope_scaling.py) and log-n scaling (any 1D encoding).
    rope_scaling_factor: Optional[float] = borrow(rope_scaling.NtkSettings, "rope_scaling_factor")
    yarn_beta_fast: float = borrow(rope_scaling.YarnSettings, "yarn_beta_fast")
    yarn_beta_slow: float = borrow(rope_scaling.YarnSettings, "yarn_beta_slow")
    logn_scaling: Optional[str] = declare(None, Str(choices=LOGN_MODES, optional=True,
                                                    doc="logits x max(1, ln n / ln training_seq_len): 'content' or 'all' (prior too)"))
    fox_gate_bias_init: float = borrow(fox.FoxSettings, "fox_gate_bias_init")
    fire_threshold_init: float = borrow(fire.FireSettings, "fire_threshold_init")
    pos_rank: int = borrow(PriorSettings, "pos_rank")
    abs_rank: int = borrow(PriorSettings, "abs_rank")
    prior_init: str = borrow(PriorSettings, "prior_init")
    prior_gate: str = borrow(PriorSettings, "prior_gate")
    enable_key_bias: bool = borrow(PriorSettings, "enable_key_bias")
    init_scale_prior: float = borrow(PriorSettings, "init_scale_prior")
    sink_extrapolation: str = borrow(PriorSettings, "sink_extrapolation")  # docs/extrapolation.md
    learn_frequencies: bool = borrow(PriorSettings, "learn_frequencies")  # docs/layer.md
    qk_layout: str = borrow(PriorSettings, "qk_layout")  # docs/layer.md, Packed width
    use_bias: bool = declare(False, Bool(doc="biases in attention projections (and the 'gpt2' MLP); GPT-2: True"))
    norm_eps: float = declare(1e-6, Float(min=0.0, min_inclusive=False, doc="epsilon of the block norms (RMSNorm for block=llama, LayerNorm for block=gpt2)"))
    dtype: Any = declare("float32", Dtype(DTYPES, doc="compute dtype of activations"))
    param_dtype: Any = declare("float32", Dtype(DTYPES, doc="storage dtype of parameters"))
    remat: bool = declare(False, Bool(doc="rematerialize each block in the backward pass (saves activation memory)"))
    remat_policy: str = declare("full", Str(choices=REMAT_POLICIES, doc="with remat (refused without it): what "
                                            "each block keeps ('full': nothing; 'dots': matmul outputs; "
                                            "'dots_no_batch': projection outputs)"))
    scan_layers: bool = declare(False, Bool(doc="nn.scan over blocks: params stacked on a 'layers' axis, one compile"))
    loss_chunk_size: Optional[int] = declare(None, Int(min=1, optional=True, doc=(
        "tokens per chunk of the training loss computed from the hidden states, so the [tokens, vocab] "
        "float32 logits are never held at once (goat_jax/losses.py); None: from the full logits")))
    init_std: float = declare(0.02, Float(min=0.0, min_inclusive=False, doc="std of the normal init of embeddings and MLP kernels"))
    attention_init_std: Optional[float] = declare(None, Float(min=0.0, min_inclusive=False, optional=True,
                                                              doc="q/k/v/out kernels N(0, std); None: Xavier-uniform (C4: 0.02)"))
    baseline_attention_scale: Optional[float] = declare(None, registry.ATTENTION_SCALE)

    def __post_init__(self):
        check_instance(self, "model")  # each field's own type and range (its declaration)
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of kv_num_heads={self.kv_num_heads}.")
        if self.head_dim is None and self.embed_dim % self.num_heads:
            raise ValueError(
                f"embed_dim={self.embed_dim} is not divisible by num_heads={self.num_heads}; set "
                "head_dim explicitly.")
        if self.remat_policy != "full" and not self.remat:
            # The policy says what each rematerialized block keeps: without remat there is none.
            raise ValueError(f"model.remat_policy={self.remat_policy!r} applies only with model.remat=True "
                             "(what each rematerialized block keeps); set model.remat=True, or drop "
                             "model.remat_policy.")
        _ = self.prior  # the GOAT settings' cross-field rules (PriorSettings raises naming the field)
        if self.position_encoding != "goat":  # the baseline's own rules: its settings' and its head's
            _ = self.encoding_settings  # (its settings class raises naming the field)
            positional.get_encoding(self.attention_encoding).check_head_dim(self.head_size)
        check_logn(self.logn_scaling, self.training_seq_len, "model.training_seq_len")  # the layer's own rule

    @property
    def max_positions(self) -> Optional[int]:
        """The longest sequence the model represents: ``max_len`` for the encodings with a
        position table (:data:`TABLE_ENCODINGS`), None (unbounded) otherwise."""
        return self.max_len if self.position_encoding in TABLE_ENCODINGS else None

    def check_length(self, length: int, what: str = "the sequence") -> None:
        """Raises ValueError if ``length`` tokens do not fit the position table (``what`` names
        the length in the message, e.g. 'seq_len')."""
        if self.max_positions is not None and length > self.max_positions:
            raise ValueError(
                f"{what}={length} exceeds model.max_len={self.max_len}, the size of the "
                f"{self.position_encoding!r} position table; raise model.max_len to >= {length} "
                "or shorten the sequence.")

    @property
    def prior(self) -> PriorSettings:
        """The GOAT prior's settings: this config's fields named like PriorSettings' (the others,
        e.g. the frequency bases, keep PriorSettings' defaults). ``training_seq_len`` is shared
        with RoPE-PI."""
        return PriorSettings.from_fields(self)

    @property
    def attention_encoding(self) -> str:
        """The encoding of the attention layers: ``position_encoding``, 'nope' for the absolute
        embeddings (their positions are in the embeddings)."""
        return "nope" if self.position_encoding in ABSOLUTE_ENCODINGS else self.position_encoding

    @property
    def encoding_settings(self) -> Optional[positional.EncodingSettings]:
        """The baseline's settings (its encoding's ``settings_class`` of this config's fields of
        those names), None for 'goat' (whose settings are :attr:`prior`)."""
        if self.position_encoding == "goat":
            return None
        return positional.get_encoding(self.attention_encoding).settings_class.from_fields(self)

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding / output table: ``vocab_size`` rounded up to a multiple of
        ``vocab_pad_multiple``."""
        m = self.vocab_pad_multiple
        return -(-self.vocab_size // m) * m

    @property
    def kv_heads(self) -> int:
        """K, the number of key/value heads."""
        return self.kv_num_heads or self.num_heads

    @property
    def head_size(self) -> int:
        """H, the resolved per-head dim."""
        return self.head_dim or self.embed_dim // self.num_heads

    @property
    def compute_dtype(self) -> jnp.dtype:
        """``dtype`` as a numpy dtype."""
        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self) -> jnp.dtype:
        """``param_dtype`` as a numpy dtype."""
        return jnp.dtype(self.param_dtype)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "LMConfig":
        """Builds an LMConfig from an ``ml_collections.ConfigDict`` (or any mapping).

        Raises ValueError naming every key that is not a field, so a typo in a config file or a
        ``--config.model.x=y`` override fails loudly instead of being ignored.
        """
        values = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ValueError(f"Unknown LMConfig field(s): {unknown}. Known fields: {sorted(fields)}."
                             + plan_fields_hint(unknown))
        return cls(**values)


# A registered encoding's setting that LMConfig does not borrow becomes a field of its own name.
LMConfig = registry.add_settings_fields(LMConfig, BASELINES)

# Type, range and doc of every field of a config's ``model`` section, derived from LMConfig's
# declarations (the engine checks them before any work, goat_jax/config/fields.py).
FIELD_SPECS = specs_of(LMConfig)


# ----------------------------------------------------------------------------------------------
# Blocks
# ----------------------------------------------------------------------------------------------

_REMAT_POLICY = {"full": None,  # nn.remat's default: save nothing
                 "dots": jax.checkpoint_policies.dots_saveable,
                 "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def _normal(std: float, axes):
    return nn.with_logical_partitioning(nn.initializers.normal(std), axes)


def _normal_padded_columns(std: float, axes, columns: int):
    """N(0, std) for a ``[..., Vp]`` table whose last ``Vp - columns`` columns are padding: the
    first ``columns`` are drawn exactly as the unpadded ``[..., columns]`` table's (the same key
    and shape), the padding is 0 (no token's logit: cut before any softmax, zero gradient).

    Why: a table padded along its rows (the tied embedding) keeps its unpadded draws, since the
    random bits follow the flat index; one padded along its last axis (the untied ``lm_head``,
    ``[E, Vp]``) would draw every value anew, so ``vocab_pad_multiple``, a speed setting,
    changed an untied model's initialization."""
    def init(key, shape, dtype=jnp.float32):
        real = nn.initializers.normal(std)(key, tuple(shape[:-1]) + (columns,), dtype)
        return jnp.pad(real, [(0, 0)] * (len(shape) - 1) + [(0, shape[-1] - columns)])
    return nn.with_logical_partitioning(init, axes)


def _norm(cfg: LMConfig, name: str) -> nn.Module:
    """RMSNorm ('llama') or LayerNorm with a bias ('gpt2'); both reduce in float32 whatever the
    compute dtype (force_float32_reductions)."""
    ones = nn.with_logical_partitioning(nn.initializers.ones, ("embed",))
    if cfg.block == "gpt2":
        return nn.LayerNorm(epsilon=cfg.norm_eps, dtype=cfg.compute_dtype,
                            param_dtype=cfg.weight_dtype, scale_init=ones,
                            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
                            name=name)
    return nn.RMSNorm(epsilon=cfg.norm_eps, dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype,
                      scale_init=ones, name=name)


class SwiGLU(nn.Module):
    """``wo(silu(x wi_0) * (x wi_1))`` (Shazeer 2020, as in Llama): [B, T, E] -> [B, T, E]."""

    config: LMConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config

        def dense(features, axes, std, name):
            return nn.DenseGeneral(features, use_bias=False, dtype=cfg.compute_dtype,
                                   param_dtype=cfg.weight_dtype, kernel_init=_normal(std, axes),
                                   name=name)

        gate = dense(cfg.mlp_dim, ("embed", "mlp"), cfg.init_std, "wi_0")(x)  # [B, T, F]
        up = dense(cfg.mlp_dim, ("embed", "mlp"), cfg.init_std, "wi_1")(x)  # [B, T, F]
        h = nn.with_logical_constraint(nn.silu(gate) * up, ("batch", "length", "mlp"))
        # GPT-2 residual scaling: each block adds two branches, so shrinking the output
        # projections by sqrt(2 L) keeps the residual stream's variance O(1) at init.
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        return dense(cfg.embed_dim, ("mlp", "embed"), out_std, "wo")(h)


class GeluMLP(nn.Module):
    """GPT-2's MLP ``wo(gelu_tanh(x wi + b_i)) + b_o``: [B, T, E] -> [B, T, E].

    Both kernels are drawn N(0, init_std) with no residual scaling, as in the official GOAT
    recipes (docs/protocols.md); biases (``use_bias``) start at zero.
    """

    config: LMConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config

        def dense(features, axes, name):
            return nn.DenseGeneral(
                features, use_bias=cfg.use_bias, dtype=cfg.compute_dtype,
                param_dtype=cfg.weight_dtype, kernel_init=_normal(cfg.init_std, axes),
                bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes[1:]), name=name)

        h = dense(cfg.mlp_dim, ("embed", "mlp"), "wi")(x)  # [B, T, F]
        h = nn.with_logical_constraint(nn.gelu(h, approximate=True), ("batch", "length", "mlp"))
        return dense(cfg.embed_dim, ("mlp", "embed"), "wo")(h)


def make_attention(cfg: LMConfig, decode: bool, plan: AttentionPlan = DEFAULT,
                   name: str = "attention") -> nn.Module:
    """The attention module for ``cfg.position_encoding``: GoatAttention for 'goat', otherwise
    PositionalAttention ('sinusoidal'/'learned' use its 'nope' mode, their positions being in the
    embeddings). Shared knobs (heads, GQA, dtypes, bias, the attention plan) are passed identically."""
    common = dict(num_heads=cfg.num_heads, kv_num_heads=cfg.kv_heads, head_dim=cfg.head_size,
                  out_features=cfg.embed_dim, use_bias=cfg.use_bias, dtype=cfg.compute_dtype,
                  param_dtype=cfg.weight_dtype, decode=decode, kernel_init_std=cfg.attention_init_std,
                  logn_scaling=cfg.logn_scaling, plan=plan, name=name)
    if cfg.position_encoding == "goat":
        # GOAT's content logits keep 1/sqrt(d_c) (packed at attention scale 1, as the official
        # module); baseline_attention_scale applies to the baselines only.
        return GoatAttention(prior=cfg.prior, **common)
    # One settings object (the encoding's declarations, read from this config's fields of those
    # names); training_seq_len also for log-n scaling, which every encoding takes.
    return positional_layer.PositionalAttention(position_encoding=cfg.attention_encoding, settings=cfg.encoding_settings,
                                          training_seq_len=cfg.training_seq_len,
                                          attention_scale=cfg.baseline_attention_scale, **common)


class DecoderBlock(nn.Module):
    """Pre-norm block ``x + attn(norm(x))``, then ``x + mlp(norm(x))``: [B, T, E] -> [B, T, E].

    Norm and MLP follow ``config.block``: RMSNorm + SwiGLU ('llama') or LayerNorm + GELU ('gpt2').

    ``positions`` (None or [T] / [B, T] int) move the attention's notion of position and
    ``segment_ids`` (None or [B, T] int) keep it inside each packed document; both must
    be None while decoding (the attention reads them from its cache index). Under ``nn.scan``
    (``scanned=True``) the block returns ``(x, None)``, scan's (carry, output) convention.
    """

    config: LMConfig
    decode: bool = False
    scanned: bool = False
    plan: AttentionPlan = DEFAULT  # the model's (TransformerLM.plan)

    @nn.compact
    def __call__(self, x: Array, positions: Optional[Array], segment_ids: Optional[Array] = None):
        cfg = self.config
        h = _norm(cfg, "attn_norm")(x)
        h = make_attention(cfg, self.decode, self.plan)(h, is_causal=True, q_positions=positions,
                                             k_positions=positions, segment_ids=segment_ids)
        x = nn.with_logical_constraint(x + h, ("batch", "length", "embed"))
        mlp = GeluMLP if cfg.block == "gpt2" else SwiGLU
        h = mlp(cfg, name="mlp")(_norm(cfg, "mlp_norm")(x))
        x = nn.with_logical_constraint(x + h, ("batch", "length", "embed"))
        return (x, None) if self.scanned else x


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------


class TransformerLM(nn.Module):
    """Decoder-only LM: ``tokens [B, T] int32 -> logits [B, T, V] float32``.

    Call: ``model.apply(variables, tokens, positions=None)``. ``positions`` ([T] or [B, T] int)
    default to ``arange(T)``; they drive the attention prior / rotation and, for 'sinusoidal' /
    'learned', the absolute embedding. ``segment_ids`` ([B, T] int; document-aware packing,
    ``data.packing='documents'``) keep every layer's attention inside each document; positions
    then default to each document's own (``goat_jax.prior.segments.segment_positions``), which the
    absolute embeddings read too. Not while decoding.

    KV-cache decoding: ``dm = model.clone(decode=True)``; ``dm.init(rng, tokens_of_full_length)``
    sizes the 'cache' collection for that length; then each
    ``dm.apply({'params': p, 'cache': c}, chunk, mutable=['cache'])`` appends ``chunk``
    ([B, t], t >= 1) and returns its logits. Positions then come from the cache index, so
    ``positions`` must be None. Works with ``scan_layers`` (the cache is stacked per layer).

    ``return_hidden=True`` returns ``(hidden [B, T, E], w [E, Vp])`` in the compute dtype instead
    of the logits (``logits = hidden @ w``, the first ``vocab_size`` columns): what
    :func:`goat_jax.losses.chunked_cross_entropy` takes (``model.loss_chunk_size``).
    With ``vocab_pad_multiple`` the table has ``Vp = padded_vocab_size`` rows; the logits are
    cut back to ``vocab_size``.
    """

    config: LMConfig
    decode: bool = False
    # How attention runs (goat_jax.kernels.plan.AttentionPlan: the run's, built once from its config by
    # the entry point and handed over by the task); by default the default plan (automatic kernel).
    plan: AttentionPlan = DEFAULT

    def _decode_offset(self, length: int) -> Optional[Array]:
        """Position of the first token of this call while decoding (absolute encodings only:
        attention modules keep their own index)."""
        is_init = not self.has_variable("cache", "position_index")
        index = self.variable("cache", "position_index", lambda: jnp.array(0, jnp.int32))
        if is_init:
            return jnp.array(0, jnp.int32)
        offset = index.value
        index.value = offset + length
        return offset

    @nn.compact
    def __call__(self, tokens: Array, *, positions: Optional[Array] = None,
                 segment_ids: Optional[Array] = None, return_hidden: bool = False) -> Array:
        cfg = self.config
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be [batch, length] integers, got {tokens.shape} {tokens.dtype}.")
        t = tokens.shape[1]
        cfg.check_length(t, "tokens.shape[1]")
        if self.decode and positions is not None:
            raise ValueError("decode=True takes positions from the cache index; do not pass positions.")
        positions = widen(positions)  # int8/int16 positions as int32 (goat_jax.prior.widen)
        if positions is not None:  # named as the caller passed them (the layers' say q_positions)
            validate_positions(positions, "positions")
        if segment_ids is not None and positions is None:
            # Per-document positions, computed once here so that the absolute embeddings and
            # every layer read the same ones (the layers would derive the same from the ids).
            positions = segments.segment_positions(segment_ids)

        embed = nn.Embed(cfg.padded_vocab_size, cfg.embed_dim, dtype=cfg.compute_dtype,
                         param_dtype=cfg.weight_dtype,
                         embedding_init=_normal(cfg.init_std, ("vocab", "embed")), name="embed")
        x = embed(tokens.astype(jnp.int32))  # [B, T, E]

        if cfg.position_encoding in ABSOLUTE_ENCODINGS:
            from goat_jax.positional import LearnedPositionEmbedding, sinusoidal_embedding

            abs_pos = positions
            if abs_pos is None:
                start = self._decode_offset(t) if self.decode else 0
                abs_pos = start + jnp.arange(t, dtype=jnp.int32)[None]  # [1, T]
            if cfg.position_encoding == "sinusoidal":
                pe = sinusoidal_embedding(abs_pos, cfg.embed_dim)
            else:
                pe = LearnedPositionEmbedding(
                    max_len=cfg.max_len, features=cfg.embed_dim, dtype=cfg.compute_dtype,
                    param_dtype=cfg.weight_dtype,
                    embedding_init=nn.initializers.normal(cfg.init_std), name="pos_embed")(abs_pos)
            x = x + pe.astype(x.dtype)  # [B or 1, T, E] broadcasts over the batch
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))

        block = DecoderBlock
        if cfg.remat:
            # prevent_cse=False is safe (and faster) under scan, which already blocks CSE.
            block = nn.remat(block, prevent_cse=not cfg.scan_layers, policy=_REMAT_POLICY[cfg.remat_policy])
        if cfg.scan_layers:
            stack = nn.scan(block, variable_axes={"params": 0, "cache": 0},
                            split_rngs={"params": True}, in_axes=(nn.broadcast, nn.broadcast),
                            length=cfg.num_layers, metadata_params={nn.PARTITION_NAME: "layers"})
            x, _ = stack(cfg, decode=self.decode, scanned=True, plan=self.plan, name="layers")(
                x, positions, segment_ids)
        else:
            for i in range(cfg.num_layers):
                x = block(cfg, decode=self.decode, plan=self.plan, name=f"layer_{i}")(x, positions, segment_ids)

        x = _norm(cfg, "final_norm")(x)
        if cfg.tie_embeddings:
            w = embed.embedding.T  # [E, Vp]
        else:
            w = self.param("lm_head", _normal_padded_columns(cfg.init_std, ("embed", "vocab"), cfg.vocab_size),
                           (cfg.embed_dim, cfg.padded_vocab_size), cfg.weight_dtype)
        w = w.astype(cfg.compute_dtype)
        if return_hidden:  # the chunked loss computes the logits itself, a chunk at a time
            return x, w
        # Inputs in the compute dtype (fast matmul), accumulation and result in float32: the
        # softmax over a large vocabulary and the loss need float32 logits.
        logits = jnp.einsum("bte,ev->btv", x, w, preferred_element_type=jnp.float32)
        if cfg.padded_vocab_size != cfg.vocab_size:
            # The matmul runs on the padded (aligned) width; the padded columns are no tokens,
            # so no softmax, loss, argmax or sampler downstream may see them.
            logits = logits[..., :cfg.vocab_size]
        return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))

    def token_loss(self, tokens: Array, targets: Array, weights: Array, *, positions: Optional[Array] = None,
                   segment_ids: Optional[Array] = None) -> Tuple[Array, Array]:
        """``(sum_i w_i * CE_i, sum_i w_i)`` in float32 of next-token ``targets`` ([B, T] int)
        under ``weights`` ([B, T]): from the full float32 logits, or with
        ``config.loss_chunk_size`` a chunk of positions at a time from the hidden states
        (:func:`goat_jax.losses.chunked_cross_entropy`; the same value and
        gradients, without the ``[B, T, V]`` logits). Call it as
        ``model.apply(variables, tokens, targets, weights, method='token_loss')``."""
        cfg = self.config
        if cfg.loss_chunk_size is None:
            logits = self(tokens, positions=positions, segment_ids=segment_ids)
            return losses.weighted_cross_entropy(logits, targets, weights)
        hidden, w = self(tokens, positions=positions, segment_ids=segment_ids, return_hidden=True)
        return losses.chunked_cross_entropy(hidden, w, targets, weights, chunk_size=cfg.loss_chunk_size,
                                                  vocab_size=cfg.vocab_size)


# ----------------------------------------------------------------------------------------------
# FLOPs (for MFU)
# ----------------------------------------------------------------------------------------------


def matmul_params(cfg: LMConfig) -> int:
    """Parameters that take part in a matmul per token: attention projections, MLP and the
    output projection (the input embedding is a lookup, norms and the GOAT prior are negligible).
    """
    e, h, n, k = cfg.embed_dim, cfg.head_size, cfg.num_heads, cfg.kv_heads
    attn = e * n * h + 2 * e * k * h + n * h * e  # q, k, v, out
    mlp = (2 if cfg.block == "gpt2" else 3) * e * cfg.mlp_dim  # wi, wo (+ wi_1 for SwiGLU)
    return cfg.num_layers * (attn + mlp) + e * cfg.vocab_size


def lm_flops_per_token(cfg: LMConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM appendix B counting:
    ``6 N + 12 L N_heads H T`` with N the matmul parameters (:func:`matmul_params`).

    The attention term counts the full T x T score and value products (no causal halving), as
    PaLM and MaxText do, so MFU numbers are comparable across codebases. GOAT's few extra packed
    q/k channels (``2R + sink`` of them, already inside H) are not counted separately.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}.")
    attention = 12 * cfg.num_layers * cfg.num_heads * cfg.head_size * seq_len
    return float(6 * matmul_params(cfg) + attention)
