"""Section 5 of the device check: the q/k width sweep on cuDNN: where Hopper's
head-width cliff is, and what each GOAT layout costs beside plain attention and RoPE.

Hopper attention kernels are built per head-width bucket (docs/layer.md, "Packed width"):
GOAT's official layout makes q/k ``head_dim + 2`` wide in bf16 (66 for a 64 head, padded by
cuDNN to 72), and the first GPU check measured GOAT at 1.24-1.50x plain cuDNN's time
(benchmarks/gpu.md). This section times cuDNN forward + backward (causal, bf16) at one shape per
row:

* the attention as the layers call it, at head dim 64: ``plain`` (q/k/v 64), ``rope`` (the
  rotation + attention), ``goat official`` (the prior packed into q/k 66 wide) and ``goat
  lane_aligned`` (q/k kept 64 wide, ``PriorSettings(qk_layout='lane_aligned')``);
* bare q/k widths 64, 65, 66, 72, 80, 96 and 128 with v 64 (jax's cuDNN takes v narrower than
  q/k on Hopper from cuDNN 9.10; goat_jax/kernels/cudnn.py pads v to the q/k width elsewhere,
  and q/k to a multiple of 8), and 72 and 128 with v as wide as q/k;

each as a ratio of time to ``plain`` at the same shape. Shapes: the 125M model's own attention
(B=8, 12 heads, 2,048 tokens) first, then B=1, 8 heads at 4k, 16k and 1k (the first check's
shape). Rows that would start after the section's share of the time (``SHARE_S``) are skipped
and say so. On CPU (``--dry_run``) every variant runs once on the 'xla' kernel at a tiny size:
the code paths, not a measurement.
"""

from __future__ import annotations

import statistics
import time
from typing import Dict, List, Optional, Tuple

from goat_jax.device_check import Check, Section
from goat_jax.device_check.report import error_text, table

WIDTHS = (64, 65, 66, 72, 80, 96, 128)  # bare q/k widths, v 64
WIDE_V = (72, 128)  # q/k widths also timed with v as wide
SHAPES = ((8, 12, 2048), (1, 8, 4096), (1, 8, 16384), (1, 8, 1024))  # (B, heads, tokens), in the order run
SHARE_S = 150.0  # the section's share of the check's time (seconds)
RESERVE_S = 15.0  # no variant starts with less left: the shape's timing rounds still follow its compile
CLIFF = 1.10  # a width at least this much slower than 64 is past the cliff


def _inputs(rng, b: int, t: int, n: int, widths: Tuple[int, int, int], dtype):
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

    return tuple(jnp.asarray(rng.normal(size=(b, t, n, w)), dtype) for w in widths)


def variant_losses(t: int, n: int, dtype, impl: str) -> List[Tuple[str, Tuple[int, int, int], str, object]]:
    """``(name, (q, k, v) input widths, the kernel's q/k / v widths, loss(q, k, v))`` of every
    variant at ``t`` tokens and ``n`` heads: the summed causal attention output, forward +
    backward when differentiated."""
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

    from goat_jax.layers import goat as attn_lib  # pylint: disable=g-import-not-at-top
    from goat_jax import kernels  # pylint: disable=g-import-not-at-top
    from goat_jax import prior as prior_lib  # pylint: disable=g-import-not-at-top
    from goat_jax.positional import rope  # pylint: disable=g-import-not-at-top
    from goat_jax.prior import packing  # pylint: disable=g-import-not-at-top

    h = 64
    pos = prior_lib.positions_1d(t)
    steps = jnp.arange(t, dtype=jnp.int32)[None]  # RoPE's [1, T] positions
    attend = lambda q, k, v, scale: jnp.sum(kernels.attend(q, k, v, implementation=impl, scale=scale,
                                                           is_causal=True).astype(jnp.float32))

    def goat(layout: str):
        """GOAT's layer call at head dim 64 in ``layout``: (the packed q/k width, its loss)."""
        spec = prior_lib.PriorSpec(num_heads=n, kv_num_heads=n, pos_rank=8, abs_rank=8, qk_layout=layout,
                                   training_seq_len=t)
        channels = packing.packed_sink_channels(layout, spec.enable_key_bias, None, dtype)
        d_c = spec.content_dim(h, channels)
        p4 = prior_lib.positions_1d(4)
        params = attn_lib.GoatPrior(spec).init(jax.random.PRNGKey(0), p4, p4, True)["params"]

        def loss(q, k, v):  # the prior's features are part of the call, as in the layer
            q_rel, q_sink = prior_lib.query_features(spec, params, pos)
            k_rel, u = prior_lib.key_features(spec, params, pos, True)
            qp = packing.pack_query(q[..., :d_c], q_rel, q_sink, channels, dtype)
            kp = packing.pack_key(k[..., :d_c], k_rel, u, channels, dtype)
            return jnp.sum(kernels.attend(qp, kp, v, implementation=impl, is_causal=True).astype(jnp.float32))
        return f"{d_c + 2 * spec.pos_rank + channels} / {h} (packed)", loss

    plain = lambda q, k, v: attend(q, k, v, h ** -0.5)
    out = [("plain", (h, h, h), f"{h} / {h}", plain),
           ("goat official", (h, h, h)) + goat("official"),
           ("goat lane_aligned", (h, h, h)) + goat("lane_aligned"),
           ("rope", (h, h, h), f"{h} / {h}", lambda q, k, v: attend(rope.apply_rope(q, steps).astype(dtype),
                                                       rope.apply_rope(k, steps).astype(dtype), v, h ** -0.5))]
    out += [(f"q/k {w}, v 64", (w, w, h), f"{w} / {h}", lambda q, k, v, w=w: attend(q, k, v, w ** -0.5))
            for w in WIDTHS if w != h]
    out += [(f"q/k {w}, v {w}", (w, w, w), f"{w} / {w}", lambda q, k, v, w=w: attend(q, k, v, w ** -0.5))
            for w in WIDE_V]
    return out


def width_rows(shapes, gpu: bool, repeats: int, deadline: float) -> List[List]:
    """One row per (shape, variant): median wall ms, compiled MiB and the ratio to ``plain``."""
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top

    from goat_jax.benchmarking import jax_variant, measure  # pylint: disable=g-import-not-at-top

    dtype = jnp.bfloat16 if gpu else jnp.float32
    impl = "cudnn" if gpu else "xla"
    rows = []
    for b, n, t in shapes:
        shape = f"{b} x {n} x {t}"
        rng = np.random.default_rng(t)
        measured: List[Tuple[str, object]] = []
        for name, widths, label, loss in variant_losses(t, n, dtype, impl):
            head = [shape, name, label]
            if time.time() > deadline - (RESERVE_S if gpu else 0.0):
                rows.append(head + [None, None, None, "skipped: time budget (rerun with --sections 5)"])
                continue
            try:
                var = jax_variant(name, loss, _inputs(rng, b, t, n, widths, dtype), (0, 1, 2))
            except Exception as err:  # noqa: BLE001 -- e.g. a width cuDNN refuses: record, go on
                rows.append(head + [None, None, None, error_text(err)])
                continue
            measured.append((head, var))
        try:
            measure([v for _, v in measured], repeats)
        except Exception as err:  # noqa: BLE001 -- e.g. out of memory at run time
            rows += [head + [None, None, None, "**ERROR** while running: " + error_text(err)] for head, _ in measured]
            continue
        times = {v.name: statistics.median(v.times) for _, v in measured}
        for head, var in measured:
            ratio = times[var.name] / times["plain"] if "plain" in times else None
            rows.append(head + [1e3 * times[var.name], None if var.memory is None else var.memory / 2**20, ratio, ""])
        del measured
        jax.clear_caches()
    return rows


def cliff(rows: List[List]) -> List[str]:
    """Per shape: the widest bare q/k width (v 64) within ``CLIFF`` of width 64, the first one
    past it, and the two GOAT layouts' ratios to plain."""
    by_shape: Dict[str, Dict[str, Optional[float]]] = {}
    for shape, name, _, ms, _, ratio, _ in rows:
        if ms is not None:
            by_shape.setdefault(shape, {})[name] = ms
    lines = []
    for shape, ms in by_shape.items():
        base = ms.get("plain")
        widths = [(w, ms.get("plain" if w == 64 else f"q/k {w}, v 64")) for w in WIDTHS]
        widths = [(w, m) for w, m in widths if m is not None]
        if base is None or not widths:
            continue
        fast = [w for w, m in widths if m <= CLIFF * base]
        slow = [w for w, m in widths if m > CLIFF * base]
        goat = ", ".join(f"{k} {ms[k] / base:.2f}x" for k in ("goat official", "goat lane_aligned", "rope") if k in ms)
        lines.append(f"* {shape}: widths within {CLIFF:.2f}x of 64: {fast or 'none'}; slower: {slow or 'none'}"
                     f"{f' (the cliff: above {max(fast)})' if fast and slow and min(slow) > max(fast) else ''}; "
                     f"ratios to plain: {goat or '-'}.")
    return lines


def run_widths(check: Check) -> None:
    """Section 5."""
    shapes = ((1, 2, 64),) if check.dry_run else SHAPES
    rows = width_rows(shapes, check.gpu, check.repeats if check.dry_run else max(check.repeats, 10),
                      check.section_deadline(SHARE_S))
    note = (["Dry run on CPU: float32 on the 'xla' kernel, tiny size; the code paths, not a measurement.", ""]
            if not check.gpu else ["cuDNN, bf16, causal, forward + backward; ratio = median time / plain's at the "
                                   "same shape.", ""])
    check.report.section("5. q/k width sweep on cuDNN (where the cliff is; ratio of time to plain attention)",
                         note + table(["B x heads x tokens", "variant", "q/k / v width", "median wall ms",
                                       "compiled MiB", "ratio to plain", "note"], rows) + [""] + cliff(rows))


WIDTH_SWEEP = Section("5", "5. q/k width sweep", run_widths)
