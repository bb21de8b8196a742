"""The ring's attention alone on a TPU slice, read from the TPU compiler on a CPU host: per-device
temporaries of the gradient of a load-balanced causal ring on splash blocks against flash blocks
(benchmarks/context.md, "Ring on fused blocks").

    JAX_PLATFORMS=cpu python benchmarks/ring_memory.py [--tokens 65536] [--dump DIR]

Compile-only on v5p-8 (4 chips, context 4: each device holds two 8,192-token chunks at 65,536
tokens), B 1, 8 heads of 64, bf16, scale 1/8, the gradient of sum(out * ct) with respect to q,
k, v. ``--dump DIR`` also writes XLA's dumps there (per blocks, ``DIR/<blocks>``), whose
``*memory-usage-report.txt`` and ``*live-range.txt`` name the largest buffers and those live at
the peak. Needs libtpu (``pip install 'goat-jax[aot]'``).
"""

import argparse
import json
import os
import re
import subprocess
import sys


def measure(blocks: str, tokens: int) -> dict:
    """Per-device bytes and the custom calls of the ring's gradient on ``blocks`` ('splash' or
    'flash') at ``tokens`` tokens, compiled for v5p-8 (this process)."""
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from goat_jax import aot
    from goat_jax.kernels import ring
    from goat_jax.kernels.mask import AttentionMask
    from goat_jax.kernels.plan import AttentionPlan

    c, heads, head_dim = 4, 8, 64
    devices = aot.target_devices(aot.parse_target("v5p-8"))
    mesh = Mesh(np.array(devices[:c]).reshape(1, 1, c, 1), ("data", "fsdp", "context", "tensor"))
    arg = jax.ShapeDtypeStruct((1, tokens, heads, head_dim), jnp.bfloat16,
                               sharding=NamedSharding(mesh, P(None, "context", None, None)))

    def loss(q, k, v, ct):
        out = ring.attend(q, k, v, mask=AttentionMask(causal=True), bias=None, mesh=mesh,
                          plan=AttentionPlan(context_strategy="ring", load_balanced=True), implementation=blocks,
                          scale=head_dim ** -0.5)
        return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))

    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(arg, arg, arg, arg).compile()
    m = compiled.memory_analysis()
    calls = re.findall(r'custom_call_target="([^"]+)"', compiled.as_text())
    return {"blocks": blocks, "tokens": tokens, "temporaries_GiB": round(m.temp_size_in_bytes / 2 ** 30, 3),
            "arguments_GiB": round(m.argument_size_in_bytes / 2 ** 30, 3),
            "tpu_custom_calls": calls.count("tpu_custom_call")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--dump", default=None, help="write XLA's dumps under DIR/<blocks>")
    parser.add_argument("--blocks", default=None, help=argparse.SUPPRESS)  # one measurement, in a child
    args = parser.parse_args()
    if args.blocks:
        print(json.dumps(measure(args.blocks, args.tokens)))
        return
    for blocks in ("splash", "flash"):  # one process each: XLA's dump flags are read at start-up
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        if args.dump:
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_dump_to={os.path.join(args.dump, blocks)}".strip()
        out = subprocess.run([sys.executable, __file__, "--blocks", blocks, "--tokens", str(args.tokens)],
                             env=env, capture_output=True, text=True, check=False)
        if out.returncode:
            sys.exit(out.stderr[-3000:])
        print(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
