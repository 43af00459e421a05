"""``python launch.py --nproc-per-node N``: torchrun's launcher in our process, with our exit codes and no traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parallel.launcher import EXIT_DRAINED, exit_code_of
from tests.conftest import make_tiny_text_llama
from tests.helpers import wait_for_rows

REPO = Path(__file__).resolve().parents[1]
ROWS = 24


@pytest.mark.parametrize(
    ("rank_codes", "expected"),
    [
        ({0: 143, 1: 143}, EXIT_DRAINED),  # every rank drained: resumable
        ({1: 143}, EXIT_DRAINED),
        ({0: 143, 1: 1}, 1),  # a real failure wins over a drain
        ({0: 2, 1: 1}, 2),  # the first failed rank's own code
        ({1: -9}, 137),  # killed by SIGKILL
        ({0: 0, 1: 300}, 1),  # not an exit code a shell can carry
    ],
)
def test_exit_code_of_failed_ranks(rank_codes, expected):
    assert exit_code_of(rank_codes) == expected


def test_the_first_failure_gives_the_code_not_the_ranks_ended_after_it():
    assert exit_code_of({0: -9, 1: 1}, first_failed=1) == 1  # rank 0 was killed because rank 1 failed
    assert exit_code_of({0: 143, 1: 2}, first_failed=0) == 2  # a drain is never the failure


RANK_SCRIPT = """\
import os, signal, sys, time
from parallel.launcher import record_exit_code
code = os.environ["RANK_CODE"] if os.environ["RANK"] == "0" else "0"
def stop(*_):  # as launch.py's ranks: drain, then leave the code ("none": a rank that leaves none)
    sys.exit(143 if code == "none" else record_exit_code(int(code)))
signal.signal(signal.SIGTERM, stop)
open(os.path.join(os.environ["MARKS"], os.environ["RANK"]), "w").close()
time.sleep(120)
"""


@pytest.mark.parametrize(("rank_code", "expected"), [("0", 0), ("143", EXIT_DRAINED), ("none", EXIT_DRAINED)])
def test_after_a_signal_the_launcher_reports_the_ranks_own_code(tmp_path, rank_code, expected):
    """torchrun raises after a signal whatever its ranks returned: ranks that all finished (a job done while
    draining) exit 0; a rank that left no code reads as a drain, as before."""
    (tmp_path / "rank.py").write_text(RANK_SCRIPT)
    marks = tmp_path / "marks"
    marks.mkdir()
    code = "import sys; from parallel.launcher import run_torchrun; sys.exit(run_torchrun(2, 'rank.py', []))"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**_env(), "RANK_CODE": rank_code, "MARKS": str(marks)})
    try:
        deadline = time.monotonic() + 120
        while len(list(marks.iterdir())) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)  # the launcher only; torchrun passes it on
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == expected, err[-3000:]
    assert f"launcher: stopped by SIGTERM; the ranks have exited (exit {expected})" in err


def test_the_launcher_reads_the_folder_the_ranks_write(tmp_path, monkeypatch):
    from parallel import launcher

    monkeypatch.setenv(launcher.EXIT_CODE_DIR_ENV, str(tmp_path))
    for rank, code in (("0", 143), ("3", 0)):
        monkeypatch.setenv("RANK", rank)
        assert launcher.record_exit_code(code) == code
    (tmp_path / "1.tmp").write_text("2")
    assert launcher.recorded_exit_codes(str(tmp_path)) == {0: 143, 3: 0}


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("launcher")
    model = make_tiny_text_llama(root / "model", default_model_dir, seed=5)
    rows = root / "rows.jsonl"
    rows.write_text("".join(json.dumps({
        "id": i, "prompt": f"Row {i}: a few words about {i * 3}.",
        "sampling": {"max_new_tokens": 40 + (i * 11) % 60, "ignore_eos": True},
    }) + "\n" for i in range(ROWS)))
    return model, rows


def _launch(model: Path, rows: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "launch.py", "--nproc-per-node", "2", f"model.path={model}", "engine.device=cpu",
            "model.max_seq_len=512", f"job.input={rows}", f"job.output={out}", "job.progress=false",
            "job.chat_template=false", "scheduler.max_running_requests=2", *extra]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_a_signal_to_the_launcher_drains_and_exits_143_without_traceback(job, tmp_path, sig):
    """SIGTERM and Slurm's SIGUSR1 from a scheduler, SIGINT from Ctrl-C: the same drain and the same code."""
    model, rows = job
    out = tmp_path / "out.jsonl"
    cmd = _launch(model, rows, out, "parallel.tp_size=2", "job.drain_timeout_s=5")
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_rows(proc, out, 3)
        proc.send_signal(sig)  # the launcher only, as a scheduler would
        sent = time.time()
        _, err = proc.communicate(timeout=120)
        elapsed = time.time() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_DRAINED and elapsed < 60, (proc.returncode, elapsed, err[-3000:])
    assert "Traceback" not in err and "launcher: stopped by SIG" in err, err[-3000:]
    first = [json.loads(line) for line in out.read_text().splitlines()]
    assert 3 <= len(first) < ROWS
    rerun = subprocess.run(_launch(model, rows, out, "parallel.tp_size=2"), cwd=REPO, env=_env(),
                           capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == list(range(ROWS))  # every id exactly once


@pytest.mark.slow
def test_a_failing_rank_gives_its_one_line_and_code_without_traceback():
    # The default model has 9 heads: TP=2 cannot split them.
    proc = subprocess.run([sys.executable, "launch.py", "--nproc-per-node", "2", "engine.device=cpu"], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 1, log[-3000:]
    assert log.count("error on rank") == 1 and "num_attention_heads=9 is not divisible" in log, log[-3000:]
    assert "parallel.tp_size=1" in log  # the way out is named
    assert "Traceback" not in log and "launcher: ranks failed" in log, log[-3000:]


@pytest.mark.slow
def test_a_rank_that_fails_alone_says_why(tmp_path):
    """A ValueError on rank 1 only (its copy of the model, say): rank 0 does not say it for it, so rank 1 must."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    from models.config import ModelConfig\n"
        "    def broken(cls, path):\n"
        "        raise ValueError('rank 1 cannot read its copy of the model')\n"
        "    ModelConfig.from_dir = classmethod(broken)\n")
    start = time.time()
    proc = subprocess.run([sys.executable, "launch.py", "--nproc-per-node", "2", "engine.device=cpu",
                           "parallel.tp_size=1"], cwd=REPO, env={**_env(), "PYTHONPATH": f"{hook}:{REPO}"},
                          capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "error on rank 1: rank 1 cannot read its copy of the model" in log, log[-3000:]
    assert time.time() - start < 120, log[-3000:]


@pytest.mark.slow
def test_the_launcher_sets_the_ranks_threads_so_torchrun_prints_no_banner(tmp_path):
    env = {k: v for k, v in _env().items() if k not in ("OMP_NUM_THREADS", "GOMP_SPINCOUNT")}
    proc = subprocess.run([sys.executable, "launch.py", "--nproc-per-node", "2", "engine.device=cpu",
                           f"model.path={tmp_path / 'missing'}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "launcher: ranks failed" in log, log[-3000:]  # the ranks did start
    assert "OMP_NUM_THREADS" not in log, log[-3000:]


def test_cpu_threads_are_a_share_of_the_cores_unless_set():
    from launch import GOMP_SPINCOUNT, configure_cpu_threads

    cores = len(os.sched_getaffinity(0))
    for ranks in (1, 2, cores + 1):
        env: dict[str, str] = {}
        configure_cpu_threads(ranks, env)
        assert env == {"OMP_NUM_THREADS": str(max(1, cores // ranks)), "GOMP_SPINCOUNT": str(GOMP_SPINCOUNT)}
    env = {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE"}
    configure_cpu_threads(1, env)
    assert env == {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE"}  # the user's settings win
    env = {"GOMP_SPINCOUNT": "5"}
    configure_cpu_threads(1, env)
    assert env["GOMP_SPINCOUNT"] == "5"


def test_no_nanobind_leak_report_at_exit():
    """The step loop freezes the objects alive (gc.freeze), Triton's bindings among them; frozen at exit, nanobind
    reports each as leaked. Leaving the step loop, even to exit, unfreezes them."""
    pytest.importorskip("triton")
    frozen = "import gc, triton; gc.freeze()"
    control = subprocess.run([sys.executable, "-c", frozen], cwd=REPO, env=_env(), capture_output=True, text=True,
                             timeout=120)
    if "nanobind" not in control.stderr:
        pytest.skip("this Triton build reports no leaks")
    run = ("import sys, triton\nfrom runtime.frontend.llm import quiet_garbage_collector\n"
           "with quiet_garbage_collector():\n    sys.exit(0)")
    proc = subprocess.run([sys.executable, "-c", run], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "nanobind" not in proc.stderr, proc.stderr[-3000:]


def test_nproc_per_node_below_one_is_refused():
    proc = subprocess.run([sys.executable, "launch.py", "--nproc-per-node", "0"], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--nproc-per-node must be at least 1" in proc.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
@pytest.mark.parametrize("parent", ["alive", "pid 1 and alive", "gone"])
def test_a_rank_ends_with_its_agent_only_when_the_agent_is_gone(parent):
    """A rank under torchrun asks for SIGTERM when its parent (the agent) dies. Its parent may be pid 1 and alive
    (torchrun as a container's entry point): that rank must run on. One whose parent changed meanwhile (the agent
    died before the request took effect) is ended at once."""
    probe = f"""
import os
parents = {{"alive": [os.getppid()] * 2, "pid 1 and alive": [1, 1], "gone": [os.getppid(), 1]}}[{parent!r}]
os.getppid = lambda: parents.pop(0)
from parallel.distributed import end_with_the_agent
end_with_the_agent()
print("running on")
"""
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    if parent == "gone":
        assert proc.returncode == -signal.SIGTERM and "running on" not in proc.stdout
    else:
        assert proc.returncode == 0 and "running on" in proc.stdout, proc.stderr[-2000:]


def test_a_failure_of_any_type_after_the_groups_start_is_announced_to_the_other_replicas(monkeypatch):
    """Not only the errors launch.py explains (a config error, a missing file): a KeyError while loading a model,
    say, reaches the store too, so the other replicas' barriers end at once instead of after the heartbeat's
    silence (``replicas.SILENT_S``)."""
    from types import SimpleNamespace

    import launch
    from parallel import distributed
    from runtime.frontend import replicas

    told: list[BaseException] = []

    def load_fails(*args: object, **kwargs: object) -> int:
        raise KeyError("model.layers.0.mlp.gate.weight")

    monkeypatch.setattr(launch, "configure_cpu_threads", lambda local_ranks: None)
    monkeypatch.setattr(distributed, "init_distributed", lambda *a, **k: SimpleNamespace(rank=0, global_rank=0))
    monkeypatch.setattr(launch, "run_leader", load_fails)
    monkeypatch.setattr(replicas, "announce_failure", told.append)
    with pytest.raises(KeyError, match="mlp.gate.weight"):
        launch.main([])
    assert [type(exc) for exc in told] == [KeyError]
