"""Options the official recipes need (docs/protocols.md): N(0, std) attention projections and
the official C4 init, the span-weighted synthetic loss, and the official synthetic variant of
configs/retrieval_tiny.py. Defaults stay as they were."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from configs import lm_c4_125m
from goat_jax.models import lm as lm_lib
from goat_jax.tasks import lm as lm_task
from tests.marks import SLOW_CASE

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")


def _flat_params(cfg: lm_lib.LMConfig, seed: int = 0, length: int = 8) -> dict:
    """``{'path/to/leaf': float64 array}`` of a freshly initialized LM."""
    variables = jax.jit(lm_lib.TransformerLM(cfg).init)(jax.random.PRNGKey(seed), jnp.zeros((1, length), jnp.int32))
    params = jax.tree_util.tree_map(lambda x: getattr(x, "value", x), variables["params"],
                                    is_leaf=lambda x: hasattr(x, "value"))
    return {"/".join(k): np.asarray(v, np.float64) for k, v in traverse_util.flatten_dict(params).items()}


def _is_projection_kernel(path: str) -> bool:
    return path.endswith("kernel") and any(f"/{p}/" in path for p in PROJECTIONS)


def _kurtosis(x):
    x = x.ravel() - x.mean()
    return float(np.mean(x ** 4) / np.mean(x ** 2) ** 2)


@pytest.mark.parametrize("encoding", [pytest.param("goat", marks=pytest.mark.slow(reason="a 256-wide model; rope checks the same init path")), "rope"])
def test_attention_init_std_draws_normal_projections(encoding):
    """``attention_init_std=0.02``: every q/k/v/out kernel (GOAT's included) is N(0, 0.02);
    all other parameters are bit-identical to the default init at the same seed, and the
    default projections are Xavier-uniform over each [fan_in, fan_out] matrix."""
    base = lm_lib.LMConfig(num_layers=1, embed_dim=256, num_heads=4, mlp_dim=64, vocab_size=64,
                           block="gpt2", use_bias=True, position_encoding=encoding)
    default = _flat_params(base)
    normal = _flat_params(lm_lib.LMConfig(**{**base.__dict__, "attention_init_std": 0.02}))
    assert default.keys() == normal.keys()
    kernels = [k for k in default if _is_projection_kernel(k)]
    assert len(kernels) == 4 * base.num_layers
    for path, value in normal.items():
        if path not in kernels:
            np.testing.assert_array_equal(value, default[path], err_msg=path)
            continue
        n = value.size  # 256 x 256 = 65,536 draws: the std's standard error is 0.28%
        assert abs(value.std() / 0.02 - 1) < 0.02, path
        assert abs(value.mean()) < 5 * 0.02 / np.sqrt(n), path
        assert abs(_kurtosis(value) - 3.0) < 0.1, path  # normal (a uniform has 1.8)
        old = default[path]
        bound = np.sqrt(6.0 / (256 + 256))  # Xavier-uniform, fans E and N * H = E
        assert np.abs(old).max() <= bound
        assert abs(old.std() / (bound / np.sqrt(3)) - 1) < 0.02, path
        assert abs(_kurtosis(old) - 1.8) < 0.1, path


@SLOW_CASE  # ~10-25 s: a 12-layer model init (the init option itself: the test above)
def test_official_c4_init_std():
    """The official C4 recipe's init (docs/protocols.md, C4 125M) at its own depth, head size
    and ranks, narrowed (d 192, 3 heads of 64, vocab 512) so it initializes in a second: every
    Linear and the embedding N(0, 0.02), attention projections included; the sink MLP's kernels
    N(0, 1e-3) (pooled over the 12 layers), all biases 0, no residual scaling."""
    c = lm_c4_125m.get_config("goat")
    fields = c.model.to_dict()
    cfg = lm_lib.LMConfig(**{**fields, "embed_dim": 192, "num_heads": 3, "kv_num_heads": 3,
                             "mlp_dim": 768, "vocab_size": 512, "dtype": "float32"})
    params = _flat_params(cfg)
    groups = {"projection": [], "mlp": [], "embed": [], "sink_fc1": [], "sink_fc2": [], "bias": []}
    for path, value in params.items():
        if "key_bias" in path:
            groups["bias" if path.endswith("bias") else "sink_" + path.split("/")[-2]].append(value)
        elif path.endswith("kernel") and "/mlp/" in path:
            groups["mlp"].append(value)
        elif _is_projection_kernel(path):
            groups["projection"].append(value)
        elif path == "embed/embedding":
            groups["embed"].append(value)
        elif path.endswith("/bias") and ("_proj/" in path or "/mlp/" in path):
            groups["bias"].append(value)  # Linear biases (norm biases and prior_gate_bias aside)
    for name, std, tol in (("projection", 0.02, 0.01), ("mlp", 0.02, 0.01), ("embed", 0.02, 0.02),
                           ("sink_fc1", 1e-3, 0.2), ("sink_fc2", 1e-3, 0.5)):
        pooled = np.concatenate([v.ravel() for v in groups[name]])
        # tolerances ~6 standard errors of the std estimate: 1.8M, 2.4M, 98k, 480, 48 draws
        assert abs(pooled.std() / std - 1) < tol, (name, pooled.size, pooled.std())
    assert len(groups["projection"]) == 4 and groups["projection"][0].shape[0] == 12  # scanned
    assert len(groups["bias"]) == 4 + 2 + 2 and all(np.all(b == 0) for b in groups["bias"])


# ----------------------------------------------------------------------------------------------
# The official synthetic loss: (global + 10 * span) / 11
# ----------------------------------------------------------------------------------------------


def _log_softmax64(logits):
    z = logits - logits.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_span_loss_weights_give_the_official_loss(rng):
    """Through the task's own loss, on a constructed batch: the trained loss with
    ``span_loss_weight = 10`` is (mean CE over all targets + 10 * mean CE over the span) / 11,
    computed by hand in float64; None keeps the span-only loss (the default)."""
    from goat_jax.data import synthetic
    from goat_jax.tasks import lm as lm_task

    b, t, v, k = 3, 12, 7, 4
    targets = rng.integers(0, v, size=(b, t)).astype(np.int32)
    logits = rng.normal(size=(b, t, v)) * 2.0
    span = np.zeros((b, t), np.float32)
    span[:, t - k:] = 1.0  # the scored span at the end, as passkey / NIAH
    ce = -np.take_along_axis(_log_softmax64(logits), targets[..., None], -1)[..., 0]  # [B, T]
    hand_global, hand_span = ce.mean(), ce[:, t - k:].mean()

    from goat_jax import losses

    def apply_fn(variables, inputs, targets_, weights_, method=None, **_):  # the model's token_loss on these logits
        assert method == "token_loss"
        return losses.weighted_cross_entropy(jnp.asarray(logits, jnp.float32), targets_, weights_)
    for weight, expected in ((10.0, (hand_global + 10 * hand_span) / 11), (0.5, (hand_global + 0.5 * hand_span) / 1.5),
                             (None, hand_span)):
        weights = span if weight is None else synthetic.span_loss_weights(span, weight)
        batch = {"inputs": np.zeros((b, t), np.int32), "targets": targets, "weights": weights}
        loss_sum, (weight_sum, _) = lm_task.loss(apply_fn, None, batch, None)
        assert float(loss_sum / weight_sum) == pytest.approx(expected, rel=1e-5), weight
    with pytest.raises(ValueError, match="at least one scored target"):
        synthetic.span_loss_weights(np.zeros((1, 4)), 10.0)
    with pytest.raises(ValueError, match="span_loss_weight must be >= 0"):
        synthetic.span_loss_weights(span, -1.0)


def test_span_loss_weight_applies_to_training_batches_only():
    """The datasets: training batches carry the mixed weights, eval batches the span mask."""
    from configs import retrieval_tiny
    from goat_jax.data import synthetic

    c = retrieval_tiny.get_config("passkey,official")
    train, make_eval, _ = synthetic.make_synthetic_datasets(c.data, seq_len=c.seq_len, global_batch_size=4,
                                                            seed=0)
    batch, ev = next(train), next(make_eval())
    span = (ev["weights"] > 0).astype(np.float32)
    assert set(np.unique(ev["weights"])) == {0.0, 1.0} and span.sum(-1).tolist() == [8.0] * 4
    default_train, _, _ = synthetic.make_synthetic_datasets(
        retrieval_tiny.get_config("passkey").data, seq_len=c.seq_len, global_batch_size=4, seed=0)
    np.testing.assert_array_equal(next(default_train)["weights"], span)  # default: span only
    np.testing.assert_allclose(batch["weights"], synthetic.span_loss_weights(span, 10.0))


def test_official_synthetic_variant_fields():
    """``configs/retrieval_tiny.py:<task>,<enc>,official``: the official synthetic script's
    settings (docs/protocols.md, Passkey) at every size; without 'official' nothing changes."""
    from configs import retrieval_tiny

    for size in ("", ",smoke", ",paper"):
        for enc in ("goat", "rope"):
            plain = retrieval_tiny.get_config(f"niah,{enc}{size}")
            c = retrieval_tiny.get_config(f"niah,{enc}{size},official")
            assert (c.model.pos_rank, c.model.abs_rank, c.model.init_scale_prior) == (8, 8, 3e-3)
            assert c.data.span_loss_weight == 10.0 and c.model.baseline_attention_scale == 1.0
            assert plain.data.span_loss_weight is None and plain.model.baseline_attention_scale is None
            assert plain.model.init_scale_prior == 1e-3
            cfg = lm_task.model_config(c)  # the model's fields of c.model (the plan's are the plan's)
            assert cfg.head_size - (2 * 8 + 1) >= 1  # R = 8 fits the head at every size
            changed = {k for k, v in c.model.items() if plain.model[k] != v}
            assert changed <= {"pos_rank", "abs_rank", "init_scale_prior", "baseline_attention_scale",
                               "num_heads", "kv_num_heads"}


@SLOW_CASE  # ~25 s of CPU: two trainer runs (the reproduce smoke suite covers one too)
def test_official_synthetic_smoke_trains(tmp_path):
    """Two steps of the official variant, GOAT and a scale-1 baseline: finite losses."""
    from configs import retrieval_tiny
    from goat_jax.train import trainer

    for enc in ("goat", "rope"):
        c = retrieval_tiny.get_config(f"passkey,{enc},smoke,official")
        c.progress_bar, c.num_train_steps, c.checkpoint_every_steps = False, 2, 2
        summary = trainer.train_and_evaluate(c, str(tmp_path / enc))
        assert summary["step"] == 2 and np.isfinite(summary["train_loss"])
