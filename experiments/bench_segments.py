"""The cost of segment ids (document-aware packing) on the flash kernel: forward+backward time
and compiled memory, with and without a segment mask, side by side.

Variants at each length L (B, N, H from the flags, float32, causal, ``loss = sum(out)``,
gradients w.r.t. q, k, v, the kernel's default blocks):

* ``flash``: ``kernels.attend(..., implementation='flash')``, no segment ids (the baseline);
* ``flash+1doc``: the same with one segment id for the whole row: every tile pays the
  segment mask and none can be skipped (the pure cost of masking);
* ``flash+docs``: rows packed with documents of random lengths (exponential, mean
  ``--doc-len`` tokens, at least 16; each row its own): tiles across documents are skipped,
  each example its own (the default ``per_example``), so a row costs about its documents;
* ``flash+docs:union`` (B > 1 only): the same with ``per_example=False``, the batch visiting
  the union of its rows' tiles;
* ``xla+docs``: XLA's materialized attention with the same documents, for scale (up to
  ``--xla-max-len``).

Timing as in :mod:`goat_jax.benchmarking`: compile, one warm-up call, ``--repeats`` rounds in
rotated order, medians; CPU time (all threads) is robust to other processes, wall time is
what a user waits. The machine's load average is recorded at the start and the end.

  nice python experiments/bench_segments.py --lengths 1024 2048 4096 --repeats 3 \\
      --out benchmarks/segments.md
  nice python experiments/bench_segments.py --lengths 1024 2048 --batch 4 --repeats 3 \\
      --out benchmarks/segments.md --append
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
from typing import Dict, List

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from goat_jax.kernels import flash as flash_lib  # noqa: E402
from goat_jax import kernels  # noqa: E402
from goat_jax.benchmarking import Variant, jax_variant, measure  # noqa: E402


def variants(length: int, args, rng) -> List[Variant]:
    """The four variants at one length (module doc)."""
    b, n, h = args.batch, args.heads, args.head_dim
    q, k, v = (jnp.asarray(rng.normal(size=(b, length, n, h)), jnp.float32) for _ in range(3))
    docs = np.zeros((b, length), np.int32)
    for row in range(b):
        sizes = np.maximum(16, rng.exponential(args.doc_len, size=length // 16 + 1)).astype(int)
        docs[row] = np.repeat(np.arange(len(sizes)), sizes)[:length]
    docs = jnp.asarray(docs)
    one = jnp.zeros((b, length), jnp.int32)

    def loss(impl, seg, union=False):
        def f(q_, k_, v_, seg_):
            if union:  # kernels.attend always uses the default per_example=True
                return jnp.sum(flash_lib.flash_attention(
                    q_, k_, v_, scale=h ** -0.5, is_causal=True, q_segment_ids=seg_,
                    kv_segment_ids=seg_, per_example=False))
            kw = {} if seg is None else dict(segment_ids=seg_)
            return jnp.sum(kernels.attend(q_, k_, v_, implementation=impl, scale=h ** -0.5,
                                          is_causal=True, **kw))
        return f

    out = []
    for name, impl, seg in (("flash", "flash", None), ("flash+1doc", "flash", one),
                            ("flash+docs", "flash", docs), ("flash+docs:union", "flash", docs),
                            ("xla+docs", "xla", docs)):
        if (impl == "xla" and length > args.xla_max_len) or (name.endswith("union") and b == 1):
            continue
        out.append(jax_variant(name, loss(impl, seg, name.endswith("union")),
                               (q, k, v, docs if seg is None else seg), (0, 1, 2)))
    return out


def main(argv=None) -> None:
    """Runs the benchmark and writes the markdown table to ``--out`` (stdout if empty)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--doc-len", type=int, default=512, help="tokens per packed document")
    parser.add_argument("--xla-max-len", type=int, default=2048, help="longest L run on XLA")
    parser.add_argument("--out", default="", help="markdown file to write")
    parser.add_argument("--append", action="store_true", help="add a section to --out")
    args = parser.parse_args(argv)
    for name in ("repeats", "batch", "heads", "head_dim", "doc_len"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
    if any(length < 1 for length in args.lengths):
        raise SystemExit(f"--lengths must be positive, got {args.lengths}.")

    load0 = os.getloadavg()[0]
    rng = np.random.default_rng(0)
    rows: List[Dict] = []
    for length in args.lengths:
        vs = variants(length, args, rng)
        measure(vs, args.repeats)
        base = statistics.median(vs[0].cpu)
        for var in vs:
            rows.append(dict(L=length, variant=var.name, wall=1e3 * statistics.median(var.times),
                             cpu=1e3 * statistics.median(var.cpu), ratio=statistics.median(var.cpu) / base,
                             mib=(var.memory or 0) / 2**20))
            print(rows[-1], flush=True)
    load1 = os.getloadavg()[0]

    cmd = "python experiments/bench_segments.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [] if args.append else [
        "# Segment ids on the flash kernel: time per forward+backward step, with and without", ""]
    lines += [
        f"## B={args.batch}",
        "",
        f"Command: `nice {cmd}`",
        "",
        f"Date: {datetime.datetime.now().isoformat(timespec='seconds')}; jax {jax.__version__} "
        f"(backend {jax.default_backend()}); CPU: {platform.machine()}, "
        f"{len(os.sched_getaffinity(0))} cores available; load average {load0:.1f} at the start, "
        f"{load1:.1f} at the end (a shared machine: compare CPU-time ratios within a length). "
        f"B={args.batch}, N={args.heads}, H={args.head_dim}, float32, causal, loss = sum(out), "
        f"'docs' rows: documents of random lengths, mean {args.doc_len} tokens; "
        f"{args.repeats} rounds, medians.",
        "",
        "| L | variant | wall ms | CPU ms | CPU / flash | compiled MiB |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    lines += [f"| {r['L']} | {r['variant']} | {r['wall']:.1f} | {r['cpu']:.1f} | {r['ratio']:.3f} | "
              f"{r['mib']:.1f} |" for r in rows]
    text = ("\n" if args.append else "") + "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "a" if args.append else "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    from goat_jax import platforms  # pylint: disable=g-import-not-at-top
    platforms.avoid_libtpu_without_tpu()  # before any JAX backend starts (goat_jax/platforms.py)
    main()
