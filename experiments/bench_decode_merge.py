"""One decode step against a KV cache split over the ``context`` axis, on fake CPU devices: what the
split-K merge (goat_jax/kernels/decode_merge.py) costs, collective by collective.

Every variant is one jitted program on a mesh of ``--context`` fake CPU devices (the ``context``
axis), the cache ``[B, S, K, D]`` split over it on S, the step's query replicated:

  local        each shard's float32 partials (o, m, l) over its S / c slots; no collective
  pmax_m       the first collective alone: ``pmax`` of m [B, T, N]
  psum_o       ``psum`` of the weighted o [B, T, N, Dv]
  psum_l       ``psum`` of the weighted l [B, T, N]
  merge        the whole step (decode_merge.decode_attention): local + the three collectives
  merge_interleaved  the same with the interleaved slot layout
  all_gather   the alternative: gather K and V on every shard, then attend locally (the
               training strategy 'all_gather' applied to decoding)
  one_device   the whole cache on one device (no mesh), for scale

Timing as the other benchmarks (goat_jax/benchmarking.py: warm-up, then ``--repeats`` rounds in
rotated order, medians). Fake devices share the host's cores, so the numbers say what each
piece costs in work and bytes on this machine, not an interconnect's latency; the bytes each
collective moves per device are printed beside them. The last table counts, for a cache filled to
``--fill`` of its slots, the written slots on the busiest shard under each layout: the work a
kernel that stops at the written length would do (docs/training.md, "Decoding with a sharded
cache").

    python experiments/bench_decode_merge.py --context 8 --slots 65536 --out benchmarks/decode_merge.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys


def _devices_from_argv(argv) -> int:
    for i, a in enumerate(argv):
        if a == "--context" and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith("--context="):
            return int(a.split("=", 1)[1])
    return 8


# Fake CPU devices must be asked for before JAX starts.
_COUNT = f"--xla_force_host_platform_device_count={_devices_from_argv(sys.argv)}"
os.environ["XLA_FLAGS"] = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), _COUNT) if f)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from goat_jax import benchmarking  # noqa: E402
from goat_jax.kernels import decode_merge  # noqa: E402


def _variants(args, mesh):
    b, t, n, kh, d, s, c = args.batch, args.queries, args.heads, args.kv_heads, args.head_dim, args.slots, args.context
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, s, kh, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, s, kh, d)), jnp.float32)
    fill = max(t, int(args.fill * s))
    kl = jnp.full((b,), fill, jnp.int32)
    qp = jnp.broadcast_to(fill - t + jnp.arange(t, dtype=jnp.int32), (b, t))
    split = NamedSharding(mesh, P(None, "context"))
    ks, vs = jax.device_put(k, split), jax.device_put(v, split)
    scale, slots = 1.0 / np.sqrt(d), s // c
    spec_q, spec_kv, rows, batch = P(), P(None, "context"), P(), P()

    def shard_map(fn, in_specs, out_specs):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))

    def local(q_, k_, v_, qp_, kl_):
        keys = decode_merge.slot_positions(slots, c, lax.axis_index("context"))
        return decode_merge.partial_attention(q_, k_, v_, qp_, keys, kl_, scale=scale)

    part = P(None, "context")  # each shard's partials, side by side
    local_fn = shard_map(lambda *a: tuple(x[:, None] for x in local(*a)), (spec_q, spec_kv, spec_kv, rows, batch),
                         (part, part, part))
    o, m, l = local_fn(q, ks, vs, qp, kl)
    progs = {
        "local": (local_fn, (q, ks, vs, qp, kl)),
        "pmax_m": (shard_map(lambda m_: lax.pmax(m_[:, 0], "context"), (part,), P()), (m,)),
        "psum_o": (shard_map(lambda o_: lax.psum(o_[:, 0], "context"), (part,), P()), (o,)),
        "psum_l": (shard_map(lambda l_: lax.psum(l_[:, 0], "context"), (part,), P()), (l,)),
    }
    for layout in decode_merge.LAYOUTS:
        name = "merge" if layout == "contiguous" else "merge_interleaved"
        progs[name] = (jax.jit(lambda *a, layout=layout: decode_merge.decode_attention(
            *a[:3], q_positions=a[3], kv_length=a[4], scale=scale, mesh=mesh, layout=layout)), (q, ks, vs, qp, kl))

    def gathered(q_, k_, v_, qp_, kl_):
        k_, v_ = (lax.all_gather(x, "context", axis=1, tiled=True) for x in (k_, v_))
        o_, m_, l_ = decode_merge.partial_attention(q_, k_, v_, qp_, jnp.arange(s, dtype=jnp.int32), kl_, scale=scale)
        return decode_merge.merge_partials(o_, m_, l_, None)

    progs["all_gather"] = (shard_map(gathered, (spec_q, spec_kv, spec_kv, rows, batch), P()), (q, ks, vs, qp, kl))
    one = jax.devices()[0]
    progs["one_device"] = (jax.jit(lambda *a: decode_merge.decode_attention(
        *a[:3], q_positions=a[3], kv_length=a[4], scale=scale, mesh=jax.sharding.Mesh(np.array([one]), ("context",)))),
        tuple(jax.device_put(x, one) for x in (q, k, v, qp, kl)))
    out = []
    for name, (fn, a) in progs.items():
        compiled = fn.lower(*a).compile()
        out.append(benchmarking.Variant(name, lambda compiled=compiled, a=a: jax.block_until_ready(compiled(*a)), None))
    ref = np.asarray(progs["one_device"][0](*progs["one_device"][1]))
    for name in ("merge", "merge_interleaved", "all_gather"):
        layout = "interleaved" if name == "merge_interleaved" else "contiguous"
        a = progs[name][1]
        if layout == "interleaved":  # the same natural-order cache, laid out interleaved
            order = np.concatenate([np.arange(j, s, c) for j in range(c)])
            a = (q, jax.device_put(k[:, order], split), jax.device_put(v[:, order], split), qp, kl)
        err = float(np.max(np.abs(np.asarray(progs[name][0](*a)) - ref)))
        if err > 1e-4:
            raise SystemExit(f"{name} differs from one_device by {err:.2e}: a bug, not a benchmark result.")
    return out, fill


def main(argv=None) -> str:
    """Runs the benchmark; returns (and with ``--out`` writes) its markdown."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=8, help="fake CPU devices = context shards (default 8)")
    p.add_argument("--slots", type=int, default=65536, help="cache slots S (a multiple of --context)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--queries", type=int, default=1, help="queries per step T (1: one decode step)")
    p.add_argument("--heads", type=int, default=8, help="query heads N")
    p.add_argument("--kv_heads", type=int, default=2, help="key/value heads K (GQA)")
    p.add_argument("--head_dim", type=int, default=64, help="D = Dv")
    p.add_argument("--fill", type=float, default=0.1, help="written fraction of the cache (the layouts' table)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    c, s = args.context, args.slots
    if c < 2 or s % c or not 0 < args.fill <= 1 or args.heads % args.kv_heads:
        raise SystemExit("--context >= 2 must divide --slots, --kv_heads divide --heads, and 0 < --fill <= 1.")
    mesh = jax.make_mesh((c,), ("context",), axis_types=(jax.sharding.AxisType.Auto,))
    variants, fill = _variants(args, mesh)
    benchmarking.measure(variants, args.repeats)
    load = os.getloadavg()[0]
    b, t, n, kh, d = args.batch, args.queries, args.heads, args.kv_heads, args.head_dim
    moved = {"pmax_m": b * t * n * 4, "psum_o": b * t * n * d * 4, "psum_l": b * t * n * 4,
             "all_gather": 2 * (c - 1) * (s // c) * b * kh * d * 4}
    moved["merge"] = moved["merge_interleaved"] = moved["pmax_m"] + moved["psum_o"] + moved["psum_l"]
    md = [f"# Decode step against a KV cache split over context={c} ({datetime.date.today()})", "",
          f"Command: `python experiments/bench_decode_merge.py {' '.join(sys.argv[1:] if argv is None else argv)}`  ",
          f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores shared by the {c} fake devices, "
          f"jax {jax.__version__}; float32; B={b}, T={t}, N={n}, K={kh}, D=Dv={d}, S={s} slots "
          f"({s // c} per shard), {fill} written. Medians of {args.repeats} rounds (rotated order); load "
          f"average {load:.1f} at the end (other jobs on the machine slow every row alike).", "",
          "| program | median ms (wall) | median ms (process CPU) | bytes per device (all-reduce: the array; "
          "all-gather: received) |", "|---|---|---|---|"]
    for var in variants:
        med = lambda xs: 1e3 * sorted(xs)[len(xs) // 2]
        md.append(f"| {var.name} | {med(var.times):.3f} | {med(var.cpu):.3f} | "
                  f"{moved.get(var.name, 0):,} |")
    counts = {}
    for layout in decode_merge.LAYOUTS:
        counts[layout] = [int(np.sum(np.asarray(decode_merge.slot_positions(s // c, c, j, layout)) < fill))
                          for j in range(c)]
    md += ["", f"Written slots per shard with {fill} of {s} written (what a kernel that stops at the "
           "written length would scan; the dense merge above scans all S / c on every shard):", "",
           "| layout | busiest shard | idlest shard | per shard |", "|---|---|---|---|"]
    md += [f"| {layout} | {max(x)} | {min(x)} | {', '.join(map(str, x))} |" for layout, x in counts.items()]
    text = "\n".join(md) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return text


if __name__ == "__main__":
    from goat_jax import platforms  # pylint: disable=g-import-not-at-top
    platforms.avoid_libtpu_without_tpu()  # before any JAX backend starts (goat_jax/platforms.py)
    main()
