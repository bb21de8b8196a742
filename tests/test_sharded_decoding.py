"""KV-cache decoding under a mesh that splits sequences over ``context`` (docs/training.md,
"Decoding with a sharded cache"): the layer writes each shard's slots and merges the shards'
partial softmaxes (goat_jax/kernels/decode_merge.py), so ``generate`` and chunked decoding give
context 1's tokens and logits on 8 fake CPU devices, for context 2, 4, 8 and data 2 x context 4,
prompts the shard count does not divide, a cache mostly empty and one full to its last slot."""

import json

import pytest

from tests.config_helpers import run_on_fake_devices
from tests.marks import SLOW_CASE

_SCRIPT = r'''
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh
from goat_jax.models.lm import LMConfig, TransformerLM
from goat_jax.kernels.plan import AttentionPlan
from goat_jax.models import sampling

enc, kv, sampled, full = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
cfg = LMConfig(vocab_size=31, num_layers=2, embed_dim=32, num_heads=4, kv_num_heads=kv, mlp_dim=48,
               position_encoding=enc, training_seq_len=16, pos_rank=2, abs_rank=2)
model = TransformerLM(cfg, plan=AttentionPlan(implementation="xla"))
meshes = {f"context{c}" if d == 1 else f"data{d}xcontext{c}": Mesh(
    np.array(jax.devices()[:d * c]).reshape(d, 1, c, 1), ("data", "fsdp", "context", "tensor"))
    for d, c in (((1, 2), (1, 4), (1, 8), (2, 4)) if full else ((1, 4), (2, 4)))}
rng = np.random.default_rng(0)
out = {"tokens": {}, "logits": {}}
for p in (1, 37):
    prompt = jnp.asarray(rng.integers(0, 31, size=(2, p)), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), prompt)
    key = jax.random.PRNGKey(3) if sampled else None
    kw = dict(temperature=1.0) if sampled else {}
    want = np.asarray(sampling.generate(model, params, prompt, 6, key, **kw))
    for name, mesh in meshes.items():
        with jax.set_mesh(mesh):
            got = np.asarray(sampling.generate(model, params, prompt, 6, key, **kw))
        out["tokens"][f"p{p}/{name}"] = bool((got == want).all())

# Logits of every step: a 37-token prefill then single tokens into a 40-slot cache (full to its
# last slot), and a 1-token prompt into a 64-slot cache (only the first shard holds a key: the
# others merge with weight 0).
decoder = model.clone(decode=True)
for length, chunks in ((40, ((0, 37), (37, 38), (38, 39), (39, 40))), (64, ((0, 1), (1, 2), (2, 3)))):
    tokens = jnp.asarray(rng.integers(0, 31, size=(2, length)), jnp.int32)
    params = model.init(jax.random.PRNGKey(1), tokens)["params"]

    def steps():
        cache = decoder.init(jax.random.PRNGKey(0), tokens)["cache"]
        outs = []
        for lo, hi in chunks:
            lg, state = jax.jit(lambda c, t: decoder.apply({"params": params, "cache": c}, t, mutable=["cache"]))(
                cache, tokens[:, lo:hi])
            cache = state["cache"]
            outs.append(np.asarray(lg))
        return np.concatenate(outs, 1)

    want = steps()
    for name, mesh in meshes.items():
        with jax.set_mesh(mesh):
            got = steps()
        out["logits"][f"S{length}/{name}"] = float(np.max(np.abs(got - want)))
print("RESULT " + json.dumps(out))
'''


def _run(encoding, kv_heads, sampled, full):
    return json.loads(run_on_fake_devices(_SCRIPT, encoding, str(kv_heads), "1" if sampled else "0",
                                          "1" if full else "0", devices=8).split("RESULT ")[-1])


@pytest.mark.parametrize("encoding,kv_heads,sampled,full", [
    ("goat", 2, False, False),  # GQA 2:1, greedy, context 4 and data 2 x context 4
    pytest.param("goat", 2, False, True, marks=SLOW_CASE),  # every mesh: context 2, 4, 8, data 2 x 4
    pytest.param("rope", 1, False, True, marks=SLOW_CASE),  # MQA RoPE: the same path, another encoding
    pytest.param("fox", 4, True, True, marks=SLOW_CASE),  # FoX (its own cache slot), sampled tokens
])
def test_decoding_split_over_context_equals_one_device(encoding, kv_heads, sampled, full):
    out = _run(encoding, kv_heads, sampled, full)
    assert all(out["tokens"].values()), out["tokens"]
    assert max(out["logits"].values()) < 1e-5, out["logits"]


_REFUSAL = r'''
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh
from goat_jax.models.lm import LMConfig, TransformerLM
from goat_jax.kernels.plan import AttentionPlan
from goat_jax.models import sampling

model = TransformerLM(LMConfig(vocab_size=31, num_layers=1, embed_dim=32, num_heads=4, mlp_dim=48,
                               position_encoding="alibi"), plan=AttentionPlan(implementation="xla"))
prompt = jnp.zeros((1, 4), jnp.int32)
params = model.init(jax.random.PRNGKey(0), prompt)
mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 1, 2, 1), ("data", "fsdp", "context", "tensor"))
try:
    with jax.set_mesh(mesh):
        sampling.generate(model, params, prompt, 2)
except ValueError as e:
    print("REFUSED " + str(e).splitlines()[0])
'''


def test_a_bias_encoding_is_refused_in_one_line_under_a_context_mesh():
    out = run_on_fake_devices(_REFUSAL, devices=2)
    assert "REFUSED decoding with the KV cache split over mesh.context=2: this position encoding adds a " \
           "materialized" in out, out


@pytest.mark.slow(reason="a benchmark's smoke run (~10 s): its decode loop is generate's, tested above")
def test_the_decode_benchmark_runs_split_and_gives_one_devices_tokens(tmp_path):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "decode.md"
    proc = subprocess.run([sys.executable, "experiments/bench_sharded_decode.py", "--slots", "256", "--contexts", "1",
                           "4", "--devices", "4", "--new_tokens", "4", "--repeats", "1", "--out", str(out)], cwd=root,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| 256 |")]
    assert [(r[1], r[2].split(" of ")[0], r[5], r[6].rstrip(" |")) for r in rows] == [
        ("1", "0.2", "yes", "0"), ("4", "0.1", "yes", "4")], rows  # MiB, one decimal
