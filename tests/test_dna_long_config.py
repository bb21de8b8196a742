"""configs/dna_long.py (the 131,072-base genome window, context-parallel): it loads, validates
against the engine schema for 8 and 64 devices, its window splits over the context axis (with
load balancing and splash's blocks), and what follows seq_len follows an override. Fast: no
model is built or compiled (benchmarks/context.md has the TPU compiles)."""

import ast
import os

import pytest

from configs import dna_long
from goat_jax.kernels import balance
from goat_jax.train import sharding, trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("encoding", ["goat", "rope"])
def test_loads_and_validates(encoding):
    config = dna_long.get_config(encoding)
    assert config.model.position_encoding == encoding
    assert config.seq_len == 131_072 and config.model.training_seq_len == 131_072
    assert config.model.max_len == 131_072
    assert config.model.remat and config.model.dtype == "bfloat16"
    assert config.context_load_balance and config.data.source == "fasta"
    for devices in (8, 64):
        assert trainer.validate_config(config, num_devices=devices).global_batch == config.global_batch_size


@pytest.mark.parametrize("devices", [1, 8, 16, 64])
def test_window_splits_over_all_devices(devices):
    config = dna_long.get_config("goat")
    shape = dict(zip(sharding.MESH_AXES, sharding.mesh_shape(config.mesh, devices)))
    assert shape == {"data": 1, "fsdp": 1, "context": devices, "tensor": 1}
    # balanced (2 chunks per shard) and in splash's 128-token blocks, as on TPU
    balance.check_length(config.seq_len, devices, True, "splash")
    assert config.global_batch_size % (shape["data"] * shape["fsdp"]) == 0


def test_context_traded_for_data():
    config = dna_long.get_config("goat")
    for c in (1, 2, 4, 8):
        config.mesh.context, config.mesh.data = c, -1
        shape = dict(zip(sharding.MESH_AXES, sharding.mesh_shape(config.mesh, 8)))
        assert shape["data"] == 8 // c and config.global_batch_size % shape["data"] == 0
        assert trainer.validate_config(config, num_devices=8).global_batch == 8


def test_seq_len_override_is_followed():
    config = dna_long.get_config("goat")
    config.seq_len = 1024
    assert config.model.training_seq_len == 1024 and config.model.max_len == 1024
    config.mesh.context, config.mesh.data = 4, -1
    trainer.validate_config(config, num_devices=8)


def test_bad_argument_names_the_tokens():
    with pytest.raises(ValueError, match="configs/dna_long.py: unknown config argument token 'gaot'"):
        dna_long.get_config("gaot")


def test_every_field_has_a_comment():
    path = os.path.join(ROOT, "configs", "dna_long.py")
    source = open(path).read().splitlines()
    func = next(n for n in ast.parse("\n".join(source)).body
                if isinstance(n, ast.FunctionDef) and n.name == "get_config")
    for node in func.body:
        if (isinstance(node, ast.Assign) and "." in ast.unparse(node.targets[0])
                and not ast.unparse(node.value).startswith("ml_collections.ConfigDict")):
            assert "#" in source[node.lineno - 1], f"{path}:{node.lineno}: {source[node.lineno - 1].strip()}"
