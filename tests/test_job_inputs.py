"""One bad row, value or file never ends a job: each gets an error row naming its line, and reruns
retry what failed (in-process, on a tiny model)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from runtime import LLM
from runtime.config import to_yaml
from runtime.frontend.job import run_job
from runtime.frontend.job_files import JobPaths

REPO = Path(__file__).resolve().parents[1]


class ChatStub:
    """A tokenizer whose chat template rejects some conversations, as real templates do."""

    def encode(self, text: str, **_: object) -> list[int]:
        return [3 + len(w) % 50 for w in text.split()] or [3]

    def decode(self, ids: list[int], **_: object) -> str:
        return " ".join(map(str, ids))

    def apply_chat_template(self, messages: list[dict], **_: object) -> str:
        import jinja2

        if messages[0]["role"] != "user":
            raise jinja2.TemplateError("Conversation roles must alternate user/assistant/user/assistant/...")
        return " ".join(m["content"] for m in messages)


def _llm(model_dir: Path, tmp_path: Path, *overrides: str) -> LLM:
    llm = LLM(str(model_dir), overrides=["engine.device=cpu", "model.dtype=float32", "model.max_seq_len=64",
                                         f"job.input={tmp_path / 'rows.jsonl'}", f"job.output={tmp_path / 'out.jsonl'}",
                                         "job.progress=false", *overrides])
    llm.tokenizer = ChatStub()
    return llm


def _write(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(b"".join(line + b"\n" for line in lines))


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip(" \x00")]


def test_bad_rows_become_error_rows_naming_their_line(tiny_llama_dir, tmp_path):
    row = {"prompt": [5, 6, 7], "sampling": {"max_new_tokens": 2}}
    _write(tmp_path / "rows.jsonl", [
        json.dumps({"id": "a", **row}).encode(),
        b'{"id": "latin1", "prompt": "caf\xe9"}',  # not UTF-8
        json.dumps({"id": "tpl", "messages": [{"role": "assistant", "content": "hi"}]}).encode(),
        json.dumps({"id": "empty", "prompt": "  "}).encode(),
        json.dumps({"id": "hot", "prompt": [5], "sampling": "hot"}).encode(),
        json.dumps({"id": True, **row}).encode(),
        json.dumps({"id": 1, **row}).encode(),
        json.dumps({"id": 1.0, **row}).encode(),  # the same id as 1
        json.dumps({"id": "long", "prompt": list(range(5, 100)), "sampling": {"max_new_tokens": 2}}).encode(),
        b'{"id": "big", "prompt": [5], "x": ' + b"9" * 5000 + b"}",  # past Python's 4,300-digit int limit
        b'{"id": "deep", "prompt": [5], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # past the recursion limit
        json.dumps({"id": "msg-str", "messages": "What is the capital of France?"}).encode(),
        json.dumps({"id": "msg-ids", "messages": [1, 2, 3]}).encode(),
        b'{"id": "sur\\ud800", "prompt": [5, 6, 7], "sampling": {"max_new_tokens": 2}}',  # a lone surrogate
    ])
    m = run_job(_llm(tiny_llama_dir, tmp_path), "cfg")
    out, errors = _read(tmp_path / "out.jsonl"), _read(tmp_path / "out.errors.jsonl")
    assert sorted(str(r["id"]) for r in out) == ["1", "a", "sur\ud800"] and m["completed"] == 3
    by_line = {e["line"]: e["error"] for e in errors}
    assert set(by_line) == {2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13} and m["errors"] == 11
    assert "cannot be read" in by_line[10] and "cannot be read" in by_line[11]
    assert "'messages' must be a non-empty list" in by_line[12] and "'messages'" in by_line[13]
    assert "not valid UTF-8" in by_line[2] and ":2 " in by_line[2] and "0xe9" in by_line[2]
    assert by_line[3].startswith("TemplateError") and "alternate" in by_line[3]
    assert "empty" in by_line[4] and "'sampling' must be an object" in by_line[5]
    assert "usable 'id'" in by_line[6] and "duplicate id" in by_line[8] and "maximum sequence length" in by_line[9]


def test_a_misspelt_row_key_is_an_error_row_and_other_keys_ride_along(tiny_llama_dir, tmp_path):
    _write(tmp_path / "rows.jsonl", [json.dumps(r).encode() for r in [
        {"id": "typo", "prompt": [5, 6], "samplng": {"max_new_tokens": 2}},
        {"id": "promt", "promt": [5, 6]},
        {"id": "kept", "prompt": [5, 6], "sampling": {"max_new_tokens": 2}, "answer": "Paris", "meta": {"k": 1},
         "idx": 3, "uid": "u", "prompt_id": 7, "prompts": ["a"], "message": "m"},  # near names of keys it has
    ]])
    m = run_job(_llm(tiny_llama_dir, tmp_path), "cfg")
    errors = {e["id"]: e["error"] for e in _read(tmp_path / "out.errors.jsonl")}
    assert [r["id"] for r in _read(tmp_path / "out.jsonl")] == ["kept"] and m["completed"] == 1
    assert errors == {"typo": "line 1: unknown key 'samplng' (did you mean 'sampling'?)",
                      "promt": "line 2: unknown key 'promt' (did you mean 'prompt'?)"}


def test_rerun_retries_failed_rows_and_skips_unreadable_output_lines(tiny_llama_dir, tmp_path):
    rows = [{"id": i, "prompt": list(range(5, 5 + 12 * i)), "sampling": {"max_new_tokens": 2}} for i in range(1, 8)]
    _write(tmp_path / "rows.jsonl", [json.dumps(r).encode() for r in rows])
    first = run_job(_llm(tiny_llama_dir, tmp_path), "cfg")  # ids 6 and 7 are too long for max_seq_len=64
    assert first["completed"] == 5 and first["errors"] == 2
    with open(tmp_path / "out.jsonl", "ab") as f:
        f.write(b"\n" + b"\x00" * 40 + b"\n")  # a blank line and a zero-filled block, as after a node crash
    second = run_job(_llm(tiny_llama_dir, tmp_path, "model.max_seq_len=256"), "cfg")
    assert second["completed"] == 2 and second["errors"] == 0 and second["already_done"] == 5
    assert sorted(r["id"] for r in _read(tmp_path / "out.jsonl") if "id" in r) == list(range(1, 8))
    assert _read(tmp_path / "out.errors.jsonl") == []  # the latest run's failures: none


def test_a_torn_last_line_is_cut_before_new_rows_are_appended(tiny_llama_dir, tmp_path):
    rows = [{"id": i, "prompt": [5, 6, 7 + i], "sampling": {"max_new_tokens": 2}} for i in range(4)]
    _write(tmp_path / "rows.jsonl", [json.dumps(r).encode() for r in rows])
    _write(tmp_path / "out.jsonl", [json.dumps({"id": 0, "text": "x"}).encode()])
    with open(tmp_path / "out.jsonl", "ab") as f:
        f.write(b'{"id": 1, "te')  # killed mid-write
    m = run_job(_llm(tiny_llama_dir, tmp_path), "cfg")
    assert (m["already_done"], m["completed"]) == (1, 3)
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["id"] for line in lines) == [0, 1, 2, 3]  # every line a whole row


def test_a_whole_last_line_without_its_newline_is_kept(tiny_llama_dir, tmp_path):
    rows = [{"id": i, "prompt": [5, 6, 7 + i], "sampling": {"max_new_tokens": 2}} for i in range(3)]
    _write(tmp_path / "rows.jsonl", [json.dumps(r).encode() for r in rows])
    done = [json.dumps({"id": 0, "text": "x"}), json.dumps({"id": 1, "text": "y"})]
    (tmp_path / "out.jsonl").write_text("\n".join(done))  # as an editor saves it: no newline at the end
    m = run_job(_llm(tiny_llama_dir, tmp_path), "cfg")
    assert (m["already_done"], m["completed"]) == (2, 1)
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert lines[:2] == done and [json.loads(line)["id"] for line in lines] == [0, 1, 2]


def test_outputs_that_share_their_side_files_are_refused_while_the_other_holds_rows(tiny_llama_dir, tmp_path):
    """out.jsonl, out.json and out share out.config.yaml and out.errors.jsonl: a job on one of them must not
    overwrite the record and the errors of another one's rows, nor resume under settings it replaced."""
    _write(tmp_path / "rows.jsonl", [json.dumps({"id": i, "prompt": [5, 6, 7 + i]}).encode() for i in range(2)])
    first = _llm(tiny_llama_dir, tmp_path, "sampling.max_new_tokens=2")
    assert run_job(first, to_yaml(first.cfg))["completed"] == 2
    record = (tmp_path / "out.config.yaml").read_text()
    for name in ("out.json", "out"):
        other = _llm(tiny_llama_dir, tmp_path, "sampling.max_new_tokens=3", f"job.output={tmp_path / name}")
        with pytest.raises(ValueError, match=rf"job.output={tmp_path / name} would share {tmp_path / 'out.config.yaml'} "
                                             rf".*with job.output={tmp_path / 'out.jsonl'}, whose rows it describes"):
            run_job(other, to_yaml(other.cfg))
        assert (tmp_path / "out.config.yaml").read_text() == record and not (tmp_path / name).exists()
    (tmp_path / "out.jsonl").unlink()  # the rows it described are gone: the name is free
    other = _llm(tiny_llama_dir, tmp_path, "sampling.max_new_tokens=3", f"job.output={tmp_path / 'out.json'}")
    assert run_job(other, to_yaml(other.cfg))["completed"] == 2


def test_a_rerun_with_other_row_settings_is_refused_before_it_serves(tiny_llama_dir, tmp_path):
    rows = [{"id": i, "prompt": [5, 6, 7 + i]} for i in range(3)]
    _write(tmp_path / "rows.jsonl", [json.dumps(r).encode() for r in rows[:2]])
    first = _llm(tiny_llama_dir, tmp_path, "sampling.max_new_tokens=2")
    assert run_job(first, to_yaml(first.cfg))["completed"] == 2
    _write(tmp_path / "rows.jsonl", [json.dumps(r).encode() for r in rows])
    output, record = (tmp_path / "out.jsonl").read_bytes(), (tmp_path / "out.config.yaml").read_text()
    changed = _llm(tiny_llama_dir, tmp_path, "sampling.max_new_tokens=3", "sampling.temperature=0.5")
    with pytest.raises(ValueError, match=r"holds rows made with other settings \(sampling.max_new_tokens: 2 then, 3 "
                                         r"now; sampling.temperature: .*\): use another job.output, or delete .*"
                                         r"out\.config\.yaml"):
        run_job(changed, to_yaml(changed.cfg))
    assert (tmp_path / "out.jsonl").read_bytes() == output and (tmp_path / "out.config.yaml").read_text() == record
    proc = subprocess.run([sys.executable, "launch.py", f"model.path={tiny_llama_dir}", "engine.device=cpu",
                           "model.dtype=float32", "model.max_seq_len=64", f"job.input={tmp_path / 'rows.jsonl'}",
                           f"job.output={tmp_path / 'out.jsonl'}", "sampling.max_new_tokens=3", "sampling.temperature=1.0"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert "(sampling.max_new_tokens: 2 then, 3 now)" in errors[0]  # the one difference, before the model loads
    # where it runs may change (a requeued job), and so may the settings once their record is deleted
    moved = _llm(tiny_llama_dir, tmp_path, "sampling.max_new_tokens=2", "scheduler.max_running_requests=1")
    assert run_job(moved, to_yaml(moved.cfg))["already_done"] == 2
    (tmp_path / "out.config.yaml").unlink()
    assert run_job(changed, to_yaml(changed.cfg))["already_done"] == 3
    assert "max_new_tokens: 3" in (tmp_path / "out.config.yaml").read_text()


def test_a_rerun_with_another_logit_bias_is_refused(tiny_llama_dir, tmp_path):
    """A logit bias is one setting: another token, or none, is a change, though no key is in both copies."""
    rows = [{"id": i, "prompt": [5, 6, 7 + i]} for i in range(3)]
    _write(tmp_path / "rows.jsonl", [json.dumps(r).encode() for r in rows[:2]])
    first = _llm(tiny_llama_dir, tmp_path, "sampling.max_new_tokens=2", "sampling.logit_bias={5: -100}")
    assert run_job(first, to_yaml(first.cfg))["completed"] == 2
    _write(tmp_path / "rows.jsonl", [json.dumps(r).encode() for r in rows])
    for bias, shown in [("{7: -100}", "{'7': -100.0}"), ("{}", "{}")]:
        other = _llm(tiny_llama_dir, tmp_path, "sampling.max_new_tokens=2", f"sampling.logit_bias={bias}")
        with pytest.raises(ValueError, match=re.escape(f"(sampling.logit_bias: {{'5': -100.0}} then, {shown} now)")):
            run_job(other, to_yaml(other.cfg))
    same = _llm(tiny_llama_dir, tmp_path, "sampling.max_new_tokens=2", "sampling.logit_bias={5: -100.0}")
    assert run_job(same, to_yaml(same.cfg))["completed"] == 1


def test_input_and_output_must_differ(tiny_llama_dir, tmp_path):
    rows = tmp_path / "rows.jsonl"
    _write(rows, [json.dumps({"id": 1, "prompt": [5]}).encode()])
    proc = subprocess.run([sys.executable, "launch.py", f"model.path={tiny_llama_dir}", f"job.input={rows}",
                           f"job.output={rows}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "same file" in proc.stderr and "Traceback" not in proc.stderr
    metrics = subprocess.run([sys.executable, "launch.py", f"model.path={tiny_llama_dir}", f"job.input={rows}",
                              f"job.output={tmp_path / 'o.jsonl'}", f"job.metrics={rows}"],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
    assert metrics.returncode == 2 and "'job.input' and 'job.metrics' name the same file" in metrics.stderr
    llm = _llm(tiny_llama_dir, tmp_path, f"job.output={rows}")
    with pytest.raises(ValueError, match="same file"):
        run_job(llm, "cfg")
    assert rows.read_text().count("\n") == 1  # the input was not touched


def test_side_files_never_collide_and_the_metrics_folder_is_made(tmp_path):
    def paths(output: Path, **keys: str) -> JobPaths:
        return JobPaths.from_config(SimpleNamespace(input=str(tmp_path / "in.jsonl"), output=str(output),
                                                    errors=keys.get("errors", ""), metrics=keys.get("metrics", "")))

    a, b = paths(tmp_path / "shard.00"), paths(tmp_path / "shard.01")
    assert {a.errors, a.metrics, a.config}.isdisjoint({b.errors, b.metrics, b.config})
    assert paths(tmp_path / "out.jsonl").errors == tmp_path / "out.errors.jsonl"  # the documented name
    with pytest.raises(ValueError, match="'job.output' and 'job.errors' name the same file"):
        paths(tmp_path / "out.jsonl", errors=str(tmp_path / "out.jsonl")).check_distinct()


def test_an_output_that_cannot_be_written_fails_before_the_model_loads(tmp_path):
    rows = tmp_path / "rows.jsonl"
    _write(rows, [json.dumps({"id": 1, "prompt": [5]}).encode()])
    cases = {tmp_path: "'job.output'=.* is a folder; name a file in it",
             rows / "o.jsonl": "'job.output'=.*: its folder cannot be made",
             tmp_path / "o.csv": r"job.output=.*o.csv: results are written as JSONL or Parquet, not .csv",
             f"{tmp_path / 'new'}/": "'job.output'=.*new/ names a folder; name a file in it",  # a Path drops the /
             tmp_path / ("x" * 300 + ".jsonl"): "'job.output'=.*: File name too long",
             (tmp_path / "o.jsonl", "job.format=openai"): r"rows.jsonl: its first row is a native row .* \(job.format"}
    for output, message in cases.items():
        output, *extra = output if isinstance(output, tuple) else (output,)
        proc = subprocess.run([sys.executable, "launch.py", "model.path=/nonexistent", f"job.input={rows}",
                               f"job.output={output}", *extra], cwd=REPO, capture_output=True, text=True, timeout=120)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
        assert proc.returncode == 2 and len(errors) == 1 and re.search(message, errors[0]), proc.stderr
        assert "Traceback" not in proc.stderr and "nonexistent" not in proc.stderr  # before the model
    metrics_in_a_file = JobPaths.from_config(SimpleNamespace(input=str(rows), output=str(tmp_path / "o.jsonl"),
                                                             errors="", metrics=str(rows / "m.json")))
    with pytest.raises(ValueError, match="'job.metrics'=.*: its folder cannot be made"):
        metrics_in_a_file.check_writable()
    assert rows.is_file() and not (tmp_path / "new").exists()


def test_column_names_set_for_a_jsonl_input_are_refused_before_the_model_loads(tmp_path):
    """job.columns names a table's columns: for JSONL rows, which name their own keys, it would be ignored."""
    from runtime.config import load_config
    from runtime.frontend.job_inputs import open_input
    from runtime.sampling_params import SamplingParams

    rows = tmp_path / "rows.jsonl"
    _write(rows, [json.dumps({"id": 1, "question": "Hi", "prompt": "Yo"}).encode()])
    for override, shown in [("job.columns.prompt=question", "job.columns.prompt='question'"),
                            ("job.columns.id=qid", "job.columns.id='qid'"),
                            ("job.columns.messages=null", "job.columns.messages=None")]:
        job = load_config(overrides=[override]).job
        with pytest.raises(ValueError, match=re.escape(f"{shown} applies to table inputs")):
            open_input(rows, job, SamplingParams())
    proc = subprocess.run([sys.executable, "launch.py", "model.path=/nonexistent", f"job.input={rows}",
                           f"job.output={tmp_path / 'o.jsonl'}", "job.columns.prompt=question"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert proc.returncode == 2 and len(errors) == 1 and "job.columns.prompt='question'" in errors[0], proc.stderr
    assert "nonexistent" not in proc.stderr and not (tmp_path / "o.jsonl").exists()
    assert open_input(rows, load_config().job, SamplingParams()).format == "native"  # the defaults are fine


def test_latency_is_from_claim_to_result(tiny_llama_dir, tmp_path):
    """With one running slot rows are claimed a few at a time: a row's latency is its wait in this
    replica's queue plus its own run, far below the job's wall time (not the time since the job began)."""
    rows = [{"id": i, "prompt": [5, 6, 7 + i], "sampling": {"max_new_tokens": 2}} for i in range(30)]
    _write(tmp_path / "rows.jsonl", [json.dumps(r).encode() for r in rows])
    m = run_job(_llm(tiny_llama_dir, tmp_path, "scheduler.max_running_requests=1",
                     f"job.metrics={tmp_path / 'new' / 'dir' / 'm.json'}"), "cfg")
    assert m["completed"] == 30 and (tmp_path / "new" / "dir" / "m.json").is_file()
    assert m["latency_s"]["p50"] < m["wall_s"] / 3, m


def test_a_compressed_file_or_a_json_array_is_not_read_as_jsonl(tmp_path):
    """Each of its lines would be an error row after the model loads: it is refused before, saying what it is."""
    import gzip

    from runtime.frontend.job_files import InputError, jsonl_format

    rows = [{"id": 1, "prompt": "a"}, {"id": 2, "prompt": "b"}]
    lines = "".join(json.dumps(r) + "\n" for r in rows).encode()
    (tmp_path / "rows.jsonl.gz").write_bytes(gzip.compress(lines))
    with pytest.raises(InputError, match=r"rows.jsonl.gz is gzip-compressed; decompress it first"):
        jsonl_format(tmp_path / "rows.jsonl.gz")
    (tmp_path / "rows.json").write_text(json.dumps(rows, indent=2))
    with pytest.raises(InputError, match=r"rows.json holds one JSON array, not JSON Lines .* jq -c"):
        jsonl_format(tmp_path / "rows.json")
    (tmp_path / "rows.jsonl").write_bytes(lines)
    assert jsonl_format(tmp_path / "rows.jsonl") == "native"
    (tmp_path / "first_row_a_list.jsonl").write_bytes(b'[1, 2]\n' + lines)  # one bad row: an error row, as any
    assert jsonl_format(tmp_path / "first_row_a_list.jsonl") == "native"


def test_a_job_holds_no_served_result(tiny_llama_dir, tmp_path, monkeypatch):
    """What a job has written leaves memory: while a 30-row job runs, no output it has already written is still
    alive, so a job of millions of rows (or with logprobs) does not grow with them."""
    import weakref

    from runtime.frontend import results

    served: list[weakref.ref] = []
    alive_before: list[int] = []  # at each completion, how many earlier outputs are still alive
    complete = results.Results._complete

    def recording(self: results.Results, out: results.RequestOutput) -> None:
        alive_before.append(sum(ref() is not None for ref in served))
        served.append(weakref.ref(out))
        complete(self, out)

    monkeypatch.setattr(results.Results, "_complete", recording)
    rows = [{"id": i, "prompt": [5, 6, 7 + i], "sampling": {"max_new_tokens": 2}} for i in range(30)]
    _write(tmp_path / "rows.jsonl", [json.dumps(r).encode() for r in rows])
    m = run_job(_llm(tiny_llama_dir, tmp_path, "scheduler.max_running_requests=2"), "cfg")
    assert m["completed"] == 30 and len(served) == 30 and len(_read(tmp_path / "out.jsonl")) == 30
    assert max(alive_before) == 0, alive_before


@pytest.mark.parametrize(("line", "reason"), [
    (b'{"id": 1, "prompt": "a\tb"}', "Invalid control character at column 23"),  # a raw tab inside a string
    (b'{"id": 1, "prompt": "ab",}', "Expecting property name enclosed in double quotes at column 26"),
    (b'{"id": 3, "prompt": "x"', "Expecting ',' delimiter at column 24"),  # cut short: at its end
])
def test_a_line_that_is_not_json_says_why_once(tmp_path, line, reason):
    from runtime.frontend.job_files import read_rows
    from runtime.sampling_params import SamplingParams

    _write(tmp_path / "rows.jsonl", [line])
    (row,) = read_rows(tmp_path / "rows.jsonl", SamplingParams(), chat_template=False)
    assert row.error == f"line 1 is not valid JSON: {reason}"


def test_a_native_row_may_carry_url_body_or_custom_id_keys(tmp_path):
    """Only an OpenAI batch line keeps its prompt in a body: a row with a top-level prompt is native."""
    from runtime.frontend.job_files import jsonl_format, read_rows
    from runtime.sampling_params import SamplingParams

    rows = tmp_path / "rows.jsonl"
    _write(rows, [json.dumps({"id": 1, "prompt": "Summarize.", "url": "https://x", "body": "page"}).encode(),
                  json.dumps({"id": 2, "prompt": "Hi", "custom_id": "web-2"}).encode(),
                  json.dumps({"id": 3, "messages": [{"role": "user", "content": "Hi"}], "url": "u", "body": "b"}).encode()])
    assert jsonl_format(rows) == "native" and jsonl_format(rows, "native") == "native"
    assert [(r.id, r.error) for r in read_rows(rows, SamplingParams(), True, "native")] == [(1, None), (2, None),
                                                                                            (3, None)]


def test_a_row_that_reads_as_both_kinds_is_native_unless_job_format_says_openai(tmp_path):
    """A native row may carry a url and an object body of its own (a crawled page); an OpenAI batch line may keep
    its prompt beside its body: job.format decides such a file, auto reads it as native rows."""
    from runtime.frontend.job_files import jsonl_format, read_rows
    from runtime.sampling_params import SamplingParams

    rows, batch = tmp_path / "rows.jsonl", tmp_path / "batch.jsonl"
    chat = [{"role": "user", "content": "Hi"}]
    _write(rows, [json.dumps({"id": 1, "prompt": "Summarize.", "url": "https://x/1", "body": {"html": "<p/>"}}).encode(),
                  json.dumps({"id": 2, "messages": chat, "custom_id": "c2", "url": "/v1/chat/completions",
                              "body": {"messages": chat}}).encode()])
    assert jsonl_format(rows) == jsonl_format(rows, "native") == "native"
    assert [(r.id, r.error) for r in read_rows(rows, SamplingParams(), True, "auto")] == [(1, None), (2, None)]
    _write(batch, [json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "prompt": "Hi",
                               "body": {"prompt": "Hi", "max_tokens": 2}}).encode()])
    assert jsonl_format(batch) == "native" and jsonl_format(batch, "openai") == "openai"
    (row,) = read_rows(batch, SamplingParams(), True, "openai")
    assert (row.id, row.error, row.request.url) == ("a", None, "/v1/completions")


def test_a_utf8_bom_before_the_first_row_is_not_part_of_it(tmp_path):
    from runtime.frontend.job_files import jsonl_format, read_rows
    from runtime.sampling_params import SamplingParams

    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(b"\xef\xbb\xbf" + json.dumps({"id": 1, "prompt": "Hi"}).encode() + b"\n"
                     + json.dumps({"id": 2, "prompt": "Yo"}).encode() + b"\n")
    assert jsonl_format(rows) == "native"
    assert [(r.id, r.error) for r in read_rows(rows, SamplingParams(), False)] == [(1, None), (2, None)]


def test_reading_back_an_output_holds_one_line_at_a_time(tmp_path):
    """A resume reads outputs that may be larger than memory (logprobs): the ids done, a merge of parts and an
    OpenAI batch output's error lines dropped each hold about one line at a time, not the file."""
    import tracemalloc

    from runtime.frontend import openai_api
    from runtime.frontend.job_files import done_ids, drop_error_lines, merge_parts

    pad = "x" * 100_000
    out, batch = tmp_path / "out.jsonl", tmp_path / "batch.jsonl"
    out.write_text("".join(json.dumps({"id": i, "text": pad}) + "\n" for i in range(150)) + '{"id": 150, "te')
    (tmp_path / "out.jsonl.part-1").write_text("".join(json.dumps({"id": i, "text": pad}) + "\n"
                                                       for i in range(140, 160)))
    served = {"id": "b", "custom_id": "{}", "response": {"status_code": 200, "request_id": "r", "body": {"p": pad}},
              "error": None}
    failed = openai_api.error_line(None, "line:1", "invalid_json", "line 1 is not valid JSON")
    batch.write_text("".join(json.dumps({**served, "custom_id": f"c{i}"}) + "\n" for i in range(150))
                     + json.dumps(failed) + "\n")
    assert out.stat().st_size > 15e6 and batch.stat().st_size > 15e6
    tracemalloc.start()
    try:
        assert done_ids(out) == {json.dumps(i) for i in range(150)}  # the torn last line is cut
        assert merge_parts(out) == 10
        assert drop_error_lines(batch) == 1
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3e6, peak
    assert done_ids(out) == {json.dumps(i) for i in range(160)}
    assert [json.loads(line)["custom_id"] for line in batch.read_text().splitlines()] == [f"c{i}" for i in range(150)]
