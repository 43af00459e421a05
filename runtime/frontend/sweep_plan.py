"""What a sweep is: its file (or command-line shorthand), its runs and their folders, each run's record.

A sweep file (format: docs/sweeps.md)::

    base: my.yaml                                  # base and out: relative to the file's folder
    grid: {sampling.temperature: [0.0, 0.7]}       # cartesian product; ``zip:`` lists advance together
    out: runs/my-sweep

Every run's config is validated here, before anything runs. Nothing in this module imports torch.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import itertools
import json
import os
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from runtime.config import ConfigError, RuntimeConfig, flatten, load_config, yaml_as_written
from runtime.frontend.job_files import JobPaths, write_atomic

DEFAULT_BASE = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"
SWEEP_KEYS = ("base", "overrides", "grid", "zip", "name", "out", "metrics", "plot", "reuse_engine")
# Set per run by the sweep: a sweep over them would point every run at one file.
PER_RUN_KEYS = ("job.output", "job.errors", "job.metrics")
# Sections a loaded engine does not read: runs that differ only there can share it.
REUSABLE_SECTIONS = ("sampling", "job")
# Keys that change neither a run's rows nor its measurements: a rerun may change them and still resume.
NOT_IDENTITY = ("job.progress", "job.fsync_every_s", "job.drain_timeout_s", "job.lock", "job.lock_wait_s", "logging.level",
                "parallel.timeout_s")
NOT_IDENTITY_SECTIONS = ("server.",)  # read by `launch.py serve` only, never by a sweep's jobs
RESULT_COLUMNS = ("status", "rows", "errors", "output_tokens", "tokens_per_s", "wall_s", "load_s")
RECORD = "run.json"
DONE, FAILED, INTERRUPTED, RUNNING, PENDING = "done", "failed", "interrupted", "running", "pending"
_UNSAFE = re.compile(r"[^A-Za-z0-9._=,+-]+")


@dataclass
class PlotSpec:
    x: str | None = None
    y: str = "tokens_per_s"


@dataclass
class Sweep:
    source: str
    base: list[str]
    overrides: list[str]
    grid: dict[str, list[str]]
    zip: dict[str, list[str]]
    out: Path
    name: str | None = None
    metrics: list[str] = field(default_factory=list)
    plot: PlotSpec = field(default_factory=PlotSpec)
    reuse_engine: bool = True

    @property
    def swept(self) -> list[str]:
        return [*self.grid, *self.zip]


@dataclass
class Run:
    index: int  # 1-based, in execution order (a Slurm array task runs the run of its task id)
    name: str
    point: dict[str, str]
    cfg: RuntimeConfig
    dir: Path

    @property
    def paths(self) -> JobPaths:
        return JobPaths.from_config(self.cfg.job)

    @property
    def prompts_input(self) -> bool:
        """No job.input in the config: the run serves job.prompts, written to its folder as rows."""
        return Path(self.cfg.job.input) == self.dir / "input.jsonl"

    @property
    def described(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.point.items())

    def swept_values(self) -> dict[str, Any]:
        """Plain values (a swept list is a list, not omegaconf's ListConfig, which JSON cannot write)."""
        node = OmegaConf.structured(self.cfg)
        values = {key: OmegaConf.select(node, key) for key in self.point}
        return {key: OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for key, v in values.items()}

    def engine_key(self) -> str:
        """Equal for two runs exactly when one loaded engine can serve both."""
        flat = flatten(OmegaConf.to_container(OmegaConf.structured(self.cfg)))
        return json.dumps({k: v for k, v in flat.items() if k.split(".")[0] not in REUSABLE_SECTIONS}, sort_keys=True)

    def identity(self) -> dict[str, Any]:
        flat = flatten(OmegaConf.to_container(OmegaConf.structured(self.cfg)))
        return {k: v for k, v in flat.items() if not outside_identity(k)}

    def record(self) -> dict[str, Any] | None:
        return read_record(self.dir)


def outside_identity(key: str) -> bool:
    return key in NOT_IDENTITY or key.startswith(NOT_IDENTITY_SECTIONS)


def load_sweep_file(path: str | Path, extra_configs: Sequence[str] = (), extra_overrides: Sequence[str] = (),
                    out: str | None = None, name: str | None = None) -> Sweep:
    """``out`` and ``name`` (the command line's --out, --name) replace the file's."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"sweep file {file} does not exist")
    try:
        text = file.read_text(encoding="utf-8")
        spec = yaml.safe_load(text)
        written = yaml_as_written(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"sweep file {file} is not valid YAML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"sweep file {file} is not UTF-8 text: {exc}") from None
    if not isinstance(spec, dict):
        raise ConfigError(f"sweep file {file} must hold a mapping (base, grid, zip, ...), not {type(spec).__name__}")
    src = str(file)
    for key in spec:
        if key not in SWEEP_KEYS:
            near = difflib.get_close_matches(str(key), SWEEP_KEYS, n=1)
            raise ConfigError(f"{src}: unknown sweep key '{key}'" + (f"; did you mean '{near[0]}'?" if near else "")
                              + f" (sweep keys: {', '.join(SWEEP_KEYS)})")
    base: list[str] = []
    for given in _str_list(spec.get("base", []), f"{src}: 'base'"):
        base.append(_beside(file, given))
        if not Path(base[-1]).is_file():
            raise ConfigError(f"{src}: 'base' {given}: config file {base[-1]} does not exist (a sweep file's 'base' "
                              "and 'out' are relative to its folder)")
    overrides = _str_list(spec.get("overrides", []), f"{src}: 'overrides'")
    if not out:
        out = spec.get("out")
        if not isinstance(out, str) or not out:
            raise ConfigError(f"{src}: 'out' (the sweep's folder) must be set to a path, or given as --out")
        out = _beside(file, out)
    reuse = spec.get("reuse_engine", True)
    if not isinstance(reuse, bool):
        raise ConfigError(f"{src}: 'reuse_engine' must be true or false, not {reuse!r}")
    name = name or spec.get("name")
    if name is not None and not isinstance(name, str):
        raise ConfigError(f"{src}: 'name' must be a string template such as \"{{model.path.name}}-t{{sampling.temperature}}\"")
    if not base and DEFAULT_BASE.is_file():  # --config files add to the default base, as they add to a given one
        base = [str(DEFAULT_BASE)]
    return Sweep(
        source=src, base=base + list(extra_configs), overrides=overrides + list(extra_overrides),
        grid=_axes(spec.get("grid"), _at(written, "grid"), f"{src}: 'grid'"),
        zip=_axes(spec.get("zip"), _at(written, "zip"), f"{src}: 'zip'"),
        out=Path(out), name=name, metrics=_str_list(spec.get("metrics", []), f"{src}: 'metrics'"),
        plot=_plot(spec.get("plot"), src), reuse_engine=reuse,
    )


def _beside(file: Path, path: str) -> str:
    """A path in a sweep file, relative to the file's folder (so the file runs from any folder)."""
    return path if Path(path).is_absolute() else os.path.normpath(file.parent / path)


def shorthand_sweep(configs: list[str], items: list[str], out: str | None = None, name: str | None = None) -> Sweep:
    """``--sweep key=a,b ...``: a value list with top-level commas is a grid axis, anything else an override."""
    grid: dict[str, list[str]] = {}
    overrides: list[str] = []
    for item in items:
        key, sep, text = item.partition("=")
        values = split_top_level(text) if sep else []
        if sep and key and len(values) > 1:
            if key in grid:
                raise ConfigError(f"--sweep: key '{key}' is given twice")
            grid[key] = values
        else:
            overrides.append(item)
    if out is None:  # the same command gets the same folder, so a rerun resumes (in any order of its overrides)
        same = sorted(o for o in overrides if not outside_identity(o.partition("=")[0].lstrip("+~")))
        # Run folders are named in axis order: axes in another order are another sweep, in another folder.
        order = [list(grid)] if list(grid) != sorted(grid) else []
        digest = hashlib.sha256(json.dumps([configs, same, grid, *order], sort_keys=True).encode()).hexdigest()[:8]
        out = f"outputs/sweep-{digest}"
    return Sweep(source="--sweep", base=list(configs), overrides=overrides, grid=grid, zip={}, out=Path(out), name=name)


def split_top_level(text: str) -> list[str]:
    """'a,b' -> ['a', 'b']; commas inside brackets, braces or quotes stay. A quote opens only where a value
    starts, as in the override grammar: the apostrophe of don't,can't is a letter."""
    parts, depth, quote, start, prev, escaped = [], 0, "", 0, ",", False
    for i, ch in enumerate(text):
        if escaped:  # the second quote of YAML's '' inside single quotes
            escaped = False
        elif quote:
            escaped = quote == ch == "'" and text[i + 1 : i + 2] == "'"
            quote = quote if escaped or ch != quote else ""
        elif ch in "'\"" and prev in ",[{:":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        if not ch.isspace():
            prev = ch
    parts.append(text[start:])
    return parts


def _str_list(value: Any, what: str) -> list[str]:
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{what} must be a string or a list of strings, not {value!r}")
    return value


def _axes(value: Any, written: Any, what: str) -> dict[str, list[str]]:
    """``written``: the same YAML read with every scalar as its text."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{what} must map config keys to lists of values, not {type(value).__name__}")
    axes = {}
    for key, values in value.items():
        if not isinstance(values, list):
            raise ConfigError(f"{what}: '{key}' must be a list of values, not {values!r}")
        if not values:
            raise ConfigError(f"{what}: '{key}' has no values")
        axes[str(key)] = [_override_text(v, t) for v, t in zip(values, _texts(values, _at(written, key)))]
    return axes


def _at(written: Any, key: Any) -> Any:
    """``written[key]``, found by key: a merge key (``<<``) is not merged in ``written``, so position says nothing.
    None where it is not there: the value is then given as YAML read it."""
    return written.get(str(key)) if isinstance(written, dict) else None


def _texts(value: list[Any], written: Any) -> list[Any]:
    return written if isinstance(written, list) and len(written) == len(value) else [None] * len(value)


def _override_text(value: Any, written: Any) -> str:
    """A sweep file's value as the text of a key=value override that reads back as a command line's would: a
    string quoted (JSON is YAML), any other scalar as written, so that a text key gets ``no`` or ``012`` as
    written (YAML 1.1 reads them as false and 10), as config files and overrides give it."""
    if isinstance(value, list):
        return "[" + ", ".join(_override_text(v, t) for v, t in zip(value, _texts(value, written))) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {_override_text(v, _at(written, k))}" for k, v in value.items()) + "}"
    if isinstance(value, str) or not isinstance(written, str):
        return json.dumps(value)
    return written


def _plot(value: Any, src: str) -> PlotSpec:
    if value is None:
        return PlotSpec()
    if not isinstance(value, dict) or set(value) - {"x", "y"}:
        raise ConfigError(f"{src}: 'plot' must be a mapping with 'x' (a swept key) and/or 'y' (a results column)")
    return PlotSpec(x=value.get("x"), y=value.get("y", "tokens_per_s"))


def plan_runs(sweep: Sweep) -> list[Run]:
    """Every run, its config validated; raises ConfigError naming the first problem."""
    _check_axes(sweep)
    default_base = [DEFAULT_BASE] if DEFAULT_BASE.is_file() else []
    runs = []
    for point in points(sweep):
        described = " ".join(f"{k}={v}" for k, v in point.items())
        try:
            cfg = load_config(sweep.base or default_base, [*sweep.overrides, *(f"{k}={v}" for k, v in point.items())])
        except ConfigError as exc:
            raise ConfigError(f"{sweep.source}: run {described}: {str(exc).splitlines()[0]}") from None
        runs.append(Run(0, "", point, cfg, sweep.out))
    if sweep.reuse_engine:
        first_seen: dict[str, int] = {}
        runs.sort(key=lambda r: first_seen.setdefault(r.engine_key(), len(first_seen)))
    for i, run in enumerate(runs, 1):
        run.index, run.name = i, run_name(sweep, run)
        run.dir = sweep.out / run.name
        _place(run, sweep.source)
    _check_unique(runs, sweep.source)
    _check_results_spec(sweep)
    return runs


def points(sweep: Sweep) -> list[dict[str, str]]:
    grid = [dict(zip(sweep.grid, combo)) for combo in itertools.product(*sweep.grid.values())]
    zipped = [dict(zip(sweep.zip, values)) for values in zip(*sweep.zip.values())] if sweep.zip else [{}]
    return [{**g, **z} for g in grid for z in zipped]


def _check_axes(sweep: Sweep) -> None:
    if not sweep.grid and not sweep.zip:
        raise ConfigError(f"{sweep.source}: the sweep has no runs: 'grid' and 'zip' are both empty")
    lengths = {key: len(values) for key, values in sweep.zip.items()}
    if len(set(lengths.values())) > 1:
        raise ConfigError(f"{sweep.source}: 'zip' lists advance together and must have one length; got {lengths}")
    both = set(sweep.grid) & set(sweep.zip)
    if both:
        raise ConfigError(f"{sweep.source}: {sorted(both)} in both 'grid' and 'zip'")
    fixed = [k for k in sweep.swept if k in PER_RUN_KEYS]
    if fixed:
        raise ConfigError(f"{sweep.source}: {fixed} cannot be swept: every run writes its own files in its folder")
    for item in sweep.overrides:  # the axis would replace the override in every run
        key = item.partition("=")[0].strip()
        for swept in sweep.swept:
            if key == swept or swept.startswith(f"{key}.") or key.startswith(f"{swept}."):
                axis = "grid" if swept in sweep.grid else "zip"
                raise ConfigError(f"{sweep.source}: override '{item}': '{swept}' is already swept ('{axis}'); drop the "
                                  "override or the axis")


def _place(run: Run, source: str) -> None:
    job = run.cfg.job
    for key in PER_RUN_KEYS:
        value = getattr(job, key.split(".")[1])
        if value is not None:
            raise ConfigError(f"{source}: {key}={value} is set, but every run writes its own {key.split('.')[1]} file in "
                              f"its folder ({run.dir}); leave {', '.join(PER_RUN_KEYS)} out of a sweep")
    if job.input is None:
        job.input = str(run.dir / "input.jsonl")
    elif not Path(job.input).exists():
        raise ConfigError(f"{source}: run {run.name}: config key 'job.input'={job.input} does not exist")
    job.output, job.errors, job.metrics = (str(run.dir / f) for f in ("output.jsonl", "errors.jsonl", "metrics.json"))
    run.paths.check_distinct()


def _check_unique(runs: list[Run], source: str) -> None:
    seen: dict[str, Run] = {}
    for run in runs:
        if run.name in seen:
            raise ConfigError(f"{source}: runs {seen[run.name].index} and {run.index} would share the folder "
                              f"'{run.name}': put the keys that differ into 'name'")
        seen[run.name] = run


def _check_results_spec(sweep: Sweep) -> None:
    if sweep.plot.x is not None and sweep.plot.x not in sweep.swept:
        raise ConfigError(f"{sweep.source}: plot x '{sweep.plot.x}' is not a swept key ({', '.join(sweep.swept)})")
    taken = {"run", "name", "error", *RESULT_COLUMNS, *sweep.swept}
    clash = [m for m in sweep.metrics if m in taken]
    if clash:
        raise ConfigError(f"{sweep.source}: 'metrics' {clash}: already a results column (run, name, the swept keys, "
                          f"{', '.join(RESULT_COLUMNS)}, error); the table reports it as measured over every attempt")
    columns = [*RESULT_COLUMNS, *sweep.metrics]
    if sweep.plot.y not in columns:
        raise ConfigError(f"{sweep.source}: plot y '{sweep.plot.y}' is not a results column ({', '.join(columns)}); "
                          "name a metrics.json key under 'metrics' to plot it")


class LayoutError(ConfigError):
    """The world or a run's model does not split into the run's TP groups."""


def check_layout(runs: list[Run], world_size: int, source: str) -> None:
    """Every run's TP size divides the world, and its model is there, is supported (at the run's model.max_seq_len)
    and splits over its TP group: a sweep, or a Slurm array, is refused at the start rather than failing run by run.
    Prepares the default model when a run uses it (so array tasks on nodes without internet find it ready)."""
    from models.config import ModelConfig, tp_problem
    from models.weights.default_model import resolve_model_path

    configs: dict[str, ModelConfig] = {}
    for run in runs:
        tp, path = run.cfg.parallel.tp_size or world_size, run.cfg.model.path
        if world_size % tp:
            raise LayoutError(f"{source}: run {run.described}: parallel.tp_size={tp} does not divide the world size "
                              f"{world_size} (the world is DP replicas x TP ranks)")
        try:
            if path not in configs:
                configs[path] = ModelConfig.from_dir(resolve_model_path(path))
            configs[path].max_seq_len(run.cfg.model.max_seq_len)
        except (FileNotFoundError, ValueError) as exc:
            raise ConfigError(f"{source}: run {run.described}: {exc}") from None
        problem = tp_problem(configs[path], tp)
        if problem:
            raise LayoutError(f"{source}: run {run.described}: {problem}")


def check_resumable(run: Run) -> None:
    """A folder left by a run of another config must not be skipped or resumed as if it were this run's."""
    record = run.record()
    if record is None or "config" not in record:
        return
    now, before = run.identity(), record["config"]
    # The folder's own files: the same files, named from whichever folder the sweep runs in.
    own = {*PER_RUN_KEYS, *(["job.input"] if run.prompts_input else [])}
    # A key the record lacks came with a later version of tpinfer: it was its default then.
    defaults = _default_identity()
    changed = sorted(k for k in now.keys() | before.keys()
                     if k not in own and now.get(k, defaults.get(k)) != before.get(k, defaults.get(k)))
    if changed:
        raise ConfigError(f"run {run.index} ({run.dir}) holds a run of another config (keys that differ: "
                          f"{', '.join(changed[:5])}): use another 'out', or delete the folder to run it again")


@functools.cache
def _default_identity() -> dict[str, Any]:
    return flatten(OmegaConf.to_container(OmegaConf.structured(RuntimeConfig())))


def run_name(sweep: Sweep, run: Run) -> str:
    if sweep.name is None:
        return safe_name(default_name(run.swept_values()))
    node = OmegaConf.to_container(OmegaConf.structured(run.cfg))
    try:
        text = _ConfigFormatter(node).format(sweep.name)
    except (KeyError, AttributeError, ValueError, IndexError) as exc:
        raise ConfigError(f"{sweep.source}: 'name' {sweep.name!r}: {exc.args[0] if exc.args else exc}") from None
    name = safe_name(text)
    if not name:
        raise ConfigError(f"{sweep.source}: 'name' {sweep.name!r} gives an empty folder name for run {run.index}")
    return name


def default_name(values: dict[str, Any]) -> str:
    """``temperature=0.7,path=Llama-3.1-8B``: shortest unambiguous key parts; paths by their last component."""
    shorts = [k.rsplit(".", 1)[-1] for k in values]
    parts = []
    for (key, value), short in zip(values.items(), shorts):
        label = short if shorts.count(short) == 1 else key
        shown = Path(value).name if isinstance(value, str) and "/" in value else value
        parts.append(f"{label}={shown}")
    return ",".join(parts)


def safe_name(text: str) -> str:
    return _UNSAFE.sub("_", text).strip("._")[:200]


class _ConfigFormatter(string.Formatter):
    """``{model.path.name}``: config keys, then attributes of the value (a string as a Path)."""

    def __init__(self, node: dict[str, Any]) -> None:
        super().__init__()
        self.node = node

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> tuple[Any, str]:
        value: Any = self.node
        parts = field_name.split(".")
        for i, part in enumerate(parts):
            if isinstance(value, dict):
                if part not in value:
                    raise KeyError(f"'{'.'.join(parts[: i + 1])}' is not a config key")
                value = value[part]
                continue
            target = Path(value) if isinstance(value, str) else value
            if not hasattr(target, part):
                raise AttributeError(f"'{'.'.join(parts[:i])}' has no attribute '{part}'")
            value = getattr(target, part)
        if isinstance(value, dict):
            raise ValueError(f"'{field_name}' is a config section, not a value")
        return value, field_name


def read_record(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / RECORD).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return None  # a kill while the first record was written: not done


def write_record(folder: Path, record: dict[str, Any]) -> None:
    write_atomic(folder / RECORD, json.dumps(record, indent=2) + "\n")
