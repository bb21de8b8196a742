"""The paper dry run's table (goat_jax/reproduce/paper_table.py): parameter counts from eval_shape
equal a real init's, the official-recipe comparison finds exactly the changed fields, and the
rendered rows are shell comments with the right budget arithmetic."""

import jax
import numpy as np

from goat_jax.config.files import load_config
from goat_jax.reproduce import paper_table
from goat_jax.reproduce.suites import Job
from goat_jax.train import tasks
from goat_jax.kernels.plan import AttentionPlan


def test_parameter_count_equals_a_real_init():
    config = load_config("configs/retrieval_tiny.py:niah,goat,smoke,official")
    task = tasks.get_task(config.task)
    batch = task.dummy_batch(config, 1)
    params = jax.jit(task.build_model(config, AttentionPlan.from_config(config)).init)(jax.random.PRNGKey(0), *task.model_inputs(batch))["params"]
    real = sum(np.asarray(getattr(x, "value", x)).size
               for x in jax.tree_util.tree_leaves(params, is_leaf=lambda x: hasattr(x, "value")))
    assert paper_table.parameter_count(config) == real


def test_differences_name_exactly_the_departures():
    for enc in ("goat", "alibi"):
        c4 = load_config(f"configs/lm_c4_125m.py:{enc}")
        assert paper_table.differences(c4, paper_table.official_recipe("lm", "c4_125m", enc)) == {}
    recipe = paper_table.official_recipe("lm", "c4_125m", "goat")
    changed = load_config("configs/lm_c4_125m.py:goat", {"model.pos_rank": 8, "seed": 0})
    assert paper_table.differences(changed, recipe) == {"model.pos_rank": (8, 4), "seed": (0, 1370)}
    llama = load_config("configs/lm_c4_125m.py:goat,llama")  # ours: far from the script
    assert {"model.block", "model.vocab_size", "optimizer.learning_rate"} <= set(
        paper_table.differences(llama, recipe))
    # Synthetic: the official variant matches; the plain paper size departs where it should.
    plain = load_config("configs/retrieval_tiny.py:niah,rope,paper")
    assert set(paper_table.differences(plain, paper_table.official_recipe("niah", "niah", "rope"))) == {
        "data.span_loss_weight", "model.baseline_attention_scale"}
    # A model field the config file leaves out is compared at the model's default (what runs;
    # load_config adds it at that default).
    from configs import lm_fineweb_1b
    from goat_jax.models import lm

    assert "block" not in lm_fineweb_1b.get_config("goat").model
    fw = load_config("configs/lm_fineweb_1b.py:goat")
    assert fw.model.block == lm.LMConfig.block
    assert paper_table.differences(fw, paper_table.official_recipe("lm", "fineweb_1b", "goat")) == {}


def test_rendered_rows():
    jobs = [Job("lm", "c4_125m", "goat", "configs/lm_c4_125m.py:goat", {}, "/r/c4"),
            Job("niah", "niah", "rope", "configs/retrieval_tiny.py:niah,rope,paper", {}, "/r/n"),
            Job("toy", "copy_mixture", "goat", "configs/toy_copy_mixture.py", {}, "/r/t")]
    rows = paper_table.rows(jobs)
    c4 = rows[0]
    # GPT-2 small without its position table, plus GOAT's prior (R = M = 4) in 12 layers.
    e, f, v = 768, 3072, 50_257
    dense = 12 * (4 * e * e + 4 * e + 2 * e * f + f + e + 4 * e) + v * e + 2 * e
    assert c4.params == dense + 12 * (2 * 12 * 4 + 2 * 12 + 3 * 12 + 49)
    assert (c4.tokens_per_step, c4.steps) == (128 * 2048, 15_259)
    assert 4e9 <= c4.total_tokens < 4e9 + 128 * 2048 and c4.diffs == {}
    text = paper_table.render(rows)
    lines = text.splitlines()
    assert all(line.startswith("#") for line in lines)  # the dry run's output stays a shell script
    assert f"| lm/c4_125m/goat | configs/lm_c4_125m.py:goat | {c4.params:,} (123.66M) | 262,144 | 15,259 |" in text
    assert lines[2].endswith("| none |")
    assert "data.span_loss_weight = None (official 10.0)" in lines[3]
    assert lines[4].endswith("| no official recipe (ours) |")
    assert any(line.startswith("# c4_125m: official train_c4.py") for line in lines)
