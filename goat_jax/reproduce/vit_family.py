"""The vision family of the report harness (``experiments.reproduce``): ViTs on Fashion-MNIST
(configs/vit_tiny.py) with every 2D position encoding, evaluated zero-shot at larger input
resolutions.

Per run (cached with the run's other evaluations): top-1 and loss at each ``Suite.vit_scales``
multiple of the training resolution (goat_jax.eval.vision.evaluate_vision_run, what
``experiments.evaluate --evals resolution`` runs), train images/s from its metrics.jsonl, and
the figure inputs in ``WORKDIR/reproduce_vision.npz``: the last block's CLS attention on the
first eval images at the smallest and largest resolution, and for GOAT block 0's centre-patch
log-prior on a 32 x 32 grid and its shift-invariance error per block.

The report section: tables of top-1 and loss by resolution, images/s, the figures, and the
paper's three vision claims with numbers (thresholds in :func:`vision_checks`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from goat_jax import cli
from goat_jax.config.files import load_config
from goat_jax.eval import canvas as canvas_lib
from goat_jax.eval import vision
from goat_jax.reproduce import layout, records, stats
from goat_jax.reproduce.suites import Job, LayoutCheck, Suite
from goat_jax.tasks import vit as vit_task
from goat_jax.train import run as run_lib

PRIOR_GRID = (32, 32)  # the centre-patch log-prior figure's key grid (as experiments.evaluate)
SHIFT_TOLERANCE = 0.10  # shift-invariant: a shifted prior moves by <= 10% of its range (see vision_checks)
CLS_IMAGES = 4  # eval images in the CLS attention figure


def resolutions_for(config, scales: Sequence[float]) -> list[int]:
    """The evaluation resolutions ``scale x image_size`` of a ViT config (e.g. 28 px: 1, 1.5, 2,
    3 -> 28, 42, 56, 84), each a multiple of the patch size; ValueError naming the scale when
    one is not (the grid must be whole for every encoding)."""
    model = vit_task.model_config(config)  # resolves a preset ('s16': 224 px, patch 16)
    size, patch = int(model.image_size), int(model.patch_size)
    out = []
    for s in scales:
        r = s * size
        if r != int(r) or int(r) % patch:
            raise ValueError(f"vit_scales: {s} x {size} px = {r:g} px is not a multiple of the patch "
                             f"size {patch}; choose scales that give whole patch grids.")
        out.append(int(r))
    return out


def evaluate_vit_job(job: Job, suite: Suite) -> dict[str, Any]:
    """The evaluations of one ViT ``job`` (uncached; :func:`goat_jax.reproduce.jobs.evaluate`
    caches them):
    ``{'step', 'train_resolution', 'encoding', 'resolution': {r: {'top1', 'loss', 'images'}},
    'eval_images', 'images_per_sec', ...}``; writes ``WORKDIR/reproduce_vision.npz``."""
    config = load_config(job.spec, job.overrides)
    resolutions = resolutions_for(config, suite.vit_scales)
    entry, run, make_eval_at = vision.evaluate_vision_run(
        job.workdir, resolutions, num_eval_batches=suite.vit_eval_batches, log=cli.log)
    shown = (min(resolutions), max(resolutions))
    arrays = {}
    for r in shown:  # the first eval images: the same for every run (same data config and seed)
        images = next(make_eval_at(r))["image"][:CLS_IMAGES]
        arrays[f"images_{r}"] = images
        arrays[f"cls_{r}"] = vision.cls_attention_maps(run.model, run.params, images)
    cfg = run.model.config
    if suite.vit_canvas_scales:
        canvases = resolutions_for(config, suite.vit_canvas_scales)
        fill = canvas_lib.background_fill(run.config.data.mean, run.config.data.std)
        make_canvas = canvas_lib.make_canvas_eval(make_eval_at, int(cfg.image_size), int(cfg.patch_size), fill,
                                                  seed=int(run.config.seed) - job.seed_offset)  # same per seed
        entry["canvas"] = vision.evaluate_resolutions(run.model, run.params, make_canvas, canvases, cli.log)
        arrays[f"images_canvas_{max(canvases)}"] = next(make_canvas(max(canvases)))["image"][:CLS_IMAGES]
    if entry["encoding"] == "goat":
        arrays["centre_log_prior"] = vision.centre_log_prior(run.params, cfg, PRIOR_GRID)
        entry.update(prior_measures(job, cfg, suite))
    np.savez(os.path.join(job.workdir, "reproduce_vision.npz"), **arrays)
    entry["images_per_sec"] = run_lib.median_throughput(job.workdir)
    return entry


def prior_measures(job: Job, cfg, suite: Suite) -> dict[str, Any]:
    """GOAT's prior, per block: its kappa / u split (goat_jax/eval/canvas.py: ranges and the
    residual) on the training grid and on the largest evaluated grid, and the prior's range on
    the training grid at every kept checkpoint (how far it moved from its uniform start)."""
    train_grid = (int(cfg.image_size) // int(cfg.patch_size),) * 2
    scales = tuple(suite.vit_canvas_scales) + tuple(suite.vit_scales)
    big = (int(max(scales) * train_grid[0]),) * 2
    run = run_lib.load_run(job.workdir)
    parts = {name: [canvas_lib.prior_parts(vision.patch_log_prior(run.params, cfg, grid, layer=i))
                    for i in range(cfg.num_layers)] for name, grid in (("train", train_grid), ("large", big))}
    over_training = []
    for step in run_lib.checkpoint_steps(job.workdir):
        params = run.params if step == run.step else run_lib.load_run(job.workdir, step).params
        over_training.append({"step": int(step), "range_by_layer": [
            float(np.ptp(vision.patch_log_prior(params, cfg, train_grid, layer=i))) for i in range(cfg.num_layers)]})
    return {"prior_parts": {"train_grid": list(train_grid), "large_grid": list(big), **parts},
            "prior_over_training": over_training}


def setup_line(config: dict) -> str:
    """The resolved settings of a ViT run (its config.json) for the report's Setup section."""
    m = config["model"]
    return (f"{m['num_layers']} layer(s), d {m['embed_dim']}, {m['num_heads']} heads, patch "
            f"{m['patch_size']} at {m['image_size']} px, {config['num_train_steps']} steps x "
            f"{config['global_batch_size']} images, peak lr {config['optimizer']['learning_rate']}, "
            f"seed {config['seed']}")


def _runs(jobs: Sequence[Job], results: dict[str, dict], variants: bool = True) -> dict[str, dict]:
    """``{label: result}`` of the evaluated ViT runs, in plan order (``variants`` False: the
    encodings' rows only, without ``Suite.family_variants``' extra rows)."""
    return {j.label: results[j.name] for j in jobs if j.kind == "vit" and j.name in results
            and (variants or not j.variant)}


def _top1(entry: dict, r: int, key: str = "resolution") -> Optional[float]:
    v = entry.get(key, {}).get(str(r), entry.get(key, {}).get(r))
    return None if v is None else v["top1"]


def feeds_checks(job: Job, suite: Suite) -> bool:
    """Whether the vision checks read ``job``'s result: every encoding's ViT (GOAT's top-1 is
    compared with the best encoding's in :func:`vision_checks`) and the rows of ``suite``'s
    vision layout checks (:func:`layout_checks`). As every family's ``feeds_checks``
    (:data:`goat_jax.reproduce.jobs.FEEDS_CHECKS`)."""
    return job.kind == "vit" and (not job.variant or layout.feeds(job, suite))


def layout_checks(results: dict[str, dict], checks: Sequence[LayoutCheck]) -> list[stats.Check]:
    """The vision family's non-inferiority checks among ``checks`` (family 'vit'; docs/protocols.md,
    "Extrapolation to 1024x and the 64-wide layout"): the check's metric (top-1) by resolution,
    judged at the training resolution by :func:`goat_jax.reproduce.layout.judge`; the change shown
    beside it is on the canvas protocol's canvases when both rows have them (the object
    unchanged), else on the upsampled resolutions. A row without results is "not measured"."""
    def by_size(entry, key, metric):  # {resolution or canvas px: value}, None when not evaluated
        return {int(r): v[metric] for r, v in entry[key].items()} if entry and key in entry else None

    out = []
    for lc in layout.of_family(checks, "vit"):
        c, r = (results.get(f"vit/vit/{label}") for label in (lc.candidate, lc.reference))
        canvas = bool(c and r and "canvas" in c and "canvas" in r)
        shown = (by_size(c, "canvas", lc.metric), by_size(r, "canvas", lc.metric)) if canvas else None
        out.append(layout.judge(lc, by_size(c, "resolution", lc.metric), by_size(r, "resolution", lc.metric),
                                shown=shown, shown_where=" canvas" if canvas else "", unit="px"))
    return out


def vision_checks(jobs: Sequence[Job], results: dict[str, dict]) -> list[stats.Check]:
    """The paper's vision claims at this scale as :class:`goat_jax.reproduce.stats.Check` s
    (the verdict on the paired difference named in each, the fixed threshold as PASS/FAIL):

    * GOAT loses less top-1 than 'ape' from 1x to 2x the training resolution (points).
    * GOAT's top-1 at 1x is within 1 point of the best encoding's.
    * GOAT's prior is shift-invariant: for every block, moving query and key by the same
      number of patches changes the head-mean log-prior by at most :data:`SHIFT_TOLERANCE` of
      its range (goat_jax.eval.vision.shift_invariance_error; the relative part is invariant by
      construction, the learned sink u(j) is what can vary). Judged twice: on the training grid
      (shift: a quarter of it), where the prior was learned, and on a 16 x 16 grid (shift
      (3, 5)), where u(j) is extrapolated.
    """
    runs = _runs(jobs, results, variants=False)  # the encodings compared; extra rows have their own checks
    checks = []
    if not runs:
        return checks
    first = next(iter(runs.values()))
    r1 = int(first["train_resolution"])
    r2 = 2 * r1
    g, a = runs.get("goat"), runs.get("ape")
    if g and a and _top1(g, r2) is not None:
        dg, da = (_top1(g, r1) - _top1(g, r2)), (_top1(a, r1) - _top1(a, r2))
        checks.append(stats.judged(
            f"ViT: GOAT loses less top-1 than ape at 2x the training resolution ({r2} px)", dg < da,
            f"drop 1x -> 2x: GOAT {100 * dg:.2f} points, ape {100 * da:.2f} points", 100 * (dg - da), -1,
            "GOAT drop - ape drop (points)", ".2f"))
    if g and a and "canvas" in g and "canvas" in a and _top1(g, r2, "canvas") is not None:
        dg, da = (_top1(g, r1, "canvas") - _top1(g, r2, "canvas")), (_top1(a, r1, "canvas") - _top1(a, r2, "canvas"))
        checks.append(stats.judged(
            f"ViT canvas: GOAT loses less top-1 than ape on a 2x canvas ({r2} px, the object unchanged)", dg < da,
            f"drop 1x -> 2x canvas: GOAT {100 * dg:.2f} points, ape {100 * da:.2f} points", 100 * (dg - da), -1,
            "GOAT drop - ape drop (points)", ".2f"))
    if g and len(runs) > 1:
        best = max(runs, key=lambda k: _top1(runs[k], r1))
        gap = _top1(runs[best], r1) - _top1(g, r1)
        checks.append(stats.judged(
            f"ViT: GOAT top-1 at 1x ({r1} px) within 1 point of the best encoding", gap <= 0.01,
            f"GOAT {100 * _top1(g, r1):.2f}%, best {best} {100 * _top1(runs[best], r1):.2f}% "
            f"({100 * gap:.2f} points behind)", 100 * gap - 1, -1, f"{best} - GOAT - 1 (points)", ".2f"))
    if g and "shift_invariance_train_grid" in g:
        t = g["shift_invariance_train_grid"]
        errs = t["by_layer"]
        worst = stats.per_seed_max(errs)
        checks.append(stats.judged(
            f"ViT: GOAT's learned 2D prior is shift-invariant on the training grid "
            f"({t['grid'][0]}x{t['grid'][1]}, shift {tuple(t['shift'])}; max relative change <= "
            f"{SHIFT_TOLERANCE:g} in every block)", worst <= SHIFT_TOLERANCE,
            "per block: " + ", ".join(f"{e:.3f}" for e in errs), worst - SHIFT_TOLERANCE, -1,
            f"worst block - {SHIFT_TOLERANCE:g}"))
    if g and "shift_invariance_by_layer" in g:
        errs = g["shift_invariance_by_layer"]
        worst = stats.per_seed_max(errs)
        checks.append(stats.judged(
            f"ViT: GOAT's learned 2D prior is shift-invariant on a larger grid (16x16, shift "
            f"(3, 5); max relative change <= {SHIFT_TOLERANCE:g} in every block)", worst <= SHIFT_TOLERANCE,
            "per block: " + ", ".join(f"{e:.3f}" for e in errs), worst - SHIFT_TOLERANCE, -1,
            f"worst block - {SHIFT_TOLERANCE:g}"))
    return checks


def vision_section(jobs: Sequence[Job], results: dict[str, dict], out: str) -> list[str]:
    """The vision section (markdown lines); writes its PNGs into ``out``."""

    runs = _runs(jobs, results)
    if not runs:
        return []
    first = next(iter(runs.values()))
    r1 = int(first["train_resolution"])
    rs = sorted({int(r) for e in runs.values() for r in e["resolution"]})
    head = " | ".join(f"{r} px ({r / r1:g}x)" for r in rs)
    md = ["## Vision: zero-shot resolution extrapolation (ViT on Fashion-MNIST)", "",
          f"Top-1 (%) on the first {first['eval_images']:,} test images, the same for every encoding and "
          f"resolution (resize the shorter side to r * 256/224, centre crop r); trained at {r1} px "
          f"only. Images/s: median training throughput from the run's metrics.jsonl (a shared "
          f"CPU: read side by side with care).", "",
          f"| encoding | step | {head} | top-1 lost 1x -> 2x (points) | train images/s |",
          "|---|---:|" + "---:|" * len(rs) + "---:|---:|"]
    for label, e in runs.items():
        cells = [f"{100 * t:.2f}" if (t := _top1(e, r)) is not None else "-" for r in rs]
        t2 = _top1(e, 2 * r1)
        drop = f"{100 * (_top1(e, r1) - t2):.2f}" if t2 is not None else "-"
        ips = e.get("images_per_sec")
        md.append(f"| {label} | {e['step']} | " + " | ".join(cells) + f" | {drop} | "
                  f"{'-' if ips is None else f'{ips:,.0f}'} |")
    md += ["", "Loss (nats per image) by resolution:", "",
           f"| encoding | {head} |", "|---|" + "---:|" * len(rs)]
    for label, e in runs.items():
        res = {int(k): v for k, v in e["resolution"].items()}
        md.append(f"| {label} | " + " | ".join(f"{res[r]['loss']:.4f}" if r in res else "-" for r in rs) + " |")
    md += ["", "![top-1 vs resolution](vit_resolution.png)", ""]
    vision.plot_resolutions({k: {int(r): v for r, v in e["resolution"].items()} for k, e in runs.items()},
                            os.path.join(out, "vit_resolution.png"), r1)
    md += _canvas_section(runs, r1, out)

    # The figures draw one run's arrays (the row's own job: seed +0), while every number in the
    # tables is over the seeds; the captions say so.
    drawn = {j.label: j for j in jobs if j.kind == "vit" and j.label in runs
             and os.path.exists(records.run_file(j, "reproduce_vision.npz"))}
    arrays = {label: dict(np.load(records.run_file(j, "reproduce_vision.npz"))) for label, j in drawn.items()}
    if "goat" in arrays and "centre_log_prior" in arrays["goat"]:
        g = runs["goat"]
        grid = arrays["goat"]["centre_log_prior"].shape
        vision.plot_log_prior(arrays["goat"]["centre_log_prior"], os.path.join(out, "vit_prior_goat.png"),
                              title=f"GOAT block 0: centre-patch log-prior, {grid[0]}x{grid[1]} grid")
        spread = float(np.ptp(arrays["goat"]["centre_log_prior"]))
        md += [f"### GOAT's learned 2D prior (block 0, head mean, centre patch's query over a "
               f"{grid[0]} x {grid[1]} key grid; trained on {r1 // int(_patch(jobs))} x "
               f"{r1 // int(_patch(jobs))})", "", "![GOAT prior](vit_prior_goat.png)", "",
               f"The seed +{drawn['goat'].seed_offset} run's prior, trained from `prior_init='uniform'`; its range "
               f"on this grid (max - min of the head-mean log-prior: how strongly it prefers some keys "
               f"over others) is {spread:.3f} nats in that run (the prior-split table above gives "
               f"the ranges over seeds).", "",
               "Shift-invariance error per block (largest change of the head-mean log-prior when query "
               "and key move by the same patches, relative to its range over the grid; 0 = exactly "
               "shift-invariant): on a 16 x 16 grid, shift (3, 5): "
               + ", ".join(f"{x:.3f}" for x in g.get("shift_invariance_by_layer", []))
               + "; on the training grid: " + ", ".join(
                   f"{x:.3f}" for x in g.get("shift_invariance_train_grid", {}).get("by_layer", [])), ""]
    pair = [k for k in ("goat", "ape") if k in arrays]
    if pair:
        shown = sorted(int(k.split("_")[1]) for k in arrays[pair[0]] if k.startswith("cls_"))
        vision.plot_cls_attention({r: arrays[pair[0]][f"images_{r}"] for r in shown},
                                  {k: {r: arrays[k][f"cls_{r}"] for r in shown} for k in pair},
                                  os.path.join(out, "vit_cls_attention.png"))
        md += [f"### CLS attention ({' vs '.join(pair)}, last block, head mean; the same "
               f"{CLS_IMAGES} test images at {shown[0]} and {shown[-1]} px; the seed +{drawn[pair[0]].seed_offset} "
               f"runs)", "",
               "![CLS attention](vit_cls_attention.png)", ""]
    return md


def _canvas_section(runs: dict[str, dict], r1: int, out: str) -> list[str]:
    """The canvas protocol's table and figure, and GOAT's prior split into kappa and u, with
    its range at every kept checkpoint (empty when the runs have no canvas evaluation)."""
    with_canvas = {k: e for k, e in runs.items() if "canvas" in e}
    if not with_canvas:
        return []
    cs = sorted({int(c) for e in with_canvas.values() for c in e["canvas"]})
    md = ["## Vision, canvas protocol: the same object on a larger canvas (docs/protocols.md)", "",
          "Top-1 (%) with each test image pasted unchanged at a random patch-aligned offset onto a "
          "black canvas (the same offsets for every run): only the number of patches and the object's "
          "position change.", "",
          "| encoding | " + " | ".join(f"{c} px canvas ({c / r1:g}x)" for c in cs)
          + " | top-1 lost 1x -> 2x (points) |",
          "|---|" + "---:|" * len(cs) + "---:|"]
    for label, e in with_canvas.items():
        cells = [f"{100 * t:.2f}" if (t := _top1(e, c, "canvas")) is not None else "-" for c in cs]
        t2 = _top1(e, 2 * r1, "canvas")
        drop = f"{100 * (_top1(e, r1, 'canvas') - t2):.2f}" if t2 is not None else "-"
        md.append(f"| {label} | " + " | ".join(cells) + f" | {drop} |")
    md += ["", "![top-1 vs canvas](vit_canvas.png)", ""]
    vision.plot_resolutions({k: {int(c): v for c, v in e["canvas"].items()} for k, e in with_canvas.items()},
                            os.path.join(out, "vit_canvas.png"), r1, xlabel="canvas size (px)")
    g = runs.get("goat", {})
    parts = g.get("prior_parts")
    if parts:
        md += ["### GOAT's prior split into kappa(q - k) and u(k) (per block; nats; goat_jax/eval/canvas.py)", "",
               "kappa depends on the offset alone, so it is shift-invariant by construction; u is the "
               "key-only sink term, the part that can break shift invariance. Ranges are max - min "
               "over the grid; the residual is the largest part of the prior that the split leaves.", "",
               "| block | prior range (train grid) | kappa range | u range (train grid "
               f"{parts['train_grid'][0]}x{parts['train_grid'][1]}) | u range ({parts['large_grid'][0]}x"
               f"{parts['large_grid'][1]} grid) | residual |", "|---|---:|---:|---:|---:|---:|"]
        for i, (t, big) in enumerate(zip(parts["train"], parts["large"])):
            md.append(f"| {i} | {t['prior_range']:.3f} | {t['kappa_range']:.3f} | {t['u_range']:.3f} | "
                      f"{big['u_range']:.3f} | {max(t['residual_max'], big['residual_max']):.2g} |")
        md.append("")
    over = g.get("prior_over_training")
    if over:
        md += ["Range of GOAT's head-mean log-prior on the training grid at each kept checkpoint (per block; "
               "0 at the uniform init): " + "; ".join(
                   f"step {o['step']}: " + ", ".join(f"{x:.3f}" for x in o["range_by_layer"]) for o in over), ""]
    return md


def _patch(jobs: Sequence[Job]) -> int:
    """The patch size of the first ViT run (from the config it wrote)."""
    job = next(j for j in jobs if j.kind == "vit")
    return int(records.read_config(job).model.patch_size)
