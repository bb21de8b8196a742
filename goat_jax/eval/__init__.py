"""Evaluations of the language experiments.

* :mod:`goat_jax.eval.extrapolation` -- perplexity at 1x..16x the training length
  (non-overlapping or sliding windows, BOS windows for ``data.bos_windows`` runs).
* :mod:`goat_jax.eval.chunked` -- the same windows through the KV cache in query chunks
  (memory bounded by chunk x length; the official C4 protocol).
* :mod:`goat_jax.eval.retrieval` -- passkey (synthetic teacher-forced and standard greedy) and
  the NIAH (length x depth) grid.
* :mod:`goat_jax.eval.sinks` -- attention mass on position 0 and first-key norms for any LM;
  the learned GOAT prior (sink ``u(j)``, ``kappa``) and the checks on it.
* :mod:`goat_jax.eval.diagnostics` -- the official C4 run's last-layer attention statistics
  (mass on token 0, max weight, mass on the last 128 keys) at any length, and GOAT's u(j) curves.
* :mod:`goat_jax.eval.context` -- the whole-window evaluations with each window split over
  devices (the ``context`` mesh axis; ``experiments.evaluate --mesh_context N``).
* :mod:`goat_jax.eval.plots` -- the figures (imported lazily: it pulls in matplotlib).
* :mod:`goat_jax.eval.harness` -- EleutherAI's lm-evaluation-harness on a run (``GoatLM``;
  imported on use: it needs the ``[eval]`` extra).

Models enter as ``apply_fn(params, tokens [B, T]) -> logits [B, T, V]``
(:func:`model_apply_fn` makes one from a Linen LM) or, for generation, a ``generate_fn``.
"""

from goat_jax.eval.extrapolation import (PerplexityResult, model_apply_fn, perplexity,
                                         perplexity_by_length, perplexity_on_batches,
                                         tokens_from_batches)
from goat_jax.eval.retrieval import (greedy_generator, niah_accuracy_grid,
                                     passkey_accuracy_standard, passkey_accuracy_synthetic)
from goat_jax.eval.sinks import (has_diagonal_at_lag, has_sink_at_zero, log_priors,
                                 prior_components, sink_statistics, summarize_prior)

__all__ = [
    "PerplexityResult", "greedy_generator", "has_diagonal_at_lag", "has_sink_at_zero",
    "log_priors", "model_apply_fn", "niah_accuracy_grid", "passkey_accuracy_standard",
    "passkey_accuracy_synthetic", "perplexity", "perplexity_by_length", "perplexity_on_batches",
    "prior_components", "sink_statistics", "summarize_prior", "tokens_from_batches",
]
