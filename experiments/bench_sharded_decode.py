"""Greedy decoding tokens/s against a KV cache of S slots, on one device and with the cache's slots
split over ``context`` fake CPU devices, side by side in one process.

A random-parameter model of ``--config`` (the decoder's cost does not depend on the weights) makes
a cache of each ``--slots`` S, prefills a ``--prompt``-token prompt in one chunk, then decodes
``--new_tokens`` greedy tokens in one jitted ``lax.scan`` (the loop of
:func:`goat_jax.models.sampling.generate`: the model's own decode call, one token per step). What is
timed is that decode loop alone (the prefill runs once, before), ``--repeats`` times after a warm-up
run, median; tokens/s = batch x new tokens / seconds. Context 1 is one device and no mesh; context
c > 1 is a mesh whose one split axis is ``context`` (as ``experiments.sample --mesh_context c``
makes it), the parameters replicated, the cache laid out by the config's logical rules (its slots
over ``context``, :func:`goat_jax.aot.decode.cache_shardings`), and the layer's decode branch
attends it with the split-cache merge (goat_jax/kernels/decode_merge.py). The greedy tokens of
every context are compared with context 1's, per cache size.

The merge scores every slot of a shard, written or not (as the one-device kernel scores every
slot of the cache), so the time per token depends on S, not on how full the cache is. Fake
devices share the host's cores: a split cache does the same total work in c pieces plus three
small collectives per layer, so on a CPU host it shows what the split costs, not the speed-up of
c chips each reading 1/c of the cache from its own memory.

    python experiments/bench_sharded_decode.py --slots 8192 32768 131072 --contexts 1 4
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time


def _devices_from_argv(argv) -> int:
    for i, a in enumerate(argv):
        if a == "--devices" and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith("--devices="):
            return int(a.split("=", 1)[1])
    return 8


# Fake CPU devices must be asked for before JAX starts.
_COUNT = f"--xla_force_host_platform_device_count={_devices_from_argv(sys.argv)}"
os.environ["XLA_FLAGS"] = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), _COUNT) if f)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import contextlib  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from goat_jax.aot import decode as aot_decode  # noqa: E402
from goat_jax.config.files import load_config  # noqa: E402
from goat_jax.kernels.plan import AttentionPlan  # noqa: E402
from goat_jax.train import sharding, tasks  # noqa: E402


def _programs(model, batch: int, slots: int, new_tokens: int):
    """``(empty cache (abstract), prefill, decode)``: ``prefill(params, cache, prompt) -> (cache,
    first token [B])``; ``decode(params, cache, token) -> tokens [B, new_tokens - 1]``, the greedy
    loop. Traced under whatever mesh is in context when they are called."""
    decoder = model.clone(decode=True)
    abstract = jax.eval_shape(lambda: decoder.init(jax.random.PRNGKey(0), jnp.zeros((batch, slots), jnp.int32)))
    abstract = abstract["cache"]

    def feed(params, cache, tokens):
        logits, state = decoder.apply({"params": params, "cache": cache}, tokens, mutable=["cache"])
        return state["cache"], jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)

    prefill = jax.jit(feed)

    @jax.jit
    def decode(params, cache, token):
        def step(carry, _):
            cache_, token_ = carry
            cache_, nxt = feed(params, cache_, token_[:, None])
            return (cache_, nxt), nxt
        _, tokens = jax.lax.scan(step, (cache, token), None, length=new_tokens - 1)
        return tokens.T

    return abstract, prefill, decode


def _one(config, model, params, slots: int, context: int, args) -> dict:
    """Runs one (cache size, context) setting; returns its row."""
    mesh = None
    if context > 1:
        mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "context": context, "tensor": 1}, jax.devices()[:context])
        params = jax.device_put(params, NamedSharding(mesh, P()))
    on_mesh = (lambda: jax.set_mesh(mesh)) if mesh is not None else contextlib.nullcontext
    with on_mesh():
        abstract, prefill, decode = _programs(model, args.batch, slots, args.new_tokens)
        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), nn.unbox(abstract))
        # The cache's slots over context, as experiments.compile --step decode lays it out (on a
        # mesh of the one device at context 1, for the byte count only).
        layout = mesh if mesh is not None else sharding.make_mesh(
            {"data": 1, "fsdp": 1, "context": 1, "tensor": 1}, jax.devices()[:1])
        shardings = aot_decode.cache_shardings(abstract, layout, sharding.rules_from_config(config.sharding_rules),
                                               bool(model.config.scan_layers))
        total, per_device = aot_decode.cache_bytes(abstract, shardings)
        if mesh is not None:
            zeros = jax.device_put(zeros, shardings)
        prompt = jnp.asarray(np.random.default_rng(0).integers(3, 259, (args.batch, args.prompt)), jnp.int32)
        cache, first = prefill(params, zeros, prompt)
        # The collectives of the compiled loop: the split cache's merge (pmax, two psums per layer).
        reductions = decode.lower(params, cache, first).compile().as_text().count("all-reduce(")
        jax.block_until_ready(decode(params, cache, first))  # warm-up
        seconds = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            tokens = jax.block_until_ready(decode(params, cache, first))
            seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds)
    steps = args.new_tokens - 1
    return {"slots": slots, "context": context, "all_reduces": reductions, "cache_total": total, "cache_per_device": per_device,
            "ms_per_token": 1e3 * median / steps, "tokens_per_s": args.batch * steps / median,
            "tokens": np.concatenate([np.asarray(first)[:, None], np.asarray(tokens)], axis=1)}


def main(argv=None) -> str:
    """Runs the benchmark; returns (and with ``--out`` writes) its markdown."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/lm_tiny.py:goat")
    p.add_argument("--slots", type=int, nargs="+", default=[8192, 32768], help="cache sizes S")
    p.add_argument("--contexts", type=int, nargs="+", default=[1, 4], help="devices the cache is split over")
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices the process makes (>= every context)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens, prefilled in one chunk (not timed)")
    p.add_argument("--new_tokens", type=int, default=33, help="greedy tokens per run (the first from the prefill)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    bad = [c for c in args.contexts if c < 1 or c > args.devices]
    if bad:
        raise SystemExit(f"--contexts {bad[0]}: give 1 .. --devices {args.devices}.")
    bad = [s for s in args.slots for c in args.contexts if s % c or s < args.prompt + args.new_tokens]
    if bad:
        raise SystemExit(f"--slots {bad[0]}: each cache size must be a multiple of every --contexts and hold "
                         f"--prompt + --new_tokens = {args.prompt + args.new_tokens} tokens.")
    if args.new_tokens < 2:
        raise SystemExit("--new_tokens must be >= 2 (the first comes from the prefill; the rest are timed).")

    config = load_config(args.config)
    task = tasks.get_task(config.task)
    model = task.build_model(config, AttentionPlan.from_config(config))  # the benchmark's one plan
    params = model.init(jax.random.PRNGKey(0), np.zeros((1, 8), np.int32))["params"]
    load_start, start = os.getloadavg()[0], time.perf_counter()
    rows = []
    for slots in args.slots:
        for context in args.contexts:
            row = _one(config, model, params, slots, context, args)
            rows.append(row)
            print(f"S={slots} context={context}: {row['ms_per_token']:.2f} ms/token, "
                  f"{row['tokens_per_s']:.1f} tokens/s", flush=True)
    wall, load_end = time.perf_counter() - start, os.getloadavg()[0]
    base = {r["slots"]: r for r in rows if r["context"] == args.contexts[0]}
    md = [f"# Greedy decoding against a KV cache, whole and split over context ({datetime.date.today()})", "",
          f"Command: `python experiments/bench_sharded_decode.py --config {args.config} --slots "
          f"{' '.join(map(str, args.slots))} --contexts {' '.join(map(str, args.contexts))} --batch {args.batch} "
          f"--prompt {args.prompt} --new_tokens {args.new_tokens} --repeats {args.repeats}`  ",
          f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores shared by {args.devices} fake devices, "
          f"jax {jax.__version__}; load average {load_start:.1f} at the start, {load_end:.1f} at the end "
          f"({wall:.0f} s in all).  ",
          f"Random parameters, batch {args.batch}, a {args.prompt}-token prompt prefilled (not timed), then "
          f"{args.new_tokens - 1} greedy steps in one jitted scan: median of {args.repeats} runs after a warm-up. "
          "Fake devices share the cores: a split cache does the same work in pieces (module doc).", "",
          "| cache slots | context | cache per device (MiB) | ms per token | tokens/s | greedy tokens = context "
          f"{args.contexts[0]}'s | all-reduces in the compiled loop |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        same = bool(np.array_equal(r["tokens"], base[r["slots"]]["tokens"]))
        md.append(f"| {r['slots']:,} | {r['context']} | {r['cache_per_device'] / 2**20:.1f} of "
                  f"{r['cache_total'] / 2**20:.1f} | {r['ms_per_token']:.2f} | {r['tokens_per_s']:.1f} | "
                  f"{'yes' if same else 'NO'} | {r['all_reduces']} |")
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
