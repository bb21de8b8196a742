"""Samples from a trained language or genome run: what ``python -m experiments.sample`` runs.

    request = prepare(workdir, prompts=[("--prompt", "The cat")], max_new_tokens=32)  # no weights read
    run = lm_run.load_lm_run(request.workdir, request.step)
    rows, timing = sample(run, request, on_progress=None)

:func:`prepare` makes every check a request can fail before any weights are read: the run's
task ('lm' or 'dna'; a ViT or a synthetic-task run is refused), its checkpoint step, the
sampling options, and the prompts, tokenized by the run's own tokenizer (bytes, SentencePiece,
GPT-2 BPE; "ACGNT" bases for DNA) and checked against the positions the model can hold.
:func:`sample` then decodes with the KV cache (:func:`goat_jax.models.sampling.generate`), every
row of one prompt length in one batch, and times the decoding from the host callback of each
token (so the rate excludes compiling and the prompt's prefill).

Text prompts start with the tokenizer's BOS, as every training document (or window, with
``data.bos_windows``) did; genome prompts are bases only. A continuation is cut at the first EOS
a text model samples (the rest would be the start of a new document); its row says where
(``eos_at``) and keeps every generated token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from goat_jax.data import fasta, synthetic
from goat_jax.data import tokenizers as tokenizers_lib
from goat_jax.prior.positions import MAX_POSITION
from goat_jax.train import run as run_lib
from goat_jax.train import tasks as tasks_lib

TASKS = ("lm", "dna")  # config.task of the runs that can be sampled
# Prompt lengths share one compiled decoder per this many tokens when a request holds several
# lengths (goat_jax.models.sampling.generate's prefill_multiple; the tokens are the exact path's).
PREFILL_MULTIPLE = 64


@dataclasses.dataclass(frozen=True)
class Request:
    """A checked sampling request (:func:`prepare`): nothing in it needs the weights."""

    workdir: str
    step: int  # the checkpoint to load
    task: str  # 'lm' or 'dna'
    tokenizer: Any  # the run's own (goat_jax.data.tokenizers, or fasta.DnaTokenizer)
    prompts: tuple  # ((where, text), ...): where names the source in messages and rows
    prompt_ids: tuple  # one int32 array per prompt, BOS first for text runs
    max_new_tokens: int
    temperature: float  # 0: greedy
    top_k: Optional[int]
    seed: int
    num_samples: int
    notes: tuple = ()  # what the tokenizer changed in a prompt (IUPAC codes read as N), to log
    mesh_context: int = 1  # devices the KV cache is split over (goat_jax/kernels/decode_merge.py)

    @property
    def rows(self) -> list[tuple[int, int]]:
        """``(prompt index, sample index)`` of every row, prompt by prompt."""
        return [(i, j) for i in range(len(self.prompts)) for j in range(self.num_samples)]


@dataclasses.dataclass
class Row:
    """One continuation: what ``--out`` writes as a JSON line (:meth:`record`)."""

    prompt_index: int
    sample_index: int
    where: str  # the prompt's source ('--prompt', or 'FILE line N')
    prompt: str
    prompt_tokens: int  # BOS included for text runs
    tokens: list  # every generated id, past an EOS too
    eos_at: Optional[int]  # index in tokens of the first EOS (text runs), or None
    continuation: str  # the tokens before eos_at, decoded

    def record(self, request: Request) -> dict[str, Any]:
        """The JSON-able row, with the request's settings."""
        return {"workdir": request.workdir, "step": request.step, "prompt_index": self.prompt_index,
                "sample_index": self.sample_index, "prompt_source": self.where, "prompt": self.prompt,
                "prompt_tokens": self.prompt_tokens, "continuation": self.continuation,
                "tokens": self.tokens, "eos_at": self.eos_at, "temperature": request.temperature,
                "top_k": request.top_k, "seed": request.seed}


@dataclasses.dataclass
class Timing:
    """Where a request's time went: ``wall`` seconds in all (compiling and prefill included);
    ``decode_steps`` row-tokens drawn after each batch's first token, in ``decode_seconds``."""

    wall: float = 0.0
    tokens: int = 0  # every generated token of every row
    decode_steps: int = 0
    decode_seconds: float = 0.0

    def line(self) -> str:
        """The one-line tokens/s summary the command prints last."""
        if self.decode_steps and self.decode_seconds > 0:
            return (f"tokens/s: {self.decode_steps / self.decode_seconds:.1f} decoding ({self.decode_steps} "
                    f"tokens after each batch's first, in {self.decode_seconds:.3f} s); {self.tokens} tokens "
                    f"in {self.wall:.1f} s wall, compiling and prefill included")
        return (f"tokens/s: {self.tokens / max(self.wall, 1e-9):.1f} ({self.tokens} tokens in {self.wall:.1f} s "
                "wall, compiling and prefill included: one new token per row leaves no decoding step to time "
                "alone)")


# ----------------------------------------------------------------------------------------------
# Checks, before any weights are read
# ----------------------------------------------------------------------------------------------


def check_options(*, max_new_tokens: Any, temperature: Any, top_k: Any, seed: Any, num_samples: Any,
                  mesh_context: Any) -> None:
    """Refuses a bad sampling option in one line naming the flag and the fix, and options greedy
    decoding (``temperature`` 0) would ignore: ``--top_k``, ``--seed``, ``--num_samples > 1``
    (identical copies); ``mesh_context`` more devices than the process has."""

    def integer(flag, value, low):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{flag} must be an integer >= {low}, got {value!r}.")

    integer("--mesh_context", mesh_context, 1)
    if mesh_context > jax.device_count():
        raise ValueError(f"--mesh_context {mesh_context}: the KV cache would be split over {mesh_context} devices, "
                         f"but this process sees {jax.device_count()}; give at most {jax.device_count()} (on a CPU "
                         f"host, XLA_FLAGS=--xla_force_host_platform_device_count={mesh_context} makes that many).")
    integer("--max_new_tokens", max_new_tokens, 1)
    integer("--num_samples", num_samples, 1)
    if top_k is not None:
        integer("--top_k", top_k, 1)
    if seed is not None:
        integer("--seed", seed, 0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise ValueError(f"--temperature must be a finite number >= 0 (0: greedy), got {temperature!r}.")
    if temperature == 0:
        for flag, given in (("--top_k", top_k is not None), ("--seed", seed is not None),
                            (f"--num_samples {num_samples}", num_samples > 1)):
            if given:
                what = "identical copies" if flag.startswith("--num") else "nothing"
                raise ValueError(f"{flag} applies to sampling, but --temperature 0 decodes greedily ({what} to "
                                 f"draw); give --temperature > 0 or drop {flag.split()[0]}.")


def read_prompts(prompt: Optional[str], prompt_file: Optional[str]) -> list[tuple[str, str]]:
    """``[(where, text)]`` from ``--prompt`` or ``--prompt_file`` (one prompt a line; the
    file's final newline ends the last line). Refuses both or neither, a missing or non-UTF-8
    file, and any empty prompt, naming its line."""
    if (prompt is None) == (prompt_file is None):
        raise ValueError("give one of --prompt TEXT or --prompt_file FILE (one prompt a line).")
    if prompt is not None:
        if not prompt:
            raise ValueError("--prompt is empty; give the text to continue (at least one character).")
        return [("--prompt", prompt)]
    if not os.path.isfile(prompt_file):
        raise ValueError(f"--prompt_file {prompt_file}: no such file.")
    try:
        with open(prompt_file, encoding="utf-8", newline="") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompt_file {prompt_file}: not UTF-8 text ({e.reason} at byte {e.start}).") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the final newline
    lines = [line[:-1] if line.endswith("\r") else line for line in lines]
    if not lines:
        raise ValueError(f"--prompt_file {prompt_file} holds no prompt; write one prompt a line.")
    empty = [i + 1 for i, line in enumerate(lines) if not line]
    if empty:
        raise ValueError(f"--prompt_file {prompt_file}: line(s) {', '.join(map(str, empty[:10]))} are empty; "
                         "every line is a prompt, so remove the blank lines.")
    return [(f"{prompt_file} line {i + 1}", line) for i, line in enumerate(lines)]


def check_run(workdir: str, step: Optional[int]) -> tuple[Any, int]:
    """``(config, step)`` of a run that can be sampled, reading only its config.json and the
    names of its checkpoints: refuses a missing workdir, a run of another task than
    :data:`TASKS` (a ViT), a synthetic-task run (no text tokenizer), a run with no checkpoint
    yet, and a ``step`` it does not hold (listing those it does)."""
    if not os.path.isdir(workdir):
        raise ValueError(f"--workdir {workdir}: no such directory; give the workdir of a run of "
                         "experiments.train.")
    if not os.path.isfile(run_lib.config_path(workdir)):
        raise ValueError(f"--workdir {workdir} is not a run of experiments.train (no {run_lib.CONFIG_FILE}).")
    config = run_lib.read_config(workdir)
    task = str(config.get("task"))
    if task not in TASKS:
        kind = "a vision run" if task == "vit" else "a run"
        raise ValueError(f"--workdir {workdir} is {kind} of config.task={task!r}; experiments.sample "
                         f"continues token sequences of language and genome runs (config.task in {TASKS}).")
    if synthetic.is_synthetic(config):
        raise ValueError(f"--workdir {workdir} trained on the synthetic task {config.data.get('kind')!r}, "
                         "which has no text tokenizer to read a prompt with; sample a run trained on text or "
                         "a genome.")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"--step must be an integer >= 0 (a checkpoint's step), got {step!r}.")
    steps = run_lib.checkpoint_steps(workdir)
    if not steps:
        raise ValueError(f"--workdir {workdir} holds no complete checkpoint yet; wait for the run's first "
                         "checkpoint (checkpoint_every_steps).")
    if step is not None and step not in steps:
        raise ValueError(f"--step {step}: {workdir} holds checkpoints at step(s) "
                         f"{', '.join(map(str, steps))}; give one of them (or drop --step for the last).")
    return config, int(steps[-1] if step is None else step)


def run_tokenizer(config: Any) -> Any:
    """The run's own tokenizer, without training or downloading one: bases ("ACGNT") for a
    genome run; ``data.tokenizer`` of a text run (a SentencePiece model must exist at
    ``data.spm_model_path``; GPT-2's BPE files must be local)."""
    if str(config.task) == "dna":
        return fasta.DnaTokenizer()
    return tokenizers_lib.make_tokenizer(config.data, allow_training=False)


def max_positions(config: Any) -> int:
    """The most positions (prompt and new tokens) the run's model can hold: ``model.max_len``
    for an encoding with a position table, else MAX_POSITION (2**24)."""
    from goat_jax.tasks import lm as lm_task  # pylint: disable=g-import-not-at-top

    cfg = lm_task.model_config(config, str(config.task))
    return int(cfg.max_positions) if cfg.max_positions is not None else MAX_POSITION


def encode_prompts(config: Any, tokenizer: Any, prompts: Sequence[tuple[str, str]],
                   max_new_tokens: int) -> list[np.ndarray]:
    """Each prompt's ids (int32; BOS first for text runs), refusing one the tokenizer cannot read
    (a genome prompt with a character that is not a base) or one that, with ``max_new_tokens``,
    needs more positions than the model holds (:func:`max_positions`), naming the prompt."""
    limit = max_positions(config)
    bos = [] if str(config.task) == "dna" else [int(tokenizer.bos_id)]
    out = []
    for where, text in prompts:
        if str(config.task) == "dna":
            allowed = set(fasta.ALPHABET + fasta.AMBIGUOUS) | set((fasta.ALPHABET + fasta.AMBIGUOUS).lower())
            bad = [(i, c) for i, c in enumerate(text) if c not in allowed]
            if bad:
                raise ValueError(f"{where}: a genome prompt holds bases only ({fasta.ALPHABET} and the IUPAC codes "
                                 f"{fasta.AMBIGUOUS}, either case), but has {bad[0][1]!r} at position {bad[0][0]} "
                                 f"({len(bad)} such character(s)); remove them.")
        ids = bos + list(tokenizer.encode(text))
        if len(ids) > limit:
            raise ValueError(f"{where}: the prompt is {len(ids)} tokens, longer than the {limit} positions the "
                             f"model of {config.model.position_encoding!r} can hold; shorten it.")
        if len(ids) + max_new_tokens > limit:
            raise ValueError(f"{where}: the prompt's {len(ids)} tokens and --max_new_tokens {max_new_tokens} need "
                             f"{len(ids) + max_new_tokens} positions, but the model holds {limit}; lower "
                             f"--max_new_tokens to <= {limit - len(ids)} or shorten the prompt.")
        out.append(np.asarray(ids, np.int32))
    return out


def prepare(workdir: str, prompts: Sequence[tuple[str, str]], *, max_new_tokens: int = 64,
            temperature: float = 1.0, top_k: Optional[int] = None, seed: Optional[int] = None,
            num_samples: int = 1, step: Optional[int] = None, mesh_context: int = 1) -> Request:
    """Every check of a sampling request, before any weights are read (module doc): the options
    (:func:`check_options`), the run (:func:`check_run`) and the prompts, tokenized by the run's
    tokenizer (:func:`encode_prompts`). ``prompts``: ``[(where, text)]`` (:func:`read_prompts`).
    Returns the :class:`Request`; raises ValueError naming the flag or prompt and the fix."""
    check_options(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
                  num_samples=num_samples, mesh_context=mesh_context)
    config, step = check_run(workdir, step)
    config = tasks_lib.with_field_defaults(config, tasks_lib.get_task(config.task))
    tokenizer = run_tokenizer(config)
    if top_k is not None and top_k > config.model.vocab_size:
        raise ValueError(f"--top_k {top_k} exceeds the run's vocabulary of {config.model.vocab_size} tokens; "
                         f"give at most {config.model.vocab_size}.")
    ids = encode_prompts(config, tokenizer, prompts, max_new_tokens)
    notes = []
    if str(config.task) == "dna":
        for where, text in prompts:
            ambiguous = fasta.encode(text)[1]
            if ambiguous:
                notes.append(f"{where}: {ambiguous} IUPAC code(s) ({fasta.AMBIGUOUS}) read as N, as the "
                             "genome pipeline reads them")
    return Request(notes=tuple(notes), workdir=workdir, step=step, task=str(config.task), tokenizer=tokenizer,
                   prompts=tuple(prompts),
                   prompt_ids=tuple(ids), max_new_tokens=max_new_tokens, temperature=float(temperature),
                   top_k=top_k, seed=0 if seed is None else int(seed), num_samples=num_samples,
                   mesh_context=mesh_context)


# ----------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------


def decode_continuation(request: Request, tokens: Sequence[int]) -> tuple[str, Optional[int]]:
    """``(text, eos_at)``: ``tokens`` decoded by the run's tokenizer up to the first EOS (text
    runs; genome runs have none), and that EOS's index (None if there is none)."""
    tokens = [int(t) for t in tokens]
    eos = getattr(request.tokenizer, "eos_id", None)
    eos_at = tokens.index(eos) if eos is not None and eos in tokens else None
    return request.tokenizer.decode(tokens[:eos_at]), eos_at


class _Clock:
    """The host callback of every drawn token (``generate``'s ``on_token``): stamps the first
    and last step of the current batch and forwards ``(step, tokens)`` to ``on_progress``. One
    object for the whole request, so batches of lengths that share a compiled decoder reuse it."""

    def __init__(self, on_progress):
        self.on_progress = on_progress
        self.first = self.last = None

    def reset(self):
        self.first = self.last = None

    def __call__(self, step, tokens):
        now = time.perf_counter()
        if int(step) == 0:
            self.first = now
        self.last = now
        if self.on_progress is not None:
            self.on_progress(int(step), np.asarray(tokens))


def sample(run: Any, request: Request,
           on_progress: Optional[Callable[[int, np.ndarray], None]] = None,
           on_batch: Optional[Callable[[list, int], None]] = None) -> tuple[list[Row], Timing]:
    """Continues every prompt of ``request`` ``num_samples`` times with ``run``'s model (a
    :class:`goat_jax.eval.lm_run.LMRun` of the request's workdir and step). Rows of one prompt
    length form one batch; several lengths share compiled decoders (:data:`PREFILL_MULTIPLE`).
    Batch ``g`` samples with ``fold_in(PRNGKey(seed), g)``, so a command repeated gives the same
    rows. ``on_batch(rows, length)`` is called before each batch (its ``[(prompt, sample)]``);
    ``on_progress(step, tokens [B])`` as each token is drawn. Returns the rows in prompt order
    and the :class:`Timing`."""
    from goat_jax.eval import context  # pylint: disable=g-import-not-at-top
    from goat_jax.models import sampling  # pylint: disable=g-import-not-at-top

    # --mesh_context: the parameters replicated on a mesh whose one split axis is context; the KV
    # cache's slots split over it (docs/training.md, "Decoding with a sharded cache").
    run = context.on_mesh(run, request.mesh_context)
    on_mesh = (lambda: jax.set_mesh(run.mesh)) if request.mesh_context > 1 else contextlib.nullcontext

    groups: dict[int, list[tuple[int, int]]] = {}
    for i, j in request.rows:
        groups.setdefault(len(request.prompt_ids[i]), []).append((i, j))
    several = len(groups) > 1
    limit = max_positions(run.config)
    clock, timing, rows = _Clock(on_progress), Timing(), {}
    key = jax.random.PRNGKey(request.seed)
    start = time.perf_counter()
    for g, (length, members) in enumerate(sorted(groups.items())):
        if on_batch is not None:
            on_batch(members, length)
        prompt = jnp.asarray(np.stack([request.prompt_ids[i] for i, _ in members]))
        clock.reset()
        extra = {"prefill_multiple": PREFILL_MULTIPLE, "cache_length": limit} if several else {}
        # Tokens stream through an ordered host callback, which JAX runs on one device only: under
        # --mesh_context the continuation is printed whole and timed by the wall clock.
        streamed = clock if request.mesh_context == 1 else None
        with on_mesh():
            out = np.asarray(jax.device_get(sampling.generate(
                run.model, run.params, prompt, request.max_new_tokens,
                jax.random.fold_in(key, g) if request.temperature > 0 else None,
                temperature=request.temperature, top_k=request.top_k, on_token=streamed, **extra)))
        if request.max_new_tokens > 1 and clock.first is not None:
            timing.decode_steps += len(members) * (request.max_new_tokens - 1)
            timing.decode_seconds += clock.last - clock.first
        for r, (i, j) in enumerate(members):
            new = out[r, length:].tolist()
            text, eos_at = decode_continuation(request, new)
            rows[(i, j)] = Row(i, j, request.prompts[i][0], request.prompts[i][1], length, new, eos_at, text)
    timing.wall = time.perf_counter() - start
    timing.tokens = len(rows) * request.max_new_tokens
    return [rows[k] for k in request.rows], timing
