"""Forward+backward time and compiled memory: GOAT vs plain attention and positional baselines.

What is compared, at equal B, T = S = L, N, H and ``loss = sum(outputs)`` (causal):

* ``core``: attention on given q/k/v [B, L, N, H], gradients w.r.t. q, k, v (and the prior's
  parameters where there are any): plain ``kernels.attend``; GOAT (prior features from
  ``goat_jax.prior``, ``goat_jax.prior.packing.pack_query``/``pack_key``, attend at scale 1); RoPE; ALiBi
  as a materialized bias; ALiBi packed; the naive learned L x L prior.
* ``layer``: the whole Flax layer (projections included), gradients w.r.t. the parameters:
  ``GoatAttention`` vs ``PositionalAttention`` ('nope' = plain, 'rope', 'alibi', ...), plus
  the official PyTorch ``goat.GoatAttention`` and a plain PyTorch SDPA layer (CPU, float32,
  ``torch.set_num_threads`` = the core count JAX uses). ``--layer-encodings`` adds rows for
  more ``PositionalAttention`` encodings (e.g. ``yarn,ntk,rope+logn``: ``+logn`` adds log-n
  scaling of the content logits), each with ``training_seq_len = L / 4`` so that the
  length-dependent ones (rope_pi, ntk, yarn, log-n) run past their training length.
* ``profile`` (core, GOAT split up): the kernel alone on pre-packed q~/k~, and GOAT with the
  prior features precomputed, to see where any extra time goes (features vs. concatenation).

Timing: jit, one warm-up call after compiling, then ``--repeats`` rounds; in every round each
variant runs once, in a rotated order, so machine noise hits all variants alike; the median is
reported. Memory: ``jit(f).lower(...).compile().memory_analysis()``, temp + argument + output
bytes (what XLA allocates for one step, parameters and gradients included).

* ``long`` (``--sections long``, lengths ``--long-lengths``): the memory-efficient kernel at long
  context: the GOAT layer on ``implementation='flash'`` vs ``'xla'`` vs the official PyTorch
  layer, and the plain kernel on both, forward+backward. A variant whose compiled memory exceeds
  ``--max-run-fraction`` of the machine's available memory is compiled (memory reported) but
  not run. With ``--update`` the section replaces its marked block in ``--out`` and leaves the
  rest of the file alone:

  python experiments/bench_attention.py --sections long --repeats 3 --update \
      --out benchmarks/attention.md

``--gpu``: a bf16 section on cuDNN flash attention up to long L (bias-based variants on XLA, up
to ``--gpu-bias-max-len``); skipped cleanly when JAX has no GPU. Needs only jax/flax (no
tensorflow or ml_collections).

  python experiments/bench_attention.py --lengths 512 1024 2048 4096 --repeats 5 \
      --out benchmarks/attention.md
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import platform
import statistics
import sys
from typing import Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from goat_jax.layers import goat as attn_lib  # noqa: E402
from goat_jax.benchmarking import Variant, jax_variant, measure  # noqa: E402
from goat_jax import kernels  # noqa: E402
from goat_jax import positional as pos_lib  # noqa: E402
from goat_jax.layers.positional import PositionalAttention  # noqa: E402
from goat_jax import prior as prior_lib  # noqa: E402
from goat_jax.prior import packing  # noqa: E402

MiB = 2.0**20


# ----------------------------------------------------------------------------------------------
# Core: attention on given q/k/v
# ----------------------------------------------------------------------------------------------


def core_variants(b: int, length: int, n: int, h: int, dtype, impl: str, rng, bias_ok: bool,
                  profile: bool, pos_rank: int, abs_rank: int) -> List[Variant]:
    shape = (b, length, n, h)
    q, k, v = (jnp.asarray(rng.normal(size=shape), dtype) for _ in range(3))
    pos = prior_lib.positions_1d(length)
    scale = 1.0 / math.sqrt(h)
    attend = lambda q_, k_, v_, **kw: kernels.attend(q_, k_, v_, implementation=kw.pop("impl", impl),
                                                      is_causal=True, **kw)
    out = []

    plain = lambda q_, k_, v_: jnp.sum(attend(q_, k_, v_, scale=scale).astype(jnp.float32))
    out.append(jax_variant("plain", plain, (q, k, v), (0, 1, 2)))

    # GOAT: prior parameters as the module initializes them ('seeded'), trained too.
    spec = prior_lib.PriorSpec(num_heads=n, kv_num_heads=n, pos_rank=pos_rank, abs_rank=abs_rank)
    pp = attn_lib.GoatPrior(spec).init(
        jax.random.PRNGKey(0), prior_lib.positions_1d(4), prior_lib.positions_1d(4), True)["params"]
    d_c = spec.content_dim(h)
    channels = packing.default_sink_channels(dtype)

    def pack(q_, k_, pp_):
        q_rel, q_sink = prior_lib.query_features(spec, pp_, pos)
        k_rel, u = prior_lib.key_features(spec, pp_, pos, True)
        return (packing.pack_query(q_[..., :d_c], q_rel, q_sink, channels, dtype),
                packing.pack_key(k_[..., :d_c], k_rel, u, channels, dtype))

    def goat(q_, k_, v_, pp_):
        qp, kp = pack(q_, k_, pp_)
        return jnp.sum(attend(qp, kp, v_, scale=1.0).astype(jnp.float32))

    out.append(jax_variant("goat", goat, (q, k, v, pp), (0, 1, 2, 3)))

    rope = lambda q_, k_, v_: jnp.sum(attend(pos_lib.apply_rope(q_, pos.index), pos_lib.apply_rope(k_, pos.index),
                                             v_, scale=scale).astype(jnp.float32))
    out.append(jax_variant("rope", rope, (q, k, v), (0, 1, 2)))

    def alibi_packed(q_, k_, v_):
        qp = pos_lib.pack_alibi_query(q_, 1, channels, dtype)
        kp = pos_lib.pack_alibi_key(k_, pos.index, n, channels, dtype)
        return jnp.sum(attend(qp, kp, v_, scale=1.0).astype(jnp.float32))

    out.append(jax_variant("alibi_packed", alibi_packed, (q, k, v), (0, 1, 2)))

    if bias_ok:
        bias_impl = "xla"  # flash kernels take no additive bias
        alibi = lambda q_, k_, v_: jnp.sum(attend(q_, k_, v_, scale=scale, impl=bias_impl,
                                                  bias=pos_lib.alibi_bias(n, pos.index, pos.index)).astype(jnp.float32))
        out.append(jax_variant("alibi_bias", alibi, (q, k, v), (0, 1, 2)))
        table = jnp.zeros((n, length, length), jnp.float32)  # the naive prior at max_len = L
        naive = lambda q_, k_, v_, t_: jnp.sum(attend(q_, k_, v_, scale=scale, impl=bias_impl,
                                                      bias=t_[None]).astype(jnp.float32))
        out.append(jax_variant("naive_LxL", naive, (q, k, v, table), (0, 1, 2, 3)))

    if profile:
        # The kernel alone on pre-packed inputs (same packed dim as GOAT).
        qp, kp = jax.jit(pack)(q, k, pp)
        kernel = lambda q_, k_, v_: jnp.sum(attend(q_, k_, v_, scale=1.0).astype(jnp.float32))
        out.append(jax_variant("goat:kernel_only", kernel, (qp, kp, v), (0, 1, 2)))
        # Features precomputed (inputs), only slicing + concatenation + kernel.
        q_rel, q_sink = prior_lib.query_features(spec, pp, pos)
        k_rel, u = prior_lib.key_features(spec, pp, pos, True)

        def packed_only(q_, k_, v_, q_rel_, q_sink_, k_rel_, u_):
            qp_ = packing.pack_query(q_[..., :d_c], q_rel_, q_sink_, channels, dtype)
            kp_ = packing.pack_key(k_[..., :d_c], k_rel_, u_, channels, dtype)
            return jnp.sum(attend(qp_, kp_, v_, scale=1.0).astype(jnp.float32))

        out.append(jax_variant("goat:no_features", packed_only, (q, k, v, q_rel, q_sink, k_rel, u),
                               (0, 1, 2, 3, 4, 5, 6)))
        # GOAT's extra work alone (features + slicing + concatenation, no attention), and RoPE's.
        prior_only = lambda q_, k_, pp_: sum(jnp.sum(x.astype(jnp.float32)) for x in pack(q_, k_, pp_))
        out.append(jax_variant("goat:prior_only", prior_only, (q, k, pp), (0, 1, 2)))
        rot_only = lambda q_, k_: (jnp.sum(pos_lib.apply_rope(q_, pos.index).astype(jnp.float32))
                                   + jnp.sum(pos_lib.apply_rope(k_, pos.index).astype(jnp.float32)))
        out.append(jax_variant("rope:rotation_only", rot_only, (q, k), (0, 1)))
    return out


# ----------------------------------------------------------------------------------------------
# Layer: the Flax modules, and the official PyTorch layer
# ----------------------------------------------------------------------------------------------


def extra_layer(spec: str, n: int, length: int, dtype, impl: Optional[str]):
    """The PositionalAttention of a ``--layer-encodings`` entry ``ENCODING[+logn]``; ValueError
    naming the flag for an unknown encoding."""
    encoding, _, option = spec.partition("+")
    if encoding not in pos_lib.POSITION_ENCODINGS or option not in ("", "logn"):
        raise ValueError(f"--layer-encodings: {spec!r} is not ENCODING[+logn] with ENCODING one of "
                         f"{pos_lib.POSITION_ENCODINGS}.")
    enc = pos_lib.get_encoding(encoding)
    return enc, PositionalAttention(
        num_heads=n, position_encoding=encoding, dtype=dtype, implementation=None if enc.materialized_bias else impl,
        training_seq_len=max(2, length // 4), max_len=length, logn_scaling="content" if option else None)


def layer_variants(b: int, length: int, n: int, h: int, dtype, impl: Optional[str], rng, bias_ok: bool,
                   pos_rank: int, abs_rank: int, extra: Sequence[str] = ()) -> List[Variant]:
    e = n * h
    x = jnp.asarray(rng.normal(size=(b, length, e)), jnp.float32)
    mods = {
        "plain": PositionalAttention(num_heads=n, position_encoding="nope", dtype=dtype, implementation=impl),
        "goat": attn_lib.GoatAttention(num_heads=n, prior=prior_lib.PriorSettings(pos_rank=pos_rank, abs_rank=abs_rank),
                                       dtype=dtype, implementation=impl),
        "rope": PositionalAttention(num_heads=n, position_encoding="rope", dtype=dtype, implementation=impl),
        "alibi_packed": PositionalAttention(num_heads=n, position_encoding="alibi_packed", dtype=dtype,
                                                    implementation=impl),
        # FoX packs its forget-gate bias into q/k channels, so it runs on the same kernel.
        "fox": PositionalAttention(num_heads=n, position_encoding="fox", dtype=dtype, implementation=impl),
    }
    if bias_ok:
        mods["alibi_bias"] = PositionalAttention(num_heads=n, position_encoding="alibi", dtype=dtype)
        mods["naive_LxL"] = PositionalAttention(num_heads=n, position_encoding="naive_prior",
                                                        max_len=length, dtype=dtype)
        mods["fire"] = PositionalAttention(num_heads=n, position_encoding="fire", dtype=dtype)
        mods["kerple_log"] = PositionalAttention(num_heads=n, position_encoding="kerple_log", dtype=dtype)
    for spec in extra:  # after the standard rows, which keep their names and meaning
        enc, mod = extra_layer(spec, n, length, dtype, impl)
        if bias_ok or not enc.materialized_bias:
            mods[spec] = mod
    out = []
    for name, mod in mods.items():
        params = jax.jit(lambda x_, m=mod: m.init(jax.random.PRNGKey(0), x_, is_causal=True))(x)["params"]
        loss = lambda p, x_, m=mod: jnp.sum(m.apply({"params": p}, x_, is_causal=True).astype(jnp.float32))
        out.append(jax_variant(name, loss, (params, x), (0,)))
        del params
    return out


def torch_variants(b: int, length: int, n: int, h: int, threads: int) -> List[Variant]:
    """The official PyTorch GOAT layer and a plain SDPA layer with the same projections."""
    try:
        import torch
        import goat
    except ImportError as err:  # the GPU image may lack them
        print(f"torch section skipped: {err}")
        return []
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    e = n * h
    x = torch.randn(b, length, e)
    official = goat.GoatAttention(embed_dim=e, num_heads=n, batch_first=True, pos_encoding="1d")

    class PlainSDPA(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (torch.nn.Linear(e, e) for _ in range(4))

        def forward(self, x_):
            split = lambda y: y.view(b, length, n, h).transpose(1, 2)  # [B, N, L, H]
            o = torch.nn.functional.scaled_dot_product_attention(
                split(self.q(x_)), split(self.k(x_)), split(self.v(x_)), is_causal=True)
            return self.o(o.transpose(1, 2).reshape(b, length, e))

    plain = PlainSDPA()

    def step(module, call):
        def run():
            module.zero_grad(set_to_none=True)
            call().sum().backward()
        return run

    return [
        Variant("torch_plain_sdpa", step(plain, lambda: plain(x)), None),
        Variant("torch_goat_official", step(official, lambda: official(
            x, x, x, is_causal=True, need_weights=False)[0]), None),
    ]


# ----------------------------------------------------------------------------------------------
# Timing and reporting
# ----------------------------------------------------------------------------------------------


def rows_for(section: str, length: int, variants: List[Variant], base: str = "plain",
             torch_base: str = "torch_plain_sdpa") -> List[Dict]:
    med = {v.name: statistics.median(v.times) for v in variants}
    cpu = {v.name: statistics.median(v.cpu) for v in variants}
    mem = {v.name: v.memory for v in variants}
    rows = []
    for v in variants:
        ref = torch_base if v.name.startswith("torch") else base
        rows.append(dict(section=section, L=length, name=v.name, ms=1e3 * med[v.name],
                         t_ratio=med[v.name] / med[ref] if ref in med else None,
                         cpu_ms=1e3 * cpu[v.name], c_ratio=cpu[v.name] / cpu[ref] if ref in cpu else None,
                         mib=None if mem[v.name] is None else mem[v.name] / MiB,
                         m_ratio=(mem[v.name] / mem[ref]) if mem[v.name] and mem.get(ref) else None,
                         spread=1e3 * (max(v.times) - min(v.times))))
        print(f"  {section:6s} L={length:6d} {v.name:22s} {rows[-1]['ms']:9.1f} ms "
              f"x{rows[-1]['t_ratio'] or float('nan'):.3f}  cpu {rows[-1]['cpu_ms']:9.1f} ms "
              f"x{rows[-1]['c_ratio'] or float('nan'):.3f}  mem {rows[-1]['mib'] or float('nan'):9.1f} MiB "
              f"x{rows[-1]['m_ratio'] or float('nan'):.3f}", flush=True)
    return rows


def run_section(title: str, lengths: Sequence[int], args, dtype, impl: Optional[str], bias_max_len: int,
                with_torch: bool) -> List[Dict]:
    print(f"== {title}", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    for length in lengths:
        bias_ok = length <= bias_max_len
        if "core" in args.sections:
            vs = core_variants(args.batch, length, args.heads, args.head_dim, dtype, impl or "xla", rng, bias_ok,
                               "profile" in args.sections, args.pos_rank, args.abs_rank)
            measure(vs, args.repeats)
            rows += rows_for("core", length, vs)
            del vs
            gc.collect()
        if "layer" in args.sections:
            vs = layer_variants(args.batch, length, args.heads, args.head_dim, dtype, impl, rng, bias_ok,
                                args.pos_rank, args.abs_rank, args.layer_encodings)
            if with_torch and "torch" in args.sections:
                vs += torch_variants(args.batch, length, args.heads, args.head_dim, args.threads)
            measure(vs, args.repeats)
            rows += rows_for("layer", length, vs)
            del vs
            gc.collect()
    return rows


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def markdown_table(rows: List[Dict]) -> str:
    lines = ["| section | L | variant | wall ms | wall / plain | CPU ms | CPU / plain | compiled MiB | memory / plain |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['section']} | {r['L']} | {r['name']} | {r['ms']:.1f} | {fmt(r['t_ratio'], '.3f')} | "
                     f"{r['cpu_ms']:.1f} | {fmt(r['c_ratio'], '.3f')} | "
                     f"{fmt(r['mib'], '.1f')} | {fmt(r['m_ratio'], '.3f')} |")
    return "\n".join(lines)


def acceptance(rows: List[Dict]) -> str:
    """The core targets at L >= 1024: GOAT <= 1.05x plain time and <= 1.02x plain memory, and
    <= 1.02x RoPE time; wall and CPU time. ``goat:kernel_only`` does exactly plain's work, so
    its ratio to plain is the run's noise floor."""
    lines = ["| L | GOAT/plain wall (<= 1.05) | GOAT/plain CPU | GOAT/plain memory (<= 1.02) | "
             "GOAT/RoPE wall (<= 1.02) | GOAT/RoPE CPU | noise floor: kernel_only/plain wall, CPU |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    mark = lambda x, limit: "-" if x is None else f"{x:.3f} " + ("ok" if x <= limit else "**miss**")
    core = [r for r in rows if r["section"] == "core"]
    for length in sorted({r["L"] for r in core}):
        by = {r["name"]: r for r in core if r["L"] == length}
        if "goat" not in by or length < 1024:
            continue
        g, rope = by["goat"], by["rope"]
        floor = by.get("goat:kernel_only")
        floor_txt = "-" if floor is None else f"{floor['t_ratio']:.3f}, {floor['c_ratio']:.3f}"
        lines.append(f"| {length} | {mark(g['t_ratio'], 1.05)} | {mark(g['c_ratio'], 1.05)} | "
                     f"{mark(g['m_ratio'], 1.02)} | {mark(g['ms'] / rope['ms'], 1.02)} | "
                     f"{mark(g['cpu_ms'] / rope['cpu_ms'], 1.02)} | {floor_txt} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Long context: the flash kernel vs XLA vs the official PyTorch layer
# ----------------------------------------------------------------------------------------------

LONG_BEGIN, LONG_END = "<!-- long-context: begin -->", "<!-- long-context: end -->"


def available_bytes() -> int:
    """MemAvailable from /proc/meminfo (the machine may be shared), or a large number."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 50


def guard(var: Variant, fraction: float) -> Variant:
    """Leaves ``var`` unrun (memory still reported) if it would not fit in memory."""
    budget = fraction * available_bytes()
    if var.memory is not None and var.memory > budget:
        var.run = None
        var.note = f"not run: needs {var.memory / 2**30:.1f} GiB > {budget / 2**30:.1f} GiB ({fraction:.0%} of available)"
        print(f"  {var.name}: {var.note}", flush=True)
    return var


def long_variants(args, length: int, rng) -> List[Variant]:
    b, n, h = args.batch, args.heads, args.head_dim
    x = jnp.asarray(rng.normal(size=(b, length, n * h)), jnp.float32)
    out = []
    for impl in ("xla", "flash"):
        mod = attn_lib.GoatAttention(num_heads=n, prior=prior_lib.PriorSettings(pos_rank=args.pos_rank, abs_rank=args.abs_rank),
                                     dtype=jnp.float32, implementation=impl)
        params = jax.jit(lambda x_, m=mod: m.init(jax.random.PRNGKey(0), x_[:, :8], is_causal=True))(x)["params"]
        loss = lambda p, x_, m=mod: jnp.sum(m.apply({"params": p}, x_, is_causal=True))
        out.append(guard(jax_variant(f"goat_layer:{impl}", loss, (params, x), (0,)), args.max_run_fraction))
    q, k, v = (jnp.asarray(rng.normal(size=(b, length, n, h)), jnp.float32) for _ in range(3))
    long = length >= args.long_from
    for impl in ("xla", "flash"):
        loss = lambda q_, k_, v_, i=impl: jnp.sum(kernels.attend(q_, k_, v_, implementation=i, scale=h ** -0.5,
                                                                 is_causal=True))
        var = guard(jax_variant(f"plain_core:{impl}", loss, (q, k, v), (0, 1, 2)), args.max_run_fraction)
        if long and var.run is not None:  # the layer rows carry the timing; keep the run short
            var.run, var.note = None, "memory only (not timed at this length)"
        out.append(var)
    torch_vs = torch_variants(b, length, n, h, args.threads)
    return out + [v for v in torch_vs if not (long and v.name == "torch_plain_sdpa")]


def run_long(args) -> List[Dict]:
    print("== long context: flash vs xla vs torch", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    for length in args.long_lengths:
        vs = long_variants(args, length, rng)
        if length >= args.long_from:  # minutes per call: one timed call each, no warm-up call
            measure(vs, args.long_repeats, warmup=False)
        else:
            measure(vs, args.repeats)
        for v in vs:
            ran = bool(v.cpu)
            rows.append(dict(L=length, name=v.name, note=v.note,
                             ms=1e3 * statistics.median(v.times) if ran else None,
                             cpu_ms=1e3 * statistics.median(v.cpu) if ran else None,
                             mib=None if v.memory is None else v.memory / MiB))
            r = rows[-1]
            print(f"  long L={length:6d} {v.name:22s} cpu {fmt(r['cpu_ms'], '9.1f')} ms  wall "
                  f"{fmt(r['ms'], '9.1f')} ms  mem {fmt(r['mib'], '9.1f')} MiB {v.note}", flush=True)
        del vs
        gc.collect()
    return rows


def long_tables(rows: List[Dict]) -> str:
    lines = ["| L | variant | CPU ms | wall ms | compiled MiB | note |", "|---:|---|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['L']} | {r['name']} | {fmt(r['cpu_ms'], '.1f')} | {fmt(r['ms'], '.1f')} | "
                     f"{fmt(r['mib'], '.1f')} | {r['note']} |")
    lines += ["", "Targets (CPU-time and memory ratios from the rows above):", "",
              "| L | GOAT layer memory flash / XLA (<= 1/8 at 8192) | kernel memory flash / XLA | "
              "GOAT layer flash / official torch, CPU (<= 1 at L >= 2048) | GOAT layer flash / XLA, CPU "
              "(<= 1 at 1024) |", "|---:|---:|---:|---:|---:|"]

    def ratio(a, b, key):
        return None if a is None or b is None or a.get(key) is None or b.get(key) is None else a[key] / b[key]

    for length in sorted({r["L"] for r in rows}):
        by = {r["name"]: r for r in rows if r["L"] == length}
        lines.append(
            f"| {length} | {fmt(ratio(by.get('goat_layer:flash'), by.get('goat_layer:xla'), 'mib'), '.4f')} | "
            f"{fmt(ratio(by.get('plain_core:flash'), by.get('plain_core:xla'), 'mib'), '.4f')} | "
            f"{fmt(ratio(by.get('goat_layer:flash'), by.get('torch_goat_official'), 'cpu_ms'), '.3f')} | "
            f"{fmt(ratio(by.get('goat_layer:flash'), by.get('goat_layer:xla'), 'cpu_ms'), '.3f')} |")
    return "\n".join(lines)


def cpu_info() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {len(os.sched_getaffinity(0))} cores available to this process"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--pos-rank", type=int, default=8, help="GOAT R (GoatAttention default)")
    parser.add_argument("--abs-rank", type=int, default=8, help="GOAT M (GoatAttention default)")
    parser.add_argument("--sections", default="core,layer,torch,profile",
                        help="comma-separated subset of core,layer,torch,profile, or 'long' alone")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="torch.set_num_threads (default: the cores XLA uses)")
    parser.add_argument("--long-lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384],
                        help="lengths of the 'long' section (flash vs xla vs torch)")
    parser.add_argument("--long-from", type=int, default=8192,
                        help="'long' section: from this length on, --long-repeats timed calls without a "
                             "warm-up call, and the plain-kernel rows report memory only")
    parser.add_argument("--long-repeats", type=int, default=1)
    parser.add_argument("--max-run-fraction", type=float, default=0.6,
                        help="'long' section: do not run a variant whose compiled memory exceeds this "
                             "fraction of the available memory (its memory is still reported)")
    parser.add_argument("--update", action="store_true",
                        help="with --sections long: replace only the long-context block of --out")
    parser.add_argument("--gpu", action="store_true", help="also run the bf16 cuDNN section (GPU only)")
    parser.add_argument("--gpu-lengths", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--gpu-bias-max-len", type=int, default=16384,
                        help="longest L for the materialized-bias variants on GPU")
    parser.add_argument("--out", default=None, help="markdown file to write (e.g. benchmarks/attention.md)")
    parser.add_argument("--layer-encodings", default="", help="layer section: more PositionalAttention "
                        "rows, comma list of ENCODING[+logn], e.g. yarn,ntk,rope+logn (training_seq_len L/4)")
    args = parser.parse_args(argv)
    args.sections = set(args.sections.split(","))
    args.layer_encodings = [e for e in args.layer_encodings.split(",") if e]
    for spec in args.layer_encodings:  # refuse a bad entry before any benchmark runs
        extra_layer(spec, args.heads, 8, jnp.float32, None)

    command = "python experiments/bench_attention.py " + " ".join(argv if argv is not None else sys.argv[1:])
    backend = jax.default_backend()
    header = [
        "# Attention benchmark: GOAT vs plain attention and positional baselines", "",
        f"Command: `{command}`", "",
        f"Date: {datetime.datetime.now().isoformat(timespec='seconds')}; jax {jax.__version__} "
        f"(backend {backend}); CPU: {cpu_info()}; B={args.batch}, N={args.heads}, H={args.head_dim}, "
        f"causal, loss = sum(outputs), GOAT R={args.pos_rank}, M={args.abs_rank}; load average at "
        f"start {os.getloadavg()[0]:.1f}.", "",
    ]
    try:
        import torch
        header[-2] += f" torch {torch.__version__} with {args.threads} threads."
    except ImportError:
        pass

    if args.sections == {"long"}:
        return write_long(args, command, backend)

    body = []
    rows = run_section(f"{backend} float32 xla", args.lengths, args, jnp.float32, "xla",
                       bias_max_len=max(args.lengths), with_torch=backend == "cpu")
    body += [f"## {backend}, float32, implementation='xla'", "", markdown_table(rows), "",
             "### Core acceptance (GOAT vs plain / RoPE, same run)", "", acceptance(rows), ""]

    if args.gpu:
        if backend != "gpu":
            print(f"--gpu: skipped (JAX backend is '{backend}', no GPU).")
            body += ["## GPU (bf16, cuDNN)", "", f"Skipped: JAX backend was '{backend}'.", ""]
        else:
            gpu_rows = run_section("gpu bf16 cudnn", args.gpu_lengths, args, jnp.bfloat16, "cudnn",
                                   bias_max_len=args.gpu_bias_max_len, with_torch=False)
            body += ["## GPU, bfloat16, implementation='cudnn' (bias variants on 'xla')", "",
                     markdown_table(gpu_rows), "", acceptance(gpu_rows), ""]

    notes = [
        "## Notes", "",
        "* Each L: compile, one warm-up call, then `--repeats` rounds running every variant once "
        "in a rotated order; medians. *CPU* = process CPU time (all threads), robust to other "
        "processes on a shared machine; *wall* is what a user waits. `memory` = compiled "
        "temp + argument + output bytes (`memory_analysis()`), parameters and gradients included.",
        "* core: attention on given q/k/v, gradients w.r.t. q, k, v (+ prior parameters / the L x L "
        "table). layer: the whole Flax layer, gradients w.r.t. parameters; torch rows are the "
        "official `goat.GoatAttention` (pos_encoding='1d') and a plain SDPA layer, both forward + "
        "backward in float32, ratios to the torch plain layer.",
        "* Profile rows: `goat:kernel_only` = the kernel on pre-packed q~/k~ (the same work as "
        "plain: its ratio is the noise floor); `goat:no_features` = slicing + concatenation + "
        "kernel with the prior features given; `goat:prior_only` / `rope:rotation_only` = GOAT's "
        "features + packing / RoPE's rotation alone (no attention), forward + backward.",
        f"* Load average at the end: {os.getloadavg()[0]:.1f}.", ""]
    text = "\n".join(header + body + notes)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}")
    else:
        print(text)


def write_long(args, command: str, backend: str) -> None:
    """Runs the 'long' section and writes it (between markers, with --update) to --out."""
    load0 = os.getloadavg()[0]
    rows = run_long(args)
    block = "\n".join([
        LONG_BEGIN,
        "## Long context: `implementation='flash'` vs XLA vs the official PyTorch layer", "",
        f"Command: `{command}`", "",
        f"Date: {datetime.datetime.now().isoformat(timespec='seconds')}; jax {jax.__version__} (backend "
        f"{backend}); CPU: {cpu_info()}; float32, causal, B={args.batch}, N={args.heads}, H={args.head_dim}, "
        f"GOAT R={args.pos_rank}, M={args.abs_rank}, loss = sum(outputs), forward+backward (gradients "
        f"w.r.t. the layer parameters / q, k, v); torch with {args.threads} threads; {args.repeats} rounds "
        f"(medians) after a warm-up call below L = {args.long_from}, {args.long_repeats} timed call(s) and no "
        f"warm-up from there on (compiled ahead, so no compile time is timed); load average {load0:.1f} at start, {os.getloadavg()[0]:.1f} at "
        "the end (the machine is shared with other jobs: read the CPU-time column).", "",
        "`goat_layer:*` = the whole `GoatAttention` layer (projections included); `plain_core:*` = "
        "`kernels.attend` on given q/k/v; torch rows = the official `goat.GoatAttention` and a plain "
        "SDPA layer. Compiled MiB = temp + argument + output bytes from `memory_analysis()`.", "",
        long_tables(rows), "", LONG_END])
    if not args.out:
        print(block)
        return
    text = ""
    if args.update and os.path.exists(args.out):
        with open(args.out) as f:
            text = f.read()
    if LONG_BEGIN in text and LONG_END in text:
        head, rest = text.split(LONG_BEGIN, 1)
        text = head + block + rest.split(LONG_END, 1)[1]
    else:
        text = (text.rstrip("\n") + "\n\n" if text else "") + block + "\n"
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    from goat_jax import platforms  # pylint: disable=g-import-not-at-top
    platforms.avoid_libtpu_without_tpu()  # before any JAX backend starts (goat_jax/platforms.py)
    main()
