"""Length extrapolation: perplexity of an LM at multiples of its training length.

Protocol (ALiBi paper, Press et al. 2022; docs/protocols.md, Length extrapolation): train at
``L``, evaluate the perplexity of a held-out token stream cut into windows of 1x, 2x, 4x, 8x,
16x ``L``.

* Non-overlapping (default): window ``k`` has inputs ``stream[kW : kW + W]`` and targets
  ``stream[kW + 1 : kW + W + 1]``; every target is scored once, each with a context of 0 to
  W - 1 tokens. The tail that does not fill a window is dropped.
* Sliding (``stride=s``): windows start every ``s`` tokens and only the last ``s`` targets
  of each are scored (every scored token then sees >= W - s tokens of context); the first
  window scores all of its W targets, so every token of the covered stream is scored once.
* BOS windows (``bos_id``; runs trained with ``data.bos_windows``, the official C4 packing):
  window ``k`` has targets ``stream[kW : kW + W]`` and inputs ``[BOS] + stream[kW : kW + W - 1]``,
  so position 0 always holds BOS at every length, as in training and in the official
  evaluation; every target is still scored once (sliding windows likewise, with BOS first).
* Chunked (``nll_fn=goat_jax.eval.chunked.make_chunked_nll_fn(model, C)``): each window runs
  through the KV cache in chunks of C queries, the same numbers with memory bounded by C x W.

``apply_fn(params, tokens [B, T] int32) -> logits [B, T, V]`` is any model (see
:func:`model_apply_fn`); it is jitted once per call and compiled once per window length
(windows are batched, the last batch padded with weight-0 windows to keep the shape).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

ApplyFn = Callable[[Any, jax.Array], jax.Array]
DEFAULT_MULTIPLIERS = (1, 2, 4, 8, 16)


class PerplexityResult(NamedTuple):
    """Mean NLL (nats per scored token), ``exp(nll)`` and the number of scored tokens."""

    nll: float
    ppl: float
    num_tokens: int


def model_apply_fn(model) -> ApplyFn:
    """``(params, tokens) -> logits`` for a Linen LM called as ``model.apply({'params': p}, x)``."""
    return lambda params, tokens: model.apply({"params": params}, tokens)


def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Per-token NLL ``-log softmax(logits)[target]``: [B, T, V], [B, T] -> [B, T] float32
    (log-softmax in float32: a bf16 one loses the digits perplexity is made of)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]


def make_nll_fn(apply_fn: ApplyFn) -> Callable:
    """Jitted ``(params, inputs, targets, weights) -> (sum of w * nll [B], sum of w [B])`` per
    window; it compiles once per input shape, i.e. once per window length and batch size.
    Callers add the per-window sums in float64, so the float32 error does not grow with the
    number of windows."""

    def nll_sums(params, inputs, targets, weights):
        nll = token_nll(apply_fn(params, inputs), targets)
        weights = weights.astype(jnp.float32)
        return jnp.sum(nll * weights, axis=-1), jnp.sum(weights, axis=-1)

    return jax.jit(nll_sums)


def tokens_from_batches(batches: Iterable[Mapping[str, np.ndarray]],
                        bos_windows: bool = False) -> np.ndarray:
    """The flat token stream behind text-pipeline eval batches ([N] int32).

    The eval iterator of :mod:`goat_jax.data.text` cuts the held-out stream, unshuffled, into
    consecutive windows ``w`` with ``inputs = w[:-1]``, ``targets = w[1:]`` and weight 1 on
    real targets; joining ``[inputs[0], targets...]`` of each window over its real tokens gives
    the stream back. With ``bos_windows`` (``data.bos_windows``) ``inputs[0]`` is the BOS the
    packer put in front of every window, not stream text, so only the targets are joined.
    Padding windows (all weights 0) are skipped.
    """
    pieces = []
    for batch in batches:
        inputs, targets = np.asarray(batch["inputs"]), np.asarray(batch["targets"])
        weights = np.asarray(batch["weights"])
        for x, y, w in zip(inputs, targets, weights):
            real = int((w > 0).sum())  # the real targets form a prefix of the window
            if real:
                pieces.append(y[:real] if bos_windows else np.concatenate([x[:1], y[:real]]))
    if not pieces:
        raise ValueError("tokens_from_batches: the batches hold no real (weight > 0) tokens.")
    return np.concatenate(pieces).astype(np.int32)


def window_starts(num_tokens: int, window: int, stride: Optional[int] = None,
                  bos: bool = False) -> np.ndarray:
    """Start offsets of the full windows in a stream: a window takes W + 1 stream tokens (W
    inputs and one target beyond), or W with ``bos`` (BOS is the first input, not stream text)."""
    step = window if stride is None else stride
    if window < 1 or step < 1 or step > window:
        raise ValueError(f"window={window} and stride={stride} must satisfy 1 <= stride <= window.")
    last = num_tokens - window - (0 if bos else 1)
    return np.arange(0, last + 1, step) if last >= 0 else np.zeros((0,), np.int64)


def window_batch(tokens: np.ndarray, starts: np.ndarray, window: int,
                 bos_id: Optional[int] = None) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs, targets)`` [len(starts), W] int32 of the windows starting at ``starts``:
    ``stream[s : s + W]`` and ``stream[s + 1 : s + W + 1]``; with ``bos_id`` (BOS windows)
    ``[BOS] + stream[s : s + W - 1]`` and ``stream[s : s + W]``."""
    if bos_id is None:
        win = tokens[starts[:, None] + np.arange(window + 1)]  # [b, W + 1]
        return win[:, :-1], win[:, 1:]
    targets = tokens[starts[:, None] + np.arange(window)]  # [b, W]
    inputs = np.concatenate([np.full((len(starts), 1), bos_id, np.int32), targets[:, :-1]], axis=1)
    return inputs, targets


def perplexity(apply_fn: ApplyFn, params: Any, tokens: np.ndarray, window: int, *,
               stride: Optional[int] = None, batch_size: Optional[int] = None,
               tokens_per_batch: int = 16384, max_windows: Optional[int] = None,
               nll_fn: Optional[Callable] = None, bos_id: Optional[int] = None) -> PerplexityResult:
    """Perplexity of ``tokens`` [N] at one window length.

    Args:
      window: W, tokens the model sees per window.
      stride: None = non-overlapping windows; else sliding windows every ``stride`` tokens,
        scoring the last ``stride`` targets of each (all W of the first).
      batch_size: windows per forward; default ``max(1, tokens_per_batch // W)``.
      max_windows: evaluate only the first windows (same tokens across models).
      nll_fn: a :func:`make_nll_fn` to reuse (shares its compile cache across calls), or
        :func:`goat_jax.eval.chunked.make_chunked_nll_fn` (KV cache, query chunks).
      bos_id: None = plain windows of the stream; an id = BOS windows (module doc).
    Returns:
      PerplexityResult(nll, ppl, num_tokens). Raises if the stream is shorter than one window.
    """
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    starts = window_starts(len(tokens), window, stride, bos=bos_id is not None)
    if max_windows is not None:
        starts = starts[:max_windows]
    if not len(starts):
        need = f"{window}" if bos_id is not None else f"{window} + 1"
        raise ValueError(f"The token stream ({len(tokens)} tokens) is shorter than one window of "
                         f"{need} tokens; evaluate on more data or shorter windows.")
    nll_fn = nll_fn or make_nll_fn(apply_fn)
    batch_size = min(batch_size or max(1, tokens_per_batch // window), len(starts))
    scored = np.ones(window, np.float32)
    if stride is not None:
        scored[: window - stride] = 0.0  # the first window overrides this below
    total, count = 0.0, 0.0
    for lo in range(0, len(starts), batch_size):
        chunk = starts[lo:lo + batch_size]
        n = len(chunk)
        chunk = np.concatenate([chunk, np.full(batch_size - n, chunk[0])])  # fixed shape
        inputs, targets = window_batch(tokens, chunk, window, bos_id)  # [b, W] each
        weights = np.tile(scored, (batch_size, 1))
        weights[n:] = 0.0
        if lo == 0:
            weights[0] = 1.0
        s, c = nll_fn(params, inputs, targets, weights)
        total = total + np.asarray(s, np.float64).sum()
        count = count + np.asarray(c, np.float64).sum()
    nll = total / count
    return PerplexityResult(nll=nll, ppl=float(np.exp(nll)), num_tokens=int(round(count)))


def perplexity_by_length(apply_fn: ApplyFn, params: Any,
                         data: Union[np.ndarray, Iterable[Mapping[str, np.ndarray]]],
                         train_len: int, multipliers: Sequence[int] = DEFAULT_MULTIPLIERS, *,
                         stride: Optional[int] = None, batch_size: Optional[int] = None,
                         tokens_per_batch: int = 16384, max_tokens: Optional[int] = None,
                         nll_fn: Optional[Callable] = None, bos_id: Optional[int] = None,
                         progress: Optional[Callable[[str], None]] = None
                         ) -> dict[int, PerplexityResult]:
    """Perplexity at window lengths ``m * train_len`` for ``m`` in ``multipliers``.

    Args:
      apply_fn: ``(params, tokens [B, T]) -> logits [B, T, V]``.
      data: a flat token array [N] (numpy or jax), or an iterable of text-pipeline eval
        batches (their stream is recovered with :func:`tokens_from_batches`).
      stride: None = non-overlapping windows (the ALiBi protocol); an int = sliding windows
        with this stride at every length (must be <= the shortest window).
      max_tokens: use only the first ``max_tokens`` tokens of the stream.
      nll_fn: default :func:`make_nll_fn` of ``apply_fn``; pass
        :func:`goat_jax.eval.chunked.make_chunked_nll_fn` for chunked KV-cache evaluation.
      bos_id: BOS windows at every length (module doc); with batches as ``data``, the BOS the
        packer put in front of each window is dropped from the recovered stream.
      progress: called with one line per length (e.g. ``print``).
    Returns:
      ``{window_length: PerplexityResult(nll, ppl, num_tokens)}``; lengths longer than the
      stream are left out (reported through ``progress``).
    """
    tokens = (np.asarray(data) if hasattr(data, "shape")
              else tokens_from_batches(data, bos_windows=bos_id is not None))
    if max_tokens is not None:
        tokens = tokens[:max_tokens]
    nll_fn = nll_fn or make_nll_fn(apply_fn)
    results = {}
    for m in multipliers:
        window = int(m * train_len)
        if not len(window_starts(len(tokens), window, bos=bos_id is not None)):
            if progress:
                progress(f"length {window}: skipped, the stream ({len(tokens)} tokens) holds no full window")
            continue
        t0 = time.time()
        results[window] = r = perplexity(apply_fn, params, tokens, window, stride=stride,
                                         batch_size=batch_size, tokens_per_batch=tokens_per_batch,
                                         nll_fn=nll_fn, bos_id=bos_id)
        if progress:
            progress(f"length {window}: ppl {r.ppl:.4g} over {r.num_tokens} tokens ({time.time() - t0:.1f}s)")
    return results


def perplexity_on_batches(apply_fn: ApplyFn, params: Any,
                          batches: Iterable[Mapping[str, np.ndarray]],
                          nll_fn: Optional[Callable] = None) -> PerplexityResult:
    """Perplexity of batches as they are (``inputs``, ``targets``, ``weights`` [B, T]), e.g. the
    text pipeline's eval iterator at the training length or a synthetic task's. ``nll_fn``:
    as in :func:`perplexity`."""
    nll_fn = nll_fn or make_nll_fn(apply_fn)
    total, count = 0.0, 0.0
    for batch in batches:
        s, c = nll_fn(params, np.asarray(batch["inputs"]), np.asarray(batch["targets"]),
                      np.asarray(batch["weights"], np.float32))
        total = total + np.asarray(s, np.float64).sum()
        count = count + np.asarray(c, np.float64).sum()
    if count == 0:
        raise ValueError("perplexity_on_batches: no scored (weight > 0) tokens.")
    nll = total / count
    return PerplexityResult(nll=nll, ppl=float(np.exp(nll)), num_tokens=int(round(count)))
