"""What a goat-jax LM is in the exported Hugging Face format: the refusals (what the modeling
file cannot express), the ``config.json`` of a model config and the weights both ways
(goat-jax's params tree <-> PyTorch-layout tensors named as ``modeling_goat.py``'s modules).

Reads the model through its params tree and :class:`goat_jax.models.lm.LMConfig` only (names and
shapes, never the layers' code). Shape legend: E embed, N query heads, K kv heads, H head dim,
F mlp, Vp padded vocab, L layers.

=============================================  ==============================================
goat-jax (Flax, ``[in, out]`` kernels)         exported (PyTorch ``[out, in]`` weights)
=============================================  ==============================================
embed/embedding [Vp, E]                        model.embed_tokens.weight [Vp, E]
pos_embed/embedding [max_len, E]               model.embed_positions.weight
layer_i/attn_norm/{scale,bias}                 model.layers.i.input_layernorm.{weight,bias}
layer_i/mlp_norm/{scale,bias}                  model.layers.i.post_attention_layernorm.*
layer_i/attention/q_proj/kernel [E, N, H]      model.layers.i.self_attn.q_proj.weight [N*H, E]
layer_i/attention/{k,v}_proj/kernel [E, K, H]  ...self_attn.{k,v}_proj.weight [K*H, E]
layer_i/attention/out_proj/kernel [N, H, E]    ...self_attn.o_proj.weight [E, N*H]
layer_i/attention/prior/<name>                 ...self_attn.prior.<name> (official names)
layer_i/attention/prior/key_bias/fcX/kernel    ...self_attn.prior.key_bias.fcX.weight (transposed)
layer_i/mlp/{wi_0,wi_1,wo} (llama)             ...mlp.{gate_proj,up_proj,down_proj}
layer_i/mlp/{wi,wo} (gpt2)                     ...mlp.{fc_in,fc_out}
final_norm/{scale,bias}                        model.norm.{weight,bias}
lm_head [E, Vp] (untied)                       lm_head.weight [Vp, E]
=============================================  ==============================================

``scan_layers`` runs (parameters stacked under ``layers`` on a leading axis) are unstacked on
export and stacked again on import.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import numpy as np

from goat_jax.models.lm import LMConfig

# position_encoding values the modeling file computes; the others are refused by name.
SUPPORTED_ENCODINGS = ("goat", "rope", "ntk", "yarn", "alibi", "alibi_packed", "nope", "sinusoidal",
                       "learned")
SUPPORTED_TEXT = ("goat, rope, ntk and yarn (with a fixed model.rope_scaling_factor), alibi, alibi_packed, "
                  "nope, sinusoidal, learned")
MODEL_TYPE = "goat_jax_lm"


def check_exportable(cfg: LMConfig, window: Optional[int] = None) -> None:
    """Raises a one-line ValueError naming the setting (and what exports) when the modeling file
    cannot compute a model of ``cfg`` (``window``: the run's attention plan's sliding window)."""
    enc = cfg.position_encoding
    if enc not in SUPPORTED_ENCODINGS:
        raise ValueError(f"model.position_encoding={enc!r} has no closed form in the exported PyTorch modeling "
                         f"file; the export takes: {SUPPORTED_TEXT}.")
    if enc in ("ntk", "yarn") and cfg.rope_scaling_factor is None:
        raise ValueError(f"model.position_encoding={enc!r} with the dynamic factor (model.rope_scaling_factor=None) "
                         "follows the length of each whole call, which a transformers KV cache does not know; "
                         f"the export takes {enc!r} with a fixed model.rope_scaling_factor (or: {SUPPORTED_TEXT}).")
    if enc == "goat" and cfg.enable_key_bias and cfg.training_seq_len is None:
        raise ValueError("model.training_seq_len=None: GOAT's sink then normalizes positions by each call's key "
                         "length, which changes while generating; the export takes GOAT runs with "
                         "model.training_seq_len set (or enable_key_bias=False).")
    if window is not None:
        raise ValueError(f"the run's attention plan has a sliding window of {window} keys, which the exported "
                         "modeling file does not take; export a run without a window.")


def content_dim(cfg: LMConfig) -> int:
    """GOAT's content dims ``d_c`` of ``cfg``'s heads: ``head_dim - 2R - 1`` in the official layout;
    with ``qk_layout='lane_aligned'`` and the sink, the sink channels are carved from the head too.

    The carve is read in one place, :func:`goat_jax.export.official.carved_sink_channels` (issue
    #67: today the compute dtype's default, 1 in float32 and 3 in bfloat16; later the layout's).
    """
    from goat_jax.export import official  # pylint: disable=g-import-not-at-top
    return official.content_dims(cfg.prior, cfg.head_size, cfg.compute_dtype)[0]


def hf_config(cfg: LMConfig, extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """``config.json`` of the export: ``model_type``, ``architectures``, ``auto_map`` and every
    setting the modeling file reads, from ``cfg``; ``extra`` is merged in (tokens ids, the run)."""
    out = {
        "model_type": MODEL_TYPE, "architectures": ["GoatForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_goat.GoatConfig",
                     "AutoModelForCausalLM": "modeling_goat.GoatForCausalLM"},
        "vocab_size": cfg.vocab_size, "padded_vocab_size": cfg.padded_vocab_size,
        "hidden_size": cfg.embed_dim, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_size,
        "intermediate_size": cfg.mlp_dim, "block": cfg.block, "norm_eps": cfg.norm_eps, "use_bias": cfg.use_bias,
        "tie_embeddings": cfg.tie_embeddings, "position_encoding": cfg.position_encoding,
        "max_position_embeddings": cfg.max_len, "training_seq_len": cfg.training_seq_len,
        "rope_base": cfg.rope_base, "rope_scaling_factor": cfg.rope_scaling_factor,
        "yarn_beta_fast": cfg.yarn_beta_fast, "yarn_beta_slow": cfg.yarn_beta_slow,
        "logn_scaling": cfg.logn_scaling, "attention_scale": cfg.baseline_attention_scale,
        "use_cache": True,
    }
    if cfg.position_encoding == "goat":
        prior = cfg.prior
        out.update(pos_rank=prior.pos_rank, abs_rank=prior.abs_rank, pos_base=prior.pos_base,
                   abs_base=prior.abs_base, enable_key_bias=prior.enable_key_bias, prior_gate=prior.prior_gate,
                   sink_extrapolation=prior.sink_extrapolation, learn_frequencies=prior.learn_frequencies,
                   qk_layout=prior.qk_layout, content_dim=content_dim(cfg))
    out.update(extra or {})
    return out


# ----------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------

_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
_MLP = {"wi_0": "gate_proj", "wi_1": "up_proj", "wo": "down_proj", "wi": "fc_in"}
_NORM_LEAF = {"scale": "weight", "bias": "bias"}


def _flatten(tree: Any, prefix: Tuple[str, ...] = ()) -> Dict[Tuple[str, ...], Any]:
    if isinstance(tree, dict) or hasattr(tree, "items"):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, prefix + (str(k),)))
        return out
    return {prefix: tree}


def _unflatten(flat: Dict[Tuple[str, ...], Any]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def _unstack(flat: Dict[Tuple[str, ...], np.ndarray], num_layers: int) -> Dict[Tuple[str, ...], np.ndarray]:
    """``layers/...`` leaves stacked on axis 0 (``scan_layers``) as ``layer_i/...``."""
    out = {}
    for path, x in flat.items():
        if path[0] == "layers":
            for i in range(num_layers):
                out[(f"layer_{i}",) + path[1:]] = x[i]
        else:
            out[path] = x
    return out


def torch_name(path: Tuple[str, ...], cfg: LMConfig) -> Tuple[str, str]:
    """``(name in the exported state dict, transform)`` of the Flax param at ``path`` (unstacked);
    transform: 'same', 'T' (2D transpose), 'in' (a [E, heads, H] kernel), 'out' ([N, H, E]),
    'flat' (a [heads, H] bias)."""
    head = path[0]
    if path == ("embed", "embedding"):
        return "model.embed_tokens.weight", "same"
    if path == ("pos_embed", "embedding"):
        return "model.embed_positions.weight", "same"
    if path == ("lm_head",):
        return "lm_head.weight", "T"
    if head == "final_norm":
        return f"model.norm.{_NORM_LEAF[path[1]]}", "same"
    if head.startswith("layer_"):
        i, rest = int(head[len("layer_"):]), path[1:]
        base = f"model.layers.{i}"
        if rest[0] in _NORMS:
            return f"{base}.{_NORMS[rest[0]]}.{_NORM_LEAF[rest[1]]}", "same"
        if rest[0] == "mlp":
            name = _MLP[rest[1]] if not (rest[1] == "wo" and cfg.block == "gpt2") else "fc_out"
            leaf = "weight" if rest[2] == "kernel" else "bias"
            return f"{base}.mlp.{name}.{leaf}", "T" if leaf == "weight" else "same"
        if rest[0] == "attention":
            sub = rest[1]
            if sub in ("q_proj", "k_proj", "v_proj", "out_proj"):
                name = "o_proj" if sub == "out_proj" else sub
                if rest[2] == "kernel":
                    return f"{base}.self_attn.{name}.weight", "out" if sub == "out_proj" else "in"
                return f"{base}.self_attn.{name}.bias", "same" if sub == "out_proj" else "flat"
            if sub == "prior":
                if rest[2] == "key_bias":
                    leaf = "weight" if rest[4] == "kernel" else "bias"
                    return f"{base}.self_attn.prior.key_bias.{rest[3]}.{leaf}", "T" if leaf == "weight" else "same"
                return f"{base}.self_attn.prior.{rest[2]}", "same"
    raise ValueError(f"the parameter {'/'.join(path)} has no place in the exported model (a parameter of an "
                     f"encoding the export does not take?); the export takes: {SUPPORTED_TEXT}.")


def _forward(x: np.ndarray, how: str) -> np.ndarray:
    if how == "T":
        return x.T
    if how == "in":  # [E, heads, H] -> [heads * H, E]
        return x.reshape(x.shape[0], -1).T
    if how == "out":  # [N, H, E] -> [E, N * H]
        return x.reshape(-1, x.shape[-1]).T
    if how == "flat":
        return x.reshape(-1)
    return x


def _backward(y: np.ndarray, how: str, shape: Tuple[int, ...]) -> np.ndarray:
    if how in ("T", "in", "out"):  # each forward transform is a transpose of a reshape
        return np.ascontiguousarray(y.T).reshape(shape)
    return y.reshape(shape)


def to_torch(params: Any, cfg: LMConfig) -> Dict[str, np.ndarray]:
    """``{name: array}`` in PyTorch layout (contiguous, the params' dtype) of a goat-jax LM's
    ``params`` (unboxed; ``{'params': ...}`` or the collection itself)."""
    params = params.get("params", params) if hasattr(params, "get") else params
    flat = _unstack({p: np.asarray(x) for p, x in _flatten(params).items()}, cfg.num_layers)
    out = {}
    for path, x in flat.items():
        name, how = torch_name(path, cfg)
        out[name] = np.ascontiguousarray(_forward(x, how))
    return out


def from_torch(tensors: Dict[str, np.ndarray], cfg: LMConfig, shapes: Any) -> Dict[str, Any]:
    """The goat-jax params tree of ``cfg``'s model from exported ``tensors``; ``shapes`` is the
    model's params tree of ``jax.ShapeDtypeStruct`` (``eval_shape`` of init, unboxed), whose
    names, shapes and dtypes the result takes. ValueError naming the first missing, extra or
    misshapen tensor."""
    flat_shapes = _flatten(shapes)
    wanted = {}  # unstacked path -> (shape, dtype)
    for path, spec in flat_shapes.items():
        if path[0] == "layers":  # scan_layers: one entry per layer
            for i in range(cfg.num_layers):
                wanted[(f"layer_{i}",) + path[1:]] = (tuple(spec.shape[1:]), spec.dtype)
        else:
            wanted[path] = (tuple(spec.shape), spec.dtype)
    values, used = {}, set()
    for path, (shape, dtype) in wanted.items():
        name, how = torch_name(path, cfg)
        if name not in tensors:
            raise ValueError(f"the folder's weights lack {name!r} (goat-jax's {'/'.join(path)}); was it written by "
                             "experiments.export from a run of this config?")
        y = np.asarray(tensors[name])
        if int(np.prod(y.shape)) != int(np.prod(shape)):
            raise ValueError(f"{name!r} has shape {tuple(y.shape)}, but goat-jax's {'/'.join(path)} is {shape}.")
        values[path] = _backward(y, how, shape).astype(dtype)
        used.add(name)
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(f"the folder's weights hold {extra[:5]} that the model of its config.json has no place for.")
    if any(p[0] == "layers" for p in flat_shapes):
        values = {path: (np.stack([values[(f"layer_{i}",) + path[1:]] for i in range(cfg.num_layers)])
                         if path[0] == "layers" else values[path]) for path in flat_shapes}
    return _unflatten(values)
