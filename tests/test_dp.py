"""Data parallelism on CPU (gloo): DP replicas x TP groups under one torchrun, one job, one output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parallel.distributed import TorchrunEnv, layout
from runtime.frontend.job_files import merge_parts, part_path
from tests.conftest import make_tiny_text_llama
from tests.helpers import rows_written, wait_for_rows
from tests.test_torchrun import _alive
from tests.tp_utils import child_with_rank

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
ROWS = 36


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A tiny random Llama (4 heads: TP=2 divides them) with the default model's tokenizer, so rows are text."""
    path = make_tiny_text_llama(tmp_path_factory.mktemp("dp_model"), default_model_dir, seed=3)
    return path


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Skewed on purpose: a few rows generate ten times more than the rest."""
    path = tmp_path_factory.mktemp("dp_rows") / "rows.jsonl"
    path.write_text("".join(json.dumps({
        "id": i, "prompt": f"Row {i}: say something about the number {i * 7}.",
        "sampling": {"max_new_tokens": 300 if i % 12 == 5 else 8 + (i * 13) % 30, "ignore_eos": True},
    }) + "\n" for i in range(ROWS)))
    return path


def _job(model_dir: Path, rows: Path, out: Path, nproc: int, tp_size: int, *extra: str) -> list[str]:
    launcher = [sys.executable] if nproc == 1 else [*TORCHRUN, "--nproc-per-node", str(nproc)]
    return [*launcher, "launch.py", f"model.path={model_dir}", "engine.device=cpu", "model.max_seq_len=512",
            f"job.input={rows}", f"job.output={out}", "job.progress=false", "job.chat_template=false",
            "scheduler.max_running_requests=8", f"parallel.tp_size={tp_size}", *extra]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def _texts(out: Path) -> dict[int, str]:
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    texts = {r["id"]: r["text"] for r in rows}
    assert len(texts) == len(rows), "an id was written twice"
    return texts


@pytest.fixture(scope="module")
def reference(model_dir: Path, rows: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    out = tmp_path_factory.mktemp("dp_ref") / "one.jsonl"
    _run(_job(model_dir, rows, out, 1, 0))
    texts = _texts(out)
    assert len(texts) == ROWS and all(texts.values())
    return texts


def test_layout_puts_each_tp_group_on_contiguous_ranks():
    places = [layout(TorchrunEnv(rank=r, world_size=8, local_rank=r % 4), tp_size=2) for r in range(8)]
    assert [(p.dp_rank, p.rank) for p in places] == [(r // 2, r % 2) for r in range(8)]
    assert {p.dp_size for p in places} == {4} and [p.global_rank for p in places] == list(range(8))
    whole = layout(TorchrunEnv(rank=3, world_size=4, local_rank=3), tp_size=0)
    assert (whole.size, whole.rank, whole.dp_size) == (4, 3, 1)  # 0: today's behaviour, TP over everything
    with pytest.raises(ValueError, match=r"parallel.tp_size=3 does not divide the world size 8"):
        layout(TorchrunEnv(rank=0, world_size=8, local_rank=0), tp_size=3)


def test_merging_parts_adds_every_id_once(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": 1, "text": "a"}\n{"id": 2, "text": "b"}\n{"id": 3, "te')  # torn tail of a kill
    part_path(out, 1).write_text('{"id": 2, "text": "b"}\n{"id": 4, "text": "d"}\n\n')
    part_path(out, 2).write_text('{"id": 5, "text": "e"}\n{"id": 6, "te')
    assert merge_parts(out) == 2  # ids 4 and 5; 2 is there already, the torn and blank lines are no rows
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [1, 2, 4, 5]
    assert not list(tmp_path.glob("out.jsonl.part-*"))
    assert merge_parts(out) == 0  # idempotent: a merge interrupted before its deletes adds nothing twice


@pytest.mark.slow
@pytest.mark.parametrize("nproc,tp_size", [(4, 2), (3, 1)], ids=["dp2xtp2", "dp3xtp1"])
def test_dp_job_matches_one_process(model_dir, rows, reference, tmp_path, nproc, tp_size):
    out = tmp_path / "out.jsonl"
    proc = _run(_job(model_dir, rows, out, nproc, tp_size))
    assert _texts(out) == reference
    dp = nproc // tp_size
    assert f"over {dp} replicas" in proc.stdout
    metrics = json.loads(out.with_suffix(".metrics.json").read_text())
    assert (metrics["dp_size"], metrics["tp_size"], metrics["completed"]) == (dp, tp_size, ROWS)
    replicas = metrics["replicas"]
    assert [r["ranks"] for r in replicas] == [list(range(i * tp_size, (i + 1) * tp_size)) for i in range(dp)]
    assert sum(r["rows"] for r in replicas) == ROWS
    # Rows are taken as replicas have room, so more than one replica serves (not all: on a 2-core CI
    # machine one process may get no CPU before the others took every row).
    assert sum(r["rows"] > 0 for r in replicas) >= 2
    assert sum(r["output_tokens"] for r in replicas) == metrics["output_tokens"]
    assert all(r["busy_s"] > 0 for r in replicas)
    assert not list(tmp_path.glob("*.part-*"))  # merged into the one output


def _start_and_kill(cmd: list[str], out: Path, after_rows: int) -> None:
    """Start a job and SIGKILL every process of it once ``after_rows`` rows are on disk."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_for_rows(proc, out, after_rows)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


@pytest.mark.slow
def test_killed_then_resumed_at_other_dp_sizes_gives_one_row_per_id(model_dir, rows, reference, tmp_path):
    out = tmp_path / "out.jsonl"
    _start_and_kill(_job(model_dir, rows, out, 2, 1), out, 6)  # DP=2
    assert list(tmp_path.glob("out.jsonl.part-*")), "replica 1's rows should still be in its part file"
    _start_and_kill(_job(model_dir, rows, out, 3, 1), out, 14)  # DP=3 resumes, killed again
    _run(_job(model_dir, rows, out, 1, 0))  # one process finishes
    assert _texts(out) == reference
    metrics = json.loads(out.with_suffix(".metrics.json").read_text())
    assert metrics["already_done"] >= 14 and metrics["already_done"] + metrics["completed"] == ROWS


@pytest.mark.slow
def test_a_signal_to_one_replica_drains_them_all(model_dir, rows, reference, tmp_path):
    out = tmp_path / "out.jsonl"
    cmd = _job(model_dir, rows, out, 4, 2, "job.drain_timeout_s=0")  # DP=2 x TP=2; in-flight rows are abandoned
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_rows(proc, out, 4)
        os.kill(child_with_rank(proc.pid, 2), signal.SIGUSR1)  # replica 1's leader only
        sent = time.time()
        log, _ = proc.communicate(timeout=120)
        elapsed = time.time() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert elapsed < 60
    assert proc.returncode != 0  # so a Slurm script requeues
    assert "SIGUSR1 received: draining" in log and "SIGUSR1 received by another replica: draining" in log, log[-3000:]
    assert "exitcode: 143" in log or "exit 143" in log, log[-3000:]
    assert log.count("interrupted by signal") == 1, log[-3000:]  # replica 0 says it for all
    assert not list(tmp_path.glob("out.jsonl.part-*"))  # replica 1's rows were merged on the way out
    first = _texts(out)
    assert 4 <= len(first) < ROWS
    _run([c for c in cmd if c != "job.drain_timeout_s=0"])
    assert _texts(out) == reference


@pytest.mark.slow
def test_a_dying_rank_ends_every_replica_and_loses_no_finished_row(model_dir, rows, reference, tmp_path):
    out = tmp_path / "out.jsonl"
    cmd = _job(model_dir, rows, out, 4, 2, "job.drain_timeout_s=5")  # DP=2 x TP=2
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_rows(proc, out, 4)
        os.kill(child_with_rank(proc.pid, 3), signal.SIGKILL)  # a worker of replica 1
        killed = time.time()
        written = rows_written(out)
        proc.communicate(timeout=120)
        elapsed = time.time() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"all ranks gone {elapsed:.1f} s after the kill")
    assert proc.returncode != 0 and elapsed < 60, elapsed
    kept = [json.loads(line) for f in [out, *tmp_path.glob("out.jsonl.part-*")] for line in f.read_text().splitlines()]
    assert len(kept) >= written and all(reference[r["id"]] == r["text"] for r in kept)
    _run(_job(model_dir, rows, out, 3, 1))  # resumed as DP=3: the part file left behind is merged first
    assert _texts(out) == reference


@pytest.mark.slow
def test_a_tp_size_that_does_not_divide_the_world_fails_once_and_clearly(model_dir, rows, tmp_path):
    proc = subprocess.run(_job(model_dir, rows, tmp_path / "out.jsonl", 3, 2), cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert log.count("error on rank") == 1
    assert "error on rank 0: parallel.tp_size=2 does not divide the world size 3" in log


@pytest.mark.slow
def test_a_replica_idle_at_the_end_keeps_its_tp_workers_inside_a_short_timeout(model_dir, tmp_path):
    """DP 2 x TP 2, one long row and one short: the short row's leader waits at the last barrier far longer than
    parallel.timeout_s, and its TP worker must still be waiting for it, not timed out (the job is complete)."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": 0, "prompt": "A long story", "sampling": {"max_new_tokens": 480,
                                                                               "ignore_eos": True}}) + "\n"
                    + json.dumps({"id": 1, "prompt": "Short", "sampling": {"max_new_tokens": 1}}) + "\n")
    out = tmp_path / "out.jsonl"
    _run(_job(model_dir, rows, out, 4, 2, "parallel.timeout_s=5"))
    assert sorted(_texts(out)) == [0, 1]


@pytest.mark.slow
def test_a_leader_waiting_for_a_part_lock_keeps_its_tp_workers_inside_a_short_timeout(model_dir, rows, reference,
                                                                                       tmp_path):
    """TP=2: at start the leader waits for a killed run's replica that still holds its part of the output (here
    for longer than parallel.timeout_s). Its TP worker waits for a batch meanwhile and must not time out."""
    from runtime.frontend.output_lock import OutputLock, lock_path

    out = tmp_path / "out.jsonl"
    held = OutputLock(lock_path(out, 1), "replica 1's part")
    held.acquire()
    proc = subprocess.Popen(_job(model_dir, rows, out, 2, 2, "parallel.timeout_s=5", "job.lock_wait_s=120"),
                            cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = []
    try:
        for line in proc.stdout:  # the leader says when it starts waiting for the part
            log.append(line)
            if "is in use by another run" in line:
                break
        time.sleep(12)  # past two worker timeouts
        assert proc.poll() is None, "".join(log) + proc.communicate()[0][-3000:]
    finally:
        held.release()
    rest, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, ("".join(log) + rest)[-3000:]
    assert any("is in use by another run" in line for line in log)
    assert _texts(out) == reference


@pytest.mark.slow
def test_a_replica_that_fails_ends_the_others_at_once(model_dir, rows, tmp_path):
    """Replica 0 cannot take a part file another run holds (job.lock_wait_s=1) and fails; replica 1, waiting at
    a barrier, ends with it in seconds and says why, not after the drain's timeout (20 s, then torchrun's kill)."""
    from runtime.frontend.output_lock import OutputLock, lock_path

    out = tmp_path / "out.jsonl"
    held = OutputLock(lock_path(out, 1), "a killed run's replica 1")
    held.acquire()
    proc = subprocess.Popen(_job(model_dir, rows, out, 2, 1, "job.lock_wait_s=1"), cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = []
    try:
        for line in proc.stdout:
            log.append(line)
            if "is in use by another run" in line:
                break
        waiting_since = time.time()
        rest, _ = proc.communicate(timeout=120)
        elapsed = time.time() - waiting_since
    finally:
        held.release()
        if proc.poll() is None:
            proc.kill()
    text = "".join(log) + rest
    print(f"every rank gone {elapsed:.1f} s after replica 0 started waiting for the lock")
    assert proc.returncode == 1, text[-3000:]
    assert "replica 0: OutputLocked" in text, text[-3000:]
    assert elapsed < 12, text[-3000:]


@pytest.mark.slow
def test_ranks_of_a_killed_launcher_drain_and_exit(model_dir, tmp_path):
    """kill -9 of launch.py --nproc-per-node (torchrun's agent in-process): its TP=2 ranks, in sessions of their
    own, drain and exit, rather than serve minutes of rows on and hold the output a rerun waits for."""
    from runtime.frontend.output_lock import OutputLock, lock_path

    rows = tmp_path / "long.jsonl"
    rows.write_text("".join(json.dumps({"id": i, "prompt": f"Row {i}", "sampling": {"max_new_tokens": 400,
                                                                                  "ignore_eos": True}}) + "\n"
                            for i in range(200)))
    out = tmp_path / "out.jsonl"
    cmd = _job(model_dir, rows, out, 1, 2, "job.drain_timeout_s=3")  # python launch.py ...
    cmd[2:2] = ["--nproc-per-node", "2"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks: list[int] = []
    try:
        wait_for_rows(proc, out, 2)
        ranks = [child_with_rank(proc.pid, r) for r in range(2)]
        proc.kill()
        proc.wait(timeout=30)
        killed = time.time()
        while any(_alive(pid) for pid in ranks) and time.time() < killed + 60:
            time.sleep(0.2)
        elapsed = time.time() - killed
    finally:
        for pid in ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    print(f"ranks gone {elapsed:.1f} s after their launcher, {rows_written(out)} of 200 rows written")
    assert elapsed < 30 and rows_written(out) < 200
    with OutputLock(lock_path(out), "the output"):  # free: a rerun starts at once
        pass
