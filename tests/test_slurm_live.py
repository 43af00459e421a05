"""The real sbatch template on a live single-node Slurm (scripts/slurm/local_cluster.sh), CPU ranks over gloo.

Checked through squeue/scontrol and the job's own files (no accounting database): a clean run,
a preemption that drains and requeues, a hard kill and a resubmission, and MAX_REQUEUES.
Skipped, with the reason, where Slurm and munge are not installed or cannot start (as root).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import make_tiny_llama

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "scripts" / "slurm" / "local_cluster.sh"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("munged", "slurmctld", "slurmd", "sbatch")):
        pytest.skip("needs root and Slurm + munge installed (scripts/slurm/local_cluster.sh install)")
    state = tmp_path_factory.mktemp("slurm")
    started = subprocess.run(["bash", str(CLUSTER), "start", str(state)], capture_output=True, text=True, timeout=120)
    if started.returncode != 0:
        pytest.skip(f"a local Slurm cluster could not start: {started.stderr.strip()[-500:]}")
    env = {**os.environ, "SLURM_CONF": str(state / "slurm.conf"), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    yield env
    subprocess.run(["bash", str(CLUSTER), "stop", str(state)], capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("slurm_model"), vocab=502, heads=8, kv_heads=4, seed=3)


def _rows(path: Path, n: int, base: int, step: int) -> Path:
    path.write_text("".join(json.dumps({"id": i, "prompt": [i + 1, 5, 7], "sampling": {
        "max_new_tokens": base + step * i, "ignore_eos": True}}) + "\n" for i in range(n)))
    return path


def submit(env: dict[str, str], model: Path, rows: Path, out: Path, *extra: str, overrides: str = "",
           **variables: str) -> str:
    """sbatch the real template: 2 CPU ranks (TP=2 over gloo), no GPUs, the log next to the output; ``overrides``
    come last, so they win."""
    overrides = (f"model.path={model} engine.device=cpu model.max_seq_len=2048 scheduler.max_running_requests=4 "
                 f"job.input={rows} job.output={out} job.progress=false job.drain_timeout_s=3 {overrides}")
    job_env = {**env, "CONFIG": "configs/default.yaml", "OVERRIDES": overrides, "NPROC_PER_NODE": "2",
               "PYTHON": sys.executable, **variables}
    proc = subprocess.run(["sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=2", "--time=10",
                           f"--output={out.parent}/slurm-%j.out", *extra, "scripts/slurm/single_node.sbatch"],
                          cwd=REPO, env=job_env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def job(env: dict[str, str], job_id: str) -> dict[str, str]:
    """``scontrol show job`` as a dict (JobState, Restarts, ...)."""
    text = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
    return dict(item.split("=", 1) for item in text.split() if "=" in item)


def wait_until(condition, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def wait_done(env: dict[str, str], job_id: str, timeout: float = 300) -> dict[str, str]:
    final = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
    wait_until(lambda: job(env, job_id).get("JobState") in final, timeout, f"job {job_id} to end")
    return job(env, job_id)


def warn_batch(slurm: dict, job_id: str) -> None:
    """USR1 to the batch shell (the time-limit warning). slurmctld refuses signals while a job changes state
    ("Job can not be altered now, try again later", e.g. just after a requeue, for over a minute on a loaded
    2-core machine): retry those, for up to 180 s."""
    deadline = time.monotonic() + 180
    while True:
        proc = subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=slurm, capture_output=True,
                              text=True)
        if proc.returncode == 0:
            return
        if "try again later" not in proc.stderr or time.monotonic() > deadline:
            raise AssertionError(f"scancel --signal=USR1 failed: {proc.stderr.strip()}")
        time.sleep(1)


def wait_for_requeued_run(env: dict[str, str], job_id: str, restarts: int) -> None:
    """A requeued job starts again after Slurm's requeue delay (about 120 s). Not forced earlier with
    StartTime=now: the old allocation's credential is still revoked then, and Slurm kills the job as
    non-startable (seen in slurmctld.log: "Job credential revoked")."""
    wait_until(lambda: job(env, job_id).get("JobState") == "RUNNING" and job(env, job_id).get("Restarts") == str(restarts),
               330, f"job {job_id} to run again after its requeue")


def ids(out: Path) -> list[int]:
    return sorted(json.loads(line)["id"] for line in out.read_text().splitlines())


def test_a_clean_run_completes_with_every_row(slurm, tiny_model, tmp_path):
    out = tmp_path / "out.jsonl"
    job_id = submit(slurm, tiny_model, _rows(tmp_path / "rows.jsonl", 6, 8, 0), out)
    info = wait_done(slurm, job_id)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "0"
    assert ids(out) == list(range(6))


def test_preemption_drains_requeues_and_the_next_attempt_finishes(slurm, tiny_model, tmp_path):
    out = tmp_path / "out.jsonl"
    job_id = submit(slurm, tiny_model, _rows(tmp_path / "rows.jsonl", 16, 40, 60), out)
    wait_until(lambda: out.exists() and out.read_text().strip(), 180, "the first row")
    warn_batch(slurm, job_id)  # the time-limit warning
    wait_for_requeued_run(slurm, job_id, 1)
    info = wait_done(slurm, job_id)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1"
    assert ids(out) == list(range(16))  # exactly one row per id across the two attempts
    log = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert "attempt 1" in log and "attempt 2" in log and "got SIGUSR1" in log and "requeueing job" in log


def test_a_warning_once_every_row_is_in_flight_completes_without_a_requeue(slurm, tiny_model, tmp_path):
    """All 4 rows run at once (scheduler.max_running_requests=4); USR1 after the short first one: the drain finishes
    the others, every rank exits 0, and the job ends COMPLETED on its first attempt, though torchrun itself exits 1
    after the signal."""
    out = tmp_path / "out.jsonl"
    job_id = submit(slurm, tiny_model, _rows(tmp_path / "rows.jsonl", 4, 8, 100), out,
                    overrides="job.drain_timeout_s=60")
    wait_until(lambda: out.exists() and out.read_text().strip(), 180, "the first row")
    warn_batch(slurm, job_id)
    info = wait_done(slurm, job_id)
    log = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "0", (info, log)
    assert ids(out) == list(range(4))
    assert "got SIGUSR1" in log and "its ranks exited rank 0: 0, rank 1: 0: exit 0" in log
    assert "step exited with code 0" in log and "requeueing" not in log


def test_a_hard_kill_then_a_resubmission_resumes(slurm, tiny_model, tmp_path):
    out, rows = tmp_path / "out.jsonl", _rows(tmp_path / "rows.jsonl", 16, 40, 60)
    job_id = submit(slurm, tiny_model, rows, out)
    wait_until(lambda: out.exists() and out.read_text().strip(), 180, "the first row")
    # As a node crash or the OOM killer would: SIGKILL to the batch shell and the ranks, no trap runs.
    # (scancel's KILL is not that: Slurm turns it into a cancel with SIGTERM first, which drains.)
    subprocess.run(["pkill", "-KILL", "-f", f"job{int(job_id):05d}/slurm_script"], check=True)
    subprocess.run(["pkill", "-KILL", "-f", f"job.output={out}"])
    info = wait_done(slurm, job_id)
    assert info["JobState"] != "COMPLETED" and info["Restarts"] == "0"  # not requeued
    partial = len(out.read_text().splitlines())
    assert partial < 16
    again = submit(slurm, tiny_model, rows, out)
    assert wait_done(slurm, again)["JobState"] == "COMPLETED"
    assert ids(out) == list(range(16))


def test_max_requeues_stops_a_job_that_never_finishes(slurm, tiny_model, tmp_path):
    out = tmp_path / "out.jsonl"
    job_id = submit(slurm, tiny_model, _rows(tmp_path / "rows.jsonl", 16, 1900, 0), out, MAX_REQUEUES="1")
    wait_until(lambda: job(slurm, job_id).get("JobState") == "RUNNING", 180, "attempt 1")
    time.sleep(5)  # the batch shell has installed its traps
    warn_batch(slurm, job_id)
    wait_for_requeued_run(slurm, job_id, 1)
    time.sleep(5)
    warn_batch(slurm, job_id)
    info = wait_done(slurm, job_id)
    time.sleep(3)  # a requeue would show up as PENDING now
    assert job(slurm, job_id)["JobState"] != "COMPLETED" and info["Restarts"] == "1"
    log = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert "not requeueing: already restarted 1 times (MAX_REQUEUES=1)" in log


def test_a_user_cancel_is_not_requeued(slurm, tiny_model, tmp_path):
    out = tmp_path / "out.jsonl"
    job_id = submit(slurm, tiny_model, _rows(tmp_path / "rows.jsonl", 16, 40, 60), out)
    wait_until(lambda: out.exists() and out.read_text().strip(), 180, "the first row")
    subprocess.run(["scancel", job_id], env=slurm, check=True)
    info = wait_done(slurm, job_id)
    time.sleep(3)  # a requeue would show up as PENDING now
    assert job(slurm, job_id)["JobState"] == "CANCELLED" and info["Restarts"] == "0"
