"""Tensor parallelism on two or more GPUs (NCCL and the custom all-reduce), run under torchrun.

Numerics: one random checkpoint saved once and loaded at TP=1 and TP=2, so both are the
same model. Lifecycle: a TP=2 job exits by itself, drains on SIGTERM, and ends every rank
when one is killed; reruns resume with one row per id.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from scripts.make_random_checkpoint import write_random_checkpoint
from tests.helpers import relative_error
from tests.test_torchrun import _alive
from tests.tp_utils import child_with_rank

pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
SMALL = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1024,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
}


# When the whole GPU suite runs in one pytest process, the in-process tests hold memory on GPU 0 only;
# that imbalance is the harness's, not another job's, so the TP jobs here accept it.
IMBALANCE_OK = "parallel.memory_imbalance_bytes=68719476736"


def torchrun(nproc: int, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([*TORCHRUN, "--nproc-per-node", str(nproc), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def llama_1b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = write_random_checkpoint(REPO / "configs" / "models" / "llama-3.2-1b", tmp_path_factory.mktemp("llama1b"))
    torch.cuda.empty_cache()
    return out


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config_dir = tmp_path_factory.mktemp("small_config")
    (config_dir / "config.json").write_text(json.dumps(SMALL))
    return write_random_checkpoint(config_dir, tmp_path_factory.mktemp("small"))


def _probe(model: Path, out: Path, nproc: int, *overrides: str) -> list[dict]:
    proc = torchrun(nproc, "tests/gpu_tp_probe.py", str(model), str(out), IMBALANCE_OK, *overrides)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nproc)]


def _hf_float32_logits(model_dir: Path, seqs: list[list[int]], dtype: torch.dtype) -> list[torch.Tensor]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=dtype).cuda().eval()
    with torch.no_grad():
        out = [model(torch.tensor([s], device="cuda")).logits[0].float().cpu() for s in seqs]
    del model
    torch.cuda.empty_cache()
    return out


def _greedy_agreement(ref: list[torch.Tensor], prompts: list[list[int]], outputs: list[list[int]]) -> tuple[float, float]:
    """(share of tokens equal to the reference argmax, largest gap below it relative to the row's max |logit|)."""
    agree = total = 0
    worst = 0.0
    for lg, p, o in zip(ref, prompts, outputs):
        steps = lg[len(p) - 1 : len(p) - 1 + len(o)]
        chosen = steps.gather(1, torch.tensor(o)[:, None])[:, 0]
        gap = (steps.max(dim=1).values - chosen) / steps.abs().max(dim=1).values
        worst = max(worst, float(gap.max()))
        agree += int((gap == 0).sum())
        total += len(o)
    return agree / total, worst


def test_custom_all_reduce_path_equals_nccl_on_one_gpu(llama_1b, tmp_path):
    """At world size 1 a forced symmetric-memory all-reduce is a copy: every logit and token must be the
    same bits as the NCCL path, through prefill, chunked prefill, graph-captured decode and generation."""
    nccl = _probe(llama_1b, tmp_path / "nccl", 1, "parallel.all_reduce=nccl")[0]
    symm = _probe(llama_1b, tmp_path / "symm", 1, "parallel.all_reduce=symm_mem")[0]
    for mode in ("prefill", "chunked", "graph_decode"):
        for a, b in zip(nccl[mode], symm[mode]):
            assert torch.equal(a, b), mode
    assert nccl["outputs"] == symm["outputs"] and nccl["steps"] == symm["steps"]


@two_gpus
def test_tp2_matches_tp1_and_hf_with_graphs_and_overlap(llama_1b, tmp_path):
    tp1 = _probe(llama_1b, tmp_path / "tp1", 1)
    tp2 = _probe(llama_1b, tmp_path / "tp2", 2)
    one, two = tp1[0], tp2[0]
    # Logits: TP=2 equals TP=1 within what bf16 allows (HF's own bf16 error against float32 sets the budget).
    prompts = one["logit_prompts"]
    ref32 = _hf_float32_logits(llama_1b, prompts, torch.float32)
    hf16 = _hf_float32_logits(llama_1b, prompts, torch.bfloat16)
    for i, ref in enumerate(ref32):
        keep = one["prefill"][i].shape[0]  # the last positions the probe kept (fewer for a short prompt)
        ref = ref[-keep:]
        budget = 2 * relative_error(hf16[i][-keep:], ref) + 2e-3
        for mode in ("prefill", "chunked", "graph_decode"):
            e1, e2 = relative_error(one[mode][i], ref), relative_error(two[mode][i], ref)
            cross = relative_error(two[mode][i], one[mode][i])
            print(f"prompt {i} {mode}: tp1 {e1:.2e}, tp2 {e2:.2e}, tp2 vs tp1 {cross:.2e}, budget {budget:.2e}")
            assert e1 <= budget and e2 <= budget and cross <= budget, (i, mode)
    # Every rank sampled the same tokens at every step (greedy, seeded and unseeded rows in one batch).
    assert tp2[1]["steps"] == two["steps"] and len(two["steps"]) > 40
    # Greedy generation agrees with HF float32 (teacher-forced) as well at TP=2 as at TP=1.
    n_greedy = 8
    seqs = [p + o for p, o in zip(two["prompts"][:n_greedy], two["outputs"][:n_greedy])]
    seqs += [p + o for p, o in zip(one["prompts"][:n_greedy], one["outputs"][:n_greedy])]
    ref = _hf_float32_logits(llama_1b, seqs, torch.float32)
    agree2, gap2 = _greedy_agreement(ref[:n_greedy], two["prompts"][:n_greedy], two["outputs"][:n_greedy])
    agree1, gap1 = _greedy_agreement(ref[n_greedy:], one["prompts"][:n_greedy], one["outputs"][:n_greedy])
    print(f"greedy vs HF float32: tp1 {agree1:.3f} exact (worst gap {gap1:.3f}), tp2 {agree2:.3f} ({gap2:.3f})")
    assert gap2 <= 0.03 and gap1 <= 0.03  # only near-ties may flip
    # Random weights of a 1B model are flat: near-ties are common, so only TP=1 sets the bar (measured 0.94).
    assert agree2 >= agree1 - 0.03 and agree2 >= 0.85
    assert all(len(o) == 32 for o in two["outputs"][8:])


def _job_rows(path: Path, n: int, base_tokens: int, step: int) -> list[dict]:
    rows = [{"id": i, "prompt": [(i * 37 + j) % 30000 + 1 for j in range(20 + i)],
             "sampling": {"max_new_tokens": base_tokens + step * i, "ignore_eos": True, "temperature": 0.7, "seed": i}}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _ids(out: Path) -> list[int]:
    return sorted(json.loads(line)["id"] for line in out.read_text().splitlines())


def _job_args(model: Path, rows: Path, out: Path, *extra: str) -> list[str]:
    return ["launch.py", f"model.path={model}", "engine.device=cuda", "model.max_seq_len=4096",
            "scheduler.max_running_requests=64", "engine.cuda_graph_max_bs=64", "cache.num_pages=8192",
            f"job.input={rows}", f"job.output={out}", "job.progress=false", IMBALANCE_OK, *extra]


@two_gpus
def test_tp2_job_exits_by_itself(small_model, tmp_path):
    rows, out = tmp_path / "rows.jsonl", tmp_path / "out.jsonl"
    _job_rows(rows, 32, 16, 4)
    start = time.time()
    proc = torchrun(2, *_job_args(small_model, rows, out), timeout=300)
    ended = time.time()
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert _ids(out) == list(range(32))
    after_last_row = ended - out.stat().st_mtime
    print(f"job took {ended - start:.1f} s; exited {after_last_row:.1f} s after its last row")
    assert after_last_row < 20, proc.stderr[-3000:]
    assert "SIGKILL" not in proc.stderr and "closing signal" not in proc.stderr


def _start_job(model: Path, rows: Path, out: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([*TORCHRUN, "--nproc-per-node", "2", *_job_args(model, rows, out, *extra)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_first_row(proc: subprocess.Popen, out: Path) -> None:
    deadline = time.time() + 240
    while not (out.exists() and out.read_text().strip()):
        assert proc.poll() is None and time.time() < deadline, "the job ended before it could be interrupted"
        time.sleep(0.1)


@two_gpus
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_tp2_drains_on_signal_and_resumes(small_model, tmp_path, sig):
    rows, out = tmp_path / "rows.jsonl", tmp_path / "out.jsonl"
    _job_rows(rows, 24, 8, 160)
    proc = _start_job(small_model, rows, out, "job.drain_timeout_s=2")
    try:
        _wait_first_row(proc, out)
        ranks = [child_with_rank(proc.pid, r) for r in (0, 1)]
        assert None not in ranks
        for pid in ranks:  # as Slurm signals every process of the step
            os.kill(pid, sig)
        sent = time.time()
        output, _ = proc.communicate(timeout=90)
        elapsed = time.time() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"drained and exited {elapsed:.1f} s after the signal")
    assert elapsed < 30 and not any(_alive(p) for p in ranks)
    assert "exitcode  : 143" in output or "exitcode: 143" in output, output[-3000:]
    assert "SIGKILL" not in output
    done = _ids(out)
    assert 0 < len(done) < 24 and len(done) == len(set(done))
    rerun = torchrun(2, *_job_args(small_model, rows, out), timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert _ids(out) == list(range(24))


@two_gpus
def test_tp2_killed_rank_ends_every_rank_and_rerun_resumes(small_model, tmp_path):
    rows, out = tmp_path / "rows.jsonl", tmp_path / "out.jsonl"
    _job_rows(rows, 24, 8, 160)
    proc = _start_job(small_model, rows, out)
    try:
        _wait_first_row(proc, out)
        victim, survivor = child_with_rank(proc.pid, 1), child_with_rank(proc.pid, 0)
        assert victim is not None and survivor is not None
        os.kill(victim, signal.SIGKILL)
        killed_at = time.time()
        output, _ = proc.communicate(timeout=90)
        elapsed = time.time() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"all ranks gone {elapsed:.1f} s after the kill")
    assert proc.returncode != 0 and elapsed < 60 and not _alive(survivor)
    done = _ids(out)
    assert len(done) < 24 and len(done) == len(set(done))
    rerun = torchrun(2, *_job_args(small_model, rows, out), timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert _ids(out) == list(range(24))
