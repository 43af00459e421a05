"""What a job reads and writes, decided from ``job.input``, ``job.output`` and ``job.format`` before serving."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.config import JobColumnsSection
from runtime.frontend.job_files import (
    PARQUET_SUFFIXES,
    InputError,
    JobRow,
    check_output_kind,
    jsonl_format,
    read_rows,
)
from runtime.sampling_params import SamplingParams


@dataclass
class JobInput:
    path: Path
    format: str
    rows: Callable[[], Iterator[JobRow]]  # a fresh iterator each call
    id_type: str | None = None
    id_note: str | None = None
    kept: list[Any] = field(default_factory=list)

    @property
    def is_table(self) -> bool:
        return self.format not in ("native", "openai")


TABLE_SUFFIXES = (".parquet", ".pq", ".csv", ".tsv", ".arrow", ".feather", ".ipc")
UNWRITTEN_SUFFIXES = tuple(s for s in TABLE_SUFFIXES if s not in PARQUET_SUFFIXES)  # read, never written


def open_input(path: Path, job: Any, defaults: SamplingParams) -> JobInput:
    """Open and check ``job.input`` (its kind, its columns); rows are read later, a batch at a time."""
    kind = None
    if path.is_dir() or path.suffix.lower() in TABLE_SUFFIXES:  # JSONL jobs never import pyarrow
        from runtime.frontend.tables import table_kind

        kind = table_kind(path)
    if kind is None:
        # JSONL rows name their own keys (id, prompt | messages, sampling): a mapping set for them would be
        # ignored, and rows served from keys other than the ones asked for.
        for name, default in vars(JobColumnsSection()).items():
            value = getattr(job.columns, name)
            if value != default:
                shown = list(value) if name == "keep" else value
                raise InputError(f"job.columns.{name}={shown!r} applies to table inputs (Parquet, CSV, Arrow, "
                                 f"datasets); job.input={path} is JSONL, whose rows are {{id, prompt | messages}}")
        fmt = jsonl_format(path, job.format)
        return JobInput(path, fmt, lambda: read_rows(path, defaults, job.chat_template, job.format))
    if job.format != "auto":
        raise InputError(f"job.format={job.format} applies to JSONL inputs; job.input={path} is a table ({kind})")
    from runtime.frontend.tables import TableInput

    table = TableInput(path, kind, job.columns)
    return JobInput(path, kind, lambda: table.rows(defaults, job.chat_template), table.id_type, table.id_note,
                    table.kept_fields())


def output_format(output: Path, source: JobInput) -> str:
    """jsonl (result rows), openai (batch result lines, for an OpenAI batch input) or parquet."""
    suffix = output.suffix.lower()
    if suffix in UNWRITTEN_SUFFIXES:  # other names (shard.00, say) are JSONL
        raise InputError(f"job.output={output}: results are written as JSONL or Parquet, not {suffix}; name it "
                         ".jsonl, or .parquet for a table")
    parquet = suffix in PARQUET_SUFFIXES
    if source.format == "openai":
        if parquet:
            raise InputError(f"an OpenAI batch input is answered with OpenAI batch result lines: job.output={output} "
                             "must be a JSONL file, not Parquet")
        return "openai"
    return "parquet" if parquet else "jsonl"


def check_output(output: Path, source: JobInput, repair: bool = True) -> None:
    """What ``output`` holds already is of this job's kind (a Parquet output: its columns and types): checked
    before the model loads (``repair=False``: it changes nothing), and again under the output's lock before
    anything in it is rewritten."""
    out_format = output_format(output, source)
    if out_format == "parquet":
        from runtime.frontend.parquet_output import check_columns

        check_columns(output, source.kept, repair)
    else:
        check_output_kind(output, out_format)
