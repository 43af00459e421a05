"""Table inputs (Parquet, CSV, Arrow, shard folders, ``save_to_disk`` folders), read with pyarrow a batch at a
time so a table larger than memory streams. Without an id column the row number is the id."""

from __future__ import annotations

import codecs
import json
import mmap
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from runtime.frontend.job_files import PARQUET_SUFFIXES, InputError, JobRow, first_line, normalize_id, shard_name
from runtime.sampling_params import SamplingParams

BATCH_ROWS = 4096
SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".tsv": "csv", ".arrow": "arrow",
            ".feather": "arrow", ".ipc": "arrow"}
RESULT_COLUMNS = ("id", "text", "finish_reason", "completion_tokens", "prompt_tokens", "logprobs",
                  "cumulative_logprob", "choices", "prompt_logprobs")
_MESSAGE_KEYS = ("role", "content")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system", "tool": "tool"}


def table_kind(path: Path) -> str | None:
    """parquet, csv, arrow or datasets for a table input; None for a JSONL file."""
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
            raise InputError(f"job.input={path} holds a datasets DatasetDict with splits {splits}: point job.input "
                             f"at one split's folder (e.g. {path / (splits[0] if splits else 'train')})")
        if (path / "state.json").is_file():
            return "datasets"
        if _data_files(path, PARQUET_SUFFIXES):
            return "parquet"
        if _data_files(path, (".arrow",)):
            return "arrow"
        raise InputError(f"job.input={path} is a folder without .parquet or .arrow files (nor a folder written by "
                         "datasets' save_to_disk)")
    return SUFFIXES.get(path.suffix.lower())




def _data_files(folder: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """A folder's shards, in name order: files with one of ``suffixes``, none under a name starting with '.' or
    '_' (Spark's _SUCCESS, a job's own lock). A dataset card or any other file beside them is not a shard."""
    return sorted(f for f in folder.rglob("*") if shard_name(folder, f, suffixes) and f.is_file())


@dataclass
class Columns:
    id: str | None
    prompt: str | None
    messages: str | None
    keep: list[str]


class TableInput:
    """One table input: its files, its schema and the chosen columns, checked when opened."""

    def __init__(self, path: Path, kind: str, columns: Any) -> None:
        self.path, self.kind = path, kind
        self.files = self._files()
        schemas = [self._schema(file) for file in self.files]
        self.schema = schemas[0]
        if kind == "csv":  # one file
            if not self._tsv:
                self._check_quotes()
            self._check_field_counts()
        self.columns = self._choose(columns)
        self._kept = self._kept_types(schemas)

    @property
    def id_note(self) -> str | None:
        """Said in the log, the metrics and the Parquet output when ids are row numbers."""
        return None if self.columns.id else f"ids are row numbers (from 0) of {self.path}: it has no 'id' column"

    @property
    def id_type(self) -> str | None:
        """int or str when the id column says which (row numbers are ints)."""
        if self.columns.id is None:
            return "int"
        kind = self.schema.field(self.columns.id).type
        if pa.types.is_integer(kind) or pa.types.is_floating(kind):
            return "int"
        return "str" if pa.types.is_string(kind) or pa.types.is_large_string(kind) else None

    def kept_fields(self) -> list[pa.Field]:
        return self._kept

    @property
    def wanted(self) -> list[str]:
        """The chosen columns, each once."""
        c = self.columns
        return list(dict.fromkeys(n for n in (c.id, c.prompt, c.messages, *c.keep) if n))

    def _kept_types(self, schemas: list[pa.Schema]) -> list[pa.Field]:
        """Every file holds the chosen columns; a kept column's type is one that holds its values in every file
        (a shard of nulls is typed null, another's strings are strings: strings)."""
        for file, schema in zip(self.files, schemas):
            absent = [n for n in self.wanted if n not in schema.names]
            if absent:
                raise InputError(f"{file} has no column(s) {absent}; its columns: {schema.names}")
            repeated = [n for n in self.wanted if schema.names.count(n) > 1]
            if repeated:
                raise InputError(f"{file} has more than one column named {repeated}: rename them, so the column to "
                                 "read is known")
            for name in self.wanted:
                kind = schema.field(name).type
                if not _is_nanosecond_time(kind) and _holds_nanosecond_times(kind):
                    raise InputError(f"{file}: column {name!r} ({kind}) holds nanosecond times inside it, which "
                                     "a job cannot carry exactly; cast them to microseconds, or leave the column out")
        keep = self.columns.keep
        try:
            unified = pa.unify_schemas([pa.schema([s.field(n) for n in keep]) for s in schemas],
                                       promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise InputError(f"job.input={self.path}: the files of this input give a kept column types no one type "
                             f"holds ({first_line(exc)}); give it one type in every file") from None
        return list(unified)

    def _files(self) -> list[Path]:
        path = self.path
        if self.kind == "datasets":
            state = json.loads((path / "state.json").read_text())
            files = [path / f["filename"] for f in state.get("_data_files", [])]
        elif path.is_dir():
            files = _data_files(path, PARQUET_SUFFIXES if self.kind == "parquet" else (".arrow",))
        else:
            files = [path]
        if not files:
            raise InputError(f"job.input={path} lists no data files")
        return files

    def _schema(self, file: Path) -> pa.Schema:
        try:
            if self.kind == "parquet":
                return pq.ParquetFile(file).schema_arrow
            if self.kind == "csv":  # text as written: "007" stays an id, a late "abc" cannot break a column's type
                names = pa_csv.open_csv(file, parse_options=self._csv_parse()).schema.names
                return pa.schema([pa.field(name, pa.string()) for name in names])
            return self._open_arrow(file).schema
        except UnicodeDecodeError as exc:  # a CSV header that is not UTF-8
            raise InputError(f"job.input={file}: a column name in its header is not valid UTF-8 (byte "
                             f"0x{exc.object[exc.start]:02x}); save the file as UTF-8") from None
        except (pa.ArrowException, OSError) as exc:
            raise InputError(f"job.input={file} is not a readable {_KIND_NAMES[self.kind]} file: "
                             f"{first_line(exc)}") from None

    @property
    def _tsv(self) -> bool:
        return self.path.suffix.lower() == ".tsv"

    def _csv_parse(self) -> pa_csv.ParseOptions:
        # Tab-separated values have no quoting: a '"' starting a field is text, never the start of a field that
        # runs on over the next rows.
        return pa_csv.ParseOptions(delimiter="\t" if self._tsv else ",", quote_char=False if self._tsv else '"',
                                   newlines_in_values=True)

    def _check_quotes(self) -> None:
        """pyarrow ends a quoted field that is never closed at the end of the file, every row after it inside
        that field, without a word: such a CSV is refused, naming the line."""
        with open(self.path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                at = _unclosed_quote(data)
                if at is not None:
                    line = data[:at].count(b"\n") + 1
                    raise InputError(f"job.input={self.path}: the quoted field that opens on line {line} is never "
                                     "closed, so every row after it would be read into it; close it (a quote inside "
                                     'a quoted field is written twice: "")')

    def _check_field_counts(self) -> None:
        """A row with more or fewer fields than the header stops pyarrow where it reads it: found here, over the
        whole file (one column kept), before the model loads rather than mid-job."""
        first = self.schema.names[:1]
        convert = pa_csv.ConvertOptions(include_columns=first, column_types=dict.fromkeys(first, pa.binary()))
        try:
            for _ in pa_csv.open_csv(self.path, parse_options=self._csv_parse(), convert_options=convert):
                pass
        except pa.ArrowException as exc:
            raise InputError(f"job.input={self.path} cannot be read as {_KIND_NAMES[self.kind]}: {first_line(exc)}; "
                             "every row needs as many fields as the header") from None

    @staticmethod
    def _open_arrow(file: Path) -> Any:
        """Arrow IPC: the file format, or the stream format (what save_to_disk writes), memory-mapped."""
        source = pa.memory_map(str(file))
        try:
            return pa.ipc.open_file(source)
        except pa.ArrowInvalid:
            return pa.ipc.open_stream(pa.memory_map(str(file)))

    def _choose(self, cfg: Any) -> Columns:
        names = self.schema.names
        keep = list(cfg.keep)
        repeated = sorted({n for n in keep if keep.count(n) > 1})
        if repeated:
            raise InputError(f"job.columns.keep={keep} names {repeated} more than once")

        def missing(key: str, name: str) -> InputError:
            return InputError(f"job.columns.{key}={name!r} is not a column of {self.path}; its columns: {names}")

        for key, default in (("prompt", "prompt"), ("messages", "messages"), ("id", "id")):
            name = getattr(cfg, key)
            if name is not None and name != default and name not in names:
                raise missing(key, name)
        prompt = cfg.prompt if cfg.prompt in names else None
        messages = cfg.messages if cfg.messages in names else None
        if prompt and messages:
            raise InputError(f"{self.path} has both a {prompt!r} and a {messages!r} column: choose one with "
                             "job.columns.prompt=null or job.columns.messages=null")
        if not prompt and not messages:
            raise InputError(f"{self.path} has no prompt column: name it with job.columns.prompt=<column> (text or "
                             f"token ids) or job.columns.messages=<column> (chats); its columns: {names}")
        for name in keep:
            if name not in names:
                raise missing("keep", name)
            if name in RESULT_COLUMNS:
                raise InputError(f"job.columns.keep={keep}: {name!r} is also a result column; keep columns must "
                                 f"have other names than {list(RESULT_COLUMNS)}")
        return Columns(cfg.id if cfg.id in names else None, prompt, messages, keep)

    def batches(self) -> Iterator[pa.RecordBatch]:
        """The chosen columns, in row order, a batch at a time."""
        wanted = self.wanted
        for file in self.files:
            try:
                yield from self._file_batches(file, wanted)
            except (pa.ArrowException, OSError) as exc:
                raise InputError(f"job.input={file} cannot be read as {_KIND_NAMES[self.kind]}: "
                                 f"{first_line(exc)}") from None

    def _file_batches(self, file: Path, wanted: list[str]) -> Iterator[pa.RecordBatch]:
        if self.kind == "parquet":
            yield from pq.ParquetFile(file).iter_batches(batch_size=BATCH_ROWS, columns=wanted)
        elif self.kind == "csv":
            cells = dict.fromkeys(wanted, pa.binary())
            yield from pa_csv.open_csv(file, parse_options=self._csv_parse(),
                                       convert_options=pa_csv.ConvertOptions(include_columns=wanted, column_types=cells))
        else:
            reader = self._open_arrow(file)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches)) \
                if isinstance(reader, pa.ipc.RecordBatchFileReader) else reader
            for batch in batches:
                yield batch.select(wanted)

    def rows(self, defaults: SamplingParams, chat_template: bool) -> Iterator[JobRow]:
        """Every row as a JobRow, in order; a row that cannot be served is an error row naming its number."""
        c = self.columns
        seen: set[str] = set()
        number = 0
        for batch in self.batches():
            size = batch.num_rows
            columns = {name: _values(batch.column(name)) for name in self.wanted}
            errors = _decode_csv_cells(columns, number) if self.kind == "csv" else [None] * size
            ids = columns[c.id] if c.id else range(number, number + size)
            prompts = columns[c.prompt or c.messages]
            for i in range(size):
                if errors[i] is not None:
                    yield JobRow(number + i, None, error=errors[i])
                    continue
                row = self._row(number + i, ids[i], prompts[i], defaults, chat_template, seen)
                if c.keep:
                    row.keep = {name: columns[name][i] for name in c.keep}
                yield row
            number += size

    def _row(self, number: int, raw_id: Any, value: Any, defaults: SamplingParams, chat_template: bool,
             seen: set[str]) -> JobRow:
        c = self.columns
        row_id = normalize_id(raw_id)
        if row_id is None:
            return JobRow(number, None, error=f"row {number}: column {c.id!r} holds no usable id (a non-blank string or "
                                              f"an integer): {raw_id!r}")
        key = json.dumps(row_id)
        if key in seen:
            return JobRow(number, row_id, error=f"row {number}: duplicate id {row_id!r}")
        seen.add(key)
        try:
            prompt = _messages(value) if c.messages else _prompt(value)
        except ValueError as exc:
            return JobRow(number, row_id, error=f"row {number}: column {c.prompt or c.messages!r} {exc}")
        if isinstance(prompt, str) and chat_template:
            prompt = [{"role": "user", "content": prompt}]
        return JobRow(number, row_id, prompt=prompt, sampling=defaults)


def _values(column: pa.Array) -> list[Any]:
    """A column's values as Python's; nanosecond times, which no Python type holds, stay Arrow scalars (exact in
    a Parquet output, ISO 8601 text in JSON)."""
    if _is_nanosecond_time(column.type):
        return [value if value.is_valid else None for value in column]
    return column.to_pylist()


def _is_nanosecond_time(kind: pa.DataType) -> bool:
    return (pa.types.is_timestamp(kind) or pa.types.is_time64(kind) or pa.types.is_duration(kind)) \
        and kind.unit == "ns"


def _holds_nanosecond_times(kind: pa.DataType) -> bool:
    """Whether nanosecond times sit inside ``kind`` (a list's items, a struct's fields, a map's values)."""
    if _is_nanosecond_time(kind):
        return True
    return any(_holds_nanosecond_times(kind.field(i).type) for i in range(kind.num_fields))


def _decode_csv_cells(columns: dict[str, list[Any]], first: int) -> list[str | None]:
    """CSV cells come as bytes: decoded in place, so one bad byte is its row's error, not the whole file's. Each
    row's error (None if it has none) names its first cell that is not UTF-8."""
    errors: list[str | None] = [None] * len(next(iter(columns.values()), []))
    for name, cells in columns.items():
        for i, cell in enumerate(cells):
            try:
                cells[i] = cell.decode()
            except UnicodeDecodeError as exc:
                errors[i] = errors[i] or (f"row {first + i}: column {name!r} is not valid UTF-8 (byte "
                                          f"0x{cell[exc.start]:02x} at byte {exc.start + 1})")
    return errors


_QUOTED = re.compile(rb'"[^"]*(?:""[^"]*)*"(?!")')  # a closed quoted CSV field ("" is a quote inside it)
_FIELD_ENDS = b",\r\n"


def _unclosed_quote(data: Any) -> int | None:
    """The offset of a quoted field that ``data`` (CSV, as pyarrow parses it: a quote opens a field only at its
    start, elsewhere it is text) never closes; None if there is none. One pass, at memchr speed between quotes."""
    first = len(codecs.BOM_UTF8) if data[: len(codecs.BOM_UTF8)] == codecs.BOM_UTF8 else 0
    pos = first
    while (at := data.find(b'"', pos)) != -1:
        if at == first or data[at - 1] in _FIELD_ENDS:
            closed = _QUOTED.match(data, at)
            if closed is None:
                return at
            pos = closed.end()
        else:
            pos = at + 1
    return None


def _prompt(value: Any) -> str | list[int]:
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("is empty")
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    raise ValueError(f"must hold text or a non-empty list of token ids, not {_kind(value)}")


def _messages(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's stack
            raise ValueError("holds text that is not a JSON list of messages") from None
    if not isinstance(value, list) or not value or not all(isinstance(m, dict) for m in value):
        raise ValueError(f"must hold a non-empty list of messages, not {_kind(value)}")
    if all("from" in m and "value" in m and "role" not in m for m in value):
        return [{"role": _SHAREGPT_ROLES.get(m["from"], m["from"]), "content": m["value"]} for m in value]
    # What a text chat's template reads: a dataset's other fields (WildChat's timestamp, toxic...) may be
    # values JSON and templates have no use for.
    return [{k: m[k] for k in _MESSAGE_KEYS if k in m} for m in value]


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


_KIND_NAMES = {"parquet": "Parquet", "csv": "CSV", "arrow": "Arrow IPC", "datasets": "datasets save_to_disk Arrow"}
