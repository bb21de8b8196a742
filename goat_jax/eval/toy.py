"""The toy prior experiment (paper Figure 1) as a library: train a small GOAT LM on the copy
mixture (``configs/toy_copy_mixture.py``), check and plot its learned prior.

:func:`run_toy` is what ``python -m experiments.toy_prior`` and ``experiments.reproduce`` run.
It writes into the workdir: ``toy_prior.png`` (the best head's sink ``u(j)``, ``kappa(i - j)``,
the row-centred causal log-prior and its softmax), ``toy_prior_all_heads.png`` (``all_heads``)
and ``toy_summary.txt``.

What to expect: each token copies the first token or the token at lag 1 (or is noise), and the
token identities carry no hint of *where* to look, so the prior has to learn a sink at position
0 and a diagonal at lag 1 (``goat_jax.eval.sinks.has_sink_at_zero`` / ``has_diagonal_at_lag``).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from goat_jax import _extras
with _extras.imports(__name__):  # optional packages: one-line error naming the extra
    from matplotlib.figure import Figure

from goat_jax.data import synthetic
from goat_jax.eval import extrapolation, plots, sinks

# Thresholds of the checks, in nats over the row median of the log-prior (sinks.sink_margin):
# 1 nat = the marked key is e times likelier a priori than a typical one.
MARGIN = 1.0


def prior_checks(run, seq_len: int = 32) -> dict[str, Any]:
    """Sink / diagonal checks on every layer/head of a GOAT run's prior at ``seq_len`` positions.

    Returns ``{'sink': bool, 'diagonal': bool, 'lag': int, 'sink_margin': [Y, N],
    'lag_margin': [Y, N] (row-median excess at the copy lag), 'best': (layer, head)}``; 'best'
    maximizes min(sink margin, lag margin): the head that shows both, the figure's head.
    """
    lag = int(run.config.data.lag)
    priors = sinks.log_priors(run.model, run.params, seq_len)  # [Y, N, T, S]
    sink_margin = sinks.sink_margin(priors)  # [Y, N]
    max_lag = max(8, lag)
    lag_margin = sinks.lag_profile(priors, max_lag)[..., lag]  # [Y, N]
    best = np.unravel_index(np.argmax(np.minimum(sink_margin, lag_margin)), sink_margin.shape)
    return {"sink": sinks.has_sink_at_zero(priors, MARGIN),
            "diagonal": sinks.has_diagonal_at_lag(priors, lag, MARGIN, max_lag), "lag": lag,
            "sink_margin": sink_margin, "lag_margin": lag_margin,
            "best": (int(best[0]), int(best[1]))}


def heldout_loss(run, num_batches: int = 4, batch_size: int = 32) -> dict[str, float]:
    """Held-out NLL of the run on fresh copy-mixture windows, with the Bayes-optimal entropy
    (the floor) and the uniform guess (log V) for scale."""
    d = run.config.data
    kw = dict(vocab_size=int(d.vocab_size), p_first=float(d.p_first), p_prev=float(d.p_prev), lag=int(d.lag))
    rng = np.random.default_rng([int(run.config.seed), 104729])
    batches = [synthetic.copy_mixture_batch(rng, batch_size, run.train_len, **kw)[0] for _ in range(num_batches)]
    res = extrapolation.perplexity_on_batches(extrapolation.model_apply_fn(run.model), run.params, batches)
    return {"nll": res.nll, "bayes": synthetic.copy_mixture_entropy(run.train_len, **kw),
            "uniform": float(np.log(kw["vocab_size"]))}


def plot_all_heads(run, path: str, seq_len: int = 32) -> str:
    """The four panels of :func:`goat_jax.eval.plots.plot_toy_prior` for every layer/head, one row
    per (layer, head)."""
    cfg = run.model.config
    rows = [(layer, head) for layer in range(cfg.num_layers) for head in range(cfg.num_heads)]
    fig = Figure(figsize=(13, 2.9 * len(rows) + 0.6))
    axes = np.asarray(fig.subplots(len(rows), len(plots.PANELS), squeeze=False))
    comps = {layer: sinks.prior_components(run.model, run.params, layer, seq_len)
             for layer in range(cfg.num_layers)}
    for r, (layer, head) in enumerate(rows):
        for c, panel in enumerate(plots.PANELS):
            # plots has no public per-panel painter; _draw_panel is the one plot_toy_prior uses,
            # so these rows match toy_prior.png exactly.
            plots._draw_panel(axes[r, c], fig, comps[layer], head, panel, small=True)  # pylint: disable=protected-access
            axes[r, c].set_title(f"L{layer} H{head}: {plots._TITLES[panel]}", fontsize=8)  # pylint: disable=protected-access
            axes[r, c].tick_params(labelsize=7)
    fig.suptitle("GOAT prior on the copy mixture, every layer/head")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=80, bbox_inches="tight")
    return path


def summary_text(run, checks: dict[str, Any], loss: dict[str, float], seq_len: int) -> str:
    """The human-readable ``toy_summary.txt``."""
    d = run.config.data
    yes = lambda ok: "YES" if ok else "NO"
    layer, head = checks["best"]
    lines = [
        f"GOAT prior on the copy mixture (V={d.vocab_size}, p_first={d.p_first}, p_prev={d.p_prev}, "
        f"lag={d.lag}); {run.model.config.num_layers} layer(s) x {run.model.config.num_heads} head(s), "
        f"trained {run.step} steps at length {run.train_len}.",
        f"held-out loss {loss['nll']:.3f} nats/token (Bayes-optimal {loss['bayes']:.3f}, uniform "
        f"guess {loss['uniform']:.3f}): {100 * (loss['uniform'] - loss['nll']) / max(loss['uniform'] - loss['bayes'], 1e-9):.0f}% "
        "of the reachable gain.",
        f"sink at position 0: {yes(checks['sink'])} (best head {checks['sink_margin'].max():+.2f} nats "
        f"over the row median; threshold {MARGIN:+.1f})",
        f"diagonal at lag {checks['lag']}: {yes(checks['diagonal'])} (best head "
        f"{checks['lag_margin'].max():+.2f} nats over the row median at lag {checks['lag']})",
        f"figure: layer {layer} head {head}, positions 0..{seq_len - 1}.",
        "",
        "per layer/head (sinks.summarize_prior):",
        sinks.summarize_prior(run.model, run.params, seq_len=seq_len),
    ]
    return "\n".join(lines) + "\n"


def run_toy(config, workdir: str, *, all_heads: bool = False, seq_len: int = 32,
            train: bool = True) -> dict[str, Any]:
    """Trains ``config`` in ``workdir`` (unless ``train`` is False), then writes the figure(s)
    and the summary there. Returns ``{'checks', 'loss', 'summary', 'paths'}``."""
    from goat_jax.eval import lm_run  # pylint: disable=g-import-not-at-top
    from goat_jax.train import trainer  # pylint: disable=g-import-not-at-top

    if train:
        trainer.train_and_evaluate(config, workdir)  # creates workdir once the config is valid
    run = lm_run.load_lm_run(workdir)
    if run.label != "goat":
        raise ValueError(f"the toy prior figure needs a GOAT model, not {run.label!r}.")
    checks = prior_checks(run, seq_len)
    loss = heldout_loss(run)
    layer, head = checks["best"]
    paths = [plots.plot_toy_prior(run.model, run.params, os.path.join(workdir, "toy_prior.png"),
                                  layer=layer, head=head, seq_len=seq_len,
                                  title=f"GOAT prior learned on the copy mixture (layer {layer}, head {head})")]
    if all_heads:
        paths.append(plot_all_heads(run, os.path.join(workdir, "toy_prior_all_heads.png"), seq_len))
    text = summary_text(run, checks, loss, seq_len)
    with open(os.path.join(workdir, "toy_summary.txt"), "w") as f:
        f.write(text)
    paths.append(os.path.join(workdir, "toy_summary.txt"))
    return {"checks": checks, "loss": loss, "summary": text, "paths": paths}
