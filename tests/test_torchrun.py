"""torchrun end to end on CPU: TP=3 job equals the single-process job; a killed rank ends every rank."""

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
from tests.tp_utils import child_with_rank

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def test_torchrun_tp3_job_writes_the_same_file(default_model_dir, tmp_path):
    rows = tmp_path / "rows.jsonl"
    prompts = ["What is the capital of France?", "Name three colors.", "Write a haiku about rain.",
               "Count from one to five.", "What is 2 + 2?", "Say hello in French."]
    rows.write_text("".join(json.dumps({"id": i, "prompt": p, "sampling": {"max_new_tokens": 16 + i}}) + "\n"
                            for i, p in enumerate(prompts)))
    common = [f"model.path={default_model_dir}", "engine.device=cpu", f"job.input={rows}"]
    single = subprocess.run([sys.executable, "launch.py", *common, f"job.output={tmp_path / 'tp1.jsonl'}"],
                            cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-2000:]
    tp3 = subprocess.run([*TORCHRUN, "--nproc-per-node", "3", "launch.py", *common,
                          f"job.output={tmp_path / 'tp3.jsonl'}"],
                         cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert tp3.returncode == 0, tp3.stderr[-2000:]
    one, three = (tmp_path / "tp1.jsonl").read_text(), (tmp_path / "tp3.jsonl").read_text()
    assert len(one.splitlines()) == len(prompts)
    assert one == three


def test_killed_rank_ends_every_rank(tmp_path):
    model_dir = make_tiny_llama(tmp_path / "model", vocab=502, heads=8, kv_heads=4, seed=5)
    rows = tmp_path / "rows.jsonl"
    lines = [{"id": 0, "prompt": [1, 2, 3], "sampling": {"max_new_tokens": 1}}]
    lines += [{"id": i, "prompt": [i, 7, 9, 11], "sampling": {"max_new_tokens": 1500, "ignore_eos": True}}
              for i in range(1, 9)]
    rows.write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(
        [*TORCHRUN, "--nproc-per-node", "2", "launch.py", f"model.path={model_dir}", "engine.device=cpu",
         "model.max_seq_len=2048", f"job.input={rows}", f"job.output={out}"],
        cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.time() + 300
        while not (out.exists() and out.read_text().strip()):  # mid-generation: the first row is done
            assert proc.poll() is None and time.time() < deadline, "the job ended before it could be interrupted"
            time.sleep(0.2)
        victim, survivor = child_with_rank(proc.pid, 1), child_with_rank(proc.pid, 0)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.time()
        output, _ = proc.communicate(timeout=60)
        elapsed = time.time() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert elapsed < 60
    assert "rank: 1" in output or "rank 1" in output, output[-3000:]
    assert len(out.read_text().splitlines()) < len(lines)  # it really was interrupted
    print(f"all ranks gone {elapsed:.1f} s after the kill")
    assert not _alive(survivor)  # rank 0 did not outlive the job


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_config_error_on_every_rank_is_printed_once_before_torchrun_reports(default_model_dir):
    """The default model has 9 heads: TP=2 cannot split them. One clear line, from rank 0, and no drain."""
    proc = subprocess.run([*TORCHRUN, "--nproc-per-node", "2", "launch.py", f"model.path={default_model_dir}",
                           "engine.device=cpu"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count("error on rank") == 1 and "error on rank 0: num_attention_heads=9 is not divisible" in out
    assert out.index("error on rank 0") < out.index("ChildFailedError")
    assert "draining" not in out and 'launch.py", line' not in out  # no traceback from our ranks
