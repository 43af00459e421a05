"""End-to-end generation with the default model against HF `generate`, and per-request errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime import LLM, SamplingParams

pytestmark = pytest.mark.slow

MAX_NEW = 24
STORY = (
    "In a small village by the sea there lived an old fisherman who mended his nets every morning. "
    "The children of the village would gather around him to hear stories about storms and whales. "
)
PROMPTS = [
    "What is the capital of France?",
    "Name three colors.",
    "Summarize this story in one sentence: " + STORY * 8,  # over 300 tokens
    "Write a short poem about autumn.",
    "Translate 'good morning' into Spanish.",
    "What does this text describe? " + STORY * 10,  # over 300 tokens
    "Give me a one-line definition of gravity.",
    "Count from one to five.",
]


def chat(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


@pytest.fixture(scope="module")
def hf_reference(default_model_dir):
    """Greedy HF `generate` for each prompt on its own (no padding), with the model's EOS ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    refs = []
    for prompt in PROMPTS:
        text = tok.apply_chat_template(chat(prompt), add_generation_prompt=True, tokenize=False)
        ids = tok.encode(text, add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False)
        refs.append((ids.shape[1], out[0, ids.shape[1]:].tolist()))
    assert max(n for n, _ in refs) > 300 and sum(n > 300 for n, _ in refs) >= 2
    return refs


def _check_against_hf(llm: LLM, hf_reference) -> None:
    outs = llm.generate([chat(p) for p in PROMPTS], SamplingParams(temperature=0, max_new_tokens=MAX_NEW))
    for out, (prompt_len, ref_tokens) in zip(outs, hf_reference):
        assert out.error is None
        assert out.prompt_tokens == prompt_len
        assert out.token_ids == ref_tokens
        assert out.finish_reason == ("stop" if len(ref_tokens) < MAX_NEW else "length")


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_matches_hf_generate(default_model_dir, hf_reference, page_size):
    llm = LLM(str(default_model_dir), overrides=[f"cache.page_size={page_size}", "engine.device=cpu"])
    _check_against_hf(llm, hf_reference)


def test_greedy_matches_hf_when_requests_wait_for_pages(default_model_dir, hf_reference):
    # 60 pages of 16 tokens: the long prompts need ~24 each, so requests must queue for pages.
    llm = LLM(str(default_model_dir), overrides=["cache.num_pages=60", "engine.device=cpu", "cache.debug_checks=true"])
    _check_against_hf(llm, hf_reference)
    assert llm.scheduler.stats.page_waits > 0
    # Every page came back: free, or held by the prefix cache with no request using it.
    assert llm.scheduler.allocator.num_free + llm.scheduler.cache.evictable_pages == 59


def test_chunked_prefill_equals_unchunked(default_model_dir):
    prompt = chat("Summarize: " + STORY * 9)
    params = SamplingParams(temperature=0, max_new_tokens=16)
    whole = LLM(str(default_model_dir), overrides=["engine.device=cpu"])
    chunked = LLM(str(default_model_dir), overrides=["engine.device=cpu", "scheduler.max_prefill_tokens=64"])
    a = whole.generate([prompt], params)[0]
    b = chunked.generate([prompt], params)[0]
    assert a.prompt_tokens > 64 * 4
    assert chunked.scheduler.stats.prefill_steps >= a.prompt_tokens // 64
    assert whole.scheduler.stats.prefill_steps == 1
    assert a.token_ids == b.token_ids


def test_overlap_off_gives_same_tokens(default_model_dir, hf_reference):
    llm = LLM(str(default_model_dir), overrides=["engine.device=cpu", "scheduler.overlap=false", "cache.num_pages=60"])
    _check_against_hf(llm, hf_reference)


def test_bad_requests_fail_alone(default_model_dir):
    llm = LLM(str(default_model_dir), overrides=["engine.device=cpu", "model.max_seq_len=512"])
    prompts = ["", chat("hello " * 600), chat("What is the capital of France?"), [10**9], chat("Name three colors.")]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12))
    assert "empty" in outs[0].error
    assert "maximum sequence length" in outs[1].error and "512" in outs[1].error
    assert "vocabulary" in outs[3].error
    for ok in (outs[2], outs[4]):
        assert ok.error is None and ok.completion_tokens > 0
    assert "Paris" in outs[2].text
    # the engine is still healthy for the next call
    again = llm.generate([chat("What is the capital of France?")], SamplingParams(temperature=0, max_new_tokens=12))
    assert again[0].token_ids == outs[2].token_ids


def test_stop_strings_and_stop_tokens(default_model_dir):
    llm = LLM(str(default_model_dir), overrides=["engine.device=cpu"])
    free = llm.generate([chat("What is the capital of France?")], SamplingParams(temperature=0, max_new_tokens=20))[0]
    assert "France" in free.text
    stopped = llm.generate(
        [chat("What is the capital of France?")], SamplingParams(temperature=0, max_new_tokens=20, stop=["France"])
    )[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index("France")]
    at_start = llm.generate(
        [chat("What is the capital of France?")], SamplingParams(temperature=0, max_new_tokens=20, stop=[free.text[:3]])
    )[0]
    assert at_start.text == "" and at_start.finish_reason == "stop"
    first = free.token_ids[2]
    by_id = llm.generate(
        [chat("What is the capital of France?")],
        SamplingParams(temperature=0, max_new_tokens=20, stop_token_ids=[first]),
    )[0]
    assert by_id.token_ids == free.token_ids[:3] and by_id.finish_reason == "stop"
    assert by_id.text == llm.tokenizer.decode(free.token_ids[:2])  # the stop token's text is not output, as vLLM
    ignored = llm.generate(
        [chat("What is the capital of France?")], SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    )[0]
    assert ignored.completion_tokens == 20 and ignored.finish_reason == "length"


def test_missing_model_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloads"):
        LLM("meta-llama/Not-Here", overrides=["engine.device=cpu"])


def test_launch_job_mode_writes_one_row_per_input(default_model_dir, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "\n".join([
            json.dumps({"id": "a", "prompt": "What is the capital of France?"}),
            "{not json",
            json.dumps({"id": "b", "messages": chat("Name three colors."), "sampling": {"max_new_tokens": 8}}),
            json.dumps({"id": "c", "prompt": "hi", "sampling": {"temperature": -1}}),
        ]) + "\n"
    )
    out = tmp_path / "out.jsonl"
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "launch.py", f"model.path={default_model_dir}", "engine.device=cpu",
         f"job.input={rows}", f"job.output={out}"],
        cwd=repo, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "nanobind" not in proc.stderr  # no leak report from Triton's bindings at exit
    results = [json.loads(line) for line in out.read_text().splitlines()]
    errors = [json.loads(line) for line in out.with_suffix(".errors.jsonl").read_text().splitlines()]
    by_id = {r["id"]: r for r in results}
    assert sorted(by_id) == ["a", "b"]
    assert "Paris" in by_id["a"]["text"] and by_id["a"]["finish_reason"] == "stop"
    assert by_id["b"]["completion_tokens"] <= 8
    assert len(errors) == 2
    assert any(e["id"] == "c" and "temperature" in e["error"] for e in errors)
    assert any(e["id"] is None and "not valid JSON" in e["error"] for e in errors)
    metrics = json.loads(out.with_suffix(".metrics.json").read_text())
    assert metrics["completed"] == 2 and metrics["errors"] == 2 and metrics["rows"] == 4
    assert "page_size: 16" in out.with_suffix(".config.yaml").read_text()


def test_overlapping_step_loops_keep_the_gc_quiet_until_the_last_one_ends():
    """Two LLMs stepping on two threads: the first loop to end must not bring the GC back under the other."""
    import gc

    from runtime.frontend.llm import GC_YOUNG_THRESHOLD, quiet_garbage_collector

    before = gc.get_threshold()
    first, second = quiet_garbage_collector(), quiet_garbage_collector()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert gc.get_freeze_count() > 0 and gc.get_threshold()[0] >= GC_YOUNG_THRESHOLD
    second.__exit__(None, None, None)
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before


@pytest.mark.parametrize("shut_down", [True, False], ids=["shut-down", "dropped"])
def test_a_dropped_llm_and_the_callers_data_are_freed_by_one_collection(default_model_dir, shut_down):
    """The step loop freezes what is alive (the GC then leaves the model alone) only while it runs: an LLM dropped
    with or without shutdown(), and the caller's objects alive when it ran, are collected afterwards (sweeps and
    notebooks build model after model in one process)."""
    import gc
    import weakref

    class Data:
        pass

    data = Data()
    data.itself = data  # a cycle: only the cyclic GC frees it
    frozen_while_stepping = []
    llm = LLM(str(default_model_dir), overrides=["engine.device=cpu"])
    llm.run([(0, "Hello", SamplingParams(max_new_tokens=2))], on_batch=lambda _: frozen_while_stepping.append(
        gc.get_freeze_count()))
    assert min(frozen_while_stepping) > 0 and gc.get_freeze_count() == 0
    # A parameter and its layer form a cycle (the parameter's weight_loader is the layer's bound method).
    engine, weights, kept = weakref.ref(llm.engine), weakref.ref(next(llm.engine.model.parameters())), weakref.ref(data)
    if shut_down:
        llm.shutdown()
    del llm, data
    gc.collect()
    assert engine() is None and weights() is None and kept() is None


def test_runs_from_two_threads_take_turns(tiny_llama_dir):
    import threading

    llm = LLM(str(tiny_llama_dir), overrides=["engine.device=cpu", "model.dtype=float32", "model.max_seq_len=64"])
    prompts = [[5, 6, 7 + i] for i in range(8)]
    greedy = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    alone = [o.token_ids for o in llm.generate(prompts, greedy)]
    outputs: list = [None, None]

    def generate(i: int) -> None:
        outputs[i] = [o.token_ids for o in llm.generate(prompts, greedy)]

    threads = [threading.Thread(target=generate, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outputs == [alone, alone]
    llm.shutdown()


def test_chat_reads_a_generator_and_a_model_path_may_be_a_path(default_model_dir):
    llm = LLM(Path(default_model_dir), overrides=["engine.device=cpu"])
    chats = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Bye"}]]
    greedy = SamplingParams(temperature=0, max_new_tokens=3)
    assert [o.text for o in llm.chat((c for c in chats), greedy)] == [o.text for o in llm.chat(chats, greedy)]
    with pytest.raises(TypeError, match="sampling_params must be SamplingParams.*not int"):
        llm.generate("Hi", 5)
    llm.shutdown()


class _Interrupted(BaseException):
    """Stands for Ctrl-C (a KeyboardInterrupt here would stop pytest itself)."""


@pytest.mark.parametrize("where", ["on_result", "on_batch"])
def test_a_run_that_raises_leaves_nothing_behind_for_the_next(tiny_llama_dir, where):
    """An on_result that raises (a full disk) or an interrupt at the first batch: the next run on the same LLM
    serves only its own requests, each once, with the tokens it gives alone."""
    llm = LLM(str(tiny_llama_dir), overrides=["engine.device=cpu", "model.dtype=float32", "model.max_seq_len=64",
                                             "scheduler.max_running_requests=1", "cache.debug_checks=true"])
    greedy = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    first, second = [[10, 11, 12, 13, 14], [20, 21, 22]], [[30, 31, 32, 33], [40, 41]]
    expected = [o.token_ids for o in llm.generate(second, greedy)]
    rows = len(llm.scheduler.free_rows)

    def fail(*args: object) -> None:
        raise (OSError("disk full") if where == "on_result" else _Interrupted())

    with pytest.raises((OSError, _Interrupted)):
        llm.run([(f"a{i}", p, greedy) for i, p in enumerate(first)], **{where: fail})
    assert llm.scheduler.idle and len(llm.scheduler.free_rows) == rows
    llm.scheduler.check_integrity()
    delivered: dict[str, list[list[int]]] = {}
    out = llm.run([(f"b{i}", p, greedy) for i, p in enumerate(second)],
                  on_result=lambda key, o: delivered.setdefault(key, []).append(o.token_ids))
    assert [o.token_ids for o in out] == expected and delivered == {"b0": [expected[0]], "b1": [expected[1]]}
    llm.shutdown()


def test_an_on_result_that_raises_releases_the_requests_finished_beside_it(tiny_llama_dir):
    """Two requests finish in one step and the first one's on_result raises: the second, already marked
    finished, gives back its row and pages too, so a request that needs the whole cache is still served."""
    llm = LLM(str(tiny_llama_dir), overrides=["engine.device=cpu", "model.dtype=float32", "model.max_seq_len=64",
                                             "scheduler.max_running_requests=4", "cache.page_size=4",
                                             "cache.num_pages=5"])  # 4 usable pages: 16 tokens
    rows, pages = len(llm.scheduler.free_rows), llm.scheduler.allocator.num_free
    greedy = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)

    def fail(*args: object) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError):
        llm.run([("a", [10, 11, 12], greedy), ("b", [20, 21, 22], greedy)], on_result=fail)
    assert llm.scheduler.idle and len(llm.scheduler.free_rows) == rows
    assert llm.scheduler.allocator.num_free + llm.scheduler.cache.evictable_pages == pages
    llm.scheduler.check_integrity()
    whole_cache = SamplingParams(temperature=0, max_new_tokens=7, ignore_eos=True)  # 10 + 7 - 1 tokens: 4 pages
    [out] = llm.generate([list(range(30, 40))], whole_cache)
    assert out.error is None and len(out.token_ids) == 7
    llm.shutdown()


def test_a_temperature_too_small_for_float32_samples_the_argmax(tiny_llama_dir):
    """1/t overflows float32 below ~3e-39 (the sampler then read inf and NaN): such a temperature is greedy."""
    llm = LLM(str(tiny_llama_dir), overrides=["engine.device=cpu", "model.dtype=float32", "model.max_seq_len=64"])
    prompts = [[10, 11, 12], [20, 21, 22, 23]]
    greedy = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_new_tokens=6,
                                                                        ignore_eos=True))]
    for t in (1e-40, 1e-30, 1e-6):
        tiny = SamplingParams(temperature=t, top_p=0.9, max_new_tokens=6, ignore_eos=True)
        assert tiny.is_greedy and [o.token_ids for o in llm.generate(prompts, tiny)] == greedy, t
    assert not SamplingParams(temperature=1e-4).is_greedy
    llm.shutdown()


def test_parameters_changed_after_construction_are_checked_per_request(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), overrides=["engine.device=cpu", "model.dtype=float32", "model.max_seq_len=64"])
    for field, value in (("temperature", float("nan")), ("max_new_tokens", -5), ("top_p", 0.0)):
        params = SamplingParams(max_new_tokens=4)
        setattr(params, field, value)
        (out,) = llm.generate([[10, 11, 12]], params)
        assert out.error is not None and f"sampling parameter {field}=" in out.error, (field, out.error)
    params = SamplingParams(max_new_tokens=4)
    params.stop = "xyz"  # one stop string, not three characters
    llm.generate([[10, 11, 12]], params)
    assert params.stop == ["xyz"]
    llm.shutdown()
