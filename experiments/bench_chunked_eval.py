"""Compiled memory (and, where it runs, time and agreement) of perplexity evaluation on whole
windows vs in query chunks through the KV cache (goat_jax.eval.chunked).

For each window length W (batch 1, the official C4 evaluation's), two jitted functions of
``(params, inputs [1, W], targets [1, W], weights [1, W]) -> (sum nll, count)`` are compiled:
``full`` (``extrapolation.make_nll_fn``: one forward, [1, W, V] logits) and ``chunked``
(``chunked.make_chunked_nll_fn`` with ``--chunk_size``). Memory is XLA's
``compile().memory_analysis()``: temp + argument + output bytes, parameters included. Lengths
up to ``--run_max_len`` are also run (``--repeats`` rounds, rotated order, median wall time) on
random tokens with random-normal parameters, and the two NLL sums compared.

    python experiments/bench_chunked_eval.py --config configs/lm_c4_125m.py:goat \
        --lengths 2048 4096 8192 16384 32768 --run_max_len 0 --out benchmarks/chunked_eval.md
    python experiments/bench_chunked_eval.py --config configs/lm_tiny.py:goat \
        --lengths 128 512 2048 --run_max_len 2048 --chunk_size 128 --append --out benchmarks/chunked_eval.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from goat_jax.benchmarking import Variant, measure  # noqa: E402
from goat_jax.config.files import load_config  # noqa: E402
from goat_jax.eval import chunked, extrapolation  # noqa: E402
from goat_jax.train import tasks  # noqa: E402
from goat_jax.kernels.plan import AttentionPlan  # noqa: E402


def compiled(fn, args):
    """(compiled function, temp + argument + output bytes)."""
    c = fn.lower(*args).compile()
    m = c.memory_analysis()
    return c, int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes)


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/lm_c4_125m.py:goat")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    p.add_argument("--chunk_size", type=int, default=512)
    p.add_argument("--run_max_len", type=int, default=0, help="also run lengths up to this")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--append", action="store_true", help="append the table to --out")
    args = p.parse_args(argv)
    chunked.check_chunk_size(args.chunk_size)

    config = load_config(args.config)
    model = tasks.get_task(config.task).build_model(config, AttentionPlan.from_config(config))  # the task builds its model
    cfg = model.config
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
    shapes = jax.tree_util.tree_map(lambda x: getattr(x, "value", x), shapes,
                                    is_leaf=lambda x: hasattr(x, "value"))
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map(lambda s: jnp.asarray(rng.normal(0, 0.02, s.shape), s.dtype), shapes)
    full_fn = extrapolation.make_nll_fn(extrapolation.model_apply_fn(model))
    chunk_fn = chunked.make_chunked_nll_fn(model, args.chunk_size)

    rows = []
    for w in args.lengths:
        toks = rng.integers(0, cfg.vocab_size, (1, w + 1)).astype(np.int32)
        call = (params, toks[:, :-1], toks[:, 1:], np.ones((1, w), np.float32))
        full_c, full_mem = compiled(full_fn, call)
        chunk_c, chunk_mem = compiled(chunk_fn, call)
        row = {"W": w, "full": full_mem, "chunked": chunk_mem, "t_full": None, "t_chunked": None, "rel": None}
        if w <= args.run_max_len:
            variants = [Variant("full", lambda c=full_c: jax.block_until_ready(c(*call)), full_mem),
                        Variant("chunked", lambda c=chunk_c: jax.block_until_ready(c(*call)), chunk_mem)]
            measure(variants, args.repeats)
            row["t_full"], row["t_chunked"] = (statistics.median(v.times) for v in variants)
            a, b = float(full_c(*call)[0][0]), float(chunk_c(*call)[0][0])
            row["rel"] = abs(a - b) / abs(a)
        rows.append(row)
        print(f"W={w}: full {full_mem / 2**20:.0f} MiB, chunked {chunk_mem / 2**20:.0f} MiB", flush=True)

    fmt_t = lambda t: "-" if t is None else f"{t:.3f}"
    lines = [
        f"### {args.config}: {cfg.num_layers} layers, d {cfg.embed_dim}, {cfg.num_heads} heads, "
        f"vocab {cfg.vocab_size}, {cfg.position_encoding}, chunk {args.chunk_size}, batch 1",
        "",
        f"`python experiments/bench_chunked_eval.py --config {args.config} --lengths "
        f"{' '.join(map(str, args.lengths))} --chunk_size {args.chunk_size} --run_max_len {args.run_max_len}`"
        f" ({datetime.date.today()}, {platform.machine()}, jax {jax.__version__}, "
        f"{jax.default_backend()}, {os.cpu_count()} CPUs shared with other jobs)",
        "",
        "| W | full: compiled MiB | chunked: compiled MiB | ratio | full s | chunked s | rel. NLL diff |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rel = "-" if r["rel"] is None else f"{r['rel']:.1e}"
        lines.append(f"| {r['W']} | {r['full'] / 2**20:.0f} | {r['chunked'] / 2**20:.0f} | "
                     f"{r['full'] / r['chunked']:.1f}x | {fmt_t(r['t_full'])} | {fmt_t(r['t_chunked'])} | {rel} |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        header = ("# Chunked-query evaluation: compiled memory and time\n\n"
                  "Whole windows vs the KV cache in query chunks (goat_jax/eval/chunked.py); "
                  "memory from XLA's memory_analysis (temp + arguments + outputs, parameters "
                  "included), times the median of rotated rounds.\n\n")
        mode = "a" if args.append and os.path.exists(args.out) else "w"
        with open(args.out, mode) as f:
            f.write(("" if mode == "a" else header) + table + "\n")
    return table


if __name__ == "__main__":
    from goat_jax import platforms  # pylint: disable=g-import-not-at-top
    platforms.avoid_libtpu_without_tpu()  # before any JAX backend starts (goat_jax/platforms.py)
    main()
