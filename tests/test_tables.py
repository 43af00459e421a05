"""Tables in (Parquet, CSV, Arrow, datasets' save_to_disk, folders of shards) and Parquet out: the same texts as
the same rows in JSONL, kept columns, row numbers as ids, clear errors for bad inputs, streaming, and a Parquet
output that survives kill -9 (CPU, a tiny random Llama with the default model's tokenizer)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest

from runtime import LLM
from runtime.config import ConfigError, JobColumnsSection
from runtime.frontend import parquet_output
from runtime.frontend.job import Todo, plan, run_job
from runtime.frontend.job_files import InputError, JobRow, json_line, part_files
from runtime.frontend.tables import TableInput, table_kind
from tests.conftest import make_tiny_llama
from tests.test_output_lock import kill_job

REPO = Path(__file__).resolve().parents[1]
QUESTIONS = ["What is the capital of France?", "Name a color.", "What is 3 + 4?", "Say hi.", "Name a fruit.",
             "What is the opposite of hot?", "Name a planet.", "What do bees make?"]
IDS = [101, 7, 55, 3, 42, 900, 12, 8]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def text_model(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    path = make_tiny_llama(tmp_path_factory.mktemp("table_model"), vocab=49152, heads=4, kv_heads=2, layers=2, seed=3)
    for f in default_model_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="module")
def llm(text_model: Path) -> LLM:
    return LLM(str(text_model), overrides=["engine.device=cpu", "model.dtype=float32", "model.max_seq_len=128",
                                           "job.progress=false", "sampling.temperature=0", "sampling.max_new_tokens=5",
                                           "job.lock_wait_s=0"])


def _job(llm: LLM, source: Path, out: Path, **columns: object) -> dict:
    base = llm.cfg.job
    llm.cfg.job = replace(base, input=str(source), output=str(out), columns=JobColumnsSection(**columns))
    try:
        return run_job(llm, "cfg")
    finally:
        llm.cfg.job = base


def _texts(out: Path) -> dict:
    if out.suffix == ".parquet":
        rows = pq.read_table(out).to_pylist()
    else:
        rows = [json.loads(line) for line in out.read_text().splitlines()]
    texts = {r["id"]: r["text"] for r in rows}
    assert len(texts) == len(rows), "an id was written twice"
    return texts


@pytest.fixture(scope="module")
def reference(llm: LLM, tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("jsonl")
    rows = folder / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": i, "prompt": q}) + "\n" for i, q in zip(IDS, QUESTIONS)))
    assert _job(llm, rows, folder / "out.jsonl")["completed"] == len(IDS)
    return _texts(folder / "out.jsonl")


def _table() -> pa.Table:
    return pa.table({"qid": IDS, "question": QUESTIONS, "source": [f"s{i}" for i in range(8)],
                     "score": [0.5 * i for i in range(8)]})


def _write_inputs(folder: Path) -> dict[str, Path]:
    """The same table in every input kind."""
    table = _table()
    paths = {"parquet": folder / "in.parquet", "csv": folder / "in.csv", "arrow-file": folder / "in.arrow",
             "arrow-stream": folder / "stream.arrow", "shards": folder / "shards", "datasets": folder / "saved"}
    pq.write_table(table, paths["parquet"], row_group_size=3)
    pa_csv.write_csv(table, paths["csv"])
    with pa.ipc.new_file(paths["arrow-file"], table.schema) as w:
        w.write_table(table, max_chunksize=3)
    with pa.ipc.new_stream(paths["arrow-stream"], table.schema) as w:
        w.write_table(table, max_chunksize=5)
    paths["shards"].mkdir()
    for i, start in enumerate((0, 3, 5)):  # shard names sort in row order
        pq.write_table(table.slice(start, {0: 3, 3: 2, 5: 3}[start]), paths["shards"] / f"part-{i:05d}.parquet")
    (paths["shards"] / "_SUCCESS").write_text("")  # what Spark leaves; not a shard
    (paths["shards"] / "README.md").write_text("# a dataset card\n")  # beside the shards of a downloaded dataset
    (paths["shards"] / "out.jsonl.lock").write_text("")  # a job's own files, its output in the input folder
    try:
        import datasets
    except ImportError:  # the layout save_to_disk writes: Arrow stream files listed in state.json
        paths["datasets"].mkdir()
        with pa.ipc.new_stream(paths["datasets"] / "data-00000-of-00001.arrow", table.schema) as w:
            w.write_table(table)
        (paths["datasets"] / "state.json").write_text(json.dumps({"_data_files": [
            {"filename": "data-00000-of-00001.arrow"}]}))
    else:
        datasets.Dataset(table).save_to_disk(str(paths["datasets"]), num_shards=2)
    return paths


def test_every_table_kind_with_renamed_columns_gives_the_jsonl_texts(llm, reference, tmp_path):
    for kind, path in _write_inputs(tmp_path).items():
        out = tmp_path / f"{kind}.jsonl"
        metrics = _job(llm, path, out, id="qid", prompt="question")
        assert metrics["completed"] == len(IDS) and metrics["errors"] == 0, kind
        # CSV holds text: its ids come back as written
        assert _texts(out) == ({str(k): v for k, v in reference.items()} if kind == "csv" else reference), kind
    assert table_kind(tmp_path / "saved") == "datasets" and table_kind(tmp_path / "shards") == "parquet"


def test_chat_columns_and_sharegpt_conversations(llm, tmp_path):
    chats = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}] for q in QUESTIONS[:4]]
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": i, "messages": m}) + "\n" for i, m in enumerate(chats)))
    _job(llm, rows, tmp_path / "ref.jsonl")
    pq.write_table(pa.table({"conversation": chats}), tmp_path / "chats.parquet")  # list<struct<role, content>>
    assert _job(llm, tmp_path / "chats.parquet", tmp_path / "chats.jsonl", messages="conversation")["errors"] == 0
    sharegpt = [[{"from": "system", "value": m[0]["content"]}, {"from": "human", "value": m[1]["content"]}]
                for m in chats]
    pq.write_table(pa.table({"conversations": sharegpt}), tmp_path / "sharegpt.parquet")
    _job(llm, tmp_path / "sharegpt.parquet", tmp_path / "sharegpt.jsonl", messages="conversations")
    assert _texts(tmp_path / "chats.jsonl") == _texts(tmp_path / "sharegpt.jsonl") == _texts(tmp_path / "ref.jsonl")


def test_messages_with_fields_json_has_no_type_for_give_the_plain_chats_texts(llm, tmp_path):
    """WildChat's messages carry a timestamp and more besides role and content: what the template reads is kept,
    and planning a row with such values crashes nothing."""
    import datetime

    when = datetime.datetime(2023, 4, 9, 0, 2, 53, tzinfo=datetime.timezone.utc)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS[:4]]
    pq.write_table(pa.table({"conversation": chats}), tmp_path / "plain.parquet")
    pq.write_table(pa.table({"conversation": [[{**m, "timestamp": when, "toxic": False} for m in c] for c in chats]}),
                   tmp_path / "wildchat.parquet")
    table = TableInput(tmp_path / "wildchat.parquet", "parquet", _columns(messages="conversation", prompt=None))
    rows = list(table.rows(llm_defaults(), chat_template=True))
    assert [r.prompt for r in rows] == chats
    assert len(plan([replace(rows[0], prompt=[{"role": "user", "content": "x", "at": when}]), *rows], set())) == 5
    _job(llm, tmp_path / "plain.parquet", tmp_path / "plain.jsonl", messages="conversation", prompt=None)
    m = _job(llm, tmp_path / "wildchat.parquet", tmp_path / "wildchat.jsonl", messages="conversation", prompt=None)
    assert m["completed"] == 4 and _texts(tmp_path / "wildchat.jsonl") == _texts(tmp_path / "plain.jsonl")


def test_kept_columns_and_row_numbers_as_ids(llm, reference, tmp_path):
    table = _table().drop_columns(["qid"])
    pq.write_table(table, tmp_path / "in.parquet")
    metrics = _job(llm, tmp_path / "in.parquet", tmp_path / "out.jsonl", prompt="question", keep=["source", "score"])
    assert "row numbers (from 0)" in metrics["ids"]
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted((r["id"], r["source"], r["score"]) for r in rows) == [(i, f"s{i}", 0.5 * i) for i in range(8)]
    assert {r["id"]: r["text"] for r in rows} == {i: reference[qid] for i, qid in enumerate(IDS)}

    out = tmp_path / "out.parquet"
    _job(llm, tmp_path / "in.parquet", out, prompt="question", keep=["source", "score"])
    written = pq.read_table(out)
    assert written.schema.names == [*parquet_output.result_schema("int", []).names, "source", "score"]
    assert written.schema.field("score").type == pa.float64() and written.schema.field("id").type == pa.int64()
    assert b"row numbers" in written.schema.metadata[parquet_output.ID_NOTE_KEY]
    assert sorted(written.column("source").to_pylist()) == [f"s{i}" for i in range(8)]
    assert _texts(out) == {i: reference[qid] for i, qid in enumerate(IDS)}


def test_a_parquet_output_refuses_a_job_with_other_columns_before_serving(llm, tmp_path):
    pq.write_table(_table(), tmp_path / "in.parquet")
    out = tmp_path / "out.parquet"
    _job(llm, tmp_path / "in.parquet", out, id="qid", prompt="question", keep=["source"])
    before = out.read_bytes()
    with pytest.raises(ValueError, match=r"has columns \[.*'source'\]; this job writes \[.*'prompt_logprobs', "
                                         r"'score'\] \(kept columns come from job.columns.keep\)"):
        _job(llm, tmp_path / "in.parquet", out, id="qid", prompt="question", keep=["score"])
    assert out.read_bytes() == before and not part_files(out)


def test_parquet_output_resumes_and_holds_logprobs_and_samples(llm, reference, tmp_path):
    rows = tmp_path / "rows.jsonl"
    lines = [json.dumps({"id": i, "prompt": q}) for i, q in zip(IDS, QUESTIONS)]
    rows.write_text("\n".join(lines[:3]) + "\n")
    out = tmp_path / "out.parquet"
    assert _job(llm, rows, out)["completed"] == 3
    rows.write_text("\n".join(lines) + "\n" + json.dumps({"id": "x", "prompt": "a string id",
                                                          "sampling": {"n": 2, "logprobs": 2}}) + "\n")
    metrics = _job(llm, rows, out)
    assert (metrics["already_done"], metrics["completed"], metrics["errors"]) == (3, 5, 1)  # "x": not an int id
    assert _texts(out) == reference and not part_files(out)
    errors = [json.loads(line) for line in out.with_name("out.parquet.errors.jsonl").read_text().splitlines()]
    assert "id column holds integers" in errors[0]["error"]

    rows.write_text(json.dumps({"id": "x", "prompt": "a string id", "sampling": {"n": 2, "logprobs": 2}}) + "\n")
    _job(llm, rows, tmp_path / "samples.parquet")
    (row,) = pq.read_table(tmp_path / "samples.parquet").to_pylist()
    assert row["id"] == "x" and row["text"] is None and [c["index"] for c in row["choices"]] == [0, 1]
    entry = row["choices"][0]["logprobs"][0]
    assert set(entry) == {"token_id", "logprob", "top"} and len(entry["top"]) == 2


def test_csv_columns_are_read_as_written(tmp_path):
    """Ids keep their leading zeros, and a column that looks numeric for its first blocks may hold text later."""
    path = tmp_path / "in.csv"
    ids = ["007", "8", *(str(i) for i in range(100, 40_100)), "abc"]  # over a megabyte: several blocks
    path.write_text("id,prompt,tag\n" + "".join(f"{i},say something number {i},{i}\n" for i in ids))
    table = TableInput(path, "csv", _columns(keep=["tag"]))
    assert table.id_type == "str" and table.kept_fields() == [pa.field("tag", pa.string())]
    rows = list(table.rows(llm_defaults(), chat_template=False))
    assert [r.id for r in rows] == ids and all(r.error is None for r in rows)
    assert rows[0].keep == {"tag": "007"} and rows[-1].keep == {"tag": "abc"}


def test_a_csv_cell_that_is_not_utf8_or_a_blank_id_fails_its_row_alone(tmp_path):
    path = tmp_path / "in.csv"
    path.write_bytes(b"id,prompt,tag\n1,fine,a\n2,caf\xe9,b\n,no id,c\n3,also fine,\xff\n4,last,d\n")
    rows = list(TableInput(path, "csv", _columns(keep=["tag"])).rows(llm_defaults(), chat_template=False))
    assert [(r.id, r.prompt, r.keep) for r in rows if r.error is None] == [("1", "fine", {"tag": "a"}),
                                                                          ("4", "last", {"tag": "d"})]
    assert [r.error for r in rows if r.error is not None] == [
        "row 1: column 'prompt' is not valid UTF-8 (byte 0xe9 at byte 4)",
        "row 2: column 'id' holds no usable id (a non-blank string or an integer): ''",
        "row 3: column 'tag' is not valid UTF-8 (byte 0xff at byte 1)"]


def test_a_quote_never_swallows_the_rows_after_it(tmp_path):
    """A TSV has no quoting: a field starting with '"' is text. A CSV keeps RFC 4180 quoting (a quoted field may
    hold newlines and doubled quotes), and one whose quoted field is never closed, which pyarrow would read to the
    end of the file, is refused, naming its line."""
    tsv = tmp_path / "in.tsv"
    tsv.write_text('id\tprompt\n1\t"Hello, he said\n2\tworld\n3\tx\n')
    rows = list(TableInput(tsv, "csv", _columns()).rows(llm_defaults(), chat_template=False))
    assert [(r.id, r.prompt) for r in rows] == [("1", '"Hello, he said'), ("2", "world"), ("3", "x")]
    csv = tmp_path / "in.csv"
    csv.write_text('id,prompt\n1,"a ""quoted"" word\non two lines"\n2,5" screen\n3,"b"\n')
    rows = list(TableInput(csv, "csv", _columns()).rows(llm_defaults(), chat_template=False))
    assert [(r.id, r.prompt) for r in rows] == [("1", 'a "quoted" word\non two lines'), ("2", '5" screen'), ("3", "b")]
    csv.write_text('id,prompt\n1,fine\n2,"Hello, he said\n3,world\n4,x\n')
    with pytest.raises(InputError, match="the quoted field that opens on line 3 is never closed"):
        TableInput(csv, "csv", _columns())


def test_a_row_with_another_field_count_anywhere_in_a_csv_is_refused_before_any_row_is_read(tmp_path):
    """pyarrow stops at such a row where it reads it: past the first block, that was mid-job."""
    for name, sep in (("in.csv", ","), ("in.tsv", "\t")):
        lines = [f"id{sep}prompt"] + [f"{i}{sep}say something number {i} " + "x" * 100 for i in range(17_000)]
        lines[16_501] = f"16500{sep}hello{sep}extra"  # past the first megabyte
        path = tmp_path / name
        path.write_text("\n".join(lines) + "\n")
        with pytest.raises(InputError, match=r"Expected 2 columns, got 3: 16500.hello.extra; every row needs as many "
                                             r"fields as the header"):
            TableInput(path, "csv", _columns())
        del lines[16_501]
        path.write_text("\n".join(lines) + "\n")
        assert len(list(TableInput(path, "csv", _columns()).rows(llm_defaults(), chat_template=False))) == 16_999


def test_a_messages_cell_nested_past_pythons_stack_fails_its_row_alone(tmp_path):
    chat = json.dumps([{"role": "user", "content": "Hi"}])
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [1, 2, 3], "messages": [chat, "[" * 100_000 + "]" * 100_000, chat]}), path)
    rows = list(TableInput(path, "parquet", _columns()).rows(llm_defaults(), chat_template=True))
    assert [r.id for r in rows if r.error is None] == [1, 3]
    assert [r.error for r in rows if r.error is not None] == [
        "row 1: column 'messages' holds text that is not a JSON list of messages"]


# ---- bad inputs --------------------------------------------------------------------------------------------------
def _columns(**names: object) -> JobColumnsSection:
    return JobColumnsSection(**names)


def test_bad_tables_say_what_is_wrong(tmp_path):
    pq.write_table(_table(), tmp_path / "in.parquet")
    present = "['qid', 'question', 'source', 'score']"
    cases = [
        (_columns(prompt="prompt_text"), "job.columns.prompt='prompt_text' is not a column"),
        (_columns(id="uid", prompt="question"), "job.columns.id='uid' is not a column"),
        (_columns(prompt="question", keep=["nope"]), "job.columns.keep='nope' is not a column"),
        (_columns(), "has no prompt column: name it with job.columns.prompt=<column>"),
        (_columns(prompt="question", messages="source"), "has both a 'question' and a 'source' column"),
        (_columns(prompt="question", keep=["text"]), None),
    ]
    for columns, message in cases:
        with pytest.raises(InputError) as raised:
            TableInput(tmp_path / "in.parquet", "parquet", columns)
        if message is None:  # a kept column may not shadow a result column
            pq.write_table(_table().append_column("text", pa.array(["t"] * 8)), tmp_path / "in.parquet")
            with pytest.raises(InputError, match="'text' is also a result column"):
                TableInput(tmp_path / "in.parquet", "parquet", columns)
            continue
        assert message in str(raised.value), str(raised.value)
        if "is not a column" in message or "no prompt column" in message:
            assert present in str(raised.value)
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(InputError, match=r"DatasetDict with splits \['train', 'test'\]: point job.input at one"):
        table_kind(tmp_path / "dd")


def test_repeated_column_names_and_a_header_that_is_not_utf8_are_named(tmp_path):
    """Two columns of one name (a CSV header, a Parquet file) cannot be told apart, a keep list naming a column
    twice would write it twice, and a header in Latin-1 cannot be read: each is one line naming the file or key."""
    (tmp_path / "dup.csv").write_text("id,prompt,id\n1,hi,2\n")
    with pytest.raises(InputError, match=r"dup.csv has more than one column named \['id'\]"):
        TableInput(tmp_path / "dup.csv", "csv", _columns())
    (tmp_path / "unused.csv").write_text("id,prompt,note,note\n1,hi,a,b\n")  # repeated, but not read: fine
    assert TableInput(tmp_path / "unused.csv", "csv", _columns()).columns.prompt == "prompt"
    table = pa.Table.from_arrays([pa.array([1]), pa.array(["hi"]), pa.array(["x"])], names=["id", "prompt", "prompt"])
    pq.write_table(table, tmp_path / "dup.parquet")
    with pytest.raises(InputError, match=r"dup.parquet has more than one column named \['prompt'\]"):
        TableInput(tmp_path / "dup.parquet", "parquet", _columns())
    pq.write_table(_table(), tmp_path / "in.parquet")
    with pytest.raises(InputError, match=r"job.columns.keep=\['source', 'source'\] names \['source'\] more than once"):
        TableInput(tmp_path / "in.parquet", "parquet", _columns(prompt="question", keep=["source", "source"]))
    (tmp_path / "latin1.csv").write_bytes(b"id,caf\xe9\n1,hi\n")
    with pytest.raises(InputError, match=r"latin1.csv: a column name in its header is not valid UTF-8 \(byte 0xe9\)"):
        TableInput(tmp_path / "latin1.csv", "csv", _columns())


def test_a_bad_table_fails_at_start_with_one_line(text_model, llm, tmp_path):
    fake = tmp_path / "in.parquet"
    fake.write_text('{"id": 1, "prompt": "I am JSON"}\n')
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text(json.dumps({"id": 1, "prompt": "x"}) + "\n")
    pq.write_table(_table(), tmp_path / "good.parquet")
    cases = [
        ([f"job.input={fake}"], f"job.input={fake} is not a readable Parquet file: Parquet magic bytes not found"),
        ([f"job.input={tmp_path / 'good.parquet'}", "job.columns.prompt=q"],
         "job.columns.prompt='q' is not a column of"),
    ]
    for extra, message in cases:
        proc = subprocess.run([sys.executable, "launch.py", f"model.path={text_model}", "engine.device=cpu",
                               f"job.output={tmp_path / 'out.jsonl'}", *extra], cwd=REPO, env=_env(),
                              capture_output=True, text=True, timeout=300)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
        assert proc.returncode != 0 and len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
    base = llm.cfg.job
    for keys, message in [({"input": str(jsonl), "columns": _columns(keep=["a"])},
                           "job.columns.keep=['a'] applies to table inputs"),
                          ({"input": str(tmp_path / "good.parquet"), "format": "openai"},
                           "job.format=openai applies to JSONL inputs")]:
        llm.cfg.job = replace(base, output=str(tmp_path / "out.jsonl"), **keys)
        try:
            with pytest.raises(InputError, match=message.replace("[", r"\[").replace("]", r"\]")):
                run_job(llm, "cfg")
        finally:
            llm.cfg.job = base
    assert not (tmp_path / "out.jsonl").exists()


# ---- streaming ---------------------------------------------------------------------------------------------------
def test_rows_are_read_a_window_at_a_time(tmp_path):
    pulled = 0

    def rows():
        nonlocal pulled
        for i in range(100_000):
            pulled += 1
            yield JobRow(i, i, prompt="x", sampling=llm_defaults())

    todo = Todo(rows(), done={json.dumps(1)}, window=1000)
    todo.fill(0)
    assert 2000 <= pulled <= 3000 and todo.total > 100_000  # two windows planned; the end is not known yet
    assert [r.id for r in todo.rows(range(0, 3))] == [0, 2, 3]  # id 1 is done
    assert [r.id for r in todo.rows(range(5000, 5002))] == [5001, 5002]
    assert pulled <= 7000 and len(todo._planned) <= 3  # windows before the claims are let go
    assert todo.rows(range(99_990, 200_000))[-1].id == 99_999 and todo.exhausted and todo.total == 99_999
    assert todo.rows(range(99_999, 100_005)) == [] and (todo.read, todo.already_done) == (100_000, 1)


def llm_defaults():
    from runtime.sampling_params import SamplingParams

    return SamplingParams()


def test_a_large_parquet_table_streams(tmp_path):
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"id": range(200_000), "prompt": [f"question {i}" for i in range(200_000)]}), path,
                   row_group_size=20_000)
    table = TableInput(path, "parquet", _columns())
    batches = table.batches()
    first = next(batches)
    assert first.num_rows <= 4096 and first.schema.names == ["id", "prompt"]
    rows = table.rows(llm_defaults(), chat_template=False)
    assert next(rows).prompt == "question 0"


# ---- Parquet output parts ----------------------------------------------------------------------------------------
def _record(i: int) -> dict:
    return {"id": i, "text": f"t{i}", "finish_reason": "length", "completion_tokens": 1, "prompt_tokens": 2}


def test_parquet_parts_are_flushed_whole_and_merged_once(tmp_path):
    out = tmp_path / "out.parquet"
    schema = parquet_output.result_schema("int", [])
    sink = parquet_output.ParquetSink(out, 1, schema, row_group_rows=4, flush_every_s=3600)
    for i in range(10):
        sink.write(_record(i))
    assert len(part_files(out)) == 2 and parquet_output.done_keys(out) == {json.dumps(i) for i in range(8)}
    # killed here: rows 8 and 9 were buffered (the open row group) and are lost
    (tmp_path / f".{out.name}.part-1-9-000009.tmp").write_bytes(b"PAR1 torn")  # a flush killed before its rename
    assert parquet_output.merge_parts(out, row_group_rows=3) == 8
    assert pq.read_table(out).column("id").to_pylist() == list(range(8)) and not part_files(out)
    assert pq.ParquetFile(out).metadata.num_row_groups == 3 and not list(tmp_path.glob(".*"))

    again = parquet_output.ParquetSink(out, 0, schema, row_group_rows=100, flush_every_s=0)  # every write flushes
    for i in (6, 7, 8):  # 6 and 7 as after a merge killed between its rename and its deletes
        again.write(_record(i))
    again.close()
    (tmp_path / "out.parquet.part-2-1-000000").write_bytes(b"not parquet")
    assert parquet_output.done_keys(out) == {json.dumps(i) for i in range(9)}  # the damaged part is set aside
    assert parquet_output.merge_parts(out, row_group_rows=100) == 1
    assert pq.read_table(out).column("id").to_pylist() == list(range(9))
    assert (tmp_path / ".out.parquet.part-2-1-000000.unreadable").exists()
    assert parquet_output.merge_parts(out, row_group_rows=100) == 0  # nothing left to merge
    (tmp_path / "out.parquet.part-2-1-000000").write_bytes(b"damaged again")  # set aside beside the first
    assert parquet_output.done_keys(out) == {json.dumps(i) for i in range(9)}
    assert (tmp_path / ".out.parquet.part-2-1-000000.unreadable").read_bytes() == b"not parquet"
    assert (tmp_path / ".out.parquet.part-2-1-000000.unreadable.1").read_bytes() == b"damaged again"


def test_an_output_that_is_not_parquet_is_refused_and_left_as_it_is(tmp_path):
    """job.output=x.parquet naming someone's other file: the job stops naming it, and the file stays where and
    what it was."""
    out = tmp_path / "out.parquet"
    out.write_text("notes, not a table\n")
    for repair in (False, True):
        with pytest.raises(ConfigError, match=r"job.output=.*out.parquet is not readable Parquet .*: move it away"):
            parquet_output.check_columns(out, [], repair)
    with pytest.raises(ConfigError, match="is not readable Parquet"):
        parquet_output.done_keys(out)
    assert out.read_text() == "notes, not a table\n" and sorted(p.name for p in tmp_path.iterdir()) == ["out.parquet"]


@pytest.mark.parametrize("bad_id", [2**70, "\ud800x"], ids=["beyond-int64", "lone-surrogate"])
def test_an_id_the_id_column_cannot_hold_is_that_rows_error_and_loses_no_other_row(tmp_path, bad_id):
    out = tmp_path / "out.parquet"
    good = [1, 3] if isinstance(bad_id, int) else ["a", "c"]
    sink = parquet_output.ParquetSink(out, 0, parquet_output.result_schema("int" if isinstance(bad_id, int) else "str",
                                                                           []), 100, 3600)
    sink.write(_record(good[0]))
    with pytest.raises(ValueError, match="Parquet"):
        sink.write(_record(bad_id))
    sink.write(_record(good[1]))
    sink.close()
    assert parquet_output.done_keys(out) == {json.dumps(g) for g in good}


def test_parquet_rows_are_flushed_after_fsync_every_s_with_no_other_row_finishing(tmp_path):
    out = tmp_path / "out.parquet"
    sink = parquet_output.ParquetSink(out, 0, parquet_output.result_schema("int", []), 100, flush_every_s=0.2)
    sink.write(_record(1))
    sink.tick()
    assert not part_files(out)  # younger than job.fsync_every_s: still buffered
    time.sleep(0.3)
    sink.tick()  # the step loop calls it every step, as a long row generates
    assert parquet_output.done_keys(out) == {json.dumps(1)}


def test_a_kept_column_of_another_type_is_refused_before_serving(llm, tmp_path):
    out = tmp_path / "out.parquet"
    pq.write_table(pa.table({"qid": [1, 2], "question": ["Say hi.", "Name a color."], "score": [10, 20]}),
                   tmp_path / "in.parquet")
    _job(llm, tmp_path / "in.parquet", out, id="qid", prompt="question", keep=["score"])
    pq.write_table(pa.table({"qid": [1, 2, 3], "question": ["Say hi.", "Name a color.", "Name a fruit."],
                             "score": [10.0, 20.0, 40.5]}), tmp_path / "in.parquet")
    before = out.read_bytes()
    with pytest.raises(ValueError, match="keeps columns of other types than job.input has now "
                                         r"\(score: int64 then, double now\)"):
        _job(llm, tmp_path / "in.parquet", out, id="qid", prompt="question", keep=["score"])
    assert out.read_bytes() == before and not part_files(out)


def test_kept_columns_typed_differently_by_shards_lose_no_row(llm, tmp_path):
    """A kept column of nulls in one shard and of strings in the next holds strings, ints and floats floats; a value
    the output's column cannot hold is that row's error and every other row is written; an output whose column a
    first run (a sample: the first shard) typed null takes the rest of the input."""
    shards = tmp_path / "shards"
    shards.mkdir()
    pq.write_table(pa.table({"qid": IDS[:4], "question": QUESTIONS[:4], "note": pa.array([None] * 4, pa.null()),
                             "score": [1, 2**62 + 1, 3, 4]}), shards / "part-0.parquet")  # no double holds 2**62 + 1
    pq.write_table(pa.table({"qid": IDS[4:], "question": QUESTIONS[4:], "note": ["a", None, "c", "d"],
                             "score": [0.5, 1.5, 2.5, 3.5]}), shards / "part-1.parquet")
    columns = {"id": "qid", "prompt": "question", "keep": ["note", "score"]}
    assert TableInput(shards, "parquet", _columns(**columns)).kept_fields() == [pa.field("note", pa.string()),
                                                                               pa.field("score", pa.float64())]
    out = tmp_path / "out.parquet"
    m = _job(llm, shards, out, **columns)
    assert (m["completed"], m["errors"]) == (7, 1)
    (error,) = [json.loads(line) for line in (tmp_path / "out.parquet.errors.jsonl").read_text().splitlines()]
    assert error["id"] == IDS[1] and "column 'score' (double) cannot hold 4611686018427387905" in error["error"]
    written = pq.read_table(out)
    assert written.schema.field("note").type == pa.string() and written.num_rows == 7
    assert dict(zip(written.column("id").to_pylist(), written.column("note").to_pylist())) == {
        **{i: None for i in (IDS[0], *IDS[2:4])}, **dict(zip(IDS[4:], ["a", None, "c", "d"]))}

    sample = tmp_path / "sample.parquet"
    _job(llm, shards / "part-0.parquet", sample, id="qid", prompt="question", keep=["note"])
    assert pq.read_schema(sample).field("note").type == pa.null()
    m = _job(llm, shards, sample, id="qid", prompt="question", keep=["note"])
    assert (m["already_done"], m["completed"]) == (4, 4)
    written = pq.read_table(sample)
    assert written.schema.field("note").type == pa.string() and sorted(written.column("id").to_pylist()) == sorted(IDS)


def test_a_parquet_output_of_kept_types_parquet_stores_otherwise_resumes(llm, tmp_path):
    """Parquet reads timestamp[s] back as timestamp[ms], time32[s] as time32[ms] and date64 as date32: a rerun of
    a job that keeps such columns (an Arrow input's) resumes; a type that did change stops it before the model
    loads."""
    import datetime

    when = datetime.datetime(2024, 5, 6, 7, 8, 9)
    table = pa.table({"qid": IDS, "question": QUESTIONS, "when": pa.array([when] * 8, pa.timestamp("s")),
                      "at": pa.array([datetime.time(7, 8, 9)] * 8, pa.time32("s")),
                      "day": pa.array([when] * 8, pa.date64())})
    source, out = tmp_path / "in.arrow", tmp_path / "out.parquet"
    columns = {"id": "qid", "prompt": "question", "keep": ["when", "at", "day"]}
    for rows in (table.slice(0, 4), table):  # killed after 4 rows, then rerun
        with pa.ipc.new_file(source, rows.schema) as w:
            w.write_table(rows)
        m = _job(llm, source, out, **columns)
    assert (m["already_done"], m["completed"]) == (4, 4)
    assert set(pq.read_table(out).column("when").to_pylist()) == {when}
    changed = table.set_column(3, "at", pa.array([datetime.time(7, 8, 9)] * 8, pa.time64("us")))
    with pa.ipc.new_file(source, changed.schema) as w:
        w.write_table(changed)
    proc = subprocess.run([sys.executable, "launch.py", "model.path=/nonexistent", f"job.input={source}",
                           f"job.output={out}", "job.columns.id=qid", "job.columns.prompt=question",
                           "job.columns.keep=[when,at,day]"], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert "(at: time32[ms] then, time64[us] now)" in errors[0] and "nonexistent" not in proc.stderr


def test_an_empty_table_gives_an_empty_parquet_output_with_its_columns(llm, tmp_path):
    pq.write_table(pa.table({"qid": pa.array([], pa.int64()), "question": pa.array([], pa.string())}),
                   tmp_path / "empty.parquet")
    out = tmp_path / "out.parquet"
    m = _job(llm, tmp_path / "empty.parquet", out, id="qid", prompt="question")
    table = pq.read_table(out)
    assert m["completed"] == 0 and table.num_rows == 0 and table.schema.names[:3] == ["id", "text", "finish_reason"]


def test_an_output_a_rerun_would_read_as_a_shard_is_refused(tmp_path):
    from runtime.config import ConfigError
    from runtime.frontend.job_files import JobPaths

    shards = tmp_path / "shards"
    shards.mkdir()

    def paths(output: Path) -> JobPaths:
        return JobPaths(input=shards, output=output, errors=tmp_path / "e.jsonl", metrics=tmp_path / "m.json",
                        config=tmp_path / "c.yaml")

    for shard in (shards / "results.parquet", shards / "sub" / "out.arrow"):
        with pytest.raises(ConfigError, match=f"job.output={shard} is in the input folder .* read it as one of"):
            paths(shard).check_distinct()
    for beside in (shards / "results.jsonl", shards / "_out" / "r.parquet", tmp_path / "results.parquet"):
        paths(beside).check_distinct()  # not a shard: read by no rerun


def test_an_empty_output_decides_no_id_type(llm, tmp_path):
    """An empty input's output (its id column a guess) takes the first real rows' ids on the rerun."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("not json\n")
    out = tmp_path / "out.parquet"
    assert _job(llm, rows, out)["completed"] == 0 and pq.read_table(out).num_rows == 0
    rows.write_text("".join(json.dumps({"id": f"q{i}", "prompt": "Say hi."}) + "\n" for i in range(3)))
    assert _job(llm, rows, out)["completed"] == 3
    assert pq.read_table(out).column("id").to_pylist() == ["q0", "q1", "q2"]


def test_a_job_flushes_parquet_rows_while_a_long_row_still_generates(llm, tmp_path, monkeypatch):
    flushed_before_the_long_row: list[int] = []
    write = parquet_output.ParquetSink.write

    def watched(self: parquet_output.ParquetSink, record: dict) -> None:
        if record["id"] == 2:
            flushed_before_the_long_row.append(self.flushed)
        write(self, record)

    monkeypatch.setattr(parquet_output.ParquetSink, "write", watched)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": 1, "prompt": "Hi", "sampling": {"max_new_tokens": 1}}) + "\n"
                    + json.dumps({"id": 2, "prompt": "Hello", "sampling": {"max_new_tokens": 60, "ignore_eos": True}})
                    + "\n")
    base = llm.cfg.job
    llm.cfg.job = replace(base, fsync_every_s=0.01)
    try:
        _job(llm, rows, tmp_path / "out.parquet")
    finally:
        llm.cfg.job = base
    assert flushed_before_the_long_row == [1]  # row 1 reached disk during row 2's 60 steps


# ---- kill -9 and rerun -------------------------------------------------------------------------------------------
def _parquet_rows(out: Path) -> int:
    count = 0
    for f in [out, *part_files(out)]:
        try:
            count += pq.ParquetFile(f).metadata.num_rows
        except (OSError, pa.ArrowException):  # merged away meanwhile
            pass
    return count


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2], ids=["dp1", "dp2"])
def test_kill_9_with_a_parquet_output_then_rerun_gives_one_row_per_id(text_model, tmp_path, nproc):
    rows = tmp_path / "rows.parquet"
    count = 36
    pq.write_table(pa.table({"id": [f"q{i}" for i in range(count)],
                             "prompt": [f"Row {i}: say something about {i * 7}." for i in range(count)]}), rows)
    launch = [f"--nproc-per-node={nproc}"] if nproc > 1 else []
    common = [f"model.path={text_model}", "engine.device=cpu", "model.max_seq_len=128", f"job.input={rows}",
              "job.progress=false", "job.chat_template=false", "sampling.temperature=0", "sampling.ignore_eos=true",
              "sampling.max_new_tokens=24", "scheduler.max_running_requests=2", "job.row_group_rows=3",
              "job.fsync_every_s=0.2"]
    reference = tmp_path / "reference.parquet"
    done = subprocess.run([sys.executable, "launch.py", *common, f"job.output={reference}"], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "out.parquet"
    proc = subprocess.Popen([sys.executable, "launch.py", *launch, *common, f"job.output={out}"], cwd=REPO, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while _parquet_rows(out) < 8:
            assert proc.poll() is None and time.time() < deadline, "the job ended before it could be killed"
            time.sleep(0.05)
    finally:
        kill_job(proc)
    assert 8 <= _parquet_rows(out) < count and part_files(out) and not out.exists()
    assert (tmp_path / "out.parquet.lock").exists()  # left by the killed run; it must not block the rerun
    rerun = subprocess.run([sys.executable, "launch.py", *common, f"job.output={out}"], cwd=REPO, env=_env(),
                           capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert _texts(out) == _texts(reference)  # exactly one row per id (checked in _texts), the same texts
    assert len(_texts(out)) == count and not part_files(out)
    metrics = json.loads((tmp_path / "out.parquet.metrics.json").read_text())
    assert metrics["already_done"] >= 8 and metrics["already_done"] + metrics["completed"] == count


def test_jsonl_jobs_need_no_pyarrow_import_and_every_table_suffix_is_known():
    """JSONL inputs are recognised without importing the table module (and pyarrow): its suffixes must match."""
    from runtime.frontend.job_inputs import TABLE_SUFFIXES
    from runtime.frontend.tables import SUFFIXES

    assert set(TABLE_SUFFIXES) == set(SUFFIXES)


def test_kept_values_json_has_no_type_for_are_written_as_strict_json(llm, tmp_path):
    """NaN, infinities, bytes, timestamps, durations and decimals in kept columns: the JSONL output is strict JSON (NaN used
    to be written bare, bytes as their Python repr); a Parquet output keeps the values and their types."""
    import datetime
    import decimal

    when = datetime.datetime(2024, 5, 6, 7, 8, 9, tzinfo=datetime.timezone.utc)
    table = pa.table({
        "qid": IDS[:4], "question": QUESTIONS[:4],
        "score": [float("nan"), float("inf"), -float("inf"), 1.25],
        "blob": [b"\x00\xff", b"", None, b"abc"],
        "when": pa.array([when] * 4, pa.timestamp("us", tz="UTC")),
        "price": pa.array([decimal.Decimal("12345678901234567890.123456789")] * 4, pa.decimal128(38, 9)),
        "nested": [{"xs": [float("nan"), 2.0]}] * 4,
        "took": pa.array([datetime.timedelta(days=1, seconds=3723, microseconds=500000), datetime.timedelta(0),
                          -datetime.timedelta(microseconds=1), None], pa.duration("us")),
    })
    pq.write_table(table, tmp_path / "in.parquet")
    keep = ["score", "blob", "when", "price", "nested", "took"]
    out = tmp_path / "out.jsonl"
    assert _job(llm, tmp_path / "in.parquet", out, id="qid", prompt="question", keep=keep)["errors"] == 0

    def refuse(constant: str) -> None:
        raise AssertionError(f"not strict JSON: {constant}")

    rows = {r["id"]: r for r in (json.loads(line, parse_constant=refuse) for line in out.read_text().splitlines())}
    assert [rows[i]["score"] for i in IDS[:4]] == [None, None, None, 1.25]
    assert [rows[i]["blob"] for i in IDS[:4]] == ["AP8=", "", None, "YWJj"]
    assert {rows[i]["when"] for i in IDS[:4]} == {"2024-05-06T07:08:09+00:00"}
    assert {rows[i]["price"] for i in IDS[:4]} == {"12345678901234567890.123456789"}
    assert {json.dumps(rows[i]["nested"]) for i in IDS[:4]} == {'{"xs": [null, 2.0]}'}
    assert [rows[i]["took"] for i in IDS[:4]] == ["P1DT1H2M3.5S", "P0DT0H0M0S", "-P0DT0H0M0.000001S", None]

    out_parquet = tmp_path / "out.parquet"
    _job(llm, tmp_path / "in.parquet", out_parquet, id="qid", prompt="question", keep=keep)
    written = pq.read_table(out_parquet).sort_by("id")
    for name in keep:
        assert written.schema.field(name).type == table.schema.field(name).type
    by_id = dict(zip(written.column("id").to_pylist(), written.column("score").to_pylist()))
    assert by_id[IDS[3]] == 1.25 and by_id[IDS[1]] == float("inf") and by_id[IDS[0]] != by_id[IDS[0]]  # NaN
    assert dict(zip(written.column("id").to_pylist(), written.column("blob").to_pylist()))[IDS[0]] == b"\x00\xff"
    # Degenerate logits' logprobs are numbers JSON cannot hold too: null, the line stays strict.
    line = json_line({"id": 1, "logprobs": [{"token_id": 5, "logprob": -float("inf")}], "cumulative_logprob": math.nan})
    assert json.loads(line, parse_constant=refuse) == {"id": 1, "logprobs": [{"token_id": 5, "logprob": None}],
                                                       "cumulative_logprob": None}


def test_nanosecond_times_in_kept_columns_are_carried_exactly(llm, tmp_path):
    """pandas writes timestamps in nanoseconds, which no Python type holds: kept, they reach a JSONL output as
    exact ISO 8601 text and a Parquet output as the same values; nested ones are refused at start, naming the
    column."""
    nanos = [1_700_000_000_123_456_789, 1_700_000_000_000_000_000, -1, None]
    table = pa.table({
        "qid": IDS[:4], "question": QUESTIONS[:4],
        "at": pa.array(nanos, pa.timestamp("ns", tz="UTC")),
        "naive": pa.array(nanos, pa.timestamp("ns")),
        "clock": pa.array([3_723_000_000_001, 0, 86_399_999_999_999, None], pa.time64("ns")),
        "took": pa.array([90_061_000_000_001, 5_000, -1, None], pa.duration("ns")),
    })
    pq.write_table(table, tmp_path / "in.parquet")
    keep = ["at", "naive", "clock", "took"]
    out = tmp_path / "out.jsonl"
    assert _job(llm, tmp_path / "in.parquet", out, id="qid", prompt="question", keep=keep)["errors"] == 0
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert [rows[i]["at"] for i in IDS[:4]] == [
        "2023-11-14T22:13:20.123456789+00:00", "2023-11-14T22:13:20+00:00", "1969-12-31T23:59:59.999999999+00:00",
        None]
    assert [rows[i]["naive"] for i in IDS[:4]] == [
        "2023-11-14T22:13:20.123456789", "2023-11-14T22:13:20", "1969-12-31T23:59:59.999999999", None]
    assert [rows[i]["clock"] for i in IDS[:4]] == ["01:02:03.000000001", "00:00:00", "23:59:59.999999999", None]
    assert [rows[i]["took"] for i in IDS[:4]] == ["P1DT1H1M1.000000001S", "P0DT0H0M0.000005S",
                                                  "-P0DT0H0M0.000000001S", None]

    out_parquet = tmp_path / "out.parquet"
    assert _job(llm, tmp_path / "in.parquet", out_parquet, id="qid", prompt="question", keep=keep)["errors"] == 0
    written = pq.read_table(out_parquet)
    order = [written.column("id").to_pylist().index(i) for i in IDS[:4]]
    for name in keep:
        assert written.schema.field(name).type == table.schema.field(name).type
        assert written.column(name).take(order).combine_chunks().equals(table.column(name).combine_chunks()), name

    nested = table.append_column("stamps", pa.array([[n] for n in nanos], pa.list_(pa.timestamp("ns"))))
    pq.write_table(nested, tmp_path / "nested.parquet")
    with pytest.raises(InputError, match=r"column 'stamps' \(list<element: timestamp\[ns\]>\) holds nanosecond times"):
        _job(llm, tmp_path / "nested.parquet", tmp_path / "nested.jsonl", id="qid", prompt="question",
             keep=["stamps"])
