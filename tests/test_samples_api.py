"""n samples and logprobs through the API and JSONL jobs (CPU, float32, tiny random Llama).

The numbers themselves are checked against HF in tests/test_logprobs.py; here: what reaches the
caller, the shared prefill, seeds, config defaults, and the JSONL row format and resume.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from runtime import LLM, SamplingParams
from runtime.frontend.job import run_job

BASE = ["engine.device=cpu", "model.dtype=float32", "model.max_seq_len=256", "cache.page_size=4",
        "job.progress=false"]
PROMPT = list(range(5, 45))  # 40 tokens: 10 whole pages that samples 1..n-1 may share


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), overrides=BASE)


def test_n_samples_share_one_prefill_and_keep_sample_0_in_the_flat_fields(llm):
    params = SamplingParams(temperature=1.0, n=4, seed=11, max_new_tokens=12, ignore_eos=True, logprobs=2)
    out = llm.generate([PROMPT], params)[0]
    assert [s.sample_index for s in out.outputs] == [0, 1, 2, 3]
    first = out.outputs[0]
    assert (out.token_ids, out.text, out.logprobs, out.cumulative_logprob) == (
        first.token_ids, first.text, first.logprobs, first.cumulative_logprob)
    assert len({tuple(s.token_ids) for s in out.outputs}) > 1  # independent samples at temperature 1
    # The prompt is computed once; each other sample recomputes only its last token (page-aligned match).
    assert llm.last_stats["prefill_tokens"] == len(PROMPT) + 3 * 4
    assert llm.last_stats["output_tokens"] == 4 * 12 == out.total_completion_tokens
    for s in out.outputs:
        assert len(s.logprobs) == s.completion_tokens == 12
        assert [e["token_id"] for e in s.logprobs] == s.token_ids
        assert math.isclose(s.cumulative_logprob, sum(e["logprob"] for e in s.logprobs), rel_tol=1e-6)
    # Seeded: the same samples again, in a batch with other work; sample 0 is what n = 1 draws.
    again = llm.generate([[7, 8, 9], PROMPT], [SamplingParams(max_new_tokens=5), params])[1]
    assert [s.token_ids for s in again.outputs] == [s.token_ids for s in out.outputs]
    single = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=11, max_new_tokens=12, ignore_eos=True))[0]
    assert single.token_ids == first.token_ids and len(single.outputs) == 1


def test_greedy_samples_are_identical(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, n=3, max_new_tokens=10))[0]
    assert len(out.outputs) == 3 and len({tuple(s.token_ids) for s in out.outputs}) == 1


def test_config_sampling_defaults_reach_every_request(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), overrides=[*BASE, "sampling.n=2", "sampling.logprobs=1", "sampling.prompt_logprobs=0"])
    out = llm.generate([[3, 4, 5, 6]], {"max_new_tokens": 3})[0]
    assert len(out.outputs) == 2 and all(len(s.logprobs) == 3 for s in out.outputs)
    assert len(out.prompt_logprobs) == 4 and out.prompt_logprobs[0] is None
    assert all(e["top"] == [] for e in out.prompt_logprobs[1:])  # k = 0: the token's own logprob only


def _job(tiny_llama_dir: Path, tmp_path: Path, rows: list[dict]) -> tuple[list[dict], dict]:
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    llm = LLM(str(tiny_llama_dir), overrides=[*BASE, f"job.input={tmp_path / 'rows.jsonl'}",
                                              f"job.output={tmp_path / 'out.jsonl'}"])
    metrics = run_job(llm, "test")
    assert metrics["errors"] == 0
    return [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()], metrics


def test_jsonl_rows_carry_choices_and_logprobs_only_when_asked(tiny_llama_dir, tmp_path):
    rows = [
        {"id": "plain", "prompt": [5, 6, 7], "sampling": {"max_new_tokens": 4}},
        {"id": "scored", "prompt": [5, 6, 7], "sampling": {"max_new_tokens": 4, "logprobs": 3, "prompt_logprobs": 2}},
        {"id": "many", "prompt": PROMPT, "sampling": {"max_new_tokens": 6, "n": 3, "temperature": 1.0, "seed": 2,
                                                      "logprobs": 1, "ignore_eos": True}},
    ]
    written, metrics = _job(tiny_llama_dir, tmp_path, rows)
    out = {r["id"]: r for r in written}
    assert metrics["output_tokens"] == sum(r["completion_tokens"] for r in written)
    assert list(out["plain"]) == ["id", "text", "finish_reason", "prompt_tokens", "completion_tokens"]  # as before
    scored = out["scored"]
    assert len(scored["logprobs"]) == scored["completion_tokens"]
    assert all(set(e) == {"token_id", "logprob", "top"} and len(e["top"]) == 3 for e in scored["logprobs"])
    assert scored["prompt_logprobs"][0] is None and len(scored["prompt_logprobs"]) == 3
    assert [e["token_id"] for e in scored["prompt_logprobs"][1:]] == [6, 7]
    many = out["many"]
    assert [c["index"] for c in many["choices"]] == [0, 1, 2] and "text" not in many
    assert all(len(c["logprobs"]) == c["completion_tokens"] == 6 for c in many["choices"])
    assert many["completion_tokens"] == 18 and many["prompt_tokens"] == len(PROMPT)
    # A rerun finds every row done (a row with n samples is written once, when all n are done).
    again, metrics = _job(tiny_llama_dir, tmp_path, rows)
    assert (metrics["already_done"], metrics["completed"]) == (3, 0) and again == written


def test_bad_sample_keys_are_row_errors(tiny_llama_dir, tmp_path):
    rows = [{"id": 1, "prompt": [5, 6], "sampling": {"n": 0}}, {"id": 2, "prompt": [5, 6], "sampling": {"logprobs": 21}},
            {"id": 3, "prompt": [5, 6], "sampling": {"n": True}}, {"id": 4, "prompt": [5, 6]}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    llm = LLM(str(tiny_llama_dir), overrides=[*BASE, f"job.input={tmp_path / 'rows.jsonl'}",
                                              f"job.output={tmp_path / 'out.jsonl'}"])
    metrics = run_job(llm, "test")
    assert (metrics["completed"], metrics["errors"]) == (1, 3)
    errors = {e["id"]: e["error"] for e in map(json.loads, (tmp_path / "out.errors.jsonl").read_text().splitlines())}
    assert "n=0" in errors[1] and "logprobs=21" in errors[2] and "n=True" in errors[3], errors
