"""lm-evaluation-harness on a trained tiny run through ``experiments.evaluate --evals lm_eval``:
local tasks (YAML + JSON written here) of all three request kinds, every score checked against
a float64 NumPy computation from the model's own logits. Offline: nothing is downloaded."""

import json
import logging
import math
import os

import jax
import numpy as np
import pytest

from tests.config_helpers import lm_smoke_config
from goat_jax.kernels.plan import AttentionPlan

pytest.importorskip("lm_eval")

WINDOW = 64  # the smoke config's seq_len: the model's window
BOS, EOS = 1, 2


def encode(text: str) -> list:
    """The byte tokenizer, written out: byte b -> b + 3."""
    return [b + 3 for b in text.encode("utf-8")]


def decode(ids) -> str:
    return bytes(i - 3 for i in ids if 3 <= i < 259).decode("utf-8", errors="replace")


_FORWARD = {}


def log_probs(run, tokens) -> np.ndarray:
    """float64 log-softmax of the model's logits on ``tokens`` (one row, batch 1): [T, V].

    The row is zero-filled to the window so that one compile serves every call; causality
    (tests/test_lm.py) makes the tail invisible to the first ``len(tokens)`` logits."""
    assert len(tokens) <= WINDOW
    if id(run) not in _FORWARD:
        _FORWARD[id(run)] = jax.jit(lambda p, x: run.model.apply({"params": p}, x))
    row = np.zeros((1, WINDOW), np.int32)
    row[0, :len(tokens)] = tokens
    logits = np.asarray(_FORWARD[id(run)](run.params, row)[0, :len(tokens)], np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def reference_loglikelihood(run, context: str, continuation: str):
    """Sum of log p(continuation | BOS + context), the context cut from the left to the window."""
    cont = encode(continuation)
    seq = ([BOS] + encode(context) + cont)[-(WINDOW + 1):]
    lp = log_probs(run, seq[:-1])
    rows = range(len(seq) - 1 - len(cont), len(seq) - 1)
    total = sum(lp[r, seq[r + 1]] for r in rows)
    return total, all(int(np.argmax(lp[r])) == seq[r + 1] for r in rows)


def reference_rolling(run, text: str) -> float:
    """Every token predicted once, each window of WINDOW predictions given the WINDOW tokens
    before its last target (the first window starts at BOS)."""
    full = [BOS] + encode(text)  # full[i + 1] is the i-th token to predict
    n, total, start = len(full) - 1, 0.0, 0
    while start < n:
        end = min(start + WINDOW, n)  # predict tokens start .. end-1
        first = max(end - WINDOW, 0)
        lp = log_probs(run, full[first:end])  # inputs full[first .. end-1] predict full[first+1 .. end]
        total += sum(lp[i - first, full[i + 1]] for i in range(start, end))
        start = end
    return total


def reference_greedy(run, context: str, max_new: int) -> list:
    tokens = ([BOS] + encode(context))[-(WINDOW - max_new):]
    new = []
    for _ in range(max_new):  # the full forward each step: no cache
        nxt = int(np.argmax(log_probs(run, tokens + new)[-1]))
        new.append(nxt)
    return new


def random_param_workdir(workdir: str) -> str:
    """A workdir as experiments.train leaves it (config.json + a checkpoint at step 1) holding
    N(0, 0.3) parameters: the evaluation path without compiling a training step."""
    import jax.numpy as jnp
    from goat_jax.train import checkpoint as checkpoint_lib
    from goat_jax.train import run as run_lib
    from goat_jax.train import tasks
    from tests.config_helpers import random_params

    config = lm_smoke_config()
    task = tasks.get_task(config.task)
    model = task.build_model(config, AttentionPlan.from_config(config))
    tx, _ = run_lib.make_optimizer(task, config)
    params = random_params(model, 8, np.random.default_rng(0))
    state = run_lib.TrainState(step=jnp.ones((), jnp.int32), params=params, opt_state=tx.init(params))
    config_dict = config.to_dict()
    os.makedirs(workdir)
    with open(run_lib.config_path(workdir), "w") as f:
        json.dump(config_dict, f, default=str)
    ckpt = checkpoint_lib.Checkpointer(run_lib.checkpoint_dir(workdir), config_dict, keep=1,
                                       async_save=False, resume_safe_fields=task.resume_safe_fields,
                                       field_defaults=tasks.field_defaults(task))
    ckpt.save(1, state, {}, wait=True)
    ckpt.close()
    return workdir


def trained_workdir(workdir: str) -> str:
    """Two training steps of the smoke config through the trainer."""
    from goat_jax.train import trainer

    trainer.train_and_evaluate(lm_smoke_config(num_train_steps=2, checkpoint_every_steps=2,
                                               **{"optimizer.warmup_steps": 1}), workdir)
    return workdir


def _write_tasks(directory, run):
    """Three local tasks; the generation task's stop string is taken from the model's own
    greedy continuation so that cutting at it is exercised."""
    # Every input lands in the window-long length bucket (one compile); the second context of
    # each kind is longer than the window, so truncation from the left is exercised.
    long_context = "A context much longer than the window of the tiny model, " * 3
    mc = [{"question": "The cat, which had been out all night, sat on the", "choices": ["mat", "moon"],
           "label": 0},
          {"question": long_context + "so", "choices": ["yes", "no", "maybe"], "label": 2}]
    rolling = [{"text": "A short text of about forty-five bytes, ok."},
               {"text": "A longer document that needs several rolling windows of the small "
                        "model's sixty-four bytes each. " * 2}]
    gen_prompt = "Hacker slang, as the Jargon File records it, begins with the letter A: "
    new = reference_greedy(run, gen_prompt, 8)
    new = new[:new.index(EOS)] if EOS in new else new
    stop = next((c for c in decode(new)[2:] if c.strip()), "\x00")
    gen = [{"prompt": gen_prompt, "answer": decode(new).split(stop)[0]},  # both prompts are
           {"prompt": long_context, "answer": "unlikely"}]  # cut to WINDOW - 8: one decoder compile
    specs = {
        "goat_mc": (mc, {"output_type": "multiple_choice", "doc_to_text": "{{question}}",
                         "doc_to_choice": "{{choices}}", "doc_to_target": "{{label}}",
                         "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}),
        "goat_rolling": (rolling, {"output_type": "loglikelihood_rolling", "doc_to_text": "",
                                   "doc_to_target": "{{text}}",
                                   "metric_list": [{"metric": "byte_perplexity"}, {"metric": "bits_per_byte"}]}),
        "goat_gen": (gen, {"output_type": "generate_until", "doc_to_text": "{{prompt}}",
                           "doc_to_target": "{{answer}}",
                           "generation_kwargs": {"until": [stop], "max_gen_toks": 8, "do_sample": False},
                           "metric_list": [{"metric": "exact_match", "aggregation": "mean",
                                            "higher_is_better": True}]}),
    }
    for name, (docs, spec) in specs.items():
        data = os.path.join(directory, f"{name}.json")
        with open(data, "w") as f:
            json.dump(docs, f)
        task = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": data}},
                "test_split": "test", **spec}
        with open(os.path.join(directory, f"{name}.yaml"), "w") as f:
            json.dump(task, f)  # JSON is YAML
    return stop


def _samples(out, task):
    with open(os.path.join(out, "lm_eval_samples", "goat", f"{task}.jsonl")) as f:
        return [json.loads(line) for line in f]


def check_local_tasks_through_the_cli(workdir, tmp_path, monkeypatch, caplog):
    for var, value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"),
                       ("TRANSFORMERS_OFFLINE", "1"), ("HF_HOME", str(tmp_path / "hf"))):
        monkeypatch.setenv(var, value)
    from experiments import evaluate
    from goat_jax.eval import lm_run

    caplog.set_level(logging.WARNING, logger="goat_jax.eval.harness")
    run = lm_run.load_lm_run(workdir)
    tasks_dir, out = tmp_path / "tasks", str(tmp_path / "out")
    tasks_dir.mkdir()
    stop = _write_tasks(str(tasks_dir), run)
    evaluate.main(["--workdir", workdir, "--evals", "lm_eval", "--lm_eval_tasks",
                   "goat_mc,goat_rolling,goat_gen", "--lm_eval_include_path", str(tasks_dir),
                   "--lm_eval_batch_size", "2", "--lm_eval_bootstrap_iters", "0",
                   "--lm_eval_log_samples", "--out", out])
    truncations = [r.getMessage() for r in caplog.records if "truncated from the left" in r.getMessage()]
    # rolling windows always fit; one multiple-choice context (3 requests) and both prompts do not
    assert [m.split(":")[0] for m in truncations] == ["loglikelihood", "generate_until"], truncations
    assert "3 of 5 contexts" in truncations[0] and "2 of 2 contexts" in truncations[1]
    with open(os.path.join(out, "results.json")) as f:
        results = json.load(f)["goat"]["lm_eval"]
    with open(os.path.join(out, "results.md")) as f:
        md = f.read()
    assert "## lm-evaluation-harness" in md and "goat_mc" in md and "byte_perplexity" in md

    # loglikelihood: every (context, continuation) request lm-eval formed
    correct = []
    for sample in _samples(out, "goat_mc"):
        refs = [reference_loglikelihood(run, *args) for args in sample["arguments"].values()] \
            if isinstance(sample["arguments"], dict) else \
            [reference_loglikelihood(run, *args) for args in sample["arguments"]]
        got = [resp[0] for resp in sample["resps"]]
        np.testing.assert_allclose([g[0] for g in got], [r[0] for r in refs], rtol=1e-5, atol=1e-4)
        assert [g[1] for g in got] == [r[1] for r in refs]
        correct.append(int(np.argmax([r[0] for r in refs])) == sample["target"])
    assert results["results"]["goat_mc"]["acc,none"] == pytest.approx(np.mean(correct))

    # loglikelihood_rolling: the long document spans several windows
    texts = [s["doc"]["text"] for s in _samples(out, "goat_rolling")]
    assert max(len(t) for t in texts) > 2 * WINDOW
    ref = [reference_rolling(run, t) for t in texts]
    got = [s["resps"][0][0] for s in _samples(out, "goat_rolling")]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)
    num_bytes = sum(len(t.encode()) for t in texts)
    assert results["results"]["goat_rolling"]["byte_perplexity,none"] == pytest.approx(
        math.exp(-sum(ref) / num_bytes), rel=1e-5)

    # generate_until: greedy with the KV cache == greedy by full forwards, cut at EOS and `until`
    for sample in _samples(out, "goat_gen"):
        new = reference_greedy(run, sample["doc"]["prompt"], 8)
        new = new[:new.index(EOS)] if EOS in new else new
        assert sample["resps"][0][0] == decode(new).split(stop)[0]
    assert results["results"]["goat_gen"]["exact_match,none"] >= 0.5  # the first doc's answer


def test_local_tasks_through_the_cli_equal_the_float64_reference(tmp_path, monkeypatch, caplog):
    check_local_tasks_through_the_cli(random_param_workdir(str(tmp_path / "run")), tmp_path,
                                      monkeypatch, caplog)


@pytest.mark.slow(reason="trains a run and runs lm-eval tasks on it")
def test_local_tasks_on_a_trained_run(tmp_path, monkeypatch, caplog):
    check_local_tasks_through_the_cli(trained_workdir(str(tmp_path / "run")), tmp_path,
                                      monkeypatch, caplog)


def test_bad_lm_eval_flags_fail_before_any_work(tmp_path):
    from experiments import evaluate

    with pytest.raises(ValueError, match="--lm_eval_tasks"):
        evaluate.main(["--workdir", str(tmp_path / "nope"), "--evals", "lm_eval"])
    with pytest.raises(ValueError, match="apply to --evals lm_eval only"):
        evaluate.main(["--workdir", str(tmp_path / "nope"), "--evals", "sinks", "--lm_eval_tasks", "x"])
    with pytest.raises(ValueError, match="no such directory"):
        evaluate.main(["--workdir", str(tmp_path / "nope"), "--evals", "lm_eval", "--lm_eval_tasks",
                       "x", "--lm_eval_include_path", str(tmp_path / "missing")])
    assert not os.listdir(tmp_path)


def test_goat_lm_refuses_synthetic_runs_and_bad_arguments(tmp_path):
    from goat_jax.eval import harness
    from tests.config_helpers import random_lm_run

    run = random_lm_run(tmp_path, lm_smoke_config())
    for kwargs, match in (({"batch_size": 0}, "batch_size"), ({"max_length": 1}, "max_length"),
                          ({"max_gen_toks": True}, "max_gen_toks"), ({"prefill_multiple": 0}, "prefill_multiple")):
        with pytest.raises(ValueError, match=match):
            harness.GoatLM(run, **kwargs)
    run.config.data.source = "synthetic"
    with pytest.raises(ValueError, match="synthetic-task run has no text tokenizer"):
        harness.GoatLM(run)
    assert harness.bucket_length(1, 64) == 16 and harness.bucket_length(17, 64) == 32
    assert harness.bucket_length(33, 40) == 40


@pytest.mark.slow(reason="compiles the decoder for three prompt buckets (~30 s of an idle core); generate_until against the float64 greedy reference runs in the default suite (test_local_tasks_through_the_cli_equal_the_float64_reference)")
def test_generate_until_shares_one_compile_across_prompt_lengths_of_a_bucket(tmp_path):
    """Two prompts of two lengths below prefill_multiple=16 tokens and one in the next bucket:
    two decoder compiles, and every continuation equals the exact-length decode of
    prefill_multiple=1 (which compiles once per length)."""
    from goat_jax.eval import harness
    from goat_jax.models import sampling
    from tests.config_helpers import random_lm_run

    class Request:  # what generate_until reads of lm-eval's Instance
        def __init__(self, context):
            self.args = (context, {"until": ["\n\n"], "max_gen_toks": 6})

    run = random_lm_run(tmp_path, lm_smoke_config())
    requests = [Request("x" * n) for n in (1, 13, 27)]  # + BOS: 2, 14 and 28 tokens
    bucketed = harness.GoatLM(run, batch_size=4, prefill_multiple=16)
    before = sampling._generate_bucketed._cache_size()
    got = bucketed.generate_until(requests)
    assert sampling._generate_bucketed._cache_size() - before == 2
    assert got == harness.GoatLM(run, batch_size=4, prefill_multiple=1).generate_until(requests)


@pytest.mark.slow(reason="lm-eval indexes its whole task registry (~25 s of an idle core)")
def test_a_task_yaml_that_does_not_parse_is_named_when_its_task_is_asked_for(tmp_path):
    """lm-eval's index skips a task YAML with a syntax error silently; asking for its task names
    the file and the parser's error instead of only 'unknown task'."""
    from goat_jax.eval import harness

    (tmp_path / "good.yaml").write_text("task: fine_task\ndataset_path: json\noutput_type: loglikelihood\n"
                                        "doc_to_text: !function utils.x\n")
    (tmp_path / "broken.yaml").write_text("task: broken_task\ndataset_path: [json\n")
    assert [b.split(":")[0] for b in harness.unreadable_task_yamls(str(tmp_path))] == [str(tmp_path / "broken.yaml")]
    with pytest.raises(ValueError, match=r"unknown lm-eval task\(s\) \['broken_task'\].*broken\.yaml: .*Fix them"):
        harness.evaluate(None, ["broken_task"], include_path=str(tmp_path))


_SPLIT_SCRIPT = r'''
import json, os, sys
root = sys.argv[1]
for var, value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"),
                   ("HF_HOME", root + "/hf")):
    os.environ[var] = value
from experiments import evaluate
from goat_jax.eval import lm_run
from tests.test_harness import _samples, _write_tasks, random_param_workdir

workdir = random_param_workdir(root + "/run")
tasks_dir = root + "/tasks"
os.makedirs(tasks_dir)
_write_tasks(tasks_dir, lm_run.load_lm_run(workdir))
# Short requests (length buckets 16 and 32, not multiples of 3): what padding to the shards covers.
short = [{"question": "Hi", "choices": ["a", "bc"], "label": 0},
         {"question": "A cat sat on a", "choices": ["mat", "hat and a coat"], "label": 0}]
with open(tasks_dir + "/goat_short.json", "w") as f:
    json.dump(short, f)
with open(tasks_dir + "/goat_short.yaml", "w") as f:
    json.dump({"task": "goat_short", "dataset_path": "json",
               "dataset_kwargs": {"data_files": {"test": tasks_dir + "/goat_short.json"}}, "test_split": "test",
               "output_type": "multiple_choice", "doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}",
               "doc_to_target": "{{label}}",
               "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}, f)
TASKS = ("goat_mc", "goat_short", "goat_rolling", "goat_gen")
out = {}
for c in (1, 4, 3):
    evaluate.main(["--workdir", workdir, "--evals", "lm_eval", "--lm_eval_tasks", ",".join(TASKS),
                   "--lm_eval_include_path", tasks_dir, "--lm_eval_batch_size", "2", "--lm_eval_bootstrap_iters", "0",
                   "--lm_eval_max_length", "48", "--lm_eval_log_samples", "--mesh_context", str(c),
                   "--out", f"{root}/eval{c}"])
    with open(f"{root}/eval{c}/results.json") as f:
        saved = json.load(f)["goat"]
    out[c] = {"results": saved["lm_eval"]["results"], "setup": saved["setup"],
              "resps": {t: [s["resps"] for s in _samples(f"{root}/eval{c}", t)]
                        for t in TASKS}}
print("RESULT " + json.dumps(out))
'''


def test_lm_eval_with_the_window_split_over_context_gives_the_unsplit_scores(tmp_path):
    """``experiments.evaluate --evals lm_eval --mesh_context c`` on 8 fake CPU devices: every
    log-likelihood (multiple choice, rolling windows) equals ``--mesh_context 1``'s to float32
    round-off and the greedy generations are the same text. A 48-token window: at context 4 the
    length buckets (16, 32, 48) split as they are; at context 3 the short task's buckets are
    padded to 18 and 33 (unpadded, the split refuses them), the padding invisible to every score
    (causal attention)."""
    from tests.config_helpers import run_on_fake_devices

    out = json.loads(run_on_fake_devices(_SPLIT_SCRIPT, str(tmp_path)).split("RESULT ")[-1])
    one = out["1"]
    assert one["setup"]["mesh_context"] == 1
    for c in ("4", "3"):
        split = out[c]
        assert split["setup"] == {"mesh_context": int(c), "context_strategy": "all_gather"}, split["setup"]
        for task in ("goat_mc", "goat_short", "goat_rolling"):
            got = [[r[0] for r in resps] for resps in split["resps"][task]]
            ref = [[r[0] for r in resps] for resps in one["resps"][task]]
            scores = lambda rows: [x[0] if isinstance(x, list) else x for row in rows for x in row]  # noqa: E731
            np.testing.assert_allclose(scores(got), scores(ref), rtol=1e-5, atol=1e-4, err_msg=f"{task} at {c}")
        for task in ("goat_mc", "goat_short"):  # is_greedy flags
            assert [[r[0][1] for r in resps] for resps in split["resps"][task]] == \
                [[r[0][1] for r in resps] for resps in one["resps"][task]]
        assert split["resps"]["goat_gen"] == one["resps"]["goat_gen"]
        assert split["results"]["goat_mc"]["acc,none"] == one["results"]["goat_mc"]["acc,none"]
        assert split["results"]["goat_rolling"]["byte_perplexity,none"] == pytest.approx(
            one["results"]["goat_rolling"]["byte_perplexity,none"], rel=1e-5)
