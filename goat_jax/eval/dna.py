"""Evaluation of genome language models: NLL per base, next-base accuracy, GC agreement.

Likelihood (:func:`score_by_length`). Each record (chromosome, or a held-out region) is cut into
non-overlapping windows of W bases (inputs ``r[kW : kW + W]``, targets one base later); windows
never cross records and a record's tail that does not fill a window is left out. Over every
target of every window: NLL in nats per base, bits per base (``nll / ln 2``), perplexity
``exp(nll)`` and next-base accuracy (argmax == target). Targets that are N (an unknown base:
assembly gaps, and IUPAC codes read as N) are not bases to predict: they are left out of all
four and counted (``excluded_n``), as training gives them weight 0 (goat_jax/data/dna.py); they
stay in the inputs. Records with nothing left to score are an error naming them. Lengths are
multiples of the training length L (1x, 2x, 4x, 8x).

GC agreement (:func:`gc_agreement`). The official GOAT code reports a "GC% agreement" Pearson r
without defining it; goat-jax defines it as follows (docs/experiments.md, section DNA):

1. Take N >= 256 held-out windows of 400 bases, evenly spaced over the held-out records (window
   k starts at ``floor(k * S / N)`` of the S possible starts, all records concatenated, a window
   never crossing records); windows that contain an N are skipped, and their number reported.
2. Prompt the model with the first 200 bases of each window and sample 200 more at temperature 1
   (plain softmax sampling, no top-k, with the KV cache).
3. GC fraction of a sequence = (C + G) / (A + C + G + T), N excluded.
4. ``r_model`` = Pearson r over the windows between the GC fraction of each sample and that of
   the true next 200 bases.

Two references need no model and bound what the number means: ``r_prompt`` = r between the
prompt's own GC fraction and the true continuation's (a model that only copies the prompt's
composition scores about this), and ``r_halves`` = r between the GC fractions of the two 100-base
halves of the true continuation (the agreement of real sequence with itself at this scale).

Shape legend: N windows, P prompt length, C continuation length, W window length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from goat_jax.data.fasta import ALPHABET, N_ID
from goat_jax.eval.extrapolation import ApplyFn, token_nll, window_starts

DEFAULT_MULTIPLIERS = (1, 2, 4, 8)
_GC = np.array([c in "CG" for c in ALPHABET])  # id -> is C or G
_ACGT = np.array([c != "N" for c in ALPHABET])  # id -> is a called base


class DnaScores(NamedTuple):
    """Mean NLL (nats per base), bits per base, perplexity, next-base accuracy, bases scored,
    and the N targets of the same windows left out."""

    nll: float
    bits_per_base: float
    ppl: float
    accuracy: float
    num_bases: int
    excluded_n: int = 0


def make_score_fn(apply_fn: ApplyFn) -> Callable:
    """Jitted ``(params, inputs, targets, weights) -> (nll sums [B], correct sums [B], weights [B])``
    per window (compiled once per window length and batch size)."""

    def sums(params, inputs, targets, weights):
        logits = apply_fn(params, inputs)  # [B, W, V]
        nll = token_nll(logits, targets)  # [B, W] float32
        correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
        w = weights.astype(jnp.float32)
        return jnp.sum(nll * w, -1), jnp.sum(correct * w, -1), jnp.sum(w, -1)

    return jax.jit(sums)


def score_records(apply_fn: ApplyFn, params: Any, records: Sequence[np.ndarray], window: int, *,
                  batch_size: Optional[int] = None, tokens_per_batch: int = 16384,
                  max_windows: Optional[int] = None, score_fn: Optional[Callable] = None,
                  where: str = "the records") -> DnaScores:
    """:class:`DnaScores` of non-overlapping windows of ``window`` bases over ``records``; N
    targets are left out and counted (module docstring).

    Args:
      records: token-id arrays [n_r], one per record (windows never cross them).
      batch_size: windows per forward; default ``max(1, tokens_per_batch // window)``.
      max_windows: score only the first windows (in record order).
      score_fn: a :func:`make_score_fn` to reuse (keeps its compile cache across lengths).
      where: names the records in errors (e.g. the file and record names).
    Raises:
      ValueError: no record holds a window of ``window + 1`` bases, or every target of the
        windows is N (nothing to score), naming ``where``.
    """
    wins = [(r, s) for r, rec in enumerate(records) for s in window_starts(len(rec), window)]
    if max_windows is not None:
        wins = wins[:max_windows]
    if not wins:
        longest = max((len(r) for r in records), default=0)
        raise ValueError(f"No record holds a window of {window} + 1 bases (the longest of "
                         f"{where} has {longest}); evaluate on longer sequences or shorter windows.")
    score_fn = score_fn or make_score_fn(apply_fn)
    batch_size = min(batch_size or max(1, tokens_per_batch // window), len(wins))
    offsets = np.arange(window + 1)
    total = np.zeros(3, np.float64)  # nll, correct, count; float64 so error does not grow with N
    excluded = 0
    for lo in range(0, len(wins), batch_size):
        part = wins[lo:lo + batch_size]
        real = len(part)
        part = part + [part[0]] * (batch_size - len(part))  # fixed shape: one compile per length
        win = np.stack([np.asarray(records[r][s + offsets], np.int32) for r, s in part])  # [B, W+1]
        weights = np.zeros((batch_size, window), np.float32)
        called = win[:real, 1:] != N_ID  # an N target is no base to predict
        weights[:real] = called
        excluded += int(called.size - called.sum())
        out = score_fn(params, win[:, :-1], win[:, 1:], weights)
        total += [np.asarray(x, np.float64).sum() for x in out]
    if not total[2]:
        raise ValueError(f"{where}: every target of the {len(wins)} window(s) of {window} bases is N "
                         f"({excluded} N targets): nothing to score. Evaluate on sequence that "
                         "holds called bases (A, C, G, T).")
    nll = total[0] / total[2]
    return DnaScores(nll=float(nll), bits_per_base=float(nll / np.log(2)),
                     ppl=float(np.exp(nll)), accuracy=float(total[1] / total[2]),
                     num_bases=int(round(total[2])), excluded_n=excluded)


def score_by_length(apply_fn: ApplyFn, params: Any, records: Sequence[np.ndarray],
                    train_len: int, multipliers: Sequence[int] = DEFAULT_MULTIPLIERS,
                    **kwargs) -> dict[int, DnaScores]:
    """``{m * train_len: DnaScores}`` (see :func:`score_records` for ``kwargs``); lengths that no
    record can hold are left out, and none fitting is a ValueError naming ``kwargs['where']``."""
    score_fn = make_score_fn(apply_fn)
    out = {}
    for m in multipliers:
        window = int(m * train_len)
        if any(len(r) >= window + 1 for r in records):
            out[window] = score_records(apply_fn, params, records, window, score_fn=score_fn, **kwargs)
    if not out:
        shortest = int(min(multipliers) * train_len)
        raise ValueError(f"{kwargs.get('where', 'the records')}: no record holds a window of "
                         f"{shortest} + 1 bases (the longest has {max((len(r) for r in records), default=0)}): "
                         "nothing to score. Evaluate on longer sequences or shorter --lengths.")
    return out


# ----------------------------------------------------------------------------------------
# GC agreement.


def gc_fraction(ids: np.ndarray) -> np.ndarray:
    """(C + G) / (A + C + G + T) over the last axis: [..., n] -> [...] float64 (NaN if no A/C/G/T)."""
    ids = np.asarray(ids)
    called = _ACGT[ids].sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(called > 0, _GC[ids].sum(-1) / np.maximum(called, 1), np.nan)


def pearson_r(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson correlation of two [N] samples in float64 (NaN when either is constant)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.shape != y.shape or x.ndim != 1 or len(x) < 2:
        raise ValueError(f"pearson_r needs two [N] arrays with N >= 2, got {x.shape} and {y.shape}.")
    dx, dy = x - x.mean(), y - y.mean()
    denom = np.sqrt((dx * dx).sum() * (dy * dy).sum())
    return float((dx * dy).sum() / denom) if denom > 0 else float("nan")


def gc_windows(records: Sequence[np.ndarray], *, num_windows: int = 256, length: int = 400
               ) -> tuple[np.ndarray, int]:
    """``(windows [N, length], number skipped for holding an N)``, evenly spaced (see module doc).

    Raises ValueError if the records hold fewer than ``num_windows`` N-free windows.
    """
    if num_windows < 2:
        raise ValueError(f"num_windows={num_windows} must be >= 2 (a correlation needs two points).")
    counts = np.array([max(len(r) - length + 1, 0) for r in records], np.int64)
    total = int(counts.sum())
    bounds = np.concatenate([[0], np.cumsum(counts)])
    chosen, skipped = [], 0
    # Candidates at evenly spaced global starts; more are tried (denser) when some hold N.
    for factor in (1, 2, 4, 8, 16):
        n_try = min(total, num_windows * factor)
        chosen, skipped = [], 0
        for g in np.unique((np.arange(n_try) * total) // max(n_try, 1)):
            r = int(np.searchsorted(bounds, g, side="right") - 1)
            win = np.asarray(records[r][g - bounds[r]:g - bounds[r] + length])
            if (win == N_ID).any():
                skipped += 1
                continue
            chosen.append(win)
        if len(chosen) >= num_windows or n_try == total:
            break
    if len(chosen) < num_windows:
        raise ValueError(f"The sequences hold {len(chosen)} windows of {length} bases without N "
                         f"(of {total} possible starts); GC agreement needs num_windows="
                         f"{num_windows}. Use more held-out sequence or fewer windows.")
    idx = np.linspace(0, len(chosen) - 1, num_windows).round().astype(int)
    return np.stack([chosen[i] for i in idx]).astype(np.int32), skipped


class GCAgreement(NamedTuple):
    """GC agreement over ``num_windows`` windows (see the module docstring)."""

    r_model: float  # r(GC of the sample, GC of the true continuation)
    r_prompt: float  # r(GC of the prompt, GC of the true continuation): no model
    r_halves: float  # r(GC of the continuation's first half, of its second half): no model
    mean_gc_sample: float
    mean_gc_true: float
    num_windows: int


def gc_agreement(sample_fn: Callable[[np.ndarray], np.ndarray], windows: np.ndarray, *,
                 prompt_len: int = 200) -> GCAgreement:
    """GC agreement of ``sample_fn`` on ``windows`` [N, P + C].

    Args:
      sample_fn: prompts [N, P] int32 -> continuations [N, C] (the model's samples).
      windows: held-out windows; the first ``prompt_len`` bases prompt, the rest is the truth.
    """
    windows = np.asarray(windows)
    prompts, truth = windows[:, :prompt_len], windows[:, prompt_len:]
    c = truth.shape[1]
    if c < 2:
        raise ValueError(f"windows of {windows.shape[1]} bases leave {c} after a prompt of "
                         f"{prompt_len}; the continuation needs >= 2.")
    samples = np.asarray(sample_fn(prompts))
    if samples.shape != truth.shape:
        raise ValueError(f"sample_fn returned {samples.shape}, expected {truth.shape}.")
    gc_true, gc_sample = gc_fraction(truth), gc_fraction(samples)
    ok = ~np.isnan(gc_sample)  # a sample of only N has no GC fraction: left out, not zeroed
    return GCAgreement(
        r_model=pearson_r(gc_sample[ok], gc_true[ok]),
        r_prompt=pearson_r(gc_fraction(prompts), gc_true),
        r_halves=pearson_r(gc_fraction(truth[:, :c // 2]), gc_fraction(truth[:, c // 2:])),
        mean_gc_sample=float(np.nanmean(gc_sample)), mean_gc_true=float(gc_true.mean()),
        num_windows=int(ok.sum()))


def model_sampler(model, params: Any, *, sample_len: int = 200, temperature: float = 1.0,
                  batch_size: int = 64, seed: int = 0) -> Callable[[np.ndarray], np.ndarray]:
    """A ``sample_fn`` for :func:`gc_agreement`: KV-cache sampling of ``sample_len`` bases at
    ``temperature`` with :func:`goat_jax.models.sampling.generate`, ``batch_size`` prompts at a time
    (the last batch padded by repeating a prompt, so one compile serves every batch)."""
    from goat_jax.models import sampling  # pylint: disable=g-import-not-at-top

    def sample(prompts: np.ndarray) -> np.ndarray:
        outs = []
        for i, lo in enumerate(range(0, len(prompts), batch_size)):
            part = np.asarray(prompts[lo:lo + batch_size], np.int32)
            n = len(part)
            part = np.concatenate([part, np.repeat(part[:1], batch_size - n, 0)])
            rng = jax.random.fold_in(jax.random.PRNGKey(seed), i)
            out = sampling.generate(model, params, jnp.asarray(part), sample_len, rng,
                                    temperature=temperature)
            outs.append(np.asarray(out)[:n, part.shape[1]:])
        return np.concatenate(outs)

    return sample


# ----------------------------------------------------------------------------------------
# One model on FASTA files (what `experiments.evaluate --evals dna` runs).


def read_fasta_records(paths: Sequence[str], max_bases: Optional[int] = None
                       ) -> tuple[list[np.ndarray], dict[str, Any]]:
    """``(records as int32 id arrays, info)`` of FASTA ``paths`` (record order, files in order),
    cut to the first ``max_bases`` bases in all when given. ``info`` holds the record names,
    lengths used and IUPAC codes read as N."""
    from goat_jax.data import fasta as fasta_lib  # pylint: disable=g-import-not-at-top

    genome = fasta_lib.Genome(list(paths))
    records, names, left = [], [], max_bases
    for name in genome.names:  # fetch only what is kept: an indexed genome is read a slice at a time
        n = genome.lengths[name] if left is None else min(left, genome.lengths[name])
        if n <= 0:
            break
        records.append(genome.fetch(name, 0, n).astype(np.int32))
        names.append(name)
        left = None if left is None else left - n
    info = {"files": list(paths), "records": names, "bases": [len(r) for r in records],
            "ambiguous_as_n": {n: genome.ambiguous[n] for n in names if genome.ambiguous[n]}}
    return records, info


def first_bases(records: Sequence[np.ndarray], names: Sequence[str], max_bases: Optional[int]
                ) -> tuple[list[np.ndarray], list[str]]:
    """The first ``max_bases`` bases of in-memory ``records`` in order (all when None): whole
    records, then a prefix of the next one, and their names."""
    out, kept, left = [], [], max_bases
    for rec, name in zip(records, names):
        if left is not None and left <= 0:
            break
        out.append(rec if left is None else rec[:left])
        kept.append(name)
        left = None if left is None else left - len(out[-1])
    return out, kept


def heldout_records(data_config, split: str = "valid") -> tuple[list[np.ndarray], dict[str, Any]]:
    """``(records as int32 id arrays, info)`` of a FASTA data config's held-out ``split``
    ('valid' or 'test': the pieces of ``data.valid_records`` / ``data.test_records``, e.g. the
    last 10% of E. coli in configs/dna_tiny.py); ``info``: files, records named
    ``NAME:START-END`` (1-based, inclusive), their lengths, and ``n_bases`` (N ids among them).
    :func:`first_bases` cuts them to a budget."""
    import glob  # pylint: disable=g-import-not-at-top

    from goat_jax.data import dna as dna_data  # pylint: disable=g-import-not-at-top
    from goat_jax.data import fasta as fasta_lib  # pylint: disable=g-import-not-at-top

    if data_config.source != "fasta":
        raise ValueError(f"heldout_records reads FASTA data; data.source={data_config.source!r} "
                         "(score parquet chunks through the trainer's eval split instead).")
    if split not in dna_data.EVAL_SPLITS:
        raise ValueError(f"split={split!r} must be one of {dna_data.EVAL_SPLITS}.")
    patterns = [data_config.paths] if isinstance(data_config.paths, str) else list(data_config.paths)
    files = [f for p in patterns for f in (sorted(glob.glob(p)) or [p])]
    genome = fasta_lib.Genome(files, max_in_memory_bytes=data_config.max_in_memory_bytes)
    pieces = dna_data.split_pieces(data_config, genome.lengths, allow_regions=True)[split]
    if not pieces:
        raise ValueError(f"data.{split}_records is empty: the config holds nothing out for {split!r}.")
    records = [genome.fetch(name, a, b).astype(np.int32) for name, a, b in pieces]
    names = [f"{name}:{a + 1}-{b}" for name, a, b in pieces]
    info = {"files": files, "records": names, "bases": [len(r) for r in records],
            "n_bases": int(sum(int((r == N_ID).sum()) for r in records))}  # N or IUPAC read as N
    return records, info


def evaluate_records(model, params: Any, records: Sequence[np.ndarray], train_len: int, *,
                     multipliers: Sequence[int] = DEFAULT_MULTIPLIERS,
                     lengths: Optional[Sequence[int]] = None, gc_records: Optional[Sequence[np.ndarray]] = None,
                     gc_num_windows: int = 256, gc_prompt_len: int = 200, gc_sample_len: int = 200,
                     seed: int = 0, tokens_per_batch: int = 16384,
                     where: str = "the records", apply_fn: Optional[ApplyFn] = None) -> dict[str, Any]:
    """Likelihood at ``m * train_len`` (or at ``lengths`` bases) of a Linen LM on ``records``,
    and GC agreement on ``gc_records`` (default: ``records``).

    Returns a JSON-able dict: ``{'by_length': {W: DnaScores as dict}, 'gc': GCAgreement as dict
    (or {'error': reason} when the sequence is too short)}``. Lengths longer than every record
    are left out. ``gc_num_windows=0`` skips the GC metric. ``where`` names the records in
    errors (nothing to score: every target N). ``apply_fn``: how the likelihoods call the model
    (default ``model.apply`` on ``params``; each window split over devices:
    :func:`goat_jax.eval.context.apply_fn`); the GC samples always run ``model`` unsplit.
    """
    if apply_fn is None:
        apply_fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    if lengths:
        scores = score_by_length(apply_fn, params, records, 1, list(lengths),
                                 tokens_per_batch=tokens_per_batch, where=where)
    else:
        scores = score_by_length(apply_fn, params, records, train_len, multipliers,
                                 tokens_per_batch=tokens_per_batch, where=where)
    out: dict[str, Any] = {"by_length": {w: s._asdict() for w, s in scores.items()}}
    if gc_num_windows:
        try:
            windows, skipped = gc_windows(records if gc_records is None else gc_records,
                                          num_windows=gc_num_windows, length=gc_prompt_len + gc_sample_len)
        except ValueError as e:
            out["gc"] = {"error": str(e)}
        else:
            sampler = model_sampler(model, params, sample_len=gc_sample_len, seed=seed)
            gc = gc_agreement(sampler, windows, prompt_len=gc_prompt_len)._asdict()
            out["gc"] = {**gc, "windows_skipped_for_n": skipped}
    return out


def evaluate_fasta(model, params: Any, paths: Sequence[str], train_len: int, *,
                   max_bases: Optional[int] = None, **kwargs) -> dict[str, Any]:
    """:func:`evaluate_records` on the records of FASTA ``paths`` (the first ``max_bases`` bases
    in all when given), with ``'data'``: :func:`read_fasta_records`'s info."""
    records, info = read_fasta_records(paths, max_bases)
    where = f"{', '.join(paths)} (records {info['records'][:10]}" + (
        f", first {max_bases} bases)" if max_bases else ")")
    return {"data": info, **evaluate_records(model, params, records, train_len, where=where, **kwargs)}
