"""Input pipelines. Language-model text: :mod:`goat_jax.data.documents` (sources, UTF-8
decoding, documents, held-out split), :mod:`goat_jax.data.text` (tokens, packing, resumable
host-sharded batches) and :mod:`goat_jax.data.tokenizers` (bytes, SentencePiece).
Genomes: :mod:`goat_jax.data.fasta` (the ACGNT tokenizer, FASTA files, indexed random access) and
:mod:`goat_jax.data.dna` (splits by record, random training crops, fixed eval crops, parquet chunks).
Images: :mod:`goat_jax.data.images` (TFDS array_record, JPEG folders, Fashion-MNIST; resumable
host-sharded batches) and :mod:`goat_jax.data.image_transforms` (the ViT train/eval transforms).
"""

from goat_jax.data.text import default_data_config, make_lm_datasets, to_global_array
from goat_jax.data.tokenizers import ByteTokenizer, SentencePieceTokenizer, make_tokenizer

__all__ = [
    "ByteTokenizer",
    "SentencePieceTokenizer",
    "default_data_config",
    "make_lm_datasets",
    "make_tokenizer",
    "to_global_array",
]
