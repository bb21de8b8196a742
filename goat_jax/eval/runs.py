"""The language evaluations of trained runs, by name: what ``experiments.evaluate`` and
``experiments.reproduce`` run on each workdir, and the tables and figures comparing runs.

    run = lm_run.load_lm_run(workdir)     # goat_jax.eval.lm_run; read-only, safe while the run trains
    results = evaluate_run(run, ["extrapolation", "sinks"], multipliers=(1, 2, 4))
    write_outputs({run.label: results}, out_dir, {run.label: run.train_len})

Evaluations (protocols in docs/experiments.md; the metrics live in
:mod:`goat_jax.eval.extrapolation`, :mod:`~goat_jax.eval.retrieval`, :mod:`~goat_jax.eval.sinks`):

  extrapolation  perplexity on the held-out stream at ``m x`` the training length,
                 non-overlapping windows (``stride`` for sliding); synthetic runs score
                 fresh batches of their own task at each length instead.
  passkey        synthetic passkey (teacher-forced exact match of the 8-digit key) and the
                 standard prompt (greedy decoding with the KV cache, first integer == key).
  niah           synthetic NIAH span token accuracy over lengths x depths (heatmap).
  sinks          attention mass on position 0 and first-key norm / other keys, per layer, on
                 held-out data at the training length.
  documents      held-out documents packed with segment ids: perplexity and the mass on each
                 document's first token (:mod:`goat_jax.eval.documents`).
  diagnostics    the official C4 run's: last-layer attention mass on token 0, max attention
                 and mass on the last 128 keys at every length (KV cache, query chunks), and
                 GOAT's per-layer u(j) curves.
  lm_eval        EleutherAI's lm-evaluation-harness tasks (:mod:`goat_jax.eval.harness`, the
                 ``[eval]`` extra), scored with the run's own tokenizer.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

from goat_jax import _extras
with _extras.imports(__name__):  # optional packages: one-line error naming the extra
    import ml_collections
import numpy as np

from goat_jax.cli import log
from goat_jax.data import synthetic, text
from goat_jax.eval import checks, chunked, context, diagnostics, documents, extrapolation, retrieval, sinks
from goat_jax.eval.checks import EVAL_TASKS, evals_for_task
from goat_jax.eval.lm_run import LMRun
from goat_jax.kernels.mesh import context_shards
from goat_jax.train import run as run_lib
from goat_jax.train import tasks as tasks_lib


EVALS = tuple(e for e in EVAL_TASKS if e != "resolution")  # what evaluate_run runs
DEFAULT_MULTIPLIERS = (1, 2, 4, 8, 16)
NIAH_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)  # official GOAT NIAH depths


# ----------------------------------------------------------------------------------------------
# Labels and held-out data of a run (an LMRun of goat_jax/eval/lm_run.py)
# ----------------------------------------------------------------------------------------------


def _position_encoding(workdir: str) -> str:
    """The run's ``model.position_encoding``, its task's declared default where config.json
    leaves it out (a config written before the field existed)."""
    config = run_lib.read_config(workdir)
    return str(tasks_lib.with_field_defaults(config, tasks_lib.get_task(config.task)).model.position_encoding)


def run_labels(workdirs: Sequence[str], labels: Optional[Sequence[Optional[str]]] = None) -> list[str]:
    """One unique label per run, in order: the explicit ``labels`` where given, else the run's
    position encoding; runs whose default labels collide get ``'<encoding> (<workdir name>)'``
    (and the whole path if the names collide too). Duplicate explicit labels are refused with
    ValueError, since results are keyed by label and one would silently replace the other."""
    labels = list(labels or [None] * len(workdirs))
    if len(labels) != len(workdirs):
        raise ValueError(f"give one --label per --workdir ({len(workdirs)}), or none; got {len(labels)}.")
    explicit = [l for l in labels if l]
    dups = sorted({l for l in explicit if explicit.count(l) > 1})
    if dups:
        raise ValueError(f"--label values must be unique; {dups} given more than once.")
    out = [l or _position_encoding(w) for w, l in zip(workdirs, labels)]
    for attempt in (lambda i: f"{out[i]} ({os.path.basename(os.path.normpath(workdirs[i]))})",
                    lambda i: f"{out[i]} ({os.path.normpath(workdirs[i])})"):
        clash = [i for i, l in enumerate(out) if not labels[i] and out.count(l) > 1]
        out = [attempt(i) if i in clash else l for i, l in enumerate(out)]
    clash = sorted({l for l in out if out.count(l) > 1})
    if clash:
        raise ValueError(f"runs {clash} cannot be told apart; give each a --label.")
    return out


class HeldoutStream(NamedTuple):
    """A run's held-out token stream and the BOS id its windows start with (None unless the
    run trained with ``data.bos_windows``)."""

    tokens: np.ndarray
    bos_id: Optional[int]


def heldout_tokens(run: LMRun, max_tokens: Optional[int] = None,
                   text_file: Optional[str] = None) -> np.ndarray:
    """The held-out token stream of a text run (its data config's eval split, whole), or of
    ``text_file`` (any UTF-8 text, one document, read and tokenized by the run's own pipeline
    and tokenizer; the tokenizer is never trained on it). See :func:`heldout_stream`."""
    return heldout_stream(run, max_tokens, text_file).tokens


def heldout_stream(run: LMRun, max_tokens: Optional[int] = None,
                   text_file: Optional[str] = None) -> HeldoutStream:
    """:func:`heldout_tokens` with the BOS id of a ``data.bos_windows`` run: its evaluation
    windows start with BOS at every length, as its training windows did (docs/protocols.md,
    Length extrapolation), and the stream holds no packer-inserted BOS."""
    data = ml_collections.ConfigDict(run.config.data.to_dict())
    data.num_eval_batches = 0  # <= 0: the whole eval split
    # The stream is the held-out documents end to end, whatever packing the run trained with,
    # so runs of 'concat' and 'documents' are scored on the same tokens.
    if "packing" in data:
        data.packing = "concat"
    data.read_threads = 1
    if text_file is not None:
        if run.is_synthetic:
            raise ValueError(f"--text {text_file}: run {run.label!r} is a synthetic-task run; "
                             "--text scores text with a text run's tokenizer.")
        if not os.path.isfile(text_file):
            raise ValueError(f"--text {text_file}: no such file.")
        if data.tokenizer == "sentencepiece" and not os.path.exists(data.spm_model_path):
            raise ValueError(f"--text {text_file}: the run's SentencePiece model "
                             f"data.spm_model_path={data.spm_model_path!r} is missing; it must "
                             "exist (it is never trained on the evaluated text).")
        data.source, data.doc_split = "text_files", "files"
        data.paths = data.eval_paths = (text_file,)
    _, make_eval, tokenizer = text.make_lm_datasets(
        data, seq_len=run.train_len, global_batch_size=8, seed=int(run.config.seed),
        process_index=0, process_count=1)
    bos = bool(text.DATA.value(data, "bos_windows"))
    tokens = extrapolation.tokens_from_batches(_until(make_eval(), max_tokens), bos_windows=bos)
    return HeldoutStream(tokens[:max_tokens] if max_tokens else tokens,
                         int(tokenizer.bos_id) if bos else None)


def _until(batches, max_tokens: Optional[int]):
    """The eval batches up to the first that brings the real targets to ``max_tokens`` (a
    window's stream tokens are its real targets, plus its first input without BOS windows), so
    a few windows of a large split (C4's) do not tokenize all of it."""
    seen = 0
    for batch in batches:
        yield batch
        seen += int(np.asarray(batch["weights"]).astype(bool).sum())
        if max_tokens and seen >= max_tokens:
            return


def _synthetic_batches(run: LMRun, length: int, num_examples: int, batch_size: int = 8):
    """Fresh eval batches of a synthetic run's own task at ``length`` (a stream the training
    never saw: the seed differs from any training seed's role)."""
    make = synthetic.make_batch_fn(run.config.data, batch_size, length)
    rng = np.random.default_rng([int(run.config.seed), 7919, length])
    return [make(rng)[0] for _ in range(max(1, num_examples // batch_size))]


# ----------------------------------------------------------------------------------------------
# Evaluations (each returns plain JSON-able dicts keyed by length)
# ----------------------------------------------------------------------------------------------


def eval_extrapolation(run: LMRun, multipliers: Sequence[int] = DEFAULT_MULTIPLIERS, *,
                       stride: Optional[int] = None, max_tokens: Optional[int] = None,
                       num_examples: int = 64, text_file: Optional[str] = None,
                       chunk_size: Optional[int] = None) -> dict[int, dict[str, float]]:
    """``{length: {'ppl', 'nll', 'tokens'}}`` at ``m * train_len``.

    Text runs: the held-out stream (or ``text_file``'s, see :func:`heldout_stream`) in
    non-overlapping windows (``stride``: sliding), the same tokens for every model; windows
    start with BOS at every length when the run trained with ``data.bos_windows``. Synthetic
    runs: ``num_examples`` fresh windows of the run's task at each length (their perplexity is
    what the task's scored targets cost). ``chunk_size``: evaluate every window through the KV
    cache in chunks of that many queries (:mod:`goat_jax.eval.chunked`; same numbers, memory
    bounded by chunk x length instead of length^2).
    """
    apply_fn = run.apply_fn
    nll_fn = None
    if chunk_size is not None:
        nll_fn = context.on_run_mesh(run, chunked.make_chunked_nll_fn(run.model, chunk_size))
    if run.is_synthetic and text_file is None:
        out = {}
        for m in multipliers:
            length = int(m * run.train_len)
            r = extrapolation.perplexity_on_batches(apply_fn, run.params,
                                                    _synthetic_batches(run, length, num_examples),
                                                    nll_fn=nll_fn)
            out[length] = {"ppl": r.ppl, "nll": r.nll, "tokens": r.num_tokens}
            log(f"    {run.label} length {length}: ppl {r.ppl:.4g} over {r.num_tokens} tokens")
        return out
    stream = heldout_stream(run, max_tokens, text_file=text_file)
    if text_file is not None:  # a file the user chose: no length scored is an error, not an empty table
        lengths = [int(m * run.train_len) for m in multipliers]
        short = [n for n in lengths
                 if not len(extrapolation.window_starts(len(stream.tokens), n, bos=stream.bos_id is not None))]
        if len(short) == len(lengths):
            raise ValueError(f"--text {text_file}: {len(stream.tokens)} tokens with run {run.label!r}'s tokenizer, "
                             f"shorter than one window of {min(short)} tokens (the shortest of --multipliers "
                             f"x the training length {run.train_len}); give a longer file or smaller --multipliers.")
    res = extrapolation.perplexity_by_length(
        apply_fn, run.params, stream.tokens, run.train_len, multipliers, stride=stride,
        tokens_per_batch=8192, nll_fn=nll_fn, bos_id=stream.bos_id,
        progress=lambda msg: log(f"    {run.label} {msg}"))
    if not res:  # every length skipped: an empty table would read as a result
        no_full_window("extrapolation", run, multipliers, len(stream.tokens))
    return {int(n): {"ppl": r.ppl, "nll": r.nll, "tokens": r.num_tokens} for n, r in res.items()}


def no_full_window(name: str, run: LMRun, multipliers: Sequence[int], num_tokens: int) -> None:
    """Raises: no length of the request has one full window in the held-out stream."""
    lengths = [int(m * run.train_len) for m in multipliers]
    raise ValueError(f"--evals {name} on {run.workdir}: the held-out stream ({num_tokens} tokens) holds no "
                     f"full window of any length asked for ({', '.join(map(str, lengths))} tokens: --multipliers "
                     f"x seq_len {run.train_len}), so nothing was evaluated; give smaller --multipliers, or more "
                     "held-out data (data.eval_paths or data.eval_fraction).")


def eval_passkey(run: LMRun, multipliers: Sequence[int] = DEFAULT_MULTIPLIERS, *,
                 variants: Sequence[str] = ("synthetic", "standard"), num_examples: int = 32,
                 num_trials: int = 8, seed: int = 0) -> dict[str, dict[int, float]]:
    """``{variant: {length: accuracy}}`` at ``m * train_len``.

    'synthetic': teacher-forced exact match of the key span; 'standard': the Landmark prompt
    decoded greedily with the KV cache. Lengths too short for a variant's fixed part (needle and
    query; task text, needle and question: :func:`goat_jax.eval.checks.passkey_lengths`) are
    skipped, and logged; experiments.evaluate refuses a request where every length would be
    (:func:`goat_jax.eval.checks.check_passkey_lengths`, before any work).
    """
    out: dict[str, dict[int, float]] = {}
    for variant in variants:
        ok, skipped, shortest = checks.passkey_lengths(run.config, multipliers, variant)[1:]
        if skipped:
            log(f"    {run.label} passkey ({variant}): length(s) {', '.join(map(str, skipped))} skipped, "
                f"shorter than the {shortest} tokens the prompt needs")
        if variant == "synthetic":
            out[variant] = retrieval.passkey_accuracy_synthetic(
                run.apply_fn, run.params, ok, num_examples=num_examples,
                key_len=int(synthetic.SYNTHETIC.value(run.config.data, "key_len")), seed=seed)
        else:
            gen = context.on_run_mesh(run, retrieval.greedy_generator(run.model, run.params))
            out[variant] = retrieval.passkey_accuracy_standard(gen, ok, num_trials=num_trials,
                                                               batch_size=min(4, num_trials), seed=seed)
    return out


def eval_niah(run: LMRun, multipliers: Sequence[int] = DEFAULT_MULTIPLIERS, *,
              depths: Sequence[float] = NIAH_DEPTHS, num_examples: int = 16,
              seed: int = 0) -> dict[str, Any]:
    """The synthetic NIAH grid at ``m * train_len`` x ``depths``: ``{'lengths', 'depths',
    'token_accuracy' [nL][nD], 'exact_match' [nL][nD]}`` (lists, JSON-able)."""
    lengths = [int(m * run.train_len) for m in multipliers]
    grid = retrieval.niah_accuracy_grid(run.apply_fn, run.params, lengths,
                                        depths, num_examples=num_examples, seed=seed,
                                        key_len=int(synthetic.SYNTHETIC.value(run.config.data, "niah_key_len")),
                                        value_len=int(synthetic.SYNTHETIC.value(run.config.data, "niah_value_len")))
    return {k: np.asarray(v).tolist() for k, v in grid.items()}


def _eval_windows(run: LMRun, length: int, num: int,
                  stream: Optional[HeldoutStream] = None) -> np.ndarray:
    """Up to ``num`` held-out input windows [n, length] (BOS windows for a ``bos_windows``
    run; ``stream`` read once by the caller, or here), or a synthetic run's fresh task inputs."""
    if run.is_synthetic:
        tokens = np.concatenate([b["inputs"] for b in _synthetic_batches(run, length, num)])
        return tokens[:num]
    stream = stream or heldout_stream(run, max_tokens=num * (length + 1) * 4)
    starts = extrapolation.window_starts(len(stream.tokens), length,
                                        bos=stream.bos_id is not None)[:num]
    return extrapolation.window_batch(stream.tokens, starts, length, stream.bos_id)[0]


def eval_diagnostics(run: LMRun, multipliers: Sequence[int] = DEFAULT_MULTIPLIERS, *,
                     num_windows: int = 4, chunk_size: Optional[int] = None,
                     recent: int = diagnostics.DEFAULT_RECENT) -> dict[str, Any]:
    """The official C4 run's diagnostics (:mod:`goat_jax.eval.diagnostics`) at each
    ``m * train_len``: the last layer's attention mass on token 0, max attention weight and
    mass on the last ``recent`` keys, per head and mean, on ``num_windows`` held-out windows
    run through the KV cache in chunks of ``chunk_size`` queries (default 512); for GOAT, the
    per-layer ``u(j)`` curves up to the longest length (stored at <= 256 positions each).
    Lengths without a full held-out window are left out (logged)."""
    chunk_size = diagnostics.DEFAULT_CHUNK if chunk_size is None else chunked.check_chunk_size(chunk_size)
    lengths = [int(m * run.train_len) for m in multipliers]
    stream = None if run.is_synthetic else heldout_stream(
        run, max_tokens=num_windows * (max(lengths) + 1) + 1)
    out: dict[str, Any] = {"recent_keys": recent, "chunk_size": chunk_size, "by_length": {}}
    if stream is not None and not any(
            len(extrapolation.window_starts(len(stream.tokens), n, bos=stream.bos_id is not None)) for n in lengths):
        # Before the sink curves, which run at the longest length.
        no_full_window("diagnostics", run, multipliers, len(stream.tokens))
    for length in lengths:
        tokens = _eval_windows(run, length, num_windows, stream)
        if not len(tokens):
            log(f"    {run.label} diagnostics: length {length} skipped (no full held-out window)")
            continue
        st = diagnostics.last_layer_attention_stats(run.model, run.params, tokens,
                                                    chunk_size=chunk_size, recent=recent)
        row = {k: st[k].tolist() for k in ("first_mass", "max_weight", "recent_mass")}  # [N]
        row.update({f"{k}_mean": float(np.mean(st[k])) for k in ("first_mass", "max_weight", "recent_mass")})
        row["windows"] = int(len(tokens))
        out["by_length"][length] = row
        log(f"    {run.label} diagnostics at {length}: mass on token 0 {row['first_mass_mean']:.3f}, "
            f"max attention {row['max_weight_mean']:.3f}, last {recent} keys {row['recent_mass_mean']:.3f}")
    if run.model.config.position_encoding == "goat" and run.model.config.enable_key_bias:
        longest = max(lengths)
        pos = diagnostics.curve_positions(longest)
        u = diagnostics.sink_curves(run.model, run.params, longest)[:, :, pos]  # [Y, N, P]
        mlp = diagnostics.sink_curves(run.model, run.params, longest, recency=False)[:, :, pos]
        out["u_curves"] = {"positions": pos.tolist(), "u": u.tolist()}
        out["u_curves_without_recency"] = {"positions": pos.tolist(), "u": mlp.tolist()}
    return out


def eval_sinks(run: LMRun, *, length: Optional[int] = None, num_examples: int = 8) -> dict[str, Any]:
    """Per layer: attention mass on position 0 (mean over heads and queries >= 1), first key
    norm / mean other key norm; for GOAT also the prior's own sink margin (nats over the row
    median, :func:`goat_jax.eval.sinks.sink_margin`). On held-out inputs at ``length``
    (default: the training length)."""
    length = int(length or run.train_len)
    tokens = _eval_windows(run, length, num_examples)
    stats = sinks.sink_statistics(run.model, run.params, tokens)
    out = {"length": length,
           "first_mass": stats["first_mass"].mean(axis=-1).tolist(),  # [Y]
           "first_mass_max_head": stats["first_mass"].max(axis=-1).tolist(),  # [Y]
           "key_norm_ratio": stats["key_norm_ratio"].tolist()}  # [Y]
    if run.label == "goat":
        margins = [sinks.sink_margin(sinks.prior_components(run.model, run.params, i, min(length, 64))["log_prior"])
                   for i in range(run.model.config.num_layers)]
        out["prior_sink_margin_max_head"] = [float(np.max(m)) for m in margins]
    return out


# ----------------------------------------------------------------------------------------------
# Tables and figures
# ----------------------------------------------------------------------------------------------


def _fmt(x: Optional[float], pct: bool = False) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.0f}%" if pct else (f"{x:.3f}" if x < 100 else f"{x:.1f}")


def table(rows: dict[str, dict[int, Optional[float]]], *, pct: bool = False,
          first_col: str = "model", header_fmt=lambda n: str(n)) -> str:
    """A markdown table, one row per label, one column per (sorted) key."""
    keys = sorted({k for r in rows.values() for k in r})
    lines = [f"| {first_col} | " + " | ".join(header_fmt(k) for k in keys) + " |",
             "|---|" + "---|" * len(keys)]
    for label, r in rows.items():
        lines.append(f"| {label} | " + " | ".join(_fmt(r.get(k), pct) for k in keys) + " |")
    return "\n".join(lines)


def write_outputs(results: dict[str, dict[str, Any]], out: str, train_lens: dict[str, int],
                  setups: Optional[dict[str, dict[str, Any]]] = None) -> str:
    """Writes ``results.json``, ``results.md`` and the PNGs of ``{label: {eval: result}}``
    into ``out``; returns the markdown. ``setups``: per label, how it was evaluated
    (:func:`goat_jax.eval.context.setup`), written as the label's ``setup`` entry in results.json."""
    from goat_jax.eval import plots  # pylint: disable=g-import-not-at-top  # matplotlib: on use
    os.makedirs(out, exist_ok=True)
    setups = setups or {}
    written = {k: ({"setup": setups[k], **r} if k in setups else r) for k, r in results.items()}
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(written, f, indent=1, default=float)
    md = []
    train_len = next(iter(train_lens.values()), None)
    ext = {k: r["extrapolation"] for k, r in results.items() if "extrapolation" in r}
    if ext:
        md += ["## Perplexity by evaluation length", "",
               table({k: {int(n): v["ppl"] for n, v in r.items()} for k, r in ext.items()}), ""]
        plots.plot_perplexity_vs_length({k: {int(n): v["ppl"] for n, v in r.items()} for k, r in ext.items()},
                                        os.path.join(out, "perplexity_vs_length.png"), train_len=train_len)
    for variant in ("synthetic", "standard"):
        pk = {k: r["passkey"][variant] for k, r in results.items() if variant in r.get("passkey", {})}
        if pk:
            md += [f"## Passkey accuracy ({variant})", "", table(pk, pct=True), ""]
            plots.plot_passkey_accuracy({k: {int(n): a for n, a in v.items()} for k, v in pk.items()},
                                        os.path.join(out, f"passkey_{variant}.png"), train_len=train_len,
                                        title=f"Passkey retrieval ({variant})")
    niah = {k: r["niah"] for k, r in results.items() if "niah" in r}
    if niah:
        mean = {k: dict(zip(g["lengths"], np.mean(g["token_accuracy"], axis=1))) for k, g in niah.items()}
        md += ["## NIAH span token accuracy (mean over depths)", "", table(mean, pct=True), ""]
        for k, g in niah.items():
            plots.plot_niah_heatmap({n: np.asarray(v) for n, v in g.items()},
                                    os.path.join(out, f"niah_{k}.png"), title=f"NIAH, {k}")
    sk = {k: r["sinks"] for k, r in results.items() if "sinks" in r}
    if sk:
        md += ["## Attention sinks (per layer)", "", "| model | mass on pos. 0 (mean head) | "
               "mass on pos. 0 (max head) | first-key norm / others |", "|---|---|---|---|"]
        for k, s in sk.items():
            md.append(f"| {k} | " + ", ".join(f"{x:.2f}" for x in s["first_mass"]) + " | " +
                      ", ".join(f"{x:.2f}" for x in s["first_mass_max_head"]) + " | " +
                      ", ".join(f"{x:.2f}" for x in s["key_norm_ratio"]) + " |")
        md.append("")
    docs = {k: r["documents"] for k, r in results.items() if "documents" in r}
    if docs:
        md += ["## Packed held-out documents (each attended and positioned alone)", "",
               table({k: {int(n): v["ppl"] for n, v in r["ppl"].items()} for k, r in docs.items()}), "",
               "| model | mass on own document's first token, per layer (mean head) | (max head) |",
               "|---|---|---|"]
        md += [f"| {k} | " + ", ".join(f"{x:.2f}" for x in r["first_mass"]) + " | "
               + ", ".join(f"{x:.2f}" for x in r["first_mass_max_head"]) + " |" for k, r in docs.items()]
        md.append("")
    md += _diagnostics_markdown({k: r["diagnostics"] for k, r in results.items() if "diagnostics" in r},
                                out, train_len)
    md += _dna_markdown({k: r["dna"] for k, r in results.items() if "dna" in r})
    lm_eval = {k: r["lm_eval"] for k, r in results.items() if "lm_eval" in r}
    if lm_eval:
        from goat_jax.eval import harness  # pylint: disable=g-import-not-at-top  # the [eval] extra
        md += harness.results_markdown(lm_eval)
    text_md = "\n".join(md)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text_md)
    return text_md


def eval_dna(run: LMRun, fasta: Sequence[str], multipliers: Sequence[int] = DEFAULT_MULTIPLIERS,
             *, lengths: Optional[Sequence[int]] = None, max_bases: Optional[int] = None,
             gc_windows: int = 256) -> dict[str, Any]:
    """A genome run on FASTA files: NLL (nats, bits per base), perplexity and next-base accuracy
    at ``m * train_len`` (or ``lengths``), and GC agreement (goat_jax.eval.dna)."""
    from goat_jax.eval import dna as dna_eval  # pylint: disable=g-import-not-at-top
    if not fasta:
        raise ValueError("--evals dna needs --fasta FILE (a FASTA of held-out sequence).")
    return dna_eval.evaluate_fasta(run.model, run.params, fasta, run.train_len,
                                   multipliers=multipliers, lengths=lengths, max_bases=max_bases,
                                   gc_num_windows=gc_windows, seed=int(run.config.seed),
                                   apply_fn=run.apply_fn)


def _diagnostics_markdown(diag: dict[str, dict[str, Any]], out: str,
                          train_len: Optional[int]) -> list[str]:
    """The last-layer diagnostics tables (mean over heads, and the range over heads) and one
    ``u_curves_<label>.png`` per GOAT run."""
    if not diag:
        return []
    recent = next(iter(diag.values()))["recent_keys"]
    md = ["## Last-layer attention diagnostics (mean over heads; [min, max] over heads)", ""]
    for key, title in (("first_mass", "mass on token 0"), ("max_weight", "max attention weight"),
                       ("recent_mass", f"mass on the last {recent} keys")):
        md += [f"### {title}", "", table({k: {int(n): r[f"{key}_mean"] for n, r in d["by_length"].items()}
                                          for k, d in diag.items()}), ""]
        spread = {k: {int(n): f"[{min(r[key]):.3f}, {max(r[key]):.3f}]" for n, r in d["by_length"].items()}
                  for k, d in diag.items()}
        keys = sorted({n for r in spread.values() for n in r})
        md += ["| model (heads) | " + " | ".join(str(n) for n in keys) + " |", "|---|" + "---|" * len(keys)]
        md += [f"| {k} | " + " | ".join(r.get(n, "-") for n in keys) + " |" for k, r in spread.items()] + [""]
    from goat_jax.eval import diagnostics as diag_lib  # pylint: disable=g-import-not-at-top
    for k, d in diag.items():
        safe = "".join(c if c.isalnum() else "_" for c in k)
        for field, stem, what in (("u_curves", "u_curves", "u(j)"),
                                  ("u_curves_without_recency", "u_mlp_curves",
                                   "u(j) without the recency slope (sink MLP + bump)")):
            if field in d:
                name = f"{stem}_{safe}.png"
                diag_lib.plot_sink_curves(d[field], os.path.join(out, name), train_len=train_len,
                                          title=f"{what} per layer, {k}")
                md += [f"{what} per layer ({k}): `{name}`", ""]
    return md


def _dna_markdown(dna: dict[str, dict[str, Any]]) -> list[str]:
    """The DNA tables: bits per base and accuracy by length, GC agreement with its references."""
    if not dna:
        return []
    first = next(iter(dna.values()))["data"]
    md = [f"## DNA: {', '.join(first['files'])} ({sum(first['bases']):,} bases, "
          f"{len(first['records'])} record(s))", ""]
    for key, title, pct in (("bits_per_base", "bits per base", False),
                            ("accuracy", "next-base accuracy", True)):
        md += [f"### {title} by evaluation length", "",
               table({k: {int(n): v[key] for n, v in r["by_length"].items()} for k, r in dna.items()},
                     pct=pct), ""]
    excluded = {int(n): v.get("excluded_n", 0) for r in dna.values() for n, v in r["by_length"].items()}
    if any(excluded.values()):
        md += ["N targets (unknown bases) are not scored; left out per window length: " +
               ", ".join(f"{n}: {c:,}" for n, c in sorted(excluded.items())) + ".", ""]
    md += ["### GC agreement (Pearson r; docs/experiments.md, section DNA)", "",
           "| model | r(sample, truth) | r(prompt, truth), no model | r(halves of truth), no model "
           "| mean GC sample / truth | windows |", "|---|---|---|---|---|---|"]
    for k, r in dna.items():
        gc = r.get("gc")
        if not gc:
            continue
        if "error" in gc:
            md.append(f"| {k} | {gc['error']} | | | | |")
            continue
        md.append(f"| {k} | {gc['r_model']:.3f} | {gc['r_prompt']:.3f} | {gc['r_halves']:.3f} | "
                  f"{gc['mean_gc_sample']:.3f} / {gc['mean_gc_true']:.3f} | {gc['num_windows']} |")
    return md + [""]


def evaluate_run(run: LMRun, evals: Sequence[str], multipliers: Sequence[int], *,
                 stride: Optional[int] = None, num_examples: int = 32,
                 num_trials: int = 8, dna_options: Optional[dict[str, Any]] = None,
                 text_file: Optional[str] = None, chunk_size: Optional[int] = None,
                 diagnostics_options: Optional[dict[str, Any]] = None,
                 lm_eval_options: Optional[dict[str, Any]] = None,
                 into: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Runs ``evals`` (a subset of :data:`EVALS`) on one run; returns ``{eval: result}``
    (``into``, when given, is that dict, filled as each evaluation finishes: after an error it
    holds the ones that finished).
    ``dna_options``: keyword arguments of :func:`eval_dna` (``fasta``, ``lengths``, ...).
    ``text_file``: extrapolation scores this UTF-8 file instead of the held-out split.
    ``chunk_size``: extrapolation runs each window through the KV cache in query chunks (and
    diagnostics use that chunk size instead of 512). ``diagnostics_options``: keyword
    arguments of :func:`eval_diagnostics` (``num_windows``, ``recent``). ``lm_eval_options``:
    keyword arguments of :func:`goat_jax.eval.harness.evaluate_lm_run` (``tasks``, ...)."""
    unknown = sorted(set(evals) - set(EVALS))
    if unknown:
        raise ValueError(f"unknown evaluation(s) {unknown}; choose from {EVALS}.")
    task = str(run.config.get("task"))
    wrong = [e for e in evals if task not in EVAL_TASKS[e]]
    if wrong:  # before any evaluation runs
        raise ValueError(f"evaluation(s) {wrong} do not apply to {run.workdir}, a run of "
                         f"config.task={task!r}; the evaluations for it are: "
                         f"{', '.join(evals_for_task(task)) or 'none'}.")
    if chunk_size is not None:
        chunked.check_chunk_size(chunk_size)  # before any evaluation runs
    if getattr(run, "mesh", None) is not None:  # windows split over devices: what can split, before any work
        context.check_request(run.config, run.workdir, evals, multipliers, context_shards(run.mesh),
                              chunk_size=chunk_size, lengths=(dna_options or {}).get("lengths"),
                              lm_eval_length=(lm_eval_options or {}).get("max_length"))
    if "passkey" in evals:  # a length too short for every prompt: nothing to score is an error
        checks.check_passkey_lengths(run.config, run.workdir, multipliers)
    if "lm_eval" in evals:
        from goat_jax.eval import harness  # pylint: disable=g-import-not-at-top  # the [eval] extra
        harness.require()  # before any evaluation runs
    out: dict[str, Any] = {} if into is None else into
    for name in evals:
        t0 = time.time()
        if name == "extrapolation":
            out[name] = eval_extrapolation(run, multipliers, stride=stride, num_examples=num_examples,
                                           text_file=text_file, chunk_size=chunk_size)
        elif name == "passkey":
            variants = (checks.passkey_lengths(run.config, multipliers)[0],)
            out[name] = eval_passkey(run, multipliers, variants=variants, num_examples=num_examples,
                                     num_trials=num_trials)
        elif name == "niah":
            out[name] = eval_niah(run, multipliers, num_examples=max(8, num_examples // 2))
        elif name == "documents":
            out[name] = documents.eval_documents(run, multipliers)
        elif name == "dna":
            out[name] = eval_dna(run, multipliers=multipliers, **(dna_options or {}))
        elif name == "lm_eval":
            from goat_jax.eval import harness  # pylint: disable=g-import-not-at-top
            out[name] = harness.evaluate_lm_run(run, **(lm_eval_options or {}))
        elif name == "diagnostics":
            out[name] = eval_diagnostics(run, multipliers, chunk_size=chunk_size,
                                         **(diagnostics_options or {}))
        else:
            out[name] = eval_sinks(run)
        log(f"  {run.label} {name}: {time.time() - t0:.0f}s")
    return out


