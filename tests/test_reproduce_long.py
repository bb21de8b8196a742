"""The tiny report's 1024x extrapolation and 64-wide layout protocol (docs/protocols.md,
"Extrapolation to 1024x and the 64-wide layout"): the rows and lengths planned as decided, the
retrieval models' cached evaluations left valid, the new checks' verdicts, and the per-length
evaluation with its cost on a trained smoke LM."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from goat_jax.config.files import load_config
from goat_jax.prior.settings import PriorSpec
from goat_jax.reproduce import jobs as jobs_lib
from goat_jax.reproduce import lm_family, stats, suites

E = stats.Estimate
TINY = suites.SUITES["tiny"]
LONG_ROWS = ("goat", "goat+linear_sink", "goat+learn_frequencies", "alibi", "kerple_log", "fox", "nope")


def _jobs():
    return {j.name: j for j in suites.plan(TINY, "/runs")}


def test_lengths_and_held_out_split_are_planned_as_decided():
    """Every LM row to 256x, the seven rows of the protocol to 1024x, all on the same first
    131,072 held-out bytes of a 10% held-out split; the rows that were above 1.5 at 64x stop at
    256x."""
    jobs = _jobs()
    assert TINY.lm_long_rows == LONG_ROWS
    for name, job in jobs.items():
        if job.kind != "lm":
            continue
        got = lm_family.ppl_multipliers(job, TINY)
        top = 1024 if job.label in LONG_ROWS else 256
        assert got == tuple(m for m in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if m <= top), name
        settings = jobs_lib.eval_settings(job, TINY) if not job.trains else None
        if job.trains:
            assert load_config(job.spec, job.overrides).data.eval_fraction == pytest.approx(0.10)
        else:  # an evaluated-with row's settings name its own lengths
            assert settings["lm_eval_tokens"] == 131_073
    assert 2 * 1024 * 64 + 1 == TINY.lm_eval_tokens  # two full windows at 1024x (W + 1 bytes each)


def test_retrieval_models_keep_their_cached_evaluations():
    """The new LM settings enter only the LM rows' evaluation settings: a retrieval or toy job's
    settings are those of the suite without them, so its records and caches stay valid."""
    before = dataclasses.replace(TINY, lm_more_multipliers=(), lm_long_multipliers=(), lm_long_rows=(),
                                 lm_eval_tokens=None)
    checked = 0
    for job in _jobs().values():
        if job.kind in ("passkey", "niah", "toy"):
            assert jobs_lib.eval_settings(job, TINY) == jobs_lib.eval_settings(job, before), job.name
            checked += 1
        elif job.kind == "lm":
            assert jobs_lib.eval_settings(job, TINY) != jobs_lib.eval_settings(job, before)
    assert checked > 50


def test_layout_rows_differ_only_in_layout_and_head_dim():
    """goat+bf16 / goat+bf16+lane_aligned at head dim 32 (23 vs 21 content dims) and the same
    pair at head dim 64 (55 vs 53), all bf16 compute, everything else the GOAT LM row's."""
    jobs = _jobs()
    base = load_config(jobs["lm/jargon/goat"].spec, jobs["lm/jargon/goat"].overrides)
    content = {}
    for label, layout, head in (("goat+bf16", "official", 32), ("goat+bf16+lane_aligned", "lane_aligned", 32),
                                ("goat+bf16+h64", "official", 64), ("goat+bf16+h64+lane_aligned", "lane_aligned", 64)):
        job = jobs[f"lm/jargon/{label}"]
        assert job.trains
        c = load_config(job.spec, job.overrides)
        assert (c.model.dtype, c.model.qk_layout) == ("bfloat16", layout)
        assert c.model.embed_dim // c.model.num_heads == head and c.model.kv_num_heads == c.model.num_heads
        settings = PriorSpec(pos_rank=c.model.pos_rank, abs_rank=c.model.abs_rank, qk_layout=layout,
                             num_heads=c.model.num_heads, kv_num_heads=c.model.kv_num_heads)
        content[label] = settings.content_dim(head, sink_channels=3)  # bf16 packs the sink in 3 channels
        diff = {k for k in c.model if c.model[k] != base.model[k]}
        assert diff <= {"dtype", "qk_layout", "num_heads", "kv_num_heads"}, diff
    assert content == {"goat+bf16": 23, "goat+bf16+lane_aligned": 21, "goat+bf16+h64": 55,
                       "goat+bf16+h64+lane_aligned": 53}
    assert not any(j.variant.startswith("goat+bf16") for j in jobs.values()
                   if j.family == "lm" and j.kind != "lm")  # LM rows only (the DNA and ViT families' are their own)
    feeding = {n for n, j in jobs.items() if lm_family.feeds_checks(j, TINY)}
    assert {f"lm/jargon/{x}" for x in ("goat+bf16", "goat+bf16+lane_aligned", "goat+bf16+h64",
                                       "goat+bf16+h64+lane_aligned")} <= feeding


def _ppl(values_by_length):
    return {"extrapolation": {n: {"ppl": E(v)} for n, v in values_by_length.items()}}


def test_flatness_and_far_rival_checks():
    """goat+linear_sink at 1024x against 1.05 x its 1x, and against FoX at 256x and 1024x,
    paired over seeds; an unevaluated length is named, never dropped."""
    rival = TINY.rival_checks
    results = {"lm/jargon/goat+linear_sink": _ppl({64: [6.0, 6.2, 6.1], 16384: [6.0, 6.1, 6.0],
                                                   65536: [6.05, 6.25, 6.1]}),
               "lm/jargon/fox": _ppl({64: [6.1, 6.2, 6.1], 16384: [7.0, 7.3, 7.1], 65536: [6.0, 6.2, 6.05]})}
    checks = {c.claim: c for c in lm_family.rival_checks(results, rival, "jargon")}
    flat = checks["goat+linear_sink perplexity at 1024x <= 1.05 x its in-distribution perplexity"]
    assert flat.verdict == stats.SUPPORTED and "ratio - 1.05" in flat.difference
    assert checks["goat+linear_sink perplexity at 256x < fox's"].verdict == stats.SUPPORTED
    assert checks["goat+linear_sink perplexity at 1024x < fox's"].verdict == stats.CONTRADICTED
    assert "1024 tokens not evaluated" in checks["goat+linear_sink perplexity at 16x < fox's"].numbers
    # Rising by 10-20% in every seed: the flatness claim is contradicted.
    results["lm/jargon/goat+linear_sink"]["extrapolation"][65536] = {"ppl": E([6.9, 7.4, 6.8])}
    checks = {c.claim: c for c in lm_family.rival_checks(results, rival, "jargon")}
    assert checks["goat+linear_sink perplexity at 1024x <= 1.05 x its in-distribution perplexity"].verdict == \
        stats.CONTRADICTED
    del results["lm/jargon/goat+linear_sink"]["extrapolation"][65536]
    checks = {c.claim: c for c in lm_family.rival_checks(results, rival, "jargon")}
    assert "65536 tokens not evaluated" in checks[
        "goat+linear_sink perplexity at 1024x <= 1.05 x its in-distribution perplexity"].numbers


def test_layout_check_is_non_inferiority_at_one_percent():
    """d = lane_aligned / official - 1 at 1x against the 1% margin: supported below it,
    contradicted above it, inconclusive across it; the 16x difference is shown, not judged."""
    lc = TINY.layout_checks[0]
    ref = {64: [6.0, 6.2, 6.1], 1024: [7.0, 7.0, 7.0]}

    def verdict(cand_1x):
        results = {"lm/jargon/goat+bf16": _ppl(ref),
                   "lm/jargon/goat+bf16+lane_aligned": _ppl({64: cand_1x, 1024: [7.1, 7.0, 7.2]})}
        (check,) = lm_family.layout_checks(results, (lc,), "jargon")
        return check

    same = verdict([6.0, 6.2, 6.1])
    assert same.verdict == stats.SUPPORTED and "at 16x +1.43 ± 3.55% (not judged)" in same.numbers
    assert verdict([6.2, 6.4, 6.3]).verdict == stats.CONTRADICTED  # ~3.3% worse in every seed
    assert verdict([6.0, 6.3, 6.1]).verdict == stats.INCONCLUSIVE  # 0%, +1.6%, 0%
    assert lm_family.layout_checks({}, (lc,), "jargon")[0].numbers == "not measured"


def test_each_length_is_scored_on_the_same_tokens_with_its_cost(tmp_path, monkeypatch):
    """A 2-step smoke LM scored one length at a time on the first 2,049 held-out tokens: every
    length scores exactly 2,048 targets (so the columns read the same text), the numbers equal
    one evaluation of all lengths together, and each length has its seconds and peak memory."""
    from goat_jax.eval import lm_run
    from goat_jax.eval import runs as ev
    from goat_jax.train import trainer

    config = load_config("configs/lm_tiny.py:goat,smoke", {"num_train_steps": 2, "checkpoint_every_steps": 2,
                                                           "eval_every_steps": 0, "progress_bar": False})
    trainer.train_and_evaluate(config, str(tmp_path))
    run = lm_run.load_lm_run(str(tmp_path))
    reads = []
    heldout = ev.heldout_stream
    monkeypatch.setattr(ev, "heldout_stream", lambda *a, **k: reads.append(1) or heldout(*a, **k))
    ext, cost = lm_family.timed_extrapolation(run, (4, 1, 32), max_tokens=2049)
    assert len(reads) == 1  # the held-out stream is read and tokenized once for every length
    assert sorted(ext) == [64, 256, 2048] == sorted(cost)
    assert {v["tokens"] for v in ext.values()} == {2048}
    together = ev.eval_extrapolation(run, (1, 4, 32), max_tokens=2049)
    for n in ext:
        assert ext[n]["nll"] == pytest.approx(together[n]["nll"], rel=1e-6)
    assert all(c["seconds"] > 0 and c["peak_rss_mib"] > 0 for c in cost.values())
    table = lm_family.cost_table({"goat": cost})
    assert table[0].startswith("Cost of one evaluation by length") and table[4].startswith("| 64 | whole windows | 1 |")
    assert [line.split(" | ")[0] for line in table[4:]] == ["| 64", "| 256", "| 2048"]
    assert np.isfinite([v["ppl"] for v in ext.values()]).all()
    # The lengths from lm_chunked_from on go through the KV cache in chunks (384 does not divide
    # 2,048): the same numbers, and the cost says which lengths were chunked.
    chunked, chunked_cost = lm_family.timed_extrapolation(run, (1, 4, 32), max_tokens=2049, chunked_from=4,
                                                          chunk_size=384)
    for n in ext:
        assert chunked[n]["nll"] == pytest.approx(ext[n]["nll"], rel=1e-5), n
        assert chunked[n]["tokens"] == ext[n]["tokens"]
    assert [n for n, c in sorted(chunked_cost.items()) if c.get("chunk_size") == 384] == [256, 2048]


def test_the_cost_table_takes_every_row_and_seed_at_each_length():
    """Per length: how it was scored, the count of evaluations, the median and range of their
    seconds over rows and seeds, the row with the largest median, the largest peak memory."""
    costs = {"goat": {64: {"seconds": E([4.0, 6.0]), "peak_rss_mib": E([600.0, 650.0])},
                      65536: {"seconds": E([150.0, 430.0]), "peak_rss_mib": E([2100.0, 2188.0]),
                              "chunk_size": E([512.0, 512.0])}},
             "alibi": {64: {"seconds": E([5.0, 5.0]), "peak_rss_mib": E([610.0, 620.0])},
                       65536: {"seconds": E([1164.0, 3758.0]), "peak_rss_mib": E([2188.0, 2300.0]),
                               "chunk_size": E([512.0, 512.0])}},
             "rope": {64: {"seconds": 3.0, "peak_rss_mib": None}}}
    table = lm_family.cost_table(costs)
    assert table[4] == "| 64 | whole windows | 5 | 5 | 3-6 | goat (5) | 650 |"
    assert table[5] == "| 65536 | 512-query chunks | 4 | 797 | 150-3758 | alibi (2461) | 2300 |"
    assert len(table) == 6 and lm_family.cost_table({}) == []


def test_long_lengths_are_scored_in_chunks_and_only_the_lm_rows_change_settings():
    """Amended 2026-12-05 for memory: 128x and longer are scored through the KV cache in
    512-query chunks; every LM row has those lengths, so every LM row carries the setting, and
    the retrieval and toy rows' records stay valid."""
    assert (TINY.lm_chunked_from, TINY.lm_eval_chunk_size) == (128, 512)
    without = dataclasses.replace(TINY, lm_chunked_from=None)
    checked = 0
    for job in _jobs().values():
        settings, before = jobs_lib.eval_settings(job, TINY), jobs_lib.eval_settings(job, without)
        if job.kind == "lm":
            assert settings == {**before, "lm_chunked_from": 128, "lm_eval_chunk_size": 512}, job.name
            checked += 1
        else:
            assert settings == before, job.name
    assert checked > 10


def test_the_report_figures_put_encodings_variants_and_layout_rows_in_their_own_panels(tmp_path):
    """Twenty rows in one panel could not be told apart: the encodings, their variants beside
    goat and rope, and the layout rows beside goat each get a panel, every row in one of them."""
    labels = [j.label for j in _jobs().values() if j.kind == "lm" and j.seed_offset == 0]
    panels = lm_family.figure_panels(labels, TINY.layout_checks)
    by_title = dict(panels)
    assert [t for t, _ in panels] == ["position encodings", "variants, beside the rows they vary",
                                      "bf16 layout rows, beside float32 goat"]
    assert by_title["position encodings"] == [l for l in labels if "+" not in l]
    assert by_title["variants, beside the rows they vary"][:2] == ["goat", "rope"]
    assert "rope+yarn" in by_title["variants, beside the rows they vary"]
    assert by_title["bf16 layout rows, beside float32 goat"] == [
        "goat", "goat+bf16", "goat+bf16+lane_aligned", "goat+bf16+h64", "goat+bf16+h64+lane_aligned"]
    assert {l for _, ls in panels for l in ls} == set(labels)
    assert lm_family.figure_panels(["goat", "rope"], TINY.layout_checks) is None  # one group: one panel
    ext = {l: {64: E([5.0 + i, 5.5 + i]), 4096: E([6.0, 60.0])} for i, l in enumerate(labels)}
    path = lm_family.plots.plot_perplexity_vs_length(ext, str(tmp_path / "ppl.png"), train_len=64, panels=panels)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
