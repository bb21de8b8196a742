"""DNA evaluation math (goat_jax.eval.dna): NLL / bits per base / accuracy and the GC metric."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from goat_jax.data import fasta
from goat_jax.eval import dna as dna_eval
from goat_jax.models.lm import LMConfig, TransformerLM


@pytest.fixture(scope="module")
def tiny_lm():
    """A 1-layer GOAT LM over the 5 DNA tokens, initialized once for this module."""
    cfg = LMConfig(vocab_size=5, num_layers=1, embed_dim=32, num_heads=2, mlp_dim=64,
                   position_encoding="goat", pos_rank=2, abs_rank=2, training_seq_len=16)
    model = TransformerLM(cfg)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 16), jnp.int32))["params"]
    # Scale the embeddings up so the logits are far from uniform (a non-trivial NLL).
    params = jax.tree_util.tree_map(lambda x: x * 20 if x.ndim == 2 and x.shape[0] == 5 else x, params)
    return model, params


def test_nll_bits_accuracy_against_float64_numpy(rng, tiny_lm):
    model, params = tiny_lm
    records = [rng.integers(0, 5, n).astype(np.int32) for n in (100, 37, 16, 64)]
    window = 16
    got = dna_eval.score_records(lambda p, x: model.apply({"params": p}, x), params, records,
                                 window, batch_size=3)
    ref_apply = jax.jit(lambda x: model.apply({"params": params}, x))
    nll, correct, count, n_targets = 0.0, 0, 0, 0
    for rec in records:
        for s in range(0, len(rec) - window, window):  # full windows of 16 + 1 only
            x, y = rec[s:s + window], rec[s + 1:s + window + 1]
            logits = np.asarray(ref_apply(x[None]), np.float64)[0]
            logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
            called = y != fasta.N_ID  # N targets are not scored (N inputs are read)
            nll += float((logz - logits[np.arange(window), y])[called].sum())
            correct += int((logits.argmax(-1) == y)[called].sum())
            count += int(called.sum())
            n_targets += int((~called).sum())
    assert n_targets > 0  # ~1 in 5 targets is N here
    assert got.num_bases == count and got.excluded_n == n_targets
    assert count + n_targets == (6 + 2 + 0 + 3) * window
    np.testing.assert_allclose(got.nll, nll / count, rtol=1e-5)
    np.testing.assert_allclose(got.bits_per_base, nll / count / np.log(2), rtol=1e-5)
    np.testing.assert_allclose(got.ppl, np.exp(nll / count), rtol=1e-5)
    assert got.accuracy == pytest.approx(correct / count, abs=1e-9)
    assert 0.05 < got.accuracy < 0.95 and got.nll > 0.1  # the scaled model is not trivial

    by_len = dna_eval.score_by_length(lambda p, x: model.apply({"params": p}, x), params, records,
                                      train_len=16, multipliers=(1, 8), batch_size=3)
    assert sorted(by_len) == [16]  # 128 + 1 bases fit in no record
    assert by_len[16] == pytest.approx(got)
    with pytest.raises(ValueError, match="No record holds a window of 200"):
        dna_eval.score_records(lambda p, x: model.apply({"params": p}, x), params, records, 200)


def test_gc_fraction_and_pearson(rng):
    ids = fasta.encode("GGCCAATTNN")[0]
    assert dna_eval.gc_fraction(ids) == pytest.approx(0.5)  # N excluded from the denominator
    assert np.isnan(dna_eval.gc_fraction(fasta.encode("NNN")[0]))
    x, y = rng.normal(size=50), rng.normal(size=50)
    assert dna_eval.pearson_r(x, y) == pytest.approx(np.corrcoef(x, y)[0, 1], abs=1e-12)
    assert np.isnan(dna_eval.pearson_r(np.ones(5), x[:5]))


def _with_gc(rng, n, gc):
    """n bases of which exactly gc are C/G, shuffled."""
    bases = np.concatenate([rng.choice([1, 2], gc), rng.choice([0, 4], n - gc)])
    return rng.permutation(bases).astype(np.int32)


def test_gc_agreement_on_constructed_sequences_with_known_r(rng):
    # GC counts per window built from a = [0,1,2,3] and b = [0,2,1,3] (repeated 4 times):
    #   continuation halves h1 = 20 + 10a, h2 = 20 + 10b -> r(h1, h2) = r(a, b) = 0.8
    #   continuation t = h1 + h2 -> samples s = 20 + 10a: r(s, t) = r(a, a + b) = 9 / sqrt(90)
    #   prompts p = 20 + 10(3 - a): r(p, t) = -9 / sqrt(90)
    a = np.tile([0, 1, 2, 3], 4)
    b = np.tile([0, 2, 1, 3], 4)
    windows, samples = [], []
    for ai, bi in zip(a, b):
        prompt = _with_gc(rng, 200, 20 + 10 * (3 - ai))
        cont = np.concatenate([_with_gc(rng, 100, 20 + 10 * ai), _with_gc(rng, 100, 20 + 10 * bi)])
        windows.append(np.concatenate([prompt, cont]))
        samples.append(_with_gc(rng, 200, 20 + 10 * ai))
    windows, samples = np.stack(windows), np.stack(samples)

    def sample_fn(prompts):
        np.testing.assert_array_equal(prompts, windows[:, :200])  # sees exactly the prompts
        return samples

    got = dna_eval.gc_agreement(sample_fn, windows, prompt_len=200)
    r = 9 / np.sqrt(90)
    assert got.r_model == pytest.approx(r, abs=1e-12)
    assert got.r_prompt == pytest.approx(-r, abs=1e-12)
    assert got.r_halves == pytest.approx(0.8, abs=1e-12)
    assert got.mean_gc_true == pytest.approx(np.mean((40 + 10 * (a + b)) / 200))
    assert got.num_windows == 16


def test_gc_windows_are_evenly_spaced_and_skip_n(rng):
    recs = [rng.integers(0, 5, 3000).astype(np.int32)]
    recs[0][recs[0] == fasta.N_ID] = 0  # no N at all
    windows, skipped = dna_eval.gc_windows(recs, num_windows=10, length=400)
    starts = [(np.arange(10) * 2601) // 10][0]
    np.testing.assert_array_equal(windows, np.stack([recs[0][s:s + 400] for s in starts]))
    assert skipped == 0
    recs[0][1000:1001] = fasta.N_ID
    windows, skipped = dna_eval.gc_windows(recs, num_windows=10, length=400)
    assert skipped > 0 and not (windows == fasta.N_ID).any() and len(windows) == 10
    with pytest.raises(ValueError, match="GC agreement needs num_windows=5000"):
        dna_eval.gc_windows(recs, num_windows=5000)


def test_model_sampler_uses_the_kv_cache_generator(tiny_lm):
    from goat_jax.models import sampling

    model, params = tiny_lm
    prompts = np.random.default_rng(0).integers(0, 5, (5, 12)).astype(np.int32)
    out = dna_eval.model_sampler(model, params, sample_len=7, batch_size=4, seed=3)(prompts)
    assert out.shape == (5, 7) and out.min() >= 0 and out.max() < 5
    want = sampling.generate(model, params, jnp.asarray(prompts[:4]), 7,
                             jax.random.fold_in(jax.random.PRNGKey(3), 0), temperature=1.0)
    np.testing.assert_array_equal(out[:4], np.asarray(want)[:, 12:])


def test_evaluate_fasta_on_real_human_dna(tiny_lm):
    from goat_jax.data import dna as dna_data

    model, params = tiny_lm
    out = dna_eval.evaluate_fasta(model, params, [dna_data.HUMAN_CHR17_40KB], 16,
                                  multipliers=(1, 512), max_bases=3000, gc_num_windows=0)
    assert out["data"]["records"] == ["chr17"] and out["data"]["bases"] == [3000]
    assert sorted(out["by_length"]) == [16]  # 8192 + 1 bases do not fit in 3000
    records, _ = dna_eval.read_fasta_records([dna_data.HUMAN_CHR17_40KB], 3000)
    assert fasta.decode(records[0][:10]) == "AAGCTTCTCA"  # the file's first bases
    ref = dna_eval.score_records(lambda p, x: model.apply({"params": p}, x), params, records, 16)
    assert out["by_length"][16] == pytest.approx(ref._asdict())
    assert "gc" not in out


def test_n_targets_are_not_scored_and_all_n_is_an_error(tmp_path, tiny_lm):
    """An all-N FASTA is an error naming the file (it used to score 2.3 bits per base); N
    inside called sequence is left out and counted, and changes nothing else."""
    model, params = tiny_lm
    all_n = tmp_path / "gap.fa"
    all_n.write_text(">gap\n" + "N" * 400 + "\n")
    with pytest.raises(ValueError, match=rf"{all_n} \(records \['gap'\]\): every target of the 24 "
                                         r"window\(s\) of 16 bases is N"):
        dna_eval.evaluate_fasta(model, params, [str(all_n)], 16, multipliers=(1,), gc_num_windows=0)
    short = tmp_path / "short.fa"
    short.write_text(">s\nACGTACGT\n")
    with pytest.raises(ValueError, match=rf"{short} \(records \['s'\]\): no record holds a window"):
        dna_eval.evaluate_fasta(model, params, [str(short)], 16, multipliers=(1,), gc_num_windows=0)

    rng = np.random.default_rng(0)
    called = "".join(rng.choice(list("ACGT"), 16 * 8 + 1))
    gapped = called[:40] + "N" * 30 + called[70:]  # 30 N targets (and inputs) in window 2..5
    apply = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    ids = [fasta.encode(gapped)[0].astype(np.int32)]
    got = dna_eval.score_records(apply, params, ids, 16)
    assert got.excluded_n == 30 and got.num_bases == 16 * 8 - 30
    clean = dna_eval.score_records(apply, params, [ids[0][:33]], 16)  # the two windows before the gap
    assert clean.excluded_n == 0 and clean.num_bases == 32


@pytest.mark.skipif(not os.path.exists("/usr/share/doc/artfastqgenerator/examples/miniReference.fasta.gz"),
                    reason="Debian package artfastqgenerator-examples not installed (scripts/setup.sh installs it)")
def test_grch37_second_human_genome_reads_and_scores(tiny_lm):
    """The DNA family's second human genome, read by the harness's reader and checked against
    a plain gzip + text parse of the same file (record names, lengths, bases, Ns)."""
    import gzip

    from goat_jax.data import dna as dna_data

    path = dna_data.HUMAN_GRCH37_CHR1_3
    with gzip.open(path, "rt") as f:
        chunks = f.read().split(">")[1:]
    ref = {c.split("\n", 1)[0].split()[0]: c.split("\n", 1)[1].replace("\n", "").upper() for c in chunks}
    records, info = dna_eval.read_fasta_records([path])
    assert info["records"] == list(ref) == ["1", "2", "3"]
    assert info["bases"] == [len(s) for s in ref.values()] and sum(info["bases"]) > 190_000
    for rec, seq in zip(records, ref.values()):
        assert fasta.decode(rec) == "".join(b if b in "ACGT" else "N" for b in seq)
    model, params = tiny_lm
    out = dna_eval.evaluate_fasta(model, params, [path], 16, multipliers=(1,), max_bases=2000, gc_num_windows=0)
    assert out["data"]["records"] == ["1"] and out["data"]["bases"] == [2000]
    assert np.isfinite(out["by_length"][16]["bits_per_base"]) and out["by_length"][16]["bits_per_base"] > 0
