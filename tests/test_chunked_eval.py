"""Chunked-query evaluation through the KV cache (goat_jax.eval.chunked) equals the full-window
forward, and its perplexity equals an independent float64 NumPy forward of the whole LM.

Windows of 12 tokens; chunk sizes that divide 12 (4) and that do not (5: two chunks and a tail
of 2; one-token decoding is tests/test_lm.py's); GOAT without ``training_seq_len`` (the hardest case: its sink
normalization must stay at the full window's) and with it, RoPE and ALiBi.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from goat_jax.eval import chunked, extrapolation
from goat_jax.models import LMConfig, TransformerLM
from goat_jax.kernels.plan import AttentionPlan
from tests import goat_reference as ref
from tests.config_helpers import random_params
from tests.test_gpt2_block import _gelu_tanh, _layer_norm

V, W = 61, 12


def random_lm(rng, **overrides):
    cfg = dict(vocab_size=V, num_layers=2, embed_dim=32, num_heads=2, mlp_dim=64, pos_rank=2,
               abs_rank=2, training_seq_len=None)
    plan = AttentionPlan(implementation=overrides.pop("implementation", None))
    model = TransformerLM(LMConfig(**{**cfg, **overrides}), plan=plan)
    return model, random_params(model, W, rng)


def chunked_logits(model, params, tokens, chunk_size):
    """All [B, W, V] logits collected chunk by chunk through chunked.scan_chunks."""
    decoder = chunked.window_decoder(model, tokens.shape[1])

    def step(buf, logits, _state, start, _c):
        return jax.lax.dynamic_update_slice_in_dim(buf, logits, start, axis=1)

    buf = jnp.zeros(tokens.shape + (V,), jnp.float32)
    return jax.jit(lambda p, x: chunked.scan_chunks(decoder, {"params": p}, x, chunk_size, step, buf))(
        params, tokens)


@pytest.mark.parametrize("encoding,tsl,chunks,impl", [
    ("goat", None, (5,), None), ("goat", 16, (4,), "flash"), ("rope", None, (5,), None),
    ("alibi", 16, (5,), None)])
def test_chunked_logits_equal_the_full_window(rng, encoding, tsl, chunks, impl):
    """impl None: XLA at these sizes; 'flash': the online-softmax kernel with the traced cache
    offset, which long windows get automatically."""
    model, params = random_lm(rng, position_encoding=encoding, training_seq_len=tsl,
                              implementation=impl)
    tokens = jnp.asarray(rng.integers(0, V, (2, W)), jnp.int32)
    full = np.asarray(jax.jit(model.apply)({"params": params}, tokens), np.float64)
    for c in chunks:
        got = np.asarray(chunked_logits(model, params, tokens, c), np.float64)
        err = np.abs(got - full).max() / np.abs(full).max()
        assert err <= 1e-5, f"chunk {c}: relative error {err:.2e}"


def numpy_goat_gpt2_nll(model, params, inputs, targets):
    """Float64 NumPy forward of a GPT-2-block GOAT LM (goat_reference's attention written from
    the paper's formula): per-token NLL [B, W]."""
    cfg = model.config
    p = ref.unboxed({"params": params})
    att_cfg = dict(num_heads=cfg.num_heads, kv_num_heads=cfg.kv_heads, head_dim=cfg.head_size,
                   pos_rank=cfg.pos_rank, abs_rank=cfg.abs_rank, training_seq_len=cfg.training_seq_len)
    x = p["embed"]["embedding"][np.asarray(inputs)]  # [B, W, E]
    for i in range(cfg.num_layers):
        lp = p[f"layer_{i}"]
        h = _layer_norm(x, lp["attn_norm"]["scale"], lp["attn_norm"]["bias"], cfg.norm_eps)
        x = x + ref.goat_attention({"params": lp["attention"]}, att_cfg, h, h, h, is_causal=True)
        h = _layer_norm(x, lp["mlp_norm"]["scale"], lp["mlp_norm"]["bias"], cfg.norm_eps)
        x = x + _gelu_tanh(h @ lp["mlp"]["wi"]["kernel"] + lp["mlp"]["wi"]["bias"]) @ lp["mlp"]["wo"]["kernel"] \
            + lp["mlp"]["wo"]["bias"]
    x = _layer_norm(x, p["final_norm"]["scale"], p["final_norm"]["bias"], cfg.norm_eps)
    logits = x @ p["embed"]["embedding"].T  # [B, W, V]
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return logz - np.take_along_axis(logits, np.asarray(targets)[..., None], -1)[..., 0]


def test_chunked_nll_equals_a_float64_numpy_lm(rng):
    model, params = random_lm(rng, block="gpt2", use_bias=True, norm_eps=1e-5, training_seq_len=8)
    inputs = rng.integers(0, V, (2, W))
    targets = rng.integers(0, V, (2, W))
    weights = (rng.random((2, W)) < 0.8).astype(np.float32)
    want = numpy_goat_gpt2_nll(model, params, inputs, targets)  # [B, W]
    sums, counts = chunked.make_chunked_nll_fn(model, 5)(params, inputs, targets, weights)
    np.testing.assert_allclose(counts, weights.sum(-1))
    np.testing.assert_allclose(sums, (want * weights).sum(-1), rtol=1e-5)
    full, _ = extrapolation.make_nll_fn(extrapolation.model_apply_fn(model))(params, inputs, targets, weights)
    np.testing.assert_allclose(sums, full, rtol=1e-5)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "512"])
def test_bad_chunk_size_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="chunk_size must be an integer >= 1"):
        chunked.make_chunked_nll_fn(TransformerLM(LMConfig()), bad)


# ----------------------------------------------------------------------------------------------
# BOS windows at every evaluation length, and the run-level evaluation (chunked)
# ----------------------------------------------------------------------------------------------


def test_bos_windows_at_every_length_match_the_training_packer(tmp_path):
    """A data.bos_windows pipeline's eval windows at the training length are exactly
    window_batch's BOS windows of the recovered stream, which holds no packer-inserted BOS; at
    2x, every window still starts with BOS and every stream token is a target once."""
    from goat_jax.data import text

    doc = "goat priors park attention in u(j), not in key norms. " * 9
    path = tmp_path / "doc.txt"
    path.write_text(doc)
    cfg = text.default_data_config()
    cfg.paths, cfg.eval_paths, cfg.doc_split, cfg.read_threads = [str(path)], [str(path)], "files", 0
    cfg.num_eval_batches, cfg.bos_windows = 0, True
    _, make_eval, tok = text.make_lm_datasets(cfg, seq_len=16, global_batch_size=2, seed=0)
    batches = list(make_eval())
    stream = extrapolation.tokens_from_batches(batches, bos_windows=True)
    np.testing.assert_array_equal(stream, [*tok.encode(doc.strip()), tok.eos_id])
    full = [(x, y) for b in batches for x, y, w in zip(b["inputs"], b["targets"], b["weights"]) if w.all()]
    starts = extrapolation.window_starts(len(stream), 16, bos=True)
    inputs, targets = extrapolation.window_batch(stream, starts, 16, tok.bos_id)
    assert len(full) == len(starts) > 1
    np.testing.assert_array_equal(inputs, [x for x, _ in full])
    np.testing.assert_array_equal(targets, [y for _, y in full])

    starts = extrapolation.window_starts(len(stream), 32, bos=True)
    inputs, targets = extrapolation.window_batch(stream, starts, 32, tok.bos_id)
    assert np.all(inputs[:, 0] == tok.bos_id)
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
    np.testing.assert_array_equal(targets.ravel(), stream[:32 * len(starts)])
    # A chance-level model scores every target of the full windows once, BOS never.
    chance = lambda p, x: jnp.where(x[..., None] >= 0, 0.0, 1.0) * jnp.ones(tok.vocab_size)
    res = extrapolation.perplexity_by_length(chance, None, stream, 16, (1, 2), bos_id=tok.bos_id)
    assert {n: r.num_tokens for n, r in res.items()} == {16: 16 * (len(stream) // 16),
                                                         32: 32 * (len(stream) // 32)}
    assert res[32].ppl == pytest.approx(tok.vocab_size, rel=1e-5)


def test_eval_extrapolation_chunked_with_bos_windows(tmp_path):
    """experiments.evaluate's path: a bos_windows run evaluated in chunks of 5 queries gives the
    perplexities of full BOS windows scored directly; a bad chunk_size is refused by name."""
    from configs import lm_tiny
    from goat_jax.eval import runs
    from tests.config_helpers import random_lm_run

    config = lm_tiny.get_config("goat,smoke")
    config.data.bos_windows = True
    run = random_lm_run(tmp_path, config)
    path = tmp_path / "held_out.txt"
    path.write_text("A held-out paragraph of plain text, scored by length. " * 8)
    stream = runs.heldout_stream(run, text_file=str(path))
    assert stream.bos_id == 1 and stream.bos_id not in stream.tokens  # byte tokenizer: BOS = 1
    # max_tokens stops reading early and gives the same prefix.
    np.testing.assert_array_equal(runs.heldout_stream(run, 50, text_file=str(path)).tokens,
                                  stream.tokens[:50])
    got = runs.eval_extrapolation(run, (2,), text_file=str(path), chunk_size=5)
    direct = extrapolation.perplexity_by_length(extrapolation.model_apply_fn(run.model), run.params,
                                                stream.tokens, config.seq_len, (2,),
                                                bos_id=stream.bos_id)
    assert sorted(got) == sorted(direct) == [2 * config.seq_len]
    for n, r in direct.items():
        assert got[n]["tokens"] == r.num_tokens > 0
        assert got[n]["ppl"] == pytest.approx(r.ppl, rel=1e-5)
    with pytest.raises(ValueError, match="chunk_size"):
        runs.evaluate_run(run, ["extrapolation"], (1,), chunk_size=0)
