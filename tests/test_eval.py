"""Tests for goat_jax.eval: perplexity by length, retrieval scores, sinks, prior checks, plots.

Scores are checked against models whose answers are known: a *perfect* model (one-hot logits
of the true next token, the Bayes-optimal copy-mixture predictor, a perfect induction head)
and a constant-logit model at chance. Real models are tiny (2 layers, d 32, T <= 64).
"""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from goat_jax import prior as prior_lib
from goat_jax.layers.goat import GoatPrior
from goat_jax.data import synthetic, text
from goat_jax.data.tokenizers import ByteTokenizer
from goat_jax.eval import extrapolation, plots, retrieval, sinks
from goat_jax.models import LMConfig, TransformerLM
from tests import jitted
from tests.config_helpers import random_params
from goat_jax.kernels.plan import AttentionPlan

V = 259
TINY = dict(vocab_size=V, num_layers=2, embed_dim=32, num_heads=2, mlp_dim=64, pos_rank=2,
            abs_rank=2, training_seq_len=16, max_len=64)


def tiny_lm(seed=0, t=16, **overrides):
    """A tiny TransformerLM and numpy-filled random params (no init compile)."""
    model = TransformerLM(LMConfig(**{**TINY, **overrides}))
    return model, random_params(model, t, np.random.default_rng(seed))


def fresh_prior_lm():
    """A tiny GOAT LM whose priors have their real initial values (the rest random): GoatPrior
    alone is initialized, jitted, which is much cheaper than an eager init of the whole LM."""
    model, params = tiny_lm()
    prior = GoatPrior(prior_lib.PriorSpec(num_heads=2, kv_num_heads=2, pos_rank=2, abs_rank=2,
                                          training_seq_len=16))
    pos = prior_lib.positions_1d(4)
    init = jax.jit(prior.init)
    for i in range(2):
        params[f"layer_{i}"]["attention"]["prior"] = init(jax.random.PRNGKey(i), pos, pos)["params"]
    return model, params


def one_hot_apply(next_token):
    """A perfect model: logits 50 on ``next_token(tokens)`` [B, T], 0 elsewhere."""
    return lambda params, tokens: 50.0 * jax.nn.one_hot(next_token(tokens), V)


def constant_apply(params, tokens):
    # Zeros that depend on the tokens: a literal constant would be constant-folded by XLA.
    return jnp.where(tokens[..., None] >= 0, 0.0, 1.0) * jnp.ones((V,), jnp.float32)


# ----------------------------------------------------------------------------------------------
# Extrapolation
# ----------------------------------------------------------------------------------------------


def test_perfect_model_has_ppl_one_and_constant_model_ppl_vocab():
    # Deterministic stream x_{t+1} = (x_t + 1) mod V: its entropy is 0, so perfect ppl = 1.
    stream = (np.arange(1000) * 1 + 5) % V
    perfect = one_hot_apply(lambda x: (x + 1) % V)
    res = extrapolation.perplexity_by_length(perfect, None, stream, train_len=16)
    assert sorted(res) == [16, 32, 64, 128, 256]
    for w, r in res.items():
        assert r.ppl == pytest.approx(1.0, abs=1e-6)
        assert r.num_tokens == (999 // w) * w  # non-overlapping, tail dropped
    # I.i.d. uniform tokens: the constant model *is* the true model; ppl = V exactly.
    uniform = np.random.default_rng(0).integers(0, V, 2000)
    res = extrapolation.perplexity_by_length(constant_apply, None, uniform, 32, (1, 4))
    for r in res.values():
        assert r.nll == pytest.approx(np.log(V), rel=1e-6) and r.ppl == pytest.approx(V, rel=1e-5)


def test_sliding_window_scores_only_the_last_stride_targets():
    # Perfect only on the last 4 positions of each window, uniform elsewhere: with stride 4 only
    # the first window (which scores all 16 targets) pays log V on its first 12.
    w, stride, n = 16, 4, 200
    stream = np.arange(n) % V

    def apply_fn(params, x):
        good = 50.0 * jax.nn.one_hot((x + 1) % V, V)
        late = (jnp.arange(x.shape[1]) >= x.shape[1] - stride)[None, :, None]
        return jnp.where(late, good, 0.0)

    r = extrapolation.perplexity(apply_fn, None, stream, w, stride=stride, batch_size=3)
    num_windows = (n - w - 1) // stride + 1
    assert r.num_tokens == w + (num_windows - 1) * stride
    assert r.nll == pytest.approx((w - stride) * np.log(V) / r.num_tokens, rel=1e-5)
    with pytest.raises(ValueError, match="stride"):
        extrapolation.perplexity(apply_fn, None, stream, 8, stride=9)
    with pytest.raises(ValueError, match="shorter than one window"):
        extrapolation.perplexity(apply_fn, None, stream[:10], 16)


def test_bayes_optimal_copy_mixture_reaches_the_true_entropy():
    kw = dict(vocab_size=16, p_first=0.25, p_prev=0.5, lag=1)
    it = synthetic.SyntheticIterator(lambda r: synthetic.copy_mixture_batch(r, 64, 64, **kw), seed=0)
    batches = [next(it) for _ in range(4)]  # 16k targets
    optimal = lambda params, x: synthetic.copy_mixture_log_probs(x, **kw)
    res = extrapolation.perplexity_on_batches(optimal, None, batches)
    assert res.num_tokens == 4 * 64 * 64
    assert res.nll == pytest.approx(synthetic.copy_mixture_entropy(64, **kw), abs=0.03)
    chance = extrapolation.perplexity_on_batches(
        lambda p, x: jnp.where(x[..., None] >= 0, 0.0, 1.0) * jnp.ones(16), None, batches)
    assert chance.ppl == pytest.approx(16.0, rel=1e-5)


def test_tokens_from_text_pipeline_eval_batches(tmp_path):
    doc = "goat priors park attention in u(j), not in key norms. " * 20
    path = tmp_path / "doc.txt"
    path.write_text(doc)
    cfg = text.default_data_config()
    cfg.paths, cfg.eval_paths, cfg.doc_split, cfg.read_threads = [str(path)], [str(path)], "files", 0
    cfg.num_eval_batches = 0
    _, make_eval, tok = text.make_lm_datasets(cfg, seq_len=32, global_batch_size=2, seed=0)
    stream = extrapolation.tokens_from_batches(make_eval())
    expected = [tok.bos_id, *tok.encode(doc.strip()), tok.eos_id]
    np.testing.assert_array_equal(stream, expected)


def test_real_model_perplexity_by_length_shapes():
    model, params = tiny_lm()
    stream = np.random.default_rng(1).integers(3, V, 200)
    res = extrapolation.perplexity_by_length(extrapolation.model_apply_fn(model), params, stream,
                                             train_len=16, multipliers=(1, 4, 16))
    assert sorted(res) == [16, 64]  # 256 > stream: left out
    assert all(np.isfinite(r.nll) and r.ppl > 1 for r in res.values())


# ----------------------------------------------------------------------------------------------
# Retrieval
# ----------------------------------------------------------------------------------------------


def induction_oracle(m=8):
    """A perfect teacher-forced model for passkey/NIAH windows: position i < T-1 predicts
    inputs[i+1] (known), the last position copies what followed the earlier occurrence of the
    last ``m`` tokens -- a perfect induction head, which is what retrieval needs."""

    def apply_fn(params, x):
        b, t = x.shape
        nxt = jnp.roll(x, -1, axis=1)
        j = jnp.arange(t)
        match = (j >= m - 1) & (j <= t - 2)
        for o in range(m):
            match = match & (jnp.roll(x, o, axis=1) == x[:, t - 1 - o:t - o])
        found = jnp.argmax(match, axis=1)  # first earlier occurrence
        last = jnp.take_along_axis(x, (found + 1)[:, None], axis=1)[:, 0]
        return 50.0 * jax.nn.one_hot(nxt.at[:, -1].set(last), V)

    return apply_fn


def test_passkey_synthetic_perfect_and_chance():
    perfect = retrieval.passkey_accuracy_synthetic(induction_oracle(), None, [64, 128],
                                                   num_examples=10, batch_size=4)
    assert perfect == {64: 1.0, 128: 1.0}
    chance = retrieval.passkey_accuracy_synthetic(constant_apply, None, [64], num_examples=4)
    assert chance == {64: 0.0}


def test_niah_grid_perfect_and_chance():
    lengths, depths = [48, 96], [0.0, 0.5, 1.0]
    grid = retrieval.niah_accuracy_grid(induction_oracle(), None, lengths, depths,
                                        num_examples=5, batch_size=4)
    assert grid["token_accuracy"].shape == grid["exact_match"].shape == (2, 3)
    np.testing.assert_array_equal(grid["token_accuracy"], 1.0)
    np.testing.assert_array_equal(grid["exact_match"], 1.0)
    np.testing.assert_array_equal(grid["lengths"], lengths)
    chance = retrieval.niah_accuracy_grid(constant_apply, None, lengths, depths, num_examples=4)
    np.testing.assert_array_equal(chance["token_accuracy"], 0.0)


def test_span_scores_drop_padding_rows():
    batch, _ = synthetic.passkey_batch(np.random.default_rng(0), 3, 64)
    batch["weights"][2] = 0.0
    s = retrieval.span_scores(induction_oracle(), None, [batch])
    assert s["scored"].tolist() == [8, 8] and s["exact_match"].all()


def test_passkey_standard_perfect_random_and_real_model():
    tok = ByteTokenizer()

    def oracle(prompts, n):  # reads the needle back, as a perfect model would
        out = []
        for p in prompts:
            key = tok.decode(p).split("The pass key is ")[1].split(".")[0]
            answer = np.asarray(tok.encode(f" {key}. Done" + " " * n)[:n])
            out.append(np.concatenate([p, answer]))
        return np.stack(out)

    def babbler(prompts, n):
        return np.concatenate([prompts, np.full((len(prompts), n), tok.encode("x")[0])], axis=1)

    lengths = [280, 400]
    assert retrieval.passkey_accuracy_standard(oracle, lengths, num_trials=5, batch_size=2) == {
        280: 1.0, 400: 1.0}
    assert retrieval.passkey_accuracy_standard(babbler, [280], num_trials=3) == {280: 0.0}
    assert retrieval.first_integer("is 123. 45") == 123 and retrieval.first_integer("none") is None
    # Wiring through the KV-cache greedy decoder of a real (untrained) model.
    model, params = tiny_lm(t=8, training_seq_len=256)
    acc = retrieval.passkey_accuracy_standard(retrieval.greedy_generator(model, params), [272],
                                              num_trials=2, batch_size=2, max_new_tokens=4)
    assert set(acc) == {272} and 0.0 <= acc[272] <= 1.0


# ----------------------------------------------------------------------------------------------
# Sinks and the prior
# ----------------------------------------------------------------------------------------------


def attention_out(model, params, tokens, layer, maps):
    """The attention module's output recomputed from ``maps`` (probs @ v, then out_proj)."""
    cfg = model.config
    v = jnp.repeat(maps["values"][layer], cfg.num_heads // cfg.kv_heads, axis=2)
    out = jnp.einsum("bnts,bsnh->btnh", maps["probs"][layer], v)
    return jnp.einsum("btnh,nhe->bte", out, params[f"layer_{layer}"]["attention"]["out_proj"]["kernel"])


@pytest.mark.parametrize("encoding", ["goat", "rope", "rope_pi", "alibi", "nope"])
def test_attention_maps_reproduce_the_model(encoding):
    model, params = tiny_lm(position_encoding=encoding, kv_num_heads=1)
    tokens = jnp.asarray(np.random.default_rng(2).integers(3, V, (2, 24)), jnp.int32)
    maps = sinks.attention_maps(model, params, tokens)
    assert maps["probs"].shape == (2, 2, 2, 24, 24)
    np.testing.assert_allclose(maps["probs"].sum(-1), 1.0, rtol=1e-5)
    assert np.all(np.triu(maps["probs"], 1) == 0)
    is_attention = lambda m, method: m.name == "attention" and method == "__call__"
    capture = jax.jit(lambda p, x: model.apply({"params": p}, x, mutable=["intermediates"],
                                               capture_intermediates=is_attention)[1])
    state = capture(params, tokens)["intermediates"]
    for layer in range(2):
        expected = state[f"layer_{layer}"]["attention"]["__call__"][0]
        np.testing.assert_allclose(attention_out(model, params, tokens, layer, maps), expected,
                                   rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("layer", ["goat", "alibi"])
def test_sown_probabilities_equal_the_float64_softmax(layer):
    """The probabilities the layers sow (what attention_maps reads) are the reference softmax."""
    import flax
    from goat_jax.layers.positional import PositionalAttention
    from tests import goat_reference as ref

    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(2, 10, 32)), jnp.float32)
    pad = np.zeros((2, 10), bool)
    pad[1, 7:] = True
    if layer == "goat":
        module = ref.goat_module(num_heads=4, kv_num_heads=2, pos_rank=2, abs_rank=2, implementation="dense")
    else:
        module = PositionalAttention(num_heads=4, kv_num_heads=2, position_encoding="alibi",
                                     implementation="dense")
    params = flax.core.meta.unbox(jitted.init(module, jax.random.PRNGKey(0), x))
    params = jax.tree_util.tree_map(lambda a: jnp.asarray(rng.normal(0, 0.5, a.shape), a.dtype), params)
    _, state = jitted.apply(module, params, x, is_causal=True, key_padding_mask=jnp.asarray(pad),
                            mutable=["intermediates"])
    probs = np.asarray(state["intermediates"]["attention_probs"][0])  # [B, N, T, S]

    p = ref.unboxed(params)
    if layer == "goat":
        cfg = dict(num_heads=4, kv_num_heads=2, head_dim=8, pos_rank=2, abs_rank=2)
        logits = ref.goat_attention(params, cfg, x, x, x, is_causal=True, key_padding_mask=pad,
                                    return_logits=True)
    else:  # ALiBi written out: q.k / sqrt(H) - m_h |i - j|, slopes 2**(-8 h / N)
        q = np.einsum("bte,enh->btnh", np.asarray(x, np.float64), p["q_proj"]["kernel"]) + p["q_proj"]["bias"]
        k = np.einsum("bte,enh->btnh", np.asarray(x, np.float64), p["k_proj"]["kernel"]) + p["k_proj"]["bias"]
        logits = np.einsum("btnh,bsnh->bnts", q, np.repeat(k, 2, axis=2)) / np.sqrt(8)
        slopes = 2.0 ** (-8.0 * np.arange(1, 5) / 4)
        logits = logits - slopes[:, None, None] * np.abs(np.arange(10)[:, None] - np.arange(10)[None])
        visible = (np.arange(10)[None, :] <= np.arange(10)[:, None]) & ~pad[:, None, None, :]
        logits = np.where(visible, logits, -np.inf)
    want = np.exp(logits - logits.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    np.testing.assert_allclose(probs, want, atol=1e-6)
    # Without a mutable 'intermediates' (or on another kernel) nothing is sown.
    assert module.apply(params, x, is_causal=True).shape == x.shape


def test_sink_statistics_and_a_forced_goat_sink():
    tokens = np.random.default_rng(3).integers(3, V, (2, 16))
    for enc in ("goat", "rope"):
        model, params = tiny_lm(position_encoding=enc)
        stats = sinks.sink_statistics(model, params, tokens)
        assert stats["first_mass"].shape == (2, 2) and stats["key_norm_ratio"].shape == (2,)
        assert stats["key_norm_first"].shape == stats["key_norm_rest"].shape == (2, 2)
        assert np.all((stats["first_mass"] >= 0) & (stats["first_mass"] <= 1))
    model, params = tiny_lm()
    for i in range(2):
        params[f"layer_{i}"]["attention"]["prior"]["sink_bump"] = jnp.full((2,), 40.0)
    stats = sinks.sink_statistics(model, params, tokens)
    np.testing.assert_allclose(stats["first_mass"], 1.0, atol=1e-6)  # parked in u(0) ...
    base = sinks.sink_statistics(*tiny_lm(), tokens)
    np.testing.assert_allclose(stats["key_norm_ratio"][0], base["key_norm_ratio"][0], rtol=1e-5)


def copy_prior(params, bump=6.0, amp=5.0, layer=0):
    """Writes a sink at 0 and kappa(d) = amp cos(d - 1) (peak at lag 1, w_0 = 1) into a layer."""
    p = params[f"layer_{layer}"]["attention"]["prior"]
    p["sink_bump"] = jnp.full_like(p["sink_bump"], bump)
    p["lambda_sym"] = p["lambda_sym"].at[:, 0].set(amp * np.cos(1.0)).at[:, 1:].set(0.0)
    p["lambda_asym"] = p["lambda_asym"].at[:, 0].set(amp * np.sin(1.0)).at[:, 1:].set(0.0)
    p["key_bias"] = jax.tree_util.tree_map(jnp.zeros_like, p["key_bias"])
    return params


def test_prior_checks_and_summary():
    model, init = fresh_prior_lm()
    lp = sinks.log_priors(model, init, 32)
    assert lp.shape == (2, 2, 32, 32) and np.isneginf(lp[0, 0, 0, 1])
    assert not sinks.has_sink_at_zero(lp) and not sinks.has_diagonal_at_lag(lp, lag=1)
    trained = copy_prior(jax.tree_util.tree_map(lambda x: x, init), layer=1)
    lp = sinks.log_priors(model, trained, 32)
    assert sinks.has_sink_at_zero(lp) and sinks.has_diagonal_at_lag(lp, lag=1)
    assert not sinks.has_diagonal_at_lag(lp, lag=2)
    assert not sinks.has_sink_at_zero(lp[0])  # the untouched layer
    summary = sinks.summarize_prior(model, trained, seq_len=32)
    assert len(summary.splitlines()) == 4 and "layer 1 head 0" in summary
    assert "peaks at lag 1" in summary.splitlines()[2]
    comp = sinks.prior_components(model, trained, 1, 32)
    np.testing.assert_allclose(comp["kappa"][0, :3], 5 * np.cos(np.arange(3) - 1.0), rtol=1e-5)
    np.testing.assert_allclose(comp["probs"].sum(-1), 1.0, rtol=1e-5)
    # Scanned layers: same prior from the stacked parameters.
    scanned = TransformerLM(LMConfig(**TINY, scan_layers=True))
    stacked = {k: v for k, v in trained.items() if not k.startswith("layer_")}
    stacked["layers"] = jax.tree_util.tree_map(lambda a, b: jnp.stack([a, b]),
                                               trained["layer_0"], trained["layer_1"])
    np.testing.assert_allclose(sinks.log_priors(scanned, {"params": stacked}, 32), lp)
    tokens = np.random.default_rng(4).integers(3, V, (1, 12))
    np.testing.assert_allclose(sinks.attention_maps(scanned, stacked, tokens)["probs"],
                               sinks.attention_maps(model, trained, tokens)["probs"], rtol=1e-6)


def test_checks_on_plain_arrays():
    t = 20
    scores = np.where(np.tril(np.ones((t, t), bool)), 0.0, -np.inf)
    assert not sinks.has_sink_at_zero(scores)
    scores[:, 0] = np.where(np.arange(t) >= 0, 3.0, scores[:, 0])
    idx = np.arange(2, t)
    scores[idx, idx - 2] = 2.0
    assert sinks.has_sink_at_zero(scores, margin=2.5)
    assert sinks.has_diagonal_at_lag(scores, lag=2) and not sinks.has_diagonal_at_lag(scores, lag=1)
    np.testing.assert_allclose(sinks.lag_profile(scores, 4), [0, 0, 2, 0, 0])


# ----------------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------------


def test_plots_write_pngs(tmp_path):
    model, params = fresh_prior_lm()
    params = copy_prior(params)
    ppl = {"goat": {16: extrapolation.PerplexityResult(2.0, 7.4, 100), 32: 7.6, 64: 8.0},
           "rope": {16: 7.3, 32: 30.0, 64: 400.0}}
    grid = {"lengths": np.array([256, 512, 1024]), "depths": np.array([0.1, 0.5, 0.9]),
            "token_accuracy": np.array([[1.0, 1.0, 0.9], [1.0, 0.8, 0.5], [0.3, 0.2, 0.1]])}
    paths = [
        plots.plot_toy_prior(model, params, str(tmp_path / "toy.png"), layer=0, head=1, seq_len=24),
        plots.plot_prior_grid(model, params, str(tmp_path / "grid.png"), seq_len=24),
        plots.plot_prior_grid(model, params, str(tmp_path / "grid_kappa.png"), panel="kappa"),
        plots.plot_perplexity_vs_length(ppl, str(tmp_path / "ppl.png"), train_len=16),
        plots.plot_passkey_accuracy({"goat": {256: 1.0, 512: 0.9}, "rope": {256: 1.0, 512: 0.0}},
                                    str(tmp_path / "passkey.png"), train_len=256),
        plots.plot_niah_heatmap(grid, str(tmp_path / "sub" / "niah.png")),
    ]
    for path in paths:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert os.path.getsize(path) > 5000
    with pytest.raises(ValueError, match="panel"):
        plots.plot_prior_grid(model, params, str(tmp_path / "x.png"), panel="nope")
    if os.environ.get("GOAT_KEEP_PLOTS"):  # for looking at them
        import shutil
        shutil.copytree(tmp_path, os.environ["GOAT_KEEP_PLOTS"], dirs_exist_ok=True)


def test_many_lines_get_distinct_colours_dashed_variants_and_a_legend_beside_the_axes(tmp_path):
    """The tiny report's perplexity figure has 16 rows: tab10's cycle gave goat and
    goat+learn_frequencies the same blue, and the legend covered the curves."""
    labels = ["goat", "rope", "rope_pi", "alibi", "sinusoidal", "nope", "fire", "kerple_log", "fox",
              "goat+linear_sink", "goat+learn_frequencies", "rope+yarn", "rope+ntk", "rope+logn",
              "rope+yarn+logn", "goat+logn"]
    styles = plots.line_styles(labels)
    assert len({tuple(st["color"]) for st in styles.values()}) == len(labels)
    assert styles["goat"]["ls"] == "-" and styles["rope+yarn"]["ls"] == "--" and styles["goat+logn"]["ls"] == "--"
    assert plots.line_styles(["goat@linear_sink"])["goat@linear_sink"]["ls"] == "--"
    assert len({tuple(st["color"]) for st in plots.line_styles([str(i) for i in range(30)]).values()}) == 30
    ppl = {label: {64: 6.0 + i, 128: 7.0 + i} for i, label in enumerate(labels)}
    few = plots.plot_perplexity_vs_length({"goat": ppl["goat"]}, str(tmp_path / "one.png"))
    many = plots.plot_perplexity_vs_length(ppl, str(tmp_path / "many.png"))
    from PIL import Image  # pylint: disable=g-import-not-at-top  # matplotlib's own dependency

    with Image.open(few) as a, Image.open(many) as b:  # the legend beside the axes widens the figure
        assert b.size[0] > a.size[0] + 150 and abs(b.size[1] - a.size[1]) < 60


@pytest.mark.slow(reason="trains a run, then scores a text file at several lengths")
def test_extrapolation_on_any_text_file_uses_the_runs_own_tokenizer(tmp_path):
    """``--text FILE``: the file is one document, tokenized like the run's training data
    ([BOS, bytes + 3, EOS] for the byte tokenizer), and scored by length; the perplexities equal
    those of that stream scored directly."""
    from configs import lm_tiny
    from goat_jax.eval import lm_run, runs
    from goat_jax.train import tasks

    task = tasks.get_task("lm")
    config = tasks.with_field_defaults(lm_tiny.get_config("goat,smoke"), task)  # as load_run gives it
    model = task.build_model(config, AttentionPlan.from_config(config))
    params = nn.unbox(model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"])
    run = lm_run.LMRun(workdir=str(tmp_path), config=config, task=task, model=model, params=params,
                     step=0, plan=model.plan)
    text = "Ünïcödé held-out text.\n\nA second paragraph, still one document.\n" * 12
    path = tmp_path / "held_out.txt"
    path.write_text(text, encoding="utf-8")
    expected = np.array([1, *(b + 3 for b in text.strip().encode("utf-8")), 2], np.int32)
    np.testing.assert_array_equal(runs.heldout_tokens(run, text_file=str(path)), expected)
    got = runs.eval_extrapolation(run, (1, 2), text_file=str(path))
    direct = extrapolation.perplexity_by_length(extrapolation.model_apply_fn(model), params,
                                                expected, config.seq_len, (1, 2))
    assert sorted(got) == sorted(direct) == [config.seq_len, 2 * config.seq_len]
    for n, r in direct.items():
        assert got[n]["tokens"] == r.num_tokens > 0
        assert got[n]["ppl"] == pytest.approx(r.ppl, rel=1e-6)
    with pytest.raises(ValueError, match="no such file"):
        runs.heldout_tokens(run, text_file=str(tmp_path / "missing.txt"))


def test_a_text_file_shorter_than_one_window_is_refused_naming_it(tmp_path):
    """``--text FILE`` too short for any requested length: an error naming the file, its length
    in tokens and the window (it used to give an empty table and exit 0)."""
    from configs import lm_tiny
    from goat_jax.eval import lm_run, runs
    from goat_jax.train import tasks

    task = tasks.get_task("lm")
    config = tasks.with_field_defaults(lm_tiny.get_config("goat,smoke"), task)  # as load_run gives it
    model = task.build_model(config, AttentionPlan.from_config(config))
    params = nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"])
    run = lm_run.LMRun(workdir=str(tmp_path), config=config, task=task, model=model, params=params, step=0,
                       plan=model.plan)
    path = tmp_path / "short.txt"
    path.write_text("too short", encoding="utf-8")  # 9 bytes + BOS + EOS = 11 tokens
    with pytest.raises(ValueError, match=rf"--text {path}: 11 tokens .* shorter than one window of "
                                         rf"{config.seq_len} tokens .*give a longer file"):
        runs.eval_extrapolation(run, (1, 2), text_file=str(path))


def test_a_diverging_row_goes_off_scale_and_says_so_instead_of_flattening_the_rest(tmp_path):
    """One diverging row (sinusoidal at 10^4 in the tiny report) stretched the log axis so far
    that every other line lay on the bottom: the axis stops at 10 x the lowest perplexity and
    the row that leaves it is labelled with the length it leaves at; nothing is cut without a
    word, and with every row in range the axis is untouched."""
    curves = {"goat": {64: 6.0, 128: 7.7, 4096: 8.1}, "sinusoidal": {64: 16.0, 128: 26.0, 4096: 3.5e4}}
    top, shown = plots.off_scale(curves, 10.0)
    assert top == pytest.approx(60.0)
    assert shown == {"goat": "goat", "sinusoidal": "sinusoidal (off scale from 4096)"}
    assert plots.off_scale(curves, None) == (None, {"goat": "goat", "sinusoidal": "sinusoidal"})
    assert plots.off_scale({"goat": curves["goat"]}, 10.0) == (None, {"goat": "goat"})
    assert os.path.exists(plots.plot_perplexity_vs_length(curves, str(tmp_path / "ppl.png")))


def test_a_wide_interval_is_cut_at_half_its_mean_and_the_figure_says_so(tmp_path):
    """With two seeds a t interval reaches below zero, which a log axis cannot draw: it had
    stretched the tiny report's axis down to 0.1. The lower arm stops at half the value, and
    only a cut interval is reported as cut."""
    assert plots.lower_errors([6.0, 2.0], [1.0, 3.0]) == ([1.0, 1.0], True)
    assert plots.lower_errors([6.0, 2.0], [1.0, 0.5]) == ([1.0, 0.5], False)
    assert plots.lower_errors([6.0], [0.0]) == ([0.0], False)
    assert plots.accuracy_errors([96.0, 10.0], [18.0, 42.0]) == ([18.0, 10.0], [4.0, 42.0], True)
    assert plots.accuracy_errors([50.0], [20.0]) == ([20.0], [20.0], False)
    path = plots.plot_passkey_accuracy({"goat": {64: 0.96, 128: 0.7}, "rope": {64: 0.96, 128: 0.1}},
                                       str(tmp_path / "pk.png"), panels=[("a", ["goat"]), ("b", ["rope"])])
    assert os.path.getsize(path) > 5000


def test_panels_share_one_axis_and_refuse_a_row_left_out_or_unknown(tmp_path):
    curves = {"goat": {64: 6.0, 128: 7.7}, "rope": {64: 6.1, 128: 30.0}, "rope+yarn": {64: 6.1, 128: 9.0}}
    panels = [("encodings", ["goat", "rope"]), ("variants", ["rope", "rope+yarn"])]
    path = plots.plot_perplexity_vs_length(curves, str(tmp_path / "ppl.png"), panels=panels)
    one = plots.plot_perplexity_vs_length(curves, str(tmp_path / "one.png"))
    from PIL import Image  # pylint: disable=g-import-not-at-top  # matplotlib's own dependency

    with Image.open(path) as a, Image.open(one) as b:
        assert a.size[0] > 1.5 * b.size[0]  # two panels side by side
    with pytest.raises(ValueError, match=r"leave out \['rope\+yarn'\]"):
        plots.plot_perplexity_vs_length(curves, str(tmp_path / "x.png"), panels=[("e", ["goat", "rope"])])
    with pytest.raises(ValueError, match=r"name \['fox'\], which results has no row"):
        plots.plot_perplexity_vs_length(curves, str(tmp_path / "x.png"),
                                        panels=panels + [("more", ["fox"])])
    assert not os.path.exists(tmp_path / "x.png")
    assert plots.length_label(65536, compact=True) == "64k" and plots.length_label(65536) == "65536"
    assert plots.length_label(640, compact=True) == "640"
