"""The ring section of the one-GPU check (experiments/device_check.py, ``--sections ring``): the
per-step work of ring attention on one device, on cuDNN blocks against flash blocks and against
plain cuDNN attention of the same size (goat_jax/kernels/ring_blocks.py).

One ring step of a load-balanced causal ring holds, per device, pairs of a local query block
against a key block: the diagonal pair (causal) and earlier pairs (every key visible). The step
measured here is one of each at local block length L: queries q [1, L, 8, 64] against keys
``k0`` (an earlier block, all visible) and ``k1`` (the diagonal block, causal), i.e. attention of
L queries over 2L keys with the causal offset L.

* ``ring:cudnn``: each pair forward through jax's private cuDNN call with ``return_residual=True``
  (float32 stats), the two merged by their log-sum-exps, each pair's backward bound with the
  *merged* output and stats; ``ring:flash``: the same with the flash kernel's block loops;
* ``plain:cudnn``: the two pairs as two ordinary cuDNN attention calls (``jax.nn.dot_product_attention``,
  the same kernels' work without the merge and the global statistics) differentiated by JAX: what
  the ring blocks aim to be within ~1.2x of.

Numerics (bf16 inputs) of the merged output and dq, dk, dv against the float64 reference
(tests/goat_reference.py) at a small L; timings (forward + backward, median wall ms) at local
blocks of 16k, 64k and 128k tokens, each row skipped when the time budget is spent. ``--dry_run``
(CPU) runs the same code at tiny sizes with the cuDNN calls replaced by a pure-JAX stand-in
(tests/cudnn_stand_in.py, handed in by the command as ``stand_in``, as is the float64 reference),
so only the plumbing is rehearsed there.
"""

from __future__ import annotations

import statistics
import time
from typing import List, Optional, Tuple

N, H = 8, 64  # heads, head dim
NUMERIC_TOLERANCE = 2e-2  # bf16, relative to the largest entry (device_check's bar)


def _blocks(name: str, stand_in, length: int):
    """The ring blocks of kernel ``name`` ('flash' or 'cudnn') as its row builds them (flash's
    tiles up to 512); blocks that call cuDNN (a ``calls`` field) through ``stand_in`` when given."""
    import dataclasses  # pylint: disable=g-import-not-at-top

    from goat_jax.kernels import capabilities  # pylint: disable=g-import-not-at-top

    blocks = capabilities.CAPABILITIES[name].ring_blocks.make(min(512, length), None)
    if stand_in is not None and hasattr(blocks, "calls"):
        return dataclasses.replace(blocks, calls=stand_in, narrow_values=True)
    return blocks


def _stood_in(name: str, stand_in) -> bool:
    """Whether kernel ``name``'s ring blocks run through ``stand_in`` (they call cuDNN)."""
    return stand_in is not None and hasattr(_blocks(name, None, 1), "calls")


def ring_step(blocks, length: int, scale: float):
    """``f(q, k0, v0, k1, v1, do) -> (out, dq, dk0, dv0, dk1, dv1)``: one device's ring step on
    ``blocks`` (module doc); q [1, L, N, H], k/v [1, L, N, H] in the ring's [B, K, G, L, H] layout."""
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

    from goat_jax.kernels import ring, ring_blocks  # pylint: disable=g-import-not-at-top

    earlier = ring_blocks.Pair(True, 0, length, "full")
    diagonal = ring_blocks.Pair(True, 0, length)
    to_ring = lambda x, g: jnp.moveaxis(x, 1, 2)[:, :, None] if g else jnp.moveaxis(x, 1, 2)
    back = lambda x: jnp.moveaxis(x[:, :, 0], 2, 1)
    off_earlier, off_diag = jnp.int32(length), jnp.int32(0)

    def step(q, k0, v0, k1, v1, do):
        qr, dor = to_ring(q, True), to_ring(do, True)
        k0r, v0r, k1r, v1r = (to_ring(x, False) for x in (k0, v0, k1, v1))
        part0 = blocks.forward(scale, earlier, qr, k0r, v0r, None, off_earlier, None, None)
        part1 = blocks.forward(scale, diagonal, qr, k1r, v1r, None, off_diag, None, None)
        out, lse = ring._merge(part0, part1)  # pylint: disable=protected-access
        out = out.astype(v0.dtype)
        lse = jnp.where(jnp.isfinite(lse), lse, jnp.inf)
        dq0, dk0, dv0 = blocks.backward(scale, earlier, qr, k0r, v0r, None, off_earlier, None, None, out, lse, dor)
        dq1, dk1, dv1 = blocks.backward(scale, diagonal, qr, k1r, v1r, None, off_diag, None, None, out, lse, dor)
        cast = lambda x: x.astype(q.dtype)
        return (back(out), cast(back(dq0 + dq1)), cast(jnp.moveaxis(dk0, 2, 1)), cast(jnp.moveaxis(dv0, 2, 1)),
                cast(jnp.moveaxis(dk1, 2, 1)), cast(jnp.moveaxis(dv1, 2, 1)))
    return step


def plain_step(length: int, scale: float, dry_run: bool):
    """The same two pairs as two ordinary cuDNN attention calls, differentiated by JAX (on CPU
    in a dry run: the XLA path of the same function)."""
    import jax  # pylint: disable=g-import-not-at-top

    impl = "xla" if dry_run else "cudnn"

    def loss_and_grads(q, k0, v0, k1, v1, do):
        def f(q_, k0_, v0_, k1_, v1_):
            a = jax.nn.dot_product_attention(q_, k0_, v0_, scale=scale, implementation=impl)
            b = jax.nn.dot_product_attention(q_, k1_, v1_, scale=scale, is_causal=True, implementation=impl)
            return a + b
        out, vjp = jax.vjp(f, q, k0, v0, k1, v1)
        return (out,) + vjp(do)
    del length
    return loss_and_grads


def _inputs(length: int, dtype, seed: int):
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top

    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=(1, length, N, H)), dtype) for _ in range(6))


def numerics_rows(length: int, reference, stand_in=None) -> List[List]:
    """Each ring step's merged output and gradients (bf16) against the float64 reference
    (``reference.attention_and_grads``, tests/goat_reference.py)."""
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top

    scale = H ** -0.5
    q, k0, v0, k1, v1, do = _inputs(length, jnp.bfloat16, 0)
    f64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)
    want = reference.attention_and_grads(f64(q), np.concatenate([f64(k0), f64(k1)], 1), np.concatenate([f64(v0), f64(v1)], 1),
                                   f64(do), scale=scale, is_causal=True, causal_offset=length)
    w_out, w_dq, w_dk, w_dv = want
    rows = []
    for name in ("cudnn", "flash"):
        try:
            got = jax.jit(ring_step(_blocks(name, stand_in, length), length, scale))(q, k0, v0, k1, v1, do)
            out, dq, dk0, dv0, dk1, dv1 = (f64(x) for x in got)
            pairs = [(out, w_out), (dq, w_dq), (np.concatenate([dk0, dk1], 1), w_dk), (np.concatenate([dv0, dv1], 1), w_dv)]
            errs = [float(np.abs(g - w).max() / np.abs(w).max()) for g, w in pairs]
            ok = "ok" if max(errs) <= NUMERIC_TOLERANCE else "**FAIL**"
            label = f"ring:{name}" + (" (pure-JAX stand-in)" if _stood_in(name, stand_in) else "")
            rows.append([label, length] + errs + [NUMERIC_TOLERANCE, ok])
        except Exception as err:  # noqa: BLE001 -- an unchecked machine: record, go on
            rows.append([f"ring:{name}", length] + [None] * 4
                        + [NUMERIC_TOLERANCE, f"**ERROR** {type(err).__name__}: {str(err).splitlines()[0][:200]}"])
    return rows


def compile_and_time(fn, args, repeats: int, deadline: float) -> Tuple[float, Optional[float]]:
    """``(median wall ms, compiled MiB)`` of ``fn`` on ``args`` (the ring and Ulysses sections'
    timings): compiled once (arguments, outputs and temporaries from ``memory_analysis``; None
    where the backend gives none), one warm-up call, then up to ``repeats`` timed calls, stopping
    early past ``deadline`` (at least one). Errors propagate: the sections record them per row."""
    import jax  # pylint: disable=g-import-not-at-top

    compiled = jax.jit(fn).lower(*args).compile()
    mem = compiled.memory_analysis()
    mib = None if mem is None else (mem.temp_size_in_bytes + mem.argument_size_in_bytes
                                    + mem.output_size_in_bytes) / 2**20
    jax.block_until_ready(compiled(*args))  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
        if time.time() > deadline:
            break
    return 1e3 * statistics.median(times), mib


def timing_rows(lengths: List[int], repeats: int, deadline: float, stand_in=None) -> List[List]:
    """Forward + backward wall time of the ring step on cuDNN blocks, flash blocks and plain cuDNN."""
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

    scale = H ** -0.5
    rows = []
    for length in lengths:
        args = _inputs(length, jnp.bfloat16, length)
        plain_ms = None
        for name in ("plain:cudnn", "ring:cudnn", "ring:flash"):
            if time.time() > deadline:
                rows.append([length, name, None, None, None, "skipped: time budget"])
                continue
            fn = (plain_step(length, scale, stand_in is not None) if name == "plain:cudnn"
                  else ring_step(_blocks(name.split(":")[1], stand_in, length), length, scale))
            try:
                ms, mib = compile_and_time(fn, args, repeats, deadline)
            except Exception as err:  # noqa: BLE001 -- e.g. out of memory: record, go on
                rows.append([length, name, None, None, None, f"**ERROR** {type(err).__name__}: "
                             f"{str(err).splitlines()[0][:200]}"])
                continue
            plain_ms = ms if name == "plain:cudnn" else plain_ms
            ratio = None if plain_ms is None else ms / plain_ms
            stood_in = stand_in is not None and (name == "plain:cudnn" or _stood_in(name.split(":")[1], stand_in))
            note = "pure-JAX stand-in / XLA on CPU (dry run)" if stood_in else ""
            rows.append([length, name, ms, ratio, mib, note])
    return rows


NUMERICS_HEAD = ["step", "L", "out", "dq", "dk", "dv", "tolerance", "result"]
TIMING_HEAD = ["local block L", "variant", "median wall ms", "x plain cuDNN", "compiled MiB", "note"]


def section(dry_run: bool, repeats: int, deadline: float, reference, stand_in=None) -> Tuple[List[List], List[List]]:
    """The ring section's (numerics rows, timing rows) (columns :data:`NUMERICS_HEAD`,
    :data:`TIMING_HEAD`): numerics at L = 2048 (dry: 128), timings at 16k, 64k, 128k (dry: 128,
    256). ``reference``: tests/goat_reference.py; ``stand_in``: the cuDNN calls' stand-in
    (``CudnnBlocks``'s ``calls``), required on CPU, None on a GPU (jax's private calls)."""
    numerics = numerics_rows(128 if dry_run else 2048, reference, stand_in)
    lengths = [128, 256] if dry_run else [16384, 65536, 131072]
    return numerics, timing_rows(lengths, repeats, deadline, stand_in)


def run_ring(check) -> None:
    """The section as the check runs it (:class:`goat_jax.device_check.Check`)."""
    from goat_jax.device_check.report import table  # pylint: disable=g-import-not-at-top

    numerics, timing = section(check.dry_run, check.repeats, check.deadline - 60, check.reference, check.stand_in)
    check.report.section("ring. Ring attention per step on one device (goat_jax/device_check/ring.py): bf16 "
                         "numerics vs the float64 reference, then forward+backward wall time",
                         table(NUMERICS_HEAD, numerics) + [""] + table(TIMING_HEAD, timing))
