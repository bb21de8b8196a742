"""Configuration of a goat-jax language model exported for ``transformers`` (written by
``python -m experiments.export``; PyTorch and ``transformers`` only, no goat-jax import).

Every field the math of ``modeling_goat.py`` reads is here, named as goat-jax's ``LMConfig``
fields where ``transformers`` has no convention (``hidden_size`` is ``embed_dim``,
``num_hidden_layers`` is ``num_layers``, ``num_attention_heads`` is ``num_heads``,
``num_key_value_heads`` is ``kv_num_heads``, ``intermediate_size`` is ``mlp_dim``,
``max_position_embeddings`` is ``max_len``). ``goat_jax`` holds the run's own config, which
``experiments.export --from_hf`` reads to make a goat-jax checkpoint again.
"""

from transformers import PretrainedConfig


class GoatConfig(PretrainedConfig):
    """A goat-jax ``TransformerLM`` (Llama-style or GPT-2-style blocks; GOAT attention or a
    closed-form baseline). See docs/export.md of goat-jax for each field."""

    model_type = "goat_jax_lm"

    def __init__(self, vocab_size=259, padded_vocab_size=None, hidden_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=None, head_dim=None, intermediate_size=256,
                 block="llama", norm_eps=1e-6, use_bias=False, tie_embeddings=True, position_encoding="goat",
                 max_position_embeddings=2048, training_seq_len=None, rope_base=10000.0,
                 rope_scaling_factor=None, yarn_beta_fast=32.0, yarn_beta_slow=1.0, logn_scaling=None,
                 attention_scale=None, pos_rank=8, abs_rank=8, pos_base=10000.0, abs_base=10000.0,
                 enable_key_bias=True, prior_gate="none", sink_extrapolation="official",
                 learn_frequencies=False, qk_layout="official", content_dim=None, goat_jax=None, **kwargs):
        self.vocab_size = vocab_size
        self.padded_vocab_size = padded_vocab_size or vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.intermediate_size = intermediate_size
        self.block = block
        self.norm_eps = norm_eps
        self.use_bias = use_bias
        self.tie_embeddings = tie_embeddings
        self.position_encoding = position_encoding
        self.max_position_embeddings = max_position_embeddings
        self.training_seq_len = training_seq_len
        self.rope_base = rope_base
        self.rope_scaling_factor = rope_scaling_factor
        self.yarn_beta_fast = yarn_beta_fast
        self.yarn_beta_slow = yarn_beta_slow
        self.logn_scaling = logn_scaling
        self.attention_scale = attention_scale
        self.pos_rank = pos_rank
        self.abs_rank = abs_rank
        self.pos_base = pos_base
        self.abs_base = abs_base
        self.enable_key_bias = enable_key_bias
        self.prior_gate = prior_gate
        self.sink_extrapolation = sink_extrapolation
        self.learn_frequencies = learn_frequencies
        self.qk_layout = qk_layout
        self.content_dim = content_dim
        self.goat_jax = goat_jax
        # The output projection is the embedding itself when tie_embeddings (no second weight).
        kwargs["tie_word_embeddings"] = False
        super().__init__(**kwargs)
