"""goat_jax.kernels.decode_merge: attention of a chunk of queries against a KV cache split over
the ``context`` mesh axis equals a float64 NumPy reference (the whole cache, natural order, the
softmax written out) within 1e-5, on 8 fake CPU devices: context 2, 4, 8 and data 2 x context 4;
GQA 4:1 and MQA; a cache filled to 1 and to 37 positions (mostly empty), and full; one query
and a chunk of several with causal visibility by global position; both slot layouts; a row with
no written key (zeros, never NaN); bfloat16 inputs with float32 partials; and the write of new
keys into the shard that owns their positions. No all-gather is compiled: the keys stay put."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from goat_jax.kernels import decode_merge
from tests.config_helpers import run_on_fake_devices

SLOTS, D, DV, SCALE = 64, 16, 8, 0.37


def reference(q, k, v, q_positions, kv_length, scale=SCALE):
    """float64 attention of q [B, T, N, D] over the natural-order cache k [B, S, K, D], v: slot
    s visible to query (b, t) iff s < kv_length[b] and s <= q_positions[b, t]; zeros when none."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, n, _ = q.shape
    s, kh = k.shape[1], k.shape[2]
    out = np.zeros((b, t, n, v.shape[-1]))
    for bi in range(b):
        for ti in range(t):
            visible = (np.arange(s) < kv_length[bi]) & (np.arange(s) <= q_positions[bi, ti])
            if not visible.any():
                continue
            for h in range(n):
                kv = h // (n // kh)
                logits = k[bi, visible, kv] @ q[bi, ti, h] * scale
                p = np.exp(logits - logits.max())
                out[bi, ti, h] = p @ v[bi, visible, kv] / p.sum()
    return out


def draw(rng, b, t, n, kh, lengths):
    """Random q/k/v, and each row's queries at the last ``t`` positions of its length."""
    q = rng.normal(size=(b, t, n, D)).astype(np.float32)
    k = rng.normal(size=(b, SLOTS, kh, D)).astype(np.float32)
    v = rng.normal(size=(b, SLOTS, kh, DV)).astype(np.float32)
    kv_length = np.asarray(lengths, np.int32)
    q_positions = (np.maximum(kv_length, t)[:, None] - t + np.arange(t)[None]).astype(np.int32)
    return q, k, v, q_positions, kv_length


def to_layout(x, c, layout):
    """A natural-order cache [B, S, ...] as the global array of ``layout`` (interleaved: the
    array's slot j S/c + i holds position j + c i)."""
    if layout == "contiguous":
        return x
    order = np.concatenate([np.arange(j, x.shape[1], c) for j in range(c)])
    return x[:, order]


# name: (mesh shape, N, K, T, row lengths, layout)
CASES = {
    "context2_gqa_prompt37": ((1, 2), 8, 2, 1, [37, 20], "contiguous"),
    "context4_mqa_prompt1": ((1, 4), 4, 1, 1, [1, 3], "contiguous"),
    "context8_gqa_full": ((1, 8), 8, 2, 1, [64, 64], "contiguous"),
    "context8_mqa_chunk_full": ((1, 8), 4, 1, 4, [64, 9], "contiguous"),
    "data2_context4_gqa_chunk_prompt37": ((2, 4), 8, 2, 5, [37, 12], "contiguous"),
    "context4_gqa_interleaved_prompt1": ((1, 4), 8, 2, 1, [1, 37], "interleaved"),
    "context8_mqa_interleaved_chunk": ((1, 8), 4, 1, 3, [37, 64], "interleaved"),
    "context4_row_without_keys": ((1, 4), 8, 2, 1, [0, 37], "contiguous"),
    "data2_context4_mha_chunk_prompt1": ((2, 4), 4, 4, 1, [1, 2], "contiguous"),
}

_SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from goat_jax.kernels import decode_merge
from tests import test_decode_merge as t

cases, seed = json.loads(sys.argv[1]), int(sys.argv[2])
auto = (jax.sharding.AxisType.Auto,) * 2
out = {}
for name, (shape, n, kh, tq, lengths, layout) in cases.items():
    rng = np.random.default_rng([seed, len(out)])
    q, k, v, qp, kl = t.draw(rng, len(lengths), tq, n, kh, lengths)
    mesh = jax.make_mesh(tuple(shape), ("data", "context"), axis_types=auto,
                         devices=jax.devices()[:shape[0] * shape[1]])
    c = shape[1]
    f = jax.jit(lambda q, k, v, qp, kl: decode_merge.decode_attention(q, k, v, q_positions=qp, kv_length=kl,
                                                                     scale=t.SCALE, mesh=mesh, layout=layout))
    args = (q, t.to_layout(k, c, layout), t.to_layout(v, c, layout), qp, kl)
    with jax.set_mesh(mesh):
        kv_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "context"))
        args = (args[0], jax.device_put(args[1], kv_sharding), jax.device_put(args[2], kv_sharding)) + args[3:]
        hlo = f.lower(*args).compile().as_text()
        got = np.asarray(f(*args), np.float64)
    want = t.reference(q, k, v, qp, kl)
    out[name] = {"err": float(np.max(np.abs(got - want))), "finite": bool(np.isfinite(got).all()),
                 "all_gather": "all-gather" in hlo,
                 "zero_rows": [bool((got[b] == 0).all()) for b in range(len(lengths))]}

# The write: each shard writes the positions it owns; the natural-order cache equals NumPy's.
rng = np.random.default_rng([seed, 99])
for layout in decode_merge.LAYOUTS:
    mesh = jax.make_mesh((2, 4), ("data", "context"), axis_types=auto)
    kc = rng.normal(size=(2, t.SLOTS, 2, t.D)).astype(np.float32)
    kn = rng.normal(size=(2, 5, 2, t.D)).astype(np.float32)
    f = jax.jit(lambda kc, vc, kn, vn, s: decode_merge.write_cache(kc, vc, kn, vn, s, mesh=mesh, layout=layout))
    for start in (0, 14, 61):  # 61: the last 2 of 5 fall past the cache, dropped
        with jax.set_mesh(mesh):
            got_k, got_v = f(t.to_layout(kc, 4, layout), t.to_layout(kc, 4, layout), kn, kn, jnp.int32(start))
        want = kc.copy()
        stop = min(start + 5, t.SLOTS)
        want[:, start:stop] = kn[:, :stop - start]
        out[f"write_{layout}_{start}"] = bool(np.array_equal(np.asarray(got_k), t.to_layout(want, 4, layout))
                                              and np.array_equal(np.asarray(got_v), t.to_layout(want, 4, layout)))
print(json.dumps(out))
"""


def test_the_sharded_merge_equals_the_float64_reference_on_8_devices(rng):
    seed = int(rng.integers(1 << 31))
    out = json.loads(run_on_fake_devices(_SCRIPT, json.dumps(CASES), str(seed)).strip().splitlines()[-1])
    for name, (_, _, _, _, lengths, _) in CASES.items():
        r = out[name]
        assert r["finite"] and r["err"] < 1e-5, (name, r)
        assert not r["all_gather"], f"{name}: the keys were gathered"
        assert r["zero_rows"] == [n == 0 for n in lengths], (name, r)
    for layout in decode_merge.LAYOUTS:
        for start in (0, 14, 61):
            assert out[f"write_{layout}_{start}"], (layout, start)


def test_one_shard_without_visible_keys_weighs_nothing_and_partials_stay_float32(rng):
    """The merge itself, on one device: shard 1 of 2 sees no key (m = -inf, l = o = 0), so the
    result is shard 0's alone; bfloat16 inputs give float32 partials."""
    q, k, v, qp, kl = draw(rng, 2, 1, 8, 2, [20, 31])
    half = SLOTS // 2
    parts = [decode_merge.partial_attention(jnp.asarray(q, jnp.bfloat16), jnp.asarray(k[:, sl], jnp.bfloat16),
                                            jnp.asarray(v[:, sl], jnp.bfloat16), qp, jnp.arange(half) + off, kl,
                                            scale=SCALE)
             for sl, off in ((slice(0, half), 0), (slice(half, SLOTS), half))]
    assert all(x.dtype == jnp.float32 for part in parts for x in part)
    assert np.isneginf(np.asarray(parts[1][1])).all() and not np.asarray(parts[1][2]).any()
    o, m, l = (jnp.stack(x) for x in zip(*parts))
    # Two shards as a leading axis: the merge written out with max/sum over it.
    m_g = m.max(0)
    w = jnp.where(jnp.isfinite(m), jnp.exp(m - m_g), 0.0)
    merged = (w[..., None] * o).sum(0) / (w * l).sum(0)[..., None]
    alone = decode_merge.merge_partials(*parts[0], None)
    np.testing.assert_allclose(np.asarray(merged), np.asarray(alone), rtol=0, atol=1e-6)
    want = reference(*(np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64) for x in (q, k, v)), qp, kl)
    np.testing.assert_allclose(np.asarray(alone), want, atol=1e-5)


def test_one_device_runs_without_collectives_and_equals_the_reference(rng):
    q, k, v, qp, kl = draw(rng, 2, 3, 4, 1, [37, 0])
    got = decode_merge.decode_attention(q, k, v, q_positions=qp, kv_length=kl, scale=SCALE)
    np.testing.assert_allclose(np.asarray(got, np.float64), reference(q, k, v, qp, kl), atol=1e-5)
    assert not np.asarray(got[1]).any()


@pytest.mark.parametrize("kwargs, match", [
    (dict(k=np.zeros((2, SLOTS, 3, D), np.float32), v=np.zeros((2, SLOTS, 3, DV), np.float32)),
     "must divide the query heads"),
    (dict(q_positions=np.zeros((2,), np.int32)), "q_positions must be \\[B, T\\]"),
    (dict(kv_length=np.zeros((2, 1), np.int32)), "kv_length must be \\[B\\]"),
    (dict(layout="striped"), "layout must be one of"),
])
def test_bad_inputs_are_refused_naming_the_argument(rng, kwargs, match):
    q, k, v, qp, kl = draw(rng, 2, 1, 4, 2, [5, 5])
    args = dict(q=q, k=k, v=v, q_positions=qp, kv_length=kl, scale=SCALE)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        decode_merge.decode_attention(**args)


@pytest.mark.slow(reason="a benchmark's smoke run (~6 s): its programs are the tested function's")
def test_the_benchmark_runs_and_checks_its_programs_against_one_device(tmp_path):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "merge.md"
    proc = subprocess.run([sys.executable, "experiments/bench_decode_merge.py", "--context", "4", "--slots", "256",
                           "--repeats", "1", "--out", str(out)], cwd=root, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    for row in ("local", "pmax_m", "psum_o", "psum_l", "merge", "merge_interleaved", "all_gather", "one_device"):
        assert f"\n| {row} |" in text, row
    assert "| contiguous | 25 | 0 | 25, 0, 0, 0 |" in text and "| interleaved | 7 | 6 | 7, 6, 6, 6 |" in text
