"""Positional-encoding baselines behind GoatAttention's interface, for fair comparisons.

Relative encodings act inside attention, in :class:`goat_jax.layers.positional.PositionalAttention` (same call signature,
projections, parameter names and cache collection as :class:`goat_jax.layers.goat.GoatAttention`:
both are :class:`goat_jax.layers.linen.Attention`, so models swap the two freely), chosen by
``position_encoding``, one of ``POSITION_ENCODINGS``:

==============  ==============  ==============================================================
name            module          what it is
==============  ==============  ==============================================================
'nope'          nope.py         no positional information in attention (Kazemnejad et al. 2023)
'rope'          rope.py         rotary embeddings (Su et al. 2021), rotate-half layout
'rope_pi'       rope.py         RoPE with position interpolation (Chen et al. 2023): positions
                                times ``training_seq_len / key_length`` once the keys outgrow
                                the training length
'rope2d'        rope.py         axial 2D RoPE for patch grids (Heo et al. 2024, "RoPE-Axial"):
                                half of each head rotated by the row, half by the column;
                                needs ``spatial_shape``
'rope_mixed'    rope_mixed.py   RoPE-Mixed (Heo et al. 2024): 2D RoPE whose per-pair angle
                                ``row * F[h, m, 0] + col * F[h, m, 1]`` has learned per-head,
                                per-layer frequencies mixing the axes (param
                                'rope_mixed_freqs' [K, H/2, 2]); ViT only; every kernel
'alibi'         alibi.py        ALiBi (Press et al. 2022) as a materialized [N, T, S] additive
                                bias: the textbook form; XLA / dense kernels only
'alibi_packed'  alibi.py        the same ALiBi logits packed into q/k channels exactly like
                                GOAT's causal recency slope, so it runs on flash kernels;
                                causal only
'naive_prior'   naive_prior.py  a learned dense per-head [N, max_len, max_len] log-prior: the
                                L x L prior that GOAT's packing avoids (its memory is the
                                point of the comparison); XLA / dense kernels only
'ntk'           rope_scaling.py dynamic NTK-aware RoPE (bloc97 2023, Emozilla / HF 'dynamic'):
                                base times f ** (H / (H - 2)), f = max(1, key length /
                                training_seq_len) or ``rope_scaling_factor``; every kernel
'yarn'          rope_scaling.py YaRN (Peng et al. 2023): NTK-by-parts frequencies and the
                                attention temperature (0.1 ln f + 1) ** 2; every kernel
'fire'          fire.py         FIRE (Li et al. 2024): a learned MLP of the progressively
                                interpolated log distance, materialized; XLA / dense only
'kerple_log'    kerple.py       Kerple, log variant (Chi et al. 2022): -r1 log(1 + r2 |i - j|)
                                with learned r1, r2 > 0, materialized; XLA / dense only
'fox'           fox.py          FoX, the Forgetting Transformer (Lin et al. 2025): a learned
                                data-dependent forget gate, its bias c_i - c_j packed into q/k
                                channels like 'alibi_packed'; every kernel; causal only
==============  ==============  ==============================================================

Absolute encodings are added to the token embeddings before the first layer, not inside
attention (``absolute.py``): :func:`sinusoidal_embedding` (Vaswani et al. 2017),
:func:`sincos_2d_embedding` (big_vision's ViT default) and :class:`LearnedPositionEmbedding`.
A model using them runs its attention with ``position_encoding='nope'``.

Adding an encoding
------------------
An encoding is its module here and one entry in ``ENCODINGS`` (``registry.py``; ``POSITION_ENCODINGS``
is read from it). The module holds a subclass of :class:`PositionEncoding` (``base.py``) and, if
the encoding has knobs, their settings: a frozen dataclass subclassing :class:`EncodingSettings`
with one field per knob, declared once with ``goat_jax.config.fields.declare(default,
Float(...))`` (or inherited / ``borrow``-ed when another encoding declares it already, as
``rope_base`` and ``training_seq_len``), and in ``__post_init__`` (after ``super().__post_init__()``,
which checks each field against its declaration) the rules between knobs, e.g. 'rope_pi' needs
``training_seq_len``: the one place each requirement is checked. The class names it as
``settings_class``. The class also says, as attributes: its ``name``; ``positions`` ('1d', '2d' or
'any'); ``causal_only`` (the reason, if it needs ``is_causal=True``); ``materialized_bias`` (True:
it returns a [.., N, T, S] bias and runs on the 'xla'/'dense' kernels only; False: it runs on
every kernel). It declares its parameters (``parameters(sizes, settings)``: ``(name, init,
(shape, dtype))`` each) and, if it keeps decoding state, its cache slots (``cache_slots(sizes,
batch)``); the layer makes them and hands their values to the hooks, which take values and return
values (never the layer): the parameters' values ``params`` (``{name: value}``) and an
:class:`EncodingContext` (its checked settings ``ctx.settings``, positions, the keys attended
while decoding, head shapes, dtype, scale, the cache's values while decoding). It overrides only
the hooks it needs:

* ``check_layer(sizes)``: raise for a layer it cannot run in (its settings' rules are checked
  when the settings are built);
* ``check_head_dim(head_dim)``: raise for a head size it cannot run on (the layer and the model
  configs call it);
* ``extra_qk_dims(shape, channels)``: channels appended to each q/k head when it packs a term
  into q/k (the KV cache is sized with them);
* ``encode(params, ctx, q, k) -> (q, k, scale)``: what it does to q and k (the cache stores that k);
* ``bias(params, ctx)``: an additive bias, or None;
* ``cache_update(params, ctx)``: while decoding, the new values of its cache slots.

Nothing else is written for it: the models offer the registered encodings
(``goat_jax.models.lm``: the '1d' and 'any' ones; ``goat_jax.models.vit``: '2d' and 'any'), their
configs have each setting as a ``model.<name>`` field (borrowed from the declaration, or added
from the registry by ``layer.add_settings_fields``, so ``--config.model.<name>=...`` sets it and
old run configs resume under its default), the models pass the one settings object
(``PositionalAttention(settings=...)``), and a layer built by hand takes each built-in setting as
a keyword of the same name (``PositionalAttention(position_encoding='yarn',
training_seq_len=2048)``). An encoding defined outside this package is added with
``register(encoding)`` before ``goat_jax.models`` is imported. ``tests/test_positional_protocol.py``
shows a complete encoding written only against the protocol; ``tests/test_encoding_settings.py``
adds one with a knob and sets it from the command line's config override.

Segments (document-aware packing). When a call has ``segment_ids``, the layer has already made
the positions per document (``EncodingContext.q_pos`` [B, T], ``k_pos`` / ``attended_k_pos``
[B, S], restarting at 0 at each document) and the kernel masks every pair of tokens of different
documents, so an encoding that reads positions only through the context honours segments with
no code of its own. An encoding that reads anything else about the sequence must make it per
document: ``ctx.key_len`` (and the query/key lengths) is the packed window's, so a
length-dependent encoding reads ``goat_jax.prior.segments.segment_lengths(ctx.call.kv_segment_ids)``
([B, S], each token's document length; 'rope_pi' does this) when ``ctx.call.q_segment_ids`` is
not None; an encoding that cannot be made per document raises in ``check_layer``/``encode``
when segment ids are given. tests/test_segment_layers.py runs every registered 1D encoding on
every CPU kernel (the slow suite; a few in the default one): a packed row equals each document
alone.

Projections, positions, the KV cache, the kernel call and sowing are written once, in
:mod:`goat_jax.layers.core`, which the Linen and NNX layers both run.

Log-n scaling is not an encoding but a field of every layer (``logn_scaling``, in
:class:`goat_jax.layers.linen.Attention`), so any 1D encoding and GOAT can add it.

Shape legend: B batch, T queries, S keys, E model dim, N query heads, K kv heads, G = N // K,
H head dim, c split channels (``goat_jax.prior.packing.default_sink_channels``).
"""

from goat_jax.positional.absolute import LearnedPositionEmbedding, sincos_2d_embedding, sinusoidal_embedding
from goat_jax.positional.alibi import alibi_bias, pack_alibi_key, pack_alibi_query
from goat_jax.positional.base import EncodingContext, EncodingSettings, PositionEncoding
from goat_jax.positional.fire import fire_bias
from goat_jax.positional.fox import fox_cumulative, fox_log_forget, pack_fox_key
from goat_jax.positional.kerple import kerple_log_bias
from goat_jax.positional import registry as _registry
from goat_jax.positional.registry import get_encoding, register
from goat_jax.positional.naive_prior import naive_prior_bias
from goat_jax.positional.rope import apply_rope, apply_rope_2d, rope_frequencies
from goat_jax.positional.rope_mixed import apply_rope_mixed

__all__ = [
    "ENCODINGS", "POSITION_ENCODINGS", "EncodingContext", "EncodingSettings", "LearnedPositionEmbedding",
    "PositionEncoding",
    "alibi_bias", "apply_rope", "apply_rope_2d", "apply_rope_mixed", "fire_bias",
    "fox_cumulative", "fox_log_forget", "get_encoding", "kerple_log_bias", "naive_prior_bias", "pack_alibi_key",
    "pack_alibi_query", "pack_fox_key", "register", "rope_frequencies", "sincos_2d_embedding", "sinusoidal_embedding",
]


def __getattr__(name: str):
    """``ENCODINGS`` and ``POSITION_ENCODINGS``, read from the registry when asked (so an
    encoding added with :func:`register` is in them, with no write into this package)."""
    if name in ("ENCODINGS", "POSITION_ENCODINGS"):
        return getattr(_registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
