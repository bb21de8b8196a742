"""The Ulysses section of the one-GPU check (experiments/device_check.py, ``--sections ulysses``):
one device's attention work per layer under ``context_strategy='ulysses'`` against the ring's, for
packed documents (segment ids), the FineWeb recipe's heads (``configs/lm_fineweb_1b.py``: 32 query
heads, 8 KV heads, head dim 64) over ``c = 8`` context devices.

* ``ulysses:cudnn packed``: what a device runs after the all-to-all, one call of cuDNN's packed
  layout on the **whole sequence** T for its ``32 / 8 = 4`` query heads and 1 KV head, causal,
  with the segment ids (forward + backward, ``goat_jax.kernels.attend``);
* ``ring:flash blocks``: a packed-document ring runs the flash kernel's block loops (cuDNN's ring
  blocks take no segment ids, docs/layer.md); one full block pair of ``T / c`` queries and keys
  with all 32 heads is timed, forward + backward through ``goat_jax/kernels/ring_blocks.py``,
  and the device's layer is estimated as ``c / 2`` such pairs (a balanced causal ring gives each
  device ``T^2 / 2c`` of the causal area, i.e. ``c / 2`` full pairs of ``(T / c)^2``);
* ``ring:cudnn blocks (no documents)``: the same on cuDNN's ring blocks without segment ids, for
  scale: what the ring would cost if the documents were ignored (a different computation).

Neither exchange is timed here (one GPU: the all-to-alls and the ring's sends need a node);
section 2b checks cuDNN's packed layout against the float64 reference, and Ulysses' values and
gradients are tested on 8 fake CPU devices (tests/test_ulysses.py). ``--dry_run`` (CPU) runs the
same code at tiny sizes, the cuDNN calls replaced by 'flash' (Ulysses' call) and by the pure-JAX
stand-in (tests/cudnn_stand_in.py, the ring's cuDNN blocks), so only the plumbing is rehearsed.
"""

from __future__ import annotations

import time
from typing import List

N, KV, H, C = 32, 8, 64, 8  # FineWeb 1B's heads and head dim; context devices
HEAD = ["sequence T", "variant", "per device", "median wall ms (measured)", "est. ms per device and layer",
        "x ulysses", "compiled MiB", "note"]


def _ids(t: int, docs: int):
    """[1, t] int32 segment ids: ``docs`` documents of random lengths (the packer's layout)."""
    import numpy as np  # pylint: disable=g-import-not-at-top

    rng = np.random.default_rng(t)
    cuts = np.sort(rng.choice(np.arange(1, t), docs - 1, replace=False))
    return np.repeat(np.arange(docs), np.diff(np.r_[0, cuts, t])).astype(np.int32)[None]


def _ulysses(t: int, kernel: str):
    """(fn, args): one device's Ulysses call, forward + backward, on the whole sequence."""
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp

    from goat_jax import kernels

    ids = jnp.asarray(_ids(t, max(2, t // 4096)))
    key = jax.random.split(jax.random.key(0), 4)
    q, ct = (jax.random.normal(k_, (1, t, N // C, H), jnp.bfloat16) for k_ in key[:2])
    k, v = (jax.random.normal(k_, (1, t, KV // C, H), jnp.bfloat16) for k_ in key[2:])

    def fn(q_, k_, v_, ct_):
        out, vjp = jax.vjp(lambda a, b, c: kernels.attend(a, b, c, implementation=kernel, scale=H ** -0.5,
                                                          is_causal=True, segment_ids=ids), q_, k_, v_)
        return (out,) + vjp(ct_)
    return fn, (q, k, v, ct)


def _ring_pair(t: int, blocks, segments: bool):
    """(fn, args): one full ring block pair of ``T / c`` tokens, all heads, forward + backward."""
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp

    from goat_jax.kernels import ring, ring_blocks

    run = t // C
    full = ring_blocks.Pair(True, 0, run, "full")
    ids = jnp.asarray(_ids(t, max(2, t // 4096))[:, :run]) if segments else None
    key = jax.random.split(jax.random.key(1), 4)
    q, do = (jax.random.normal(k_, (1, KV, N // KV, run, H), jnp.bfloat16) for k_ in key[:2])
    k, v = (jax.random.normal(k_, (1, KV, run, H), jnp.bfloat16) for k_ in key[2:])
    offset = jnp.int32(run)
    scale = H ** -0.5

    def fn(q_, k_, v_, do_):
        out, lse = ring._merge(blocks.forward(scale, full, q_, k_, v_, None, offset, ids, ids),  # pylint: disable=protected-access
                               (jnp.zeros(q_.shape[:-1] + (H,), jnp.float32), jnp.full(q_.shape[:-1], -jnp.inf)))
        out = out.astype(v_.dtype)
        return (out,) + blocks.backward(scale, full, q_, k_, v_, None, offset, ids, ids, out, lse, do_)
    return fn, (q, k, v, do)


def rows(lengths: List[int], repeats: int, deadline: float, dry_run: bool, stand_in=None) -> List[List]:
    """The section's rows (columns :data:`HEAD`) at each sequence length of ``lengths``."""
    from goat_jax.device_check.ring import _blocks, compile_and_time

    out = []
    for t in lengths:
        ulysses_ms = None
        variants = [("ulysses:cudnn packed", f"T={t}, {N // C} heads, {KV // C} KV head", 1,
                     lambda t=t: _ulysses(t, "flash" if dry_run else "cudnn"),
                     "flash stand-in (dry run)" if dry_run else ""),
                    ("ring:flash blocks", f"pair of {t // C}, {N} heads", C / 2,
                     lambda t=t: _ring_pair(t, _blocks("flash", None, t // C), True), "segment ids"),
                    ("ring:cudnn blocks (no documents)", f"pair of {t // C}, {N} heads", C / 2,
                     lambda t=t: _ring_pair(t, _blocks("cudnn", stand_in, t // C), False),
                     "documents ignored" + (", pure-JAX stand-in (dry run)" if stand_in is not None else ""))]
        for name, shape, count, build, note in variants:
            if time.time() > deadline:
                out.append([t, name, shape, None, None, None, None, "skipped: time budget"])
                continue
            try:
                ms, mib = compile_and_time(*build(), repeats, deadline)
            except Exception as err:  # noqa: BLE001 -- an unchecked machine: record, go on
                out.append([t, name, shape, None, None, None, None,
                            f"**ERROR** {type(err).__name__}: {str(err).splitlines()[0][:200]}"])
                continue
            per_layer = ms * count
            ulysses_ms = per_layer if name.startswith("ulysses") else ulysses_ms
            ratio = None if ulysses_ms is None else per_layer / ulysses_ms
            out.append([t, name, shape, ms, per_layer, ratio, mib, note])
    return out


def run_ulysses(check) -> None:
    """The section as the check runs it (:class:`goat_jax.device_check.Check`): 32k and 131k
    tokens (dry: 64 and 128)."""
    from goat_jax.device_check.report import table  # pylint: disable=g-import-not-at-top

    lengths = [64 * C // 4, 128 * C // 4] if check.dry_run else [32768, 131072]
    found = rows(lengths, check.repeats, check.deadline - 60, check.dry_run, check.stand_in)
    check.report.section(
        f"ulysses. One device's attention per layer, Ulysses vs ring, packed documents (goat_jax/device_check/"
        f"ulysses.py): FineWeb 1B's {N} heads / {KV} KV heads of {H} over {C} context devices, bf16, causal, "
        "forward+backward; the ring's layer estimated as c/2 full block pairs; exchanges not timed",
        table(HEAD, found))
