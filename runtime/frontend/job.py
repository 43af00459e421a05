"""Resumable jobs: rows in, one result row per input id out, over any number of replicas.

Replicas claim rows from one shared counter; replica r > 0 writes ``<output>.part-<r>``, merged at the end or
on the next run. A rerun skips ids already in the output, so a job killed at any moment and rerun, at any DP or
TP size, ends with exactly one row per input id.
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from collections import deque
from collections.abc import Iterator
from contextlib import ExitStack
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parallel.state import get_tp
from runtime.frontend import openai_api
from runtime.frontend.job_files import (
    JobPaths,
    JobRow,
    JsonlAppender,
    done_ids,
    drop_error_lines,
    finite_values,
    merge_parts,
    part_files,
    part_path,
    result_row,
    served_custom_ids,
)
from runtime.frontend.job_inputs import JobInput, check_output, open_input, output_format
from runtime.frontend.output_lock import OutputLock, lock_path, part_locks
from runtime.frontend.replicas import Replicas

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger(__name__)

WINDOW_ROWS = 8192  # input rows read and planned at a time
UNKNOWN_REST = 1 << 40  # stands for the rows not read yet


def run_job(llm: Any, config_yaml: str, output_locked: bool = False) -> dict[str, Any]:
    """Serve every row not yet done; returns the job's metrics.

    ``output_locked``: the caller holds ``<output>.lock`` already.
    """
    job = llm.cfg.job
    paths = JobPaths.from_config(job)
    if not paths.input.exists():
        raise FileNotFoundError(f"job.input={paths.input} does not exist")
    paths.check_distinct()
    paths.check_writable()
    start = time.perf_counter()
    replicas = Replicas(llm.drain, job.drain_timeout_s)
    with ExitStack() as held:
        with llm.workers_kept_waiting():  # opening a large table can take a while too
            source = open_input(paths.input, job, llm.default_sampling())
            out_format = output_format(paths.output, source)
            todo = prepare(job, paths, out_format, source, replicas, held, config_yaml, output_locked)
        if llm.drain is not None and replicas.store is not None:
            llm.drain.sync = replicas.share_drain  # through the last barrier too: it gives up after a shared drain
        try:
            mine = serve(llm, replicas, paths, todo, out_format, source)
            with llm.workers_kept_waiting():
                reports = replicas.gather(mine)
                if replicas.first:
                    merge_output(paths.output, out_format, job.row_group_rows)
                    merge_parts(paths.errors, results=False)
        finally:
            if llm.drain is not None:
                llm.drain.sync = None
        metrics = summarize(reports, time.perf_counter() - start, config_yaml)
        metrics.update(input_format=source.format, output_format=out_format)
        if source.id_note:
            metrics["ids"] = source.id_note
        if replicas.first:
            paths.metrics.parent.mkdir(parents=True, exist_ok=True)
            paths.metrics.write_text(json.dumps(metrics, indent=2) + "\n")
        # The others leave with replica 0, not before its merge: a launcher that ends every task once one exits
        # non-zero (srun --kill-on-bad-exit, after a drain's 143) would otherwise cut the merge and the metrics.
        with llm.workers_kept_waiting():
            replicas.barrier("merged", give_up_after_drain=False)
    return metrics


def prepare(job: Any, paths: JobPaths, out_format: str, source: JobInput, replicas: Replicas,
            held: ExitStack, config_yaml: str, output_locked: bool) -> Todo:
    """Before serving: replica 0 takes the output, folds in a killed run's parts and records the config; every
    replica then locks its own part and reads which rows are done. Locks go on ``held``, kept until the job ends."""
    if replicas.first:
        if job.lock and not output_locked:
            held.enter_context(output_lock(paths.output, job.lock_wait_s))
        paths.check_same_rows(config_yaml)
        check_output(paths.output, source)
        recover(paths, out_format, job.row_group_rows, job.lock_wait_s if job.lock else None)
        for stale in part_files(paths.errors):
            stale.unlink()
        paths.config.parent.mkdir(parents=True, exist_ok=True)
        paths.config.write_text(config_yaml)
        if source.id_note:
            log.warning("%s", source.id_note)
    replicas.barrier("recovered")  # others lock their part only now: replica 0 may have refused the run
    if not replicas.first and job.lock:
        part = part_path(paths.output, replicas.index)
        held.enter_context(OutputLock(lock_path(paths.output, replicas.index),
                                      f"{part} (replica {replicas.index}'s part of job.output={paths.output})",
                                      job.lock_wait_s))
    todo = Todo(source.rows(), done_keys(out_format, paths.output))
    todo.fill(0)
    replicas.barrier("planned")  # every replica reads the same output before anyone appends
    return todo


def output_lock(output: Path, wait_s: float) -> OutputLock:
    return OutputLock(lock_path(output), f"job.output={output}", wait_s)


def recover(paths: JobPaths, out_format: str, row_group_rows: int, lock_wait_s: float | None) -> None:
    """Replica 0: fold in a killed run's part files (taking each part's lock first, so a replica still
    writing stops this run rather than lose rows) and drop an OpenAI output's error lines."""
    with ExitStack() as parts:
        if lock_wait_s is not None:
            for held in part_locks(paths.output):
                parts.enter_context(OutputLock(held, f"a replica's part of job.output={paths.output}", lock_wait_s))
        merge_output(paths.output, out_format, row_group_rows)
        if out_format == "openai":
            dropped = drop_error_lines(paths.output)
            if dropped:
                log.info("%s: %d error lines of an earlier run removed; those requests are served again",
                         paths.output, dropped)


def merge_output(output: Path, out_format: str, row_group_rows: int) -> None:
    if out_format == "parquet":
        from runtime.frontend import parquet_output

        parquet_output.merge_parts(output, row_group_rows)
    else:
        merge_parts(output)


def done_keys(out_format: str, output: Path) -> set[str]:
    if out_format == "parquet":
        from runtime.frontend import parquet_output

        return parquet_output.done_keys(output)
    if out_format == "openai":
        return served_custom_ids(output)
    return done_ids(output, repair=False)


OUTLIER_WORK = 4.0


def plan(rows: list[JobRow], done: set[str]) -> list[JobRow]:
    """Unparsable rows first, then outliers longest first (started last, they would keep one replica busy
    alone), then the rest in input order; fully longest-first starts the long rows together and is slower."""

    def expected_work(row: JobRow) -> int:  # ~4 characters a token; a value JSON has no type for counts as text
        return len(json.dumps(row.prompt, default=str)) // 4 + row.sampling.max_new_tokens * row.sampling.n

    todo = [r for r in rows if r.error is not None or r.key not in done]
    good = [r for r in todo if r.error is None]
    work = [expected_work(r) for r in good]
    cutoff = OUTLIER_WORK * statistics.median(work) if good else 0
    outliers = sorted((i for i, w in enumerate(work) if w > cutoff), key=lambda i: -work[i])
    rest = [r for r, w in zip(good, work) if w <= cutoff]
    return [r for r in todo if r.error is not None] + [good[i] for i in outliers] + rest


class Todo:
    """The rows to serve in serving order, planned a window at a time the same way on every replica, so a
    claimed number names the same row everywhere."""

    def __init__(self, rows: Iterator[JobRow], done: set[str], window: int = WINDOW_ROWS) -> None:
        self._rows, self._done, self._window = rows, done, window
        self._planned: deque[tuple[int, list[JobRow]]] = deque()  # (number of the first row, rows)
        self.end = 0
        self.exhausted = False
        self.read = 0
        self.already_done = 0
        self.first_id: Any = None

    @property
    def total(self) -> int:
        return self.end if self.exhausted else self.end + UNKNOWN_REST

    def fill(self, number: int) -> None:
        """Plan at least a window beyond ``number`` so claims in the last window see the exact total."""
        while not self.exhausted and self.end <= number + self._window:
            chunk = list(islice(self._rows, self._window))
            if not chunk:
                self.exhausted = True
                break
            self.read += len(chunk)
            if self.first_id is None:
                self.first_id = next((r.id for r in chunk if r.error is None), None)
            planned = plan(chunk, self._done)
            self.already_done += len(chunk) - len(planned)
            if planned:
                self._planned.append((self.end, planned))
                self.end += len(planned)

    def rows(self, numbers: range) -> list[JobRow]:
        """The rows of ``numbers``; claims only grow, so earlier windows are dropped."""
        if not numbers:
            return []
        self.fill(numbers[-1])
        while self._planned and self._planned[0][0] + len(self._planned[0][1]) <= numbers[0]:
            self._planned.popleft()
        found = []
        for first, planned in self._planned:
            lo, hi = max(numbers[0], first), min(numbers[-1] + 1, first + len(planned))
            if lo < hi:
                found.extend(planned[lo - first : hi - first])
        return found


def _id_type(source: JobInput, todo: Todo, existing: pa.Schema | None) -> str:
    """int or str: the Parquet id column's type, decided the same way on every replica (``existing``: the
    output's schema, if it holds rows)."""
    if existing is not None:
        import pyarrow as pa

        return "int" if pa.types.is_integer(existing.field("id").type) else "str"
    if source.id_type is not None:
        return source.id_type
    return "str" if isinstance(todo.first_id, str) else "int"


def serve(llm: Any, replicas: Replicas, paths: JobPaths, todo: Todo, out_format: str, source: JobInput
          ) -> dict[str, Any]:
    job = llm.cfg.job
    if out_format == "parquet":
        from runtime.frontend import parquet_output

        existing = parquet_output.existing_schema(paths.output)
        schema = parquet_output.result_schema(_id_type(source, todo, existing),
                                              parquet_output.adopt_kept_types(existing, source.kept), source.id_note)
        outputs: Any = parquet_output.ParquetSink(paths.output, replicas.index, schema, job.row_group_rows,
                                                  job.fsync_every_s)
    else:
        outputs = JsonlAppender(part_path(paths.output, replicas.index), job.fsync_every_s)
    errors = JsonlAppender(part_path(paths.errors, replicas.index), job.fsync_every_s, mode="w")
    tokens = openai_api.TokenText(llm.tokenizer, llm.strips_leading_space)
    model_name = llm.model_dir.name
    counts = {"rows": 0, "errors": 0, "input_tokens": 0, "output_tokens": 0}
    latencies: list[float] = []
    claimed: dict[str, tuple[JobRow, float]] = {}  # by the row's id, which is also its noise key
    echo_prompts: dict[str, list[int]] = {}  # the token ids of claimed rows that ask for echo
    start = time.perf_counter()
    bar = _progress(todo.end if todo.exhausted else None, job.progress and replicas.first)

    def record_error(row: JobRow, message: str, code: str | None = None) -> None:
        errors.write({"id": row.id, "line": row.line, "key": row.key, "error": message})
        if out_format == "openai":
            code = code or row.code or openai_api.engine_error_code(message)
            param = row.param or openai_api.engine_error_param(message)
            outputs.write(openai_api.error_line(row.id, row.key, code, message, param))
        counts["errors"] += 1
        bar.update(replicas.finished() - bar.n)

    def on_result(key: str, output: Any) -> None:
        row, claimed_at = claimed.pop(key)
        prompt_ids = echo_prompts.pop(key, None)
        if output.error is not None:
            record_error(row, output.error)
            return
        if out_format == "openai":
            echoes = None
            if prompt_ids is not None:
                echoes = [tokens.echo(row.prompt, prompt_ids, output.prompt_logprobs)] * len(output.outputs)
            body = openai_api.response_body(row.request, output, tokens, model_name, int(time.time()), row.key, echoes)
            outputs.write(openai_api.result_line(row.id, row.key, body))
        else:
            record = result_row(row.id, output)
            if row.keep:
                record.update(finite_values(row.keep) if out_format == "jsonl" else row.keep)
            try:
                outputs.write(record)
            except ValueError as exc:
                record_error(row, str(exc))
                return
        counts["rows"] += 1
        counts["input_tokens"] += output.prompt_tokens
        if row.request is None or not row.request.prompt_only:  # its one token is made only to score the prompt
            counts["output_tokens"] += output.total_completion_tokens
        latencies.append(round(time.perf_counter() - claimed_at, 4))
        bar.update(replicas.finished() - bar.n)
        bar.set_postfix(tok_s=f"{counts['output_tokens'] / max(time.perf_counter() - start, 1e-9):.0f}")

    def take(want: int) -> list[tuple[JobRow, Any, Any]] | None:
        picked = replicas.claim(want, todo.total)
        rows = todo.rows(picked)
        if want > 0 and not rows:
            return None
        if todo.exhausted and bar.total != todo.end:
            bar.total = todo.end
            bar.refresh()
        items = []
        for row in rows:
            if row.error is not None:
                record_error(row, row.error)
            else:
                claimed[row.key] = row, time.perf_counter()
                items.append((row.key, row.prompt, row.sampling))
        return items

    def fits(key: str, req: Any) -> None:
        """As OpenAI refuses it: a length asked for must fit beside the prompt, checked once it is tokenized."""
        row = claimed[key][0]
        if row.request is not None:
            openai_api.check_context(row.request, req.prompt_len, llm.engine.max_seq_len)
            if row.request.echo:
                echo_prompts[key] = req.prompt_ids

    # Parquet rows wait in memory for a whole row group: each step flushes those older than job.fsync_every_s.
    each_step = (lambda _batch: outputs.tick()) if out_format == "parquet" else None
    try:
        llm.run(take, on_result=on_result, on_batch=each_step, admit=fits, keep_results=False)
    finally:
        outputs.close()
        errors.close()
        bar.close()
    tp = get_tp()
    first_rank = replicas.index * tp.size
    return {
        "replica": replicas.index, "ranks": list(range(first_rank, first_rank + tp.size)), **counts,
        # A drain after the last row (or on a rerun with nothing left) stopped nothing: the job is complete.
        "interrupted": llm.interrupted and not (todo.exhausted and not claimed and replicas.claimed_all(todo.end)),
        "busy_s": time.perf_counter() - start, "latencies": latencies,
        "read": todo.read, "already_done": todo.already_done,
    }


def served_nothing(m: dict[str, Any]) -> bool:
    """A complete job whose output holds nothing but error rows (none served now, none before): it failed."""
    return not m["interrupted"] and m["completed"] == m["already_done"] == 0 and m["errors"] > 0


def summarize(reports: list[dict[str, Any]], wall: float, config_yaml: str) -> dict[str, Any]:
    total = {k: sum(r[k] for r in reports) for k in ("rows", "errors", "input_tokens", "output_tokens")}
    latencies = [x for r in reports for x in r["latencies"]]
    furthest = max(reports, key=lambda r: r["read"])  # an interrupted replica read less
    per_replica = [{k: v for k, v in r.items() if k not in ("latencies", "read", "already_done")} for r in reports]
    for r in per_replica:
        r["output_tokens_per_s"] = r["output_tokens"] / max(r["busy_s"], 1e-9)
    return {
        "rows": furthest["read"], "already_done": furthest["already_done"], "completed": total["rows"],
        "errors": total["errors"],
        "interrupted": any(r["interrupted"] for r in reports), "input_tokens": total["input_tokens"],
        "output_tokens": total["output_tokens"], "output_tokens_per_s": total["output_tokens"] / max(wall, 1e-9),
        "wall_s": wall, "latency_s": _percentiles(latencies), "tp_size": get_tp().size, "dp_size": len(reports),
        "replicas": per_replica, "config_hash": hashlib.sha256(config_yaml.encode()).hexdigest()[:16],
    }


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": ordered[-1]}


def _progress(total: int | None, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="rows", unit="row", disable=not enabled, dynamic_ncols=True)
