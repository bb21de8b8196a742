"""A trained goat-jax LM to and from the Hugging Face format (docs/export.md).

    export_run(workdir, out)       # safetensors + config.json + modeling_goat.py + tokenizer + card
    import_hf(folder, new_workdir)  # a goat-jax run (config.json + checkpoint) of such a folder

``transformers`` loads the folder with ``AutoModelForCausalLM.from_pretrained(out,
trust_remote_code=True)``; the modeling file (``goat_jax/export/hf/``, shipped as package data
and copied into the folder) needs PyTorch and ``transformers`` only. The CLI is
``python -m experiments.export``.

Modules: :mod:`~goat_jax.export.mapping` (refusals, config.json, weights both ways),
:mod:`~goat_jax.export.safetensors_io` (the file format), :mod:`~goat_jax.export.tokenizer`
(tokenizer.json), :mod:`~goat_jax.export.writer` (the folder and the run),
:mod:`~goat_jax.export.official` (a layer to the official ``goat-attention`` package).
"""

from goat_jax.export.mapping import SUPPORTED_ENCODINGS, check_exportable, content_dim, from_torch, hf_config, to_torch
from goat_jax.export.writer import check_export, export_run, import_hf

__all__ = ["SUPPORTED_ENCODINGS", "check_export", "check_exportable", "content_dim", "export_run", "from_torch",
           "hf_config", "import_hf", "to_torch"]
