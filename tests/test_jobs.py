"""JSONL jobs: per-row errors, metrics, resume after SIGKILL, graceful drain on SIGTERM (CPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import make_tiny_llama

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
QUESTIONS = ["What is the capital of France?", "Name a color.", "What is 3 + 4?", "Say hi.", "Name a fruit.",
             "What is the opposite of hot?", "Name a planet.", "What do bees make?"]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for_rows(out: Path, proc: subprocess.Popen, n: int, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while len(_rows_safe(out)) < n:
        assert proc.poll() is None, "the job ended before it could be interrupted"
        assert time.time() < deadline
        time.sleep(0.1)


def _rows_safe(out: Path) -> list[str]:
    if not out.exists():
        return []
    return [ln for ln in out.read_text().split("\n")[:-1]]


def test_tp3_job_with_bad_rows(default_model_dir, tmp_path):
    rows = tmp_path / "rows.jsonl"
    lines = [json.dumps({"id": f"q{i}", "prompt": QUESTIONS[i % len(QUESTIONS)], "sampling": {"max_new_tokens": 4}})
             for i in range(197)]
    lines.insert(50, "{this is not json")
    lines.insert(120, json.dumps({"id": "bad-temp", "prompt": "hi", "sampling": {"temperature": -2}}))
    lines.insert(160, json.dumps({"id": "q3", "prompt": "duplicate id"}))
    rows.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [*TORCHRUN, "--nproc-per-node", "3", "launch.py", f"model.path={default_model_dir}", "engine.device=cpu",
         f"job.input={rows}", f"job.output={out}", "job.progress=false"],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results, errors = _rows(out), _rows(out.with_suffix(".errors.jsonl"))
    assert len(results) == 197 and len({r["id"] for r in results}) == 197
    assert len(errors) == 3
    assert {e["id"] for e in errors} == {None, "bad-temp", "q3"}
    metrics = json.loads(out.with_suffix(".metrics.json").read_text())
    assert metrics["completed"] == 197 and metrics["errors"] == 3 and metrics["tp_size"] == 3
    assert metrics["output_tokens"] == sum(r["completion_tokens"] for r in results)
    assert set(metrics["latency_s"]) == {"p50", "p90", "p99", "max"}


def _job_cmd(model_dir: Path, rows: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "launch.py", f"model.path={model_dir}", "engine.device=cpu", f"job.input={rows}",
            f"job.output={out}", "job.progress=false", "scheduler.max_running_requests=4", *extra]


def test_sigkill_half_way_then_rerun_gives_one_row_per_id(default_model_dir, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(
        json.dumps({"id": i, "prompt": QUESTIONS[i % len(QUESTIONS)], "sampling": {"max_new_tokens": 6 + (i * 7) % 30}})
        + "\n" for i in range(24)))
    reference = tmp_path / "reference.jsonl"
    done = subprocess.run(_job_cmd(default_model_dir, rows, reference), cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(_job_cmd(default_model_dir, rows, out), cwd=REPO, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_rows(out, proc, 10)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    partial = len(_rows_safe(out))
    assert 10 <= partial < 24
    rerun = subprocess.run(_job_cmd(default_model_dir, rows, out), cwd=REPO, env=_env(), capture_output=True,
                           text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    results = _rows(out)
    assert sorted(r["id"] for r in results) == list(range(24))  # exactly one row per id
    expected = {r["id"]: r["text"] for r in _rows(reference)}
    assert {r["id"]: r["text"] for r in results} == expected
    assert json.loads(out.with_suffix(".metrics.json").read_text())["already_done"] >= partial


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_signal_drains_every_rank_and_rerun_completes(tmp_path, sig):
    model_dir = make_tiny_llama(tmp_path / "model", vocab=502, heads=8, kv_heads=4, seed=9)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(
        json.dumps({"id": i, "prompt": [i + 1, 5, 7], "sampling": {"max_new_tokens": 40 + 60 * i, "ignore_eos": True}})
        + "\n" for i in range(30)))
    out = tmp_path / "out.jsonl"
    cmd = [*TORCHRUN, "--nproc-per-node", "2", "launch.py", f"model.path={model_dir}", "engine.device=cpu",
           "model.max_seq_len=2048", f"job.input={rows}", f"job.output={out}", "job.progress=false",
           "scheduler.max_running_requests=4", "job.drain_timeout_s=5"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    _wait_for_rows(out, proc, 3)
    os.killpg(proc.pid, sig)  # as Slurm (SIGTERM) or a terminal (Ctrl-C) does: every process of the step
    sent = time.time()
    log, _ = proc.communicate(timeout=60)
    assert time.time() - sent < 30, "ranks did not exit within 30 s"
    assert proc.returncode != 0  # so a Slurm script requeues
    assert "draining" in log and "KeyboardInterrupt" not in log
    # torchrun starts its ranks in their own sessions and forwards the Ctrl-C once: they drain, never stop at once.
    assert "a second Ctrl-C" not in log, log[-3000:]
    first = _rows(out)
    assert 3 <= len(first) < 30
    rerun = subprocess.run([c for c in cmd if c != "job.drain_timeout_s=5"], cwd=REPO, env=_env(),
                           capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-2000:]
    results = _rows(out)
    assert sorted(r["id"] for r in results) == list(range(30))
    assert all(r["completion_tokens"] == 40 + 60 * r["id"] for r in results)


def test_config_errors_fail_before_the_model_loads(tmp_path):
    cases = {
        "cache.page_sise=4": "cache.page_size",
        "cache.page_size=big": "cache.page_size",
        "scheduler.overlap": "key=value",
        f"job.input={tmp_path / 'missing.jsonl'}": "job.input",
    }
    for override, named in cases.items():
        extra = [f"job.output={tmp_path / 'o.jsonl'}"] if override.startswith("job.input") else []
        start = time.time()
        proc = subprocess.run([sys.executable, "launch.py", "model.path=/nonexistent", override, *extra], cwd=REPO,
                              env=_env(), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (override, proc.stderr)
        assert named in proc.stderr, (override, proc.stderr)
        assert "nonexistent" not in proc.stderr  # failed on the config, before looking for the model
        assert time.time() - start < 30
    missing = subprocess.run([sys.executable, "launch.py", "--config", str(tmp_path / "nope.yaml")], cwd=REPO,
                             env=_env(), capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "nope.yaml" in missing.stderr
