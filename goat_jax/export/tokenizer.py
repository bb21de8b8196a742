"""The run's tokenizer as ``transformers`` loads it (``AutoTokenizer.from_pretrained(DIR)``):
``tokenizer.json`` (the ``tokenizers`` library's format) and ``tokenizer_config.json``, giving
the token ids of the run's own tokenizer.

* 'byte' (pad 0, BOS 1, EOS 2, byte b -> b + 3): a byte-level BPE without merges.
* 'gpt2' (tiktoken ranks, ``<|endoftext|>`` = BOS = EOS = pad): the byte-level BPE of the same
  ranks, the merges recovered from them, GPT-2's pre-tokenization pattern.
* DNA (``task='dna'``, bases ACGNT = 0..4): one token per base; lower case and the IUPAC codes
  read as the genome pipeline reads them (N).

The text tokenizers put BOS first when asked for special tokens (the default, as Llama's; every
training document starts with BOS), so ``tokenizer(text, add_special_tokens=False).input_ids`` is
the run's ``encode(text)`` and ``tokenizer(text).input_ids`` is ``[BOS] + encode(text)``; a
literal special token in the text is text. SentencePiece runs are refused (export
them with ``--tokenizer none`` and bring the ``.model`` file along yourself).
"""

from __future__ import annotations

import json
from typing import Any, Dict, Optional

TOKENIZERS = ("run", "none")


def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def kind_of(config: Any) -> str:
    """'dna', 'byte', 'gpt2' or 'sentencepiece': the tokenizer of a run's ``config``."""
    if str(config.get("task")) == "dna":
        return "dna"
    return str(config.data.tokenizer)


def check_tokenizer(config: Any, tokenizer: str) -> None:
    """One-line ValueError, before any work, when ``--tokenizer`` is unknown or the run's
    tokenizer cannot be exported."""
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"--tokenizer {tokenizer!r}: choose one of {TOKENIZERS} ('none': write no tokenizer files).")
    if tokenizer == "run" and kind_of(config) not in ("dna", "byte", "gpt2"):
        raise ValueError(f"data.tokenizer={kind_of(config)!r}: the export writes tokenizer.json for the byte, GPT-2 "
                         "BPE and DNA tokenizers; export this run with --tokenizer none and bring its tokenizer "
                         "along yourself.")


def _byte_level(vocab: Dict[str, int], merges: list, specials: Dict[str, int], pattern: Optional[str], bos: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors  # pylint: disable=g-import-not-at-top
    from tokenizers import AddedToken  # pylint: disable=g-import-not-at-top

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.pre_tokenizer = level if pattern is None else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated"), level])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in sorted(specials, key=specials.get)])
    # With add_special_tokens (the default), BOS first, as every training document and goat-jax's
    # lm-eval adapter start: Llama's convention; add_special_tokens=False gives the bare ids.
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                       special_tokens=[(bos, specials[bos])])
    return tok


def build(config: Any):
    """``(tokenizers.Tokenizer, special tokens {'bos_token': ..., ...})`` of a run's ``config``."""
    kind = kind_of(config)
    if kind == "dna":
        from tokenizers import Tokenizer, decoders, models, normalizers  # pylint: disable=g-import-not-at-top
        from goat_jax.data import fasta  # pylint: disable=g-import-not-at-top
        tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(fasta.ALPHABET)}, merges=[]))
        rules = [normalizers.Replace(c.lower(), c) for c in fasta.ALPHABET]
        rules += [normalizers.Replace(c, "N") for c in fasta.AMBIGUOUS + fasta.AMBIGUOUS.lower()]
        tok.normalizer = normalizers.Sequence(rules)
        tok.decoder = decoders.Fuse()
        return tok, {}
    chars = bytes_to_unicode()
    if kind == "byte":
        from goat_jax.data.tokenizers import ByteTokenizer  # pylint: disable=g-import-not-at-top
        offset = ByteTokenizer._OFFSET  # pylint: disable=protected-access
        specials = {"<pad>": 0, "<s>": 1, "</s>": 2}
        vocab = {**specials, **{chars[b]: b + offset for b in range(256)}}
        return _byte_level(vocab, [], specials, None, "<s>"), {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}
    from goat_jax.data import tokenizers as goat_tokenizers  # pylint: disable=g-import-not-at-top
    encoding = goat_tokenizers.load_gpt2_tokenizer(config.data)._encoding  # pylint: disable=protected-access
    ranks = encoding._mergeable_ranks  # pylint: disable=protected-access
    text = lambda token: "".join(chars[b] for b in token)
    vocab = {text(token): rank for token, rank in ranks.items()}
    end = goat_tokenizers.GPT2_ENDOFTEXT
    vocab[end] = encoding.eot_token
    merges = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], text(left), text(right)))
    merges = [(a, b) for *_, a, b in sorted(merges)]
    return (_byte_level(vocab, merges, {end: encoding.eot_token}, goat_tokenizers.GPT2_PATTERN, end),
            {"pad_token": end, "bos_token": end, "eos_token": end})


def write(folder: str, config: Any, model_max_length: int) -> Dict[str, Optional[int]]:
    """Writes ``tokenizer.json`` and ``tokenizer_config.json`` of a run's ``config`` into
    ``folder``; returns the special ids ``{'bos_token_id', 'eos_token_id', 'pad_token_id'}``
    (None where the tokenizer has none)."""
    import os  # pylint: disable=g-import-not-at-top
    tok, specials = build(config)
    tok.save(os.path.join(folder, "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": int(model_max_length),
                "clean_up_tokenization_spaces": False,
                # A literal "<s>" in the text is text, as the run's own encode reads it.
                "split_special_tokens": True, **specials}
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(settings, f, indent=1)
    with open(os.path.join(folder, "special_tokens_map.json"), "w") as f:
        json.dump(specials, f, indent=1)
    return {f"{k}_id": tok.token_to_id(v) for k, v in
            (("bos_token", specials.get("bos_token")), ("eos_token", specials.get("eos_token")),
             ("pad_token", specials.get("pad_token"))) if v is not None} | {
        k: None for k in ("bos_token_id", "eos_token_id", "pad_token_id") if not specials}
