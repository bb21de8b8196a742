"""The export across encodings and blocks (GOAT's official and lane-aligned layouts, the linear
sink, learned frequencies, the prior gate, MQA; RoPE, YaRN, ALiBi, NoPE and the absolute
embeddings; Llama-style and GPT-2-style blocks) and the DNA run: each exported folder loads in
``transformers`` with goat-jax's logits, greedy tokens and left padding (float32 weights and
compute). Models are initialized with N(0, 0.2) parameters (training adds nothing to these
checks: the trained end-to-end run is tests/test_export.py's)."""

import numpy as np
import pytest

from experiments import export as export_cli
from tests import export_helpers as H
from tests.marks import SLOW_CASE

pytest.importorskip("transformers")

# (encoding, block, overrides): the default suite's cases, then the slow ones.
CASES = [
    pytest.param("goat", "gpt2", {"model.sink_extrapolation": "linear", "model.qk_layout": "lane_aligned",
                                  "model.learn_frequencies": True, "model.prior_gate": "query_norm"},
                 id="goat-gpt2-lane_aligned-linear_sink-learned_freqs-gate"),
    pytest.param("rope", "llama", {}, id="rope-llama-gqa"),
    pytest.param("alibi", "gpt2", {"model.kv_num_heads": 1}, id="alibi-gpt2-mqa"),
    pytest.param("goat", "llama", {"model.kv_num_heads": 1, "model.logn_scaling": "content",
                                   "model.tie_embeddings": False}, id="goat-llama-mqa-logn-untied",
                 marks=SLOW_CASE),
    pytest.param("rope", "gpt2", {"model.logn_scaling": "all"}, id="rope-gpt2-logn", marks=SLOW_CASE),
    pytest.param("yarn", "llama", {"model.rope_scaling_factor": 4.0}, id="yarn-fixed", marks=SLOW_CASE),
    pytest.param("ntk", "llama", {"model.rope_scaling_factor": 2.0}, id="ntk-fixed", marks=SLOW_CASE),
    pytest.param("alibi_packed", "llama", {}, id="alibi_packed", marks=SLOW_CASE),
    pytest.param("nope", "llama", {}, id="nope", marks=SLOW_CASE),
    pytest.param("sinusoidal", "gpt2", {}, id="sinusoidal", marks=SLOW_CASE),
    pytest.param("learned", "gpt2", {"model.max_len": 160}, id="learned", marks=SLOW_CASE),
]


@pytest.mark.parametrize("encoding, block, overrides", CASES)
def test_each_encoding_and_block_exports_equal_to_goat_jax(tmp_path, rng, encoding, block, overrides):
    from goat_jax.eval import lm_run
    config = H.lm_config(encoding, block, **{"model.dtype": "float32", **overrides})
    workdir = H.random_workdir(str(tmp_path / "run"), config)
    folder = str(tmp_path / "hf")
    export_cli.main(["--workdir", workdir, "--out", folder])
    errors = H.check_export_matches(lm_run.load_lm_run(workdir), folder, rng, vocab=259)
    print(encoding, block, overrides, "relative logit errors", errors)


def test_a_dna_run_exports_and_generates_bases(tmp_path, rng):
    from configs import dna_tiny
    from transformers import AutoTokenizer
    from goat_jax.data import fasta
    from goat_jax.eval import lm_run
    from tests.config_helpers import set_fields
    config = set_fields(dna_tiny.get_config("goat,smoke"), progress_bar=False)
    workdir = H.random_workdir(str(tmp_path / "dna"), config)
    folder = str(tmp_path / "dna_hf")
    export_cli.main(["--workdir", workdir, "--out", folder])
    run = lm_run.load_lm_run(workdir)
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    bases = "ACGTNacgtnRY"
    assert tok(bases).input_ids == fasta.encode(bases)[0].tolist()
    model = H.load_hf(folder)
    prompt = np.asarray([tok("ACGTTGCAAC").input_ids])
    out = H.hf_greedy(model, prompt, 32)
    np.testing.assert_array_equal(out, H.goat_greedy(run, prompt, 32))
    text = tok.decode(out[0, 10:])
    assert len(text) == 32 and set(text) <= set(fasta.ALPHABET)
    tokens = rng.integers(0, 5, (2, 2 * int(config.seq_len) + 3))
    assert H.rel_err(H.hf_logits(model, tokens), H.goat_logits(run, tokens)) < H.LOGIT_RTOL
