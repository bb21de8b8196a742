"""Retrieval evaluations: passkey (both variants) and needle-in-a-haystack, by length / depth.

* Synthetic passkey (official GOAT experiments): teacher-forced exact match of the 8-digit key
  span at the end of :func:`goat_jax.data.synthetic.passkey_batch` windows.
* Standard passkey (Landmark Attention / LongLoRA): the prompt of
  :func:`goat_jax.data.synthetic.passkey_prompt`, greedy decoding with the KV cache
  (:func:`goat_jax.models.sampling.generate`); correct iff the first integer in the generated
  text equals the pass key.
* NIAH (gkamradt grid, GOAT synthetic variant): teacher-forced span token accuracy (and exact
  match) of the value span for every (length, depth) cell.

Teacher-forced scores take ``apply_fn(params, tokens [B, T]) -> logits [B, T, V]`` (see
``extrapolation.model_apply_fn``); generation takes a ``generate_fn(prompts [B, P],
max_new_tokens) -> tokens [B, P + max_new_tokens]`` (see :func:`greedy_generator`). Every
cell draws its examples from ``default_rng([seed, length, ...])``, so results do not depend on
which other lengths are evaluated. All functions return plain dicts of floats / numpy arrays.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from goat_jax.data import synthetic
from goat_jax.data import tokenizers as tokenizers_lib

ApplyFn = Callable[[Any, jax.Array], jax.Array]
GenerateFn = Callable[[np.ndarray, int], np.ndarray]


# ----------------------------------------------------------------------------------------------
# Teacher-forced span scores
# ----------------------------------------------------------------------------------------------


def make_span_fn(apply_fn: ApplyFn) -> Callable:
    """Jitted ``(params, inputs, targets, weights) -> (correct [B], scored [B])``: per example,
    the number of weighted targets whose argmax prediction is right, and of weighted targets."""

    def span(params, inputs, targets, weights):
        pred = jnp.argmax(apply_fn(params, inputs), axis=-1)  # [B, T]
        scored = weights > 0
        correct = jnp.sum((pred == targets) & scored, axis=-1)
        return correct, jnp.sum(scored, axis=-1)

    return jax.jit(span)


def span_scores(apply_fn: ApplyFn, params: Any, batches: Iterable[Mapping[str, np.ndarray]],
                span_fn: Optional[Callable] = None) -> dict[str, np.ndarray]:
    """Teacher-forced scores of the weighted span of every example.

    Returns:
      ``{'correct': [N], 'scored': [N], 'token_accuracy': [N], 'exact_match': [N] bool}`` over
      the examples of ``batches`` (each with ``inputs``, ``targets``, ``weights`` [B, T]) that
      have at least one weighted target; all-zero-weight rows are padding and are dropped.
    """
    span_fn = span_fn or make_span_fn(apply_fn)
    correct, scored = [], []
    for batch in batches:
        c, s = span_fn(params, np.asarray(batch["inputs"]), np.asarray(batch["targets"]),
                       np.asarray(batch["weights"]))
        correct.append(np.asarray(c))
        scored.append(np.asarray(s))
    correct, scored = np.concatenate(correct), np.concatenate(scored)
    keep = scored > 0  # rows with nothing scored are padding
    correct, scored = correct[keep], scored[keep]
    return {"correct": correct, "scored": scored,
            "token_accuracy": correct / np.maximum(scored, 1),
            "exact_match": (correct == scored) & (scored > 0)}


def _cell_batches(make_batch, num_examples: int, batch_size: int, rng: np.random.Generator):
    """Batches of ``make_batch(rng, batch_size)`` covering ``num_examples``; surplus rows of the
    last batch get weight 0 (dropped by :func:`span_scores`) so the shape, and the compiled
    function, stay the same."""
    done = 0
    while done < num_examples:
        batch, _ = make_batch(rng, batch_size)
        n = min(batch_size, num_examples - done)
        batch["weights"][n:] = 0.0
        done += n
        yield batch


def _depth_key(depth: Optional[float]) -> int:
    return 1_000_001 if depth is None else int(round(depth * 1e6))


def passkey_accuracy_synthetic(apply_fn: ApplyFn, params: Any, lengths: Sequence[int], *,
                               num_examples: int = 32, batch_size: int = 8,
                               depth: Optional[float] = None, key_len: int = 8,
                               seed: int = 0) -> dict[int, float]:
    """Synthetic passkey accuracy by length: the fraction of examples whose whole key span is
    predicted exactly (teacher forced). Chance is ``10 ** -key_len``.

    Args:
      lengths: model input lengths (``seq_len`` of :func:`synthetic.passkey_batch`).
      depth: fixed needle depth, or None for U[0, 1] per example.
    Returns:
      ``{length: accuracy}``.
    """
    span_fn = make_span_fn(apply_fn)
    out = {}
    for length in lengths:
        rng = np.random.default_rng([seed, length, _depth_key(depth)])
        make = lambda r, b, length=length: synthetic.passkey_batch(r, b, length, depth=depth,
                                                                   key_len=key_len)
        scores = span_scores(apply_fn, params, _cell_batches(make, num_examples, batch_size, rng),
                             span_fn)
        out[int(length)] = float(scores["exact_match"].mean())
    return out


def niah_accuracy_grid(apply_fn: ApplyFn, params: Any, lengths: Sequence[int],
                       depths: Sequence[float], *, num_examples: int = 16, batch_size: int = 8,
                       key_len: int = 5, value_len: int = 6, seed: int = 0) -> dict[str, np.ndarray]:
    """Synthetic NIAH over the (length x depth) grid, teacher forced.

    Returns:
      ``{'lengths': [nL], 'depths': [nD], 'token_accuracy': [nL, nD] (mean fraction of value
      tokens predicted right; chance ~ 1/10 for a digit guesser), 'exact_match': [nL, nD]}``.
    """
    span_fn = make_span_fn(apply_fn)
    token_acc = np.zeros((len(lengths), len(depths)))
    exact = np.zeros_like(token_acc)
    for a, length in enumerate(lengths):
        for b, depth in enumerate(depths):
            rng = np.random.default_rng([seed, length, _depth_key(depth)])
            make = lambda r, n, length=length, depth=depth: synthetic.niah_batch(
                r, n, length, depth=depth, key_len=key_len, value_len=value_len)
            scores = span_scores(apply_fn, params,
                                 _cell_batches(make, num_examples, batch_size, rng), span_fn)
            token_acc[a, b] = scores["token_accuracy"].mean()
            exact[a, b] = scores["exact_match"].mean()
    return {"lengths": np.asarray(lengths), "depths": np.asarray(depths, np.float64),
            "token_accuracy": token_acc, "exact_match": exact}


# ----------------------------------------------------------------------------------------------
# Standard passkey: greedy generation
# ----------------------------------------------------------------------------------------------


def greedy_generator(model, params: Any) -> GenerateFn:
    """``generate_fn`` decoding greedily with the KV cache (``models.sampling.generate``).

    A GOAT model needs ``training_seq_len`` set to decode (its sink normalization must not
    follow the growing cache length).
    """
    from goat_jax.models import sampling  # pylint: disable=g-import-not-at-top

    def generate_fn(prompts: np.ndarray, max_new_tokens: int) -> np.ndarray:
        out = sampling.generate(model, params, jnp.asarray(prompts, jnp.int32), max_new_tokens,
                                use_cache=True)
        return np.asarray(out)

    return generate_fn


def first_integer(text: str) -> Optional[int]:
    """The first run of decimal digits in ``text`` as an int, or None (Landmark scoring)."""
    match = re.search(r"\d+", text)
    return int(match.group()) if match else None


def passkey_accuracy_standard(generate_fn: GenerateFn, lengths: Sequence[int], *,
                              num_trials: int = 8, batch_size: int = 4,
                              depths: Optional[Sequence[float]] = None,
                              tokenizer: Optional[tokenizers_lib.Tokenizer] = None,
                              max_new_tokens: int = 10, seed: int = 0) -> dict[int, float]:
    """Standard passkey accuracy by prompt length (in tokens).

    Each trial is a :func:`synthetic.passkey_prompt` with a key in [1, 50000]; the model
    continues it for ``max_new_tokens`` tokens and is right iff the first integer in the
    decoded continuation equals the key.

    Args:
      generate_fn: ``(prompts [B, P] int32, max_new_tokens) -> [B, P + max_new_tokens]``.
      depths: needle depths cycled over the trials; None draws U[0, 1] per trial.
      tokenizer: encodes the prompt and decodes the answer; default bytes.
    Returns:
      ``{length: accuracy}``.
    """
    tok = tokenizer or tokenizers_lib.ByteTokenizer()
    out = {}
    for length in lengths:
        rng = np.random.default_rng([seed, length])
        trial_depths = None if depths is None else np.resize(np.asarray(depths, np.float64), num_trials)
        prompts = synthetic.passkey_prompts(rng, num_trials, length, depths=trial_depths, tokenizer=tok)
        correct = []
        for lo in range(0, num_trials, batch_size):
            chunk = prompts[lo:lo + batch_size]
            tokens = np.stack([p.tokens for p in chunk])  # all exactly `length` long
            # Pad the last batch with copies so every call has one shape (one compile).
            tokens = np.concatenate([tokens, np.repeat(tokens[:1], batch_size - len(chunk), 0)])
            generated = np.asarray(generate_fn(tokens, max_new_tokens))[:len(chunk), length:]
            correct += [first_integer(tok.decode(g)) == p.answer for g, p in zip(generated, chunk)]
        out[int(length)] = float(np.mean(correct))
    return out
