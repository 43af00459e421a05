"""A damaged safetensors file (a cut download, a full disk) fails with one error naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from models.config import ModelConfig
from models.weights.loader import load_model
from scripts.make_random_checkpoint import write_random_checkpoint

TINY = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 128, "tie_word_embeddings": False, "eos_token_id": 2}


@pytest.fixture()
def checkpoint(tmp_path: Path) -> Path:
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    (config_dir / "config.json").write_text(json.dumps(TINY))
    return write_random_checkpoint(config_dir, tmp_path / "ckpt", dtype=torch.float32, device=torch.device("cpu"))


def _load(path: Path) -> None:
    load_model(path, ModelConfig.from_dir(path), torch.device("cpu"), torch.float32, 64)


def test_the_random_checkpoint_loads(checkpoint: Path) -> None:
    _load(checkpoint)  # the damaged cases below fail because of the damage, not the checkpoint


@pytest.mark.parametrize("keep", [0.5, 0.001], ids=["data_cut", "header_cut"])
def test_a_cut_shard_fails_with_one_error_naming_it(checkpoint: Path, keep: float) -> None:
    (shard,) = checkpoint.glob("*.safetensors")
    data = shard.read_bytes()
    shard.write_bytes(data[: max(int(len(data) * keep), 1)])
    with pytest.raises(ValueError) as err:
        _load(checkpoint)
    message = str(err.value)
    assert f"checkpoint file {shard} is damaged or incomplete" in message, message
    assert "\n" not in message
    assert err.value.__cause__ is None and err.value.__suppress_context__  # no safetensors traceback under it


def test_an_index_names_the_files_of_the_checkpoint(checkpoint: Path) -> None:
    """Shards and their index, beside a checkpoint of the same weights in other names (as Mistral's repositories
    ship consolidated.safetensors): only the indexed files load, into the same weights."""
    from safetensors.torch import load_file, save_file

    from models.weights.loader import checkpoint_files

    (single,) = checkpoint.glob("*.safetensors")
    tensors = load_file(single)
    single.unlink()
    names = sorted(tensors)
    shards = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(checkpoint / file))
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    save_file({f"native.{k}": v for k, v in tensors.items()}, str(checkpoint / "consolidated.safetensors"))
    assert [f.name for f in checkpoint_files(checkpoint)] == sorted(shards)
    model = load_model(checkpoint, ModelConfig.from_dir(checkpoint), torch.device("cpu"), torch.float32, 64)
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])
    (checkpoint / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"names \['model-00002-of-00002.safetensors'\], missing from"):
        _load(checkpoint)
