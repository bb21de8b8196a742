"""goat_jax/eval/probe.py (experiments.probe_extrapolation) on an untrained smoke model with a randomized prior."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import lm_tiny
from goat_jax.eval import probe as probe_extrapolation
from goat_jax.eval import lm_run
from goat_jax.train import tasks
from goat_jax.kernels.plan import AttentionPlan


@pytest.mark.slow(reason="trains a run and probes it with every intervention")
def test_probe_changes_only_what_each_intervention_names(tmp_path, rng):
    config = lm_tiny.get_config("goat,smoke")
    config.seq_len = config.model.training_seq_len = 16
    task = tasks.get_task("lm")
    model = task.build_model(config, AttentionPlan.from_config(config))
    params = nn.unbox(model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"])
    def randomize(path, x):  # a prior and weights large enough that every position term shows
        names = [getattr(p, "key", "") for p in path]
        if "prior" in names:
            return jnp.asarray(rng.normal(0, 2.0 if "key_bias" in names else 0.5, x.shape), x.dtype)
        return x * 25.0 if x.ndim >= 2 else x

    params = jax.tree_util.tree_map_with_path(randomize, params)
    run = lm_run.LMRun(workdir=str(tmp_path), config=config, task=task, model=model, params=params, step=0,
                       plan=model.plan)
    tokens = rng.integers(3, 259, size=4 * 64 + 1).astype(np.int32)
    result = probe_extrapolation.probe(run, multiple=4, tokens=tokens)
    assert result["edges"] == [0, 16, 32, 64] and result["windows"] == 4
    b = result["buckets"]
    assert list(b) == ["as trained", "sink inputs clamped", "sink MLP removed", "slopes removed",
                       "kappa lags clamped", "last L keys", "linear sink"]
    # Inside the training window only the two removals change anything.
    for label in ("sink inputs clamped", "kappa lags clamped", "last L keys", "linear sink"):
        assert b[label][0] == pytest.approx(b["as trained"][0], rel=1e-6), label
        assert b[label][1:] != pytest.approx(b["as trained"][1:], rel=1e-5), label
    for label in ("sink MLP removed", "slopes removed"):
        assert b[label][0] != pytest.approx(b["as trained"][0], rel=1e-5), label
    assert result["shifted"][0] == pytest.approx(b["as trained"][0], rel=1e-6)
    assert result["shifted"][16] != pytest.approx(b["as trained"][0], rel=1e-5)
    assert "| linear sink |" in probe_extrapolation.markdown(result)
