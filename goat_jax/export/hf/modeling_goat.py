"""A goat-jax language model in PyTorch for ``transformers`` (``trust_remote_code=True``).

Written by goat-jax's ``python -m experiments.export`` next to the weights; it imports PyTorch
and ``transformers`` only. It computes what goat-jax's ``TransformerLM`` computes:

* blocks: 'llama' (RMSNorm, SwiGLU) or 'gpt2' (LayerNorm, GELU(tanh) MLP), pre-norm, tied or
  untied output embedding, GQA/MQA (``num_key_value_heads``);
* attention: GOAT (arXiv 2601.15380), whose log-prior ``kappa_h(p_i - p_j) + u_h(j)`` is packed
  into extra query/key channels so that ``scaled_dot_product_attention`` at scale 1 computes it
  exactly (the relative Fourier series, the key-only sink with its MLP, bump and recency slope,
  the 'linear' sink extrapolation, learned frequencies, the query-norm prior gate); or a
  closed-form baseline: RoPE (and NTK / YaRN with a fixed factor), ALiBi, NoPE, and the
  sinusoidal / learned absolute embeddings; log-n scaling ('content' or 'all') on any of them.

Positions come from ``position_ids`` or, when not given, from the attention mask (the count of
real tokens before each one), so a left-padded batch gives each row the logits it has alone.
The KV cache is a ``transformers`` cache (``DynamicCache``); it holds keys as the kernel sees
them (packed for GOAT, rotated for RoPE), so ``model.generate`` works.

Angles ``w * p`` are computed in float64 and reduced modulo 2 pi before the cosine (goat-jax
computes them as exact integer phases); the prior's features and parameters stay float32 in any
dtype (the sink is split exactly into bfloat16 / float16 parts as in goat-jax's packing).
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

try:  # loaded by transformers as a module of the model's folder
    from .configuration_goat import GoatConfig
except ImportError:  # pragma: no cover - imported as a plain file
    from configuration_goat import GoatConfig

TWO_PI = 2.0 * math.pi


# ----------------------------------------------------------------------------------------------
# Positions and angles
# ----------------------------------------------------------------------------------------------


def cos_sin(positions: torch.Tensor, freqs: torch.Tensor):
    """``(cos, sin)`` of ``positions[..., None] * freqs`` in float32, the angles in float64
    reduced modulo 2 pi. ``freqs`` [F] gives [..., F]; [K, F] gives [..., K, F]."""
    p = positions.to(torch.float64)
    f = freqs.to(torch.float64)
    angle = p[..., None] * f if f.dim() == 1 else p[..., None, None] * f
    angle = torch.remainder(angle, TWO_PI)
    return torch.cos(angle).float(), torch.sin(angle).float()


def ladder(rank: int, base: float, device=None) -> torch.Tensor:
    """GOAT's frequencies ``base ** (-r / max(rank - 1, 1))``, [rank] float64."""
    r = torch.arange(rank, dtype=torch.float64, device=device)
    return torch.as_tensor(base, dtype=torch.float64) ** (-r / max(rank - 1, 1))


def rope_ladder(dim: int, base: float, device=None) -> torch.Tensor:
    """RoPE's inverse frequencies ``base ** (-2 i / dim)``, [dim / 2] float64."""
    return torch.as_tensor(base, dtype=torch.float64) ** (
        -torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)


def alibi_slopes(num_heads: int) -> list:
    """ALiBi's slopes (Press et al. 2022), the recipe for any head count."""
    def power_of_two(n):
        return [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]
    if num_heads & (num_heads - 1) == 0:
        return power_of_two(num_heads)
    c = 2 ** int(math.floor(math.log2(num_heads)))
    return power_of_two(c) + power_of_two(2 * c)[0::2][: num_heads - c]


def scaled_rope(config) -> tuple:
    """``(inverse frequencies [H/2] float64, logit factor)`` of 'rope', 'ntk' and 'yarn' (the
    latter two with their fixed ``rope_scaling_factor``; at factor 1 they are 'rope')."""
    dim, base = config.head_dim, float(config.rope_base)
    f = float(config.rope_scaling_factor or 1.0)
    if config.position_encoding == "rope" or f == 1.0:
        return rope_ladder(dim, base), 1.0
    if config.position_encoding == "ntk":
        return rope_ladder(dim, base * f ** (dim / (dim - 2))), 1.0
    # YaRN, NTK-by-parts (Hugging Face's _compute_yarn_parameters with truncate=True).
    theta = rope_ladder(dim, base)

    def index(rotations):
        return dim * math.log(config.training_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(index(config.yarn_beta_fast)), 0)
    high = min(math.ceil(index(config.yarn_beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low), 0.0, 1.0)
    mscale = 0.1 * math.log(f) + 1.0
    return theta * (1.0 - ramp) + (theta / f) * ramp, mscale ** 2


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x`` [B, heads, T, H] with ``cos, sin`` [B, 1, T, H/2], in float32."""
    h = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :h], xf[..., h:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def split_exact(x: torch.Tensor, parts: int, dtype) -> torch.Tensor:
    """``x`` (float32) as ``parts`` values of ``dtype`` whose float32 sum is ``x``: [..., parts]."""
    out, rest = [], x.float()
    for _ in range(parts):
        piece = rest.to(dtype)
        out.append(piece)
        rest = rest - piece.float()
    return torch.stack(out, dim=-1)


def sink_channels(dtype) -> int:
    """Channels that carry GOAT's sink at float32 accuracy in ``dtype`` (goat-jax's packing)."""
    return {torch.bfloat16: 3, torch.float16: 2}.get(dtype, 1)


# ----------------------------------------------------------------------------------------------
# Norms and MLPs (float32 statistics, as goat-jax's Flax norms)
# ----------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` (statistics in float32)."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm with Flax's statistics (``var = mean(x^2) - mean(x)^2``, float32)."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        xf = x.float()
        mean = xf.mean(-1, keepdim=True)
        var = torch.clamp(xf.pow(2).mean(-1, keepdim=True) - mean.pow(2), min=0.0)
        y = (xf - mean) * torch.rsqrt(var + self.eps)
        return (y * self.weight.float() + self.bias.float()).to(x.dtype)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` (the 'llama' block)."""

    def __init__(self, config):
        super().__init__()
        e, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(e, f, bias=False)
        self.up_proj = nn.Linear(e, f, bias=False)
        self.down_proj = nn.Linear(f, e, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GeluMLP(nn.Module):
    """``fc_out(gelu_tanh(fc_in(x)))`` (the 'gpt2' block)."""

    def __init__(self, config):
        super().__init__()
        e, f = config.hidden_size, config.intermediate_size
        self.fc_in = nn.Linear(e, f, bias=config.use_bias)
        self.fc_out = nn.Linear(f, e, bias=config.use_bias)

    def forward(self, x):
        return self.fc_out(F.gelu(self.fc_in(x), approximate="tanh"))


# ----------------------------------------------------------------------------------------------
# GOAT's prior
# ----------------------------------------------------------------------------------------------


class KeyBiasMLP(nn.Module):
    """The sink MLP ``fc2(silu(fc1(phi)))`` (the official package's ``key_bias``)."""

    def __init__(self, in_dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(in_dim, hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, x):
        return self.fc2(F.silu(self.fc1(x)))[..., 0]


class GoatPrior(nn.Module):
    """GOAT's prior parameters (the official names and shapes) and its packed channels."""

    def __init__(self, config):
        super().__init__()
        n, k, r, m = (config.num_attention_heads, config.num_key_value_heads, config.pos_rank, config.abs_rank)
        self.config, self.group = config, n // k
        self.lambda_sym = nn.Parameter(torch.zeros(k, r))
        self.lambda_asym = nn.Parameter(torch.zeros(k, r))
        self.prior_gate_scale_raw = nn.Parameter(torch.zeros(n))
        self.prior_gate_bias = nn.Parameter(torch.zeros(n))
        if config.enable_key_bias:
            self.key_bias = KeyBiasMLP(2 * m + 2, min(2 * (2 * m + 2), 4))
            self.sink_gain = nn.Parameter(torch.ones(k))
            self.sink_bump = nn.Parameter(torch.zeros(k))
            self.recency_slope_raw = nn.Parameter(torch.zeros(k))
        if config.learn_frequencies and r:
            self.pos_freqs = nn.Parameter(torch.zeros(k, r))

    def _freqs(self, device):
        c = self.config
        if c.learn_frequencies and c.pos_rank:
            return self.pos_freqs.float()  # [K, R]
        return ladder(c.pos_rank, c.pos_base, device)  # [R]

    def _mlp(self, t):
        """The sink MLP's output at sequence indices ``t`` (float32 [...])."""
        c = self.config
        denom = float(c.training_seq_len)
        cos, sin = cos_sin(t, ladder(c.abs_rank, c.abs_base, t.device))
        tf = t.float()[..., None]
        x = torch.cat([cos, sin, tf / denom, torch.log1p(tf) / math.log1p(denom)], dim=-1)
        w = self.key_bias
        return F.linear(F.silu(F.linear(x, w.fc1.weight.float(), w.fc1.bias.float())),
                        w.fc2.weight.float(), w.fc2.bias.float())[..., 0]

    def sink(self, t):
        """``u(j)`` [B, S, K] float32 at key indices ``t`` [B, S] (causal)."""
        c = self.config
        if c.sink_extrapolation == "linear":
            end, half = float(c.training_seq_len - 1), float(c.training_seq_len // 2)
            tf = t.float()
            inside = self._mlp(torch.clamp(tf, max=end))
            anchors = self._mlp(torch.tensor([end, end - half], device=t.device))
            extended = anchors[0] + (tf - end) * ((anchors[0] - anchors[1]) / half)
            m = torch.where(tf > end, extended, inside)
        else:
            m = self._mlp(t)
        tf = t.float()[..., None]
        return (self.sink_gain.float() * m[..., None] + self.sink_bump.float() * (tf == 0).float()
                + F.softplus(self.recency_slope_raw.float()) * tf)

    def pack(self, q, k, q_pos, k_pos, d_c):
        """Packed ``(q~ [B, N, T, d_c + 2R + c], k~ [B, K, S, d_c + 2R + c])`` from the raw
        projections ``q`` [B, N, T, H], ``k`` [B, K, S, H] at positions [B, T] / [B, S]."""
        c, dtype = self.config, q.dtype
        r = c.pos_rank
        q_c, k_c = q[..., :d_c], k[..., :d_c]
        gate = None
        if c.prior_gate == "query_norm":
            norm = q_c.float().pow(2).sum(-1).sqrt()  # [B, N, T]
            gate = torch.sigmoid(self.prior_gate_bias.float()[:, None]
                                 - F.softplus(self.prior_gate_scale_raw.float())[:, None] * norm)
        freqs = self._freqs(q.device)
        qcos, qsin = cos_sin(q_pos, freqs)  # [B, T, R] or [B, T, K, R]
        kcos, ksin = cos_sin(k_pos, freqs)
        if freqs.dim() == 2:  # learned, per KV head
            qcos = qcos.repeat_interleave(self.group, dim=2).permute(0, 2, 1, 3)  # [B, N, T, R]
            qsin = qsin.repeat_interleave(self.group, dim=2).permute(0, 2, 1, 3)
            kcos, ksin = kcos.permute(0, 2, 1, 3), ksin.permute(0, 2, 1, 3)  # [B, K, S, R]
        else:
            qcos, qsin, kcos, ksin = qcos[:, None], qsin[:, None], kcos[:, None], ksin[:, None]
        a = self.lambda_sym.float().repeat_interleave(self.group, dim=0)[None, :, None, :]  # [1, N, 1, R]
        b = self.lambda_asym.float().repeat_interleave(self.group, dim=0)[None, :, None, :]
        q_rel = torch.cat([a * qcos + b * qsin, a * qsin - b * qcos], dim=-1)  # [B, N, T, 2R]
        bsz, n, t = q.shape[0], q.shape[1], q.shape[2]
        kh, s = k.shape[1], k.shape[2]
        q_rel = q_rel.expand(bsz, n, t, 2 * r)
        q_sink = torch.ones(bsz, n, t, device=q.device)
        if gate is not None:
            q_rel, q_sink = q_rel * gate[..., None], gate
        k_rel = torch.cat([kcos, ksin], dim=-1).expand(bsz, kh, s, 2 * r)
        q_parts = [(q_c.float() / math.sqrt(d_c)).to(dtype), q_rel.to(dtype)]
        k_parts = [k_c, k_rel.to(dtype)]
        if c.enable_key_bias:
            parts = sink_channels(dtype)
            u = self.sink(k_pos).permute(0, 2, 1)  # [B, K, S]
            q_parts.append(q_sink[..., None].expand(bsz, n, t, parts).to(dtype))
            k_parts.append(split_exact(u, parts, dtype))
        return torch.cat(q_parts, dim=-1), torch.cat(k_parts, dim=-1)


# ----------------------------------------------------------------------------------------------
# Attention and blocks
# ----------------------------------------------------------------------------------------------


def masked(allowed: torch.Tensor, dtype) -> torch.Tensor:
    """The additive mask of ``allowed`` (bool [B, 1, T, S]): 0 where allowed, the dtype's most
    negative number elsewhere (a row with no allowed key gets a uniform softmax, not NaN)."""
    zeros = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return zeros.masked_fill(~allowed, torch.finfo(dtype).min)


class GoatAttention(nn.Module):
    """Self-attention of one block: projections, position encoding, the KV cache and
    ``scaled_dot_product_attention``."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        e, n, k, h = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        self.n, self.k, self.h = n, k, h
        self.q_proj = nn.Linear(e, n * h, bias=config.use_bias)
        self.k_proj = nn.Linear(e, k * h, bias=config.use_bias)
        self.v_proj = nn.Linear(e, k * h, bias=config.use_bias)
        self.o_proj = nn.Linear(n * h, e, bias=config.use_bias)
        if config.position_encoding == "goat":
            self.prior = GoatPrior(config)

    def forward(self, x, q_pos, key_pos, mask, cache: Optional[Cache]):
        c = self.config
        bsz, t, _ = x.shape
        q = self.q_proj(x).view(bsz, t, self.n, self.h).transpose(1, 2)  # [B, N, T, H]
        k = self.k_proj(x).view(bsz, t, self.k, self.h).transpose(1, 2)  # [B, K, T, H]
        v = self.v_proj(x).view(bsz, t, self.k, self.h).transpose(1, 2)
        enc = c.position_encoding
        bias = None
        if enc == "goat":
            d = c.content_dim
            q, k = self.prior.pack(q, k, q_pos, q_pos, d)
            scale = 1.0
        else:
            d = self.h
            scale = float(c.attention_scale) if c.attention_scale is not None else 1.0 / math.sqrt(self.h)
            if enc in ("rope", "ntk", "yarn"):
                freqs, factor = scaled_rope(c)
                cos, sin = cos_sin(q_pos, freqs.to(x.device))
                q, k = rotate(q, cos[:, None], sin[:, None]), rotate(k, cos[:, None], sin[:, None])
                scale *= factor
            elif enc in ("alibi", "alibi_packed"):
                slopes = torch.tensor(alibi_slopes(self.n), device=x.device)
                dist = (q_pos[:, :, None] - key_pos[:, None, :]).abs().float()  # [B, T, S]
                bias = -slopes[None, :, None, None] * dist[:, None]  # [B, N, T, S]
        if c.logn_scaling is not None:
            n_keys = q_pos.float() + 1.0
            factor = torch.clamp(torch.log(torch.clamp(n_keys, min=1.0)) / math.log(c.training_seq_len), min=1.0)
            factor = factor[:, None, :, None]  # [B, 1, T, 1]
            qf = q.float()
            if c.logn_scaling == "content":
                qf = torch.cat([qf[..., :d] * factor, qf[..., d:]], dim=-1)
            else:
                qf = qf * factor
                bias = None if bias is None else bias * factor
            q = qf.to(q.dtype)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        group = self.n // self.k
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if bias is not None:  # the bias needs float32 logits: attend in float32
            attn_mask = masked(mask, torch.float32) + bias
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=attn_mask,
                                                 scale=scale).to(v.dtype)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=masked(mask, q.dtype), scale=scale)
        out = out.transpose(1, 2).reshape(bsz, t, self.n * self.h)
        return self.o_proj(out)


class GoatBlock(nn.Module):
    """Pre-norm ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config, layer_idx):
        super().__init__()
        norm = LayerNorm if config.block == "gpt2" else RMSNorm
        self.input_layernorm = norm(config.hidden_size, config.norm_eps)
        self.self_attn = GoatAttention(config, layer_idx)
        self.post_attention_layernorm = norm(config.hidden_size, config.norm_eps)
        self.mlp = GeluMLP(config) if config.block == "gpt2" else SwiGLU(config)

    def forward(self, x, q_pos, key_pos, mask, cache):
        x = x + self.self_attn(self.input_layernorm(x), q_pos, key_pos, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class GoatPreTrainedModel(PreTrainedModel):
    """Shared ``transformers`` plumbing."""

    config_class = GoatConfig
    base_model_prefix = "model"
    _no_split_modules = ["GoatBlock"]
    _keep_in_fp32_modules_strict = ["prior"]  # the prior's parameters stay float32, as in goat-jax
    _supports_sdpa = True

    def _init_weights(self, module):
        """Weights come from the exported checkpoint; a fresh model gets small normal ones."""
        if isinstance(module, (nn.Linear, nn.Embedding)) and module.weight is not None:
            if getattr(module.weight, "is_meta", False):
                return
            with torch.no_grad():
                module.weight.normal_(0.0, 0.02)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    module.bias.zero_()


def sinusoidal(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """Vaswani et al.'s embedding, interleaved ``[sin, cos]`` pairs: [B, T, dim] float32."""
    cos, sin = cos_sin(positions, rope_ladder(dim, 10000.0, positions.device))
    return torch.stack([sin, cos], dim=-1).reshape(positions.shape + (dim,))


class GoatModel(GoatPreTrainedModel):
    """The decoder stack: embeddings, blocks, final norm."""

    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.padded_vocab_size, config.hidden_size)
        if config.position_encoding == "learned":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList([GoatBlock(config, i) for i in range(config.num_hidden_layers)])
        norm = LayerNorm if config.block == "gpt2" else RMSNorm
        self.norm = norm(config.hidden_size, config.norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=None):
        """Hidden states [B, T, E] and the cache."""
        c = self.config
        bsz, t = input_ids.shape
        device = input_ids.device
        if use_cache and cache is None:
            cache = DynamicCache(config=c)
        past = cache.get_seq_length() if cache is not None else 0
        s = past + t
        if attention_mask is None:
            attention_mask = torch.ones(bsz, s, dtype=torch.long, device=device)
        if attention_mask.dim() != 2 or attention_mask.shape[-1] != s:
            raise ValueError(f"attention_mask must be [batch, past + new tokens] = [{bsz}, {s}], "
                             f"got {tuple(attention_mask.shape)}.")
        valid = attention_mask.bool()
        key_pos = torch.clamp(attention_mask.long().cumsum(-1) - 1, min=0)  # [B, S]
        if position_ids is not None:
            position_ids = position_ids.expand(bsz, t).long()
            key_pos = torch.cat([key_pos[:, :past], position_ids], dim=-1)
        q_pos = key_pos[:, past:]  # [B, T]
        if c.position_encoding == "learned" and int(q_pos.max()) >= c.max_position_embeddings:
            raise ValueError(f"position {int(q_pos.max())} is past max_position_embeddings="
                             f"{c.max_position_embeddings}, the size of the learned position table.")
        causal = torch.arange(s, device=device)[None, :] <= (past + torch.arange(t, device=device))[:, None]
        allowed = causal[None, None] & valid[:, None, None, :]  # [B, 1, T, S]
        x = self.embed_tokens(input_ids)
        if c.position_encoding == "sinusoidal":
            x = x + sinusoidal(q_pos, c.hidden_size).to(x.dtype)
        elif c.position_encoding == "learned":
            x = x + self.embed_positions(q_pos).to(x.dtype)
        for layer in self.layers:
            x = layer(x, q_pos, key_pos, allowed, cache)
        return self.norm(x), cache


class GoatForCausalLM(GoatPreTrainedModel, GenerationMixin):
    """The LM: :class:`GoatModel` and the output projection (the embedding when tied);
    float32 logits over ``vocab_size`` tokens."""

    def __init__(self, config):
        super().__init__(config)
        self.model = GoatModel(config)
        if not config.tie_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return None if self.config.tie_embeddings else self.lm_head

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                past_key_values=None, use_cache=None, labels=None, logits_to_keep=0, return_dict=None,
                **kwargs):
        """``CausalLMOutputWithPast`` (logits [B, T, vocab_size] float32, the cache, the loss of
        ``labels`` when given). ``past_key_values``: the older name of ``cache``."""
        if input_ids is None:
            raise ValueError("GoatForCausalLM takes input_ids (token ids); inputs_embeds is not supported.")
        unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in (
            "output_attentions", "output_hidden_states", "cache_position", "token_type_ids"))
        if unknown:
            raise ValueError(f"GoatForCausalLM.forward got unsupported argument(s) {unknown}.")
        cache = cache if cache is not None else past_key_values
        if use_cache is None:
            use_cache = self.config.use_cache if hasattr(self.config, "use_cache") else True
        hidden, cache = self.model(input_ids, attention_mask, position_ids, cache, use_cache)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        w = self.model.embed_tokens.weight if self.config.tie_embeddings else self.lm_head.weight
        logits = F.linear(hidden.float(), w.float())[..., : self.config.vocab_size]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache if use_cache else None)
