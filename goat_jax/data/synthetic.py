"""Synthetic sequence tasks for the paper's language experiments: generators and iterators.

Every generator is plain seeded numpy and returns ``(batch, meta)``. ``batch`` has the text
pipeline's format (:mod:`goat_jax.data.text`): each example is a window ``w`` of
``seq_len + 1`` tokens and

    inputs  int32   [B, seq_len]   w[:-1]
    targets int32   [B, seq_len]   w[1:]
    weights float32 [B, seq_len]   1 where the target is scored

``meta`` holds per-example numpy arrays (needle positions, keys, ...); indices into the window
are also indices into ``inputs`` (``inputs[i] = w[i]``) and target index ``i`` predicts
``w[i + 1]``. Lengths are exact: every window has exactly ``seq_len + 1`` tokens.

Tasks:
  copy_mixture_batch   toy copy mixture (paper Figure 1): each token copies the first token,
                       copies an earlier token at a fixed lag, or is uniform noise.
  passkey_batch        official GOAT synthetic passkey: byte-level random a-z filler with
                       "passkey: <8 digits>" at a depth and the query at the end; only the key
                       span at the end is scored (teacher-forced exact match).
  passkey_prompt       standard passkey prompt (Landmark Attention / LongLoRA;
                       docs/protocols.md, Passkey) of an exact token length, for greedy generation.
  niah_batch           synthetic needle-in-a-haystack: random-word haystack, "key=value" needle
                       at depth d, "key=" question at the end, value span scored.

Loss weighting (training only): ``data.span_loss_weight = w`` replaces the span-only weights
of the training batches by :func:`span_loss_weights`, so the trained loss is ``(mean CE over
all targets + w * mean CE over the scored span) / (1 + w)`` (the official synthetic script:
w = 10). Evaluation batches keep the span-only weights: ``eval_loss`` and the retrieval scores
measure the span whatever the training objective.

Training: :class:`SyntheticIterator` wraps any generator as an infinite iterator whose batch at
step ``s`` is drawn from ``default_rng([seed, role, process_index, s])``, so its state is just
``{'step': s}`` (JSON) and ``set_state`` resumes exactly. :func:`make_synthetic_datasets`
mirrors ``text.make_lm_datasets`` for the training engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Optional

from goat_jax import _extras
with _extras.imports(__name__):  # optional packages: one-line error naming the extra
    import ml_collections
import numpy as np

from goat_jax.data import tokenizers as tokenizers_lib
from goat_jax.config.fields import Float, Int, Section, Str

Batch = dict[str, np.ndarray]
Meta = dict[str, np.ndarray]
MakeBatch = Callable[[np.random.Generator], tuple[Batch, Meta]]

_BYTES = tokenizers_lib.ByteTokenizer()
BOS_ID = tokenizers_lib.BOS_ID
KINDS = ("copy_mixture", "passkey", "niah")

# Official GOAT synthetic passkey (docs/protocols.md, Passkey). The query repeats the needle's
# "passkey: " prefix, so retrieval is an induction-style lookup of what followed it.
PASSKEY_NEEDLE = " passkey: {key}. "
PASSKEY_QUERY = " ... passkey: "

# Standard passkey prompt (Landmark Attention, Mohtashami & Jaggi 2023; LongLoRA), joined by
# newlines as in the Landmark code.
PASSKEY_TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
                "memorize them. I will quiz you about the important information there.")
PASSKEY_FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and "
                  "back again.")
PASSKEY_INFO = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key? The pass key is"

# Synthetic NIAH: '=' only ever appears in the needle and the question (the haystack is
# letters and spaces), so the question names the needle unambiguously by its key.
NIAH_NEEDLE = " {key}={value}. "
NIAH_QUESTION = " {key}="


def _encode(text: str) -> np.ndarray:
    return np.asarray(_BYTES.encode(text), np.int32)


def _letters(rng: np.random.Generator, shape) -> np.ndarray:
    """Byte-token ids of uniform random 'a'..'z'."""
    return (rng.integers(ord("a"), ord("z") + 1, size=shape) + 3).astype(np.int32)


def _digits(rng: np.random.Generator, shape) -> np.ndarray:
    """Uniform random decimal digits 0..9 (not token ids)."""
    return rng.integers(0, 10, size=shape).astype(np.int32)


def _digit_tokens(digits: np.ndarray) -> np.ndarray:
    return (digits + ord("0") + 3).astype(np.int32)


def _depths(rng: np.random.Generator, batch_size: int, depth: Optional[float]) -> np.ndarray:
    if depth is None:
        return rng.uniform(0.0, 1.0, batch_size)
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth} must be in [0, 1] (0: needle first, 1: needle last).")
    return np.full(batch_size, float(depth))


def _split(window: np.ndarray) -> Batch:
    """[B, L + 1] windows -> inputs/targets (weights are added by the caller)."""
    return {"inputs": window[:, :-1].copy(), "targets": window[:, 1:].copy()}


def _check_len(seq_len: int, n_filler: int, what: str) -> None:
    if n_filler < 0:
        raise ValueError(f"seq_len={seq_len} is too short for {what}: it needs "
                         f"{seq_len - n_filler} tokens before any filler. Use a longer seq_len.")


# ----------------------------------------------------------------------------------------------
# Toy copy mixture (paper Figure 1)
# ----------------------------------------------------------------------------------------------


def copy_mixture_batch(rng: np.random.Generator, batch_size: int, seq_len: int, *,
                       vocab_size: int = 16, p_first: float = 0.25, p_prev: float = 0.5,
                       lag: int = 1) -> tuple[Batch, Meta]:
    """Windows ``x_0..x_L`` over ``vocab_size`` symbols: ``x_0`` uniform, then each ``x_t`` is
    a copy of ``x_0`` (prob. ``p_first``), a copy of ``x_{t-1-lag}`` (prob. ``p_prev``) or
    uniform noise (the rest; also used for ``p_prev`` while ``t - 1 - lag < 0``).

    ``lag`` is the attention lag ``i - j`` at which the query must look: the query at position
    ``i`` predicts ``x_{i+1}`` and its "previous token" source is ``x_{i-lag}``. ``lag=1``
    (default) is the lag-1 diagonal a GOAT prior should learn, next to its sink at position 0;
    ``lag=0`` (copy the current token) needs no attention at all (the residual stream has it).

    Returns:
      batch: inputs/targets [B, L] int32 in [0, vocab_size), weights [B, L] all ones.
      meta: ``source`` [B, L] int8, the rule that drew ``targets``: 0 noise, 1 first, 2 lag copy.
    """
    if vocab_size < 2 or lag < 0 or not (0 <= p_first and 0 <= p_prev and p_first + p_prev <= 1):
        raise ValueError(f"copy_mixture: need vocab_size >= 2, lag >= 0, p_first, p_prev >= 0 "
                         f"with p_first + p_prev <= 1; got {vocab_size}, {lag}, {p_first}, {p_prev}.")
    x = np.empty((batch_size, seq_len + 1), np.int32)
    x[:, 0] = rng.integers(0, vocab_size, batch_size)
    # Draw sources and noise up front (fixed draw order = determinism), then fill causally.
    u = rng.uniform(size=(batch_size, seq_len))
    source = np.where(u < p_first, 1, np.where(u < p_first + p_prev, 2, 0)).astype(np.int8)
    noise = rng.integers(0, vocab_size, (batch_size, seq_len)).astype(np.int32)
    for t in range(1, seq_len + 1):
        src = source[:, t - 1]
        if t - 1 - lag < 0:
            src = np.where(src == 2, 0, src).astype(np.int8)
            source[:, t - 1] = src
            prev = noise[:, t - 1]
        else:
            prev = x[:, t - 1 - lag]
        x[:, t] = np.where(src == 1, x[:, 0], np.where(src == 2, prev, noise[:, t - 1]))
    batch = _split(x)
    batch["weights"] = np.ones((batch_size, seq_len), np.float32)
    return batch, {"source": source}


def copy_mixture_entropy(seq_len: int, *, vocab_size: int = 16, p_first: float = 0.25,
                         p_prev: float = 0.5, lag: int = 1) -> float:
    """Exact mean conditional entropy (nats per target) of :func:`copy_mixture_batch` windows:
    the loss of the Bayes-optimal predictor, i.e. the best reachable eval NLL.

    The next token depends on the past only through ``x_0`` and the lag source ``c``; its
    entropy depends only on whether ``c == x_0``, whose probability follows the recursion
    ``P(x_s = x_0) = p_first + p_prev P(x_{s-1-lag} = x_0) + p_noise / V``.
    """
    v, p_n = vocab_size, 1.0 - p_first - p_prev

    def entropy(probs):
        probs = np.asarray([p for p in probs if p > 0])
        return float(-(probs * np.log(probs)).sum())

    rest = [p_n / v] * (v - 2)
    h_start = entropy([p_first + (p_prev + p_n) / v] + [(p_prev + p_n) / v] * (v - 1))
    h_eq = entropy([p_first + p_prev + p_n / v] + [p_n / v] * (v - 1))
    h_neq = entropy([p_first + p_n / v, p_prev + p_n / v] + rest)
    p_eq = np.zeros(seq_len + 1)  # p_eq[s] = P(x_s == x_0)
    p_eq[0] = 1.0
    total = 0.0
    for t in range(1, seq_len + 1):
        s = t - 1 - lag
        if s < 0:
            p_eq[t] = p_first + (p_prev + p_n) / v
            total += h_start
        else:
            p_eq[t] = p_first + p_prev * p_eq[s] + p_n / v
            total += p_eq[s] * h_eq + (1.0 - p_eq[s]) * h_neq
    return total / seq_len


def copy_mixture_log_probs(inputs, *, vocab_size: int = 16, p_first: float = 0.25,
                           p_prev: float = 0.5, lag: int = 1):
    """The Bayes-optimal next-token log-probabilities for :func:`copy_mixture_batch`.

    Args:
      inputs: [B, L] int (numpy or jax; jit-compatible).
    Returns:
      [B, L, V] float32 jax array: ``log p(targets[:, i] = v | inputs[:, :i+1])``.
    """
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

    inputs = jnp.asarray(inputs, jnp.int32)
    length, v, p_n = inputs.shape[1], vocab_size, 1.0 - p_first - p_prev
    first = jnp.eye(v, dtype=jnp.float32)[inputs[:, :1]]  # [B, 1, V]
    # Source of query i is inputs[i - lag]; before it exists the lag rule falls back to noise.
    src = jnp.eye(v, dtype=jnp.float32)[jnp.roll(inputs, lag, axis=1)]  # [B, L, V]
    has_src = (jnp.arange(length) >= lag)[None, :, None]
    probs = (p_first * first + jnp.where(has_src, p_prev * src, p_prev / v) + p_n / v)
    return jnp.log(probs)


# ----------------------------------------------------------------------------------------------
# Passkey: official GOAT synthetic variant (byte level, teacher forced)
# ----------------------------------------------------------------------------------------------


def passkey_batch(rng: np.random.Generator, batch_size: int, seq_len: int, *,
                  depth: Optional[float] = None, key_len: int = 8) -> tuple[Batch, Meta]:
    """Synthetic passkey windows (byte tokens, vocab 259)::

        [BOS] filler[:k] " passkey: DDDDDDDD. " filler[k:] " ... passkey: " DDDDDDDD

    with random a-z filler of exactly the length that makes ``seq_len + 1`` tokens and
    ``k = round(depth * n_filler)``. Only the final key span is scored.

    Args:
      depth: fraction of the filler before the needle; None draws U[0, 1] per example.
      key_len: digits of the key.
    Returns:
      batch: inputs/targets [B, seq_len] int32, weights [B, seq_len] = 1 exactly on the last
        ``key_len`` targets (the key after the query).
      meta: ``depth`` [B], ``needle_start`` [B] (window index of the needle's first token),
        ``key_start`` [B] (window index of the needle's first digit), ``key`` [B, key_len]
        digits, ``answer_start`` [B] (target index of the first scored digit).
    """
    needle_len = len(PASSKEY_NEEDLE.format(key="0" * key_len))
    prefix = _encode(PASSKEY_NEEDLE.split("{key}")[0])
    suffix = _encode(PASSKEY_NEEDLE.split("{key}")[1])
    query = _encode(PASSKEY_QUERY)
    n_filler = seq_len + 1 - 1 - needle_len - len(query) - key_len
    _check_len(seq_len, n_filler, f"the passkey needle, query and a {key_len}-digit key")
    depths = _depths(rng, batch_size, depth)
    keys = _digits(rng, (batch_size, key_len))
    filler = _letters(rng, (batch_size, n_filler))
    cut = np.rint(depths * n_filler).astype(np.int64)
    window = np.empty((batch_size, seq_len + 1), np.int32)
    for b in range(batch_size):
        key = _digit_tokens(keys[b])
        window[b] = np.concatenate([[BOS_ID], filler[b, :cut[b]], prefix, key, suffix,
                                    filler[b, cut[b]:], query, key])
    batch = _split(window)
    batch["weights"] = np.zeros((batch_size, seq_len), np.float32)
    batch["weights"][:, seq_len - key_len:] = 1.0
    meta = {"depth": depths, "needle_start": 1 + cut, "key_start": 1 + cut + len(prefix),
            "key": keys, "answer_start": np.full(batch_size, seq_len - key_len)}
    return batch, meta


# ----------------------------------------------------------------------------------------------
# Passkey: standard prompt (Landmark / LongLoRA), scored by greedy generation
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PasskeyPrompt:
    """One standard passkey prompt.

    Attributes:
      tokens: [length] int32, the prompt exactly ``length`` tokens long (BOS first if any).
      answer: the pass key N; correct iff the first integer generated equals it.
      needle_start: index of the first token of "The pass key is N. ..." in ``tokens``.
      needle_len: tokens of that sentence.
      depth: fraction of the filler tokens before the needle.
    """

    tokens: np.ndarray = dataclasses.field(repr=False)
    answer: int
    needle_start: int
    needle_len: int
    depth: float


# The largest key of the standard passkey prompt (keys are drawn from [1, PASSKEY_MAX_KEY]).
PASSKEY_MAX_KEY = 50000


def passkey_prompt_length(key: int = PASSKEY_MAX_KEY, tokenizer: Optional[tokenizers_lib.Tokenizer] = None,
                          add_bos: bool = True) -> int:
    """The shortest :func:`passkey_prompt` with ``key``: the task, needle and question without
    filler (the evaluations skip shorter lengths)."""
    tok = tokenizer or _BYTES
    pieces = (PASSKEY_TASK, "\n", "\n", PASSKEY_INFO.format(key=key), "\n", "\n", PASSKEY_QUESTION)
    return int(add_bos) + sum(len(tok.encode(p)) for p in pieces)


def passkey_prompt(length: int, depth: float, key: int,
                   tokenizer: Optional[tokenizers_lib.Tokenizer] = None,
                   add_bos: bool = True) -> PasskeyPrompt:
    """The standard passkey prompt of exactly ``length`` tokens::

        [BOS] TASK \\n filler[:k] \\n "The pass key is N. Remember it. N is the pass key." \\n
        filler[k:] \\n "What is the pass key? The pass key is"

    The filler is the tokenized "The grass is green. ..." unit repeated and cut to the number
    of tokens that makes the prompt exactly ``length`` long; ``k = round(depth * n_filler)``.
    Pieces are tokenized separately (exact for the byte tokenizer, the default; a subword
    tokenizer may merge differently across piece boundaries than on the joined text).
    """
    tok = tokenizer or _BYTES
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth} must be in [0, 1].")
    enc = lambda s: np.asarray(tok.encode(s), np.int32)
    head = np.concatenate([[tok.bos_id] if add_bos else [], enc(PASSKEY_TASK), enc("\n")]).astype(np.int32)
    info = enc(PASSKEY_INFO.format(key=key))
    newline, tail = enc("\n"), np.concatenate([enc("\n"), enc(PASSKEY_QUESTION)])
    n_filler = length - len(head) - 2 * len(newline) - len(info) - len(tail)
    _check_len(length, n_filler, "the passkey task, needle and question")
    unit = enc(PASSKEY_FILLER + " ")
    filler = np.tile(unit, -(-n_filler // len(unit)))[:n_filler]
    k = int(round(depth * n_filler))
    tokens = np.concatenate([head, filler[:k], newline, info, newline, filler[k:], tail]).astype(np.int32)
    return PasskeyPrompt(tokens=tokens, answer=int(key), needle_start=len(head) + k + len(newline),
                         needle_len=len(info), depth=float(depth))


def passkey_prompts(rng: np.random.Generator, num: int, length: int, *,
                    depths: Optional[np.ndarray] = None,
                    tokenizer: Optional[tokenizers_lib.Tokenizer] = None) -> list[PasskeyPrompt]:
    """``num`` standard prompts of ``length`` tokens; keys uniform in [1, 50000] (Landmark);
    depths given ([num]) or U[0, 1]."""
    keys = rng.integers(1, PASSKEY_MAX_KEY + 1, num)
    depths = rng.uniform(0.0, 1.0, num) if depths is None else np.asarray(depths, np.float64)
    return [passkey_prompt(length, float(d), int(k), tokenizer) for k, d in zip(keys, depths)]


# ----------------------------------------------------------------------------------------------
# Synthetic needle in a haystack
# ----------------------------------------------------------------------------------------------


def niah_batch(rng: np.random.Generator, batch_size: int, seq_len: int, *,
               depth: Optional[float] = None, key_len: int = 5,
               value_len: int = 6) -> tuple[Batch, Meta]:
    """One (length, depth) cell of the synthetic NIAH grid (byte tokens, vocab 259)::

        [BOS] hay[:k] " kkkkk=vvvvvv. " hay[k:] " kkkkk=" vvvvvv

    The haystack is random words (a-z runs separated by spaces, mean length 5) of exactly
    the length that makes ``seq_len + 1`` tokens; ``k = round(depth * n_hay)``. The key is
    ``key_len`` random letters, the value ``value_len`` random digits; the value span at the
    end is scored (teacher-forced span token accuracy).

    Returns:
      batch: inputs/targets [B, seq_len] int32, weights = 1 on the last ``value_len`` targets.
      meta: ``depth`` [B], ``needle_start`` [B] (window index of the needle's first token),
        ``key`` [B, key_len] token ids, ``value`` [B, value_len] digits, ``answer_start`` [B].
    """
    needle_len = len(NIAH_NEEDLE.format(key="k" * key_len, value="0" * value_len))
    question_len = len(NIAH_QUESTION.format(key="k" * key_len))
    n_hay = seq_len + 1 - 1 - needle_len - question_len - value_len
    _check_len(seq_len, n_hay, "the NIAH needle, question and answer")
    depths = _depths(rng, batch_size, depth)
    keys = _letters(rng, (batch_size, key_len))
    values = _digits(rng, (batch_size, value_len))
    hay = _letters(rng, (batch_size, n_hay))
    hay = np.where(rng.uniform(size=hay.shape) < 0.2, ord(" ") + 3, hay).astype(np.int32)
    cut = np.rint(depths * n_hay).astype(np.int64)
    space, eq, stop = _encode(" "), _encode("="), _encode(". ")
    window = np.empty((batch_size, seq_len + 1), np.int32)
    for b in range(batch_size):
        value = _digit_tokens(values[b])
        window[b] = np.concatenate([[BOS_ID], hay[b, :cut[b]], space, keys[b], eq, value, stop,
                                    hay[b, cut[b]:], space, keys[b], eq, value])
    batch = _split(window)
    batch["weights"] = np.zeros((batch_size, seq_len), np.float32)
    batch["weights"][:, seq_len - value_len:] = 1.0
    meta = {"depth": depths, "needle_start": 1 + cut, "key": keys, "value": values,
            "answer_start": np.full(batch_size, seq_len - value_len)}
    return batch, meta


def span_loss_weights(span: np.ndarray, span_loss_weight: float) -> np.ndarray:
    """Per-target weights for ``(global + w * span) / (1 + w)`` (docs/protocols.md, Passkey).

    With these weights the weighted mean cross-entropy of each example, and so of a batch (the
    engine divides the weighted sum by the summed weight), is ``(mean over its T targets + w *
    mean over its scored span) / (1 + w)``: each row is ``(1 / T + w * span / K) / (1 + w)``
    with ``K`` its number of scored targets, and sums to 1, so examples count equally (for a
    fixed span length, as passkey and NIAH have, this is also the batch-level mean of each term).

    Args:
      span: [B, T] the span-only weights of a batch (1 on the scored targets, 0 elsewhere).
      span_loss_weight: ``w >= 0``.
    Returns:
      [B, T] float32.
    """
    span = np.asarray(span, np.float64)
    if not span_loss_weight >= 0:
        raise ValueError(f"span_loss_weight must be >= 0, got {span_loss_weight}.")
    if span.ndim != 2 or np.any((span != 0) & (span != 1)):
        raise ValueError(f"span must be a [batch, length] 0/1 mask, got shape {span.shape}.")
    count = span.sum(axis=-1, keepdims=True)
    if np.any(count == 0):
        raise ValueError("span_loss_weights: every example needs at least one scored target.")
    weights = (1.0 / span.shape[-1] + span_loss_weight * span / count) / (1.0 + span_loss_weight)
    return weights.astype(np.float32)


# ----------------------------------------------------------------------------------------------
# Resumable iterators and the engine-facing entry point
# ----------------------------------------------------------------------------------------------

_TRAIN, _EVAL = 0, 1  # rng stream roles: eval batches never coincide with training batches


class SyntheticIterator:
    """Infinite iterator over ``make_batch(rng)`` batches with a JSON state ``{'step': s}``.

    The batch of step ``s`` uses ``np.random.default_rng([seed, role, process_index, s])``:
    independent of how many batches were drawn before, so ``set_state({'step': s})`` resumes
    exactly, and hosts (``process_index``) draw disjoint streams.

    Args:
      make_batch: ``rng -> (batch, meta)``, e.g. ``functools.partial(passkey_batch,
        batch_size=8, seq_len=1024)``.
      with_meta: also yield the meta arrays (merged into the batch dict under their names);
        off for training so batches hold only the keys the trainer shards.
    """

    def __init__(self, make_batch: MakeBatch, seed: int, *, process_index: int = 0,
                 with_meta: bool = False, role: int = _TRAIN):
        if seed < 0:
            raise ValueError(f"seed={seed} must be >= 0.")
        self._make_batch, self._seed = make_batch, int(seed)
        self._process_index, self._with_meta, self._role = int(process_index), with_meta, role
        self._step = 0

    def __iter__(self) -> "SyntheticIterator":
        return self

    def __next__(self) -> Batch:
        rng = np.random.default_rng([self._seed, self._role, self._process_index, self._step])
        batch, meta = self._make_batch(rng)
        self._step += 1
        return {**batch, **meta} if self._with_meta else batch

    def get_state(self) -> dict[str, Any]:
        """``{'step': int}``: the number of batches handed out."""
        return {"step": self._step}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continues as if ``state['step']`` batches had been drawn."""
        self._step = int(state["step"])


@dataclasses.dataclass(frozen=True)
class IntegerTokenizer:
    """The copy-mixture "tokenizer": symbols are their own ids (no specials). Satisfies the
    ``Tokenizer`` protocol so the engine can check ``model.vocab_size`` against it."""

    vocab_size: int
    pad_id: int = -1
    bos_id: int = -1
    eos_id: int = -1

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


# Every field of default_synthetic_config(), declared once: default, type, range, doc (the
# engine checks FIELD_SPECS, which adds ``source``, before any work).
SYNTHETIC = Section(
    kind=("copy_mixture", Str(choices=KINDS)),
    vocab_size=(16, Int(min=2, doc="copy_mixture: number of symbols")),
    p_first=(0.25, Float(min=0.0, max=1.0, doc="copy_mixture: probability of copying the first token; p_first + p_prev <= 1")),
    p_prev=(0.5, Float(min=0.0, max=1.0, doc="copy_mixture: probability of copying the token at lag; p_first + p_prev <= 1")),
    lag=(1, Int(min=0, doc="copy_mixture: attention lag of the copy (1: the token before the current one; 0: the current token)")),
    key_len=(8, Int(min=1, doc="passkey: digits of the key")),
    niah_key_len=(5, Int(min=1, doc="NIAH: letters of the key")),
    niah_value_len=(6, Int(min=1, doc="NIAH: digits of the value (the scored span)")),
    depth=(-1.0, Float(max=1.0, doc="needle depth in [0, 1]; < 0: uniform random per example")),
    span_loss_weight=(None, Float(min=0.0, optional=True,
                                  doc="None: span-only loss; w: (all + w span) / (1 + w); official 10")),
    num_eval_batches=(8, Int(min=1, doc="batches per make_eval_iter() call")),
)
FIELD_SPECS = {"source": Str(choices=("synthetic",)), **SYNTHETIC.specs}


def is_synthetic(config: Any) -> bool:
    """Whether a run's whole ``config`` (a ConfigDict or dict; an old run's config.json may leave
    fields out) trains on these generators (``data.source = 'synthetic'``) rather than on text:
    the one place that is decided (the LM task, the evaluations, the compile tool ask here)."""
    data = config.get("data") if config is not None else None
    return data is not None and data.get("source") == "synthetic"


def default_synthetic_config(kind: str = "copy_mixture") -> ml_collections.ConfigDict:
    """Data config of a synthetic task (the ``data`` section of an experiment config)."""
    c = SYNTHETIC.defaults()
    c.kind = kind
    return c


def make_batch_fn(data_config: ml_collections.ConfigDict, batch_size: int, seq_len: int) -> MakeBatch:
    """``rng -> (batch, meta)`` for ``data_config.kind`` at this batch size and length."""
    c = data_config
    depth = None if c.depth < 0 else float(c.depth)
    if c.kind == "copy_mixture":
        return lambda rng: copy_mixture_batch(rng, batch_size, seq_len, vocab_size=c.vocab_size,
                                              p_first=c.p_first, p_prev=c.p_prev, lag=c.lag)
    if c.kind == "passkey":
        return lambda rng: passkey_batch(rng, batch_size, seq_len, depth=depth, key_len=c.key_len)
    if c.kind == "niah":
        return lambda rng: niah_batch(rng, batch_size, seq_len, depth=depth,
                                      key_len=c.niah_key_len, value_len=c.niah_value_len)
    raise ValueError(f"data.kind={c.kind!r} is unknown: use one of {KINDS}.")


def make_synthetic_datasets(data_config: ml_collections.ConfigDict, *, seq_len: int,
                            global_batch_size: int, seed: int, process_index: int = 0,
                            process_count: int = 1):
    """Synthetic counterpart of ``text.make_lm_datasets``.

    Returns:
      (train_iter, make_eval_iter, tokenizer): ``train_iter`` is a :class:`SyntheticIterator`
      of this host's ``global_batch_size // process_count`` examples per batch (weights from
      :func:`span_loss_weights` when ``span_loss_weight`` is set);
      ``make_eval_iter()`` returns a fresh finite iterator of ``num_eval_batches`` batches,
      the same ones every call (a stream disjoint from training); ``tokenizer`` is the byte
      tokenizer (passkey, NIAH) or an :class:`IntegerTokenizer` (copy mixture).
    """
    if process_count < 1 or global_batch_size % process_count or global_batch_size < 1:
        raise ValueError(f"global_batch_size={global_batch_size} must be a positive multiple of "
                         f"process_count={process_count}.")
    make_batch = make_batch_fn(data_config, global_batch_size // process_count, seq_len)
    weight = data_config.get("span_loss_weight")

    def weighted_batch(rng):  # the training objective only; eval batches keep span weights
        batch, meta = make_batch(rng)
        return {**batch, "weights": span_loss_weights(batch["weights"], weight)}, meta

    train = SyntheticIterator(make_batch if weight is None else weighted_batch, seed,
                              process_index=process_index)

    def make_eval_iter() -> Iterator[Batch]:
        it = SyntheticIterator(make_batch, seed, process_index=process_index, role=_EVAL)
        return (next(it) for _ in range(data_config.num_eval_batches))

    tokenizer = (IntegerTokenizer(data_config.vocab_size) if data_config.kind == "copy_mixture"
                 else tokenizers_lib.ByteTokenizer())
    return train, make_eval_iter, tokenizer

