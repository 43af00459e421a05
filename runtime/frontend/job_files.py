"""The files of a job: JSONL input rows parsed and validated, JSONL output rows read back and appended, and
the part files of replicas r > 0 (``<output>.part-<r>``), merged at the end of a run or the start of the next."""

from __future__ import annotations

import base64
import codecs
import datetime
import difflib
import glob
import json
import logging
import math
import os
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from runtime.config import ConfigError, flatten
from runtime.frontend import openai_api
from runtime.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class InputError(ValueError):
    """The input as a whole cannot be read as asked (a row-level problem is an error row instead)."""


@dataclass
class JobRow:
    line: int
    id: Any
    prompt: Any = None
    sampling: SamplingParams | None = None
    error: str | None = None
    code: str | None = None
    param: str | None = None  # the request parameter an OpenAI line's error is about
    request: openai_api.Request | None = None
    keep: dict[str, Any] | None = None

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
        for key in ("output", "errors", "metrics"):
            value = getattr(job, key)
            if value and value.endswith(("/", os.sep)):  # a Path drops the '/': out/ would become a file named out
                raise ConfigError(f"config key 'job.{key}'={value} names a folder; name a file in it")
        out = Path(job.output)
        return cls(
            input=Path(job.input), output=out,
            errors=Path(job.errors) if job.errors else _beside(out, ".errors.jsonl"),
            metrics=Path(job.metrics) if job.metrics else _beside(out, ".metrics.json"),
            config=_beside(out, ".config.yaml"),
        )

    def check_distinct(self) -> None:
        """Five different files: a metrics or errors file on top of the input or the output destroys it."""
        named = {"job.input": self.input, "job.output": self.output, "job.errors": self.errors,
                 "job.metrics": self.metrics, "the config copy": self.config}
        seen: dict[Path, str] = {}
        for key, path in named.items():
            other = seen.setdefault(path.resolve(), key)
            if other != key:
                raise ConfigError(f"config keys '{other}' and '{key}' name the same file ({path})")
        if self.input.is_dir():
            shard = next((k for k, p in named.items() if k != "job.input" and read_as_shard(self.input, p)), None)
            if shard is not None:
                raise ConfigError(f"{shard}={named[shard]} is in the input folder job.input={self.input}, where a "
                                  "rerun would read it as one of the input's shards: write it outside that folder")

    def check_same_rows(self, config_yaml: str) -> None:
        """A rerun adds rows to an output only under the settings its rows were made with (the config copy
        beside it says which): otherwise rows of two settings would pass for one job's."""
        if not self.config.is_file():
            return
        recorded = _flat_config(self.config.read_text())
        self._check_side_files_are_ours(recorded)
        if not (self.output.exists() or part_files(self.output)):
            return
        before, now = _row_settings(recorded), _row_settings(_flat_config(config_yaml))
        changed = sorted(k for k in before.keys() & now.keys() if before[k] != now[k])  # keys of both versions
        if changed:
            shown = "; ".join(f"{k}: {before[k]!r} then, {now[k]!r} now" for k in changed[:4])
            raise ConfigError(f"job.output={self.output} holds rows made with other settings ({shown}"
                              f"{'; ...' if len(changed) > 4 else ''}): use another job.output, or delete "
                              f"{self.config} to add this config's rows to it")

    def _check_side_files_are_ours(self, recorded: dict[str, Any]) -> None:
        """out.jsonl, out.json and out share side files (out.config.yaml, out.errors.jsonl, out.metrics.json):
        while another of them holds rows, this job would overwrite its settings record and its errors."""
        other_name = _recorded_output(recorded)
        if other_name is None or other_name == self.output.name:
            return
        other = self.output.with_name(other_name)
        if other.exists() or part_files(other):
            raise ConfigError(f"job.output={self.output} would share {self.config} (and the errors and metrics files "
                              f"beside it) with job.output={other}, whose rows it describes: give this output a name "
                              "of its own")

    def check_writable(self) -> None:
        """The output files can be made: checked before the model loads, so a typo costs seconds, not a load."""
        for key, path in (("job.output", self.output), ("job.errors", self.errors), ("job.metrics", self.metrics)):
            try:
                folder_named = path.is_dir()
            except OSError as exc:  # a name too long, say
                raise ConfigError(f"config key '{key}'={path}: {exc.strerror}") from None
            if folder_named:
                raise ConfigError(f"config key '{key}'={path} is a folder; name a file in it")
            folder = path.parent
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"config key '{key}'={path}: its folder cannot be made ({exc.strerror}: "
                                  f"{exc.filename or folder})") from None
            if not os.access(folder, os.W_OK | os.X_OK):
                raise ConfigError(f"config key '{key}'={path}: its folder {folder} is not writable")


# What a row's result depends on besides the row. Where the job runs (devices, parallelism, batch sizes) may
# change between runs of one job, as when a preempted job is requeued elsewhere, and so may the input file
# (a sample of the rows first, then all of them: ids name the rows).
ROW_SETTINGS = ("model.", "sampling.", "cache.dtype", "engine.seed", "engine.deterministic", "job.columns.",
                "job.chat_template")


def _flat_config(config_yaml: str) -> dict[str, Any]:
    """A config copy's keys, flattened (empty where it is not a YAML mapping)."""
    try:
        node = yaml.safe_load(config_yaml)
    except yaml.YAMLError:
        return {}
    return flatten(node) if isinstance(node, dict) else {}


def _recorded_output(config: dict[str, Any]) -> str | None:
    """The file name of the job.output a config copy was written for (its folder is the copy's own)."""
    output = config.get("job.output")
    return Path(output).name if isinstance(output, str) and output else None


def _row_settings(config: dict[str, Any]) -> dict[str, Any]:
    settings = {k: v for k, v in config.items()
                if any(k == s or (s.endswith(".") and k.startswith(s)) for s in ROW_SETTINGS)}
    path = settings.get("model.path")
    if isinstance(path, str) and path != "default":  # one folder however it is spelled
        settings["model.path"] = str(Path(path).resolve())
    return settings


PARQUET_SUFFIXES = (".parquet", ".pq")


def shard_name(folder: Path, path: Path, suffixes: tuple[str, ...]) -> bool:
    """A shard of a table folder: a file with one of ``suffixes``, under no name starting with '.' or '_'."""
    return path.suffix.lower() in suffixes and not any(p.startswith((".", "_")) for p in path.relative_to(folder).parts)


def read_as_shard(folder: Path, path: Path) -> bool:
    """Whether a file written at ``path`` would be read as one of the shards of the input folder ``folder``."""
    folder, path = folder.resolve(), path.resolve()
    if folder not in path.parents or (folder / "state.json").is_file():  # save_to_disk lists its own files
        return False
    return shard_name(folder, path, (*PARQUET_SUFFIXES, ".arrow"))


def _beside(out: Path, suffix: str) -> Path:
    """A side file of the output: ``out.jsonl`` -> ``out<suffix>``, other names keep their whole name (out.parquet
    and out.pq do not share one); out.jsonl, out.json and out do, and ``check_same_rows`` keeps them apart."""
    return out.with_suffix(suffix) if out.suffix in (".jsonl", ".json") else out.with_name(out.name + suffix)


def read_rows(path: Path, defaults: SamplingParams, chat_template: bool, fmt: str = "native") -> Iterator[JobRow]:
    """The rows of a JSONL input in order; one file holds one kind (native or openai, ``fmt``: job.format): a
    row of the other kind is an error row, so the rows after it are still served."""
    kind = jsonl_format(path, fmt)
    seen: set[str] = set()
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if line_no == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)  # as some editors and Windows tools save UTF-8
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                error = f"{path}:{line_no} is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"
                yield JobRow(line_no, _salvage_custom_id(raw) if kind == "openai" else None, error=error,
                             code="invalid_json")
                continue
            if not line.strip():
                continue
            obj, error = _load_json(line, line_no)
            if error is not None:
                yield JobRow(line_no, _salvage_custom_id(raw) if kind == "openai" else None, error=error,
                             code="invalid_json")
                continue
            found = row_kind(obj, kind)
            if found == "openai" and kind == "native" and "id" in obj:
                found = kind  # a native row with an OpenAI key of its own and a misspelt prompt: say which key
            if found is not None and found != kind:
                yield JobRow(line_no, None, code="invalid_request",
                             error=f"{path}:{line_no} is {_KIND_NAMES[found]} in a file of {_KIND_PLURALS[kind]} "
                                   f"({'job.format=' + fmt if fmt != 'auto' else 'as its first row says'}); "
                                   "a file holds one kind of row")
                continue
            if kind == "openai":
                yield _openai_row(obj, line_no, defaults, seen)
            else:
                yield _native_row(obj, line_no, defaults, chat_template, seen)


_KIND_NAMES = {"native": "a native row ({id, prompt | messages})", "openai": "an OpenAI batch line ({custom_id, body})"}
_KIND_PLURALS = {"native": "native rows", "openai": "OpenAI batch lines"}


def row_kind(obj: Any, fmt: str = "auto") -> str | None:
    """openai, native, or None (an error row either way). A native row's prompt is at the top, and it may carry
    url, body (even an object) or custom_id keys of its own; an OpenAI batch line's request is its body object.
    A row that reads as both is native, unless ``fmt`` (job.format) says openai."""
    if not isinstance(obj, dict):
        return None
    native = "prompt" in obj or "messages" in obj
    openai = "custom_id" in obj or ("url" in obj and isinstance(obj.get("body"), dict))
    if native and openai and fmt != "auto":
        return fmt
    if native:
        return "native"
    if openai:
        return "openai"
    return "native" if "id" in obj else None


def jsonl_format(path: Path, forced: str = "auto") -> str:
    """The kind of rows a JSONL file holds, from its first row of a known kind (native if none is); a forced
    ``job.format`` must agree with that row, so a mismatch stops the job before the model loads."""
    _check_is_jsonl(path)
    found = None
    with open(path, "rb") as f:
        for raw in f:
            try:
                found = row_kind(json.loads(raw.removeprefix(codecs.BOM_UTF8)), forced)
            except (ValueError, RecursionError):
                continue
            if found is not None:
                break
    if forced == "auto":
        return found or "native"
    if found is not None and found != forced:
        raise InputError(f"{path}: its first row is {_KIND_NAMES[found]}, in a file of {_KIND_PLURALS[forced]} "
                         f"(job.format={forced}); a file holds one kind of row")
    return forced


_COMPRESSED = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz",
               b"PK\x03\x04": "zip"}


def _check_is_jsonl(path: Path) -> None:
    """A compressed file or one JSON array is not JSON Lines: said before the model loads, where every one of its
    lines would otherwise be an error row."""
    with open(path, "rb") as f:
        first_line = f.readline(1 << 20)
    for magic, name in _COMPRESSED.items():
        if first_line.startswith(magic):
            raise InputError(f"job.input={path} is {name}-compressed; decompress it first (JSONL inputs are read as "
                             "plain text)")
    text = first_line.removeprefix(codecs.BOM_UTF8).strip()
    if text.startswith(b"["):
        try:
            json.loads(text)
        except (ValueError, RecursionError):  # an array that goes on over the next lines
            raise InputError(f"job.input={path} holds one JSON array, not JSON Lines (one object per line); "
                             f"convert it first, e.g. jq -c '.[]' {path} > rows.jsonl") from None


_CUSTOM_ID = re.compile(rb'"custom_id"\s*:\s*("(?:[^"\\]|\\.)*")')


def _salvage_custom_id(raw: bytes) -> str | None:
    """The custom_id of a line that is not valid JSON, when it can be read, so its error line names it."""
    match = _CUSTOM_ID.search(raw)
    if match is None:
        return None
    try:
        value = json.loads(match.group(1).decode("utf-8", errors="replace"))
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def normalize_id(value: Any) -> str | int | None:
    """A row's id as written, or None where it holds none: not a bool, nor a blank string (a CSV's empty cell)."""
    if isinstance(value, bool) or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value if isinstance(value, (str, int)) else None


def _load_json(line: str, line_no: int) -> tuple[Any, str | None]:
    line = line.rstrip("\r\n")  # a line cut short is then reported at its end, not at column 1 of the next
    try:
        return json.loads(line), None
    except json.JSONDecodeError as exc:
        reason = exc.msg.removesuffix(" at")
        return None, f"line {line_no} is not valid JSON: {reason} at column {exc.colno}"
    except (ValueError, RecursionError) as exc:  # an integer over 4,300 digits, or nesting deeper than the stack
        return None, f"line {line_no} cannot be read: {first_line(exc)[:200]}"


_NATIVE_KEYS = ("id", "prompt", "messages", "sampling")


def _misspelt_key(row: dict[str, Any]) -> str | None:
    """Other keys ride along unread (an answer kept for scoring, an ``idx``), but one a letter or two from a key
    the row lacks would silently drop what it holds: ``samplng`` would serve the row with the default sampling.
    (A row without ``id`` is an error anyway.)"""
    missing = [] if "sampling" in row else ["sampling"]
    if "prompt" not in row and "messages" not in row:
        missing += ["prompt", "messages"]
    for key in row:
        close = difflib.get_close_matches(key, missing, n=1, cutoff=0.75) if key not in _NATIVE_KEYS else []
        if close:
            return f"unknown key {key!r} (did you mean {close[0]!r}?)"
    return None


def _native_row(row: Any, line_no: int, defaults: SamplingParams, chat_template: bool, seen: set[str]) -> JobRow:
    if not isinstance(row, dict):
        return JobRow(line_no, None, error=f"line {line_no} must be a JSON object")
    row_id = normalize_id(row.get("id"))
    if row_id is None:
        return JobRow(line_no, None, error=f"line {line_no} has no usable 'id' (a non-blank string or an integer): {row.get('id')!r}")
    key = json.dumps(row_id)
    if key in seen:
        return JobRow(line_no, row_id, error=f"line {line_no}: duplicate id {row_id!r}")
    seen.add(key)
    misspelt = _misspelt_key(row)
    if misspelt is not None:
        return JobRow(line_no, row_id, error=f"line {line_no}: {misspelt}")
    if ("prompt" in row) == ("messages" in row):
        return JobRow(line_no, row_id, error=f"line {line_no}: a row needs exactly one of 'prompt' or 'messages'")
    if "messages" in row and not (
        isinstance(row["messages"], list) and row["messages"] and all(isinstance(m, dict) for m in row["messages"])
    ):
        return JobRow(line_no, row_id, error=f"line {line_no}: 'messages' must be a non-empty list of message objects")
    prompt = row.get("prompt", row.get("messages"))
    if isinstance(prompt, str) and not prompt.strip():
        return JobRow(line_no, row_id, error=f"line {line_no}: the prompt is empty")
    if isinstance(prompt, str) and chat_template and "prompt" in row:
        prompt = [{"role": "user", "content": prompt}]
    sampling = row.get("sampling")
    sampling = {} if sampling is None else sampling
    if not isinstance(sampling, dict):
        return JobRow(line_no, row_id, error=f"line {line_no}: 'sampling' must be an object, not {sampling!r}")
    try:
        sampling = SamplingParams.from_dict(sampling, base=defaults)
    except (TypeError, ValueError) as exc:
        return JobRow(line_no, row_id, error=f"line {line_no}: {exc}")
    return JobRow(line_no, row_id, prompt=prompt, sampling=sampling)


def _openai_row(obj: Any, line_no: int, defaults: SamplingParams, seen: set[str]) -> JobRow:
    """An OpenAI batch line; chat messages always get the chat template and completion prompts never do, as
    the two endpoints do."""
    if not isinstance(obj, dict):
        return JobRow(line_no, None, error=f"line {line_no} must be a JSON object", code="invalid_request")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return JobRow(line_no, None, code="invalid_request",
                      error=f"line {line_no} has no usable 'custom_id' (a non-empty string): {custom_id!r}")
    key = json.dumps(custom_id)
    if key in seen:
        return JobRow(line_no, custom_id, error=f"line {line_no}: duplicate custom_id {custom_id!r}",
                      code="duplicate_custom_id")
    seen.add(key)
    try:
        prompt, sampling, request = openai_api.parse_line(obj, defaults)
    except openai_api.RequestError as exc:
        return JobRow(line_no, custom_id, error=f"line {line_no}: {exc}", code=exc.code, param=exc.param)
    return JobRow(line_no, custom_id, prompt=prompt, sampling=sampling, request=request)


def whole_lines(path: Path, repair: bool = False) -> Iterator[bytes]:
    """The complete lines of ``path``, read as they are iterated (an output may be larger than memory); a torn
    last line from a killed writer is left out (with ``repair``, cut at once, before the first line is read)."""
    if not path.exists():
        return iter(())
    with open(path, "rb") as f:
        end = _after_last_newline(f)
        tail = f.read()
    newline_missing = bool(tail) and _is_object(tail)  # a whole last line, only its newline missing (an edit)
    if repair and tail:
        with open(path, "r+b") as f:
            if newline_missing:
                f.seek(0, os.SEEK_END)
                f.write(b"\n")
            else:
                f.truncate(end)
    return _lines(path, end + len(tail) if newline_missing else end)


def _lines(path: Path, end: int) -> Iterator[bytes]:
    with open(path, "rb") as f:
        done = 0
        for line in f:
            if done >= end:
                return
            done += len(line)
            yield line.removesuffix(b"\n")


def _after_last_newline(f: Any, chunk: int = 1 << 16) -> int:
    """The offset just past the last newline of the open file ``f`` (0 if it has none), searched from its end;
    ``f`` is left there."""
    stop = os.fstat(f.fileno()).st_size
    while stop > 0:
        start = max(0, stop - chunk)
        f.seek(start)
        found = f.read(stop - start).rfind(b"\n")
        if found >= 0:
            f.seek(start + found + 1)
            return start + found + 1
        stop = start
    f.seek(0)
    return 0


def _is_object(line: bytes) -> bool:
    """Whether ``line`` is a whole JSON object: a writer killed mid-line never leaves one."""
    try:
        return isinstance(json.loads(line), dict)
    except (ValueError, RecursionError):
        return False


def row_key(line: bytes) -> str | None:
    try:
        return json.dumps(normalize_id(json.loads(line)["id"]))
    except (ValueError, KeyError, TypeError):
        return None


def done_ids(path: Path, repair: bool = True) -> set[str]:
    """Ids of the rows a previous run wrote; a torn last line is cut (``repair``), other non-row lines skipped."""
    keys = set()
    for line_no, line in enumerate(whole_lines(path, repair), 1):
        key = row_key(line)
        if key is not None:
            keys.add(key)
        elif line.strip(b" \t\r\x00"):
            log.warning("%s:%d is not a result row; ignored (that id, if any, is served again)", path, line_no)
    return keys


def part_path(path: Path, replica: int) -> Path:
    return path if replica == 0 else path.with_name(f"{path.name}.part-{replica}")


def part_files(path: Path) -> list[Path]:
    return sorted(path.parent.glob(glob.escape(path.name) + ".part-*"))


def merge_parts(path: Path, results: bool = True) -> int:
    """Append every ``<path>.part-*`` to ``path``, then delete the parts; returns the lines added.

    ``results``: skip ids ``path`` already holds, so a merge interrupted before its deletes adds nothing twice.
    """
    lines = whole_lines(path, repair=True)  # appends start clean
    parts = part_files(path)
    if not parts:
        return 0
    seen = {key for key in map(row_key, lines) if key is not None} if results else set()
    added = 0
    with open(path, "ab") as out:
        for part in parts:
            for line in whole_lines(part):
                if results:
                    key = row_key(line)
                    if key is None or key in seen:
                        continue
                    seen.add(key)
                out.write(line + b"\n")
                added += 1
        out.flush()
        os.fsync(out.fileno())
    for part in parts:
        part.unlink()
    return added


_RESULT_NAMES = {"jsonl": "native result rows", "openai": "OpenAI batch result lines"}


def check_output_kind(output: Path, kind: str) -> None:
    """A JSONL output (and its parts) holds results of one kind, ``kind`` (jsonl or openai), as its first result
    line says: a rerun of an OpenAI batch job rewrites its output without its error lines, and a native job
    would take another kind's ids for its own."""
    for path in (output, *part_files(output)):
        found = _first_result(path)
        if found is not None and found[1] != kind:
            raise ConfigError(f"job.output={output} holds {_RESULT_NAMES[found[1]]} ({path}:{found[0]}), and this "
                              f"job writes {_RESULT_NAMES[kind]}: use another job.output, or move {path} away")


def _first_result(path: Path) -> tuple[int, str] | None:
    """(line number, jsonl or openai) of the first result line of ``path``; None if it holds none."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return None
    with f:
        for line_no, raw in enumerate(f, 1):
            try:
                obj = json.loads(raw)
            except (ValueError, RecursionError):
                continue  # a torn or zero-filled line
            if openai_api.is_result_line(obj):
                return line_no, "openai"
            if isinstance(obj, dict) and "id" in obj:
                return line_no, "jsonl"
    return None


def served_custom_ids(path: Path) -> set[str]:
    """Keys (the custom_id as JSON) of the requests an OpenAI batch output answers; error lines are not answers."""
    keys = set()
    for line in whole_lines(path):
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if openai_api.is_served(obj) and isinstance(obj.get("custom_id"), str):
            keys.add(json.dumps(obj["custom_id"]))
    return keys


def drop_error_lines(path: Path) -> int:
    """Remove an OpenAI batch output's error lines so a rerun retries them; written aside and renamed, so a kill
    leaves the old file whole. Every other line stays: only an error line is known to hold nothing."""

    def error_line(line: bytes) -> bool:
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):
            return False
        return openai_api.is_result_line(obj) and not openai_api.is_served(obj)

    dropped = sum(map(error_line, whole_lines(path, repair=True)))
    if dropped:
        write_atomic(path, (line + b"\n" for line in whole_lines(path) if not error_line(line)))
    return dropped


def write_atomic(path: Path, data: str | Iterable[bytes]) -> None:
    """Write a temporary file, sync it, rename it over ``path``: a reader (another array task, a rerun after a
    kill) sees the old file or the new one, never part of one. The temporary name carries the pid, so writers in
    several processes do not share one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.writelines([data.encode()] if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    sync_dir(path.parent)


def sync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def json_line(row: dict[str, Any]) -> bytes:
    """``row`` as one line of strict JSON, which any parser reads back: NaN and infinities are null; of values
    JSON has no type for (kept table columns), bytes are base64, dates, times and durations ISO 8601, decimals
    their exact text."""
    try:
        text = json.dumps(row, ensure_ascii=False, allow_nan=False, default=_json_value)
    except ValueError:  # a non-finite float: jobs pass kept values through finite_values first, so this is rare
        text = json.dumps(finite_values(row), ensure_ascii=False, allow_nan=False, default=_json_value)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (valid JSON): escaped, it reads back the same
        return json.dumps(json.loads(text), allow_nan=False).encode("ascii")


def _json_value(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, (datetime.date, datetime.time)):  # datetime is a date
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return _iso_duration(value // datetime.timedelta(microseconds=1) * 1000)
    if type(value).__module__ == "pyarrow.lib":  # a nanosecond time: tables.py keeps those as Arrow scalars
        return _nanosecond_text(value)
    return str(value)  # Decimal and the like: their exact text


def _nanosecond_text(value: Any) -> str:
    """A nanosecond timestamp, time of day or duration (an Arrow scalar) as ISO 8601 text; one that is whole
    microseconds reads as a microsecond column's value does."""
    import pyarrow as pa  # only tables hold such values: a JSONL job never imports pyarrow

    nanos = value.value
    if pa.types.is_duration(value.type):
        return _iso_duration(nanos)
    micro_type = pa.timestamp("us", value.type.tz) if pa.types.is_timestamp(value.type) else pa.time64("us")
    micros, extra = divmod(nanos, 1000)
    as_py = pa.scalar(micros, micro_type).as_py()
    if extra == 0:
        return as_py.isoformat()
    text = as_py.isoformat(timespec="microseconds")
    digits_end = text.index(".") + 7
    return f"{text[:digits_end]}{extra:03d}{text[digits_end:]}"


def _iso_duration(nanos: int) -> str:
    """ISO 8601 duration, exact to the nanosecond: ``P1DT2H3M4.5S``; negative ones lead with ``-``."""
    sign = "-" if nanos < 0 else ""
    days, nanos = divmod(abs(nanos), 86_400 * 10**9)
    hours, nanos = divmod(nanos, 3_600 * 10**9)
    minutes, nanos = divmod(nanos, 60 * 10**9)
    seconds, nanos = divmod(nanos, 10**9)
    second_text = f"{seconds}.{nanos:09d}".rstrip("0").rstrip(".")
    return f"{sign}P{days}DT{hours}H{minutes}M{second_text}S"


def first_line(exc: BaseException) -> str:
    """The first line of an error's message (pyarrow's run on with context), or its type when it has none."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def finite_values(value: Any) -> Any:
    """``value`` with NaN and infinities, at any depth, as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_values(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_values(v) for v in value]
    return value


class JsonlAppender:

    def __init__(self, path: Path, fsync_every_s: float, mode: str = "a") -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, mode + "b")
        self.fsync_every_s = fsync_every_s
        self.last_sync = time.monotonic()

    def write(self, row: dict[str, Any]) -> None:
        self.file.write(json_line(row) + b"\n")
        self.file.flush()
        if time.monotonic() - self.last_sync >= self.fsync_every_s:
            os.fsync(self.file.fileno())
            self.last_sync = time.monotonic()

    def close(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


def result_row(row_id: Any, output: Any) -> dict[str, Any]:
    """The output line of a finished row; logprob and ``choices`` keys appear only when the row asked for them."""
    row: dict[str, Any] = {"id": row_id}
    if len(output.outputs) > 1:
        row["choices"] = [_choice(s, with_index=True) for s in output.outputs]
        row["prompt_tokens"] = output.prompt_tokens
        row["completion_tokens"] = output.total_completion_tokens
    else:
        row.update(_choice(output.outputs[0] if output.outputs else output, with_index=False))
        row["prompt_tokens"] = output.prompt_tokens
        row["completion_tokens"] = row.pop("completion_tokens")
    if output.prompt_logprobs is not None:
        row["prompt_logprobs"] = output.prompt_logprobs
    return row


def _choice(sample: Any, with_index: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": sample.sample_index} if with_index else {}
    choice.update(text=sample.text, finish_reason=sample.finish_reason, completion_tokens=sample.completion_tokens)
    if sample.logprobs is not None:
        choice.update(logprobs=sample.logprobs, cumulative_logprob=sample.cumulative_logprob)
    return choice


