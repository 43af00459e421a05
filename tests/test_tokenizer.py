"""Tokenizer loading: settings that transformers warns about when left unset are passed explicitly; EOS ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from runtime.frontend import tokenizer


@pytest.mark.parametrize(("config", "expected"), [
    ({}, False),  # the default model's converted tokenizer states nothing: transformers' current default
    ({"clean_up_tokenization_spaces": True}, True),
    ({"clean_up_tokenization_spaces": False}, False),
    ({"clean_up_tokenization_spaces": None}, False),
])
def test_load_passes_clean_up_tokenization_spaces_from_the_model(tmp_path: Path, monkeypatch, config, expected):
    import transformers

    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    calls: list[dict] = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda path, **kwargs: calls.append({"path": path, **kwargs}) or "tok")
    assert tokenizer.load_tokenizer(tmp_path) == "tok"
    assert calls == [{"path": str(tmp_path), "local_files_only": True, "clean_up_tokenization_spaces": expected}]


def test_a_directory_without_tokenizer_files_has_no_tokenizer(tmp_path: Path):
    assert tokenizer.load_tokenizer(tmp_path) is None


@pytest.fixture(scope="module")
def llama_without_generation_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.conftest import make_tiny_llama

    path = make_tiny_llama(tmp_path_factory.mktemp("eos"), layers=1)
    (path / "generation_config.json").unlink()
    return path


@pytest.mark.parametrize(("config_eos", "generation_config"), [
    (7, None),  # no generation_config.json: config.json's
    ([7, 9], None),
    (7, {"eos_token_id": [3, 4]}),  # generation_config.json's, config.json's not added
    (7, {"bos_token_id": 1}),  # generation_config.json without one: none, config.json's not taken
])
def test_eos_ids_are_the_ones_transformers_generate_stops_at(llama_without_generation_config: Path, tmp_path: Path,
                                                              config_eos, generation_config):
    import torch
    from transformers import AutoModelForCausalLM

    path = shutil.copytree(llama_without_generation_config, tmp_path / "model")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": config_eos}))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).generation_config.eos_token_id
    expected = set(theirs if isinstance(theirs, list) else [theirs]) - {None}
    assert tokenizer.eos_token_ids(path, None) == expected
