"""What GOAT's packed q/k width costs on a TPU, read from the TPU compiler on a CPU host.

    JAX_PLATFORMS=cpu python benchmarks/packed_head_dim.py   # needs libtpu: pip install 'goat-jax[aot]'

Two measurements, both compile-only on a v5e chip (no TPU needed; results in
benchmarks/packed_head_dim.md):

1. splash alone (forward + backward, causal, B 1, 8 heads, T 4096, bf16) with q/k widths 128,
   130 (a 128 head packed in the official layout in bf16), 136 and 256: the q/k operand layouts
   of the Mosaic kernel and the compiled program's bytes accessed (XLA's cost analysis; it does
   not see inside the Mosaic kernel, whose FLOPs are not counted).
2. the GOAT layer (E 1024, 8 heads of 128, R = M = 8, bf16, T 2048, forward + backward) in
   ``qk_layout='official'`` and ``'lane_aligned'``.
"""

import json
import re

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from goat_jax import GoatAttention, PriorSettings, aot, kernels


def _cost(compiled):
    cost = compiled.cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost).get("bytes accessed")


def _qk_layouts(text, width):
    """The tiled layouts the compiled program gives [.., width] bf16 arrays."""
    return sorted(set(re.findall(rf"bf16\[[\d,]*,{width}\]\{{[\d,]+:(T\([\d,]+\))", text)))


def main():
    devices = aot.target_devices(aot.parse_target("v5e-1"))
    mesh = Mesh(np.array(devices).reshape(1), ("data",))
    rep = NamedSharding(mesh, P())
    rows = []
    b, t, n = 1, 4096, 8
    for width in (128, 130, 136, 256):
        q = jax.ShapeDtypeStruct((b, t, n, width), jnp.bfloat16, sharding=rep)
        v = jax.ShapeDtypeStruct((b, t, n, 128), jnp.bfloat16, sharding=rep)

        def loss(q, k, v):
            return jnp.sum(kernels.attend(q, k, v, implementation="splash", is_causal=True).astype(jnp.float32))

        with jax.set_mesh(mesh):
            compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, v).compile()
        text = compiled.as_text()
        rows.append({"what": f"splash fwd+bwd, q/k width {width}", "bytes_accessed": _cost(compiled),
                     "qk_logical_bytes": 2 * b * t * n * width * 2, "qk_tiles": _qk_layouts(text, width)})
    x = jax.ShapeDtypeStruct((1, 2048, 1024), jnp.bfloat16, sharding=rep)
    for layout in ("official", "lane_aligned"):
        attn = GoatAttention(num_heads=8, head_dim=128, implementation="splash", dtype=jnp.bfloat16,
                             prior=PriorSettings(pos_rank=8, abs_rank=8, training_seq_len=2048, qk_layout=layout))
        with jax.set_mesh(mesh), kernels.record_choices() as found:
            params = jax.eval_shape(lambda x: flax.core.meta.unbox(attn.init(jax.random.key(0), x, is_causal=True)), x)
            loss = lambda p, x: jnp.mean(attn.apply(p, x, is_causal=True).astype(jnp.float32) ** 2)  # pylint: disable=cell-var-from-loop
            compiled = jax.jit(jax.grad(loss)).lower(params, x).compile()
        width = found[-1]["qk_dim"]
        rows.append({"what": f"GOAT layer fwd+bwd, qk_layout={layout!r} (packed width {width})",
                     "bytes_accessed": _cost(compiled), "qk_tiles": _qk_layouts(compiled.as_text(), width)})
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
