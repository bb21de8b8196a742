"""Vision evaluations: top-1 across input resolutions, and the learned 2D prior as an image.

* :func:`evaluate_resolutions` -- top-1 and loss of a trained ViT at each evaluation
  resolution (the grid follows the input: GOAT, 'sincos2d' and 'rope2d' extrapolate with the
  same patch step, 'ape' resizes its table bicubically).
* :func:`centre_log_prior` -- a GOAT layer's head-averaged log-prior of the centre patch's query
  over every key of a (larger) grid: the paper's panel showing a shift-invariant prior learned
  from a uniform start.
* :func:`cls_attention_maps` -- the last layer's CLS attention over the patches (paper panel:
  GOAT vs 'ape' at high resolution).
* :func:`plot_resolutions` (with :func:`dodge`), :func:`plot_log_prior`, :func:`plot_cls_attention` -- the figures
  (matplotlib, Agg).

Shape legend: B batch, r resolution, h x w patch grid, N heads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Dict, Optional, Tuple

import flax
import jax
import jax.numpy as jnp
import numpy as np

from goat_jax import _extras
from goat_jax import prior as prior_lib
from goat_jax.layers.goat import GoatPrior
from goat_jax.models.vit import ViTConfig


def evaluate_resolutions(model, params, make_eval_at: Callable[[int], Iterator[Dict[str, np.ndarray]]],
                         resolutions: Sequence[int], log: Callable[[str], None] = print) -> Dict[int, Dict[str, float]]:
    """Top-1 and mean cross-entropy of ``model`` on the eval split at each resolution.

    Args:
      model: a :class:`goat_jax.models.vit.ViT`; params: its 'params' collection.
      make_eval_at: ``resolution -> finite iterator of eval batches`` (``image``, ``label``,
        ``weights``), e.g. :func:`goat_jax.data.images.make_image_datasets`'s second output.
      resolutions: pixels per side, each divisible by the model's patch size.
    Returns:
      ``{r: {'top1': fraction, 'loss': nats per image, 'images': count}}``.
    """
    patch = model.config.patch_size
    bad = [r for r in resolutions if r % patch]
    if bad:
        raise ValueError(f"resolutions {bad} are not divisible by the model's patch_size={patch}.")

    @jax.jit
    def sums(params, batch):
        logits = model.apply({"params": params}, batch["image"])  # [B, K] float32
        w = batch["weights"].astype(jnp.float32)
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["label"][:, None], axis=1)[:, 0]
        hit = (jnp.argmax(logits, -1) == batch["label"]).astype(jnp.float32)
        return jnp.sum(hit * w), jnp.sum(ce * w), jnp.sum(w)

    out = {}
    for r in resolutions:
        correct = loss = count = 0.0
        for batch in make_eval_at(int(r)):
            c, l, n = sums(params, {k: batch[k] for k in ("image", "label", "weights")})
            correct, loss, count = correct + float(c), loss + float(l), count + float(n)
        if not count:
            raise ValueError(f"the eval split gave no images at resolution {r}.")
        out[int(r)] = {"top1": correct / count, "loss": loss / count, "images": int(count)}
        log(f"resolution {r}: top-1 {100 * out[int(r)]['top1']:.2f}% loss {out[int(r)]['loss']:.4f} "
            f"({int(count)} images)")
    return out


def _prior_module(cfg: ViTConfig) -> GoatPrior:
    return GoatPrior(cfg.prior.for_heads(cfg.num_heads, cfg.num_heads))


def patch_log_prior(params: Mapping[str, Any], cfg: ViTConfig, grid: Tuple[int, int], layer: int = 0) -> np.ndarray:
    """Head-averaged log-prior between every pair of patches of ``grid`` (CLS present in the
    sequence, as in the model, then dropped): [h, w, h, w] float64, (query row, col, key row, col)."""
    if cfg.position_encoding != "goat":
        raise ValueError(f"the log-prior needs a GOAT ViT, got position_encoding={cfg.position_encoding!r}.")
    prior_params = flax.core.meta.unbox(params)[f"block_{layer}"]["attention"]["prior"]
    pos = prior_lib.positions_2d(grid, has_cls=True)
    log_prior = _prior_module(cfg).apply({"params": prior_params}, pos, pos, False)  # [1, N, L, L]
    mean = np.asarray(log_prior[0], np.float64).mean(axis=0)[1:, 1:]  # [h w, h w], CLS dropped
    return mean.reshape(tuple(grid) + tuple(grid))


def centre_log_prior(params: Mapping[str, Any], cfg: ViTConfig, grid: Tuple[int, int] = (32, 32),
                     layer: int = 0) -> np.ndarray:
    """Head-averaged GOAT log-prior ``kappa(p_c - p_j) + u(j)`` of the centre patch's query over
    every patch key of ``grid``, from block ``layer``'s prior: [h, w] float64 (the paper's panel)."""
    return patch_log_prior(params, cfg, grid, layer)[grid[0] // 2, grid[1] // 2]


def shift_invariance_error(params: Mapping[str, Any], cfg: ViTConfig, grid: Tuple[int, int] = (16, 16),
                           layer: int = 0, shift: Tuple[int, int] = (3, 5)) -> float:
    """How far a layer's learned prior is from shift-invariant over the patches: the largest
    change of ``log_prior(q, k)`` when query and key both move by ``shift`` (within the grid),
    relative to the prior's range over the grid. The Fourier part kappa is exactly invariant;
    what this measures is the key-only sink ``u(j)``, which depends on the key's sequence index."""
    a, b = shift
    if not (0 <= a < grid[0] and 0 <= b < grid[1]):
        raise ValueError(f"shift={shift} must fit inside grid={grid}.")
    p = patch_log_prior(params, cfg, grid, layer)
    h, w = grid
    base = p[:h - a, :w - b, :h - a, :w - b]
    moved = p[a:, b:, a:, b:]
    spread = float(p.max() - p.min())
    return float(np.abs(moved - base).max() / spread) if spread else 0.0


def cls_attention_maps(model, params, images: np.ndarray, layer: Optional[int] = None) -> np.ndarray:
    """Head-averaged attention of the CLS query over the patches in block ``layer`` (default:
    the last), read from the layer's sown probabilities (the 'dense' kernel materializes them).

    Args:
      images: [B, r, r, Ch] normalized images at any resolution divisible by the patch size.
    Returns:
      [B, h, w] float64 maps (each sums to 1 minus the CLS-to-CLS mass).
    """
    cfg = model.config
    layer = cfg.num_layers - 1 if layer is None else layer
    dense = model.clone(plan=model.plan.replace(implementation="dense"))
    _, state = jax.jit(lambda p, x: dense.apply({"params": p}, x, mutable=["intermediates"]))(params, images)
    probs = state["intermediates"][f"block_{layer}"]["attention"]["attention_probs"][0]  # [B, N, L, L]
    grid = (images.shape[1] // cfg.patch_size, images.shape[2] // cfg.patch_size)
    return np.asarray(probs[:, :, 0, 1:], np.float64).mean(axis=1).reshape((-1,) + grid)


def plot_cls_attention(images: Mapping[int, np.ndarray], maps: Mapping[str, Mapping[int, np.ndarray]],
                       path: str) -> None:
    """One row per image: the image, then each run's CLS map at each resolution."""
    with _extras.imports(__name__):
        import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = sorted(images)
    cols = [(label, r) for label in maps for r in rs]
    n = images[rs[0]].shape[0]
    fig, axes = plt.subplots(n, 1 + len(cols), figsize=(1.6 * (1 + len(cols)), 1.6 * n), squeeze=False)
    for i in range(n):
        img = images[rs[-1]][i]
        axes[i, 0].imshow(img[..., 0] if img.shape[-1] == 1 else (img - img.min()) / (np.ptp(img) or 1),
                          cmap="gray" if img.shape[-1] == 1 else None)
        for j, (label, r) in enumerate(cols, start=1):
            axes[i, j].imshow(maps[label][r][i], cmap="inferno")
            if i == 0:
                axes[i, j].set_title(f"{label} @ {r}px", fontsize=7)
    for ax in axes.ravel():
        ax.set_xticks([])
        ax.set_yticks([])
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def dodge(n_lines: int, xs: Sequence[float], with_bars: bool) -> list[float]:
    """x offsets that draw ``n_lines`` lines with error bars a little apart, centred on the
    true x (each line at most 1/10 of the smallest gap between ``xs`` away); all 0 without
    bars, where nothing overlaps that a reader must tell apart."""
    xs = sorted(set(xs))
    if not with_bars or n_lines < 2 or len(xs) < 2:
        return [0.0] * n_lines
    step = min(b - a for a, b in zip(xs, xs[1:])) / 5 / (n_lines - 1)
    return [(i - (n_lines - 1) / 2) * step for i in range(n_lines)]


def plot_resolutions(results: Mapping[str, Mapping[int, Mapping[str, float]]], path: str,
                     train_resolution: Optional[int] = None,
                     xlabel: str = "evaluation resolution (px)") -> None:
    """Top-1 (%) against evaluation resolution (or canvas size: ``xlabel``), one line per run,
    with 95% error bars where a value carries a ``half_width`` (a mean over seeds); a dotted
    line marks the training resolution. With error bars the runs are drawn a little apart
    along x, so that overlapping bars stay readable (the points are at the ticks' sizes)."""
    with _extras.imports(__name__):
        import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # goat_jax.eval.plots needs matplotlib when imported: imported here, so this module (the
    # ViT evaluations) stays importable without the plotting extra, as its other figures.
    from goat_jax.eval.plots import error_bars  # pylint: disable=g-import-not-at-top

    fig, ax = plt.subplots(figsize=(5, 3.5))
    all_rs = sorted({int(r) for by_res in results.values() for r in by_res})
    with_bars = any(any(error_bars([v["top1"] for v in by_res.values()])) for by_res in results.values())
    for (label, by_res), dx in zip(results.items(), dodge(len(results), all_rs, with_bars)):
        rs = sorted(int(r) for r in by_res)
        top1 = [by_res[r]["top1"] for r in rs]
        ax.errorbar([r + dx for r in rs], [100 * t for t in top1], yerr=[100 * e for e in error_bars(top1)],
                    marker="o", capsize=3, label=label)
    if train_resolution:
        ax.axvline(train_resolution, color="gray", linestyle=":", linewidth=1)
    ax.set_xticks(all_rs)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("top-1 (%)")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def plot_log_prior(grid_values: np.ndarray, path: str, title: str = "") -> None:
    """The centre patch's log-prior over the key grid as an image."""
    with _extras.imports(__name__):
        import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4, 3.5))
    im = ax.imshow(grid_values, cmap="viridis")
    h, w = grid_values.shape
    ax.plot([w // 2], [h // 2], marker="+", color="red")
    fig.colorbar(im, ax=ax, label="log-prior (head mean)")
    ax.set_title(title or f"centre-patch log-prior, {h}x{w} grid", fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def evaluate_vision_run(workdir: str, resolutions: Sequence[int], *, batch_size: Optional[int] = None,
                        num_eval_batches: Optional[int] = None, log: Callable[[str], None] = print):
    """Top-1 and loss of one ViT run (a workdir of ``experiments.train`` with ``config.task =
    'vit'``, read-only) at each resolution, plus :func:`shift_invariance_error` of every block's
    prior for GOAT runs.

    Args:
      batch_size: images per eval batch (default: the run's ``global_batch_size``).
      num_eval_batches: eval batches per resolution (default: the run's
        ``data.num_eval_batches``; 0: the whole split).
    Returns:
      ``(entry, run, make_eval_at)``: ``entry`` = ``{'step', 'train_resolution', 'encoding',
      'resolution': {r: {'top1', 'loss', 'images'}}, 'eval_images'}`` (and for GOAT
      ``'shift_invariance_error'`` of block 0 and ``'shift_invariance_by_layer'`` on a 16 x 16
      grid, shift (3, 5), and ``'shift_invariance_train_grid'``: ``{'grid', 'shift',
      'by_layer'}`` on the training grid, shift a quarter of it); the loaded
      run and its ``resolution -> eval batches`` function, for figures on the same images.
    """
    from goat_jax.data import images
    from goat_jax.train import run as run_lib

    run = run_lib.load_run(workdir)
    if run.config.task != "vit":
        raise ValueError(f"--evals resolution needs a ViT run (config.task='vit'); {workdir} has task "
                         f"{run.config.task!r}.")
    data = run.config.data
    if num_eval_batches is not None:
        data = data.copy_and_resolve_references()
        data.num_eval_batches = int(num_eval_batches)
    _, make_eval_at, _ = images.make_image_datasets(data, global_batch_size=batch_size or run.config.global_batch_size,
                                                    seed=run.config.seed, process_index=0, process_count=1)
    cfg = run.model.config
    by_res = evaluate_resolutions(run.model, run.params, make_eval_at, resolutions, log)
    entry = {"step": run.step, "train_resolution": cfg.image_size, "encoding": cfg.position_encoding,
             "resolution": by_res, "eval_images": min(v["images"] for v in by_res.values())}
    if cfg.position_encoding == "goat":
        errors = [shift_invariance_error(run.params, cfg, layer=i) for i in range(cfg.num_layers)]
        entry["shift_invariance_error"] = errors[0]
        entry["shift_invariance_by_layer"] = errors
        # The same on the training grid, where the prior was learned (shift: a quarter of it).
        grid = (cfg.image_size // cfg.patch_size,) * 2
        shift = (max(1, grid[0] // 4), max(1, grid[1] // 4))
        entry["shift_invariance_train_grid"] = {"grid": list(grid), "shift": list(shift), "by_layer": [
            shift_invariance_error(run.params, cfg, grid, layer=i, shift=shift) for i in range(cfg.num_layers)]}
    return entry, run, make_eval_at


def evaluate_vision_runs(workdirs: Sequence[str], labels: Sequence[str], resolutions: Sequence[int], out: str,
                         batch_size: Optional[int] = None, log: Callable[[str], None] = print) -> Dict[str, Any]:
    """The ``--evals resolution`` evaluation of ``experiments.evaluate`` on ViT runs.

    For each run (a workdir of ``experiments.train`` with ``config.task = 'vit'``, read-only):
    top-1 and loss on its eval split at each resolution; for GOAT runs also block 0's
    centre-patch log-prior on a 32 x 32 grid and :func:`shift_invariance_error`. Writes
    ``out/results.json`` (all numbers), ``out/results.md`` (runs side by side) and
    ``out/resolution.png``, ``out/cls_attention.png`` (the last layer's CLS attention on the
    same 4 eval images at the smallest and largest resolution, every run) and
    ``prior_<label>.png`` for GOAT runs. Eval batches hold
    ``batch_size`` images (default: the run's ``global_batch_size``); ``data.num_eval_batches``
    of the run's config limits them (0: the whole split).

    Returns:
      ``{label: {'resolution': {r: {...}}, 'train_resolution': int, 'step': int, ...}}``.
    """
    import json
    import os

    results: Dict[str, Any] = {}
    shown = (min(resolutions), max(resolutions))
    cls_images: Dict[int, np.ndarray] = {}
    cls_maps: Dict[str, Dict[int, np.ndarray]] = {}
    for workdir, label in zip(workdirs, labels):
        log(f"evaluating {label} ({workdir}) at {list(resolutions)} px")
        try:
            entry, run, make_eval_at = evaluate_vision_run(workdir, resolutions, batch_size=batch_size, log=log)
            for r in shown:  # the same first eval images for every run
                cls_images.setdefault(r, next(make_eval_at(r))["image"][:4])
            cls_maps[label] = {r: cls_attention_maps(run.model, run.params, cls_images[r]) for r in shown}
            if entry["encoding"] == "goat":
                os.makedirs(out, exist_ok=True)
                plot_log_prior(centre_log_prior(run.params, run.model.config, (32, 32)),
                               os.path.join(out, f"prior_{label}.png"),
                               title=f"{label}: block 0, centre patch, 32x32 grid")
        except BaseException:  # an error, Ctrl-C, SIGTERM: the runs evaluated before it are written first
            if results:
                _write_vision_outputs(results, {k: cls_maps[k] for k in results}, cls_images, out)
                log(f"kept the runs evaluated before it in {out}/results.json: {', '.join(results)}")
            raise
        results[label] = entry
    _write_vision_outputs(results, cls_maps, cls_images, out)
    return results


def _write_vision_outputs(results: Dict[str, Any], cls_maps: Dict[str, Dict[int, np.ndarray]],
                          cls_images: Dict[int, np.ndarray], out: str) -> None:
    """``out/results.json``, ``results.md``, ``resolution.png`` and ``cls_attention.png`` of the
    evaluated runs (:func:`evaluate_vision_runs`)."""
    import json
    import os

    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    rs = sorted({int(r) for e in results.values() for r in e["resolution"]})
    lines = ["| run | step | " + " | ".join(f"top-1 @ {r}" for r in rs) + " |",
             "|---|---:|" + "---:|" * len(rs)]
    for label, e in results.items():
        cells = [f"{100 * e['resolution'][r]['top1']:.2f}" if r in e["resolution"] else "" for r in rs]
        lines.append(f"| {label} | {e['step']} | " + " | ".join(cells) + " |")
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    train_res = next(iter(results.values()))["train_resolution"] if results else None
    plot_resolutions({k: v["resolution"] for k, v in results.items()}, os.path.join(out, "resolution.png"), train_res)
    plot_cls_attention(cls_images, cls_maps, os.path.join(out, "cls_attention.png"))
