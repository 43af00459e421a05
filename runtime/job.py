"""JSONL jobs: rows in, one result row per input row out.

Input rows are ``{"id", "prompt"}`` or ``{"id", "messages"}`` with an optional
``"sampling"`` object. A row that cannot be served (bad JSON, bad fields, a
prompt too long) gets an ``"error"`` row; every other row still runs.
"""

from __future__ import annotations

import json
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


def read_rows(path: Path, defaults: SamplingParams, chat_template: bool) -> Iterator[JobRow]:
    seen: set[str] = set()
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            yield _parse_row(line, line_no, defaults, chat_template, seen)


def _parse_row(line: str, line_no: int, defaults: SamplingParams, chat_template: bool, seen: set[str]) -> JobRow:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        return JobRow(line_no, None, error=f"line {line_no} is not valid JSON: {exc.msg} at column {exc.colno}")
    if not isinstance(row, dict):
        return JobRow(line_no, None, error=f"line {line_no} must be a JSON object")
    row_id = row.get("id")
    if row_id is None or isinstance(row_id, (dict, list)):
        return JobRow(line_no, None, error=f"line {line_no} has no usable 'id' (a string or number)")
    key = json.dumps(row_id)
    if key in seen:
        return JobRow(line_no, row_id, error=f"line {line_no}: duplicate id {row_id!r}")
    seen.add(key)
    if ("prompt" in row) == ("messages" in row):
        return JobRow(line_no, row_id, error="a row needs exactly one of 'prompt' or 'messages'")
    prompt = row.get("prompt", row.get("messages"))
    if isinstance(prompt, str) and chat_template and "prompt" in row:
        prompt = [{"role": "user", "content": prompt}]
    try:
        sampling = SamplingParams.from_dict(row.get("sampling") or {}, base=defaults)
    except (TypeError, ValueError) as exc:
        return JobRow(line_no, row_id, error=str(exc))
    return JobRow(line_no, row_id, prompt=prompt, sampling=sampling)


def result_row(row_id: Any, output: Any) -> dict[str, Any]:
    if output.error is not None:
        return {"id": row_id, "error": output.error}
    return {
        "id": row_id, "text": output.text, "finish_reason": output.finish_reason,
        "prompt_tokens": output.prompt_tokens, "completion_tokens": output.completion_tokens,
    }


def run_job(llm: Any, input_path: Path, output_path: Path) -> dict[str, int]:
    """Serve every row of ``input_path``; results are appended to ``output_path`` as they complete."""
    defaults = llm.default_sampling()
    rows = list(read_rows(input_path, defaults, llm.cfg.job.chat_template))
    output_path.parent.mkdir(parents=True, exist_ok=True)
    counts = {"rows": len(rows), "ok": 0, "errors": 0}
    with open(output_path, "w", encoding="utf-8") as out:

        def write(row_id: Any, result: Any) -> None:
            out.write(json.dumps(result_row(row_id, result), ensure_ascii=False) + "\n")
            out.flush()
            counts["errors" if result.error else "ok"] += 1

        for row in rows:
            if row.error is not None:
                write(row.id, _Failed(row.error))
        llm.run([(row.id, row.prompt, row.sampling) for row in rows if row.error is None], on_result=write)
    return counts


@dataclass
class _Failed:
    error: str
