"""EleutherAI's lm-evaluation-harness on any goat-jax language run (the ``[eval]`` extra).

    from goat_jax.eval import harness
    lm = harness.GoatLM.from_workdir("runs/tiny")       # read-only, like every evaluation
    results = harness.evaluate(lm, ["hellaswag"], num_fewshot=0)

:class:`GoatLM` implements lm-eval's ``LM`` interface (``loglikelihood``,
``loglikelihood_rolling``, ``generate_until``) over a run read with
:func:`goat_jax.eval.lm_run.load_lm_run`, with the run's own tokenizer (``data.tokenizer``:
bytes, SentencePiece or GPT-2 BPE; never retrained). How requests become model inputs:

* Every sequence starts with the tokenizer's BOS, as every training document did; an empty
  context is thus scored given BOS alone (lm-eval's prefix token).
* Context and continuation are encoded as lm-eval's Hugging Face model does: trailing spaces of
  the context move to the continuation, ``whole = encode(context + continuation)`` and the
  continuation is what ``whole`` adds after ``encode(context)``.
* The window is the training length ``config.seq_len`` (``max_length=`` overrides it). A
  context longer than the window is truncated from the left (its oldest tokens are dropped),
  as lm-eval expects; each call logs how many requests were truncated. A continuation that
  alone exceeds the window is an error.
* Log-probabilities are a float32 log-softmax of the model's logits, summed in float64 on the
  host; ``is_greedy`` says whether every continuation token is the argmax. Requests run in
  batches of ``batch_size``, longest first, padded on the right to a power-of-two length
  (causal attention makes the padding invisible; one compile per length bucket). A run on a
  context mesh (``experiments.evaluate --mesh_context N``, :func:`goat_jax.eval.context.on_mesh`)
  scores each batch split over the devices (:func:`goat_jax.eval.context.apply_fn`), its length
  rounded up to a multiple the shards divide (:func:`goat_jax.eval.context.window_multiple`;
  the window ``max_length`` must be one), and decodes ``generate_until`` with the KV cache's
  slots split over them (goat_jax/kernels/decode_merge.py): the same scores and tokens as on
  one device, up to float rounding.
* ``loglikelihood_rolling`` cuts a document into lm-eval's disjoint rolling windows of
  ``max_length`` predictions (each token predicted once, with as much context as fits).
* ``generate_until`` decodes with the KV cache (:func:`goat_jax.models.sampling.generate`),
  greedy unless the task asks for ``do_sample`` with a positive ``temperature``; it generates
  ``max_gen_toks`` tokens (default 256), then cuts at the first EOS and the first ``until``
  string. The context is left-truncated to ``max_length - max_gen_toks`` tokens. Requests
  with equal prompt length and arguments share a batch (prompts are never padded). Prompt
  lengths in the same ``prefill_multiple`` bucket (default 64 tokens) share one compile: the
  whole multiples are prefilled in one chunk and the rest fed one token at a time, with the
  tokens of an exact-length decode (``sampling.generate``'s ``prefill_multiple``); a real
  task's hundreds of prompt lengths thus compile ``max_length / 64`` decoders at most, not one
  each.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from goat_jax import _extras

with _extras.imports(__name__):  # optional packages: one-line error naming the extra
    from lm_eval import utils as lm_utils
    from lm_eval.api.model import LM

from goat_jax.data import synthetic
from goat_jax.data import tokenizers as tokenizers_lib
from goat_jax.eval import context as context_lib
from goat_jax.eval import lm_run
from goat_jax.kernels import mesh as kernels_mesh
from goat_jax.models import sampling

log = logging.getLogger(__name__)

MIN_BUCKET = 16  # shortest padded length: fewer compiles for short requests
_GEN_KWARGS = {"until", "max_gen_toks", "do_sample", "temperature", "top_k"}


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    return int(value)


def bucket_length(n: int, max_length: int) -> int:
    """The padded length of an input of ``n`` tokens: the next power of two >= ``MIN_BUCKET``,
    capped at ``max_length``."""
    return min(max_length, max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length()))


class GoatLM(LM):
    """lm-eval's ``LM`` over a goat-jax language run.

    Args:
      run: a :class:`goat_jax.eval.lm_run.LMRun` (``load_lm_run``) of a text run.
      batch_size: requests per forward pass.
      max_length: the window in tokens (default: the run's training length ``seq_len``).
      max_gen_toks: tokens ``generate_until`` generates when the task does not say.
      prefill_multiple: ``generate_until``'s compile bucket in prompt tokens (see the module
        docstring); 1 prefills every prompt in one chunk and compiles per length.
    """

    def __init__(self, run: Any, *, batch_size: int = 8, max_length: Optional[int] = None,
                 max_gen_toks: int = 256, prefill_multiple: int = 64):
        super().__init__()
        if synthetic.is_synthetic(run.config):
            raise ValueError(f"{run.workdir}: a synthetic-task run has no text tokenizer; "
                             "lm-eval needs a run trained on text (data.source != 'synthetic').")
        self.batch_size = _positive_int("batch_size", batch_size)
        self.max_length = _positive_int("max_length", max_length if max_length is not None
                                        else int(run.config.seq_len))
        if self.max_length < 2:
            raise ValueError(f"max_length must be >= 2 (a context and a prediction), got {self.max_length}.")
        self.max_gen_toks = _positive_int("max_gen_toks", max_gen_toks)
        self.prefill_multiple = _positive_int("prefill_multiple", prefill_multiple)
        self.run = run
        self.model, self.params = run.model, run.params
        self.tokenizer = tokenizers_lib.make_tokenizer(run.config.data, allow_training=False)
        self.prefix_token_id = int(self.tokenizer.bos_id)
        # experiments.evaluate --mesh_context: each batch split over the context devices of the
        # run's mesh (goat_jax/eval/context.py), its length a multiple of what they divide.
        self.mesh = getattr(run, "mesh", None)
        self.length_multiple = 1
        model = self.model
        apply = lambda params, inputs: model.apply({"params": params}, inputs)  # noqa: E731
        if self.mesh is not None:
            shards = kernels_mesh.context_shards(self.mesh)
            self.length_multiple = context_lib.window_multiple(run.config, shards)
            if self.max_length % self.length_multiple:
                raise ValueError(f"max_length={self.max_length}: with the window split over {shards} devices "
                                 f"(--mesh_context {shards}) it must be a multiple of {self.length_multiple}; "
                                 f"give --lm_eval_max_length a multiple of {self.length_multiple}.")
            apply = context_lib.apply_fn(model, self.mesh, run.config)

        def score(params, inputs, targets):
            logits = apply(params, inputs)  # [B, L, V]
            logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
            target_logp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
            return target_logp, jnp.argmax(logits, axis=-1) == targets

        self._score = jax.jit(score)

    @classmethod
    def from_workdir(cls, workdir: str, step: Optional[int] = None, **kwargs) -> "GoatLM":
        """Reads ``workdir`` (read-only: safe while it trains) and wraps it; ``kwargs`` as
        :class:`GoatLM`."""
        return cls(lm_run.load_lm_run(workdir, step), **kwargs)

    # --- tokenization -------------------------------------------------------------------------

    def tok_encode(self, text: str) -> list[int]:
        """The run's tokenizer, without BOS/EOS."""
        return list(self.tokenizer.encode(text))

    def tok_decode(self, ids: Sequence[int]) -> str:
        """Ids -> text (special ids dropped)."""
        return self.tokenizer.decode(ids)

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.tok_encode(context + continuation)
        context_ids = self.tok_encode(context)
        return [self.prefix_token_id] + context_ids, whole[len(context_ids):]

    # --- scoring ------------------------------------------------------------------------------

    def _loglikelihood_tokens(self, pairs: Sequence[tuple[list[int], list[int]]],
                              what: str = "loglikelihood") -> list[tuple[float, bool]]:
        """``(sum log p(continuation | context), is_greedy)`` per ``(context ids, continuation
        ids)`` pair; the context holds BOS already and is left-truncated to the window."""
        window = self.max_length
        rows, truncated = [], 0
        for context, continuation in pairs:
            if not continuation:
                raise ValueError(f"{what}: an empty continuation has no log-likelihood.")
            if len(continuation) > window:
                raise ValueError(f"{what}: a continuation of {len(continuation)} tokens exceeds "
                                 f"the model's window of {window} tokens; pass a larger "
                                 "max_length (--lm_eval_max_length) or a shorter task.")
            sequence = (list(context) + list(continuation))[-(window + 1):]
            truncated += len(context) + len(continuation) > window + 1
            rows.append((sequence[:-1], sequence[1:], len(continuation)))
        if truncated:
            log.warning("%s: %d of %d contexts are longer than the model's window of %d tokens "
                        "and were truncated from the left.", what, truncated, len(rows), window)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))  # longest first
        out: list[Optional[tuple[float, bool]]] = [None] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            length = bucket_length(len(rows[chunk[0]][0]), window)
            length = -(-length // self.length_multiple) * self.length_multiple  # <= window, its multiple
            inputs = np.full((self.batch_size, length), self.tokenizer.pad_id, np.int32)
            targets = np.zeros((self.batch_size, length), np.int32)
            for r, i in enumerate(chunk):
                x, y, _ = rows[i]
                inputs[r, :len(x)], targets[r, :len(y)] = x, y
            logp, greedy = jax.device_get(self._score(self.params, inputs, targets))
            for r, i in enumerate(chunk):
                n, k = len(rows[i][0]), rows[i][2]
                out[i] = (float(np.sum(logp[r, n - k:n], dtype=np.float64)), bool(np.all(greedy[r, n - k:n])))
        return out  # type: ignore[return-value]

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        """lm-eval: ``(log p(continuation | context), is_greedy)`` per ``(context,
        continuation)`` request."""
        pairs = [self._encode_pair(*req.args) for req in requests]
        results = self._loglikelihood_tokens(pairs)
        for req, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", req.args, result)
        return results

    def loglikelihood_rolling(self, requests) -> list[float]:
        """lm-eval: the log-likelihood of each whole string, given BOS, over disjoint rolling
        windows of ``max_length`` predictions."""
        pairs, owner = [], []
        for index, req in enumerate(requests):
            windows = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(req.args[0]), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)
            for context, continuation in map(lm_utils.make_disjoint_window, windows):
                pairs.append((context, continuation))
                owner.append(index)
        totals = [0.0] * len(requests)
        for index, (value, _) in zip(owner, self._loglikelihood_tokens(pairs, "loglikelihood_rolling")):
            totals[index] += value
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # --- generation ---------------------------------------------------------------------------

    def _gen_options(self, kwargs: Optional[dict]) -> tuple[tuple[str, ...], int, float, Optional[int]]:
        kwargs = dict(kwargs or {})
        unknown = sorted(set(kwargs) - _GEN_KWARGS)
        if unknown:
            log.warning("generate_until: ignoring generation arguments %s (supported: %s).",
                        unknown, sorted(_GEN_KWARGS))
        until = kwargs.get("until") or ()
        until = (until,) if isinstance(until, str) else tuple(until)
        max_new = _positive_int("max_gen_toks", kwargs.get("max_gen_toks", self.max_gen_toks))
        if max_new >= self.max_length:
            raise ValueError(f"generate_until: max_gen_toks={max_new} leaves no room for a context "
                             f"in the model's window of {self.max_length} tokens.")
        sample = bool(kwargs.get("do_sample", False)) and float(kwargs.get("temperature", 0.0)) > 0
        temperature = float(kwargs.get("temperature", 0.0)) if sample else 0.0
        top_k = kwargs.get("top_k") if sample else None
        return until, max_new, temperature, top_k

    def generate_until(self, requests) -> list[str]:
        """lm-eval: a continuation of each ``(context, gen_kwargs)`` request, cut at the first
        EOS and the first ``until`` string (see the module docstring)."""
        jobs, truncated = [], 0
        for req in requests:
            context, kwargs = req.args[0], (req.args[1] if len(req.args) > 1 else {})
            until, max_new, temperature, top_k = self._gen_options(kwargs)
            prompt = [self.prefix_token_id] + self.tok_encode(context)
            keep = self.max_length - max_new
            truncated += len(prompt) > keep
            jobs.append((prompt[-keep:], until, max_new, temperature, top_k))
        if truncated:
            log.warning("generate_until: %d of %d contexts are longer than the model's window of "
                        "%d tokens minus max_gen_toks and were truncated from the left.",
                        truncated, len(jobs), self.max_length)
        groups: dict[tuple, list[int]] = {}
        for i, (prompt, _, max_new, temperature, top_k) in enumerate(jobs):
            groups.setdefault((len(prompt), max_new, temperature, top_k), []).append(i)
        out: list[str] = [""] * len(jobs)
        for (_, max_new, temperature, top_k), members in groups.items():
            for start in range(0, len(members), self.batch_size):
                chunk = members[start:start + self.batch_size]
                prompts = np.asarray([jobs[i][0] for i in chunk], np.int32)
                rng = jax.random.PRNGKey(start) if temperature > 0 else None
                tokens = jax.device_get(context_lib.on_run_mesh(self.run, sampling.generate)(
                    self.model, self.params, jnp.asarray(prompts), max_new, rng,
                    temperature=temperature, top_k=top_k, prefill_multiple=self.prefill_multiple,
                    cache_length=self.max_length))
                for r, i in enumerate(chunk):
                    out[i] = self._finish(tokens[r, prompts.shape[1]:], jobs[i][1])
        for req, text in zip(requests, out):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return out

    def _finish(self, new_tokens: np.ndarray, until: Sequence[str]) -> str:
        ids = [int(t) for t in new_tokens]
        if self.tokenizer.eos_id in ids:
            ids = ids[:ids.index(self.tokenizer.eos_id)]
        text = self.tok_decode(ids)
        for stop in until:
            if stop and stop in text:
                text = text[:text.index(stop)]
        return text


# ----------------------------------------------------------------------------------------------
# Running tasks
# ----------------------------------------------------------------------------------------------


def unreadable_task_yamls(include_path: str) -> list[str]:
    """The ``*.yaml`` / ``*.yml`` files under ``include_path`` that are not valid YAML, each as
    ``'<path>: <the parser's error, one line>'`` (empty when all parse). lm-eval's task index
    skips such a file silently; this says why a task named in it is unknown. lm-eval's own tags
    (``!function``) are accepted as any tag."""
    import yaml  # pylint: disable=g-import-not-at-top  # a dependency of lm-eval

    class _AnyTag(yaml.SafeLoader):  # pylint: disable=too-many-ancestors
        pass

    _AnyTag.add_multi_constructor("", lambda loader, suffix, node: None)
    broken = []
    for folder, _, names in sorted(os.walk(include_path)):
        for name in sorted(n for n in names if n.endswith((".yaml", ".yml"))):
            path = os.path.join(folder, name)
            try:
                with open(path, encoding="utf-8") as f:
                    yaml.load(f, Loader=_AnyTag)  # noqa: S506  # safe loader with tags ignored
            except (yaml.YAMLError, UnicodeDecodeError) as e:
                broken.append(f"{path}: {' '.join(str(e).split())}")
    return broken


def evaluate(lm: GoatLM, tasks: Sequence[str], *, include_path: Optional[str] = None,
             num_fewshot: Optional[int] = None, limit: Optional[float] = None,
             log_samples: bool = False, seed: int = 0,
             bootstrap_iters: int = 100000) -> dict[str, Any]:
    """Runs lm-eval's ``simple_evaluate`` on ``tasks`` (names known to lm-eval, or defined by
    YAML files under ``include_path``); returns lm-eval's result dict (``results``,
    ``versions``, ``n-shot``, ``higher_is_better``, ``n-samples``, ``configs``, and
    ``samples`` when ``log_samples``). ``bootstrap_iters``: lm-eval's resamples for the
    standard errors (0: none). Nothing is downloaded that lm-eval or ``datasets`` would not
    download on their own: tasks read their datasets as their YAML says."""
    with _extras.imports(__name__):
        from lm_eval import evaluator  # pylint: disable=g-import-not-at-top
        from lm_eval.tasks import TaskManager  # pylint: disable=g-import-not-at-top
    if not tasks:
        raise ValueError("give at least one lm-eval task (--lm_eval_tasks hellaswag,arc_easy).")
    if num_fewshot is not None and (isinstance(num_fewshot, bool) or num_fewshot < 0):
        raise ValueError(f"num_fewshot must be an integer >= 0, got {num_fewshot!r}.")
    if limit is not None and not (limit > 0 and math.isfinite(limit)):
        raise ValueError(f"limit must be a positive number (examples per task, or a fraction < 1), got {limit!r}.")
    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" under --lm_eval_include_path {include_path}" if include_path else ""
        broken = unreadable_task_yamls(include_path) if include_path else []
        if broken:  # lm-eval's index skips a YAML it cannot parse without a word: name it
            raise ValueError(f"unknown lm-eval task(s) {unknown}{where}: these task YAMLs could not be "
                             "read, so their tasks were skipped: " + "; ".join(broken) + ". Fix them.")
        raise ValueError(f"unknown lm-eval task(s) {unknown}: not in lm-eval's registry{where}. "
                         "Check the names (`lm-eval ls tasks`) or the task YAML's `task:` field.")
    results = evaluator.simple_evaluate(
        model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit, task_manager=manager,
        log_samples=log_samples, random_seed=seed, numpy_random_seed=seed,
        torch_random_seed=None,  # nothing here uses torch; None keeps it unimported
        fewshot_random_seed=seed, bootstrap_iters=bootstrap_iters)
    return results


def markdown_table(results: dict[str, Any]) -> str:
    """lm-eval's own results table (markdown) of one :func:`evaluate` result."""
    return lm_utils.make_table(results)


def require() -> None:
    """Raises the one-line missing-extra error unless lm-eval is importable (for callers that
    import this module lazily)."""
    with _extras.imports(__name__):
        import lm_eval  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import


# Keys of lm-eval's result dict kept in results.json (the rest is environment information, and
# the per-request samples go to their own files).
RESULT_KEYS = ("results", "groups", "group_subtasks", "versions", "n-shot", "higher_is_better",
               "n-samples", "configs", "lm_eval_version")


def _jsonable(value: Any) -> Any:
    import json  # pylint: disable=g-import-not-at-top
    return json.loads(json.dumps(value, default=lambda v: v.item() if hasattr(v, "item") else str(v)))


def evaluate_lm_run(run: Any, tasks: Sequence[str], *, include_path: Optional[str] = None,
                    num_fewshot: Optional[int] = None, limit: Optional[float] = None,
                    batch_size: int = 8, max_length: Optional[int] = None,
                    samples_dir: Optional[str] = None, bootstrap_iters: int = 100000,
                    label: Optional[str] = None) -> dict[str, Any]:
    """``experiments.evaluate --evals lm_eval``: :func:`evaluate` of a :class:`GoatLM` over
    ``run``; returns the JSON-ready part of lm-eval's result (:data:`RESULT_KEYS`) plus
    ``table`` (lm-eval's markdown table). With ``samples_dir``, every request with its
    arguments and responses is written to ``samples_dir/<label>/<task>.jsonl``."""
    import json  # pylint: disable=g-import-not-at-top
    import os  # pylint: disable=g-import-not-at-top
    lm = GoatLM(run, batch_size=batch_size, max_length=max_length)
    raw = evaluate(lm, tasks, include_path=include_path, num_fewshot=num_fewshot, limit=limit,
                   log_samples=samples_dir is not None, seed=int(run.config.seed),
                   bootstrap_iters=bootstrap_iters)
    out = {k: _jsonable(raw[k]) for k in RESULT_KEYS if k in raw}
    out["table"] = markdown_table(raw)
    out["window"] = lm.max_length
    if samples_dir is not None:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in (label or run.label))
        directory = os.path.join(samples_dir, safe)
        os.makedirs(directory, exist_ok=True)
        for task, samples in raw.get("samples", {}).items():
            with open(os.path.join(directory, f"{task}.jsonl"), "w") as f:
                for sample in samples:
                    f.write(json.dumps(_jsonable(sample)) + "\n")
        out["samples_dir"] = directory
    return out


def results_markdown(by_label: dict[str, dict[str, Any]]) -> list[str]:
    """The ``results.md`` section of ``--evals lm_eval``: lm-eval's table per run."""
    if not by_label:
        return []
    md = ["## lm-evaluation-harness", ""]
    for label, result in by_label.items():
        md += [f"### {label} (window {result['window']} tokens; longer contexts truncated from "
               "the left)", "", result["table"].strip(), ""]
    return md
