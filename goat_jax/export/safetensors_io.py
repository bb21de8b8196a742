"""The safetensors format written and read without a dependency (it is a JSON header and raw
little-endian bytes: https://github.com/huggingface/safetensors, "Format"), so exporting needs
neither PyTorch nor the ``safetensors`` package; bfloat16 through ``ml_dtypes`` (a JAX dependency).

One file (``model.safetensors``) or, past ``max_shard_bytes``, shards
``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json`` (``transformers``'
sharded layout: ``{"metadata": {"total_size"}, "weight_map": {name: file}}``). Every file's
metadata is ``{"format": "pt"}``.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Dict, List

import ml_dtypes
import numpy as np

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_CODES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16",
          np.dtype(np.float64): "F64", np.dtype(np.int32): "I32", np.dtype(np.int64): "I64"}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}


def write_file(path: str, tensors: Dict[str, np.ndarray]) -> None:
    """Writes ``tensors`` (name -> array of a dtype in the table above) as one safetensors file
    with ``{"format": "pt"}`` metadata, names in sorted order."""
    header: Dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset, blobs = 0, []
    for name in sorted(tensors):
        x = np.ascontiguousarray(tensors[name])
        if x.dtype not in _CODES:
            raise ValueError(f"safetensors: {name} has dtype {x.dtype}, not one of {sorted(map(str, _CODES))}.")
        data = x.astype(x.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": _CODES[x.dtype], "shape": list(x.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for data in blobs:
            f.write(data)


def read_file(path: str) -> Dict[str, np.ndarray]:
    """The tensors of one safetensors file (bfloat16 as ``ml_dtypes.bfloat16``)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        data = f.read()
    out = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        if spec["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: {name} has dtype {spec['dtype']}, which goat-jax does not read.")
        begin, end = spec["data_offsets"]
        out[name] = np.frombuffer(data[begin:end], _DTYPES[spec["dtype"]]).reshape(spec["shape"]).copy()
    return out


def write_weights(folder: str, tensors: Dict[str, np.ndarray], max_shard_bytes: int) -> List[str]:
    """Writes ``tensors`` into ``folder``: one ``model.safetensors`` when they fit in
    ``max_shard_bytes``, else shards of at most that size (a tensor larger than it gets a shard of
    its own) and the index. Returns the file names written."""
    sizes = {name: int(np.asarray(x).nbytes) for name, x in tensors.items()}
    total = sum(sizes.values())
    if total <= max_shard_bytes:
        write_file(os.path.join(folder, SINGLE_FILE), tensors)
        return [SINGLE_FILE]
    shards: List[List[str]] = [[]]
    filled = 0
    for name in sorted(tensors):
        if shards[-1] and filled + sizes[name] > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += sizes[name]
    names, weight_map = [], {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_file(os.path.join(folder, file), {n: tensors[n] for n in shard})
        weight_map.update({n: file for n in shard})
        names.append(file)
    with open(os.path.join(folder, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1, sort_keys=True)
    return names + [INDEX_FILE]


def read_weights(folder: str) -> Dict[str, np.ndarray]:
    """The tensors of an exported folder: ``model.safetensors``, or the shards its index names."""
    single, index = os.path.join(folder, SINGLE_FILE), os.path.join(folder, INDEX_FILE)
    if os.path.isfile(single):
        return read_file(single)
    if not os.path.isfile(index):
        raise ValueError(f"{folder} holds neither {SINGLE_FILE} nor {INDEX_FILE}: not a folder written by "
                         "experiments.export.")
    with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    out: Dict[str, np.ndarray] = {}
    for file in files:
        out.update(read_file(os.path.join(folder, file)))
    return out
