"""Position accuracy of the prior's Fourier features and of RoPE, against float64 NumPy, at
positions up to 16M; and what exact phases cost in CPU time (results: benchmarks/positions.md).

    JAX_PLATFORMS=cpu PYTHONPATH=$PWD python benchmarks/positions.py [--timing]

For each window of 256 consecutive positions starting at ``P`` (1e3 ... 16e6) it prints the
largest error, relative to the largest reference value, of

* ``goat_feat``: GOAT's Fourier features ``[cos(w p), sin(w p)]`` of the relative ladder (R = 8,
  base 1e4) and of the sink MLP's absolute ladder (M = 8), as packed into q/k;
* ``goat_kappa``: the relative prior the kernel sees, ``q_rel(p_i) . k_rel(p_j)`` with O(1)
  coefficients, against ``kappa(p_i - p_j)`` from differences in float64;
* ``sink_in``: the sink MLP's non-periodic inputs ``t / L_n`` and ``log1p(t) / log1p(L_n)``
  (L_n = 2048; relative error elementwise: they grow with ``t`` by design; float32 in both
  rows, since the sink MLP always runs in float32);
* ``rope``: ``apply_rope`` of a [1, 256, 1, 128] input (base 1e4) vs the float64 rotation;
* ``goat_layer_shift``, ``rope_layer_shift``: a causal layer (E 64, 4 heads, 'xla'; GOAT with
  its relative prior only, R = 6 with O(1) coefficients) run on 48 tokens at positions ``P ..``
  against the same layer at ``0 ..``: it depends on position differences only, so any change is
  error (largest difference / largest output). The old code refuses positions past 2**17, so the
  script lifts its ``MAX_POSITION`` in-process to measure it there too (a no-op on the new code);

in float32 and in bfloat16 (features rounded to bf16 as packing does; RoPE of a bf16 input,
against the rotation of that bf16 input). It only uses functions that exist before and after the
change (``Positions`` built directly, so the old ``MAX_POSITION`` check is not in the way), so
the same command measures either tree.

``--timing`` (needs the new ``goat_jax.prior.angles``) times, in one process and interleaved,
the old float32 formula ``cos/sin(p * w)`` (copied here) against the new exact angles: cos/sin
of 131,072 positions (from 1,000,000) x 64 static frequencies (RoPE's) and x 8 heads x 8
learned (traced) frequencies (GOAT's ``learn_frequencies``), and ``apply_rope`` of
[1, 16384, 8, 128].
"""

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from goat_jax import prior as prior_lib
from goat_jax.positional import apply_rope

STARTS = (1_000, 60_000, 120_000, 1_000_000, 4_000_000, 16_000_000)
WINDOW, R, M, L_N = 256, 8, 8, 2048


def _ladder(rank, base):
    return base ** (-np.arange(rank, dtype=np.float64) / max(rank - 1, 1))


def _pos(start):
    p = jnp.arange(WINDOW, dtype=jnp.float32) + jnp.float32(start)
    return prior_lib.Positions(index=p, coords=p), np.arange(WINDOW, dtype=np.float64) + start


def _rel(got, want):
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


def _cast(x, dtype):
    return np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32), np.float64)


def goat_errors(start, dtype, rng):
    pos, p64 = _pos(start)
    errs = {}
    feats = []
    for rank in (R, M):
        got = prior_lib.fourier_features(pos, prior_lib.frequencies(rank, 1e4))
        ph = p64[:, None] * _ladder(rank, 1e4)
        feats.append(_rel(_cast(got, dtype), np.concatenate([np.cos(ph), np.sin(ph)], -1)))
    errs["goat_feat"] = max(feats)
    spec = prior_lib.PriorSpec(num_heads=1, kv_num_heads=1, pos_rank=R, abs_rank=M, enable_key_bias=False)
    a, b = rng.normal(0, 0.5, (1, R)), rng.normal(0, 0.5, (1, R))
    params = {"lambda_sym": jnp.asarray(a, jnp.float32), "lambda_asym": jnp.asarray(b, jnp.float32)}
    a, b = np.asarray(params["lambda_sym"], np.float64), np.asarray(params["lambda_asym"], np.float64)
    q_rel, _ = prior_lib.query_features(spec, params, pos)  # [T, 1, 2R]
    k_rel = prior_lib.fourier_features(pos, prior_lib.frequencies(R, 1e4))  # [S, 2R]
    logits = _cast(q_rel, dtype)[:, 0] @ _cast(k_rel, dtype).T
    ph = (p64[:, None] - p64[None, :])[..., None] * _ladder(R, 1e4)
    errs["goat_kappa"] = _rel(logits, np.cos(ph) @ a[0] + np.sin(ph) @ b[0])
    sspec = prior_lib.PriorSpec(num_heads=1, kv_num_heads=1, pos_rank=R, abs_rank=M, training_seq_len=L_N)
    inputs = np.asarray(prior_lib.sink_mlp_inputs(sspec, pos), np.float64)[:, -2:]
    want = np.stack([p64 / L_N, np.log1p(p64) / np.log1p(L_N)], -1)
    # The sink MLP runs in float32 whatever the layer's dtype (its output is split exactly over
    # bf16 channels, goat_jax/layers/goat.py), so its inputs are never rounded to bf16.
    errs["sink_in"] = float(np.max(np.abs(inputs - want) / want))
    return errs


def rope_error(start, dtype, rng):
    _, p64 = _pos(start)
    x = jnp.asarray(rng.normal(size=(1, WINDOW, 1, 128)), jnp.float32).astype(dtype)
    got = apply_rope(x, jnp.arange(WINDOW, dtype=jnp.float32) + jnp.float32(start), 1e4)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    theta = 1e4 ** (-np.arange(0, 128, 2, dtype=np.float64) / 128)
    ang = p64[:, None] * theta  # [T, 64]
    c, s = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
    x1, x2 = x64[..., :64], x64[..., 64:]
    want = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    return _rel(got.astype(jnp.float32), want)


def layer_shift_errors(dtype):
    """{name: f(P)}: the largest output change of a relative-only layer shifted to P."""
    from goat_jax.layers.goat import GoatAttention
    from goat_jax.layers.positional import PositionalAttention
    from goat_jax.prior import positions as positions_module

    positions_module.MAX_POSITION = prior_lib.MAX_POSITION = max(prior_lib.MAX_POSITION, 2 ** 24)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(2, 48, 64)), jnp.float32)
    goat = GoatAttention(num_heads=4, kv_num_heads=2, implementation="xla", dtype=dtype,
                         prior=prior_lib.PriorSettings(pos_rank=6, abs_rank=2, enable_key_bias=False))
    rope = PositionalAttention(num_heads=4, position_encoding="rope", implementation="xla", dtype=dtype)
    out = {}
    for name, module in (("goat_layer_shift", goat), ("rope_layer_shift", rope)):
        params = module.init(jax.random.key(0), x)
        if name.startswith("goat"):
            prior = params["params"]["prior"]
            for key in ("lambda_sym", "lambda_asym"):
                prior[key] = jax.tree_util.tree_map(
                    lambda a: jnp.asarray(rng.normal(0, 1, a.shape), jnp.float32), prior[key])
        run = jax.jit(lambda v, o, m=module: m.apply(v, x, is_causal=True, position_offset_q=o,
                                                     position_offset_k=o).astype(jnp.float32))
        base = np.asarray(run(params, 0), np.float64)
        out[name] = lambda p, run=run, params=params, base=base: float(
            np.abs(np.asarray(run(params, p), np.float64) - base).max() / np.abs(base).max())
    return out


def accuracy_table():
    rng = np.random.default_rng(0)
    print("| dtype | quantity | " + " | ".join(f"{p:,}" for p in STARTS) + " |")
    print("|---|---|" + "---|" * len(STARTS))
    for dtype in (jnp.float32, jnp.bfloat16):
        rows = {}
        shifts = layer_shift_errors(dtype)
        for start in STARTS:
            vals = {**goat_errors(start, dtype, rng), "rope": rope_error(start, dtype, rng),
                    **{name: f(start) for name, f in shifts.items()}}
            for key, val in vals.items():
                rows.setdefault(key, []).append(val)
        for key, vals in rows.items():
            print(f"| {jnp.dtype(dtype).name} | {key} | " + " | ".join(f"{v:.1e}" for v in vals) + " |")


def _old_cos_sin(p, w):  # the float32 formula before exact phases (goat_jax/prior/fourier.py)
    ph = p.reshape(p.shape + (1,) * w.ndim) * w
    return jnp.cos(ph), jnp.sin(ph)


def _old_rope(x, p, w):  # apply_rope before exact phases (goat_jax/positional/rope.py)
    h = x.shape[-1]
    ang = p[:, None] * w
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
    x1, x2 = x[..., : h // 2], x[..., h // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def timing(repeats=20):
    from goat_jax.prior import angles  # the new module

    w64 = 1e4 ** (-np.arange(0, 128, 2, dtype=np.float64) / 128)
    w32 = jnp.asarray(w64, jnp.float32)
    p = jnp.arange(131_072, dtype=jnp.float32) + 1_000_000
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 16_384, 8, 128)), jnp.float32)
    px = jnp.arange(16_384, dtype=jnp.float32) + 1_000_000
    learned = jnp.asarray(np.random.default_rng(1).uniform(0, 1, (8, 8)), jnp.float32)  # [K, R]
    static = (jax.jit(lambda p: _old_cos_sin(p, w32)), jax.jit(lambda p: angles.cos_sin(p, w64)))
    cases = {
        "cos/sin [131072, 64], static frequencies, positions from 0": static + (p - 1_000_000,),
        "cos/sin [131072, 64], static frequencies, positions from 1M": static + (p,),
        "cos/sin [131072, 8 x 8], learned frequencies": (jax.jit(_old_cos_sin), jax.jit(angles.cos_sin),
                                                         (p, learned)),
        "apply_rope [1, 16384, 8, 128]": (jax.jit(lambda x, p: _old_rope(x, p, w32)),
                                          jax.jit(lambda x, p: apply_rope(x, p, 1e4)), (x, px)),
    }
    print(f"\nCPU time per call, median of {repeats} interleaved calls (load average before: "
          f"{os.getloadavg()[0]:.2f}, {os.cpu_count()} cores, jax {jax.__version__}):\n")
    print("| computation | old float32 ms | exact ms | ratio |")
    print("|---|---|---|---|")
    for name, (old, new, args) in cases.items():
        args = args if isinstance(args, tuple) else (args,)
        jax.block_until_ready(old(*args))
        jax.block_until_ready(new(*args))
        t_old, t_new = [], []
        for _ in range(repeats):
            for fn, acc in ((old, t_old), (new, t_new)):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*args))
                acc.append(time.perf_counter() - t0)
        a, b = np.median(t_old) * 1e3, np.median(t_new) * 1e3
        print(f"| {name} | {a:.1f} | {b:.1f} | {b / a:.2f} |")
    print(f"\n(load average after: {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--timing", action="store_true")
    args = parser.parse_args()
    accuracy_table()
    if args.timing:
        timing()
