"""Tokenizer loading: settings that transformers warns about when left unset are passed explicitly."""

from __future__ import annotations

import json
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
