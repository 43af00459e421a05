"""engine.deterministic on the GPU: a row's tokens are the same bits alone or among 255 others, whatever the
prefill chunking, and after a job is killed with SIGKILL and resumed (random weights of the Llama-3.2-1B
shape, drawn on the device: no checkpoint to write)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.config import load_config
from tests.helpers import wait_for_rows

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[1]
MODEL = ["model.path=configs/models/llama-3.2-1b", "model.random_weights=true", "engine.device=cuda",
         "model.max_seq_len=1280"]


def prompts(n: int, seed: int, low: int = 100, high: int = 1024) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 10000, int(rng.integers(low, high + 1))).tolist() for _ in range(n)]


def target(i: int, new: int = 200) -> SamplingParams:
    """Greedy and seeded rows in turn (unseeded rows are keyed by their index in a call)."""
    if i % 2 == 0:
        return SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
    return SamplingParams(temperature=0.7, seed=i, max_new_tokens=new, ignore_eos=True)


def alone_and_among_others(deterministic: bool) -> tuple[list[list[int]], list[list[int]]]:
    cfg = load_config(overrides=[*MODEL, f"engine.deterministic={str(deterministic).lower()}", "cache.memory_ratio=0.5"])
    llm = LLM(config=cfg)
    rows = prompts(16, seed=1)
    alone = [llm.generate([p], target(i))[0].token_ids for i, p in enumerate(rows)]
    others = prompts(240, seed=2)
    rng = np.random.default_rng(3)
    spots = sorted(rng.choice(256, 16, replace=False).tolist())
    batch, params, other = [], [], iter(others)
    for slot in range(256):
        if slot in spots:
            i = spots.index(slot)
            batch.append(rows[i])
            params.append(target(i))
        else:
            batch.append(next(other))
            params.append(SamplingParams(temperature=0.8, max_new_tokens=int(rng.integers(50, 300)), ignore_eos=True))
    outs = llm.generate(batch, params)
    llm.shutdown()
    del llm
    torch.cuda.empty_cache()
    return alone, [outs[s].token_ids for s in spots]


def test_rows_are_the_same_alone_and_among_255_others():
    alone, together = alone_and_among_others(deterministic=True)
    assert all(len(t) == 200 for t in alone)
    same = sum(a == t for a, t in zip(alone, together))
    assert same == 16, f"deterministic: {same}/16 rows identical"
    default_alone, default_together = alone_and_among_others(deterministic=False)
    default_same = sum(a == t for a, t in zip(default_alone, default_together))
    first = [next((j for j, (x, y) in enumerate(zip(a, t)) if x != y), None)
             for a, t in zip(default_alone, default_together)]
    print(f"\nREPORT default mode: {default_same}/16 rows identical alone and among 255 others "
          f"(greedy {sum(a == t for a, t in list(zip(default_alone, default_together))[::2])}/8); "
          f"first differing position per row: {first}")


def test_chunked_prefill_gives_the_same_tokens():
    prompt = prompts(1, seed=4, low=1000, high=1000)[0]
    results = []
    for budget in (64, 256, 4096):
        cfg = load_config(overrides=[*MODEL, "engine.deterministic=true", f"scheduler.max_prefill_tokens={budget}",
                                     "scheduler.max_running_requests=8", "engine.cuda_graph_max_bs=8",
                                     "cache.type=naive", "cache.memory_ratio=0.3"])
        llm = LLM(config=cfg)
        outs = llm.generate([prompt, prompt], [target(0, 64), target(1, 64)])
        results.append([o.token_ids for o in outs])
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()
    assert results[0] == results[1] == results[2]


def _job(rows: Path, out: Path) -> list[str]:
    return [sys.executable, "launch.py", *MODEL, "engine.deterministic=true", f"job.input={rows}",
            f"job.output={out}", "job.progress=false", "cache.memory_ratio=0.5", "scheduler.max_running_requests=64"]


def _tokens_by_id(out: Path) -> dict:
    """Each row's generated token ids (from its logprob entries) and finish reason."""
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by_id = {r["id"]: ([e["token_id"] for e in r["logprobs"]], r["finish_reason"]) for r in rows}
    assert len(by_id) == len(rows), "an id was written twice"
    return by_id


def test_a_job_killed_and_resumed_writes_the_same_rows(tmp_path: Path):
    rows = tmp_path / "rows.jsonl"
    samplings = [{"temperature": 0}, {"temperature": 1.0}, {"temperature": 0.7, "seed": 5},
                 {"temperature": 0.9, "top_p": 0.9}]
    rows.write_text("".join(json.dumps({
        "id": i, "prompt": p, "sampling": {**samplings[i % 4], "max_new_tokens": 40 + (i * 37) % 300,
                                           "ignore_eos": True, "logprobs": 0}}) + "\n"
        for i, p in enumerate(prompts(160, seed=5, low=50, high=600))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    whole = tmp_path / "whole.jsonl"
    done = subprocess.run(_job(rows, whole), cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = tmp_path / "resumed.jsonl"
    proc = subprocess.Popen(_job(rows, resumed), cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_for_rows(proc, resumed, 80)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    killed_at = len(resumed.read_text().splitlines())
    assert killed_at < 160
    start = time.time()
    again = subprocess.run(_job(rows, resumed), cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    print(f"\nREPORT killed after {killed_at} rows, resumed in {time.time() - start:.0f} s")
    reference = _tokens_by_id(whole)
    assert len(reference) == 160 and all(len(tokens) >= 40 for tokens, _ in reference.values())
    assert _tokens_by_id(resumed) == reference
