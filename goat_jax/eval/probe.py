"""Where a trained GOAT LM loses perplexity past its training length: the probe behind
``experiments.probe_extrapolation`` (docs/extrapolation.md).

    python -m experiments.probe_extrapolation --workdir runs/tiny --out runs/tiny_probe   # the CLI

Evaluates the run's held-out stream in windows of ``--multiple`` x the training length L, with
one part of the prior changed at a time *at evaluation* (the parameters are the trained ones),
and reports the perplexity of the targets at window positions [0, L), [L, 2L), [2L, 4L), ...
(a causal model: position p sees what it would in any window longer than p). Interventions:

  as trained            the model as it is
  sink inputs clamped   the sink MLP sees min(t, L - 1): no absolute input leaves its range
  sink MLP removed      sink_gain = 0 (bump and recency slope kept)
  slopes removed        no causal recency slope
  kappa lags clamped    kappa(clip(p_i - p_j, -(L-1), L-1)) (dense kernel)
  last L keys           each query attends to its last L keys only (dense kernel)
  linear sink           PriorSettings.sink_extrapolation='linear' (the option, not a patch;
                        for runs with training_seq_len = seq_len)

plus 1x windows with every position shifted by L, 4L and (multiple - 1) L (only the sink MLP's
absolute inputs and the first-key bump see a shift). The interventions on the prior replace
functions of ``goat_jax.prior.sink_term`` / ``goat_jax.prior.fourier`` (the modules that define
them, so every caller sees the replacement) inside this process while they are evaluated and
restore them after; "last L keys" is a sliding window in the model's attention plan
(:attr:`goat_jax.kernels.plan.AttentionPlan.window`); nothing is written to the run. The CLI writes :func:`probe`'s result to
``OUT/probe.json`` and its :func:`markdown` to ``OUT/probe.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from goat_jax import cli
from goat_jax import prior as prior_lib
from goat_jax.prior import fourier, sink_term
from goat_jax.eval import extrapolation, lm_run, runs
from goat_jax.models import lm


@contextlib.contextmanager
def patched(module, name: str, fn):
    """``module.name = fn`` for the duration of the block (then the original again)."""
    original = getattr(module, name)
    setattr(module, name, fn)
    try:
        yield
    finally:
        setattr(module, name, original)


def _interventions(train_len: int):
    """``{label: (LMConfig changes, context manager factory, plan changes)}``, in report order
    (the plan changes: the run's plan with another kernel or a sliding window)."""
    sink_inputs, sink, kappa = prior_lib.sink_mlp_inputs, prior_lib.sink, prior_lib.kappa

    def clamped_inputs(spec, k_pos):
        t = jnp.minimum(k_pos.index, train_len - 1)
        return sink_inputs(spec, prior_lib.Positions(index=t, coords=t))

    def no_mlp(spec, params, k_pos, is_causal):
        return sink(spec, {**params, "sink_gain": jnp.zeros_like(params["sink_gain"])}, k_pos, is_causal)

    def no_slope(spec, params, k_pos, is_causal):
        return sink(spec, params, k_pos, False)

    def clamped_kappa(delta, lam_sym, lam_asym, freqs):
        return kappa(jnp.clip(delta, -(train_len - 1), train_len - 1), lam_sym, lam_asym, freqs)

    none = contextlib.nullcontext
    dense = {"implementation": "dense"}  # the kernel that runs the patched prior as an L x L bias
    return {  # label: (model config changes, what to patch while it runs, plan changes)
        "as trained": ({}, none, {}),
        "sink inputs clamped": ({}, lambda: patched(sink_term, "sink_mlp_inputs", clamped_inputs), {}),
        "sink MLP removed": ({}, lambda: patched(sink_term, "sink", no_mlp), {}),
        "slopes removed": ({}, lambda: patched(sink_term, "sink", no_slope), {}),
        "kappa lags clamped": ({}, lambda: patched(fourier, "kappa", clamped_kappa), dense),
        "last L keys": ({}, none, {**dense, "window": train_len}),
        "linear sink": ({"sink_extrapolation": "linear"}, none, {}),
    }


def position_nll(model, params, inputs: np.ndarray, targets: np.ndarray, positions=None,
                 batch_size: int = 8) -> np.ndarray:
    """Mean NLL per window position over windows ``inputs``/``targets`` [W, T] -> [T]."""
    fn = jax.jit(lambda p, x, y: extrapolation.token_nll(model.apply({"params": p}, x, positions=positions), y))
    out = [np.asarray(fn(params, inputs[i:i + batch_size], targets[i:i + batch_size]), np.float64)
           for i in range(0, len(inputs), batch_size)]
    return np.concatenate(out).mean(0)


def probe(run: lm_run.LMRun, multiple: int = 16, tokens: Optional[np.ndarray] = None) -> dict[str, Any]:
    """The measurements of the module docstring on one GOAT run.

    Returns ``{'edges': [0, L, 2L, ...], 'buckets': {label: [ppl per span]}, 'shifted':
    {offset: ppl of 1x windows}, 'windows': number of long windows}``.
    """
    cfg = run.model.config
    if cfg.position_encoding != "goat":
        raise ValueError(f"probe_extrapolation: {run.workdir} is a {cfg.position_encoding!r} run; "
                         "the interventions change GOAT's prior.")
    length = run.train_len
    tokens = runs.heldout_tokens(run) if tokens is None else np.asarray(tokens, np.int32)
    window = multiple * length
    count = (len(tokens) - 1) // window
    if count < 1:
        raise ValueError(f"probe_extrapolation: {len(tokens)} held-out tokens hold no window of "
                         f"{window} + 1; lower --multiple.")
    win = tokens[np.arange(count)[:, None] * window + np.arange(window + 1)]
    edges = [0] + [length * 2 ** i for i in range(int(np.log2(multiple)) + 1)]
    buckets = {}
    for label, (changes, context, plan_changes) in _interventions(length).items():
        if label == "linear sink" and cfg.training_seq_len != length:
            cli.log(f"{label}: skipped, the run's training_seq_len is {cfg.training_seq_len}, not "
                     f"its seq_len {length} (the option continues the sink past training_seq_len)")
            continue
        changed = dataclasses.replace(cfg, **changes)
        model = lm.TransformerLM(changed, plan=run.plan.replace(**plan_changes))
        with context():
            nll = position_nll(model, run.params, win[:, :-1], win[:, 1:])
        buckets[label] = [float(np.exp(nll[a:b].mean())) for a, b in zip(edges[:-1], edges[1:])]
        cli.log(f"{label}: " + " ".join(f"{v:.2f}" for v in buckets[label]))
    shifted = {}
    for offset in sorted({0, length, 4 * length, (multiple - 1) * length}):
        pos = jnp.arange(length, dtype=jnp.int32) + offset
        nll = position_nll(run.model, run.params, win[:, :length], win[:, 1:length + 1], pos)
        shifted[offset] = float(np.exp(nll.mean()))
    return {"edges": edges, "buckets": buckets, "shifted": shifted, "windows": int(count)}


def markdown(result: dict[str, Any]) -> str:
    """The tables of docs/extrapolation.md for one probe result."""
    e = result["edges"]
    head = " | ".join(f"[{a},{b})" for a, b in zip(e[:-1], e[1:]))
    lines = [f"Perplexity by window position ({result['windows']} windows of {e[-1]}):", "",
             f"| model at evaluation | {head} |", "|---" * (len(e)) + "|"]
    lines += [f"| {k} | " + " | ".join(f"{v:.2f}" for v in vals) + " |" for k, vals in result["buckets"].items()]
    lines += ["", "1x windows with shifted positions: " + ", ".join(
        f"offset {o}: {p:.2f}" for o, p in result["shifted"].items())]
    return "\n".join(lines) + "\n"
