"""Resumable JSONL jobs: rows in, one result row per input id out.

Input rows are ``{"id", "prompt"}`` or ``{"id", "messages"}`` with an optional
``"sampling"`` object; an id is a string or an integer (``1.0`` is the id ``1``).
Results are appended to the output as they complete, one whole line each (a torn
last line from a killed run is cut off on resume; other unreadable lines are
skipped with a warning). Rows that cannot be served, for whatever reason, go to the
errors file with their line number and the job goes on.

What a rerun does: it skips every id already in the output and serves every other
row, including rows that failed before (their error may have come from the config,
such as a prompt longer than ``model.max_seq_len``). Each run rewrites the errors
file, so it lists the rows that failed in the latest run. A job killed at any moment
and rerun ends with exactly one row per input id.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.sampling_params import SamplingParams


@dataclass
class JobRow:
    line: int
    id: Any
    prompt: Any = None
    sampling: SamplingParams | None = None
    error: str | None = None

    @property
    def key(self) -> str:
        """Identity across reruns: the id for good rows, the line for rows that fail to parse."""
        return f"line:{self.line}" if self.error is not None else json.dumps(self.id)


@dataclass
class JobPaths:
    input: Path
    output: Path
    errors: Path
    metrics: Path
    config: Path

    @classmethod
    def from_config(cls, job: Any) -> JobPaths:
        out = Path(job.output)
        return cls(
            input=Path(job.input), output=out,
            errors=Path(job.errors) if job.errors else out.with_suffix(".errors.jsonl"),
            metrics=Path(job.metrics) if job.metrics else out.with_suffix(".metrics.json"),
            config=out.with_suffix(".config.yaml"),
        )


log = logging.getLogger(__name__)


def read_rows(path: Path, defaults: SamplingParams, chat_template: bool) -> Iterator[JobRow]:
    seen: set[str] = set()
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield JobRow(line_no, None, error=f"{path}:{line_no} is not valid UTF-8 "
                                                  f"(byte 0x{raw[exc.start]:02x} at column {exc.start + 1})")
                continue
            if not line.strip():
                continue
            yield _parse_row(line, line_no, defaults, chat_template, seen)


def normalize_id(value: Any) -> str | int | None:
    """A row id as a string or an integer; None when it is neither (booleans, fractions, objects)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value if isinstance(value, (str, int)) else None


def _parse_row(line: str, line_no: int, defaults: SamplingParams, chat_template: bool, seen: set[str]) -> JobRow:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        return JobRow(line_no, None, error=f"line {line_no} is not valid JSON: {exc.msg} at column {exc.colno}")
    if not isinstance(row, dict):
        return JobRow(line_no, None, error=f"line {line_no} must be a JSON object")
    row_id = normalize_id(row.get("id"))
    if row_id is None:
        return JobRow(line_no, None, error=f"line {line_no} has no usable 'id' (a string or an integer): {row.get('id')!r}")
    key = json.dumps(row_id)
    if key in seen:
        return JobRow(line_no, row_id, error=f"line {line_no}: duplicate id {row_id!r}")
    seen.add(key)
    if ("prompt" in row) == ("messages" in row):
        return JobRow(line_no, row_id, error=f"line {line_no}: a row needs exactly one of 'prompt' or 'messages'")
    prompt = row.get("prompt", row.get("messages"))
    if isinstance(prompt, str) and not prompt.strip():
        return JobRow(line_no, row_id, error=f"line {line_no}: the prompt is empty")
    if isinstance(prompt, str) and chat_template and "prompt" in row:
        prompt = [{"role": "user", "content": prompt}]
    sampling = row.get("sampling")
    sampling = {} if sampling is None else sampling  # null means the defaults
    if not isinstance(sampling, dict):
        return JobRow(line_no, row_id, error=f"line {line_no}: 'sampling' must be an object, not {sampling!r}")
    try:
        sampling = SamplingParams.from_dict(sampling, base=defaults)
    except (TypeError, ValueError) as exc:
        return JobRow(line_no, row_id, error=f"line {line_no}: {exc}")
    return JobRow(line_no, row_id, prompt=prompt, sampling=sampling)


def done_ids(path: Path) -> set[str]:
    """Ids (as JSON keys) of the rows a previous run wrote. A torn last line (killed mid-write) is cut
    off; a complete line that is not a row (blank, zero-filled after a crash) is skipped with a warning."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    if len(whole) != len(data):
        with open(path, "r+b") as f:
            f.truncate(len(whole))
    keys = set()
    for line_no, line in enumerate(whole.split(b"\n")[:-1], 1):
        try:
            row = json.loads(line)
            keys.add(json.dumps(normalize_id(row["id"])))
        except (ValueError, KeyError, TypeError):
            if line.strip(b" \t\r\x00"):
                log.warning("%s:%d is not a result row; ignored (that id, if any, is served again)", path, line_no)
    return keys


class JsonlAppender:
    """Appends whole lines; flushes each, fsyncs at a cadence and on close."""

    def __init__(self, path: Path, fsync_every_s: float, mode: str = "a") -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, mode, encoding="utf-8")
        self.fsync_every_s = fsync_every_s
        self.last_sync = time.monotonic()

    def write(self, row: dict[str, Any]) -> None:
        self.file.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.file.flush()
        if time.monotonic() - self.last_sync >= self.fsync_every_s:
            os.fsync(self.file.fileno())
            self.last_sync = time.monotonic()

    def close(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


def result_row(row_id: Any, output: Any) -> dict[str, Any]:
    return {
        "id": row_id, "text": output.text, "finish_reason": output.finish_reason,
        "prompt_tokens": output.prompt_tokens, "completion_tokens": output.completion_tokens,
    }


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": ordered[-1]}


def run_job(llm: Any, config_yaml: str) -> dict[str, Any]:
    """Serve every row not yet done; returns the metrics (also written to the metrics file)."""
    job = llm.cfg.job
    paths = JobPaths.from_config(job)
    if not paths.input.is_file():
        raise FileNotFoundError(f"job.input={paths.input} does not exist")
    if len({paths.input.resolve(), paths.output.resolve(), paths.errors.resolve()}) < 3:
        raise ValueError(f"job.input, job.output and job.errors must be three different files ({paths.input})")
    rows = list(read_rows(paths.input, llm.default_sampling(), job.chat_template))
    done = done_ids(paths.output)
    todo = [r for r in rows if r.error is not None or r.key not in done]
    paths.config.parent.mkdir(parents=True, exist_ok=True)
    paths.config.write_text(config_yaml)
    outputs = JsonlAppender(paths.output, job.fsync_every_s)
    errors = JsonlAppender(paths.errors, job.fsync_every_s, mode="w")  # the latest run's failures
    counts = {"ok": 0, "errors": 0, "input_tokens": 0, "output_tokens": 0}
    latencies: list[float] = []
    start = time.perf_counter()
    bar = _progress(len(todo), job.progress)

    def record_error(row: JobRow, key: str, row_id: Any, message: str) -> None:
        errors.write({"id": row_id, "line": row.line, "key": key, "error": message})
        counts["errors"] += 1
        bar.update(1)

    def on_result(row: JobRow, output: Any) -> None:
        if output.error is not None:
            record_error(row, row.key, row.id, output.error)
            return
        outputs.write(result_row(row.id, output))
        counts["ok"] += 1
        counts["input_tokens"] += output.prompt_tokens
        counts["output_tokens"] += output.completion_tokens
        latencies.append(time.perf_counter() - start)
        bar.update(1)
        bar.set_postfix(tok_s=f"{counts['output_tokens'] / max(time.perf_counter() - start, 1e-9):.0f}")

    try:
        for row in todo:
            if row.error is not None:
                record_error(row, row.key, row.id, row.error)
        llm.run([(row, row.prompt, row.sampling) for row in todo if row.error is None], on_result=on_result)
    finally:
        outputs.close()
        errors.close()
        bar.close()
    wall = time.perf_counter() - start
    metrics = {
        "rows": len(rows), "already_done": len(rows) - len(todo), "completed": counts["ok"], "errors": counts["errors"],
        "interrupted": llm.interrupted, "input_tokens": counts["input_tokens"], "output_tokens": counts["output_tokens"],
        "output_tokens_per_s": counts["output_tokens"] / max(wall, 1e-9), "wall_s": wall,
        "latency_s": _percentiles(latencies), "tp_size": llm.engine.tp_size,
        "config_hash": hashlib.sha256(config_yaml.encode()).hexdigest()[:16],
    }
    paths.metrics.write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


def _progress(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="rows", unit="row", disable=not enabled, dynamic_ncols=True)
