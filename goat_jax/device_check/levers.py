"""Sections 6 and 6b of the device check: the 125M train step's throughput levers,
GOAT beside RoPE, one lever changed at a time from one stated base.

Base (:func:`goat_jax.device_check.train_step.base_config`): the Llama-style 125M (12 x 768,
12 heads, SwiGLU 2560, 32k vocabulary), bf16 compute, float32 weights and AdamW state, scanned
layers, no remat, the loss from the full float32 logits, no XLA GPU options, 8 x 2,048 tokens
per step, the official q/k layout: 297k tokens/s, MFU 0.29 for GOAT on one H200
(benchmarks/gpu.md). Each row changes one thing (the ``change`` column); the candidate row
changes the several that are expected to win together, for GOAT and RoPE, so the GOAT / RoPE
step-time ratio is read at the base and at the candidate.

A step compiles in ~20-60 s on a GPU, so one section holds few rows, ordered by what the issue
needs first; rows that would start after the section's share of the time say so (``--sections
6b`` runs the rest on another lease):

* 6: base GOAT, base RoPE, candidate GOAT, candidate RoPE, then 4x tokens per step and the
  chunked loss alone (GOAT).
* 6b (GOAT): XLA's GPU options alone, unrolled layers, remat ('dots_no_batch'), the official
  50,257-token vocabulary unpadded and padded to 50,304 (a multiple of 128), and
  ``qk_layout='lane_aligned'`` (q/k 64 wide, section 5's fast path).
"""

from __future__ import annotations

import time
from typing import Dict, List, Tuple

from goat_jax.device_check import Check, Section
from goat_jax.device_check.report import error_text, table
from goat_jax.device_check.train_step import StepVariant, base_config, measure_step

LOSS_CHUNK = 256  # positions per chunk of the chunked loss: 8 x 256 x 32k float32 logits = 256 MiB at once
BATCH_FACTOR = 4  # the "tokens per step" lever: 4x the base batch (32 x 2,048 on the GPU)
SHARE_S = {"6": 240.0, "6b": 240.0}  # each section's share of the check's time (seconds)
COMPILE_RESERVE_S = 60.0  # on a GPU a step compiles in ~20-60 s: no row starts with less time left


def candidate(dry_run: bool) -> Dict:
    """The settings expected to win together (one row per encoding): 4x tokens per step, the
    chunked loss, unrolled layers and XLA's GPU options (MaxText's H100 settings unroll and set
    them; llm.c never holds the full logits)."""
    return dict(batch_factor=BATCH_FACTOR, loss_chunk_size=8 if dry_run else LOSS_CHUNK, scan_layers=False,
                gpu_xla_flags=True)


def _variant(name: str, encoding: str, dry_run: bool, batch_factor: int = 1, gpu_xla_flags: bool = False,
             **model) -> StepVariant:
    cfg, batch, seq = base_config(dry_run, position_encoding=encoding, **model)
    return StepVariant(name, encoding, cfg, batch * batch_factor, seq, gpu_xla_flags)


def variants(section: str, dry_run: bool) -> List[Tuple[str, StepVariant]]:
    """``(change, variant)`` rows of ``section`` ('6' or '6b'), in the order they run."""
    chunk = 8 if dry_run else LOSS_CHUNK
    if section == "6":
        cand = candidate(dry_run)
        return [("base", _variant("base", "goat", dry_run)),
                ("base", _variant("base", "rope", dry_run)),
                ("candidate: " + _describe(cand), _variant("candidate", "goat", dry_run, **cand)),
                ("candidate: " + _describe(cand), _variant("candidate", "rope", dry_run, **cand)),
                (f"tokens per step x{BATCH_FACTOR}", _variant("batch", "goat", dry_run, batch_factor=BATCH_FACTOR)),
                (f"chunked loss ({chunk} positions)", _variant("chunked", "goat", dry_run, loss_chunk_size=chunk))]
    official_vocab = 257 if dry_run else 50_257  # GPT-2's 50,257 (the official C4 recipe), odd
    return [("XLA GPU options (gpu_xla_flags)", _variant("flags", "goat", dry_run, gpu_xla_flags=True)),
            ("unrolled layers (scan_layers=False)", _variant("unrolled", "goat", dry_run, scan_layers=False)),
            ("remat, policy dots_no_batch", _variant("remat", "goat", dry_run, remat=True,
                                                     remat_policy="dots_no_batch")),
            (f"vocabulary {official_vocab}, unpadded (the next row's reference)", _variant("vocab", "goat", dry_run, vocab_size=official_vocab)),
            (f"vocabulary {official_vocab} padded to a multiple of 128",
             _variant("vocab_pad", "goat", dry_run, vocab_size=official_vocab, vocab_pad_multiple=128)),
            ("qk_layout='lane_aligned'", _variant("lane_aligned", "goat", dry_run, qk_layout="lane_aligned"))]


def _describe(settings: Dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.items())


def lever_rows(section: str, dry_run: bool, steps: int, deadline: float) -> List[List]:
    """Measures ``section``'s variants (one row each, GOAT / RoPE step-time ratio where both ran)."""
    rows, ms = [], {}
    reserve = 0.0 if dry_run else COMPILE_RESERVE_S  # a row started later would end past the deadline
    for change, var in variants(section, dry_run):
        head = [change, var.encoding, f"{var.batch} x {var.seq}"]
        if time.time() > deadline - reserve:
            rows.append(head + [None] * 6 + ["skipped: time budget (rerun with --sections " + section + ")"])
            continue
        try:
            r = measure_step(var, steps, deadline)
        except Exception as err:  # noqa: BLE001 -- e.g. out of memory: record, go on
            rows.append(head + [None] * 6 + [error_text(err)])
            continue
        ms[(var.name, var.encoding)] = r["ms"]
        rows.append(head + [r["compile_s"], r["ms"], r["tokens_s"], r["mfu"], r["planned_gib"], None,
                            r["note"] or (f"loss {r['loss']:.3f}, {r['steps']} steps" if r["loss"] is not None else "")])
    for row, (_, var) in zip(rows, variants(section, dry_run)):
        goat, rope = ms.get((var.name, "goat")), ms.get((var.name, "rope"))
        if var.encoding == "goat" and goat and rope:
            row[8] = goat / rope
    return rows


HEAD = ["change from the base", "encoding", "batch x seq", "compile s", "ms/step", "tokens/s", "MFU", "planned GiB",
        "GOAT / RoPE step time", "note"]


def _run(section: str, check: Check) -> None:
    rows = lever_rows(section, check.dry_run, 2 if check.dry_run else 20, check.section_deadline(SHARE_S[section]))
    base = ("base: " + ("tiny float32 LM (dry run)" if check.dry_run else
                        "Llama-style 125M (12 x 768, 12 heads, SwiGLU 2560, vocabulary 32,000), bf16 compute, "
                        "float32 weights, scanned layers, no remat, full float32 logits, no XLA GPU options, "
                        "8 x 2,048 tokens, qk_layout='official'"))
    lines = [base + "; MFU = 6N + 12 L H T FLOPs per token (padding not counted) over the dense bf16 peak.", ""]
    if not check.gpu:
        lines = ["Dry run on CPU: the code paths, not a measurement (XLA's GPU options are not applied on a CPU).", ""] + lines
    title = {"6": "6. 125M train step levers (a): base, candidate, tokens per step, chunked loss; GOAT beside RoPE",
             "6b": "6b. 125M train step levers (b): XLA GPU options, unrolled layers, remat, padded vocabulary, "
                   "64-wide q/k layout (GOAT)"}[section]
    check.report.section(title, lines + table(HEAD, rows))


LEVERS = Section("6", "6. 125M train step levers (a)", lambda check: _run("6", check))
LEVERS_B = Section("6b", "6b. 125M train step levers (b)", lambda check: _run("6b", check))
