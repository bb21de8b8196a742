"""The GOAT log-prior as pure functions (no Flax in this package).

GOAT (arXiv 2601.15380, section 3) replaces the hidden uniform prior of softmax attention by a
learned one. For query position ``p_i`` and key position ``p_j`` of head ``h``::

    log pi_h(i, j) = kappa_h(p_i - p_j) + u_h(j)

* ``kappa_h(d) = sum_r A[h, r] cos(w_r d) + B[h, r] sin(w_r d)``: a truncated Fourier series
  in the position difference (translation-equivariant), ``w_r = pos_base ** (-r / max(R-1, 1))``.
* ``u_h(j) = gain_h * mlp(phi(j)) + bump_h * [t_j == 0] + [causal] softplus(slope_h) * t_j``:
  a key-only "sink" term. ``phi(j)`` are absolute Fourier features of the key position plus
  ``t_j / L_n`` and ``log1p(t_j) / log1p(L_n)``.
* Option ``sink_extrapolation='linear'`` (ours, not in the official package; off by default):
  beyond the training window the sink MLP's output continues along a straight line instead of
  being evaluated on inputs it never saw (:func:`sink_mlp_values`; why: docs/extrapolation.md).

The parametrization (names, shapes, initial values, frequency formula, 2D frequency split)
is exactly that of the official PyTorch package ``goat-attention`` 0.1.1, so parameters map
one to one (see ``goat_jax.interop``).

One module per idea; every name is re-exported here, so ``from goat_jax import prior`` and
``prior.log_prior``, ``prior.MAX_POSITION``, ... are all a user needs:

=================  =============================================================================
``settings``       :class:`PriorSettings` (the hyper-parameters, declared once) and
                   :class:`PriorSpec` (plus a layer's head counts)
``positions``      :class:`Positions` (1D, or a 2D grid with CLS), validation against
                   ``MAX_POSITION = 2**24`` (why that bound: its docstring), ``real_dtype``
``angles``         exact rotation angles ``w * p`` at any position (integer phases; also used
                   by RoPE and its variants), why this method: its docstring
``fourier``        frequencies, Fourier features, ``kappa`` (the relative prior)
``sink_term``      ``u(j)``: the sink MLP, its linear extrapolation, bump and recency slope (ALiBi
                   slopes seed it)
``features``       the query/key channels that get packed into q/k, and the dense ``log_prior``
``packing``        the packing itself (``pack_query``, ``pack_key``) and the bf16-exact split of the
                   sink into channels (``split_exact``), also used by the packed baselines
=================  =============================================================================

Imports run one way: settings, positions, angles -> fourier -> sink_term -> features; positions ->
packing.

Shape legend used in docstrings:
  B batch, T query length, S key length, N query heads, K key/value heads, G = N // K,
  R relative rank (``pos_rank``), M absolute rank (``abs_rank``).
"""

from goat_jax.prior import angles
from goat_jax.prior.features import key_features, log_prior, query_features, query_gate, relative_frequencies
from goat_jax.prior.fourier import fourier_features, frequencies, kappa
from goat_jax.prior.positions import (MAX_POSITION, Positions, check_grid, concrete_range, positions_1d,
                                      positions_2d, real_dtype, validate_positions, widen)
from goat_jax.prior.settings import PRIOR_GATES, PRIOR_INITS, SINK_EXTRAPOLATIONS, PriorSettings, PriorSpec
from goat_jax.prior.sink_term import (alibi_slopes, inverse_softplus, sink, sink_mlp, sink_mlp_inputs,
                                      sink_mlp_values)

__all__ = [
    "MAX_POSITION", "PRIOR_GATES", "PRIOR_INITS", "Positions", "PriorSettings", "PriorSpec", "SINK_EXTRAPOLATIONS", "alibi_slopes", "angles",
    "check_grid", "concrete_range", "fourier_features", "frequencies", "inverse_softplus", "kappa",
    "key_features", "log_prior", "positions_1d", "positions_2d", "query_features", "query_gate", "relative_frequencies",
    "real_dtype", "sink", "sink_mlp", "sink_mlp_inputs", "sink_mlp_values", "validate_positions", "widen",
]
