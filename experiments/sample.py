"""Sample continuations from a trained language or genome run, decoded by the run's own tokenizer.

    python -m experiments.sample --workdir runs/tiny --prompt "The hacker" --max_new_tokens 64
    python -m experiments.sample --workdir runs/tiny --prompt_file prompts.txt --num_samples 4 \\
        --temperature 0.8 --top_k 40 --seed 1 --out runs/tiny_samples.jsonl
    python -m experiments.sample --workdir runs/dna_tiny --prompt ACGTTGCA --max_new_tokens 200

``--workdir`` is a run of ``experiments.train`` of config.task 'lm' (text) or 'dna' (bases);
its last checkpoint is read (``--step N``: another one), read-only, so a run still training can
be sampled. ``--prompt TEXT`` is one prompt; ``--prompt_file FILE`` holds one prompt a line,
all continued in batches (one per prompt length). Text prompts start with the tokenizer's BOS,
as the training documents did; a genome prompt is bases (ACGTN and IUPAC codes, either case).

Decoding runs with the KV cache (goat_jax.models.sampling.generate): ``--temperature 0`` is
greedy, ``> 0`` samples (``--top_k``: among the k likeliest tokens only) with ``--seed``
(default 0; the same command gives the same samples). ``--num_samples N`` continues every
prompt N times. A text continuation ends at the first EOS the model samples (marked; ``--out``
keeps every token). On a terminal a single continuation is printed token by token as it is
generated, several show a progress counter on stderr; the last line of stdout gives tokens/s
(the decoding after each batch's first token, compiling and prefill excluded; the wall time too).
``--out FILE`` writes one JSON line per continuation (prompt, continuation, generated token
ids, where an EOS cut it, the settings). Progress lines go to stderr, the samples to stdout.

Every check runs before any weights are read, each refusal one line naming the flag: a missing
workdir, a ViT or synthetic-task run, a checkpoint step the run lacks, an empty prompt, a prompt
that with ``--max_new_tokens`` needs more positions than the model holds, a non-finite or
negative temperature, options greedy decoding would ignore, and a ``--mesh_context`` of more devices
than the process has. ``--mesh_context N`` splits the KV cache's slots over N devices (each shard
scores its own slots; the partial softmaxes are merged: docs/training.md, "Decoding with a
sharded cache"); the continuation is the one-device one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, Optional, TextIO

from goat_jax import cli, files
from goat_jax.eval import samples
from goat_jax.train import run as run_lib


def log(msg: str) -> None:
    """A progress line ``[HH:MM:SS] msg`` on stderr (stdout carries the samples)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def check_out(out: Optional[str], overwrite: bool) -> None:
    """Refuses, before any work, an ``--out`` file that exists (unless ``overwrite``), is a
    directory, lies inside a run's workdir (no tool writes beside a run's checkpoints), or whose
    folder cannot be written."""
    if out is None:
        return
    path = os.path.abspath(out)
    if os.path.isdir(path):
        raise ValueError(f"--out {out} is a directory; give a file name, e.g. "
                         f"--out {os.path.join(out, 'samples.jsonl')}.")
    if os.path.exists(path) and not overwrite:
        raise ValueError(f"--out {out} exists; give another file, or add --overwrite to replace it.")
    probe = os.path.dirname(path)
    while True:
        if run_lib.is_run_dir(probe):
            raise ValueError(f"--out {out} is inside the run workdir {probe}; experiments.sample never writes "
                             f"into a run (it may still be training). Write it elsewhere, e.g. --out "
                             f"{os.path.normpath(probe)}_samples.jsonl.")
        if os.path.dirname(probe) == probe:
            break
        probe = os.path.dirname(probe)
    files.check_writable(os.path.dirname(path), "--out")


def header(request: samples.Request, i: int, j: int) -> str:
    """The line above a continuation: which prompt (its source and start) and which sample."""
    where, text = request.prompts[i]
    shown = text if len(text) <= 60 else text[:57] + "..."
    return (f"=== prompt {i + 1}/{len(request.prompts)} ({where}) {shown!r}, sample {j + 1}/{request.num_samples} "
            f"===")


def footer(request: samples.Request, row: samples.Row) -> Optional[str]:
    """The note under a continuation an EOS cut, else None."""
    if row.eos_at is None:
        return None
    return (f"[EOS at token {row.eos_at + 1} of {len(row.tokens)}: the model ended the document; the "
            "tokens after it are not shown (--out keeps them)]")


class Printer:
    """What the command shows while a request runs. ``live`` (stdout is a terminal): a request
    of one continuation streams it token by token to ``out``; several show ``token k/N`` on
    ``err`` (a terminal too) while each batch runs. Not live: nothing until the rows are done."""

    def __init__(self, request: samples.Request, live: bool, out: Optional[TextIO] = None,
                 err: Optional[TextIO] = None):
        self.request = request
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.stream = live and len(request.rows) == 1
        self.counter = live and not self.stream and self.err.isatty()
        self.ids: list = []
        self.shown = ""
        self.ended = False

    def on_batch(self, members: list, length: int) -> None:
        """Before a batch: the streamed continuation's header, or a log line."""
        if self.stream:
            print(header(self.request, *members[0]), file=self.out, flush=True)
        else:
            log(f"continuing {len(members)} row(s) of {length}-token prompts by {self.request.max_new_tokens} tokens")

    def on_token(self, step: int, tokens) -> None:
        """Each drawn token: the new text of the streamed row, or the counter."""
        if self.counter:
            print(f"\r  token {step + 1}/{self.request.max_new_tokens}", end="", file=self.err, flush=True)
            if step + 1 == self.request.max_new_tokens:
                print("", file=self.err, flush=True)
        if not self.stream or self.ended:
            return
        self.ids.append(int(tokens[0]))
        text, eos_at = samples.decode_continuation(self.request, self.ids)
        self.ended = eos_at is not None
        # A byte tokenizer's character may span tokens: wait until it is whole.
        if text.startswith(self.shown) and (not text.endswith("\ufffd") or self.ended):
            print(text[len(self.shown):], end="", file=self.out, flush=True)
            self.shown = text

    def finish(self, rows: Sequence[samples.Row]) -> None:
        """After the request: the rows not streamed (each under its header), notes of EOS."""
        for row in rows:
            if self.stream:
                rest = row.continuation[len(self.shown):] if row.continuation.startswith(self.shown) else ""
                print(rest, file=self.out, flush=True)
            else:
                print(header(self.request, row.prompt_index, row.sample_index), file=self.out)
                print(row.continuation, file=self.out)
            note = footer(self.request, row)
            if note:
                print(note, file=self.out)
        self.out.flush()


def main(argv: Optional[Sequence[str]] = None) -> list[dict[str, Any]]:
    """CLI entry point (argparse); returns the rows ``--out`` writes (one dict per continuation)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", required=True, help="a run of experiments.train (config.task 'lm' or 'dna')")
    p.add_argument("--prompt", default=None, help="the text (or bases) to continue")
    p.add_argument("--prompt_file", default=None, help="a UTF-8 file of prompts, one a line (batched)")
    p.add_argument("--max_new_tokens", type=int, default=64, help="tokens to generate per row (default 64)")
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy; > 0 divides the logits "
                   "before sampling (default 1.0)")
    p.add_argument("--top_k", type=int, default=None, help="sample among the k likeliest tokens only")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default 0; sampling only)")
    p.add_argument("--num_samples", type=int, default=1, help="continuations per prompt (sampling only)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint step (default: the last)")
    p.add_argument("--mesh_context", type=int, default=1, help="devices the KV cache's slots are split over "
                   "(the same continuation; on a CPU host, XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    p.add_argument("--out", default=None, help="write one JSON line per continuation to this file")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = p.parse_args(argv)
    # Every check before any weights are read.
    samples.check_options(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                          seed=args.seed, num_samples=args.num_samples, mesh_context=args.mesh_context)
    prompts = samples.read_prompts(args.prompt, args.prompt_file)
    request = samples.prepare(args.workdir, prompts, max_new_tokens=args.max_new_tokens,
                              temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                              num_samples=args.num_samples, step=args.step, mesh_context=args.mesh_context)
    check_out(args.out, args.overwrite)
    for note in request.notes:
        log(note)

    from goat_jax.eval import lm_run  # pylint: disable=g-import-not-at-top  # JAX and the model: after the checks

    log(f"loading {args.workdir} (step {request.step})")
    run = lm_run.load_lm_run(args.workdir, request.step)
    printer = Printer(request, live=sys.stdout.isatty())
    how = "greedy" if request.temperature == 0 else (
        f"temperature {request.temperature:g}" + (f", top-{request.top_k}" if request.top_k else "")
        + f", seed {request.seed}")
    log(f"sampling {len(request.rows)} continuation(s) of {request.max_new_tokens} tokens ({how}); the first "
        "batch compiles the decoder")
    rows, timing = samples.sample(run, request, on_progress=printer.on_token, on_batch=printer.on_batch)
    printer.finish(rows)
    records = [row.record(request) for row in rows]
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        files.write_whole(args.out, "".join(json.dumps(r) + "\n" for r in records))
        log(f"wrote {len(records)} row(s) to {args.out}")
    print(timing.line(), flush=True)
    return records


if __name__ == "__main__":
    from goat_jax import platforms  # pylint: disable=g-import-not-at-top
    platforms.avoid_libtpu_without_tpu()  # before any JAX backend starts (goat_jax/platforms.py)
    cli.run(main)  # input errors: one line (GOAT_DEBUG=1: traceback)
