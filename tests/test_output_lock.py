"""One writer per output: a second run on the same output stops at start naming the holder; a killed run's lock
never blocks its resume (CPU; in-process on a tiny model, and two real runs at once, DP=2 included)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from runtime import LLM
from runtime.frontend.job import run_job
from runtime.frontend.output_lock import OutputLock, OutputLocked, lock_path
from tests.conftest import make_tiny_text_llama

REPO = Path(__file__).resolve().parents[1]
HOLD = """
import sys, time
from pathlib import Path
from runtime.frontend.output_lock import OutputLock
lock = OutputLock(Path(sys.argv[1]), "job.output=x")
lock.acquire()
print("held", flush=True)
time.sleep(600)
"""


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL a job and every process under it, as a scheduler ending an allocation does (torchrun starts its
    ranks in sessions of their own: killing the launcher alone leaves them running for a while); returns once
    they are all gone."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    pids, todo = [], [proc.pid]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(children.get(pid, []))
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)

    def alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.time() + 60
    while any(alive(pid) for pid in pids[1:]):
        assert time.time() < deadline, "a killed process did not go"
        time.sleep(0.05)


def _holder(lock: Path) -> subprocess.Popen:
    """Another process holding ``lock`` until it is killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_holder_is_refused_with_the_holder_named(tmp_path):
    out = tmp_path / "out.jsonl"
    with OutputLock(lock_path(out), f"job.output={out}"):
        info = json.loads(lock_path(out).read_text())
        assert info["pid"] == os.getpid() and info["host"] == socket.gethostname() and info["started"]
        with pytest.raises(OutputLocked) as refused:
            OutputLock(lock_path(out), f"job.output={out}").acquire()  # another open file: refused, even here
    message = str(refused.value)
    assert f"job.output={out}" in message and f"pid {os.getpid()}" in message
    assert f"host {socket.gethostname()}" in message and f"started {info['started']}" in message
    assert "\n" not in message
    assert not lock_path(out).exists()  # released: the file goes with it
    assert lock_path(out, 2) == tmp_path / "out.jsonl.lock-2"


def test_a_lock_of_a_killed_process_does_not_block(tmp_path):
    lock = lock_path(tmp_path / "out.parquet")
    proc = _holder(lock)
    with pytest.raises(OutputLocked, match=f"pid {proc.pid}"):
        OutputLock(lock, "job.output=x").acquire()
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert json.loads(lock.read_text())["pid"] == proc.pid  # the stale file is still there...
    with OutputLock(lock, "job.output=x"):  # ...and does not matter
        assert json.loads(lock.read_text())["pid"] == os.getpid()


def test_a_lock_held_by_a_run_that_is_exiting_is_waited_for(tmp_path):
    lock = lock_path(tmp_path / "out.jsonl")
    proc = _holder(lock)
    killer = subprocess.Popen([sys.executable, "-c", f"import os, time; time.sleep(1); os.kill({proc.pid}, 9)"])
    try:
        start = time.monotonic()
        with OutputLock(lock, "job.output=x", wait_s=60):
            assert 0.5 < time.monotonic() - start < 30
    finally:
        killer.wait()
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), overrides=["engine.device=cpu", "model.dtype=float32", "model.max_seq_len=64",
                                               "job.progress=false", "sampling.max_new_tokens=2"])


@pytest.mark.parametrize("kind", ["jsonl", "openai", "parquet"])
def test_a_job_on_a_held_output_stops_before_writing(llm, tmp_path, kind):
    rows = tmp_path / "rows.jsonl"
    if kind == "openai":
        line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": [5, 6]}}
    else:
        line = {"id": "a", "prompt": [5, 6]}
    rows.write_text(json.dumps(line) + "\n")
    out = tmp_path / ("out.parquet" if kind == "parquet" else "out.jsonl")
    base = llm.cfg.job
    llm.cfg.job = replace(base, input=str(rows), output=str(out), lock_wait_s=0.0)
    try:
        holder = _holder(lock_path(out))
        try:
            with pytest.raises(OutputLocked, match=rf"job.output={out} is in use by another run \(host .*, pid "
                                                   rf"{holder.pid}, started "):
                run_job(llm, "cfg")
        finally:
            holder.kill()
            holder.wait()
        assert not out.exists() and not list(tmp_path.glob("out.*.part-*"))
        assert run_job(llm, "cfg")["completed"] == 1  # the holder is gone: the same job runs
    finally:
        llm.cfg.job = base


# ---- two real runs at once ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def text_model(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    path = make_tiny_text_llama(tmp_path_factory.mktemp("lock_model"), default_model_dir, seed=3)
    return path


def _rows(tmp_path: Path, kind: str, count: int = 60) -> Path:
    path = tmp_path / "rows.jsonl"
    sampling = {"max_new_tokens": 48, "ignore_eos": True}
    lines = []
    for i in range(count):
        prompt = f"Row {i}: tell me about the number {i}."
        if kind == "openai":
            body = {"prompt": prompt, "max_tokens": 48, "ignore_eos": True}
            lines.append({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body})
        else:
            lines.append({"id": i, "prompt": prompt, "sampling": sampling})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _ids(out: Path, kind: str) -> list:
    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(out, columns=["id"]).column("id").to_pylist()
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    return [line["custom_id"] if kind == "openai" else line["id"] for line in lines]


def _written(out: Path) -> bool:
    """Some rows are on disk (the output, a replica's part, or a Parquet part)."""
    for f in [out, *out.parent.glob(out.name + ".part-*")]:
        try:
            if f.stat().st_size > 0:
                return True
        except FileNotFoundError:  # merged away meanwhile
            continue
    return False


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "nproc"), [("jsonl", 1), ("openai", 1), ("parquet", 2)],
                         ids=["jsonl", "openai", "parquet-dp2"])
def test_two_runs_of_one_job_at_once(text_model, tmp_path, kind, nproc):
    rows = _rows(tmp_path, kind)
    out = tmp_path / ("out.parquet" if kind == "parquet" else "out.jsonl")
    launcher = [sys.executable, "launch.py"] + ([f"--nproc-per-node={nproc}"] if nproc > 1 else [])
    cmd = [*launcher, f"model.path={text_model}", "engine.device=cpu", "model.max_seq_len=256", f"job.input={rows}",
           f"job.output={out}", "job.progress=false", "job.chat_template=false", "scheduler.max_running_requests=2",
           "job.fsync_every_s=0.2", "job.lock_wait_s=1"]
    first = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 300
        while not _written(out):
            assert first.poll() is None and time.time() < deadline, "the first run ended before the second started"
            time.sleep(0.1)
        second = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
        assert first.poll() is None, "the first run should still be running"
        log, _ = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            first.kill()
    assert second.returncode != 0
    errors = [line for line in second.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1, second.stderr[-3000:]
    assert f"job.output={out} is in use by another run (host {socket.gethostname()}, pid " in errors[0]
    assert "started 20" in errors[0] and "Traceback" not in second.stderr
    assert first.returncode == 0, log[-3000:]
    expected = [f"r{i}" for i in range(60)] if kind == "openai" else list(range(60))
    assert sorted(_ids(out, kind), key=str) == sorted(expected, key=str)  # one row per id
    assert not list(tmp_path.glob("*.lock*"))


def test_launch_stops_on_a_held_output_before_it_loads_the_model(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"id": 1, "prompt": "hi"}\n')
    out = tmp_path / "out.jsonl"
    with OutputLock(lock_path(out), f"job.output={out}"):
        # A model path that does not exist: had the model load come first, the error would name it instead.
        proc = subprocess.run([sys.executable, "launch.py", f"job.input={rows}", f"job.output={out}",
                               "model.path=/nonexistent/model", "job.lock_wait_s=0", "engine.device=cpu"],
                              cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert f"job.output={out} is in use by another run" in proc.stderr and f"pid {os.getpid()}" in proc.stderr
    assert "/nonexistent/model" not in proc.stderr
    assert not out.exists()
