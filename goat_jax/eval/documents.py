"""Scoring packed documents (``data.packing='documents'``; docs/packing.md): held-out documents
packed into windows with segment ids, each document attended and positioned as if alone.

* :func:`document_batches`: the held-out split of a text run packed as ``'documents'`` at any
  window length (the run's own pipeline and tokenizer, whatever packing it trained with), so
  runs of either packing are scored on the same documents.
* :func:`document_perplexity`: perplexity over those documents (padding has weight 0).
* :func:`document_first_mass`: per layer, the attention mass each query puts on the first token
  of *its own document* (the sink of the paper's account, which 'concat' windows lose: there
  "position 0" is wherever a window starts), averaged over heads and over the queries at
  document positions >= 1.
* :func:`eval_documents`: both, at ``m x`` the training length (perplexity) and the training
  length (mass), for ``experiments.evaluate --evals documents``.

Shape legend: Y layers, B windows, N heads, T tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from goat_jax import _extras
with _extras.imports(__name__):  # optional packages: one-line error naming the extra
    import ml_collections

from goat_jax.data import text
from goat_jax.eval import extrapolation, sinks
from goat_jax.tasks import lm as lm_task

Batch = dict[str, np.ndarray]
DOCUMENT_FIELDS = ("inputs", "targets", "weights", "segment_ids", "positions")


def document_batches(run, length: Optional[int] = None, max_windows: int = 32,
                     batch_size: int = 8, platform: Optional[str] = None) -> list[Batch]:
    """Up to ``max_windows`` held-out windows of ``length`` tokens (default: the training
    length) with whole documents packed first-fit (``goat_jax.data.packing``), in batches of
    ``batch_size``; the last batch may hold weight-0 padding windows. Where cuDNN's packed
    layout may attend them (``platform``, default this host's devices; one device per window),
    no window holds more documents than the run's ``model.max_documents_per_row``
    (:func:`goat_jax.tasks.lm.document_bound`), as in training.

    Raises:
      ValueError for a synthetic-task run (its examples are not documents).
    """
    if run.is_synthetic:
        raise ValueError(f"run {run.label!r} is a synthetic-task run; packed documents need a text run.")
    data = ml_collections.ConfigDict(run.config.data.to_dict())
    data.packing, data.bos_windows = "documents", False  # every document starts with its own BOS
    data.num_eval_batches = max(1, -(-max_windows // batch_size))
    data.read_threads = 1
    config = ml_collections.ConfigDict({**run.config.to_dict(), "data": data.to_dict()})
    bound = lm_task.document_bound(config, run.plan, platform or jax.devices()[0].platform, 1)
    _, make_eval, _ = text.make_lm_datasets(
        data, seq_len=int(length or run.train_len), global_batch_size=batch_size,
        seed=int(run.config.seed), process_index=0, process_count=1, max_documents=bound)
    batches = [{k: np.asarray(b[k]) for k in DOCUMENT_FIELDS} for b in make_eval()]
    return [b for b in batches if b["weights"].any()]


def _check_batch(batch: Batch) -> None:
    missing = [k for k in DOCUMENT_FIELDS if k not in batch]
    if missing:
        raise ValueError(f"packed-document batches need {list(DOCUMENT_FIELDS)}; this one lacks "
                         f"{missing} (build them with document_batches).")


@functools.partial(jax.jit, static_argnums=0)
def _nll_sums(model, params, batch):
    logits = model.apply({"params": params}, batch["inputs"], segment_ids=batch["segment_ids"],
                         positions=batch["positions"])
    nll = extrapolation.token_nll(logits, batch["targets"])
    w = batch["weights"].astype(jnp.float32)
    return jnp.sum(nll * w), jnp.sum(w)


def document_perplexity(model, params, batches: Sequence[Batch]) -> dict[str, float]:
    """``{'ppl', 'nll', 'tokens'}``: mean NLL (nats) over the real targets of packed-document
    batches, each document attended and positioned alone (segment ids and positions)."""
    params = params.get("params", params)
    total, weight = 0.0, 0.0
    for batch in batches:
        _check_batch(batch)
        s, w = _nll_sums(model, params, {k: jnp.asarray(batch[k]) for k in DOCUMENT_FIELDS})
        total, weight = total + float(s), weight + float(w)
    if weight == 0:
        raise ValueError("the batches hold no real targets (all weights are 0).")
    nll = total / weight
    return {"ppl": float(np.exp(min(nll, 50.0))), "nll": float(nll), "tokens": int(weight)}


@functools.partial(jax.jit, static_argnums=0)
def _first_mass(model, params, batch):
    """[Y, N] mass on each query's document start, summed over the selected queries, and the count."""
    _, state = model.apply({"params": params}, batch["inputs"], segment_ids=batch["segment_ids"],
                           positions=batch["positions"], mutable=["intermediates"])
    pos = batch["positions"]
    t = pos.shape[1]
    start = jnp.arange(t)[None, :] - pos  # [B, T] index of each token's document start
    # Queries at document position >= 1 (position 0 can only attend to itself), not padding.
    keep = ((pos >= 1) & (batch["weights"] > 0)).astype(jnp.float32)  # [B, T]
    out = []
    for i in range(model.config.num_layers):
        probs = state["intermediates"][f"layer_{i}"]["attention"]["attention_probs"][0]  # [B, N, T, S]
        mass = jnp.take_along_axis(probs, start[:, None, :, None], axis=-1)[..., 0]  # [B, N, T]
        out.append(jnp.sum(mass * keep[:, None], axis=(0, 2)))
    return jnp.stack(out), jnp.sum(keep)


def document_first_mass(model, params, batches: Sequence[Batch]) -> np.ndarray:
    """[Y, N]: per layer and head, the mean attention mass a query puts on the first token of
    its own document, over the queries at document positions >= 1 (padding excluded). Runs the
    'dense' kernel (the probabilities are sown by the layers): O(T^2) memory per layer."""
    model, params = sinks._unscanned(model, params)  # pylint: disable=protected-access
    total, count = 0.0, 0.0
    for batch in batches:
        _check_batch(batch)
        s, c = _first_mass(model, params, {k: jnp.asarray(batch[k]) for k in DOCUMENT_FIELDS})
        total, count = total + np.asarray(s, np.float64), count + float(c)
    if count == 0:
        raise ValueError("no query at a document position >= 1: the documents are all one token long.")
    return total / count


def eval_documents(run, multipliers: Sequence[int] = (1,), *, max_windows: int = 32) -> dict[str, Any]:
    """``{'ppl': {length: {'ppl', 'nll', 'tokens'}}, 'first_mass': [Y] (mean head),
    'first_mass_max_head': [Y], 'length': L}``: packed-document perplexity at ``m x`` the
    training length (a window of ``m L`` holds documents of up to ``m L`` tokens whole) and the
    mass on each document's first token at the training length."""
    ppl = {}
    for m in multipliers:
        length = int(m * run.train_len)
        ppl[length] = document_perplexity(run.model, run.params,
                                          document_batches(run, length, max(1, max_windows // m)))
    mass = document_first_mass(run.model, run.params, document_batches(run, run.train_len, max_windows))
    return {"length": run.train_len, "ppl": ppl, "first_mass": mass.mean(-1).tolist(),
            "first_mass_max_head": mass.max(-1).tolist()}
