"""scripts/bench_offline.py's orchestration: which measurements run, in which order, and what the JSON keeps."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import scripts.bench_offline as bench

REPO = Path(__file__).resolve().parents[1]


def _run(monkeypatch, tmp_path: Path, *args: str) -> tuple[list[str], dict]:
    calls: list[str] = []

    def fake_measure(_args, run: str, limits=None, tp: int = 1) -> dict:
        calls.append(run if tp == 1 else f"{run}@tp{tp}")
        return {"limits": {"hbm_gbps": 1.0}}.get(run, {"output_tok_s": 100.0 + len(calls), "seconds": 1.0})

    monkeypatch.setattr(bench, "measure", fake_measure)
    monkeypatch.setattr(bench, "print_table", lambda results: None)
    monkeypatch.setattr(sys, "argv", ["bench_offline.py", "--config", str(REPO / "configs/bench/llama-3.2-1b.yaml"),
                                      "--out", str(tmp_path), "--name", "t", *args])
    assert bench.main() == 0
    return calls, json.loads((tmp_path / "t.json").read_text())


def test_the_first_engine_run_is_measured_once_untimed_before_the_plan(monkeypatch, tmp_path):
    calls, results = _run(monkeypatch, tmp_path, "--runs", "hf_static,tpinfer_fixed,tpinfer")
    assert calls == ["limits", "tpinfer_fixed", "hf_static", "tpinfer_fixed", "tpinfer"]
    assert results["warm_up"] == [{"run": "tpinfer_fixed", "output_tok_s": 102.0, "seconds": 1.0}]
    assert list(results["runs"]) == ["hf_static", "tpinfer_fixed", "tpinfer"]
    assert results["runs"]["tpinfer_fixed"]["output_tok_s"] == 104.0  # the timed pass, not the warm-up


@pytest.mark.parametrize(("args", "expected"), [
    (("--runs", "tpinfer", "--no-warm-up"), ["limits", "tpinfer"]),
    (("--runs", "hf_static"), ["limits", "hf_static"]),  # HF peers compile none of our kernels
])
def test_no_warm_up_when_switched_off_or_no_engine_runs(monkeypatch, tmp_path, args, expected):
    calls, results = _run(monkeypatch, tmp_path, *args)
    assert calls == expected and results["warm_up"] == []


def test_each_tp_size_gets_its_own_warm_up(monkeypatch, tmp_path):
    calls, results = _run(monkeypatch, tmp_path, "--runs", "tpinfer", "--tp", "1,2", "--tp-runs", "tpinfer,decode_profile")
    assert calls == ["limits", "tpinfer", "tpinfer", "tpinfer@tp2", "tpinfer@tp2", "decode_profile@tp2"]
    assert [w["run"] for w in results["warm_up"]] == ["tpinfer", "tpinfer@tp2"]
    assert list(results["runs"]) == ["tpinfer", "tpinfer@tp2", "decode_profile@tp2"]
