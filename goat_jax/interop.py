"""Weights to and from the official PyTorch package ``goat-attention`` (import name ``goat``).

``from_official(m)`` turns a ``goat.GoatAttention`` into ``(module, params)`` such that::

    module.apply(params, query, key, value, is_causal=..., key_padding_mask=...,
                 spatial_shape=..., has_cls_token=..., position_offset_q=..., position_offset_k=...)

with batch-first ``[B, L, E]`` inputs returns ``m(query, key, value, ...)[0]`` (for a module
built with ``batch_first=True``; otherwise transpose the torch inputs: ``from_official`` warns)
in eval mode (goat_jax has no attention dropout: ``from_official`` warns when ``m.dropout > 0``). ``to_official`` goes
the other way. PyTorch is imported lazily: it is only needed here, never by the rest of
goat_jax.

One deliberate difference: with ``is_causal`` and *unequal* ``position_offset_q/k`` the
official module shifts its causal diagonal by the offset difference only when another mask is
present (otherwise SDPA's unshifted ``is_causal`` is used); goat_jax always shifts it (query
``i`` sees key ``j`` iff ``j <= i + offset_q - offset_k``).

Parameter mapping (torch ``nn.Linear`` weight is ``[out, in]``; Flax kernels are ``[in, ...]``):

=====================================  ==============================================
official                               goat_jax
=====================================  ==============================================
q_proj.weight [N*H, E] (or in_proj)    q_proj.kernel [E, N, H]
k_proj.weight / v_proj.weight          k_proj.kernel / v_proj.kernel [E, K, H]
out_proj.weight [E, N*H]               out_proj.kernel [N, H, E]
lambda_sym, lambda_asym [K, R]         prior.lambda_sym, prior.lambda_asym
key_bias.fc{1,2}.weight [out, in]      prior.key_bias.fc{1,2}.kernel [in, out]
sink_gain, sink_bump, recency_slope_raw prior.* [K]
prior_gate_scale_raw, prior_gate_bias   prior.* [N]
=====================================  ==============================================
"""

from __future__ import annotations

import warnings
from typing import Any, Tuple

import flax
import jax
import jax.numpy as jnp
import numpy as np

from goat_jax.layers.goat import GoatAttention
from goat_jax.prior import PriorSettings

_PRIOR_VECTORS = ("lambda_sym", "lambda_asym", "prior_gate_scale_raw", "prior_gate_bias")

# What :func:`to_official` does with each field of ``GoatAttention`` and of its ``prior``
# (docs/layer.md, "Weights from and to the official package"). 'copied': the official module
# takes it. 'how, not what': it changes how the layer computes (kernel, precision, cache,
# initialisation), not the function of the weights; the official module computes in float32.
# 'refused': the official package has no counterpart, so the exported module would be another
# function; to_official raises naming the field (for head_dim and out_features: unless they are
# the official module's embed_dim / num_heads and embed_dim). A field added to the layer or the
# settings must be placed here (tests/test_interop.py checks that every field is).
EXPORT_SETTINGS = {
    "num_heads": "copied", "kv_num_heads": "copied", "use_bias": "copied", "pos_encoding": "copied",
    "has_cls_token_default": "copied",
    "pos_rank": "copied", "abs_rank": "copied", "pos_base": "copied", "abs_base": "copied",
    "enable_key_bias": "copied", "training_seq_len": "copied", "prior_gate": "copied",
    "prior_init": "copied", "init_scale_prior": "copied",
    "dtype": "how, not what", "param_dtype": "how, not what", "implementation": "how, not what",
    "decode": "how, not what", "kernel_init_std": "how, not what", "sink_channels": "how, not what",
    "max_documents_per_row": "how, not what", "plan": "how, not what",  # but a window: refused below
    "head_dim": "refused", "out_features": "refused", "logn_scaling": "refused",
    "sink_extrapolation": "refused", "learn_frequencies": "refused", "qk_layout": "refused",
}
_SINK_VECTORS = ("sink_gain", "sink_bump", "recency_slope_raw")


def _base_from_freqs(freqs: np.ndarray) -> float:
    """Recovers ``base`` from ``w_r = base ** (-r / (R - 1))`` (the official module stores only
    the frequencies). With R <= 1 the only frequency is 1 and any base gives it."""
    if freqs.size <= 1:
        return 10_000.0
    base = float(1.0 / np.float64(freqs[-1]))
    rounded = float(round(base))
    return rounded if abs(rounded - base) <= 1e-3 * base else base


def _np(t) -> np.ndarray:
    """A torch tensor as a float64 NumPy array (exact for float32 weights)."""
    return t.detach().cpu().double().numpy()


def from_official(m: Any, **overrides: Any) -> Tuple[GoatAttention, dict]:
    """Converts an official ``goat.GoatAttention`` into ``(GoatAttention module, params)``.

    Args:
      m: the PyTorch module.
      **overrides: extra GoatAttention fields (e.g. ``implementation='xla'``,
        ``dtype=jnp.bfloat16``); ``module.clone(dtype=jnp.bfloat16)`` works as well.
    Warns:
      UserWarning: when ``m.batch_first`` is False (goat_jax inputs are always batch-first) or
        ``m.dropout > 0`` (goat_jax has no attention dropout; outputs match ``m.eval()``).
    Raises:
      ValueError: for official features without an equivalent here (``add_bias_kv``,
        ``add_zero_attn``, a goat_prior_scale other than 1).
    """
    if not getattr(m, "batch_first", True):
        warnings.warn(
            "from_official: the official module has batch_first=False and takes [length, batch, "
            "embed] inputs; goat_jax modules always take [batch, length, embed]. The weights "
            "convert unchanged: transpose the inputs (x.transpose(1, 0, 2)) and the output back.",
            UserWarning, stacklevel=2)
    if float(getattr(m, "dropout", 0.0)) > 0.0:
        warnings.warn(
            f"from_official: the official module has attention dropout={float(m.dropout)}; "
            "goat_jax has no attention dropout (flash kernels have none), so the converted "
            "module equals the official one in eval mode (m.eval()) only. Training it applies no "
            "dropout: add dropout on the layer's output if you need regularization.",
            UserWarning, stacklevel=2)
    if getattr(m, "add_bias_kv", False) or getattr(m, "add_zero_attn", False):
        raise ValueError("from_official: add_bias_kv / add_zero_attn are not supported by goat_jax.")
    if float(m.goat_prior_scale) != 1.0:
        raise ValueError(
            f"from_official: goat_prior_scale={float(m.goat_prior_scale)} (set_goat_prior_scale) is "
            "not supported; reset it to 1.0 before converting.")
    e, n, kv, h = m.embed_dim, m.num_heads, m.kv_num_heads, m.head_dim
    linear = m.q_proj if m.in_proj is None else m.in_proj
    settings = PriorSettings(
        pos_rank=m.R, abs_rank=m.M, pos_base=_base_from_freqs(_np(m.rel_freqs_base)),
        abs_base=_base_from_freqs(_np(m.abs_freqs_base)), enable_key_bias=m.enable_key_bias,
        init_scale_prior=m.init_scale_prior, training_seq_len=m.training_seq_len,
        prior_init=m.prior_init, prior_gate=m.prior_gate)
    module = GoatAttention(
        num_heads=n, kv_num_heads=kv, head_dim=h, prior=settings, pos_encoding=m.pos_encoding,
        has_cls_token_default=m.has_cls_token_default, use_bias=linear.bias is not None,
        **overrides)

    if m.in_proj is not None:
        w = _np(m.in_proj.weight)
        b = _np(m.in_proj.bias) if m.in_proj.bias is not None else None
        cuts = [e, e + kv * h]
        ws = np.split(w, cuts, axis=0)
        bs = np.split(b, cuts) if b is not None else [None] * 3
    else:
        lins = (m.q_proj, m.k_proj, m.v_proj)
        ws = [_np(l.weight) for l in lins]
        bs = [_np(l.bias) if l.bias is not None else None for l in lins]

    params: dict = {}
    for name, heads, w, b in zip(("q_proj", "k_proj", "v_proj"), (n, kv, kv), ws, bs):
        params[name] = {"kernel": w.T.reshape(w.shape[1], heads, h)}
        if b is not None:
            params[name]["bias"] = b.reshape(heads, h)
    params["out_proj"] = {"kernel": _np(m.out_proj.weight).T.reshape(n, h, e)}
    if m.out_proj.bias is not None:
        params["out_proj"]["bias"] = _np(m.out_proj.bias)

    prior = {name: _np(getattr(m, name)) for name in _PRIOR_VECTORS}
    if m.enable_key_bias:
        prior.update({name: _np(getattr(m, name)) for name in _SINK_VECTORS})
        prior["key_bias"] = {
            fc: {"kernel": _np(getattr(m.key_bias, fc).weight).T, "bias": _np(getattr(m.key_bias, fc).bias)}
            for fc in ("fc1", "fc2")}
    params["prior"] = prior

    param_dtype = jnp.dtype(module.param_dtype)

    def cast(path, x):
        # Prior parameters stay float32 whatever param_dtype is (see GoatPrior).
        dtype = jnp.float32 if path and getattr(path[0], "key", None) == "prior" else param_dtype
        return jnp.asarray(x, dtype)

    return module, {"params": jax.tree_util.tree_map_with_path(cast, params)}


def _check_exportable(module: GoatAttention) -> None:
    """Raises ValueError naming the first setting of ``module`` that the official package cannot
    represent (:data:`EXPORT_SETTINGS`' 'refused' ones that need only the module)."""
    pr = module.prior
    if pr.learn_frequencies:
        raise ValueError(
            "to_official: prior.learn_frequencies=True (learned relative frequencies, parameter "
            "prior.pos_freqs) has no counterpart in the official package, whose frequencies are "
            "the fixed ladder of pos_base; its outputs would differ. Export a module trained with "
            "learn_frequencies=False (model.learn_frequencies=False), or keep this run in goat_jax.")
    if pr.sink_extrapolation != "official":
        raise ValueError(
            f"to_official: prior.sink_extrapolation={pr.sink_extrapolation!r} has no counterpart in "
            "the official package, whose sink MLP would give other outputs past training_seq_len. "
            "Export a module with sink_extrapolation='official' (same parameters, official "
            "behaviour) if that is what you want.")
    if pr.qk_layout != "official" and pr.enable_key_bias:
        # Without the sink both layouts are one function; with it, 'lane_aligned' gives the
        # content two dims fewer than the official layout does, in every dtype.
        raise ValueError(
            f"to_official: prior.qk_layout={pr.qk_layout!r} has no counterpart in the official "
            "package: its sink channels are carved from the content dims, so the official module "
            "(qk_layout='official') would be another function of these weights (docs/layer.md, "
            "'Packed width'). Keep this run in goat_jax, or export a module trained with "
            "qk_layout='official'.")
    if module.plan is not None and module.plan.window is not None:
        raise ValueError(
            f"to_official: plan.window={module.plan.window} (a sliding window) has no counterpart in the "
            "official package, whose queries see every earlier key; export the module without it "
            "(module.clone(plan=module.plan.replace(window=None))).")
    if module.logn_scaling is not None:
        raise ValueError(
            f"to_official: logn_scaling={module.logn_scaling!r} has no counterpart in the official "
            "package, which never scales the logits by log n; the exported module would give "
            "other outputs past training_seq_len. Export the module with logn_scaling=None "
            "(module.clone(logn_scaling=None)) if that is what you want.")


def to_official(module: GoatAttention, params: Any, embed_dim: int | None = None) -> Any:
    """Builds a ``goat.GoatAttention`` (batch_first=True, float32) holding ``params``.

    Args:
      module: the GoatAttention whose hyper-parameters are copied.
      params: its variables (``{'params': ...}``, boxed or unboxed).
      embed_dim: model width; inferred from ``q_proj`` when omitted.
    Raises:
      ValueError: for settings the official package lacks, so that the exported module would
        be another function (:data:`EXPORT_SETTINGS`: ``learn_frequencies=True``, or ``params``
        holding ``prior.pos_freqs`` under any module; ``sink_extrapolation='linear'``;
        ``qk_layout='lane_aligned'`` with the sink; ``logn_scaling``) or shapes it cannot hold
        (``head_dim`` other than ``embed_dim / num_heads``, ``out_features`` other than
        ``embed_dim``); TypeError for a module other than a Linen ``GoatAttention``.
    """
    if not isinstance(module, GoatAttention):
        raise TypeError(
            f"to_official takes a goat_jax.GoatAttention (Linen), got {type(module).__name__}; for an "
            "NNX layer, convert it first: module, variables = goat_jax.nnx.to_linen(layer).")
    _check_exportable(module)  # before importing torch: nothing to convert
    p = flax.core.meta.unbox(params)
    p = p.get("params", p)
    if "pos_freqs" in p.get("prior", {}):  # learned frequencies in the weights, whatever the module says
        raise ValueError(
            "to_official: params hold prior.pos_freqs (weights trained with learn_frequencies=True), "
            "which the official layout cannot carry: its frequencies are the fixed ladder of pos_base, "
            "so the exported module would give other outputs. Export weights trained with "
            "learn_frequencies=False, or keep this run in goat_jax.")
    import torch
    import goat

    q_kernel = np.asarray(p["q_proj"]["kernel"], np.float32)  # [E, N, H]
    e = embed_dim or q_kernel.shape[0]
    n, h = q_kernel.shape[1], q_kernel.shape[2]
    if module.head_dim not in (None, h) or e != n * h:
        raise ValueError(
            f"to_official: the official module needs head_dim = embed_dim / num_heads; got "
            f"embed_dim={e}, num_heads={n}, head_dim={h}.")
    if module.out_features not in (None, e):
        raise ValueError("to_official: out_features must equal embed_dim for the official module.")
    kv = module.kv_num_heads or module.num_heads
    pr = module.prior
    # Cross-attention from another width: the official module's kdim / vdim.
    kdim, vdim = (int(np.shape(p[name]["kernel"])[0]) for name in ("k_proj", "v_proj"))
    m = goat.GoatAttention(
        embed_dim=e, num_heads=n, kv_num_heads=kv, batch_first=True, bias=module.use_bias,
        pos_rank=pr.pos_rank, abs_rank=pr.abs_rank, pos_base=pr.pos_base, abs_base=pr.abs_base,
        enable_key_bias=pr.enable_key_bias, init_scale_prior=pr.init_scale_prior,
        training_seq_len=pr.training_seq_len, prior_init=pr.prior_init, prior_gate=pr.prior_gate,
        pos_encoding=module.pos_encoding, has_cls_token_default=module.has_cls_token_default,
        fuse_qkv=False, kdim=None if kdim == e else kdim, vdim=None if vdim == e else vdim)
    t = lambda x: torch.tensor(np.asarray(x, np.float32))
    state = {}
    for name in ("q_proj", "k_proj", "v_proj"):
        kernel = np.asarray(p[name]["kernel"], np.float32)
        state[f"{name}.weight"] = t(kernel.reshape(kernel.shape[0], -1).T)
        if module.use_bias:
            state[f"{name}.bias"] = t(np.asarray(p[name]["bias"]).reshape(-1))
    out_kernel = np.asarray(p["out_proj"]["kernel"], np.float32)
    state["out_proj.weight"] = t(out_kernel.reshape(-1, out_kernel.shape[-1]).T)
    if module.use_bias:
        state["out_proj.bias"] = t(p["out_proj"]["bias"])
    prior = p["prior"]
    for name in _PRIOR_VECTORS + (_SINK_VECTORS if pr.enable_key_bias else ()):
        state[name] = t(prior[name])
    if pr.enable_key_bias:
        for fc in ("fc1", "fc2"):
            state[f"key_bias.{fc}.weight"] = t(np.asarray(prior["key_bias"][fc]["kernel"]).T)
            state[f"key_bias.{fc}.bias"] = t(prior["key_bias"][fc]["bias"])
    missing, unexpected = m.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in ("rel_freqs_base", "abs_freqs_base")]
    if missing or unexpected:
        raise ValueError(f"to_official: state mismatch, missing={missing}, unexpected={unexpected}.")
    return m
