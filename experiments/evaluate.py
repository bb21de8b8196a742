"""Evaluate trained LM checkpoints: length extrapolation, passkey, NIAH and attention sinks.

    python -m experiments.evaluate --workdir runs/tiny --workdir runs/tiny_rope \\
        --evals extrapolation,sinks --out runs/eval
    python -m experiments.evaluate --workdir runs/passkey_goat --evals passkey --multipliers 1,2,4,8

Each ``--workdir`` is a run of ``experiments.train`` (its ``config.json`` and checkpoints); the
label of a run is its position encoding unless ``--label`` names them (labels are unique: two
runs of one encoding are told apart by their workdir names; repeated ``--label`` is an error). Results go to
``OUT/results.json`` (default OUT: ``WORKDIR_eval``; all numbers, and per run its ``setup``: ``--mesh_context``
and the context strategy the windows were split with), ``OUT/results.md`` (one table per evaluation, runs side by
side) and one PNG per evaluation, runs as lines (NIAH: one heatmap per run).

Evaluations (code in goat_jax.eval; goat_jax.eval.runs runs them on a workdir):
  extrapolation  perplexity on the held-out stream at ``m x`` the training length,
                 non-overlapping windows (``--stride`` for sliding); synthetic runs score
                 fresh batches of their own task at each length instead. ``--text FILE``
                 scores any UTF-8 text file instead, tokenized by each run's own tokenizer.
                 ``--chunk_size N`` runs each window through the KV cache in chunks of N
                 queries (the official C4 protocol, N = 512): the same perplexity, with memory
                 bounded by N x length. Runs trained with ``data.bos_windows`` get BOS at the
                 start of every window, at every length.
  passkey        synthetic passkey (teacher-forced exact match of the 8-digit key) and the
                 standard prompt (greedy decoding with the KV cache, first integer == key).
  niah           synthetic NIAH span token accuracy over lengths x depths (heatmap).
  sinks          attention mass on position 0 and first-key norm / other keys, per layer, on
                 held-out data at the training length.
  diagnostics    the official C4 run's (docs/protocols.md, C4 125M): on ``--num_windows``
                 held-out windows at every length, the last layer's attention mass on token 0,
                 its max attention weight and the mass on the last ``--recent_keys`` (128) keys,
                 per head and mean, through the KV cache in chunks of ``--chunk_size`` (default
                 512) queries; for GOAT also ``u_curves_<label>.png``, u(j) per layer.
  documents      held-out documents packed whole into windows with segment ids (each attended
                 and positioned alone; goat_jax.eval.documents, docs/packing.md): perplexity at
                 ``m x`` the training length, and per layer the attention mass on each
                 document's first token; for runs of either data.packing.
  dna            genome runs (configs/dna_*.py) on the FASTA files of ``--fasta``: NLL in nats
                 and bits per base, perplexity and next-base accuracy at ``m x`` the training
                 length (or ``--lengths``), and GC agreement over ``--gc_windows`` windows
                 (definition: docs/experiments.md, section DNA), e.g.
                 ``--evals dna --fasta DH1.fasta.gz --multipliers 1,2,4,8``.
  lm_eval        EleutherAI's lm-evaluation-harness (the ``[eval]`` extra) on the run, with its
                 own tokenizer (goat_jax.eval.harness; docs/ecosystem.md): ``--lm_eval_tasks``
                 names lm-eval tasks (hellaswag, lambada_openai, arc_easy, ...) or tasks
                 defined by YAML files under ``--lm_eval_include_path DIR``; lm-eval's results
                 go to OUT/results.json and its table to OUT/results.md. Contexts longer than
                 the training length are truncated from the left (logged). e.g.
                 ``--evals lm_eval --lm_eval_tasks arc_easy --lm_eval_limit 100``.
  resolution     ViT runs (config.task 'vit'), on its own: top-1 and loss at each
                 ``--resolutions`` px (e.g. 28,42,56,84), a PNG of top-1 vs resolution, and for
                 GOAT the block-0 centre-patch log-prior (goat_jax.eval.vision).

A RoPE run can be evaluated with 'yarn', 'ntk' or 'rope_pi' (``--position_encoding``), and any
run with log-n scaling (``--logn_scaling content|all``), on its own parameters
(goat_jax.eval.lm_run.swap_encoding; other swaps do not share parameters and are refused), e.g.
``--workdir runs/tiny_rope --position_encoding yarn --logn_scaling content``; the default labels
then read e.g. 'rope as yarn+logn_content'. ``--rope_scaling_factor F`` fixes YaRN's / NTK's
factor (default: dynamic, max(1, length / training length)); ``--evals documents`` past 1x needs
it, since the dynamic factor would follow the packed window's length, not each document's.
``--mesh_context N`` splits each window over N devices (the ``context`` mesh axis, for runs trained
with ``mesh.context > 1`` whose windows one device cannot hold; goat_jax.eval.context): extrapolation,
niah, both passkeys, dna and lm_eval (its window, ``--lm_eval_max_length`` or seq_len, a multiple of
N; generation decodes with the KV cache split over the devices); evaluations that read attention
probabilities are refused with it. Every check of the request runs on every run before any evaluation; if an
evaluation fails anyway, or the command is stopped (Ctrl-C, SIGTERM, SIGHUP: one line, exit 130 /
143 / 129), the ones that finished before it are written to OUT first.

Runs are read with goat_jax.train.run.load_run, read-only: evaluating a run that is still
training is safe (nothing in its workdir is written, cleaned up or locked).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any, Optional

from goat_jax import cli
from goat_jax.layers.call import LOGN_MODES
from goat_jax.eval import checks, context, lm_run, runs
from goat_jax.models.lm import POSITION_ENCODINGS
from goat_jax.train import interrupts
from goat_jax.train import run as run_lib
from goat_jax.eval.runs import EVALS


def _check_chunk_and_diagnostics_flags(args, evals: Sequence[str]) -> dict[str, int]:
    """Refuses a bad or unused ``--chunk_size`` / ``--num_windows`` / ``--recent_keys`` (a flag
    that no requested evaluation reads would be silently ignored); returns the diagnostics'
    keyword arguments."""
    for flag, value in (("--chunk_size", args.chunk_size), ("--num_windows", args.num_windows),
                        ("--recent_keys", args.recent_keys)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}"
                             + (" (queries per chunk, e.g. 512)." if flag == "--chunk_size" else "."))
    if args.chunk_size is not None and not {"extrapolation", "diagnostics"} & set(evals):
        raise ValueError(f"--chunk_size applies to --evals extrapolation and diagnostics; got "
                         f"--evals {','.join(evals)}. Drop --chunk_size or add one of them.")
    for flag, value in (("--num_windows", args.num_windows), ("--recent_keys", args.recent_keys)):
        if value is not None and "diagnostics" not in evals:
            raise ValueError(f"{flag} applies to --evals diagnostics only; got --evals "
                             f"{','.join(evals)}. Drop {flag} or add diagnostics.")
    return {"num_windows": args.num_windows or 4, "recent": args.recent_keys or 128}


def _lm_eval_options(args, evals: Sequence[str], out: str) -> Optional[dict[str, Any]]:
    """The keyword arguments of goat_jax.eval.harness.evaluate_lm_run from the --lm_eval_*
    flags (None without --evals lm_eval); refuses lm_eval flags no evaluation reads and bad
    values, before any run is loaded."""
    given = [f"--{k}" for k, v in vars(args).items()
             if k.startswith("lm_eval_") and v not in (None, False)]
    if "lm_eval" not in evals:
        if given:
            raise ValueError(f"{', '.join(given)} apply to --evals lm_eval only; got --evals "
                             f"{','.join(evals)}. Drop them or add lm_eval.")
        return None
    tasks = [t for t in (args.lm_eval_tasks or "").split(",") if t]
    if not tasks:
        raise ValueError("--evals lm_eval needs --lm_eval_tasks, a comma list of lm-eval tasks "
                         "(e.g. hellaswag,arc_easy) or of tasks under --lm_eval_include_path.")
    if args.lm_eval_include_path and not os.path.isdir(args.lm_eval_include_path):
        raise ValueError(f"--lm_eval_include_path {args.lm_eval_include_path}: no such directory "
                         "(it should hold the task YAML files).")
    for flag, value, low in (("--lm_eval_num_fewshot", args.lm_eval_num_fewshot, 0),
                             ("--lm_eval_batch_size", args.lm_eval_batch_size, 1),
                             ("--lm_eval_max_length", args.lm_eval_max_length, 2),
                             ("--lm_eval_bootstrap_iters", args.lm_eval_bootstrap_iters, 0)):
        if value is not None and value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}.")
    if args.lm_eval_limit is not None and not args.lm_eval_limit > 0:
        raise ValueError(f"--lm_eval_limit must be > 0 (examples per task, or a fraction < 1), "
                         f"got {args.lm_eval_limit}.")
    limit = args.lm_eval_limit
    return {"tasks": tasks, "include_path": args.lm_eval_include_path,
            "num_fewshot": args.lm_eval_num_fewshot,
            "limit": int(limit) if limit is not None and limit >= 1 else limit,
            "batch_size": args.lm_eval_batch_size or 8, "max_length": args.lm_eval_max_length,
            "samples_dir": os.path.join(out, "lm_eval_samples") if args.lm_eval_log_samples else None,
            "bootstrap_iters": 100000 if args.lm_eval_bootstrap_iters is None else args.lm_eval_bootstrap_iters}


def parse_multipliers(value: str) -> list[int]:
    """The ``--multipliers`` comma list as positive integers (lengths are ``m x`` the training
    length, whole multiples only); refuses an empty list, non-integers and values below 1."""
    mults = []
    for item in (m.strip() for m in value.split(",")):
        if not item:
            continue
        try:
            m = int(item)
        except ValueError:
            m = None
        if m is None or m < 1:
            raise ValueError(f"--multipliers {value}: {item!r} is not a positive integer; give whole "
                             "multiples of the training length, e.g. --multipliers 1,2,4,8.")
        mults.append(m)
    if not mults:
        raise ValueError(f"--multipliers {value!r} names no length; give e.g. --multipliers 1,2,4,8.")
    return mults


# What an evaluation writes into --out (write_outputs, vision and lm_eval): a second evaluation
# into the same --out refuses these unless --overwrite, which replaces them once the new ones exist.
_RESULT_FILES = ("results.json", "results.md")


def _is_result(out: str, name: str) -> bool:
    """Whether ``out/name`` is one of an evaluation's outputs (results, a figure, lm-eval's samples)."""
    path = os.path.join(out, name)
    return (name in _RESULT_FILES or (name.endswith(".png") and os.path.isfile(path))
            or (name == "lm_eval_samples" and os.path.isdir(path)))


def results_folder(out: str, overwrite: bool) -> str:
    """Refuses an ``--out`` that holds a previous evaluation's results (``results.json`` or
    ``results.md``) unless ``overwrite``; returns the folder this evaluation writes into: ``out``
    itself, or, when it replaces previous results, a new temporary sibling of ``out`` whose files
    :func:`replace_results` moves into ``out`` at the end. Nothing is removed here, so a kill or a
    failure before the end leaves the previous results whole."""
    if not os.path.isdir(out) or not any(n in _RESULT_FILES for n in os.listdir(out)):
        return out
    if not overwrite:
        raise ValueError(f"--out {out} already holds an evaluation's results; give another --out, "
                         "or add --overwrite to replace them (its results and figures are replaced).")
    parent, base = os.path.split(os.path.abspath(out))
    return tempfile.mkdtemp(prefix=f".{base}.new-", dir=parent)


def replace_results(staging: str, out: str) -> None:
    """Ends an evaluation that wrote into ``staging`` (:func:`results_folder`): if it wrote
    results (all of them, or those :func:`keep_finished` kept after an error), removes the
    previous evaluation's results, figures (``*.png``) and ``lm_eval_samples/`` from ``out`` and
    moves the new files in, so the files of two evaluations are never mixed (other files in
    ``out`` stay); if it wrote none (interrupted, or failed before any finished), removes
    ``staging`` and leaves ``out`` as it was. No-op when ``staging`` is ``out``."""
    if staging == out:
        return
    if not os.path.isfile(os.path.join(staging, "results.json")):
        shutil.rmtree(staging, ignore_errors=True)
        return
    for n in os.listdir(out):
        if _is_result(out, n):
            path = os.path.join(out, n)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    for n in os.listdir(staging):
        os.replace(os.path.join(staging, n), os.path.join(out, n))
    os.rmdir(staging)


def keep_finished(results: dict[str, dict[str, Any]], out: str, train_lens: dict[str, int],
                  setups: Optional[dict[str, dict[str, Any]]] = None) -> None:
    """After an evaluation failed or was interrupted (Ctrl-C, SIGTERM, SIGHUP): writes the
    evaluations that finished before it (``results``, ``{label: {eval: result}}``, the
    unfinished one absent) to ``out`` as a full run would, and logs what was kept, so an hour of
    finished work is not lost to the last evaluation's error or to a stop."""
    finished = {label: r for label, r in results.items() if r}
    if not finished:
        return
    runs.write_outputs(finished, out, {k: train_lens[k] for k in finished}, setups)
    cli.log(f"kept the evaluations that finished before it stopped in {out}/results.json: "
            + "; ".join(f"{label}: {', '.join(r)}" for label, r in finished.items()))


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """CLI entry point (argparse); returns ``{label: {eval: result}}``. SIGTERM, Ctrl-C and SIGHUP
    stop it like an error does: the evaluations that finished are written to ``--out`` first
    (:func:`keep_finished`), then :class:`goat_jax.train.interrupts.Stopped` is raised (the
    command line prints one line and exits 128 + the signal's number)."""
    with interrupts.raise_on_stop():
        return _main(argv)


def _main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """:func:`main` without the signal handlers."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", action="append", required=True, help="run dir (repeatable)")
    p.add_argument("--label", action="append", help="label per --workdir (default: encoding)")
    p.add_argument("--evals", default="extrapolation,sinks", help=f"comma list of {EVALS} or "
                   "resolution; each applies to the runs of certain tasks (goat_jax.eval.checks."
                   "EVAL_TASKS), a mismatch is refused listing the ones that fit")
    p.add_argument("--multipliers", default="1,2,4,8,16", help="lengths as multiples of seq_len")
    p.add_argument("--stride", type=int, default=None, help="sliding-window stride (default: none)")
    p.add_argument("--num_examples", type=int, default=32, help="examples per length (retrieval)")
    p.add_argument("--num_trials", type=int, default=8, help="standard passkey prompts per length")
    p.add_argument("--chunk_size", type=int, default=None, help="extrapolation: evaluate each "
                   "window through the KV cache in chunks of this many queries (e.g. 512, as the "
                   "official C4 evaluation); default: whole windows")
    p.add_argument("--num_windows", type=int, default=None, help="diagnostics: held-out windows "
                   "per length (default 4)")
    p.add_argument("--recent_keys", type=int, default=None, help="diagnostics: the mass on the "
                   "last N keys (default 128, the official)")
    p.add_argument("--text", default=None, help="extrapolation: a UTF-8 text file to score "
                   "instead of the held-out split (each run's own tokenizer)")
    p.add_argument("--fasta", action="append", default=[], help="dna: FASTA file (repeatable)")
    p.add_argument("--lengths", default="", help="dna: window lengths in bases (overrides "
                   "--multipliers), e.g. 1024,4096")
    p.add_argument("--max_bases", type=int, default=None, help="dna: use only the first bases")
    p.add_argument("--gc_windows", type=int, default=256, help="dna: GC windows (0: skip GC)")
    p.add_argument("--out", default=None, help="output dir (default: WORKDIR_eval next to the first "
                   "--workdir; checked before any evaluation: never inside a run, which may still "
                   "be training, nor an existing file)")
    p.add_argument("--overwrite", action="store_true", help="replace the results and figures of "
                   "a previous evaluation in --out (without it such an --out is refused)")
    p.add_argument("--resolutions", default="", help="ViT runs: evaluation resolutions in px, e.g. 28,42,56,84")
    p.add_argument("--lm_eval_tasks", default=None, help="lm_eval: comma list of lm-eval tasks")
    p.add_argument("--lm_eval_include_path", default=None, help="lm_eval: a directory of task YAMLs")
    p.add_argument("--lm_eval_limit", type=float, default=None, help="lm_eval: examples per task "
                   "(a fraction if < 1), as lm-eval's --limit")
    p.add_argument("--lm_eval_num_fewshot", type=int, default=None, help="lm_eval: few-shot "
                   "examples (default: the task's)")
    p.add_argument("--lm_eval_batch_size", type=int, default=None, help="lm_eval: requests per "
                   "forward pass (default 8)")
    p.add_argument("--lm_eval_max_length", type=int, default=None, help="lm_eval: the window in "
                   "tokens (default: the run's seq_len)")
    p.add_argument("--lm_eval_bootstrap_iters", type=int, default=None, help="lm_eval: bootstrap "
                   "resamples for the standard errors (default 100000; 0: none)")
    p.add_argument("--lm_eval_log_samples", action="store_true", help="lm_eval: write every "
                   "request and response to OUT/lm_eval_samples/<label>/<task>.jsonl")
    p.add_argument("--position_encoding", default=None, choices=POSITION_ENCODINGS, help="evaluate "
                   "with this encoding on the run's parameters: 'yarn', 'ntk' or 'rope_pi' for a "
                   "'rope' run (other swaps are refused)")
    p.add_argument("--logn_scaling", default=None, choices=LOGN_MODES, help="evaluate with log-n "
                   "scaling of the content logits ('content') or of the whole logit ('all')")
    p.add_argument("--rope_scaling_factor", type=float, default=None, help="'yarn' / 'ntk': a fixed "
                   "frequency-scaling factor instead of the dynamic max(1, length / training length); "
                   "needed for --evals documents past 1x")
    p.add_argument("--mesh_context", type=int, default=1, help="split each window over this many devices "
                   "(the context mesh axis, as mesh.context in training) for windows one device cannot "
                   "hold: extrapolation, niah, passkey of synthetic runs, dna; the evaluations that decode "
                   "or read attention probabilities are refused (default 1: one device)")
    args = p.parse_args(argv)
    evals = [e for e in args.evals.split(",") if e]
    swap = {"position_encoding": args.position_encoding, "logn_scaling": args.logn_scaling,
            "rope_scaling_factor": args.rope_scaling_factor}
    diagnostics_options = _check_chunk_and_diagnostics_flags(args, evals)
    out = args.out or os.path.normpath(args.workdir[0]) + "_eval"
    lm_eval_options = _lm_eval_options(args, evals, out)
    # Before any work: every evaluation fits every run's task, and --out can take the results.
    checks.check_evals_fit(args.workdir, evals)
    run_lib.check_output_dir(out, "evaluation", "_eval")
    mults = parse_multipliers(args.multipliers) if "resolution" not in evals else []
    if (any(v is not None for v in swap.values()) or args.mesh_context != 1) and "resolution" in evals:
        raise ValueError("--position_encoding / --logn_scaling / --rope_scaling_factor / --mesh_context apply "
                         "to language runs, not --evals resolution.")
    dna_lengths = [int(n) for n in args.lengths.split(",") if n] or None
    if "resolution" not in evals:
        for workdir in args.workdir:  # the whole request, on every run, before any work
            config = run_lib.read_config(workdir)
            lm_run.check_request(config, workdir, evals, mults, **swap)
            context.check_request(config, workdir, evals, mults, args.mesh_context, chunk_size=args.chunk_size,
                                  lengths=dna_lengths, lm_eval_length=args.lm_eval_max_length)
    if "resolution" in evals:  # ViT runs: a family of its own, evaluated in goat_jax.eval.vision
        from goat_jax.eval import vision

        resolutions = [int(r) for r in args.resolutions.split(",") if r]
        if evals != ["resolution"] or not resolutions:
            raise ValueError("--evals resolution (ViT runs) stands alone and needs --resolutions, e.g. "
                             "--evals resolution --resolutions 28,42,56,84.")
        labels = runs.run_labels(args.workdir, args.label)  # unique; reads only config.json
        dest = results_folder(out, args.overwrite)
        try:
            results = vision.evaluate_vision_runs(args.workdir, labels, resolutions, dest, log=cli.log)
        finally:
            replace_results(dest, out)
        print(open(os.path.join(out, "results.md")).read())
        return results
    labels = runs.run_labels(args.workdir, args.label)  # unique; reads only config.json
    if any(v is not None for v in swap.values()) and not args.label:
        suffix = (f" as {args.position_encoding}" if args.position_encoding else "") + (
            f"+logn_{args.logn_scaling}" if args.logn_scaling else "") + (
            f" (factor {args.rope_scaling_factor:g})" if args.rope_scaling_factor is not None else "")
        labels = [label + suffix for label in labels]
    dest = results_folder(out, args.overwrite)
    if lm_eval_options and lm_eval_options["samples_dir"]:
        lm_eval_options["samples_dir"] = os.path.join(dest, "lm_eval_samples")
    try:
        results = _evaluate_lm_runs(args, labels, evals, mults, swap, dest, dna_lengths=dna_lengths,
                                    diagnostics_options=diagnostics_options, lm_eval_options=lm_eval_options)
    finally:
        replace_results(dest, out)
    cli.log(f"wrote {out}/results.md, results.json and figures")
    return results


def _evaluate_lm_runs(args, labels, evals, mults, swap, dest, *, dna_lengths, diagnostics_options,
                      lm_eval_options) -> dict[str, Any]:
    """Evaluates each ``--workdir`` (language, DNA runs) and writes the results into ``dest``;
    after an error, writes the evaluations that finished (:func:`keep_finished`) and raises."""
    results, train_lens, setups = {}, {}, {}
    for workdir, label in zip(args.workdir, labels):
        # Each window split over --mesh_context devices (1: the run on one device, unchanged).
        run = context.on_mesh(lm_run.swap_encoding(lm_run.load_lm_run(workdir), **swap), args.mesh_context)
        cli.log(f"evaluating {label} ({workdir}, step {run.step}): {', '.join(evals)}")
        dna_options = {"fasta": args.fasta, "max_bases": args.max_bases, "gc_windows": args.gc_windows,
                       "lengths": dna_lengths}
        train_lens[label] = run.train_len
        setups[label] = context.setup(run.plan, args.mesh_context)
        results[label] = {}  # filled as each evaluation finishes
        try:
            runs.evaluate_run(run, evals, mults, stride=args.stride, num_examples=args.num_examples,
                              num_trials=args.num_trials, dna_options=dna_options, text_file=args.text,
                              chunk_size=args.chunk_size, diagnostics_options=diagnostics_options,
                              lm_eval_options=lm_eval_options and {**lm_eval_options, "label": label},
                              into=results[label])
        except BaseException:  # an error, Ctrl-C, SIGTERM or SIGHUP (interrupts.raise_on_stop): keep the finished
            keep_finished(results, dest, train_lens, setups)
            raise
    print(runs.write_outputs(results, dest, train_lens, setups))
    return results


if __name__ == "__main__":
    from goat_jax import platforms  # pylint: disable=g-import-not-at-top
    platforms.avoid_libtpu_without_tpu()  # before any JAX backend starts (goat_jax/platforms.py)
    cli.run(main)  # config and input errors: one line (GOAT_DEBUG=1: traceback)
