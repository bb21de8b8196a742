"""Figures of the language experiments (matplotlib, Agg; each function writes one PNG).

* :func:`plot_toy_prior` -- the toy prior figure (paper Figure 1) for one layer/head: the
  learned key-only sink ``u(j)``, the relative prior ``kappa(lag)``, the row-centred causal
  log-prior matrix and the causal prior probabilities; :func:`plot_prior_grid` shows one of
  those panels for every layer/head.
* :func:`plot_perplexity_vs_length` -- perplexity against evaluation length, one line per
  position encoding (log y), from ``extrapolation.perplexity_by_length`` results; optionally
  in side-by-side panels (e.g. encodings, their variants, the bf16 layout rows).
* :func:`plot_passkey_accuracy` -- passkey accuracy against length, one line per model.
* :func:`plot_niah_heatmap` -- NIAH accuracy over (length x depth).

Figures are built on ``matplotlib.figure.Figure`` (no pyplot): no global state and no
interactive backend, so they work in headless jobs and threads. Every function returns the
path it wrote.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np

from goat_jax import _extras
with _extras.imports(__name__):  # optional packages: one-line error naming the extra
    from matplotlib.figure import Figure

from goat_jax.eval import sinks

PANELS = ("sink", "kappa", "centred", "probs")
_TITLES = {"sink": "key-only sink u(j)", "kappa": "relative prior kappa(lag)",
           "centred": "row-centred log-prior", "probs": "causal prior probabilities"}


def _save(fig: Figure, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def row_centred(log_prior: np.ndarray) -> np.ndarray:
    """[..., T, S] causal log-prior minus each row's mean over its visible keys ``j <= i``;
    NaN above the diagonal. Softmax ignores row constants, so this is what a row "means"."""
    lp = np.asarray(log_prior, np.float64)
    t = lp.shape[-2]
    visible = np.tril(np.ones((t, t), bool))
    masked = np.where(visible, lp[..., :t], np.nan)
    return masked - np.nanmean(masked, axis=-1, keepdims=True)


def _draw_panel(ax, fig: Figure, comp: Mapping[str, np.ndarray], head: int, panel: str,
                small: bool = False) -> None:
    """Draws one panel of :func:`plot_toy_prior` for ``head`` on ``ax``."""
    s = comp["u"].shape[-1]
    if panel == "sink":
        ax.plot(np.arange(s), comp["u"][head], marker="." if s <= 64 else None)
        ax.set_xlabel("key position j")
        ax.set_ylabel("u(j) [nats]")
    elif panel == "kappa":
        kap = comp["kappa"][head]
        ax.plot(np.arange(s), kap, marker="." if s <= 64 else None)
        peak = int(np.argmax(kap))
        ax.axvline(peak, color="tab:red", lw=0.8, ls="--")
        ax.set_xlabel(f"lag i - j (peak {peak})")
        ax.set_ylabel("kappa [nats]")
    elif panel in ("centred", "probs"):
        if panel == "centred":
            data = row_centred(comp["log_prior"][head])
            lim = np.nanmax(np.abs(data)) or 1.0
            im = ax.imshow(data, cmap="RdBu_r", vmin=-lim, vmax=lim, interpolation="nearest")
        else:
            data = np.where(np.tril(np.ones((s, s), bool)), comp["probs"][head], np.nan)
            im = ax.imshow(data, cmap="viridis", vmin=0.0, interpolation="nearest")
        ax.set_xlabel("key j")
        ax.set_ylabel("query i")
        if not small:
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    else:
        raise ValueError(f"panel={panel!r} must be one of {PANELS}.")


def plot_toy_prior(model, params: Any, path: str, *, layer: int = 0, head: int = 0,
                   seq_len: int = 32, title: Optional[str] = None) -> str:
    """The four-panel prior figure of one GOAT layer/head at positions ``0..seq_len-1``.

    Args:
      model: a GOAT ``TransformerLM`` (its config names the prior's shape).
      params: its params (``{'params': ...}`` or the inner dict; scanned layers work too).
    """
    comp = sinks.prior_components(model, params, layer, seq_len)
    if not 0 <= head < comp["u"].shape[0]:
        raise ValueError(f"head={head} is out of range for {comp['u'].shape[0]} heads.")
    fig = Figure(figsize=(16, 3.8))
    axes = fig.subplots(1, 4)
    for ax, panel in zip(axes, PANELS):
        _draw_panel(ax, fig, comp, head, panel)
        ax.set_title(_TITLES[panel])
    fig.suptitle(title or f"GOAT prior, layer {layer}, head {head}")
    fig.tight_layout()
    return _save(fig, path)


def plot_prior_grid(model, params: Any, path: str, *, panel: str = "probs",
                    seq_len: int = 32, title: Optional[str] = None) -> str:
    """One ``panel`` (one of :data:`PANELS`) for every layer (rows) and head (columns)."""
    if panel not in PANELS:
        raise ValueError(f"panel={panel!r} must be one of {PANELS}.")
    cfg = model.config
    rows, cols = cfg.num_layers, cfg.num_heads
    fig = Figure(figsize=(2.4 * cols + 0.5, 2.3 * rows + 0.6))
    axes = np.asarray(fig.subplots(rows, cols, squeeze=False))
    for layer in range(rows):
        comp = sinks.prior_components(model, params, layer, seq_len)
        for head in range(cols):
            ax = axes[layer, head]
            _draw_panel(ax, fig, comp, head, panel, small=True)
            ax.set_title(f"L{layer} H{head}", fontsize=9)
            ax.tick_params(labelsize=7)
            ax.xaxis.label.set_visible(layer == rows - 1)
            ax.yaxis.label.set_visible(head == 0)
    fig.suptitle(title or f"GOAT prior: {_TITLES[panel]}, every layer/head")
    fig.tight_layout()
    return _save(fig, path)


def error_bars(values: Sequence[Any]) -> list[float]:
    """The 95% half-widths of ``values`` for ``errorbar`` (a value with a ``half_width``, e.g.
    a mean over seeds from goat_jax/reproduce/stats.py; 0 for a plain number or one seed)."""
    return [float(getattr(v, "half_width", None) or 0.0) for v in values]


def line_styles(labels: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Matplotlib keyword arguments per line label: a distinct colour for every line (tab10 up
    to 10 lines, tab20 up to 20, then a continuous map: no two rows share a colour), and a
    dashed line for a variant row (a label with '+' or '@', e.g. ``rope+yarn``)."""
    import matplotlib  # pylint: disable=g-import-not-at-top  # plotting extra, on use only

    n = len(labels)
    cmap = matplotlib.colormaps["tab10" if n <= 10 else ("tab20" if n <= 20 else "turbo")]
    colours = [cmap(i) if n <= 20 else cmap(i / max(n - 1, 1)) for i in range(n)]
    return {label: {"color": colours[i], "ls": "--" if ("+" in label or "@" in label) else "-"}
            for i, label in enumerate(labels)}


def _legend(fig, ax, lines: int) -> None:
    """The legend inside the axes for a few lines, outside on the right for many (it would
    cover the data), the figure widened to keep the axes' size."""
    if lines <= 6:
        ax.legend()
        return
    fig.set_size_inches(fig.get_size_inches()[0] + 2.4, fig.get_size_inches()[1])
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", borderaxespad=0.0)
    fig.tight_layout()


def length_label(n: int, compact: bool = False) -> str:
    """A length's tick label: '65536', or with ``compact`` '64k' (multiples of 1024 from 1024)."""
    n = int(n)
    return f"{n // 1024}k" if compact and n >= 1024 and n % 1024 == 0 else str(n)


def _log2_length_axis(ax, lengths: Sequence[int], train_len: Optional[int], compact: bool = False) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(lengths))
    ax.set_xticklabels([length_label(x, compact) for x in lengths], rotation=0)
    ax.minorticks_off()
    if train_len:
        ax.axvline(train_len, color="gray", lw=0.8, ls=":", label=f"train length {train_len}")
    ax.set_xlabel("evaluation length (tokens)")


def off_scale(curves: Mapping[str, Mapping[int, Any]], max_ratio: Optional[float]
              ) -> tuple[Optional[float], dict[str, str]]:
    """The top of a perplexity axis and each line's legend label: ``max_ratio`` x the lowest
    value when some value lies above that (else None: the axis holds every point), and a row
    with a value above the top labelled ``'<label> (off scale from <first such length>)'``."""
    values = [float(v) for by_len in curves.values() for v in by_len.values()]
    top = None
    if max_ratio is not None and values and max(values) > max_ratio * min(values):
        top = max_ratio * min(values)
    shown = {}
    for label, by_len in curves.items():
        off = [n for n in sorted(by_len) if top is not None and float(by_len[n]) > top]
        shown[label] = f"{label} (off scale from {off[0]})" if off else label
    return top, shown


def lower_errors(values: Sequence[float], half_widths: Sequence[float]) -> tuple[list[float], bool]:
    """The lower arms of a log-axis error bar: each interval's half-width, cut at half its value.

    With two or three seeds a t interval can reach below zero (t is 12.7 at two seeds), which a
    log axis cannot draw: matplotlib then stretched the axis down to 0.1 and pressed every line
    together. Returns the arms and whether any was cut (the figure then says so)."""
    arms = [min(float(h), 0.5 * float(v)) for v, h in zip(values, half_widths)]
    return arms, any(a < float(h) for a, h in zip(arms, half_widths))


def checked_panels(results: Mapping[str, Any], panels: Optional[Sequence[tuple[str, Sequence[str]]]],
                   title: str) -> list[tuple[str, list[str]]]:
    """``panels`` (``[(panel title, [labels]), ...]``) as lists, checked against the rows of
    ``results`` before anything is drawn: a label with no row, or a row in no panel, is a
    ValueError naming it. None: one panel titled ``title`` with every row."""
    labels = list(results)
    if panels is None:
        return [(title, labels)]
    panels = [(str(t), list(ls)) for t, ls in panels]
    unknown = [l for _, ls in panels for l in ls if l not in results]
    if unknown:
        raise ValueError(f"panels name {unknown}, which results has no row for; rows: {labels}.")
    missing = [l for l in labels if not any(l in ls for _, ls in panels)]
    if missing or not panels:
        raise ValueError(f"panels leave out {missing or labels}: put every row of results in a panel.")
    return panels


def _panel_axes(panels: Sequence[tuple[str, Sequence[str]]]):
    """A figure with one axes per panel, side by side on a shared y axis."""
    many = len(panels) > 1
    fig = Figure(figsize=(5.2 * len(panels), 5.4) if many else (6.4, 4.2))
    return fig, np.atleast_1d(fig.subplots(1, len(panels), sharey=True))


def _finish_panel(ax, panel_title: str, lengths: Sequence[int], train_len: Optional[int], many: bool,
                  which: str = "both") -> None:
    """The length axis, grid, and (several panels) the panel's title and its legend below it."""
    _log2_length_axis(ax, lengths, train_len, compact=many)
    ax.grid(True, which=which, alpha=0.3)
    if many:
        ax.set_title(panel_title, fontsize="medium")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize="small")


def _finish_figure(fig: Figure, axes, title: str, lines: int, path: str) -> str:
    """Titles and saves a figure of :func:`_panel_axes`: several panels get ``title`` above
    them (each panel has its legend already, :func:`_finish_panel`); one panel gets it on its
    axes and the legend of :func:`_legend`."""
    if len(axes) > 1:
        fig.suptitle(title)
        fig.tight_layout()
    else:
        axes[0].set_title(title)
        _legend(fig, axes[0], lines)
    return _save(fig, path)


def plot_perplexity_vs_length(results: Mapping[str, Mapping[int, Any]], path: str, *,
                              train_len: Optional[int] = None, title: str = "Length extrapolation",
                              max_ratio: Optional[float] = 10.0,
                              panels: Optional[Sequence[tuple[str, Sequence[str]]]] = None) -> str:
    """Perplexity vs evaluation length, one line per position encoding, log y.

    Args:
      results: ``{label: {length: PerplexityResult or ppl float}}`` (e.g. one
        ``perplexity_by_length`` result per encoding). A value with a ``half_width`` (a mean
        over seeds) gets its 95% interval as an error bar; a lower arm that would reach below
        half the value is cut there, and the figure says so (:func:`lower_errors`).
      max_ratio: the y axis stops at ``max_ratio`` x the lowest perplexity plotted, so that one
        diverging row (e.g. sinusoidal at 10^4) does not press every other line onto the bottom
        of the plot; a row that leaves the axis says so in the legend ("off scale from N"),
        and its numbers are in the table beside the figure. None: the axis holds every point.
      panels: ``[(panel title, [labels]), ...]``: side-by-side panels with one shared y axis,
        each drawing its labels with its own legend and colours (a label may stand in several
        panels, e.g. a reference row: put it first in each and it keeps tab10's first colour).
        Every label of ``results`` must be in a panel. None: one panel with every row.
    """
    panels = checked_panels(results, panels, title)
    many = len(panels) > 1
    fig, axes = _panel_axes(panels)
    all_lengths = sorted({int(n) for r in results.values() for n in r})
    curves = {label: {n: getattr(v, "ppl", v) for n, v in sorted(by_len.items())}
              for label, by_len in results.items()}
    top, shown = off_scale(curves, max_ratio)
    cut = False
    for ax, (panel_title, panel_labels) in zip(axes, panels):
        # Colours per panel (each has its own legend): a reference row put first in every panel
        # (e.g. goat) keeps its colour, and ten or fewer lines stay on tab10's strong colours.
        styles = line_styles(panel_labels)
        for label in panel_labels:
            ppl = list(curves[label].values())
            highs = error_bars(ppl)
            lows, was_cut = lower_errors([float(v) for v in ppl], highs)
            cut = cut or was_cut
            ax.errorbar(list(curves[label]), ppl, yerr=[lows, highs], marker="o", capsize=3,
                        label=shown[label], **styles[label])
        _finish_panel(ax, panel_title, all_lengths, train_len, many)
    ax = axes[0]
    ax.set_yscale("log")
    if top is not None:
        ax.set_ylim(top=top)
    low, high = ax.get_ylim()
    if high < 1000 * low:  # within 3 decades: ticks at 1, 2, 5 x 10^k, written as plain numbers
        from matplotlib import ticker  # pylint: disable=g-import-not-at-top  # plotting extra

        ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_ylabel("perplexity")
    return _finish_figure(fig, axes, title + (" (intervals cut at half the mean)" if cut else ""),
                          len(results), path)


def accuracy_errors(acc: Sequence[float], half_widths: Sequence[float]
                    ) -> tuple[list[float], list[float], bool]:
    """The lower and upper arms of accuracy error bars (in %), each interval cut at 0 and 100,
    and whether any was cut."""
    lows = [min(float(h), float(a)) for a, h in zip(acc, half_widths)]
    highs = [min(float(h), 100.0 - float(a)) for a, h in zip(acc, half_widths)]
    return lows, highs, any(l < h or u < h for l, u, h in zip(lows, highs, half_widths))


def plot_passkey_accuracy(results: Mapping[str, Mapping[int, float]], path: str, *,
                          train_len: Optional[int] = None, title: str = "Passkey retrieval",
                          panels: Optional[Sequence[tuple[str, Sequence[str]]]] = None) -> str:
    """Passkey accuracy vs length, one line per model: ``{label: {length: accuracy}}``.

    A mean over seeds gets its 95% interval as an error bar, cut at 0% and 100% (an accuracy
    lies between; with two or three seeds a t interval reaches far past both), which the title
    then says. ``panels``: as in :func:`plot_perplexity_vs_length`."""
    panels = checked_panels(results, panels, title)
    many = len(panels) > 1
    fig, axes = _panel_axes(panels)
    all_lengths = sorted({int(n) for r in results.values() for n in r})
    cut = False
    for ax, (panel_title, panel_labels) in zip(axes, panels):
        styles = line_styles(panel_labels)
        for label in panel_labels:
            lengths = sorted(results[label])
            acc = [100.0 * float(results[label][n]) for n in lengths]
            half = [100.0 * e for e in error_bars([results[label][n] for n in lengths])]
            lows, highs, was_cut = accuracy_errors(acc, half)
            cut = cut or was_cut
            ax.errorbar(lengths, acc, yerr=[lows, highs], marker="o", capsize=3, label=label, **styles[label])
        _finish_panel(ax, panel_title, all_lengths, train_len, many, which="major")
    axes[0].set_ylim(-3, 103)
    axes[0].set_ylabel("accuracy (%)")
    return _finish_figure(fig, axes, title + (" (intervals cut at 0% and 100%)" if cut else ""),
                          len(results), path)


def plot_niah_heatmap(grid: Mapping[str, np.ndarray], path: str, *,
                      metric: str = "token_accuracy", title: str = "Needle in a haystack") -> str:
    """Heatmap of a ``retrieval.niah_accuracy_grid`` result: depth (rows) x length (columns),
    each cell annotated with its accuracy in %."""
    acc = np.asarray(grid[metric], np.float64).T  # [nD, nL]
    lengths, depths = np.asarray(grid["lengths"]), np.asarray(grid["depths"])
    fig = Figure(figsize=(1.0 * len(lengths) + 2.5, 0.55 * len(depths) + 1.8))
    ax = fig.subplots()
    im = ax.imshow(acc, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(len(lengths)))
    ax.set_xticklabels([str(int(n)) for n in lengths])
    ax.set_yticks(range(len(depths)))
    ax.set_yticklabels([f"{d:.0%}" for d in depths])
    for (r, c), value in np.ndenumerate(acc):
        ax.text(c, r, f"{100 * value:.0f}", ha="center", va="center", fontsize=8)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(f"{title} ({metric.replace('_', ' ')})")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    return _save(fig, path)
