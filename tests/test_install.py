"""A CPU-only install pulls no GPU-only package, and the GPU path says what to install when one is missing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from models import ops

REPO = Path(__file__).resolve().parents[1]


def _project() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_gpu_only_packages_are_in_the_gpu_extra_only() -> None:
    project = _project()
    extras = project["optional-dependencies"]
    assert not [d for d in project["dependencies"] if d.startswith("flashinfer")]
    assert not [d for d in extras["test"] if d.startswith("flashinfer")]  # CI installs '.[test]' on CPU
    assert [d for d in extras["gpu"] if d.startswith("flashinfer-python")]


def test_a_missing_flashinfer_names_the_gpu_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` now raises ImportError
    ops.import_flashinfer.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"pip install 'tpinfer\[gpu\]'"):
            ops.import_flashinfer()
    finally:
        ops.import_flashinfer.cache_clear()
