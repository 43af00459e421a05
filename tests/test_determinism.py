"""engine.deterministic on CPU (the torch backend): a row's tokens do not depend on what else runs.

Each test serves the same rows in two or more ways that change the batch around them (alone or among others,
other max_running_requests, prefill chunk budgets, a cached prefix, data-parallel sizes, a resume) and
requires the same token ids and the same logprob floats, bit for bit. CPU BLAS, like cuBLAS, takes another
path for a few rows than for many; the default mode's outputs are not asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import LLM, SamplingParams
from tests.conftest import make_tiny_llama, make_tiny_text_llama

REPO = Path(__file__).resolve().parents[1]
BASE = ["engine.device=cpu", "model.dtype=float32", "model.max_seq_len=512", "engine.deterministic=true"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("det_model"), vocab=512, heads=4, kv_heads=2, layers=2, seed=5)


def prompts(n: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(2, 500) for _ in range(rng.randrange(5, 150))] for _ in range(n)]


def params(i: int) -> SamplingParams:
    """Greedy, seeded temperature, seeded top-k + top-p, in turn (unseeded rows are keyed by their index in a
    call, so only the job tests, where a row's id is its key, compare them across calls)."""
    kind = i % 3
    if kind == 0:
        return SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True, logprobs=0)
    if kind == 1:
        return SamplingParams(temperature=0.9, seed=100 + i, max_new_tokens=12, ignore_eos=True, logprobs=0)
    return SamplingParams(temperature=1.1, top_k=40, top_p=0.8, seed=7 * i, max_new_tokens=12, ignore_eos=True,
                          logprobs=0)


def signature(out) -> tuple:  # noqa: ANN001 - a RequestOutput
    return tuple(out.token_ids), tuple(e["logprob"] for e in out.logprobs)


@pytest.mark.slow
def test_a_row_is_the_same_alone_and_among_others(model_dir: Path):
    rows = prompts(9, seed=1)
    alone_llm = LLM(str(model_dir), overrides=[*BASE, "scheduler.max_running_requests=2"])
    alone = [signature(alone_llm.generate([p], params(i))[0]) for i, p in enumerate(rows)]
    alone_llm.shutdown()
    assert len({a[0] for a in alone}) == len(alone)  # real, different generations

    others = prompts(21, seed=2)
    mixed = others[:7] + rows[::-1] + others[7:]  # another order, among other rows of other lengths
    mixed_params = [params(i) for i in range(7)] + [params(i) for i in reversed(range(9))] + \
        [SamplingParams(temperature=0.7, max_new_tokens=20) for _ in others[7:]]
    llm = LLM(str(model_dir), overrides=[*BASE, "scheduler.max_running_requests=16", "scheduler.max_prefill_tokens=96"])
    outs = llm.generate(mixed, mixed_params)
    llm.shutdown()
    together = [signature(o) for o in outs[7:16]][::-1]
    assert together == alone


@pytest.mark.slow
def test_chunked_prefill_and_a_cached_prefix_give_the_same_tokens(model_dir: Path):
    prompt = prompts(1, seed=3)[0] + prompts(1, seed=4)[0] + prompts(1, seed=5)[0]
    assert len(prompt) > 100
    results = []
    for budget in (16, 64, 4096):  # chunks of 16 and 64 tokens, and the whole prompt in one step
        llm = LLM(str(model_dir), overrides=[*BASE, f"scheduler.max_prefill_tokens={budget}", "cache.type=naive"])
        results.append([signature(o) for o in llm.generate([prompt, prompt], [params(0), params(1)])])
        llm.shutdown()
    assert results[0] == results[1] == results[2]
    # The radix cache: the first request leaves its prompt's KV; the second matches a prefix of it.
    llm = LLM(str(model_dir), overrides=[*BASE, "cache.type=radix"])
    llm.generate([prompt[:90] + [3, 4, 5]], params(0))
    cached = [signature(o) for o in llm.generate([prompt, prompt], [params(0), params(1)])]
    assert llm.last_stats["cached_tokens"] > 0
    llm.shutdown()
    assert cached == results[0]


# ---------------------------------------------------------------------------------------------------------
# Jobs: data-parallel sizes and a resume write the same text for every row (unseeded rows included)
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def text_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    path = make_tiny_text_llama(tmp_path_factory.mktemp("det_text_model"), default_model_dir, seed=6)
    return path


def job_rows(path: Path, n: int) -> Path:
    samplings = [{"temperature": 0}, {"temperature": 1.0}, {"temperature": 0.8, "top_p": 0.9},
                 {"temperature": 0.7, "seed": 11}, {"temperature": 1.0, "top_k": 20}]
    path.write_text("".join(json.dumps({
        "id": f"r{i}", "prompt": f"Row {i}: tell me about the number {i * 37}, " + "and more " * (i % 7),
        "sampling": {**samplings[i % len(samplings)], "max_new_tokens": 6 + (i * 5) % 17, "ignore_eos": True},
    }) + "\n" for i in range(n)))
    return path


def run_job(model: Path, rows: Path, out: Path, nproc: int, *extra: str, tp_size: int = 1) -> dict[str, str]:
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                   "--nproc-per-node", str(nproc)]
    cmd = [*launcher, "launch.py", f"model.path={model}", *BASE, f"job.input={rows}", f"job.output={out}",
           "job.progress=false", "job.chat_template=false", f"parallel.tp_size={tp_size}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    texts = {r["id"]: r["text"] for r in lines}
    assert len(texts) == len(lines), "an id was written twice"
    return texts


@pytest.mark.slow
def test_a_job_writes_the_same_text_at_every_dp_size_and_after_a_resume(text_model_dir: Path, tmp_path: Path):
    rows = job_rows(tmp_path / "rows.jsonl", 24)
    one = run_job(text_model_dir, rows, tmp_path / "dp1.jsonl", 1, "scheduler.max_running_requests=8")
    assert len(one) == 24 and len(set(one.values())) > 20  # real, varied text
    for dp in (2, 3):
        assert run_job(text_model_dir, rows, tmp_path / f"dp{dp}.jsonl", dp, "scheduler.max_running_requests=3") == one
    # A resume: the first run served only some rows (in other batches), the rerun serves the rest.
    partial = tmp_path / "partial.jsonl"
    partial.write_text("".join(line + "\n" for line in rows.read_text().splitlines()[::3]))
    out = tmp_path / "resumed.jsonl"
    run_job(text_model_dir, partial, out, 1, "scheduler.max_running_requests=5")
    assert run_job(text_model_dir, rows, out, 1, "scheduler.max_running_requests=16") == one


@pytest.mark.slow
def test_tensor_parallel_rows_do_not_depend_on_the_batch(text_model_dir: Path, tmp_path: Path):
    """TP=2 over gloo: the row-parallel sums go through the ordered all-reduce, so a row's text is the same
    with 2 or 12 rows running at once."""
    rows = job_rows(tmp_path / "rows.jsonl", 12)
    narrow = run_job(text_model_dir, rows, tmp_path / "narrow.jsonl", 2, "scheduler.max_running_requests=2", tp_size=2)
    assert len(narrow) == 12 and len(set(narrow.values())) > 9
    wide = run_job(text_model_dir, rows, tmp_path / "wide.jsonl", 2, "scheduler.max_running_requests=12", tp_size=2)
    assert wide == narrow
