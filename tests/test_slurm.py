"""Slurm launch helpers on CPU, without Slurm: node-list expansion, the torchrun command, the sbatch scripts."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from parallel.launcher import EXIT_CODE_DIR_ENV, recorded_exit_codes

REPO = Path(__file__).resolve().parents[1]
SLURM_DIR = REPO / "scripts" / "slurm"
SCRIPT = SLURM_DIR / "torchrun_cmd.py"
BASH = shutil.which("bash")


def _load() -> ModuleType:
    # Loaded by path: scripts/slurm is a directory of scripts, not an installed package.
    spec = importlib.util.spec_from_file_location("torchrun_cmd", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tc = _load()
FAKE_2_NODES = {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "42",
                "SLURM_GPUS_ON_NODE": "8", "SLURM_NODEID": "0"}


def _clean_env(tmp_path: Path, **slurm: str) -> dict[str, str]:
    """No inherited SLURM_* and a PATH with nothing on it, so no real scontrol or srun can answer."""
    empty = tmp_path / "empty_bin"
    empty.mkdir(exist_ok=True)
    return {"PATH": str(empty), "LC_ALL": "C", **slurm}


@pytest.mark.parametrize(("nodelist", "hosts"), [
    ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
    ("node[008-011]", ["node008", "node009", "node010", "node011"]),  # padding kept across the carry
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),  # no leading zero, no padding
    ("a[1,3,5]", ["a1", "a3", "a5"]),
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
    ("login1,login2", ["login1", "login2"]),
    ("gpu07", ["gpu07"]),
    ("gpu[07]", ["gpu07"]),
    ("x[1-2]y", ["x1y", "x2y"]),
    ("a[1-2],b,c[09-10]", ["a1", "a2", "b", "c09", "c10"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert tc.expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["", "gpu[01-03", "gpu01]", "gpu[[1]]", "gpu[3-1]", "gpu[a-b]", "gpu[]", "a,,b"])
def test_expand_nodelist_rejects_malformed(bad):
    with pytest.raises(ValueError):
        tc.expand_nodelist(bad)


def test_build_command_two_nodes():
    passthrough = ["launch.py", "--config", "configs/default.yaml", "job.output=out dir/o.jsonl"]
    cmd = tc.build_command(FAKE_2_NODES, None, 29500, passthrough, hostnames=tc.expand_nodelist)
    assert cmd == ["torchrun", "--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d",
                   "--rdzv-endpoint=gpu07:29500", "--rdzv-id=42", "--max-restarts=0", *passthrough]


def test_build_command_nproc_sources():
    env = {"SLURM_NNODES": "1", "SLURM_NODELIST": "cpu5", "SLURM_JOB_ID": "9"}
    def build(e: dict[str, str], n: int | None = None) -> list[str]:
        return tc.build_command(e, n, 1234, ["launch.py"], hostnames=tc.expand_nodelist)

    assert "--nproc-per-node=1" in build(env)
    assert "--nproc-per-node=4" in build({**env, "SLURM_NTASKS_PER_NODE": "4"})
    assert "--nproc-per-node=2" in build({**env, "SLURM_NTASKS_PER_NODE": "4", "SLURM_GPUS_ON_NODE": "2"})
    assert "--nproc-per-node=3" in build({**env, "SLURM_GPUS_ON_NODE": "2"}, 3)
    assert build(env)[:5] == ["torchrun", "--nnodes=1", "--nproc-per-node=1", "--rdzv-backend=c10d",
                              "--rdzv-endpoint=cpu5:1234"]


@pytest.mark.parametrize(("change", "named"), [
    ({"SLURM_JOB_NODELIST": None}, "SLURM_JOB_NODELIST"),
    ({"SLURM_JOB_NUM_NODES": None}, "SLURM_JOB_NUM_NODES"),
    ({"SLURM_JOB_ID": None}, "SLURM_JOB_ID"),
    ({"SLURM_JOB_NUM_NODES": "two"}, "SLURM_JOB_NUM_NODES"),
    ({"SLURM_JOB_NUM_NODES": "3"}, "SLURM_JOB_NUM_NODES"),  # disagrees with the list's 2 hosts
    ({"SLURM_GPUS_ON_NODE": "0"}, "SLURM_GPUS_ON_NODE"),
    ({"SLURM_JOB_NODELIST": "gpu[07-"}, "SLURM_JOB_NODELIST"),
])
def test_build_command_names_the_bad_variable(change, named):
    env = {k: v for k, v in {**FAKE_2_NODES, **change}.items() if v is not None}
    with pytest.raises(tc.SlurmEnvError, match=named):
        tc.build_command(env, None, 29500, ["launch.py"], hostnames=tc.expand_nodelist)


def _cli(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=_clean_env(tmp_path, **env),
                          capture_output=True, text=True, timeout=60)


def test_cli_dry_run_prints_the_command(tmp_path):
    out = _cli(tmp_path, FAKE_2_NODES, "--dry-run", "--", "launch.py", "--config", "configs/default.yaml",
               "cache.page_size=1")
    assert out.returncode == 0, out.stderr
    assert out.stdout == ("torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=gpu07:29500 "
                          "--rdzv-id=42 --max-restarts=0 launch.py --config configs/default.yaml cache.page_size=1\n")


def test_cli_quotes_passthrough_and_takes_options(tmp_path):
    out = _cli(tmp_path, FAKE_2_NODES, "--dry-run", "--nproc-per-node", "2", "--rdzv-port", "6000", "--",
               "launch.py", "job.output=my out.jsonl")
    assert out.returncode == 0, out.stderr
    assert out.stdout.endswith("--nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=gpu07:6000 --rdzv-id=42 "
                               "--max-restarts=0 launch.py 'job.output=my out.jsonl'\n")


@pytest.mark.parametrize("tp,layout", [("8", "DP 2 x TP 8 (each TP group inside one node)"),
                                       ("1", "DP 16 x TP 1 (each TP group inside one node)"),
                                       ("16", "DP 1 x TP 16 (WARNING: TP groups span nodes")])
def test_cli_tp_size_shows_the_dp_x_tp_layout(tmp_path, tp, layout):
    out = _cli(tmp_path, FAKE_2_NODES, "--dry-run", "--tp-size", tp, "--", "launch.py")
    assert out.returncode == 0, out.stderr
    assert out.stdout.endswith(f"--max-restarts=0 launch.py parallel.tp_size={tp}\n")
    assert f"2 nodes x 8 ranks = 16 ranks: {layout}" in out.stderr


def test_cli_tp_size_that_does_not_divide_the_world_exits_2(tmp_path):
    out = _cli(tmp_path, FAKE_2_NODES, "--dry-run", "--tp-size", "3", "--", "launch.py")
    assert out.returncode == 2 and out.stdout == ""
    assert "--tp-size 3 does not divide the world of 2 nodes x 8 ranks = 16" in out.stderr


def test_cli_missing_nodelist_exits_2(tmp_path):
    env = {k: v for k, v in FAKE_2_NODES.items() if k != "SLURM_JOB_NODELIST"}
    out = _cli(tmp_path, env, "--dry-run", "--", "launch.py")
    assert out.returncode == 2
    assert "SLURM_JOB_NODELIST" in out.stderr
    assert out.stdout == ""


@pytest.mark.parametrize("args", [["--dry-run", "launch.py"], ["--dry-run", "--"], ["--rdzv-port", "0", "--", "x"]])
def test_cli_usage_errors_exit_2(tmp_path, args):
    assert _cli(tmp_path, FAKE_2_NODES, *args).returncode == 2


@pytest.mark.skipif(BASH is None, reason="needs bash")
@pytest.mark.parametrize("name", ["single_node.sbatch", "multi_node.sbatch"])
def test_sbatch_syntax(name):
    out = subprocess.run([BASH, "-n", str(SLURM_DIR / name)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


@pytest.mark.skipif(BASH is None, reason="needs bash")
@pytest.mark.parametrize(("name", "env", "expected"), [
    ("single_node.sbatch", {"SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "gpu01"},
     "torchrun --nnodes=1 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=gpu01:20007 --rdzv-id=7 "
     "--max-restarts=0 launch.py --config configs/default.yaml cache.page_size=1 'job.stop=[a]'\n"),
    ("multi_node.sbatch", {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]"},
     "torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=gpu07:20007 --rdzv-id=7 "
     "--max-restarts=0 launch.py --config configs/default.yaml cache.page_size=1 'job.stop=[a]'\n"),
    ("multi_node.sbatch", {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]", "NPROC_PER_NODE": "2"},
     "torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=gpu07:20007 --rdzv-id=7 "
     "--max-restarts=0 launch.py --config configs/default.yaml cache.page_size=1 'job.stop=[a]'\n"),
])
def test_sbatch_dry_run(tmp_path, name, env, expected):
    # The script cd's to the submit dir: make one that reaches the real scripts and also holds a
    # file the glob job.stop=[a] would match, so the override must survive unexpanded.
    submit = tmp_path / "submit"
    submit.mkdir()
    (submit / "scripts").symlink_to(REPO / "scripts")
    (submit / "job.stop=a").touch()
    fake = _clean_env(tmp_path, **env, SLURM_JOB_ID="7", SLURM_GPUS_ON_NODE="8", SLURM_SUBMIT_DIR=str(submit),
                      DRY_RUN="1", PYTHON=sys.executable, OVERRIDES="cache.page_size=1 job.stop=[a]")
    out = subprocess.run([BASH, str(SLURM_DIR / name)], cwd=tmp_path, env=fake, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected


STUBS = {
    # srun: run the task in the background in a process group of its own (set -m) for scancel, report its exit code.
    "srun": '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nset -m\n"$@" & echo $! > "$STUBS/step.pid"\n'
            'wait $!; rc=$?; echo "srun rc=$rc" >> "$STUBS/log"; exit $rc\n',
    # torchrun and its --nproc-per-node ranks, which finish by themselves after $WORK_S. As the real torchrun: on
    # SIGTERM the ranks drain, leave their codes (launch.py's record_exit_code: rank 0 $RANK_CODE, default 143 =
    # rows left; "none": killed, no code; the others 0), and torchrun exits 1 whatever they returned.
    "torchrun": '#!/bin/bash\necho "torchrun $*" >> "$STUBS/log"\n'
                'n=1; for a; do if [[ $a == --nproc-per-node=* ]]; then n=${a#*=}; fi; done\n'
                'ranks_exit() { for ((r = 0; r < n; r++)); do c=$1; (( r > 0 )) && c=0; [[ $c == none ]] && continue\n'
                '  RANK=$r "$PYTHON" -c "from parallel.launcher import record_exit_code as r; r($c)"; done; }\n'
                'sleep "${WORK_S:-30}" & SLEEP=$!\n'
                'trap \'kill $SLEEP; echo drained >> "$STUBS/log"; ranks_exit "${RANK_CODE:-143}"; exit 1\' TERM\n'
                'touch "$STUBS/started"\nwait $SLEEP\nranks_exit 0\nexit 0\n',
    # scancel --signal: as Slurm, to every process of the step (torchrun_cmd.py, torchrun, the ranks).
    "scancel": '#!/bin/bash\necho "scancel $*" >> "$STUBS/log"\nkill -TERM -- -"$(cat "$STUBS/step.pid")"\n',
    "scontrol": '#!/bin/bash\necho "scontrol $*" >> "$STUBS/log"\n'
                'if [[ "$1 $2" == "show hostnames" ]]; then echo "$3"; fi\n'
                'if [[ "$1 $2" == "show job" ]]; then echo "JobId=$3 JobState=${FAKE_STATE:-RUNNING}"; fi\n',
}


# Per template: the variables it needs besides the allocation's, and the name its Slurm commands give the job.
TEMPLATES = {
    "single_node.sbatch": ({}, "7"),
    "multi_node.sbatch": ({}, "7"),
    # The task that runs under the array's own id: its commands must name it 7_3, not 7 (every task).
    "sweep.sbatch": ({"SWEEP": "s.yaml", "SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "3"}, "7_3"),
}


def _run_job(tmp_path: Path, *, signal_after_start: bool, template: str = "single_node.sbatch",
             **extra: str) -> tuple[int, str]:
    """A template under bash with stub Slurm commands and torchrun; optionally USR1 once the 'ranks' run."""
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    for name, text in STUBS.items():
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "STUBS": str(stubs), "PYTHON": sys.executable,
           "SLURM_SUBMIT_DIR": str(REPO), "SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1",
           "SLURM_JOB_NODELIST": "gpu01", "SLURM_GPUS_ON_NODE": "2", **TEMPLATES[template][0], **extra}
    proc = subprocess.Popen([BASH, str(SLURM_DIR / template)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        if signal_after_start:
            deadline = time.monotonic() + 30
            while not (stubs / "started").exists():
                assert time.monotonic() < deadline and proc.poll() is None, "the stub rank never started"
                time.sleep(0.05)
            os.kill(proc.pid, signal.SIGUSR1)
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, (stubs / "log").read_text()


@pytest.mark.skipif(BASH is None, reason="needs bash")
@pytest.mark.parametrize("template", list(TEMPLATES))
def test_sbatch_usr1_drains_then_requeues(tmp_path, template):
    job = TEMPLATES[template][1]
    rc, log = _run_job(tmp_path, signal_after_start=True, template=template)
    assert "torchrun --nnodes=1 --nproc-per-node=2" in log
    # TERM reaches the rank through scancel (not srun, which would SIGKILL), the rank drains, then requeue.
    assert log.index(f"scancel --signal=TERM {job}") < log.index("drained") < log.index(f"scontrol requeue {job}")
    assert rc == 143  # the ranks' code ("requeue me"), not torchrun's 1


@pytest.mark.skipif(BASH is None, reason="needs bash")
@pytest.mark.parametrize("template", list(TEMPLATES))
def test_sbatch_usr1_after_the_last_rows_does_not_requeue(tmp_path, template):
    """Every rank exits 0 (the drain finished the last rows) though torchrun, signalled too, exits 1: done."""
    rc, log = _run_job(tmp_path, signal_after_start=True, template=template, RANK_CODE="0")
    assert log.index("scancel --signal=TERM") < log.index("drained")
    assert "srun rc=0" in log and "requeue" not in log.replace("show job", "")
    assert rc == 0


@pytest.mark.skipif(BASH is None, reason="needs bash")
def test_sbatch_usr1_requeues_when_a_rank_left_no_code(tmp_path):
    """A rank killed while draining says nothing about the rows: torchrun's failure stands, and the job requeues."""
    rc, log = _run_job(tmp_path, signal_after_start=True, RANK_CODE="none")
    assert log.index("drained") < log.index("scontrol requeue 7")
    assert rc == 1


@pytest.mark.skipif(BASH is None, reason="needs bash")
def test_sbatch_no_requeue_when_cancelled_or_done(tmp_path):
    (tmp_path / "cancelled").mkdir()
    (tmp_path / "done").mkdir()
    rc, log = _run_job(tmp_path / "cancelled", signal_after_start=True, FAKE_STATE="CANCELLED")
    assert "drained" in log and "requeue" not in log.replace("show job", "")
    rc, log = _run_job(tmp_path / "done", signal_after_start=False, WORK_S="0")
    assert rc == 0 and "scancel" not in log and "requeue" not in log


@pytest.mark.parametrize(("torchrun", "ranks", "expected"), [
    (1, {0: 0, 1: 0}, 0),  # a signal after the last rows: torchrun's 1 is not a failure
    (1, {0: 143, 1: 0}, 143),  # rows left (TP workers exit 0 behind their leader)
    (1, {0: 143, 1: 143, 2: 0, 3: 0}, 143),  # every replica drained
    (1, {0: 143}, 1),  # rank 1 left no code (killed, crashed): torchrun's code
    (1, {0: 143, 1: 2}, 1),  # a real failure: torchrun's code
    (0, {}, 0),
    (137, {0: 0, 1: 0}, 0),  # torchrun killed after its ranks finished
])
def test_node_exit_code(torchrun, ranks, expected):
    nproc = 4 if len(ranks) == 4 else 2
    assert tc.node_exit_code(torchrun, ranks, nproc) == expected


def test_ranks_leave_their_exit_codes_for_the_launcher(tmp_path):
    """launch.py's ranks under a launcher that asks (torchrun_cmd.py sets the folder, torchrun RANK)."""
    folder = tmp_path / "codes"
    folder.mkdir()
    base = {**os.environ, "PYTHONPATH": str(REPO), EXIT_CODE_DIR_ENV: str(folder)}
    for rank, args in (("0", ["--print-config"]), ("1", ["no.such.key=1"])):
        out = subprocess.run([sys.executable, "launch.py", *args], cwd=REPO, env={**base, "RANK": rank},
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == (0 if rank == "0" else 2), out.stderr
    (folder / "2.tmp").write_text("14")  # a rank killed while writing: no code
    assert recorded_exit_codes(str(folder)) == {0: 0, 1: 2}
    out = subprocess.run([sys.executable, "launch.py", "--print-config"], cwd=REPO,
                         env={**base, "RANK": "5", EXIT_CODE_DIR_ENV: ""}, capture_output=True, timeout=120)
    assert out.returncode == 0 and sorted(p.name for p in folder.iterdir()) == ["0", "1", "2.tmp"]
