"""Evaluation with each window split over devices (``experiments.evaluate --mesh_context N``,
goat_jax/eval/context.py; issue #49). On 8 fake CPU devices:

* a smoke LM trained for two steps, evaluated by the command line at 1x and 4x its training
  length with ``--mesh_context 4``, gives the perplexities of ``--mesh_context 1`` (float32
  round-off), and the program it runs all-gathers over the ``context`` axis (not one device's
  program on replicated inputs); the logits NIAH and the synthetic passkey score are one
  device's;
* a run of ``context_strategy='ring'`` is evaluated in a ring (no gather) with the same logits;
  a DNA model's likelihoods split and its GC agreement (sampled unsplit) equal one device's;
  KV-cache decoding under a context mesh is refused in one line naming mesh.context and the
  fixes, before any work, while the uncached path runs split and gives the cached path's tokens.

And before any work, one line naming the flag and the fix: an evaluation that decodes or reads
attention probabilities, ``--chunk_size``, a window the shards do not divide, more devices than
the host has, ``--mesh_context`` with ViT runs.
"""

import json

import pytest

from experiments import evaluate
from tests.config_helpers import run_on_fake_devices

_CLI_SCRIPT = r'''
import json, sys
import jax, numpy as np
from experiments import evaluate
from goat_jax.eval import context, extrapolation, lm_run
from goat_jax.train import trainer
from tests.config_helpers import lm_smoke_config

root = sys.argv[1]
workdir = root + "/run"
trainer.train_and_evaluate(lm_smoke_config(**{"num_train_steps": 2, "checkpoint_every_steps": 2,
                                              "mesh.data": -1}), workdir)
text = root + "/held_out.txt"
with open(text, "w") as f:
    f.write("Context parallelism splits one window over devices; the numbers must not move. " * 12)
out = {}
for c in (1, 4):
    results = evaluate.main(["--workdir", workdir, "--evals", "extrapolation", "--text", text,
                             "--multipliers", "1,4", "--mesh_context", str(c), "--out", f"{root}/eval{c}"])
    out[c] = {n: r["ppl"] for n, r in results["goat"]["extrapolation"].items()}
    with open(f"{root}/eval{c}/results.json") as f:
        out[f"setup{c}"] = json.load(f)["goat"]["setup"]

# The program the split evaluation runs: the window's attention gathers over the context axis.
run = context.on_mesh(lm_run.load_lm_run(workdir), 4)
nll = extrapolation.make_nll_fn(run.apply_fn)
x = np.zeros((1, 128), np.int32)
lowered = nll.lower(run.params, x, x, np.ones((1, 128), np.float32)).as_text()
out["gathers"] = lowered.count("all_gather")
out["devices"] = sorted(d.id for d in run.params["embed"]["embedding"].sharding.device_set)
# The logits NIAH and the synthetic passkey score (their argmax), split and not.
tokens = np.random.default_rng(0).integers(0, 259, (2, 256)).astype(np.int32)
one = lm_run.load_lm_run(workdir)
split = np.asarray(jax.jit(run.apply_fn)(run.params, tokens))
whole = np.asarray(jax.jit(one.apply_fn)(one.params, tokens))
out["logits_error"] = float(np.abs(split - whole).max() / np.abs(whole).max())
print("RESULT " + json.dumps(out))
'''


def test_evaluate_with_windows_split_over_context_gives_the_unsplit_perplexities(tmp_path):
    out = json.loads(run_on_fake_devices(_CLI_SCRIPT, str(tmp_path), timeout=900).split("RESULT ")[-1])
    one, four = out["1"], out["4"]
    assert sorted(one, key=int) == sorted(four, key=int) == ["64", "256"]
    for n in one:
        assert four[n] == pytest.approx(one[n], rel=1e-5), (n, one[n], four[n])
    assert out["gathers"] >= 1 and out["devices"] == [0, 1, 2, 3], out
    assert out["logits_error"] <= 1e-5, out["logits_error"]
    # results.json says how the windows were split (it said nothing of --mesh_context before).
    assert out["setup1"] == {"mesh_context": 1, "context_strategy": None}
    assert out["setup4"] == {"mesh_context": 4, "context_strategy": "all_gather"}


# A small model over the 5 DNA tokens, no training: the other paths a split run takes.
_PATHS_SCRIPT = r'''
import dataclasses, json
import jax, numpy as np
from goat_jax.eval import context, dna, lm_run
from goat_jax.models import sampling
from goat_jax.models.lm import LMConfig, TransformerLM
from goat_jax.kernels.plan import AttentionPlan
from goat_jax.train import tasks
from tests.config_helpers import lm_smoke_config

model = TransformerLM(LMConfig(vocab_size=5, num_layers=1, embed_dim=32, num_heads=2, mlp_dim=64, pos_rank=2,
                               abs_rank=2, training_seq_len=16))
params = jax.jit(model.init)(jax.random.key(0), np.zeros((1, 16), np.int32))["params"]
task = tasks.get_task("lm")
config = tasks.with_field_defaults(lm_smoke_config(), task)  # the engine's sharding_rules, context_strategy
run = context.on_mesh(lm_run.LMRun(workdir="", config=config, task=task, model=model, params=params, step=0,
                                   plan=AttentionPlan.from_config(config)), 4)
out = {}

# DNA: likelihoods split (the apply_fn experiments.evaluate passes), GC agreement sampled with
# the KV cache on the replicated parameters, unsplit.
records = [np.array([0, 1, 2, 4], np.int32)[np.random.default_rng(0).integers(0, 4, 600)]]  # A C G T, no N
kw = dict(multipliers=(1, 4), gc_num_windows=4, gc_prompt_len=8, gc_sample_len=8)
out["dna"] = [dna.evaluate_records(model, params, records, 16, **kw),
              dna.evaluate_records(model, run.params, records, 16, apply_fn=run.apply_fn, **kw)]

# A run of context_strategy='ring' is evaluated in a ring: no gather, ppermutes, the same logits.
tokens = np.random.default_rng(1).integers(0, 5, (2, 64)).astype(np.int32)
whole = np.asarray(jax.jit(lambda p, x: model.apply({"params": p}, x))(params, tokens))
ring_plan = run.plan.replace(context_strategy="ring")  # the run's one plan (load_run builds it from config.json)
ring = dataclasses.replace(run, plan=ring_plan, model=run.model.clone(plan=ring_plan))
ring_apply = jax.jit(ring.apply_fn)
text = ring_apply.lower(ring.params, tokens).as_text()
out["ring"] = {"gathers": text.count("all_gather"), "permutes": text.count("collective_permute"),
               "error": float(np.abs(np.asarray(ring_apply(ring.params, tokens)) - whole).max() / np.abs(whole).max())}

# Decoding under a context mesh: the KV cache's slots split over the shards (the partial softmaxes
# merged) and the uncached path (each step a whole window, split) both give the tokens of the
# cached one unsplit.
prompt = tokens[:, :8]
unsplit = np.asarray(sampling.generate(model, params, prompt, 8))
with jax.set_mesh(run.mesh):
    cached = sampling.generate(model, run.params, prompt, 8)
    uncached = sampling.generate(model, run.params, prompt, 8, use_cache=False)
out["cached_equal"] = bool((np.asarray(cached) == unsplit).all())
# The standard passkey's generator and --chunk_size's chunked windows, inside the run's mesh.
from goat_jax.eval import chunked, retrieval
from goat_jax.eval import context as eval_context
split_gen = eval_context.on_run_mesh(run, retrieval.greedy_generator(model, run.params))
out["passkey_generator_equal"] = bool((split_gen(np.asarray(prompt), 8) == unsplit).all())
targets, weights = np.roll(tokens, -1, 1), np.ones(tokens.shape, np.float32)
whole_nll = chunked.make_chunked_nll_fn(model, 16)(params, tokens, targets, weights)
split_nll = eval_context.on_run_mesh(run, chunked.make_chunked_nll_fn(model, 16))(run.params, tokens, targets, weights)
out["chunked_error"] = float(np.max(np.abs(np.asarray(split_nll[0]) - np.asarray(whole_nll[0]))
                                    / np.abs(np.asarray(whole_nll[0]))))
out["uncached_equal"] = bool((np.asarray(uncached) == unsplit).all())
print("RESULT " + json.dumps(out))
'''


def test_ring_runs_dna_and_decoding_under_a_context_mesh():
    out = json.loads(run_on_fake_devices(_PATHS_SCRIPT, timeout=900).split("RESULT ")[-1])
    unsplit, split = out["dna"]
    assert sorted(split["by_length"]) == sorted(unsplit["by_length"]) == ["16", "64"]
    for n, row in unsplit["by_length"].items():
        assert split["by_length"][n] == pytest.approx(row, rel=1e-5), n
    assert split["gc"] == unsplit["gc"] and unsplit["gc"]["num_windows"] == 4
    ring = out["ring"]
    assert ring["gathers"] == 0 and ring["permutes"] >= 1 and ring["error"] <= 1e-5, ring
    assert out["cached_equal"] and out["passkey_generator_equal"] and out["chunked_error"] < 1e-5, out
    assert out["uncached_equal"]


def _run_dir(path, task="lm", **data):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"task": task, "seq_len": 64, "model": {"position_encoding": "goat"},
                                                  "data": data}))
    return str(path)


@pytest.mark.parametrize("args,match", [
    (["--evals", "extrapolation,sinks"], r"but --evals sinks reads attention probabilities"),
    (["--evals", "diagnostics"], r"but --evals diagnostics runs the KV cache in query chunks and reads attention"),
    (["--evals", "documents"], r"but --evals documents reads attention probabilities"),
    (["--evals", "extrapolation", "--multipliers", "1", "--mesh_context", "3"],
     r"^--mesh_context 3 splits each window over 3 devices, but a window of 64 tokens \(--multipliers x seq_len "
     r"64\) cannot be split: windows must be multiples of 3 \(--mesh_context\)\. Change --multipliers or "
     r"--mesh_context\.$"),
    (["--evals", "extrapolation", "--mesh_context", "0"], r"^--mesh_context must be an integer >= 1"),
    (["--evals", "lm_eval", "--lm_eval_tasks", "x", "--lm_eval_max_length", "50", "--mesh_context", "4"],
     r"^--mesh_context 4 splits each window over 4 devices, but lm_eval's window of 50 tokens "
     r"\(--lm_eval_max_length\) cannot be split: it must be a multiple of 4 \(--mesh_context\)\. Give "
     r"--lm_eval_max_length a multiple of 4, or change --mesh_context\.$"),
])
def test_what_cannot_split_a_window_is_refused_before_any_work(tmp_path, args, match):
    workdir = _run_dir(tmp_path / "run")
    if "--mesh_context" not in args:
        args = args + ["--mesh_context", "2"]
    with pytest.raises(ValueError, match=match):
        evaluate.main(["--workdir", workdir, "--out", str(tmp_path / "o"), *args])
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("source,extra", [("synthetic", []), ("text", ["--chunk_size", "16"])])
def test_passkey_and_chunks_split_and_the_host_must_have_the_devices(tmp_path, source, extra):
    """The synthetic passkey is teacher-forced (whole windows), the standard one and --chunk_size
    decode with the KV cache split over the devices: each is accepted, so the next check speaks,
    the devices of this one-device test process."""
    workdir = _run_dir(tmp_path / "run", source=source)
    with pytest.raises(ValueError, match=r"^--mesh_context 2 splits each window over 2 devices, but this host "
                                         r"has 1; give at most --mesh_context 1\.$"):
        evaluate.main(["--workdir", workdir, "--evals", "passkey,niah,extrapolation", "--multipliers", "8",
                       "--mesh_context", "2", "--out", str(tmp_path / "o"), *extra])


def test_dna_lengths_the_shards_do_not_divide_are_refused(tmp_path):
    workdir = _run_dir(tmp_path / "run", task="dna")
    with pytest.raises(ValueError, match=r"^--mesh_context 8 splits each window over 8 devices, but a window of 100 "
                                         r"tokens \(--lengths\) cannot be split: windows must be multiples of 8"):
        evaluate.main(["--workdir", workdir, "--evals", "dna", "--lengths", "64,100", "--mesh_context", "8",
                       "--out", str(tmp_path / "o")])


def test_mesh_context_is_refused_for_vit_runs(tmp_path):
    workdir = _run_dir(tmp_path / "run", task="vit")
    with pytest.raises(ValueError, match=r"--mesh_context apply to language runs, not --evals resolution"):
        evaluate.main(["--workdir", workdir, "--evals", "resolution", "--resolutions", "28", "--mesh_context", "2",
                       "--out", str(tmp_path / "o")])
