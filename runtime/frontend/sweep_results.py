"""A sweep's results: one row per run from its folder, as ``results.csv``, ``results.md`` and ``results.png``.

Read from files only (each run's ``run.json``, output, errors and metrics), so ``--collect`` and the last
Slurm array task assemble the same table the sweep writes at its end.
"""

from __future__ import annotations

import csv
import difflib
import io
import json
import logging
from pathlib import Path
from typing import Any

from runtime.config import flatten
from runtime.frontend import openai_api
from runtime.frontend.job_files import normalize_id, whole_lines, write_atomic
from runtime.frontend.sweep_plan import PENDING, RESULT_COLUMNS, Run, Sweep

log = logging.getLogger(__name__)


def result_row(sweep: Sweep, run: Run) -> dict[str, Any]:
    """Swept keys, then status, rows, errors, output tokens, tokens/s, wall and load time, then the named
    metrics; ``error`` (why a run failed) last. Tokens/s: output tokens over job time, summed over the
    attempts that returned (a killed attempt leaves no time; its rows still count)."""
    record = run.record() or {}
    attempts = record.get("attempts", [])
    paths = run.paths
    job_s = sum(a.get("job_s", 0.0) for a in attempts)
    generated = sum(a.get("output_tokens", 0) for a in attempts)
    row: dict[str, Any] = {"run": run.index, "name": run.name, **run.swept_values()}
    served, tokens = _served(paths.output)
    row.update(
        status=record.get("status", PENDING),
        rows=served,
        errors=sum(1 for _ in whole_lines(paths.errors)),
        output_tokens=tokens,
        tokens_per_s=round(generated / job_s, 2) if job_s > 0 and generated > 0 else None,  # else unmeasured
        wall_s=round(sum(a.get("wall_s", 0.0) for a in attempts), 3) if attempts else None,
        load_s=round(sum(a.get("load_s", 0.0) for a in attempts), 3) if attempts else None,
    )
    metrics = _read_json(paths.metrics)
    for key in sweep.metrics:
        row[key] = _dotted(metrics, key)
    row["error"] = record.get("error") or ""
    return row


def columns(sweep: Sweep) -> list[str]:
    return ["run", "name", *sweep.swept, *RESULT_COLUMNS, *sweep.metrics, "error"]


def write_results(sweep: Sweep, runs: list[Run]) -> list[Path]:
    """results.csv, results.md and (with matplotlib) results.png in the sweep's folder; returns what was written."""
    rows = [result_row(sweep, run) for run in runs]
    warn_unknown_metrics(sweep, runs)
    names = columns(sweep)
    sweep.out.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = sweep.out / "results.csv", sweep.out / "results.md"
    write_atomic(csv_path, to_csv(rows, names))
    write_atomic(md_path, to_markdown(rows, names, exact={"run", "name", *sweep.swept}))
    written = [csv_path, md_path]
    png = write_plot(sweep, rows, sweep.out / "results.png")
    return written + ([png] if png else [])


def warn_unknown_metrics(sweep: Sweep, runs: list[Run]) -> None:
    """A ``metrics`` name that no run's metrics.json has is a typo, not a value yet to come: say so, once."""
    written = [m for m in (_read_json(run.paths.metrics) for run in runs) if m]
    if not written:
        return
    keys = sorted({k for m in written for k in flatten(m)})
    for name in sweep.metrics:
        if all(_dotted(m, name) is None for m in written):
            close = difflib.get_close_matches(name, keys, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"its keys: {', '.join(keys)}"
            log.warning("metric '%s' is in no run's metrics.json, so its column is empty; %s", name, hint)


def to_csv(rows: list[dict[str, Any]], names: list[str]) -> str:
    """Every value as measured (the Markdown table rounds)."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=names, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _cell(row.get(k), exact=True) for k in names})
    return buf.getvalue()


def to_markdown(rows: list[dict[str, Any]], names: list[str], exact: set[str] = frozenset()) -> str:
    """Measured values rounded; the ``exact`` columns (the swept keys: what names a run) as given."""
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"

    out = [line(names), line(["---"] * len(names))]
    out += [line([_cell(row.get(k), exact=k in exact) for k in names]) for row in rows]
    return "\n".join(out) + "\n"


def write_plot(sweep: Sweep, rows: list[dict[str, Any]], path: Path) -> Path | None:
    """``plot.y`` against ``plot.x`` (default: tokens/s against the first swept key), one line per combination
    of the other swept keys. Skipped, with one warning, when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        log.warning("%s skipped: matplotlib is not installed (pip install matplotlib)", path)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_key, y_key = sweep.plot.x or sweep.swept[0], sweep.plot.y
    others = [k for k in sweep.swept if k != x_key]
    xs = [row[x_key] for row in rows]
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in xs)
    ticks = sorted(set(xs)) if numeric else list(dict.fromkeys(map(str, xs)))
    lines: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        if not isinstance(row.get(y_key), (int, float)):
            continue  # a pending or failed run has no value
        label = ", ".join(f"{k.rsplit('.', 1)[-1]}={row[k]}" for k in others) or y_key
        x = row[x_key] if numeric else ticks.index(str(row[x_key]))
        lines.setdefault(label, []).append((x, row[y_key]))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, pts in lines.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    if not numeric:
        ax.set_xticks(range(len(ticks)), ticks, rotation=20, ha="right", fontsize=8)
    ax.set_xlabel(x_key)
    ax.set_ylabel(y_key)
    ax.set_title(sweep.out.name, fontsize=10)
    if others and lines:
        ax.legend(fontsize=7)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    write_atomic(path, [png.getvalue()])
    return path


def _served(path: Path) -> tuple[int, int]:
    """Rows served and the tokens they generated, from a native output or an OpenAI batch one (whose result
    lines keep the count in ``response.body.usage``; its error lines are not served rows)."""
    keys: set[str] = set()
    tokens = 0
    for line in whole_lines(path):
        try:
            obj = json.loads(line)
            if "custom_id" in obj:
                if not openai_api.is_served(obj):
                    continue
                key, counts = obj["custom_id"], obj["response"]["body"]["usage"]
            else:
                key, counts = normalize_id(obj["id"]), obj
            count = int(counts.get("completion_tokens", 0))
        except (ValueError, TypeError, KeyError, AttributeError):
            continue  # not a result line
        if key is not None and (seen := json.dumps(key)) not in keys:
            keys.add(seen)
            tokens += count
    return len(keys), tokens


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _dotted(data: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def _cell(value: Any, exact: bool = False) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and not exact:
        return f"{value:.4g}" if abs(value) < 1e-3 and value else f"{round(value, 3)}"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)
