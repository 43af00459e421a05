"""The embedded default model's cache: damage is found and rebuilt, an unwritable cache says what to do, and a
local directory of the model's name is the user's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from models.weights import default_model
from models.weights.default_model import DEFAULT_MODEL


def _prepared(path: Path, with_sizes: bool = True) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"x" * 100)
    files = {f.name: f.stat().st_size for f in path.iterdir()}
    (path / default_model._MARKER).write_text(json.dumps({"model": DEFAULT_MODEL, **({"files": files}
                                                                                        if with_sizes else {})}))
    return path


def test_a_truncated_or_missing_file_makes_the_cache_incomplete(tmp_path):
    ok = _prepared(tmp_path / "ok")
    assert default_model._is_complete(ok)
    truncated = _prepared(tmp_path / "truncated")
    (truncated / "model.safetensors").write_bytes(b"x" * 10)
    missing = _prepared(tmp_path / "missing")
    (missing / "model.safetensors").unlink()
    assert not default_model._is_complete(truncated) and not default_model._is_complete(missing)
    assert default_model._is_complete(_prepared(tmp_path / "older", with_sizes=False))  # before sizes were kept


def test_an_unwritable_cache_names_tpinfer_cache(tmp_path, monkeypatch):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("TPINFER_CACHE", str(tmp_path / "a_file" / "cache"))
    with pytest.raises(RuntimeError, match=r"cannot prepare .* set TPINFER_CACHE to a writable directory"):
        default_model.ensure_default_model(quiet=True)


def test_a_local_directory_named_like_the_default_model_is_the_users(tmp_path, monkeypatch):
    monkeypatch.setattr(default_model, "ensure_default_model", lambda quiet=False: Path("/embedded"))
    monkeypatch.chdir(tmp_path)
    assert default_model.resolve_model_path(DEFAULT_MODEL) == Path("/embedded")
    assert default_model.resolve_model_path("default") == Path("/embedded")
    (tmp_path / DEFAULT_MODEL).mkdir()
    (tmp_path / DEFAULT_MODEL / "config.json").write_text("{}")
    assert default_model.resolve_model_path(DEFAULT_MODEL) == Path(DEFAULT_MODEL)
