"""The 64-wide layout weighed on the tiny DNA and ViT configs (docs/protocols.md, "Extrapolation to
1024x and the 64-wide layout"): the rows planned as decided (GOAT in bf16 compute with each q/k
layout, 3 seeds, resumable parts of the tiny suite queued after the language rows), the existing
DNA and ViT rows' records and caches left valid, the non-inferiority checks' verdicts (one code
path with the LM's: :mod:`goat_jax.reproduce.layout`), and a smoke-sized run through the harness."""

from __future__ import annotations

import dataclasses
import os
import shutil

import jax
import jax.numpy as jnp
import pytest

from experiments import reproduce
from goat_jax import kernels
from goat_jax.config.files import load_config
from goat_jax.prior.settings import PriorSpec
from goat_jax.reproduce import dna_family, layout, records, report, runner, stats, suites, vit_family
from goat_jax.reproduce import jobs as jobs_lib
from goat_jax.train import tasks, trainer
from goat_jax.kernels.plan import AttentionPlan

E = stats.Estimate
TINY = suites.SUITES["tiny"]
LABELS = ("goat+bf16", "goat+bf16+lane_aligned")
FAMILY_ROWS = tuple(f"{f}/{f}/{label}" for f in ("dna", "vit") for label in LABELS)
# Content dims of the official and lane_aligned layouts in bf16 (3 sink channels): DNA head 32 with
# R = 2, the canvas ViT's head 64 with R = 16.
CONTENT = {"dna": (27, 25), "vit": (31, 29)}


def _packed_widths(config) -> set[int]:
    model = tasks.get_task(config.task).build_model(config, AttentionPlan.from_config(config))
    x = (jnp.zeros((1, 28, 28, 1), jnp.float32) if config.task == "vit" else jnp.zeros((1, 8), jnp.int32))
    with kernels.record_choices() as found:
        jax.eval_shape(lambda: model.init(jax.random.key(0), x))
    return {c["qk_dim"] for c in found}


def test_dna_and_vit_layout_rows_are_planned_as_decided():
    """Per family, goat+bf16 (official) and goat+bf16+lane_aligned: trained rows of the family's
    tiny config (configs/dna_tiny.py:goat,long; configs/vit_tiny.py:goat,canvas), 3 seeds, their
    configs the GOAT row's but for model.dtype and model.qk_layout, the layout reaching the
    attention kernel (q/k head_dim + 2 wide against head_dim)."""
    jobs = {j.run_name: j for j in suites.plan(TINY, "/runs", seeds=3)}
    for family, spec, folder in (("dna", "configs/dna_tiny.py:goat,long", "dna_long"),
                                 ("vit", "configs/vit_tiny.py:goat,canvas", "vit_canvas")):
        goat = jobs[f"{family}/{family}/goat"]
        base = load_config(goat.spec, goat.overrides).to_dict()
        for label, layout_name, content in zip(LABELS, ("official", "lane_aligned"), CONTENT[family]):
            job = jobs[f"{family}/{family}/{label}"]
            assert (job.spec, job.trains, job.variant, job.encoding) == (spec, True, label, "goat")
            assert job.workdir == f"/runs/{folder}/{label}"
            assert [jobs[f"{job.name}@seed{k}"].workdir for k in (1, 2)] == [f"/runs/{folder}/{label}_seed{k}"
                                                                           for k in (1, 2)]
            config = load_config(job.spec, job.overrides)
            trainer.validate_config(config, 1)
            got = config.to_dict()
            assert (got["model"]["dtype"], got["model"]["qk_layout"]) == ("bfloat16", layout_name)
            assert {k for k in got if got[k] != base[k]} == {"model"}
            assert {k for k in got["model"] if got["model"][k] != base["model"][k]} == (
                {"dtype"} | ({"qk_layout"} if layout_name != "official" else set()))
            m = config.model
            head = m.embed_dim // m.num_heads
            spec_ = PriorSpec(pos_rank=m.pos_rank, abs_rank=m.abs_rank, qk_layout=layout_name,
                              num_heads=m.num_heads, kv_num_heads=m.num_heads)
            assert spec_.content_dim(head, sink_channels=3) == content
            assert _packed_widths(config) == {head + 2 if layout_name == "official" else head}
            assert jobs_lib.FEEDS_CHECKS[family](job, TINY)
    # Rows of their families alone: no LM, retrieval or toy run of theirs.
    assert {j.name for j in jobs.values() if j.variant in LABELS and j.family != "lm"} == set(FAMILY_ROWS)


def test_existing_dna_and_vit_rows_keep_their_records_and_cached_evaluations():
    """The layout rows add no evaluation setting: every DNA and ViT row's settings are those of
    the suite without them, and every committed record of the tiny report's DNA and ViT runs
    (reports/tiny/runs) is still reused as it is (same config, ViTConfig's new qk_layout at its
    default, same evaluation settings)."""
    before = dataclasses.replace(TINY, family_variants=(), layout_checks=layout.of_family(TINY.layout_checks, "lm"))
    root, kept = "/runs", os.path.join(suites.ROOT, "reports", "tiny", "runs")
    jobs = records.attach(suites.plan(TINY, root, families=["vit", "dna"], seeds=3), root, kept)
    old = {j.run_name for j in suites.plan(before, root, families=["vit", "dna"], seeds=3)}
    assert {j.run_name for j in jobs} - old == {f"{n}{s}" for n in FAMILY_ROWS for s in ("", "@seed1", "@seed2")}
    found = {"vit": 0, "dna": 0}
    for job in jobs:
        if job.run_name not in old:
            continue
        assert jobs_lib.eval_settings(job, TINY) == jobs_lib.eval_settings(job, before), job.run_name
        if os.path.exists(records.record_path(job)):
            assert jobs_lib.recorded(job, TINY) is not None, job.run_name
            found[job.family] += 1
    assert found["vit"] >= 6 and found["dna"] >= 4


def test_status_lists_the_layout_rows_as_missing(tmp_path, capsys):
    """``--status`` on copies of the tiny report's DNA and ViT records with the layout rows' own
    records left out (however many of them have landed in the repository): the encodings' rows
    are done, the four layout rows are listed as not started at every seed."""
    layout_folders = {os.path.basename(j.workdir) for j in suites.plan(TINY, "/runs", seeds=3) if j.name in FAMILY_ROWS}
    for folder in ("vit_canvas", "dna_long"):
        shutil.copytree(os.path.join(suites.ROOT, "reports", "tiny", "runs", folder), tmp_path / "records" / folder,
                        ignore=lambda _, names: [n for n in names if n in layout_folders])
        assert not set(os.listdir(tmp_path / "records" / folder)) & layout_folders
    argv = ["--suite", "tiny", "--seeds", "3", "--families", "vit,dna", "--workdir", str(tmp_path / "runs"),
            "--out", str(tmp_path / "out"), "--records", str(tmp_path / "records"), "--status"]
    assert reproduce.main(argv) == 0
    out = capsys.readouterr().out
    missing = out.split("Not started", 1)[1].split("\n\n", 1)[0]
    assert sorted(line.split(":")[0].strip() for line in missing.splitlines()[1:]) == sorted(FAMILY_ROWS)
    assert all(f"{n}: seeds +0 +1 +2" in missing for n in FAMILY_ROWS)
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()  # --status writes nothing


def test_layout_rows_are_queued_after_the_language_rows():
    """The protocol runs the DNA and ViT layout rows after the language rows: in the order of the
    default --families (lm, vit, dna), every run a language check reads (the LM layout rows
    among them) is queued before any DNA or ViT layout row."""
    assert suites.FAMILIES == ("lm", "vit", "dna")  # --families' default and queue_order's
    jobs = suites.plan(TINY, "/r", seeds=3)
    order = runner.queue_order(jobs, TINY)
    at = {j.run_name: i for i, j in enumerate(order)}
    lm_first = [j.run_name for j in jobs if j.family == "lm" and jobs_lib.FEEDS_CHECKS["lm"](j, TINY)]
    assert {f"lm/jargon/goat+bf16+h64+lane_aligned@seed{k}" for k in (1, 2)} <= set(lm_first)
    ours = [j.run_name for j in jobs if j.name in FAMILY_ROWS]
    assert len(ours) == 12 and max(at[n] for n in lm_first) < min(at[n] for n in ours)


def _dna(bits: dict[int, list[float]]) -> dict:
    return {"heldout": {"by_length": {str(n): {"bits_per_base": E(v)} for n, v in bits.items()}}}


def _vit(top1: list[float], canvas_2x: list[float]) -> dict:
    return {"resolution": {"28": {"top1": E(top1)}, "56": {"top1": E([0.5, 0.5, 0.5])}},
            "canvas": {"28": {"top1": E(top1)}, "56": {"top1": E(canvas_2x)}}}


def test_dna_layout_check_is_non_inferiority_at_one_percent_of_bits_per_base():
    """d = bits per base (lane_aligned) / (official) - 1 at 1x against 1%, paired over seeds;
    the 8x change shown; a missing row or length is 'not measured'."""
    (lc,) = layout.of_family(TINY.layout_checks, "dna")
    ref = {512: [1.90, 1.92, 1.91], 4096: [1.95, 1.96, 1.95]}

    def check(cand_1x, cand=None):
        results = {"dna/dna/goat+bf16": _dna(ref), "dna/dna/goat+bf16+lane_aligned": _dna(
            cand or {512: cand_1x, 4096: [1.96, 1.97, 1.96]})}
        (c,) = dna_family.layout_checks(results, TINY.layout_checks)
        return c

    same = check([1.901, 1.918, 1.912])
    assert same.claim == ("DNA lane_aligned (head dim 32, bf16): bits per base at 1x no worse than goat+bf16's "
                          "by more than 1%")
    assert same.verdict == stats.SUPPORTED and same.ok
    assert same.numbers.startswith("goat+bf16+lane_aligned 1.9103 ± ") and " at 512 (" in same.numbers
    assert "; at 8x +0.51 ± " in same.numbers and same.numbers.endswith("% (not judged)")
    assert same.difference.startswith("goat+bf16+lane_aligned / goat+bf16 - 1 - 1% (points) = -0.9")
    assert check([1.96, 1.98, 1.97]).verdict == stats.CONTRADICTED  # ~3% worse in every seed
    assert check([1.90, 1.96, 1.91]).verdict == stats.INCONCLUSIVE  # 0%, +2.1%, 0%
    assert dna_family.layout_checks({}, TINY.layout_checks)[0].numbers == "not measured"
    assert check(None, {1024: [1.9, 1.9, 1.9]}).numbers == "not measured (1024 bases not evaluated)"
    near = check([1.915, 1.94, 1.929])  # +0.8%, +1.0%, +1.0%: below the margin, but not surely
    assert near.verdict == stats.INCONCLUSIVE and near.ok


def test_vit_layout_check_is_non_inferiority_by_one_point_of_top1():
    """top-1 (official) - top-1 (lane_aligned) at the training resolution against 1 point, paired
    over seeds; the change on the 2x canvas shown, not judged."""
    (lc,) = layout.of_family(TINY.layout_checks, "vit")
    assert (lc.metric, lc.margin, lc.margin_in, lc.multiplier) == ("top1", 0.01, "points", 1)
    ref = [0.85, 0.86, 0.855]

    def check(cand):
        results = {"vit/vit/goat+bf16": _vit(ref, [0.70, 0.72, 0.71]),
                   "vit/vit/goat+bf16+lane_aligned": _vit(cand, [0.69, 0.70, 0.70])}
        (c,) = vit_family.layout_checks(results, TINY.layout_checks)
        return c

    same = check([0.848, 0.861, 0.853])
    assert same.claim == ("ViT lane_aligned (head dim 64, bf16): top-1 at 1x no worse than goat+bf16's by more "
                          "than 1 point")
    assert same.verdict == stats.SUPPORTED
    assert same.numbers.startswith("goat+bf16+lane_aligned 85.40 ± ") and "%, goat+bf16 85.50 ± " in same.numbers
    assert "at 28 (-0.10 ± " in same.numbers and "; at 2x canvas -1.33 ± " in same.numbers
    assert same.difference.startswith("goat+bf16 - goat+bf16+lane_aligned - 1 (points) = -0.9")
    assert check([0.82, 0.83, 0.826]).verdict == stats.CONTRADICTED  # ~3 points lower in every seed
    assert check([0.85, 0.835, 0.854]).verdict == stats.INCONCLUSIVE  # 0, 2.5, 0.1 points lower
    assert vit_family.layout_checks({"vit/vit/goat+bf16": _vit(ref, ref)}, TINY.layout_checks)[0].numbers == \
        "not measured"


def test_the_family_sections_carry_their_layout_checks_and_nothing_else_changes():
    """The report's headline checks of the DNA and ViT families end with their layout check (as
    the LM's), and the paper-claim checks ignore the extra rows (a layout row with the best top-1
    does not become the 'best encoding' GOAT is compared with)."""
    jobs = [j for j in suites.plan(TINY, "/r") if j.family in ("vit", "dna")]
    results = {"vit/vit/goat": _vit([0.85, 0.86, 0.855], [0.7, 0.7, 0.7]),
               "vit/vit/ape": _vit([0.85, 0.86, 0.855], [0.6, 0.6, 0.6]),
               "vit/vit/goat+bf16": _vit([0.99, 0.99, 0.99], [0.7, 0.7, 0.7]),
               "vit/vit/goat+bf16+lane_aligned": _vit([0.99, 0.99, 0.98], [0.7, 0.7, 0.7])}
    for r in results.values():
        r["train_resolution"] = 28
    vit_checks = report.headline_checks("vit", TINY, [j for j in jobs if j.family == "vit"], results)
    assert vit_checks[-1].claim.startswith("ViT lane_aligned (head dim 64, bf16): top-1 at 1x")
    best = next(c for c in vit_checks if "within 1 point of the best encoding" in c.claim)
    assert "goat+bf16" not in best.numbers and best.ok
    dna_checks = report.headline_checks("dna", TINY, [j for j in jobs if j.family == "dna"], {})
    assert [c.claim.split(":")[0] for c in dna_checks] == ["DNA lane_aligned (head dim 32, bf16)"]
    assert dna_checks[0].numbers == "not measured"


def test_family_rows_and_checks_refuse_what_they_cannot_be():
    row = suites.LMVariant("goat+x", "goat", {"model.dtype": "bfloat16"})
    for bad, match in (((("lm", row),), "family 'lm'; these rows are for 'vit' and 'dna'"),
                       ((("dna", dataclasses.replace(row, trained_as="goat")),), "model overrides only")):
        with pytest.raises(ValueError, match=match):
            suites.plan(dataclasses.replace(TINY, family_variants=bad), "/r", families=["vit", "dna"])
    with pytest.raises(ValueError, match="metric='accuracy'; choose from ppl, bits_per_base, top1"):
        suites.LayoutCheck("a", "b", "t", metric="accuracy")
    with pytest.raises(ValueError, match="margin_in='points' needs a metric that is a fraction"):
        suites.LayoutCheck("a", "b", "t", family="dna", metric="bits_per_base", margin_in="points")


def _smoke_suite(name: str) -> suites.Suite:
    """The smoke suite's ViT and DNA families with only the two bf16 layout rows each and their
    checks (no encodings' rows, no other genome, no memory compile): the cheapest suite that runs
    the layout rows."""
    bf16, lane = {"model.dtype": "bfloat16"}, {"model.qk_layout": "lane_aligned"}
    rows = tuple((f, suites.LMVariant(label, "goat", {**bf16, **extra}))
                 for f in ("dna", "vit") for label, extra in zip(LABELS, ({}, lane)))
    checks = (suites.LayoutCheck(LABELS[1], LABELS[0], "DNA lane_aligned", family="dna", metric="bits_per_base",
                                 shown_multiplier=4),
              suites.LayoutCheck(LABELS[1], LABELS[0], "ViT lane_aligned", family="vit", metric="top1",
                                 margin_in="points", shown_multiplier=2))
    return dataclasses.replace(suites.SUITES["smoke"], name=name, vit_encodings=(), dna_encodings=(),
                               dna_memory_lengths=(), dna_genomes=(), family_variants=rows, layout_checks=checks)


@pytest.mark.slow(reason="trains and evaluates four smoke runs in bf16 through the harness (~2 CPU-minutes); "
                  "the default suite checks the rows, checks and status at unit level above")
def test_layout_rows_train_evaluate_and_report_through_the_harness(tmp_path, monkeypatch, capsys):
    """The smoke-sized layout rows through ``experiments.reproduce``: --status lists them missing,
    a run trains them in bf16 with their layout and reports them in their families' tables and
    checks, and a second run reuses every one of them (nothing recomputed)."""
    monkeypatch.setitem(suites.SUITES, "smoke_layout", _smoke_suite("smoke_layout"))
    argv = ["--suite", "smoke_layout", "--families", "vit,dna", "--workdir", str(tmp_path / "runs"),
            "--out", str(tmp_path / "out"), "--compilation_cache", "none"]
    assert reproduce.main(argv + ["--status"]) == 0
    status = capsys.readouterr().out
    assert all(f"{n}: seeds +0" in status for n in FAMILY_ROWS)
    assert reproduce.main(argv) == 0
    log = capsys.readouterr().out
    for family, folder in (("vit", "vit"), ("dna", "dna")):
        section = (tmp_path / "out" / "sections" / f"{family}.md").read_text()
        checks = section.split("### Headline checks", 1)[1].split("\n### ", 1)[0]
        assert f"{family.upper() if family == 'dna' else 'ViT'} lane_aligned: " in checks
        assert f"| {stats.ONE_SEED} |" in checks.split(" lane_aligned: ", 1)[1].splitlines()[0]
        planned = {j.label: j for j in suites.plan(suites.SUITES["smoke_layout"], str(tmp_path / "runs"),
                                                   families=[family])}
        for label, layout_name in zip(LABELS, ("official", "lane_aligned")):
            assert f"| {label} |" in section  # a row of the family's tables
            config = records.read_config(planned[label])
            assert (config.model.dtype, config.model.qk_layout) == ("bfloat16", layout_name)
        assert os.path.isdir(tmp_path / "runs" / folder / LABELS[1])
    assert reproduce.main(argv) == 0
    assert "reused 4 finished and evaluated run(s); 0 to go" in capsys.readouterr().out
