"""Reproduce the paper's experiments at one scale: one command -> REPORT.md + figures.

    python -m experiments.reproduce --suite tiny                   # ~2.5 h on 2 CPU cores
    python -m experiments.reproduce --suite tiny --families dna    # one family: lm, vit or dna
    python -m experiments.reproduce --suite smoke --out /tmp/rep   # minutes: the harness end to end
    python -m experiments.reproduce --suite paper --dry_run        # the cluster commands, printed

Three families, each comparing position encodings with everything else identical:

* ``lm`` (language; ``--encodings``: GOAT, RoPE, RoPE-PI, ALiBi, sinusoidal, NoPE), per encoding
  a byte-level LM on the Jargon File -> perplexity at 1x..16x the training length
  (non-overlapping windows), the standard passkey prompt (greedy, KV cache), attention sinks;
  a synthetic passkey model -> teacher-forced key accuracy at 1x..16x; a synthetic NIAH model
  -> span token accuracy over lengths x depths (heatmaps); plus the toy copy-mixture GOAT model
  and its prior figure (experiments/report_lm.py).
* ``vit`` (vision; ``--vit_encodings``: goat, ape, sincos2d, rope2d, nope): a ViT on
  Fashion-MNIST per encoding -> top-1 and loss at 1x, 1.5x, 2x, 3x the training resolution,
  GOAT's learned 2D prior, CLS attention maps, train images/s (experiments/report_vision.py).
* ``dna`` (genomes; ``--dna_encodings``: goat, rope, alibi, nope): a genome LM on E. coli per
  encoding -> bits per base, perplexity, accuracy at 1x..8x the training length on held-out
  E. coli, another strain and human DNA, GC agreement, compiled train-step memory GOAT vs RoPE,
  train tokens/s (experiments/report_dna.py).

Then it writes ``OUT/REPORT.md`` (the command, date, settings, the headline checks of every
family with PASS/FAIL and their numbers, all tables) and its PNGs. Runs live under
``--workdir`` and resume: re-running after an interruption retrains nothing that finished, and
evaluations are cached per run (``reproduce_eval.json``). A suite is a :class:`Suite` in
:data:`SUITES`; extra LM rows (:class:`LMVariant`) and retrieval variants
(:class:`RetrievalVariant`) are one-line entries there (README, section "Experiments").

``--suite paper`` cannot run on a CPU: it builds the same runs with the full-scale configs
(configs/lm_c4_125m.py, configs/lm_fineweb_1b.py, configs/retrieval_tiny.py:*,paper,
configs/vit_s16_imagenet.py, configs/dna_hg38.py) as shell commands (``experiments.train`` +
``experiments.evaluate``) and runs them one after another, or prints them with ``--dry_run``
for a cluster scheduler.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Optional

from experiments import report_notes

ENCODINGS = ("goat", "rope", "rope_pi", "alibi", "sinusoidal", "nope")  # the language family's
VIT_ENCODINGS = ("goat", "ape", "sincos2d", "rope2d", "nope")  # the vision family's
DNA_ENCODINGS = ("goat", "rope", "alibi", "nope")  # the genome family's
FAMILIES = ("lm", "vit", "dna")  # --families: language (LM, retrieval, toy), vision, DNA
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(msg: str) -> None:
    """A progress line (flushed: the suite usually runs under nohup into a log file)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------
# Suites: which configs, which overrides (identical across encodings), which evaluations
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LMVariant:
    """An extra row of the LM tables (e.g. an ablation of GOAT's prior): one more run per LM
    dataset of the suite, evaluated like the encodings and shown next to them, never judged by
    the headline checks. Its workdir is ``ROOT/<dataset>/<label>``."""

    label: str  # the row label and workdir name, e.g. 'goat+<option>'
    encoding: str  # fills {enc} of the dataset's config spec (and must be its position encoding)
    overrides: dict = dataclasses.field(default_factory=dict)  # on top of Suite.lm_overrides
    spec: str = ""  # a config spec to use instead of the dataset's ({enc} filled in); '' = the dataset's


@dataclasses.dataclass(frozen=True)
class RetrievalVariant:
    """Another version of the synthetic retrieval models (e.g. the official synthetic data):
    every task x every encoding again, with its own tables next to the default ones. Its runs
    live in ``ROOT/<task>_<label>/<enc>``."""

    label: str  # names the tables and workdirs, e.g. 'official'
    spec: str  # config spec with {task} and {enc}, e.g. 'configs/retrieval_tiny.py:{task},{enc},official'
    overrides: dict = dataclasses.field(default_factory=dict)  # on top of Suite.retrieval_overrides


@dataclasses.dataclass(frozen=True)
class Suite:
    """One scale of the reproduction. Config specs are ``'file.py:arg'`` with ``{enc}``
    (position encoding) and ``{task}`` (retrieval task) filled in; overrides are dotted
    config fields applied to every encoding alike."""

    name: str
    lm: tuple[tuple[str, str], ...]  # (dataset label, config spec) of the perplexity LMs
    retrieval: str  # config spec of the synthetic retrieval models
    toy: str  # config spec of the toy copy-mixture model
    lm_overrides: dict = dataclasses.field(default_factory=dict)
    retrieval_overrides: dict = dataclasses.field(default_factory=dict)
    toy_overrides: dict = dataclasses.field(default_factory=dict)
    tasks: tuple[str, ...] = ("passkey", "niah")
    multipliers: tuple[int, ...] = (1, 2, 4, 8, 16)  # evaluation lengths / training length
    num_examples: int = 64  # synthetic passkey examples per length
    niah_examples: int = 16  # NIAH examples per (length, depth) cell
    niah_depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)  # official GOAT depths
    standard_trials: int = 8  # standard passkey prompts per length (greedy decoding)
    sink_examples: int = 8  # held-out windows for the sink statistics
    notes: tuple[str, ...] = ()  # language runs: how the settings were chosen, what to read into the numbers
    vit_notes: tuple[str, ...] = ()  # the same for the vision runs
    dna_notes: tuple[str, ...] = ()  # the same for the DNA runs
    encodings: tuple[str, ...] = ENCODINGS  # of the LMs and retrieval models (--encodings)
    # Extra rows and tables, one line each, e.g.
    #   lm_variants=(LMVariant("goat+opt", "goat", {"model.some_option": True}),)
    #   retrieval_variants=(RetrievalVariant("official", "configs/retrieval_tiny.py:{task},{enc},official"),)
    lm_variants: tuple[LMVariant, ...] = ()
    retrieval_variants: tuple[RetrievalVariant, ...] = ()
    # Vision: one ViT per encoding (spec with {enc}), evaluated at these multiples of its
    # training resolution on the first vit_eval_batches test batches (0: the whole split).
    vit: str = ""  # '' = no vision family in this suite
    vit_encodings: tuple[str, ...] = VIT_ENCODINGS
    vit_overrides: dict = dataclasses.field(default_factory=dict)
    vit_scales: tuple[float, ...] = (1, 1.5, 2, 3)
    vit_eval_batches: Optional[int] = None  # None: the config's data.num_eval_batches
    # DNA: one genome LM per encoding (spec with {enc}), scored at these multiples of its
    # training length on the first dna_max_bases bases of the held-out region and of each genome.
    dna: str = ""  # '' = no DNA family in this suite
    dna_encodings: tuple[str, ...] = DNA_ENCODINGS
    dna_overrides: dict = dataclasses.field(default_factory=dict)
    dna_multipliers: tuple[int, ...] = (1, 2, 4, 8)
    dna_max_bases: Optional[int] = 131_072  # per scored set (None: all of it)
    dna_genomes: tuple[tuple[str, str], ...] = ()  # (label, FASTA path) scored besides the held-out region
    dna_gc_windows: int = 256  # GC agreement windows (README: N >= 256)
    dna_memory_lengths: tuple[int, ...] = (1024, 4096)  # compiled train-step memory, GOAT vs RoPE
    dna_memory_model: dict = dataclasses.field(default_factory=dict)  # model fields changed there (tests)


_DNA_GENOMES = (("E. coli DH1 (another strain)", "/usr/share/doc/ragout/examples/E.Coli/references/DH1.fasta.gz"),
                ("human chr17 (40 kb)", "/usr/share/doc/python-pyfaidx-examples/examples/chr17.hg19.part.fa"))


SUITES = {
    # Seconds: every stage of the harness on two encodings, a few steps each (the test).
    "smoke": Suite(
        name="smoke", lm=(("jargon", "configs/lm_tiny.py:{enc},smoke"),),
        retrieval="configs/retrieval_tiny.py:{task},{enc},smoke", toy="configs/toy_copy_mixture.py:smoke",
        lm_overrides={"seq_len": 32, "num_train_steps": 4, "checkpoint_every_steps": 4,
                      "data.num_eval_batches": 1},
        toy_overrides={"num_train_steps": 4, "checkpoint_every_steps": 4, "eval_every_steps": 0},
        multipliers=(1, 16), num_examples=8, niah_examples=8, niah_depths=(0.5,),
        standard_trials=2, sink_examples=2, encodings=("goat", "rope"),
        vit="configs/vit_tiny.py:{enc},smoke", vit_encodings=("goat", "ape"), vit_scales=(1, 2),
        vit_overrides={"num_train_steps": 2, "eval_every_steps": 0, "checkpoint_every_steps": 2},
        vit_eval_batches=1,
        dna="configs/dna_tiny.py:{enc},smoke", dna_encodings=("goat", "rope"), dna_multipliers=(1, 4),
        dna_overrides={"num_train_steps": 2, "eval_every_steps": 0, "checkpoint_every_steps": 2},
        dna_max_bases=2048, dna_genomes=_DNA_GENOMES[1:], dna_gc_windows=4, dna_memory_lengths=(64,),
        dna_memory_model={"num_layers": 1, "embed_dim": 32, "num_heads": 2, "mlp_dim": 64}),
    # ~1 hour on 2 CPU cores. Settings chosen once for all encodings (see REPORT.md).
    "tiny": Suite(
        name="tiny", lm=(("jargon", "configs/lm_tiny.py:{enc}"),),
        retrieval="configs/retrieval_tiny.py:{task},{enc}", toy="configs/toy_copy_mixture.py",
        # Every model trains at 64 tokens, so 16x is 1024. MHA instead of lm_tiny's GQA: GOAT's
        # prior is per KV head, and 2 priors per layer cost it ~15% perplexity at this size.
        # 1000 steps: GOAT and RoPE are still improving at 600 (2-3% apart).
        lm_overrides={"seq_len": 64, "global_batch_size": 32, "model.kv_num_heads": 4,
                      "num_train_steps": 1000, "eval_every_steps": 1000, "checkpoint_every_steps": 1000},
        retrieval_overrides={},
        # ViT and DNA runs: their configs as they are. Evaluations capped to minutes per run on
        # 2 cores: 4,096 of the 10k test images (32 x 128) at every resolution (top-1 standard
        # error ~0.6 points at 85%), 65,536 bases of each DNA set (~32 windows at 8x).
        vit="configs/vit_tiny.py:{enc}", vit_eval_batches=32,
        dna="configs/dna_tiny.py:{enc}", dna_genomes=_DNA_GENOMES, dna_max_bases=65_536,
        notes=report_notes.LM_NOTES,
        vit_notes=report_notes.VIT_NOTES,
        dna_notes=report_notes.DNA_NOTES,
        lm_variants=(LMVariant("goat+linear_sink", "goat", spec="configs/lm_tiny.py:{enc},linear_sink"),),
        # The official synthetic settings (R = M = 8, init_scale_prior 3e-3, (global + 10 span) / 11,
        # baselines at attention scale 1) next to ours, every task and encoding.
        retrieval_variants=(RetrievalVariant("official", "configs/retrieval_tiny.py:{task},{enc},official"),)),
    # The paper's scale, for a cluster: 125M on C4 and 1.23B on FineWeb, official retrieval sizes.
    "paper": Suite(
        name="paper", lm=(("c4_125m", "configs/lm_c4_125m.py:{enc}"),
                          ("fineweb_1b", "configs/lm_fineweb_1b.py:{enc}")),
        retrieval="configs/retrieval_tiny.py:{task},{enc},paper,official", toy="configs/toy_copy_mixture.py",
        num_examples=256, niah_examples=64, standard_trials=64, sink_examples=32,
        vit="configs/vit_s16_imagenet.py:{enc}", dna="configs/dna_hg38.py:{enc}", dna_genomes=_DNA_GENOMES,
        dna_max_bases=1_048_576, dna_memory_lengths=(1024, 4096, 16384)),
}


@dataclasses.dataclass(frozen=True)
class Job:
    """One training run and the evaluations made on it."""

    kind: str  # 'lm' | 'passkey' | 'niah' | 'toy'
    dataset: str  # 'jargon', 'c4_125m', ... for LMs; the task otherwise
    encoding: str
    spec: str  # 'configs/file.py:arg'
    overrides: dict
    workdir: str
    variant: str = ""  # the LMVariant label of an extra LM row ('' for the plain encodings)

    @property
    def label(self) -> str:
        """The row label in the report: the encoding, or the LM variant's label."""
        return self.variant or self.encoding

    @property
    def name(self) -> str:
        """``kind/dataset/label`` (what the log says, and the key of its results)."""
        return f"{self.kind}/{self.dataset}/{self.label}"


def plan(suite: Suite, root: str, encodings: Optional[Sequence[str]] = None, *,
         families: Sequence[str] = FAMILIES, vit_encodings: Optional[Sequence[str]] = None,
         dna_encodings: Optional[Sequence[str]] = None) -> list[Job]:
    """Every run of ``suite``'s ``families``, in order. Language (``encodings``, default
    ``suite.encodings``): per LM dataset the encodings then the LM variants, per task the
    retrieval models (then each retrieval variant's), the toy. Vision: a ViT per
    ``vit_encodings`` in ``ROOT/vit/<enc>``. DNA: a genome LM per ``dna_encodings`` in
    ``ROOT/dna/<enc>``. Defaults: the suite's encodings of each family."""
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise ValueError(f"--families: unknown {unknown}; choose from {','.join(FAMILIES)}.")
    jobs = []
    if "lm" in families:
        jobs += _plan_language(suite, root, list(encodings or suite.encodings))
    for family, spec, encs, overrides in (
            ("vit", suite.vit, vit_encodings or suite.vit_encodings, suite.vit_overrides),
            ("dna", suite.dna, dna_encodings or suite.dna_encodings, suite.dna_overrides)):
        if family in families and spec:
            jobs += [Job(family, family, enc, spec.format(enc=enc), dict(overrides),
                         os.path.join(root, family, enc)) for enc in encs]
    return jobs


def _plan_language(suite: Suite, root: str, encodings: list[str]) -> list[Job]:
    """The language family's runs (see :func:`plan`)."""
    jobs = []
    for dataset, spec in suite.lm:
        for enc in encodings:
            jobs.append(Job("lm", dataset, enc, spec.format(enc=enc), dict(suite.lm_overrides),
                            os.path.join(root, dataset, enc)))
        for v in suite.lm_variants:
            jobs.append(Job("lm", dataset, v.encoding, (v.spec or spec).format(enc=v.encoding),
                            {**suite.lm_overrides, **v.overrides}, os.path.join(root, dataset, v.label),
                            variant=v.label))
    retrieval = [("", suite.retrieval, {})] + [(f"_{v.label}", v.spec, v.overrides)
                                               for v in suite.retrieval_variants]
    for suffix, pattern, overrides in retrieval:
        for task in suite.tasks:
            for enc in encodings:
                jobs.append(Job(task, task + suffix, enc, pattern.format(task=task, enc=enc),
                                {**suite.retrieval_overrides, **overrides},
                                os.path.join(root, task + suffix, enc)))
    jobs.append(Job("toy", "copy_mixture", "goat", suite.toy, dict(suite.toy_overrides),
                    os.path.join(root, "toy")))
    return jobs


def load_config(spec: str, overrides: Optional[dict] = None):
    """``get_config(arg)`` of ``'configs/file.py:arg'`` (path relative to the repo root) with
    dotted ``overrides`` applied (``{'data.num_eval_batches': 1}``)."""
    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location(
        os.path.splitext(os.path.basename(path))[0], os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    config = module.get_config(arg) if arg else module.get_config()
    for key, value in (overrides or {}).items():
        node = config
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        if leaf not in node:
            raise ValueError(f"override {key}: {spec} has no such field.")
        node[leaf] = value
    return config


# ----------------------------------------------------------------------------------------------
# The paper suite: shell commands for a cluster
# ----------------------------------------------------------------------------------------------


def paper_commands(suite: Suite, root: str, encodings: Optional[Sequence[str]], out: str,
                   **plan_kwargs) -> list[str]:
    """``experiments.train`` per run, then ``experiments.evaluate`` per group of runs (all
    encodings side by side), then the toy. Override values are passed as ``--config.x=y``.
    ``plan_kwargs``: :func:`plan`'s ``families``, ``vit_encodings``, ``dna_encodings``."""
    py = "python -m"
    cmds, groups = [], {}
    jobs = plan(suite, root, encodings, **plan_kwargs)
    for job in jobs:
        if job.kind == "toy":
            continue
        flags = " ".join(f"--config.{k}={shlex.quote(str(v))}" for k, v in job.overrides.items())
        cmds.append(f"{py} experiments.train --config {job.spec} --workdir {job.workdir} {flags}".strip())
        groups.setdefault((job.kind, job.dataset), []).append(job)
    # Language runs: the official C4 evaluation (docs/protocols.md): 512-query chunks through the
    # KV cache and the last-layer diagnostics with u(j) curves.
    evals = {"lm": "extrapolation,passkey,sinks,diagnostics --chunk_size 512", "passkey": "passkey",
             "niah": "niah"}
    mults = ",".join(str(m) for m in suite.multipliers)
    for (kind, dataset), group in groups.items():
        labelled = any(j.variant for j in group)  # variant rows share an encoding: name every run
        dirs = " ".join(f"--workdir {j.workdir}" + (f" --label {shlex.quote(j.label)}" if labelled else "")
                        for j in group)
        if kind == "vit":
            from experiments import report_vision  # pylint: disable=g-import-not-at-top
            res = report_vision.resolutions_for(load_config(group[0].spec, group[0].overrides), suite.vit_scales)
            what = f"--evals resolution --resolutions {','.join(map(str, res))}"
        elif kind == "dna":  # one command per genome: --max_bases caps the files together
            for _, path in suite.dna_genomes:
                name = os.path.basename(path).split(".")[0]
                cmds.append(f"{py} experiments.evaluate {dirs} --evals dna --fasta {shlex.quote(path)} "
                            f"--multipliers {','.join(map(str, suite.dna_multipliers))} --gc_windows "
                            f"{suite.dna_gc_windows}" + (f" --max_bases {suite.dna_max_bases}" if suite.dna_max_bases
                                                         else "") + f" --out {os.path.join(out, 'dna_' + name)}")
            continue
        else:
            what = (f"--evals {evals[kind]} --multipliers {mults} --num_examples {suite.num_examples} "
                    f"--num_trials {suite.standard_trials}")
        cmds.append(f"{py} experiments.evaluate {dirs} {what} --out {os.path.join(out, dataset)}")
    if any(j.kind == "toy" for j in jobs):
        cmds.append(f"{py} experiments.toy_prior --config {suite.toy} --workdir {os.path.join(root, 'toy')} "
                    "--all_heads")
    return cmds


# ----------------------------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------------------------


def _git_commit() -> str:
    """The repository's HEAD commit (short), or 'unknown' outside a git checkout."""
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                       stderr=subprocess.DEVNULL, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _setup_line(job: Job) -> str:
    """One line of the Setup section: the job's spec, overrides and the resolved settings."""
    with open(os.path.join(job.workdir, "config.json")) as f:  # what actually ran
        c = json.load(f)
    m = c["model"]
    head = f"`{job.spec}`{' + ' + str(job.overrides) if job.overrides else ''}: "
    if job.kind == "vit":
        from experiments import report_vision  # pylint: disable=g-import-not-at-top
        return head + report_vision.setup_line(c)
    return head + (f"{m['num_layers']} layer(s), d {m['embed_dim']}, {m['num_heads']} heads "
                   f"({m.get('kv_num_heads') or m['num_heads']} KV), {c['num_train_steps']} steps x "
                   f"{c['global_batch_size']} x {c['seq_len']} {'bases' if job.kind == 'dna' else 'tokens'}, "
                   f"peak lr {c['optimizer']['learning_rate']}"
                   + (f", seed {c['seed']}" if job.kind == "dna" else ""))


FAMILY_TITLES = {"lm": "Language", "vit": "Vision", "dna": "DNA"}  # REPORT.md's family sections, in order


def family_of(job: Job) -> str:
    """``'lm'`` (LMs, retrieval, toy), ``'vit'`` or ``'dna'``: the family a job belongs to."""
    from experiments import report_lm  # pylint: disable=g-import-not-at-top
    return "lm" if job.kind in report_lm.LM_KINDS else job.kind


def family_section(family: str, suite: Suite, jobs: Sequence[Job], results: dict[str, dict], out: str,
                   command: str, timings: dict[str, float], total_seconds: float) -> str:
    """One family's part of REPORT.md (``## <Family>`` and its subsections): the provenance of
    this invocation (command, date, commit, compute), the setup, the headline checks with their
    numbers, the notes, every table and figure, and the run times of ``jobs`` (the family's)."""
    from experiments import report_dna, report_lm, report_vision  # pylint: disable=g-import-not-at-top

    mine = {k: v for k, v in timings.items() if k.split(" ", 1)[1] in {j.name for j in jobs}}
    md = [f"## {FAMILY_TITLES[family]}", "",
          f"Command: `{command}`  ", f"Date: {time.strftime('%Y-%m-%d %H:%M %Z')}  ",
          f"Code: git {_git_commit()}  ",
          f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores (shared), no accelerator  ",
          f"Compute: {sum(mine.values()) / 60:.1f} min over this family's stages (training "
          f"{sum(v for k, v in mine.items() if k.startswith('train')) / 60:.1f} min); the invocation "
          f"took {total_seconds / 60:.1f} min (finished runs and cached evaluations are reused)", ""]
    body = ["## Setup (identical across position encodings)", ""]
    for kind, dataset in dict.fromkeys((j.kind, j.dataset) for j in jobs if not j.variant):
        job = next(j for j in jobs if (j.kind, j.dataset) == (kind, dataset))
        body.append(f"* **{kind if dataset in (kind, 'copy_mixture') or kind == 'lm' else dataset}**: "
                    + _setup_line(job))
    body += [f"* **{j.dataset} {j.label}** (extra row): " + _setup_line(j) for j in jobs if j.variant]
    body.append("")
    if family == "lm":
        encodings = list(dict.fromkeys(j.encoding for j in jobs if j.kind in report_lm.LM_KINDS[:-1]
                                       and not j.variant))
        checks = report_lm.lm_checks(results, encodings)
    elif family == "vit":
        checks = report_vision.vision_checks(jobs, results)
    else:
        memory = report_dna.dna_memory(suite, jobs)
        checks = report_dna.dna_checks(jobs, results, memory)
    body += ["## Headline checks", "", "| claim | result | numbers |", "|---|---|---|"]
    for claim, ok, numbers in checks:
        body.append(f"| {claim} | {'PASS' if ok else ('not measured' if ok is None else '**FAIL**')} | {numbers} |")
    body.append("")
    notes = {"lm": suite.notes, "vit": suite.vit_notes, "dna": suite.dna_notes}[family]
    if notes:
        body += ["## Notes", ""] + [f"* {n}" for n in notes] + [""]
    if family == "lm":
        body += report_lm.lm_sections(suite, jobs, results, out)
    elif family == "vit":
        body += report_vision.vision_section(jobs, results, out)
    else:
        body += report_dna.dna_section(suite, jobs, results, memory)
    body += ["## Run times", "", "| stage | seconds |", "|---|---|"]
    body += [f"| {k} | {v:.0f} |" for k, v in mine.items()]
    # One level deeper than a standalone report: the family is the ## heading.
    md += [("#" + line) if line.startswith("##") else line for line in body]
    return "\n".join(md) + "\n"


def write_report(suite: Suite, jobs: Sequence[Job], results: dict[str, dict], out: str,
                 command: str, timings: dict[str, float], total_seconds: float) -> str:
    """Writes the sections of the families in ``jobs`` to ``OUT/sections/<family>.md``, then
    ``OUT/REPORT.md``: every family section found in ``OUT/sections`` (a family not run this
    time keeps the section of the invocation that last ran it, with that invocation's command,
    date and commit), and merges ``results`` into ``OUT/results.json``. Returns the markdown."""
    os.makedirs(os.path.join(out, "sections"), exist_ok=True)
    for family in FAMILY_TITLES:
        fam_jobs = [j for j in jobs if family_of(j) == family]
        if fam_jobs:
            text = family_section(family, suite, fam_jobs, results, out, command, timings, total_seconds)
            with open(os.path.join(out, "sections", f"{family}.md"), "w") as f:
                f.write(text)
    sections = []
    for family in FAMILY_TITLES:
        path = os.path.join(out, "sections", f"{family}.md")
        if os.path.exists(path):
            with open(path) as f:
                sections.append((family, f.read()))
    md = [f"# GOAT experiments, `{suite.name}` suite", "",
          "Each family below was produced by the command, at the date and commit, written under its "
          "heading: `python -m experiments.reproduce --suite " + suite.name + "` runs every family, "
          "`--families vit,dna` (say) reruns those and keeps the other sections as they were "
          "(`sections/<family>.md`).", ""]
    md += [f"* [{FAMILY_TITLES[f]}](#{FAMILY_TITLES[f].lower()})" for f, _ in sections] + [""]
    text = "\n".join(md) + "\n" + "\n".join(body for _, body in sections)
    with open(os.path.join(out, "REPORT.md"), "w") as f:
        f.write(text)
    merged = {}
    if os.path.exists(os.path.join(out, "results.json")):
        with open(os.path.join(out, "results.json")) as f:
            merged = json.load(f)
    merged.update(results)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(merged, f, indent=1, default=float)
    return text


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------


def _check_encodings(args: argparse.Namespace) -> None:
    """Refuses an unknown name in ``--encodings`` / ``--dna_encodings`` (the language model's
    position encodings) or ``--vit_encodings`` (the ViT's), naming the flag and the choices."""
    from goat_jax.models import lm, vit  # pylint: disable=g-import-not-at-top  # jax: on use
    for flag, value, allowed in (("--encodings", args.encodings, lm.POSITION_ENCODINGS),
                                 ("--vit_encodings", args.vit_encodings, vit.POSITION_ENCODINGS),
                                 ("--dna_encodings", args.dna_encodings, lm.POSITION_ENCODINGS)):
        unknown = [x for x in (value or "").split(",") if x and x not in allowed]
        if unknown:
            raise ValueError(f"{flag} {value}: unknown encoding(s) {unknown}; choose from "
                             f"{','.join(allowed)}.")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI: runs (or prints) a suite; returns the process exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--suite", choices=sorted(SUITES), default="tiny")
    p.add_argument("--workdir", default=None, help="runs root (default runs/reproduce_<suite>)")
    p.add_argument("--out", default=None, help="report dir (default reports/<suite>)")
    p.add_argument("--families", default=",".join(FAMILIES),
                   help="comma list of families to run and report: lm (language models, retrieval, toy), "
                   "vit (vision), dna (genomes); default all")
    p.add_argument("--encodings", default=None, help="language family (LMs, retrieval): comma list "
                   f"(default: the suite's, {','.join(ENCODINGS)}; smoke: goat,rope)")
    p.add_argument("--vit_encodings", default=None, help="vision family: comma list (default: the "
                   f"suite's, {','.join(VIT_ENCODINGS)}; smoke: goat,ape)")
    p.add_argument("--dna_encodings", default=None, help="DNA family: comma list (default: the "
                   f"suite's, {','.join(DNA_ENCODINGS)}; smoke: goat,rope)")
    p.add_argument("--retrieval_variants", default=None,
                   help="comma list of the suite's retrieval variants to train and report (default: all "
                   "of them; 'none': only the default retrieval runs)")
    p.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    suite = SUITES[args.suite]
    if args.retrieval_variants is not None:
        wanted = [v for v in args.retrieval_variants.split(",") if v and v != "none"]
        known = [v.label for v in suite.retrieval_variants]
        if set(wanted) - set(known):
            raise ValueError(f"--retrieval_variants {args.retrieval_variants}: suite {suite.name!r} has "
                             f"{', '.join(known) or 'none'}; give some of them or 'none'.")
        suite = dataclasses.replace(suite, retrieval_variants=tuple(
            v for v in suite.retrieval_variants if v.label in wanted))
    split = lambda v: [x for x in v.split(",") if x] if v else None  # noqa: E731
    _check_encodings(args)  # at parsing, --dry_run too: not when the job is reached
    encodings = split(args.encodings) or list(suite.encodings)
    plan_kwargs = {"families": split(args.families) or [], "vit_encodings": split(args.vit_encodings),
                   "dna_encodings": split(args.dna_encodings)}
    if not plan_kwargs["families"]:
        raise ValueError(f"--families is empty; give some of {','.join(FAMILIES)}.")
    root = args.workdir or os.path.join("runs", f"reproduce_{suite.name}")
    out = args.out or os.path.join("reports", suite.name)
    command = "python -m experiments.reproduce " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))

    if suite.name == "paper" or args.dry_run:
        cmds = paper_commands(suite, root, encodings, out, **plan_kwargs) if suite.name == "paper" else [
            f"# in-process: train + evaluate {j.name} ({j.spec}, overrides {j.overrides}) in {j.workdir}"
            for j in plan(suite, root, encodings, **plan_kwargs)]
        if args.dry_run:
            if suite.name == "paper":  # sizes, budgets and departures from the official recipes
                from experiments import paper_table  # pylint: disable=g-import-not-at-top
                # The language runs: paper_table holds the official language recipes only.
                print(paper_table.render(paper_table.rows(plan(suite, root, encodings, families=["lm"]), load_config)))
            print("\n".join(cmds))
            return 0
        for cmd in cmds:
            log(f"$ {cmd}")
            rc = subprocess.call(cmd, shell=True, cwd=ROOT)
            if rc:
                log(f"failed with exit code {rc}: {cmd}")
                return rc
        return 0

    from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
    from experiments import report_lm  # pylint: disable=g-import-not-at-top
    from experiments.reproduce_jobs import evaluate, train  # pylint: disable=g-import-not-at-top
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax INFO lines would drown the progress log
    t_start = time.time()
    jobs = plan(suite, root, encodings, **plan_kwargs)
    if not jobs:
        raise ValueError(f"--families {args.families}: suite {suite.name!r} has no runs there.")
    log(f"suite {suite.name}: {len(jobs)} runs under {root}, report in {out}")
    results, timings = {}, {}
    for i, job in enumerate(jobs):
        log(f"[{i + 1}/{len(jobs)}] {job.name}: {job.spec} {job.overrides or ''}")
        timings[f"train {job.name}"] = train(job)["seconds"]
        results[job.name] = evaluate(job, suite)
        timings[f"eval {job.name}"] = results[job.name]["eval_seconds"]
        log(f"  elapsed {(time.time() - t_start) / 60:.1f} min")
    os.makedirs(out, exist_ok=True)
    report_lm.copy_toy_figures(jobs, out)
    write_report(suite, jobs, results, out, command, timings, time.time() - t_start)
    log(f"wrote {os.path.join(out, 'REPORT.md')} after {(time.time() - t_start) / 60:.1f} min")
    for family in dict.fromkeys(family_of(j) for j in jobs):  # this invocation's verdicts, for the log
        with open(os.path.join(out, "sections", f"{family}.md")) as f:
            part = f.read().split("### Headline checks", 1)[-1]
        print(f"{FAMILY_TITLES[family]}: headline checks" + part.split("\n### ", 1)[0])
    return 0


if __name__ == "__main__":
    from goat_jax import cli  # pylint: disable=g-import-not-at-top
    sys.exit(cli.run(main))  # config and input errors: one line (GOAT_DEBUG=1: traceback)
