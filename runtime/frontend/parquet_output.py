"""Parquet output (``job.output=*.parquet``), written so that a kill loses at most the rows not yet flushed.

pyarrow cannot append to a closed file, so rows are flushed as small complete part files (written aside and
renamed), which the first replica folds into the output at the end of a run or the start of the next.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from runtime.config import ConfigError
from runtime.frontend.job_files import first_line, normalize_id, part_files, sync_dir

log = logging.getLogger(__name__)

ID_NOTE_KEY = b"tpinfer.ids"  # schema metadata: how ids were made, when they are row numbers

_TOP = pa.list_(pa.struct([("token_id", pa.int64()), ("logprob", pa.float64())]))
_LOGPROB = pa.struct([("token_id", pa.int64()), ("logprob", pa.float64()), ("top", _TOP)])
_CHOICE = pa.struct([("index", pa.int64()), ("text", pa.string()), ("finish_reason", pa.string()),
                     ("completion_tokens", pa.int64()), ("logprobs", pa.list_(_LOGPROB)),
                     ("cumulative_logprob", pa.float64())])


def result_schema(id_type: str, kept: list[pa.Field], id_note: str | None = None) -> pa.Schema:
    """The output's columns: those of a JSONL result row, then the kept ones."""
    fields = [
        pa.field("id", pa.int64() if id_type == "int" else pa.string()),
        pa.field("text", pa.string()), pa.field("finish_reason", pa.string()),
        pa.field("completion_tokens", pa.int64()), pa.field("prompt_tokens", pa.int64()),
        pa.field("logprobs", pa.list_(_LOGPROB)), pa.field("cumulative_logprob", pa.float64()),
        pa.field("choices", pa.list_(_CHOICE)), pa.field("prompt_logprobs", pa.list_(_LOGPROB)),
        *kept,
    ]
    return pa.schema(fields, metadata={ID_NOTE_KEY: id_note.encode()} if id_note else None)


_RESULT_NAMES = frozenset(result_schema("int", []).names)


def _entries(entries: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if entries is None:
        return None
    return [None if e is None else {"token_id": e["token_id"], "logprob": e["logprob"],
                                    "top": [{"token_id": int(t), "logprob": lp} for t, lp in e["top"]]}
            for e in entries]


def _parquet_row(record: dict[str, Any]) -> dict[str, Any]:
    row = dict(record)
    for key in ("logprobs", "prompt_logprobs"):
        row[key] = _entries(row.get(key))
    if "choices" in row:
        row["choices"] = [{**c, "logprobs": _entries(c.get("logprobs"))} for c in row["choices"]]
    return row


class ParquetSink:
    """Buffers one replica's result rows and flushes them as part files."""

    def __init__(self, output: Path, replica: int, schema: pa.Schema, row_group_rows: int,
                 flush_every_s: float) -> None:
        output.parent.mkdir(parents=True, exist_ok=True)
        self.output, self.schema, self.replica = output, schema, replica
        self.prefix = f"{output.name}.part-{replica}-{time.time_ns()}-"  # never a name an earlier run used
        self.row_group_rows, self.flush_every_s = row_group_rows, flush_every_s
        self.id_is_int = pa.types.is_integer(schema.field("id").type)
        self.kept = [f for f in schema if f.name not in _RESULT_NAMES]
        self.rows: list[dict[str, Any]] = []
        self.first_at = 0.0
        self.flushed = 0

    def write(self, record: dict[str, Any]) -> None:
        """Raises ValueError (nothing written) for a row the output's columns cannot hold: an id of the other
        type, an integer beyond int64, a string that is not valid Unicode, a kept value its column's type cannot
        hold. Checked here, one row at a time, so such a row never reaches the buffer the others share."""
        self._check_id(record["id"])
        self._check_kept(record)
        if not self.rows:
            self.first_at = time.monotonic()
        self.rows.append(_parquet_row(record))
        if len(self.rows) >= self.row_group_rows:
            self.flush()
        else:
            self.tick()

    def _check_id(self, value: Any) -> None:
        if isinstance(value, int) != self.id_is_int:
            column = "integers" if self.id_is_int else "strings"
            raise ValueError(f"id {value!r}: the Parquet output's id column holds {column} (set by the first row); "
                             "write ids of mixed types to a JSONL output")
        if self.id_is_int and not -(2**63) <= value < 2**63:
            raise ValueError(f"id {value}: the Parquet output's id column holds 64-bit integers; write such ids "
                             "as strings, or to a JSONL output")
        if not self.id_is_int:
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"id {value!r} is not valid Unicode (a lone surrogate): Parquet cannot store "
                                 "it; write it to a JSONL output") from None

    def _check_kept(self, record: dict[str, Any]) -> None:
        """The input's values, converted as the flush converts each column (pa.array with its type); the other
        columns hold what the job made, of their types."""
        for field in self.kept:
            value = record.get(field.name)
            try:
                pa.array([value], field.type)
            except (pa.ArrowException, OverflowError) as exc:
                shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
                raise ValueError(f"the Parquet output's column {field.name!r} ({field.type}) cannot hold {shown} "
                                 f"({first_line(exc)}); write this row to a JSONL output") from None

    def tick(self) -> None:
        """Flush rows that have waited job.fsync_every_s, whether or not another row finishes: a kill loses
        only younger ones. Called every step."""
        if self.rows and time.monotonic() - self.first_at >= self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        table = pa.Table.from_pylist(self.rows, schema=self.schema)
        final = self.output.with_name(f"{self.prefix}{self.flushed:06d}")
        write_table_atomic(table, final, len(self.rows))
        self.flushed += 1
        self.rows.clear()

    def close(self) -> None:
        self.flush()
        if self.flushed == 0 and self.replica == 0 and not self.output.exists():
            # No row at all (an empty input): the output still exists, with its columns, as a JSONL one would.
            write_table_atomic(self.schema.empty_table(), self.output.with_name(f"{self.prefix}{0:06d}"), 1)
        sync_dir(self.output.parent)


def write_table_atomic(table: pa.Table, path: Path, row_group_rows: int) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        pq.write_table(table, f, row_group_size=max(1, row_group_rows))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _readable(output: Path, repair: bool = True) -> Iterator[tuple[Path, pq.ParquetFile]]:
    """The output and its parts, opened. An output that is not Parquet is refused: it may be someone's file, and
    nothing of it is touched. A damaged part (ours) is renamed aside with a warning and its rows served again
    (``repair``; else it is skipped: a check before the lock is taken changes nothing)."""
    for f in _sources(output):
        try:
            yield f, pq.ParquetFile(f)
        except (pa.ArrowException, OSError) as exc:
            if f == output:
                raise ConfigError(f"job.output={output} is not readable Parquet ({first_line(exc)}): move it away, "
                                  "or use another job.output") from None
            if not repair:
                continue
            aside = _free_name(f.with_name(f".{f.name}.unreadable"))
            log.warning("%s is not readable Parquet (%s); moved to %s, its rows are served again", f, exc, aside)
            os.replace(f, aside)


def _free_name(path: Path) -> Path:
    """``path``, or ``path.1``, ``path.2``...: the first that does not exist, so nothing set aside is replaced."""
    candidate, n = path, 0
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}.{n}")
    return candidate


def _sources(output: Path) -> list[Path]:
    return ([output] if output.exists() else []) + part_files(output)


def existing_schema(output: Path, repair: bool = True) -> pa.Schema | None:
    """The schema of the output or of its first part that holds rows: an empty table (an empty input's output)
    decides nothing, since its id column's type was a guess."""
    for _, reader in _readable(output, repair):
        if reader.metadata.num_rows > 0:
            return reader.schema_arrow
    return None


def _typed(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name}: {f.type}" for f in schema)


def check_columns(output: Path, kept: list[pa.Field], repair: bool = True) -> None:
    """A Parquet output's rows share one set of columns and types: a job that would write others stops before
    serving (``repair``: as existing_schema)."""
    existing = existing_schema(output, repair)
    if existing is None:
        return
    wanted = result_schema("int", kept).names
    if existing.names != wanted:
        raise ConfigError(f"job.output={output} has columns {existing.names}; this job writes {wanted} (kept "
                          "columns come from job.columns.keep): use another job.output, or keep the same columns")
    changed = kept_type_changes(existing, kept)
    if changed:
        raise ConfigError(f"job.output={output} keeps columns of other types than job.input has now "
                          f"({'; '.join(changed)}): use another job.output, or give the input the output's types")


def kept_type_changes(existing: pa.Schema, kept: list[pa.Field]) -> list[str]:
    """Kept columns whose type differs between an output and this job's input, as 'name: <then> then, <now> now'.
    The output's types are what Parquet reads back, and a column of nulls (typed null) goes with any type."""
    have = {f.name: f.type for f in existing}
    return [f"{f.name}: {have[f.name]} then, {f.type} now" for f, stored in zip(kept, stored_types(kept))
            if f.name in have and have[f.name] != stored and not _null(have[f.name], stored)]


def stored_types(fields: list[pa.Field]) -> list[pa.DataType]:
    """The types Parquet gives ``fields`` back as: timestamp[s] comes back timestamp[ms], time32[s] time32[ms],
    date64 date32 (asked of the writer and reader themselves, so nested and future cases agree too)."""
    if not fields:
        return []
    sink = pa.BufferOutputStream()
    pq.write_table(pa.schema(fields).empty_table(), sink)
    return pq.read_schema(pa.BufferReader(sink.getvalue())).types


def _null(*types: pa.DataType) -> bool:
    return any(pa.types.is_null(t) for t in types)


def adopt_kept_types(existing: pa.Schema | None, kept: list[pa.Field]) -> list[pa.Field]:
    """A kept column of nulls in this input takes the type the output gave it already, so the rows merge."""
    if existing is None:
        return kept
    return [existing.field(f.name) if pa.types.is_null(f.type) and f.name in existing.names else f for f in kept]


def _keys(ids: list[Any]) -> list[str]:
    return [json.dumps(normalize_id(v)) for v in ids]


def done_keys(output: Path) -> set[str]:
    """Ids (as JSON keys) of the rows in the output and its parts."""
    keys: set[str] = set()
    for _, reader in _readable(output):
        for batch in reader.iter_batches(columns=["id"]):
            keys.update(_keys(batch.column(0).to_pylist()))
    return keys


def merge_parts(output: Path, row_group_rows: int) -> int:
    """Fold every part into the output, then delete the parts; a kill at any point leaves no row lost or doubled."""
    for stale in output.parent.glob(glob.escape(f".{output.name}.part-") + "*.tmp"):
        stale.unlink()  # a flush killed before its rename
    parts = part_files(output)
    if not parts:
        return 0
    readable = list(_readable(output))
    if not readable:
        return 0
    # Empty tables hold no row, and their id type was a guess: rows decide; with none, the first empty one stays.
    sources = [(path, reader) for path, reader in readable if reader.metadata.num_rows > 0]
    if not sources:
        if readable[0][0] != output:
            os.replace(readable[0][0], output)
        for path, _ in readable[1:]:
            if path != output:
                path.unlink()
        sync_dir(output.parent)
        return 0
    schema = sources[0][1].schema_arrow
    for f, reader in sources[1:]:
        try:  # a column of nulls in one takes the other's type
            schema = pa.unify_schemas([schema, reader.schema_arrow])
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            raise ValueError(f"{f} has columns {_typed(reader.schema_arrow)}, {sources[0][0]} has {_typed(schema)}: "
                             "parts of one output must have the same columns and types (was job.columns.keep "
                             "changed, or a kept column's type in the input?)") from None
    seen: set[str] = set()
    added = 0
    tmp = output.with_name(f".{output.name}.merging")
    pending: list[pa.RecordBatch] = []
    with open(tmp, "wb") as f, pq.ParquetWriter(f, schema) as writer:
        def write(last: bool) -> None:
            """Whole row groups of what is pending (everything, ``last``)."""
            rows = sum(b.num_rows for b in pending)
            if not pending or (rows < row_group_rows and not last):
                return
            table = pa.Table.from_batches(pending, schema)
            whole = rows if last else rows - rows % row_group_rows
            writer.write_table(table.slice(0, whole), row_group_size=row_group_rows)
            pending[:] = table.slice(whole).to_batches()

        for path, reader in sources:
            for batch in reader.iter_batches(batch_size=row_group_rows):
                batch = batch.cast(schema)
                keys = _keys(batch.column(0).to_pylist())
                keep = [k not in seen and not seen.add(k) for k in keys]
                if not all(keep):
                    batch = batch.filter(pa.array(keep))
                if path != output:
                    added += batch.num_rows
                pending.append(batch)
                write(False)
        write(True)
        writer.close()
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, output)
    sync_dir(output.parent)
    for path, _ in readable:
        if path != output:
            path.unlink()
    for part in part_files(output):
        log.warning("%s was not merged into %s", part, output)
    return added
