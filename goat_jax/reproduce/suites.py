"""The report harness's plan: suites (which configs, which overrides, which evaluations, at one
scale), the runs of a suite (:class:`Job`, :func:`plan`) and their families.

This is the bottom layer of :mod:`goat_jax.reproduce`: the family modules (``lm_family``,
``vit_family``, ``dna_family``), the jobs, the paper commands and the report writer build on
it, and it imports none of them. A suite is a :class:`Suite` in :data:`SUITES`; extra LM rows
(:class:`LMVariant`, also the vision and DNA families' extra rows) and retrieval variants
(:class:`RetrievalVariant`) are one-line entries there (docs/experiments.md, "Adding rows").
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Optional

from goat_jax.config import files as config_files
from goat_jax.reproduce import notes as report_notes

ENCODINGS = ("goat", "rope", "rope_pi", "alibi", "sinusoidal", "nope")  # the language family's
# The comparators of docs/protocols.md ("Comparators") trained as their own rows in the tiny
# language family; 'ntk'/'yarn' and log-n are evaluated-with rows of RoPE's runs (TINY_LM_VARIANTS).
COMPARATORS = ("fire", "kerple_log", "fox")
VIT_ENCODINGS = ("goat", "ape", "sincos2d", "rope2d", "nope")  # the vision family's
VIT_COMPARATORS = ("rope_mixed",)  # learned 2D frequencies (Heo et al. 2024), the tiny vision family's too
DNA_ENCODINGS = ("goat", "rope", "alibi", "nope")  # the genome family's
FAMILIES = ("lm", "vit", "dna")  # --families: language (LM, retrieval, toy), vision, DNA
FAMILY_TITLES = {"lm": "Language", "vit": "Vision", "dna": "DNA"}  # REPORT.md's family sections, in order
LM_KINDS = ("lm", "passkey", "niah", "toy")  # Job.kind values of the language family
ROOT = config_files.REPO_ROOT  # config specs and the git revision are read from here

# ----------------------------------------------------------------------------------------------
# Suites: which configs, which overrides (identical across encodings), which evaluations
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LMVariant:
    """An extra row of the LM tables (e.g. an ablation of GOAT's prior): one more run per LM
    dataset of the suite, evaluated like the encodings and shown next to them, judged only by
    the checks that name it (rival and layout checks). Its workdir is ``ROOT/<dataset>/<label>``.
    The same entry is an extra row of the vision or DNA family in ``Suite.family_variants``
    (label, encoding and overrides only)."""

    label: str  # the row label and workdir name, e.g. 'goat+<option>'
    encoding: str  # fills {enc} of the dataset's config spec (and must be its position encoding)
    overrides: dict = dataclasses.field(default_factory=dict)  # on top of Suite.lm_overrides
    spec: str = ""  # a config spec to use instead of the dataset's ({enc} filled in); '' = the dataset's
    # An evaluated-with row: no training of its own; it evaluates the trained run of row
    # ``trained_as`` (an encoding or another variant's label, same seeds) with these model
    # fields changed at evaluation time (e.g. RoPE evaluated with a frequency rescaling).
    trained_as: str = ""
    eval_overrides: dict = dataclasses.field(default_factory=dict)
    # False: an LM row only, with no retrieval models of its own (e.g. a comparison that the
    # protocol judges on perplexity alone, where retrieval runs would be compute for no check).
    retrieval: bool = True


@dataclasses.dataclass(frozen=True)
class RetrievalVariant:
    """Another version of the synthetic retrieval models (e.g. the official synthetic data):
    every task x every encoding again, with its own tables next to the default ones. Its runs
    live in ``ROOT/<task>_<label>/<enc>``."""

    label: str  # names the tables and workdirs, e.g. 'official'
    spec: str  # config spec with {task} and {enc}, e.g. 'configs/retrieval_tiny.py:{task},{enc},official'
    overrides: dict = dataclasses.field(default_factory=dict)  # on top of Suite.retrieval_overrides


@dataclasses.dataclass(frozen=True)
class RivalChecks:
    """Headline checks of one extra row against the strongest rival, decided before their runs
    (docs/protocols.md, "The strongest rival and the linear sink"): ``candidate`` against
    ``lm_rival`` on perplexity at each of ``ppl_multipliers`` x the training length, and
    against ``retrieval_rival`` on synthetic passkey and NIAH accuracy at each of
    ``retrieval_multipliers``. Labels are row labels (an encoding or a variant's label)."""

    candidate: str  # e.g. 'goat+linear_sink' (its LM row and its retrieval rows)
    lm_rival: str  # the rival's LM row, e.g. 'fox'
    retrieval_rival: str  # the rival's retrieval rows, e.g. 'fox+gate_bias5'
    ppl_multipliers: tuple[int, ...] = (16, 64)
    retrieval_multipliers: tuple[int, ...] = (8, 16)
    # The candidate's flatness far out (0: no such check): its perplexity at flat_multiplier x the
    # training length <= flat_ratio x its perplexity at 1x (docs/protocols.md, "Extrapolation to
    # 1024x and the 64-wide layout").
    flat_multiplier: int = 0
    flat_ratio: float = 1.05


# What a LayoutCheck can compare: the key of a row's per-length results (the LM's perplexity, the
# genome LM's held-out bits per base, the ViT's top-1) -> its name in the claim, whether higher
# is better, and how a value is printed ('%': a fraction, as a percentage).
LAYOUT_METRICS = {"ppl": ("perplexity", False, ".3f"), "bits_per_base": ("bits per base", False, ".4f"),
                  "top1": ("top-1", True, "%")}
# How a LayoutCheck's margin is read: 'relative' (the candidate's value over the reference's, a
# fraction: 0.01 = 1%) or 'points' (the difference of two fractions: 0.01 = 1 point).
MARGIN_KINDS = ("relative", "points")


@dataclasses.dataclass(frozen=True)
class LayoutCheck:
    """A non-inferiority check of one row against another of its family trained the same way
    but for one setting (docs/protocols.md, "Extrapolation to 1024x and the 64-wide layout"):
    the paired amount by which ``candidate`` is worse than ``reference`` in ``metric`` at
    ``multiplier`` x the training length (resolution) must lie below ``margin`` (supported when
    its interval does, contradicted when it lies above, inconclusive otherwise); the change at
    ``shown_multiplier`` is reported beside it, not judged. How worse is measured is data: the
    metric's direction (:data:`LAYOUT_METRICS`) and the margin's kind (``margin_in``). The
    judging is one function for every family (:func:`goat_jax.reproduce.layout.judge`)."""

    candidate: str  # row label, e.g. 'goat+bf16+lane_aligned'
    reference: str  # row label, e.g. 'goat+bf16'
    title: str  # what differs, for the check's wording, e.g. 'lane_aligned (head dim 32, bf16)'
    margin: float = 0.01  # in the unit of margin_in
    multiplier: int = 1
    shown_multiplier: int = 16
    family: str = "lm"  # whose rows: 'lm' (the headline dataset's LMs), 'vit' or 'dna'
    metric: str = "ppl"  # a key of LAYOUT_METRICS
    margin_in: str = "relative"  # one of MARGIN_KINDS

    def __post_init__(self):
        for name, value, allowed in (("family", self.family, FAMILIES), ("metric", self.metric, tuple(LAYOUT_METRICS)),
                                     ("margin_in", self.margin_in, MARGIN_KINDS)):
            if value not in allowed:
                raise ValueError(f"LayoutCheck {self.candidate!r}: {name}={value!r}; choose from {', '.join(allowed)}.")
        if self.margin_in == "points" and LAYOUT_METRICS[self.metric][2] != "%":
            raise ValueError(f"LayoutCheck {self.candidate!r}: margin_in='points' needs a metric that is a fraction "
                             f"(top1), not {self.metric!r}; give the margin as 'relative'.")


@dataclasses.dataclass(frozen=True)
class Suite:
    """One scale of the reproduction. Config specs are ``'file.py:arg'`` with ``{enc}``
    (position encoding) and ``{task}`` (retrieval task) filled in; overrides are dotted
    config fields applied to every encoding alike."""

    name: str
    lm: tuple[tuple[str, str], ...]  # (dataset label, config spec) of the perplexity LMs
    retrieval: str  # config spec of the synthetic retrieval models
    toy: str  # config spec of the toy copy-mixture model ('' = none)
    lm_overrides: dict = dataclasses.field(default_factory=dict)
    retrieval_overrides: dict = dataclasses.field(default_factory=dict)
    toy_overrides: dict = dataclasses.field(default_factory=dict)
    tasks: tuple[str, ...] = ("passkey", "niah")
    multipliers: tuple[int, ...] = (1, 2, 4, 8, 16)  # evaluation lengths / training length
    lm_ppl_multipliers: tuple[int, ...] = ()  # the LMs' perplexity lengths if not these ('': multipliers)
    # More perplexity lengths of the LM rows (kind 'lm' only, so the retrieval models' cached
    # evaluations stay valid): lm_more_multipliers for every LM row, lm_long_multipliers for the
    # rows named in lm_long_rows; lm_eval_tokens: every length scores the first that many
    # held-out tokens, so every column reads the same text (None: the whole stream at each length).
    lm_more_multipliers: tuple[int, ...] = ()
    lm_long_multipliers: tuple[int, ...] = ()
    lm_long_rows: tuple[str, ...] = ()
    lm_eval_tokens: Optional[int] = None
    # LM lengths of lm_chunked_from x the training length and longer are scored through the KV
    # cache in chunks of lm_eval_chunk_size queries (the same logits; memory chunk x length, not
    # length squared, for the kernels that build a T x S bias). None: every length in one forward.
    lm_chunked_from: Optional[int] = None
    lm_eval_chunk_size: int = 512
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
    # Rows of the default passkey and NIAH tables only (no LM row): a row of model overrides
    # trains its own retrieval models in ROOT/<task>/<label>; an evaluated-with row
    # (trained_as) evaluates that row's retrieval models with its eval_overrides. No spec.
    retrieval_rows: tuple[LMVariant, ...] = ()
    rival_checks: Optional[RivalChecks] = None  # the language family's checks against the rival
    layout_checks: tuple[LayoutCheck, ...] = ()  # non-inferiority checks between LM rows
    # Vision: one ViT per encoding (spec with {enc}), evaluated at these multiples of its
    # training resolution on the first vit_eval_batches test batches (0: the whole split).
    vit: str = ""  # '' = no vision family in this suite
    vit_encodings: tuple[str, ...] = VIT_ENCODINGS
    vit_overrides: dict = dataclasses.field(default_factory=dict)
    vit_scales: tuple[float, ...] = (1, 1.5, 2, 3)
    vit_eval_batches: Optional[int] = None  # None: the config's data.num_eval_batches
    # The canvas protocol (goat_jax/eval/canvas.py): also top-1 with each test image pasted at a
    # random patch-aligned offset on canvases of these multiples of the training resolution.
    vit_canvas_scales: tuple[float, ...] = ()
    vit_dir: str = "vit"  # ROOT/<vit_dir>/<enc>: a new protocol gets its own runs
    # DNA: one genome LM per encoding (spec with {enc}), scored at these multiples of its
    # training length on the first dna_max_bases bases of the held-out region and of each genome.
    dna: str = ""  # '' = no DNA family in this suite
    dna_encodings: tuple[str, ...] = DNA_ENCODINGS
    dna_overrides: dict = dataclasses.field(default_factory=dict)
    dna_multipliers: tuple[int, ...] = (1, 2, 4, 8)
    dna_max_bases: Optional[int] = 131_072  # per scored set (None: all of it)
    dna_genomes: tuple[tuple[str, str], ...] = ()  # (label, FASTA path) scored besides the held-out region
    dna_gc_windows: int = 256  # GC agreement windows (docs/experiments.md: N >= 256)
    dna_memory_lengths: tuple[int, ...] = (1024, 4096)  # compiled train-step memory, GOAT vs RoPE
    dna_memory_model: dict = dataclasses.field(default_factory=dict)  # model fields changed there (tests)
    dna_dir: str = "dna"  # ROOT/<dna_dir>/<enc>
    # Extra rows of the vision and DNA families, as (family, row) pairs, e.g.
    #   ("dna", LMVariant("goat+bf16", "goat", {"model.dtype": "bfloat16"})):
    # one more run of the family's config (``vit`` / ``dna``, the row's encoding filled in) with
    # the row's overrides on top of the family's, in ROOT/<vit_dir or dna_dir>/<label>, shown in
    # the family's tables. Model overrides only (no spec, no evaluated-with rows).
    family_variants: tuple[tuple[str, LMVariant], ...] = ()
    # Seeds: every run (but the toy figure) trains once per seed, seed = the config's + k
    # (k = 0 .. seeds-1); the report gives mean ± 95% t interval over them (goat_jax/reproduce/stats.py).
    seeds: int = 1  # --seeds default
    lm_check_multiplier: int = 16  # the length ratio the LM extrapolation claims are judged at


_DNA_GENOMES = (("E. coli DH1 (another strain)", "/usr/share/doc/ragout/examples/E.Coli/references/DH1.fasta.gz"),
                ("human chr17 (40 kb)", "/usr/share/doc/python-pyfaidx-examples/examples/chr17.hg19.part.fa"),
                ("human GRCh37 chr1-3 (200 kb)", "/usr/share/doc/artfastqgenerator/examples/miniReference.fasta.gz"))


def _layout_rows() -> tuple[LMVariant, ...]:
    """GOAT trained in bf16 compute with each q/k layout, at head dim 32 and 64: LM rows only
    (the protocol judges perplexity)."""
    bf16 = {"model.dtype": "bfloat16"}
    h64 = {"model.num_heads": 2, "model.kv_num_heads": 2}
    lane = {"model.qk_layout": "lane_aligned"}
    return (LMVariant("goat+bf16", "goat", bf16, retrieval=False),
            LMVariant("goat+bf16+lane_aligned", "goat", {**bf16, **lane}, retrieval=False),
            LMVariant("goat+bf16+h64", "goat", {**bf16, **h64}, retrieval=False),
            LMVariant("goat+bf16+h64+lane_aligned", "goat", {**bf16, **h64, **lane}, retrieval=False))


def _family_layout_rows() -> tuple[tuple[str, LMVariant], ...]:
    """GOAT trained in bf16 compute with each q/k layout in the DNA config (head dim 32: 27
    against 25 content dims) and the canvas ViT (head dim 64, R = 16: 31 against 29, the share of
    the official ViT-S/16's heads): rows of those families, run after the language rows
    (docs/protocols.md, "Extrapolation to 1024x and the 64-wide layout")."""
    bf16 = {"model.dtype": "bfloat16"}
    lane = {"model.qk_layout": "lane_aligned"}
    rows = (LMVariant("goat+bf16", "goat", bf16), LMVariant("goat+bf16+lane_aligned", "goat", {**bf16, **lane}))
    return tuple((family, row) for family in ("dna", "vit") for row in rows)


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
        vit_canvas_scales=(1, 2),
        vit_overrides={"num_train_steps": 2, "eval_every_steps": 0, "checkpoint_every_steps": 2},
        vit_eval_batches=1,
        dna="configs/dna_tiny.py:{enc},smoke", dna_encodings=("goat", "rope"), dna_multipliers=(1, 4),
        dna_overrides={"num_train_steps": 2, "eval_every_steps": 0, "checkpoint_every_steps": 2},
        dna_max_bases=2048, dna_genomes=_DNA_GENOMES[1:2], dna_gc_windows=4, dna_memory_lengths=(64,),
        dna_memory_model={"num_layers": 1, "embed_dim": 32, "num_heads": 2, "mlp_dim": 64}, seeds=1),
    # ~15 hours on 2 CPU cores with 3 seeds (docs/experiments.md, "Compute of the tiny suite"): run
    # it in parts or sittings, finished runs are reused. Settings chosen once for all encodings.
    "tiny": Suite(
        name="tiny", lm=(("jargon", "configs/lm_tiny.py:{enc}"),),
        retrieval="configs/retrieval_tiny.py:{task},{enc}", toy="configs/toy_copy_mixture.py", seeds=3,
        # Every model trains at 64 tokens, so 16x is 1024 and 64x 4096 (perplexity only: the
        # retrieval and passkey evaluations stop at 16x, their cost grows with length x examples).
        # MHA instead of lm_tiny's GQA: GOAT's prior is per KV head, and 2 priors per layer cost
        # it ~15% perplexity at this size.
        # 1000 steps: GOAT and RoPE are still improving at 600 (2-3% apart).
        lm_ppl_multipliers=(1, 2, 4, 8, 16, 32, 64),
        # Decided 2026-12-04 before these runs (docs/protocols.md, "Extrapolation to 1024x and the
        # 64-wide layout"): 10% of the Jargon entries held out (153,879 bytes: two full windows
        # at 1024x), every length scoring the same 131,072 held-out bytes (131,073 read), 128x and 256x
        # for every LM row, 512x and 1024x for the rows whose 64x / 1x ratio was below 1.5 then.
        lm_more_multipliers=(128, 256), lm_long_multipliers=(512, 1024), lm_eval_tokens=131_073,
        lm_long_rows=("goat", "goat+linear_sink", "goat+learn_frequencies", "alibi", "kerple_log", "fox", "nope"),
        # Added 2026-12-05 for memory (ALiBi's 'xla' kernel asked for 51.6 GB at 32,768; FIRE's
        # [T, S, 32] hidden layer was killed at 8,192): 128x and longer through the KV cache in
        # 512-query chunks, for every LM row.
        lm_chunked_from=128, lm_eval_chunk_size=512,
        lm_overrides={"seq_len": 64, "global_batch_size": 32, "model.kv_num_heads": 4,
                      "num_train_steps": 1000, "eval_every_steps": 1000,
                      # a checkpoint every 200 steps: a killed run loses at most ~2 minutes
                      "checkpoint_every_steps": 200, "data.eval_fraction": 0.10},
        retrieval_overrides={},
        # ViT and DNA evaluations capped to minutes per run on 2 cores: 4,096 of the 10k test
        # images (32 x 128) at every resolution and canvas (top-1 standard error ~0.6 points at
        # 85%), 65,536 bases of each DNA set (16 windows at 8x of 512).
        # Vision: the canvas protocol (docs/protocols.md): head dim 64 for GOAT's official ViT
        # ranks, 4 epochs; the same runs also evaluated by upsampling (the old protocol's table).
        vit="configs/vit_tiny.py:{enc},canvas", vit_eval_batches=32, vit_canvas_scales=(1, 1.5, 2, 3),
        vit_dir="vit_canvas",
        # DNA: the long-window protocol: 512-base windows (half the official 1024), 1500 steps,
        # GC agreement over 1,600 windows (95% interval of r ~ +-0.05), two human genomes.
        dna="configs/dna_tiny.py:{enc},long", dna_genomes=_DNA_GENOMES, dna_max_bases=65_536,
        dna_gc_windows=1600, dna_dir="dna_long",
        notes=report_notes.LM_NOTES,
        vit_notes=report_notes.VIT_NOTES,
        dna_notes=report_notes.DNA_NOTES,
        encodings=ENCODINGS + COMPARATORS, vit_encodings=VIT_ENCODINGS + VIT_COMPARATORS,
        lm_variants=(
            LMVariant("goat+linear_sink", "goat", spec="configs/lm_tiny.py:{enc},linear_sink"),
            # GOAT's Fourier frequencies learned (the paper's future work), trained as its own row.
            LMVariant("goat+learn_frequencies", "goat", {"model.learn_frequencies": True}),
            # How a RoPE model is usually run past its training length: the RoPE runs themselves,
            # evaluated with rescaled frequencies (dynamic factor) or log-n scaled logits.
            LMVariant("rope+yarn", "rope", trained_as="rope", eval_overrides={"model.position_encoding": "yarn"}),
            LMVariant("rope+ntk", "rope", trained_as="rope", eval_overrides={"model.position_encoding": "ntk"}),
            LMVariant("rope+logn", "rope", trained_as="rope", eval_overrides={"model.logn_scaling": "content"}),
            LMVariant("rope+yarn+logn", "rope", trained_as="rope",
                      eval_overrides={"model.position_encoding": "yarn", "model.logn_scaling": "content"}),
            LMVariant("goat+logn", "goat", trained_as="goat", eval_overrides={"model.logn_scaling": "content"}),
            # The 64-wide layout weighed in bf16 compute, where it differs from the official one
            # (docs/protocols.md, "Extrapolation to 1024x and the 64-wide layout"): head dim 32
            # (the tiny LM's) and 64 (2 heads; the 125M configs' head dim).
            *_layout_rows()),
        # The official synthetic settings (R = M = 8, init_scale_prior 3e-3, (global + 10 span) / 11,
        # baselines at attention scale 1) next to ours, every task and encoding.
        retrieval_variants=(RetrievalVariant("official", "configs/retrieval_tiny.py:{task},{enc},official"),),
        # Decided 2026-12-02 before these rows were run (docs/protocols.md, "The strongest rival
        # and the linear sink"): FoX's retrieval models also with the forget-gate bias at 5,
        # where it learns both tasks at 1x (the official b = 0 rows stay, labelled fox); GOAT's
        # retrieval models evaluated with the linear sink (the same weights: the option changes
        # nothing up to the training length).
        retrieval_rows=(
            LMVariant("fox+gate_bias5", "fox", {"model.fox_gate_bias_init": 5.0}),
            LMVariant("goat+linear_sink", "goat", trained_as="goat",
                      eval_overrides={"model.sink_extrapolation": "linear"})),
        rival_checks=RivalChecks("goat+linear_sink", lm_rival="fox", retrieval_rival="fox+gate_bias5",
                                 ppl_multipliers=(16, 64, 256, 1024), flat_multiplier=1024),
        # The same layouts in the DNA and ViT configs (decided with the LM rows, 2026-12-04): bits
        # per base at 1x within 1% relative, top-1 at the training resolution within 1 point; the
        # change at the DNA's longest length (8x) and on the ViT's 2x canvas shown, not judged.
        family_variants=_family_layout_rows(),
        layout_checks=(LayoutCheck("goat+bf16+lane_aligned", "goat+bf16", "lane_aligned (head dim 32, bf16)"),
                       LayoutCheck("goat+bf16+h64+lane_aligned", "goat+bf16+h64", "lane_aligned (head dim 64, bf16)"),
                       LayoutCheck("goat+bf16+lane_aligned", "goat+bf16", "DNA lane_aligned (head dim 32, bf16)",
                                   family="dna", metric="bits_per_base", shown_multiplier=8),
                       LayoutCheck("goat+bf16+lane_aligned", "goat+bf16", "ViT lane_aligned (head dim 64, bf16)",
                                   family="vit", metric="top1", margin_in="points", shown_multiplier=2))),
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
    seed_offset: int = 0  # k: trains with the config's seed + k (k = 0 is the run of a 1-seed report)
    eval_overrides: dict = dataclasses.field(default_factory=dict)  # model fields changed at evaluation
    trains: bool = True  # False: an evaluated-with row, evaluating another row's run in ``workdir``
    record: str = ""  # the run's record folder (goat_jax/reproduce/records.py); '' when records are off

    @property
    def label(self) -> str:
        """The row label in the report: the encoding, or the LM variant's label."""
        return self.variant or self.encoding

    @property
    def name(self) -> str:
        """``kind/dataset/label`` (what the log says, and the key of its results)."""
        return f"{self.kind}/{self.dataset}/{self.label}"

    @property
    def run_name(self) -> str:
        """:attr:`name` plus ``@seed<k>`` for k > 0: one training run (logs, run times)."""
        return self.name + (f"@seed{self.seed_offset}" if self.seed_offset else "")

    @property
    def family(self) -> str:
        """``'lm'`` (LMs, retrieval, toy), ``'vit'`` or ``'dna'``: the family the job belongs to."""
        return "lm" if self.kind in LM_KINDS else self.kind


def seed_workdir(workdir: str, k: int) -> str:
    """Seed ``k``'s workdir: seed 0 keeps the 1-seed path (so a finished run is reused), seed
    k > 0 is its sibling ``<workdir>_seed<k>``."""
    return workdir if k == 0 else f"{workdir}_seed{k}"


def with_seeds(jobs: Sequence[Job], seeds: int) -> list[Job]:
    """Every job of ``jobs`` once per seed k = 0 .. ``seeds``-1 (seed-major: every seed-0 run,
    then every seed-1 run, ...), except the toy figure, which is trained once. The harness
    trains them in another order (the runs the headline checks read first:
    :func:`goat_jax.reproduce.runner.queue_order`). ValueError for ``seeds`` < 1."""
    if int(seeds) < 1:
        raise ValueError(f"--seeds {seeds}: give 1 or more (each seed trains every run once more).")
    out = list(jobs)
    for k in range(1, int(seeds)):
        out += [dataclasses.replace(j, seed_offset=k, workdir=seed_workdir(j.workdir, k))
                for j in jobs if j.kind != "toy"]
    return out


def plan(suite: Suite, root: str, encodings: Optional[Sequence[str]] = None, *,
         families: Sequence[str] = FAMILIES, vit_encodings: Optional[Sequence[str]] = None,
         dna_encodings: Optional[Sequence[str]] = None, seeds: int = 1) -> list[Job]:
    """Every run of ``suite``'s ``families``, in order. Language (``encodings``, default
    ``suite.encodings``): per LM dataset the encodings then the LM variants, per task the
    retrieval models (then each retrieval variant's), the toy. Vision: a ViT per
    ``vit_encodings`` in ``ROOT/<suite.vit_dir>/<enc>``. DNA: a genome LM per ``dna_encodings`` in
    ``ROOT/<suite.dna_dir>/<enc>``. Each of those two families' extra rows
    (``suite.family_variants``) follow its encodings, in ``ROOT/<dir>/<label>``. Defaults: the
    suite's encodings of each family. ``seeds`` > 1 adds
    the runs of seeds 1.. (:func:`with_seeds`)."""
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise ValueError(f"--families: unknown {unknown}; choose from {','.join(FAMILIES)}.")
    jobs = []
    if "lm" in families:
        jobs += _plan_language(suite, root, list(encodings or suite.encodings))
    for family, spec, encs, overrides, folder in (
            ("vit", suite.vit, vit_encodings or suite.vit_encodings, suite.vit_overrides, suite.vit_dir),
            ("dna", suite.dna, dna_encodings or suite.dna_encodings, suite.dna_overrides, suite.dna_dir)):
        if family in families and spec:
            jobs += [Job(family, family, enc, spec.format(enc=enc), dict(overrides),
                         os.path.join(root, folder, enc)) for enc in encs]
            jobs += [Job(family, family, v.encoding, spec.format(enc=v.encoding), {**overrides, **v.overrides},
                         os.path.join(root, folder, v.label), variant=v.label)
                     for v in family_variants(suite, family)]
    names = [j.name for j in jobs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # two rows under one name would be averaged as if they were seeds of one
        raise ValueError(f"suite {suite.name!r} plans {twice} twice (e.g. an LM variant evaluated-with on the "
                         "retrieval models and a retrieval_rows entry of the same label); give one of them "
                         "another label.")
    return with_seeds(jobs, seeds)


def family_variants(suite: Suite, family: str) -> list[LMVariant]:
    """The extra rows of vision or DNA ``family`` (``suite.family_variants``), in suite order;
    ValueError naming the entry for a family without such rows or a row that is not model
    overrides of the family's config."""
    out = []
    for fam, v in suite.family_variants:
        if fam not in FAMILIES[1:]:
            raise ValueError(f"family_variants {v.label!r}: family {fam!r}; these rows are for 'vit' and 'dna' "
                             "(the language family's are lm_variants).")
        if v.spec or v.trained_as or v.eval_overrides:
            raise ValueError(f"family_variants {v.label!r}: give model overrides only (no spec, trained_as or "
                             "eval_overrides); the row trains the family's config with them.")
        if fam == family:
            out.append(v)
    return out


def _retrieval_variant_rows(suite: Suite, root: str, task: str, encodings: list[str]) -> list[Job]:
    """The LM variants' rows of the default retrieval tables of ``task``: a variant given as
    model overrides only (no ``spec`` of its own, e.g. ``model.learn_frequencies``) trains its
    own retrieval model in ``ROOT/<task>/<label>``; an evaluated-with row evaluates the retrieval
    model of its ``trained_as`` row with its ``eval_overrides`` (RoPE's passkey model with YaRN),
    when that model is planned. A variant with its own LM config (``spec``) has no retrieval
    counterpart and no row there. ``suite.retrieval_rows`` follow, the same way (rows of these
    tables with no LM row)."""
    rows = tuple(suite.lm_variants) + tuple(suite.retrieval_rows)
    trained = set(encodings) | {v.label for v in rows if not v.trained_as and not v.spec}
    jobs = []
    for v in rows:
        if not v.retrieval:
            continue
        if v.spec and v in suite.retrieval_rows:
            raise ValueError(f"retrieval_rows {v.label!r}: spec={v.spec!r}; a retrieval row is the suite's "
                             "retrieval config with overrides (or an evaluated-with row), not a config of its own.")
        known = set(suite.encodings) | {r.label for r in rows if not r.trained_as and not r.spec}
        if v in suite.retrieval_rows and v.trained_as and v.trained_as not in known:  # a typo: refuse
            raise ValueError(f"retrieval_rows {v.label!r}: trained_as={v.trained_as!r} is not a trained retrieval "
                             f"row of suite {suite.name!r}; choose from {', '.join(sorted(known))}.")
        spec = suite.retrieval.format(task=task, enc=v.encoding)
        if v.trained_as:
            if v.trained_as in trained:
                jobs.append(Job(task, task, v.encoding, spec, dict(suite.retrieval_overrides),
                                os.path.join(root, task, v.trained_as), variant=v.label,
                                eval_overrides=dict(v.eval_overrides), trains=False))
        elif not v.spec:
            jobs.append(Job(task, task, v.encoding, spec, {**suite.retrieval_overrides, **v.overrides},
                            os.path.join(root, task, v.label), variant=v.label))
    return jobs


def _plan_language(suite: Suite, root: str, encodings: list[str]) -> list[Job]:
    """The language family's runs (see :func:`plan`)."""
    jobs = []
    for dataset, spec in suite.lm:
        for enc in encodings:
            jobs.append(Job("lm", dataset, enc, spec.format(enc=enc), dict(suite.lm_overrides),
                            os.path.join(root, dataset, enc)))
        known = list(suite.encodings) + [v.label for v in suite.lm_variants if not v.trained_as]
        planned = set(encodings) | {v.label for v in suite.lm_variants if not v.trained_as}
        for v in suite.lm_variants:
            if v.trained_as and v.trained_as not in known:  # a typo in the suite: refuse
                raise ValueError(f"lm_variants {v.label!r}: trained_as={v.trained_as!r} is not a trained row "
                                 f"of suite {suite.name!r}; choose from {', '.join(known)}.")
            if v.trained_as and v.trained_as not in planned:  # e.g. --encodings without its row
                continue
            jobs.append(Job("lm", dataset, v.encoding, (v.spec or spec).format(enc=v.encoding),
                            {**suite.lm_overrides, **v.overrides},
                            os.path.join(root, dataset, v.trained_as or v.label), variant=v.label,
                            eval_overrides=dict(v.eval_overrides), trains=not v.trained_as))
    retrieval = [("", suite.retrieval, {})] + [(f"_{v.label}", v.spec, v.overrides)
                                               for v in suite.retrieval_variants]
    for suffix, pattern, overrides in retrieval:
        for task in suite.tasks:
            for enc in encodings:
                jobs.append(Job(task, task + suffix, enc, pattern.format(task=task, enc=enc),
                                {**suite.retrieval_overrides, **overrides},
                                os.path.join(root, task + suffix, enc)))
            if not suffix:
                jobs += _retrieval_variant_rows(suite, root, task, encodings)
    if suite.toy:  # '' = no toy figure (e.g. a trimmed suite in a test)
        jobs.append(Job("toy", "copy_mixture", "goat", suite.toy, dict(suite.toy_overrides),
                        os.path.join(root, "toy")))
    return jobs
