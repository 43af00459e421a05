"""Experiment sweeps on CPU: a tiny random Llama with the default model's tokenizer, a few text rows per run."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from runtime.config import ConfigError, RuntimeConfig
from runtime.frontend import job as job_module
from runtime.frontend import sweep
from runtime.frontend.job_files import JsonlAppender
from runtime.frontend.sweep_plan import (
    PlotSpec,
    Sweep,
    check_layout,
    load_sweep_file,
    plan_runs,
    shorthand_sweep,
    split_top_level,
    write_record,
)
from runtime.frontend.sweep_results import write_plot
from tests.conftest import make_tiny_text_llama
from tests.test_slurm_live import slurm, tiny_model  # noqa: F401 - fixtures (a local Slurm cluster, its model)

REPO = Path(__file__).resolve().parents[1]
ROWS = 6
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """4 heads (TP=2 divides them) and the default model's tokenizer, so rows are text."""
    path = make_tiny_text_llama(tmp_path_factory.mktemp("sweep_model"), default_model_dir, seed=5)
    return path


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sweep_rows") / "rows.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": f"Row {i}: tell me about {i * 3}."}) + "\n"
                            for i in range(ROWS)))
    return path


def base_overrides(model_dir: Path, rows: Path) -> list[str]:
    return [f"model.path={model_dir}", "engine.device=cpu", "model.dtype=float32", "model.max_seq_len=256",
            "scheduler.max_running_requests=4", "cache.num_pages=64", "job.progress=false",
            "job.chat_template=false", "sampling.ignore_eos=true", "sampling.max_new_tokens=4", f"job.input={rows}"]


def write_sweep(path: Path, model_dir: Path, rows: Path, **spec: Any) -> Path:
    """The base overrides, less those of swept keys (a sweep refuses an override its axes would replace)."""
    swept = {*spec.get("grid", {}), *spec.get("zip", {})}
    overrides = [o for o in base_overrides(model_dir, rows) if o.split("=", 1)[0] not in swept]
    spec = {"overrides": overrides, "out": str(path.parent / "out"), **spec}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


GRID_2X2_ZIP_2 = {
    "grid": {"sampling.temperature": [0.0, 0.8], "cache.page_size": [8, 16]},
    "zip": {"sampling.max_new_tokens": [3, 5], "sampling.top_k": [-1, 20]},
    "metrics": ["latency_s.p50", "input_tokens"],
}


def ids(path: Path) -> list[int]:
    return sorted(json.loads(line)["id"] for line in path.read_text().splitlines())


def results(out: Path) -> list[dict[str, str]]:
    with open(out / "results.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_grid_and_zip_give_eight_runs_results_and_a_rerun_skips_them(model_dir, rows, tmp_path):
    file = write_sweep(tmp_path / "sweep.yaml", model_dir, rows, **GRID_2X2_ZIP_2)
    out = tmp_path / "out"
    assert sweep.main(["--sweep-file", str(file)]) == 0
    stats = sweep.last_stats
    assert (stats.done, stats.skipped, stats.failed) == (8, 0, 0)
    assert (stats.loads, stats.reused) == (2, 6)  # one load per cache.page_size; sampling varies within
    folders = sorted(p for p in out.iterdir() if p.is_dir())
    assert len(folders) == 8
    for folder in folders:
        assert ids(folder / "output.jsonl") == list(range(ROWS))
        assert json.loads((folder / "run.json").read_text())["status"] == "done"
        assert (folder / "metrics.json").is_file() and (folder / "output.config.yaml").is_file()
    table = results(out)
    assert len(table) == 8
    swept = ["sampling.temperature", "cache.page_size", "sampling.max_new_tokens", "sampling.top_k"]
    assert list(table[0])[2:6] == swept
    assert {(r["sampling.temperature"], r["cache.page_size"], r["sampling.max_new_tokens"]) for r in table} == {
        (t, p, n) for t in ("0.0", "0.8") for p in ("8", "16") for n in ("3", "5")}
    for r in table:
        assert r["status"] == "done" and r["rows"] == str(ROWS) and r["errors"] == "0"
        assert int(r["output_tokens"]) == ROWS * int(r["sampling.max_new_tokens"])  # ignore_eos: every token
        assert float(r["tokens_per_s"]) > 0 and float(r["latency_s.p50"]) > 0 and int(r["input_tokens"]) > 0
    assert sum(1 for r in table if float(r["load_s"]) > 0) == 2
    assert (out / "results.md").read_text().count("\n") == 10  # header, rule, 8 rows
    assert (out / "results.png").is_file() == HAVE_MATPLOTLIB  # without matplotlib: a warning, no plot


def test_results_count_an_openai_batch_outputs_served_lines_and_their_tokens(model_dir, rows, tmp_path):
    batch = tmp_path / "batch.jsonl"
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": f"Row {i}:", "max_tokens": 3}}) for i in range(4)]
    batch.write_text("\n".join([*lines, '{"custom_id": "bad", "method": ']) + "\n")  # one line is not JSON
    file = write_sweep(tmp_path / "sweep.yaml", model_dir, rows, grid={"sampling.temperature": [0.0, 0.7]})
    assert sweep.main(["--sweep-file", str(file), f"job.input={batch}"]) == 0
    table = results(tmp_path / "out")
    assert [(r["status"], r["rows"], r["errors"], r["output_tokens"]) for r in table] == [("done", "4", "1", "12")] * 2


def test_the_plot_draws_one_line_per_value_of_the_other_keys(tmp_path):
    pytest.importorskip("matplotlib")
    spec = Sweep(source="test", base=[], overrides=[], grid={"a.x": ["1", "2"], "b.y": ["p", "q"]}, zip={},
                 out=tmp_path, plot=PlotSpec(x="a.x", y="tokens_per_s"))
    rows = [{"a.x": x, "b.y": y, "tokens_per_s": x * (2 if y == "q" else 1)} for x in (1, 2) for y in "pq"]
    rows.append({"a.x": 3, "b.y": "p", "tokens_per_s": None})  # a failed run: no point
    path = write_plot(spec, rows, tmp_path / "results.png")
    assert path is not None and path.read_bytes().startswith(b"\x89PNG")


def test_a_rerun_checks_only_the_runs_left_to_run(model_dir, rows, tmp_path):
    """A finished run's model may be gone since: the rerun skips that run and is not refused for it."""
    moved = tmp_path / "model"
    shutil.copytree(model_dir, moved)
    file = write_sweep(tmp_path / "sweep.yaml", moved, rows, grid={"sampling.temperature": [0.0]})
    assert sweep.main(["--sweep-file", str(file)]) == 0
    shutil.rmtree(moved)
    assert sweep.main(["--sweep-file", str(file)]) == 0 and sweep.last_stats.skipped == 1


def test_collected_metrics_keep_their_digits_and_a_misspelt_one_is_named(rows, tmp_path, caplog):
    file = write_sweep(tmp_path / "sweep.yaml", tmp_path / "model", rows, grid={"sampling.temperature": [0.0, 0.5]},
                       metrics=["latency_s.p50", "latncy_s.p50"])
    runs = plan_runs(load_sweep_file(file))
    for run in runs:
        run.paths.metrics.parent.mkdir(parents=True)
        run.paths.metrics.write_text(json.dumps({"latency_s": {"p50": 0.123456789, "p90": 0.5}}))
    with caplog.at_level("WARNING"):
        assert sweep.main(["--sweep-file", str(file), "--collect"]) == 0
    assert [r["latency_s.p50"] for r in results(tmp_path / "out")] == ["0.123456789"] * 2  # as measured
    assert "| 0.123 |" in (tmp_path / "out" / "results.md").read_text()  # the table for reading rounds
    warned = [r.getMessage() for r in caplog.records if "latncy_s.p50" in r.getMessage()]
    assert warned == ["metric 'latncy_s.p50' is in no run's metrics.json, so its column is empty; did you mean "
                      "'latency_s.p50'?"]


def test_a_rerun_skips_every_finished_run(model_dir, rows, tmp_path):
    file = write_sweep(tmp_path / "sweep.yaml", model_dir, rows, grid={"sampling.temperature": [0.0, 0.5]})
    assert sweep.main(["--sweep-file", str(file)]) == 0
    before = (tmp_path / "out" / "temperature=0.5" / "output.jsonl").read_text()
    assert sweep.main(["--sweep-file", str(file)]) == 0
    stats = sweep.last_stats
    assert (stats.skipped, stats.done, stats.loads) == (2, 0, 0)  # counted, not timed
    assert (tmp_path / "out" / "temperature=0.5" / "output.jsonl").read_text() == before


class Killed(BaseException):
    """Stands in for SIGKILL: nothing above the job catches it, so no record says how the run ended."""


def test_a_sweep_killed_inside_run_3_resumes_it_and_runs_the_rest(model_dir, rows, tmp_path, monkeypatch):
    file = write_sweep(tmp_path / "sweep.yaml", model_dir, rows, **GRID_2X2_ZIP_2)
    run3 = plan_runs(load_sweep_file(file))[2]
    victim = str(run3.dir / "output.jsonl")

    class DiesInRun3(JsonlAppender):
        def write(self, row: dict[str, Any]) -> None:
            super().write(row)
            self.rows = getattr(self, "rows", 0) + 1
            if self.file.name == victim and self.rows == 2:
                self.file.flush()
                raise Killed

    monkeypatch.setattr(job_module, "JsonlAppender", DiesInRun3)
    with pytest.raises(Killed):
        sweep.main(["--sweep-file", str(file)])
    monkeypatch.undo()
    with open(victim, "a") as f:
        f.write('{"id": 5, "te')  # a line torn by the kill
    records = {r.index: r.record() for r in plan_runs(load_sweep_file(file))}
    assert [records[i]["status"] for i in (1, 2, 3)] == ["done", "done", "running"]
    assert all(records[i] is None for i in range(4, 9))

    assert sweep.main(["--sweep-file", str(file)]) == 0
    stats = sweep.last_stats
    assert (stats.skipped, stats.done) == (2, 6)
    assert ids(run3.dir / "output.jsonl") == list(range(ROWS))  # one row per id
    record = run3.record()
    assert record["status"] == "done" and record["attempts"][-1]["already_done"] == 2
    assert len(results(tmp_path / "out")) == 8


@pytest.mark.parametrize("signal_at_merge", [2, 4])
def test_a_signal_after_a_runs_last_row_leaves_it_done(model_dir, rows, tmp_path, monkeypatch, signal_at_merge):
    """SIGTERM while a finished run's output is merged (each run merges twice: recovering, then at its end):
    that run is done. After run 1 the sweep stops before run 2 (143) and a rerun serves run 2 alone; after the
    last run nothing is left, so the sweep exits 0 and no requeue follows."""
    file = write_sweep(tmp_path / "sweep.yaml", model_dir, rows, grid={"sampling.temperature": [0.0, 0.5]})
    merge, merges = job_module.merge_output, []

    def merge_during_a_signal(*args: Any) -> None:
        merges.append(args)
        if len(merges) == signal_at_merge:
            os.kill(os.getpid(), signal.SIGTERM)  # the sweep's drain handler takes it
        merge(*args)

    monkeypatch.setattr(job_module, "merge_output", merge_during_a_signal)
    code = sweep.main(["--sweep-file", str(file)])
    statuses = [(r.record() or {}).get("status") for r in plan_runs(load_sweep_file(file))]
    if signal_at_merge == 4:
        assert code == 0 and statuses == ["done", "done"]
        return
    assert code == 143 and statuses == ["done", None]
    monkeypatch.undo()
    assert sweep.main(["--sweep-file", str(file)]) == 0
    assert (sweep.last_stats.skipped, sweep.last_stats.done) == (1, 1)
    assert all(ids(r.paths.output) == list(range(ROWS)) for r in plan_runs(load_sweep_file(file)))


def test_runs_that_differ_only_in_sampling_load_the_model_once_with_the_same_rows(model_dir, rows, tmp_path):
    grid = {"sampling.temperature": [0.9, 0.0], "sampling.top_p": [1.0, 0.8]}
    reused = write_sweep(tmp_path / "a" / "sweep.yaml", model_dir, rows, grid=grid)
    fresh = write_sweep(tmp_path / "b" / "sweep.yaml", model_dir, rows, grid=grid, reuse_engine=False)
    assert sweep.main(["--sweep-file", str(reused)]) == 0
    assert (sweep.last_stats.loads, sweep.last_stats.reused) == (1, 3)
    assert sweep.main(["--sweep-file", str(fresh)]) == 0
    assert (sweep.last_stats.loads, sweep.last_stats.reused) == (4, 0)
    for folder in (tmp_path / "a" / "out").iterdir():
        if folder.is_dir():  # a reused engine (its prefix cache emptied) writes what a fresh one writes
            twin = tmp_path / "b" / "out" / folder.name
            assert (folder / "output.jsonl").read_text().splitlines() == (twin / "output.jsonl").read_text().splitlines()


def weightless_model(tmp_path: Path, model_dir: Path) -> Path:
    """Its config passes the checks at start; it has no weights to load, so its run fails."""
    missing = tmp_path / "no_such_model"
    missing.mkdir()
    shutil.copy(model_dir / "config.json", missing / "config.json")
    return missing


def test_a_failed_run_is_recorded_and_the_sweep_goes_on(model_dir, rows, tmp_path, capsys):
    missing = weightless_model(tmp_path, model_dir)
    file = write_sweep(tmp_path / "sweep.yaml", model_dir, rows, name="{model.path.name}",
                       grid={"model.path": [str(missing), str(model_dir)]})
    assert sweep.main(["--sweep-file", str(file)]) == 1
    assert (sweep.last_stats.failed, sweep.last_stats.done) == (1, 1)
    table = {r["name"]: r for r in results(tmp_path / "out")}
    assert table["no_such_model"]["status"] == "failed" and "no_such_model" in table["no_such_model"]["error"]
    assert table[model_dir.name]["status"] == "done" and table[model_dir.name]["rows"] == str(ROWS)
    assert "failed" in capsys.readouterr().err
    (tmp_path / "out" / "results.csv").unlink()
    assert sweep.main(["--sweep-file", str(file), "--collect"]) == 0  # the same table, from the folders only
    assert {r["name"]: r["status"] for r in results(tmp_path / "out")} == {"no_such_model": "failed",
                                                                            model_dir.name: "done"}


def test_a_rerun_runs_the_runs_not_tried_before_those_that_failed(model_dir, rows, tmp_path, capsys, monkeypatch):
    file = write_sweep(tmp_path / "sweep.yaml", model_dir, rows, name="{model.path.name}",
                       grid={"model.path": [str(weightless_model(tmp_path, model_dir)), str(model_dir)]})
    assert sweep.main(["--sweep-file", str(file), "--only-run", "1"]) == 1
    capsys.readouterr()
    monkeypatch.setattr(sys, "stderr", sys.stdout)  # one stream: the order the runs ran in
    assert sweep.main(["--sweep-file", str(file)]) == 1
    ran = [line.split(":")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("run ")]
    assert ran == [f"run 2/2 {model_dir.name}", "run 1/2 no_such_model"]
    assert [r["status"] for r in results(tmp_path / "out")] == ["failed", "done"]  # the table in run order


def test_a_list_axis_runs_and_a_run_that_serves_no_row_fails(model_dir, rows, tmp_path):
    """A swept list (stop strings) is recorded as a list; a run whose every row is refused (here too long for
    its context) is failed, as the same job exits 1, and a rerun serves it again."""
    file = write_sweep(tmp_path / "sweep.yaml", model_dir, rows,
                       grid={"model.max_seq_len": [256, 8], "sampling.stop": [[], ["the"]]})
    assert sweep.main(["--sweep-file", str(file)]) == 1
    table = {(r["model.max_seq_len"], r["sampling.stop"]): r for r in results(tmp_path / "out")}
    assert {key: r["status"] for key, r in table.items()} == {
        ("256", "[]"): "done", ("256", '["the"]'): "done", ("8", "[]"): "failed", ("8", '["the"]'): "failed"}
    refused = table[("8", "[]")]
    assert refused["error"].startswith("no row could be served") and refused["errors"] == str(ROWS)
    assert (sweep.last_stats.done, sweep.last_stats.failed) == (2, 2)
    assert sweep.main(["--sweep-file", str(file)]) == 1 and sweep.last_stats.skipped == 2  # the failed ones again


@pytest.mark.parametrize(("spec", "message"), [
    ({"grid": {"sampling.temprature": [0.0, 1.0]}}, "unknown config key 'sampling.temprature'; did you mean "
                                                    "'sampling.temperature'?"),
    ({"grid": {"sampling.temperature": [0.0, -1.0]}}, "run sampling.temperature=-1.0: config section 'sampling': "
                                                      "sampling parameter temperature=-1.0 must be"),
    ({"grid": {"cache.page_size": [16, "big"]}}, "invalid value for config key 'cache.page_size'"),
    ({"grid": {}}, "the sweep has no runs: 'grid' and 'zip' are both empty"),
    ({"grid": {"sampling.temperature": []}}, "'grid': 'sampling.temperature' has no values"),
    ({"grid": {"sampling.temperature": [0.0]}, "zip": {"sampling.top_k": [1, 2], "sampling.top_p": [1.0]}},
     "'zip' lists advance together and must have one length"),
    ({"grid": {"sampling.temperature": [0.0, 0.5]}, "name": "same"}, "runs 1 and 2 would share the folder 'same'"),
    ({"grid": {"sampling.temperature": [0.0]}, "name": "{model.paht}"}, "'model.paht' is not a config key"),
    ({"grid": {"job.output": ["a.jsonl"]}}, "['job.output'] cannot be swept"),
    ({"grid": {"sampling.temperature": [0.0]}, "plot": {"y": "nope"}}, "plot y 'nope' is not a results column"),
    ({"grd": {"sampling.temperature": [0.0]}}, "unknown sweep key 'grd'; did you mean 'grid'?"),
    ({"grid": {"sampling.temperature": [0.0]}, "metrics": ["latency_s.p50", "output_tokens"]},
     "'metrics' ['output_tokens']: already a results column"),
    ({"grid": {"sampling.temperature": [0.0]}, "metrics": ["sampling.temperature"]},
     "'metrics' ['sampling.temperature']: already a results column"),
], ids=["bad-key", "bad-value", "bad-type", "empty-grid", "empty-axis", "zip-lengths", "same-names", "bad-name",
        "per-run-key", "bad-plot", "bad-sweep-key", "metric-of-a-column", "metric-of-a-swept-key"])
def test_a_bad_sweep_fails_before_any_run_starts(model_dir, rows, tmp_path, capsys, spec, message):
    file = write_sweep(tmp_path / "sweep.yaml", model_dir, rows, **spec)
    sweep.last_stats = None
    assert sweep.main(["--sweep-file", str(file)]) == 2
    assert message in capsys.readouterr().err
    assert sweep.last_stats is None and not (tmp_path / "out").exists()  # nothing started, nothing written


@pytest.mark.parametrize(("where", "override", "swept"), [
    ("command line", "sampling.temperature=0.3", "'sampling.temperature' is already swept ('grid')"),
    ("file", "sampling.top_k=5", "'sampling.top_k' is already swept ('zip')"),
    ("file", "sampling={temperature: 0.3}", "'sampling.temperature' is already swept ('grid')"),
])
def test_an_override_of_a_swept_key_is_refused_naming_it(model_dir, rows, tmp_path, capsys, where, override, swept):
    """The axis would replace the override in every run: refused, not dropped in silence."""
    in_file = [override] if where == "file" else []
    file = write_sweep(tmp_path / "sweep.yaml", model_dir, rows, grid={"sampling.temperature": [0.0, 0.5]},
                       zip={"sampling.top_k": [1, 2]}, overrides=[*base_overrides(model_dir, rows), *in_file])
    on_line = [override] if where == "command line" else []
    assert sweep.main(["--sweep-file", str(file), *on_line]) == 2
    assert f"{file}: override '{override}': {swept}; drop the override or the axis" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_shorthand_refuses_an_override_of_its_own_axis(capsys):
    assert sweep.main(["--sweep", "sampling.temperature=0,0.5", "sampling.temperature=0.3"]) == 2
    assert ("--sweep: override 'sampling.temperature=0.3': 'sampling.temperature' is already swept ('grid')"
            in capsys.readouterr().err)


def test_a_bad_key_on_the_command_line_names_it(capsys):
    assert sweep.main(["--sweep", "sampling.temperature=0,0.5", "cache.pagesize=8"]) == 2
    assert "unknown config key 'cache.pagesize'; did you mean 'cache.page_size'?" in capsys.readouterr().err


def test_the_shorthand_makes_a_grid_of_comma_lists(model_dir, rows, tmp_path):
    out = tmp_path / "short"
    argv = ["--sweep", f"--out={out}", "sampling.temperature=0,0.5", "cache.page_size=8,16",
            *base_overrides(model_dir, rows)]
    spec = shorthand_sweep([], argv[2:], str(out))
    assert spec.grid == {"sampling.temperature": ["0", "0.5"], "cache.page_size": ["8", "16"]}
    names = [r.name for r in plan_runs(spec)]
    assert names == ["temperature=0.0,page_size=8", "temperature=0.5,page_size=8",
                     "temperature=0.0,page_size=16", "temperature=0.5,page_size=16"]  # grouped by engine
    assert shorthand_sweep([], ["a=1,2"]).out == shorthand_sweep([], ["a=1,2"]).out  # a rerun finds its folder
    # ... whatever the order of its overrides, and with keys a rerun may change (progress, log level) changed.
    same = shorthand_sweep([], ["a=1,2", "b=3", "c=4", "job.progress=false"]).out
    assert same == shorthand_sweep([], ["c=4", "a=1,2", "logging.level=DEBUG", "b=3"]).out
    assert same != shorthand_sweep([], ["a=1,2", "b=3", "c=5"]).out
    # Axes name the run folders in their order: in another order they are another sweep, in its own folder.
    assert shorthand_sweep([], ["a=1,2", "b=3,4"]).out != shorthand_sweep([], ["b=3,4", "a=1,2"]).out
    # Options after the overrides are read as options, as launch.py reads them.
    assert sweep.main(["--sweep", f"--out={out}", "sampling.temperature=0,0.5", *base_overrides(model_dir, rows),
                       "--list"]) == 0


def test_a_sweep_files_values_reach_text_keys_as_written(model_dir, rows, tmp_path):
    """YAML 1.1 reads no, Off and 012 as false, false and 10: a stop string must stay the text the file holds, as it
    does in a config file or an override, while numbers and booleans still read as numbers and booleans."""
    file = tmp_path / "sweep.yaml"
    overrides = [o for o in base_overrides(model_dir, rows) if not o.startswith("sampling.ignore_eos=")]
    file.write_text(yaml.safe_dump({"overrides": overrides, "out": str(tmp_path / "out")})
                    + "grid:\n  sampling.stop: [[no], [012, Off]]\n  sampling.temperature: [0, 0.5]\n"
                    + "zip:\n  sampling.ignore_eos: [yes, no]\n")
    runs = plan_runs(load_sweep_file(file))
    seen = {(tuple(r.cfg.sampling.stop), r.cfg.sampling.temperature, r.cfg.sampling.ignore_eos) for r in runs}
    assert seen == {(stop, t, eos) for stop in (("no",), ("012", "Off")) for t in (0.0, 0.5) for eos in (True, False)}
    assert len({r.name for r in runs}) == len(runs) == 8


def test_a_swept_logit_bias_replaces_the_base_configs(model_dir, rows, tmp_path):
    """Each run's bias is its axis value whole (``{}``: none), not merged into the bias the base config sets;
    token ids as quoted keys, as JSON writes them, read as ints."""
    base = tmp_path / "base.yaml"
    base.write_text("sampling:\n  logit_bias: {50256: -100}\n")
    file = tmp_path / "sweep.yaml"
    file.write_text(yaml.safe_dump({"base": [str(base)], "overrides": base_overrides(model_dir, rows),
                                    "out": str(tmp_path / "out")})
                    + "grid:\n  sampling.logit_bias: [{}, {'13': 5}, {50256: -100, 7: 1}]\n")
    runs = plan_runs(load_sweep_file(file))
    assert [r.cfg.sampling.logit_bias for r in runs] == [{}, {13: 5.0}, {50256: -100.0, 7: 1.0}]
    assert len({r.name for r in runs}) == 3


def test_axes_merged_in_by_a_yaml_merge_key_keep_their_values(model_dir, rows, tmp_path):
    """A merge key (``<<: *anchor``, ``<<: {...}``) is merged by YAML's reading, not by the as-written one: each
    axis must still get its own values, not those of the key beside it."""
    file = tmp_path / "sweep.yaml"
    file.write_text(yaml.safe_dump({"overrides": base_overrides(model_dir, rows), "out": str(tmp_path / "out")})
                    + "grid:\n  <<: {sampling.temperature: [0, 0.5]}\n  sampling.stop: [[no], [012]]\n")
    runs = plan_runs(load_sweep_file(file))
    seen = {(r.cfg.sampling.temperature, tuple(r.cfg.sampling.stop)) for r in runs}
    assert seen == {(t, stop) for t in (0.0, 0.5) for stop in (("no",), ("012",))}


def test_a_config_given_with_a_sweep_file_adds_to_its_default_base(model_dir, rows, tmp_path):
    file = write_sweep(tmp_path / "sweep.yaml", model_dir, rows, grid={"sampling.top_p": [1.0, 0.9]})
    extra = tmp_path / "extra.yaml"
    extra.write_text("sampling:\n  top_k: 7\n")
    plain = plan_runs(load_sweep_file(file))
    added = plan_runs(load_sweep_file(file, [str(extra)]))
    default_temperature = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())["sampling"]["temperature"]
    assert default_temperature != RuntimeConfig().sampling.temperature  # else this test could not tell them apart
    assert {r.cfg.sampling.temperature for r in plain + added} == {default_temperature}
    assert [r.cfg.sampling.top_k for r in added] == [7, 7] and plain[0].cfg.sampling.top_k != 7


def test_a_bad_input_fails_a_sweep_before_any_model_loads(model_dir, rows, tmp_path, capsys):
    table = tmp_path / "rows.csv"
    table.write_text("id,question\n1,why?\n")
    file = write_sweep(tmp_path / "sweep.yaml", model_dir, rows, grid={"sampling.temperature": [0.0, 0.5]},
                       overrides=[*base_overrides(model_dir, rows), f"job.input={table}"])
    sweep.last_stats = None
    assert sweep.main(["--sweep-file", str(file)]) == 2
    err = capsys.readouterr().err
    assert "run 1 (sampling.temperature=0.0): " in err and "prompt" in err, err
    assert sweep.last_stats is None and not (tmp_path / "out").exists()
    assert sweep.main(["--sweep-file", str(file), "--slurm", "--nproc-per-node", "1"]) == 2  # not "runs are valid"
    assert "prompt" in capsys.readouterr().err


def test_the_markdown_table_shows_swept_values_exactly_and_rounds_measurements(tmp_path):
    from runtime.frontend.sweep_results import to_markdown

    rows_ = [{"run": 1, "sampling.top_p": 0.9995, "tokens_per_s": 1234.56789}]
    table = to_markdown(rows_, ["run", "sampling.top_p", "tokens_per_s"], exact={"run", "sampling.top_p"})
    assert "| 1 | 0.9995 | 1234.568 |" in table


@pytest.mark.parametrize(("line", "gpus"), [("--gpus-per-node=8", 8), ("--gpus-per-node=h100:4", 4),
                                           ("--gpus-per-node 2", 2), ("--gres=gpu:a100:3", 3), ("--gres=gpu:6", 6),
                                           ("--gpus=1  # one is enough", 1), ("--nodes=1", None)])
def test_the_templates_gpu_count_is_read_in_each_form_slurm_takes(tmp_path, monkeypatch, line, gpus):
    (tmp_path / sweep.SBATCH_TEMPLATE).parent.mkdir(parents=True)
    (tmp_path / sweep.SBATCH_TEMPLATE).write_text(f"#!/bin/bash\n#SBATCH {line}\n#SBATCH --time=1:00:00\n")
    monkeypatch.setattr(sweep, "REPO", tmp_path)
    if gpus is None:
        with pytest.raises(ConfigError, match="asks for no GPU count this can read.*--nproc-per-node N"):
            sweep.template_gpus()
    else:
        assert sweep.template_gpus() == gpus


def test_split_top_level_keeps_lists_and_quotes_whole():
    assert split_top_level("0,0.7") == ["0", "0.7"]
    assert split_top_level('[1,2],"x,y",{a: 1, b: 2}') == ["[1,2]", '"x,y"', "{a: 1, b: 2}"]
    assert split_top_level("/models/a") == ["/models/a"]
    # An apostrophe inside a word is a letter, not the start of a quoted value.
    assert split_top_level("[don't],[can't]") == ["[don't]", "[can't]"]
    assert split_top_level("it's,'a,b', {k: 'c,d'}") == ["it's", "'a,b'", " {k: 'c,d'}"]
    assert split_top_level("'it''s,x',y") == ["'it''s,x'", "y"]  # YAML's '' is a quote inside single quotes
    assert split_top_level("'',x") == ["''", "x"]


def test_the_name_template_reads_config_keys_and_path_parts(model_dir, rows, tmp_path):
    file = write_sweep(tmp_path / "sweep.yaml", model_dir, rows, name="{model.path.name}-t{sampling.temperature}",
                       grid={"sampling.temperature": [0.0, 0.7], "model.path": [str(model_dir)]})
    assert [r.name for r in plan_runs(load_sweep_file(file))] == [f"{model_dir.name}-t0.0", f"{model_dir.name}-t0.7"]


def test_a_folder_of_another_config_is_not_resumed(model_dir, rows, tmp_path, capsys):
    file = write_sweep(tmp_path / "sweep.yaml", model_dir, rows, grid={"sampling.temperature": [0.0]})
    assert sweep.main(["--sweep-file", str(file), "--only-run", "1"]) == 0
    assert sweep.main(["--sweep-file", str(file), "sampling.max_new_tokens=7"]) == 2
    err = capsys.readouterr().err
    assert "holds a run of another config (keys that differ: sampling.max_new_tokens)" in err
    # Keys that change neither rows nor measurements may change between a run and its rerun.
    assert sweep.main(["--sweep-file", str(file), "job.lock_wait_s=300", "server.port=9000", "--list"]) == 0
    assert "  1  done" in capsys.readouterr().out
    # A key a later version added is its default in a record written before it; another value is a change.
    (record,) = (tmp_path / "out").glob("*/run.json")
    saved = record.read_text()
    old = json.loads(saved)
    del old["config"]["sampling.min_p"], old["config"]["sampling.logit_bias"]
    record.write_text(json.dumps(old))
    assert sweep.main(["--sweep-file", str(file), "--list"]) == 0
    assert "  1  done" in capsys.readouterr().out
    assert sweep.main(["--sweep-file", str(file), "sampling.min_p=0.1", "--list"]) == 2
    assert "keys that differ: sampling.min_p" in capsys.readouterr().err
    record.write_text(saved)
    # Nor collected as this config's results: the table of the config that ran stays as it was.
    table = (tmp_path / "out" / "results.csv").read_text()
    assert sweep.main(["--sweep-file", str(file), "sampling.max_new_tokens=7", "--collect"]) == 2
    assert "holds a run of another config" in capsys.readouterr().err
    assert (tmp_path / "out" / "results.csv").read_text() == table
    # A results folder that cannot be written is an error naming it, not a traceback.
    assert sweep.main(["--sweep-file", str(file), "--out", str(file), "--collect"]) == 2
    assert f"error: --collect: cannot write the results in {file}" in capsys.readouterr().err


def test_list_and_one_run_as_an_array_task(model_dir, rows, tmp_path, capsys):
    file = write_sweep(tmp_path / "sweep.yaml", model_dir, rows, grid={"sampling.temperature": [0.0, 0.5]})
    assert sweep.main(["--sweep-file", str(file), "--only-run", "2"]) == 0
    assert not (tmp_path / "out" / "results.csv").exists()  # run 1 is still to do: not the last task
    assert sweep.main(["--sweep-file", str(file), "--list"]) == 0
    listed = capsys.readouterr().out
    assert "  1  pending" in listed and "  2  done" in listed and "sbatch --array=1-2 scripts/slurm/sweep.sbatch" in listed
    assert sweep.main(["--sweep-file", str(file), "--only-run", "1"]) == 0
    assert [r["status"] for r in results(tmp_path / "out")] == ["done", "done"]  # the last task wrote it
    assert sweep.main(["--sweep-file", str(file), "--only-run", "3"]) == 2


def test_out_and_name_on_the_command_line_replace_the_files(model_dir, rows, tmp_path, capsys):
    file = write_sweep(tmp_path / "sweep.yaml", model_dir, rows, grid={"sampling.temperature": [0.0, 0.5]},
                       name="t{sampling.temperature}")
    other = tmp_path / "other"
    assert sweep.main(["--sweep-file", str(file), "--list", f"--out={other}", "--name=x{sampling.temperature}"]) == 0
    listed = [line.split()[-1] for line in capsys.readouterr().out.splitlines()[:2]]
    assert listed == [str(other / "x0.0"), str(other / "x0.5")]
    spec = yaml.safe_load(file.read_text())
    del spec["out"]
    file.write_text(yaml.safe_dump(spec))
    assert sweep.main(["--sweep-file", str(file), "--list"]) == 2
    assert "'out' (the sweep's folder) must be set to a path, or given as --out" in capsys.readouterr().err
    assert sweep.main(["--sweep-file", str(file), "--list", f"--out={other}"]) == 0
    assert capsys.readouterr().out.splitlines()[0].split()[-1] == str(other / "t0.0")


def test_without_job_input_the_prompts_become_rows(model_dir, tmp_path):
    overrides = [o for o in base_overrides(model_dir, Path("unused")) if not o.startswith("job.input")]
    spec = {"overrides": [*overrides, 'job.prompts=["Hello there", "Two plus two?"]'], "out": str(tmp_path / "out"),
            "grid": {"sampling.temperature": [0.0]}}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    assert sweep.main(["--sweep-file", str(tmp_path / "sweep.yaml")]) == 0
    folder = tmp_path / "out" / "temperature=0.0"
    assert [json.loads(x)["prompt"] for x in (folder / "input.jsonl").read_text().splitlines()] == [
        "Hello there", "Two plus two?"]
    assert ids(folder / "output.jsonl") == [0, 1]


@pytest.mark.parametrize("where", ["repo", "elsewhere"])
def test_the_example_sweep_is_valid(tmp_path, monkeypatch, where):
    monkeypatch.chdir(REPO if where == "repo" else tmp_path)
    file = Path("configs/sweeps/example.yaml") if where == "repo" else REPO / "configs" / "sweeps" / "example.yaml"
    runs = plan_runs(load_sweep_file(file))
    assert len(runs) == 4 and len({r.engine_key() for r in runs}) == 1
    assert {r.dir.resolve().parent for r in runs} == {REPO / "outputs" / "sweeps" / "example"}


def test_a_sweep_files_base_and_out_are_relative_to_its_folder(model_dir, rows, tmp_path, monkeypatch, capsys):
    """Its config values (overrides, axes) read as launch.py reads them: from the folder the sweep runs in."""
    folder = tmp_path / "exp"
    write_sweep(folder / "sweep.yaml", model_dir, rows, grid={"sampling.temperature": [0.0]}, base=["base.yaml"],
                out="out")
    (folder / "base.yaml").write_text("cache:\n  page_size: 8\n")
    (tmp_path / "here.yaml").write_text("cache:\n  page_size: 32\n")
    monkeypatch.chdir(tmp_path)
    [run] = plan_runs(load_sweep_file("exp/sweep.yaml", ["here.yaml"]))  # --config: the current folder's
    assert run.dir == Path("exp/out/temperature=0.0") and run.cfg.cache.page_size == 32
    [run] = plan_runs(load_sweep_file("exp/sweep.yaml"))
    assert run.cfg.cache.page_size == 8
    [run] = plan_runs(load_sweep_file("exp/sweep.yaml", out="mine"))  # --out: the current folder's
    assert run.dir == Path("mine/temperature=0.0")
    (folder / "base.yaml").unlink()
    (tmp_path / "base.yaml").write_text("cache:\n  page_size: 8\n")
    assert sweep.main(["--sweep-file", "exp/sweep.yaml", "--list"]) == 2
    assert ("exp/sweep.yaml: 'base' base.yaml: config file exp/base.yaml does not exist (a sweep file's 'base' and "
            "'out' are relative to its folder)") in capsys.readouterr().err


def test_a_run_done_from_one_folder_is_skipped_from_another(model_dir, rows, tmp_path, monkeypatch, capsys):
    """Its record names its files from where the sweep ran; the same folder reached from elsewhere is the same run."""
    write_sweep(tmp_path / "exp" / "sweep.yaml", model_dir, rows, grid={"sampling.temperature": [0.0]}, out="out")
    monkeypatch.chdir(tmp_path)
    [run] = plan_runs(load_sweep_file("exp/sweep.yaml"))
    write_record(run.dir, {"index": 1, "name": run.name, "status": "done", "config": run.identity()})
    monkeypatch.chdir(tmp_path / "exp")
    assert sweep.main(["--sweep-file", "sweep.yaml", "--list"]) == 0
    assert capsys.readouterr().out.startswith(f"  1  done         {Path('out') / run.name}\n")


def test_slurm_flag_checks_the_model_splits_over_the_templates_gpus(default_model_dir, capsys, monkeypatch):
    """SmolLM2's 9 heads do not split over the template's 8 GPUs: refused at submission, not in every task."""
    monkeypatch.chdir(REPO)
    example = ["--sweep-file", "configs/sweeps/example.yaml", "--slurm"]
    assert sweep.main(example) == 0  # parallel.tp_size=1: 8 data-parallel replicas of the model
    capsys.readouterr()
    one_group = [*example, "parallel.tp_size=0"]  # every rank of a task in one TP group
    assert sweep.main(one_group) == 2
    err = capsys.readouterr().err
    assert "num_attention_heads=9 is not divisible by tensor-parallel size 8" in err
    assert f"an array task runs {sweep.template_gpus()} ranks" in err and sweep.template_gpus() == 8
    assert sweep.main([*one_group, "--nproc-per-node", "3"]) == 0  # 9 heads over 3 ranks
    assert sweep.main([*one_group, "--nproc-per-node", "2"]) == 2
    assert "num_attention_heads=9 is not divisible by tensor-parallel size 2" in capsys.readouterr().err


def test_a_sweep_is_refused_at_start_for_a_run_longer_than_its_models_sliding_window(tmp_path):
    model = tmp_path / "mistral"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["MistralForCausalLM"], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 1024, "sliding_window": 64}))
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"id": 0, "prompt": [1, 2]}\n')
    file = write_sweep(tmp_path / "s" / "sweep.yaml", model, rows, grid={"model.max_seq_len": [64, 65]})
    runs = plan_runs(load_sweep_file(file))
    check_layout(runs[:1], 1, "sweep.yaml")  # within the window
    with pytest.raises(ConfigError, match=r"sweep.yaml: run .*sliding_window=64 .*set model.max_seq_len <= 64"):
        check_layout(runs, 1, "sweep.yaml")


def test_a_sweep_is_refused_at_start_for_a_missing_model_or_a_fixed_output_file(model_dir, rows, tmp_path, capsys):
    missing = write_sweep(tmp_path / "a" / "sweep.yaml", model_dir, rows, grid={"model.path": [str(model_dir),
                                                                                               str(tmp_path / "no")]})
    assert sweep.main(["--sweep-file", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'no'}' is not a local directory with config.json" in err, err
    fixed = write_sweep(tmp_path / "b" / "sweep.yaml", model_dir, rows, grid={"sampling.temperature": [0.0, 0.5]},
                        overrides=[*base_overrides(model_dir, rows), "job.output=mine.jsonl"])
    assert sweep.main(["--sweep-file", str(fixed)]) == 2
    assert "job.output=mine.jsonl is set, but every run writes its own output file" in capsys.readouterr().err
    assert not (tmp_path / "a" / "out").exists() and not (tmp_path / "b" / "out").exists()


def test_no_sweep_flag_is_read_by_torchrun_as_one_of_its_own():
    from torch.distributed.run import get_args_parser

    args = sweep.parse_args(["--sweep", "--config=c.yaml", "--only-run=2", "--out=o", "--name=n", "a=1,2"])
    forwarded = sweep.forwarded_args(args)
    assert forwarded == ["--config=c.yaml", "--sweep", "--only-run=2", "--out=o", "--name=n", "a=1,2"]
    theirs = [o for a in get_args_parser()._actions for o in a.option_strings]
    assert not [f for f in forwarded if f.startswith("--") and any(o.startswith(f.split("=")[0]) for o in theirs)]
    parsed = get_args_parser().parse_args(["--standalone", "launch.py", *forwarded])
    assert parsed.training_script_args == forwarded


def test_the_sweep_flags_are_recognised():
    assert sweep.requested(["--sweep", "a=1,2"]) and sweep.requested(["--sweep-file=x.yaml"])
    assert sweep.requested(["--config", "c.yaml", "--collect"])
    assert not sweep.requested(["sampling.temperature=0.5", "--config", "sweep.yaml"])
    with pytest.raises(ConfigError, match="need the sweep"):
        sweep.build_sweep(sweep.parse_args(["--collect"]))


# ---- several processes (torchrun on CPU, gloo) ---------------------------------------------------------------
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


@pytest.mark.slow
def test_two_ranks_walk_the_same_runs_across_tp_layouts(model_dir, rows, tmp_path):
    """World 2: TP 1 (two replicas sharing each job) and TP 2 (one replica) in one sweep, each run's rows as one
    process writes them."""
    grid = {"parallel.tp_size": [1, 2], "sampling.temperature": [0.0, 0.8]}
    single = write_sweep(tmp_path / "one" / "sweep.yaml", model_dir, rows, grid={"sampling.temperature": [0.0, 0.8]})
    assert sweep.main(["--sweep-file", str(single)]) == 0
    file = write_sweep(tmp_path / "two" / "sweep.yaml", model_dir, rows, grid=grid)
    proc = subprocess.run([*TORCHRUN, "--nproc-per-node", "2", "-m", "runtime.frontend.sweep", "--sweep-file",
                           str(file)], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "4 done, 0 skipped, 0 failed, 0 interrupted; 2 model loads" in proc.stdout  # printed by rank 0
    table = results(tmp_path / "two" / "out")
    assert [r["status"] for r in table] == ["done"] * 4 and {r["rows"] for r in table} == {str(ROWS)}
    for run in plan_runs(load_sweep_file(file)):
        metrics = json.loads(run.paths.metrics.read_text())
        tp = run.cfg.parallel.tp_size
        assert (metrics["tp_size"], metrics["dp_size"]) == (tp, 2 // tp)
        twin = tmp_path / "one" / "out" / f"temperature={run.cfg.sampling.temperature}" / "output.jsonl"
        texts = {json.loads(x)["id"]: json.loads(x)["text"] for x in run.paths.output.read_text().splitlines()}
        assert texts == {json.loads(x)["id"]: json.loads(x)["text"] for x in twin.read_text().splitlines()}


@pytest.mark.slow
def test_a_failed_run_stops_a_two_rank_sweep_and_a_rerun_runs_the_rest_first(model_dir, rows, tmp_path):
    """DP 2: run 1 fails on both ranks, which stop (a peer may wait in a collective) and say how to go on; the rerun
    runs run 2 before it retries run 1."""
    file = write_sweep(tmp_path / "sweep.yaml", model_dir, rows, name="{model.path.name}",
                       grid={"model.path": [str(weightless_model(tmp_path, model_dir)), str(model_dir)]})
    cmd = [*TORCHRUN, "--nproc-per-node", "2", "-m", "runtime.frontend.sweep", "--sweep-file", str(file),
           "parallel.tp_size=1"]
    failed, good = (tmp_path / "out" / name for name in ("no_such_model", model_dir.name))
    first = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert first.returncode != 0
    assert ("the sweep stops after run 1/2 no_such_model failed: its 2 ranks cannot go on past a failed run (another "
            "rank may wait for this one in a collective); rerun the same command: it runs the other runs left (1) first, "
            "the failed ones last (exit 1)") in first.stderr, first.stderr[-3000:]
    assert json.loads((failed / "run.json").read_text())["status"] == "failed" and not good.exists()
    again = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode != 0
    assert ("the sweep stops after run 1/2 no_such_model failed: its 2 ranks cannot go on past a failed run (another "
            "rank may wait for this one in a collective); every other run is done or failed before: fix what failed "
            "(run.json says), then rerun (exit 1)") in again.stderr, again.stderr[-3000:]
    assert ids(good / "output.jsonl") == list(range(ROWS)), again.stdout[-2000:] + again.stderr[-3000:]
    assert [(r["name"], r["status"]) for r in results(tmp_path / "out")] == [("no_such_model", "failed"),
                                                                           (model_dir.name, "done")]


SLOW_MERGE_SWEEP = """
import sys
import time

from runtime.frontend import job, sweep

merge = job.merge_output
slowed = []


def slow_merge(*args, **kwargs):
    if not slowed and sys._getframe(1).f_code.co_name == "run_job":  # the first run's last merge only
        slowed.append(True)
        time.sleep(25)  # past two worker timeouts
    return merge(*args, **kwargs)


job.merge_output = slow_merge
sys.exit(sweep.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_replicas_waiting_for_replica_0s_merge_keep_their_tp_workers_inside_a_short_timeout(model_dir, rows,
                                                                                           tmp_path):
    """DP 2 x TP 2, parallel.timeout_s=10: replica 0 merges the first run's output for 25 s while replica 1 waits
    to learn whether the sweep goes on. Neither that wait nor replica 1's TP worker may time out."""
    script = tmp_path / "slow_merge_sweep.py"
    script.write_text(SLOW_MERGE_SWEEP)
    file = write_sweep(tmp_path / "sweep.yaml", model_dir, rows, grid={"sampling.temperature": [0.0, 0.5]},
                       overrides=[*base_overrides(model_dir, rows), "parallel.tp_size=2", "parallel.timeout_s=10"])
    proc = subprocess.run([*TORCHRUN, "--nproc-per-node", "4", str(script), "--sweep-file", str(file)], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "2 done, 0 skipped, 0 failed, 0 interrupted; 1 model loads" in proc.stdout
    for t in ("0.0", "0.5"):
        assert ids(tmp_path / "out" / f"temperature={t}" / "output.jsonl") == list(range(ROWS))


SLOW_RESULTS_SWEEP = """
import sys
import time

from runtime.frontend import sweep

write = sweep.write_results


def slow_write(*args, **kwargs):
    time.sleep(8)  # the other rank has long left with exit code 1, and torchrun stops this one
    return write(*args, **kwargs)


sweep.write_results = slow_write
sys.exit(sweep.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_two_rank_sweep_with_a_failed_run_writes_its_whole_table_before_exiting_1(model_dir, rows, tmp_path):
    """DP 2: run 2 serves no row (failed; the sweep goes on), so every rank exits 1. Rank 1 leaves at once, and
    torchrun then stops rank 0 with SIGTERM while it writes the results: the table must still be written whole."""
    script = tmp_path / "slow_results_sweep.py"
    script.write_text(SLOW_RESULTS_SWEEP)
    file = write_sweep(tmp_path / "sweep.yaml", model_dir, rows, grid={"model.max_seq_len": [256, 8]})
    proc = subprocess.run([*TORCHRUN, "--nproc-per-node", "2", str(script), "--sweep-file", str(file),
                           "parallel.tp_size=1"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "2 runs: 1 done, 0 skipped, 1 failed, 0 interrupted" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert [(r["model.max_seq_len"], r["status"]) for r in results(tmp_path / "out")] == [("256", "done"),
                                                                                      ("8", "failed")]


@pytest.mark.slow
def test_a_drained_sweep_exits_143_and_a_rerun_completes_it(model_dir, rows, tmp_path):
    """SIGTERM to both ranks (DP 2) inside run 2: in-flight rows finish, run 2 is recorded interrupted, run 3
    never starts; the rerun resumes run 2 and runs run 3."""
    file = write_sweep(tmp_path / "sweep.yaml", model_dir, rows, grid={"sampling.temperature": [0.0, 0.5, 0.9]},
                       overrides=[*base_overrides(model_dir, rows), "sampling.max_new_tokens=120",
                                  "scheduler.max_running_requests=1", "parallel.tp_size=1"])
    cmd = [*TORCHRUN, "--nproc-per-node", "2", "-m", "runtime.frontend.sweep", "--sweep-file", str(file)]
    out2 = tmp_path / "out" / "temperature=0.5" / "output.jsonl"
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (out2.exists() and out2.read_text().strip()):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # torchrun passes it to both ranks
    stdout, stderr = proc.communicate(timeout=120)
    run2 = json.loads((out2.parent / "run.json").read_text())
    assert run2["status"] == "interrupted", stdout[-2000:] + stderr[-3000:]
    assert "rerun to complete (exit 143)" in stderr  # rank 0; both ranks exit 143 (torchrun itself says 1)
    assert len(ids(out2)) < ROWS and not (tmp_path / "out" / "temperature=0.9" / "run.json").exists()
    again = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "1 skipped" in again.stdout
    for t in ("0.0", "0.5", "0.9"):
        assert ids(tmp_path / "out" / f"temperature={t}" / "output.jsonl") == list(range(ROWS))


# ---- Slurm: the array template -------------------------------------------------------------------------------
SBATCH = REPO / "scripts" / "slurm" / "sweep.sbatch"
BASH = shutil.which("bash")
LAUNCH_RUNS_SWEEPS = "sweep.requested(" in (REPO / "launch.py").read_text()
needs_bash = pytest.mark.skipif(BASH is None, reason="needs bash")


def _stub_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """Stub srun/scancel/scontrol (tests/test_slurm.py's) in front of the real PATH."""
    from tests.test_slurm import STUBS

    stubs = tmp_path / "stubs"
    stubs.mkdir(exist_ok=True)
    for name in ("srun", "scancel", "scontrol") + (("torchrun",) if extra.pop("stub_torchrun", "") else ()):
        (stubs / name).write_text(STUBS[name])
        (stubs / name).chmod(0o755)
    path = f"{stubs}:{Path(sys.executable).parent}:/usr/bin:/bin"
    return {"PATH": path, "STUBS": str(stubs), "PYTHON": sys.executable, "SLURM_SUBMIT_DIR": str(REPO),
            "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "localhost", "SLURM_GPUS_ON_NODE": "1",
            "HOME": os.environ.get("HOME", "/root"), "OMP_NUM_THREADS": "1", **extra}


@needs_bash
def test_sweep_sbatch_syntax_and_dry_run(tmp_path):
    assert subprocess.run([BASH, "-n", str(SBATCH)], capture_output=True).returncode == 0
    env = _stub_env(tmp_path, DRY_RUN="1", SWEEP="s.yaml", SLURM_ARRAY_TASK_ID="3", SLURM_JOB_ID="7",
                    SLURM_GPUS_ON_NODE="8", OVERRIDES="cache.page_size=8 sampling.stop=[a]")
    out = subprocess.run([BASH, str(SBATCH)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == ("torchrun --nnodes=1 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=localhost:20007 "
                          "--rdzv-id=7 --max-restarts=0 launch.py --sweep-file s.yaml --only-run 3 cache.page_size=8 "
                          "'sampling.stop=[a]'\n")


@needs_bash
def test_slurm_flag_prints_the_line_list_prints_and_the_template_runs_it(model_dir, rows, tmp_path, capsys, monkeypatch):
    """--slurm validates and submits nothing; its variables are the ones the template reads (DRY_RUN=1 shows what
    array task 3 would run)."""
    monkeypatch.chdir(REPO)
    file = write_sweep(tmp_path / "sweep.yaml", model_dir, rows, grid={"sampling.temperature": [0.0, 0.5, 0.9]},
                       overrides=[*base_overrides(model_dir, rows), "parallel.tp_size=1"])
    argv = ["--sweep-file", str(file), "sampling.max_new_tokens=3", "sampling.stop=[a,b]"]
    assert sweep.main([*argv, "--slurm"]) == 0
    printed = capsys.readouterr()
    line = printed.out.strip()
    assert line == (f"SWEEP={file} OVERRIDES='sampling.max_new_tokens=3 sampling.stop=[a,b]' sbatch --array=1-3 "
                    "scripts/slurm/sweep.sbatch")
    assert "3 runs are valid; nothing submitted" in printed.err
    assert not (tmp_path / "out").exists()
    assert sweep.main([*argv, "--list"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"as a Slurm array: {line}"

    words = shlex.split(line)
    at = words.index("sbatch")
    assert words[at + 1:] == ["--array=1-3", "scripts/slurm/sweep.sbatch"]
    variables = dict(word.split("=", 1) for word in words[:at])
    env = _stub_env(tmp_path, DRY_RUN="1", SLURM_ARRAY_TASK_ID="3", SLURM_JOB_ID="7", **variables)
    dry = subprocess.run([BASH, str(REPO / words[-1])], env=env, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.endswith(f"launch.py --sweep-file {file} --only-run 3 sampling.max_new_tokens=3 "
                               "'sampling.stop=[a,b]'\n")


def test_slurm_flag_from_another_folder_names_the_repo_and_submits_from_there(model_dir, rows, tmp_path, capsys,
                                                                              monkeypatch):
    """The tasks start where sbatch runs: there relative paths read as --slurm read them."""
    write_sweep(tmp_path / "sweep.yaml", model_dir, rows, grid={"sampling.temperature": [0.0, 0.5]})
    monkeypatch.chdir(tmp_path)
    assert sweep.main(["--sweep-file", "sweep.yaml", "--nproc-per-node", "2", "--only-run", "2", "--slurm"]) == 0
    printed = capsys.readouterr()
    assert printed.out == (f"SWEEP=sweep.yaml NPROC_PER_NODE=2 TPINFER_REPO={shlex.quote(str(REPO))} sbatch --array=2 "
                           f"{shlex.quote(str(SBATCH))}\n")
    assert "To submit, from this folder:" in printed.err


SBATCH_STUB = """#!/bin/bash
# sbatch: each task of --array=A or A-B in turn, in this folder (the submit directory), as Slurm starts them
for arg in "$@"; do [[ $arg == --array=* ]] && tasks=${arg#--array=}; done
for ((task = ${tasks%-*}; task <= ${tasks#*-}; task++)); do
    SLURM_SUBMIT_DIR=$PWD SLURM_ARRAY_JOB_ID=51 SLURM_ARRAY_TASK_ID=$task SLURM_JOB_ID=5$task bash "${@: -1}" || exit
done
"""


@needs_bash
@pytest.mark.slow
@pytest.mark.skipif(not LAUNCH_RUNS_SWEEPS, reason="launch.py does not hand --sweep-file to runtime/frontend/sweep.py")
def test_the_printed_sbatch_line_runs_the_tasks_with_paths_read_as_slurm_read_them(model_dir, rows, tmp_path):
    """From a folder other than the repo: the file's base and out beside the file, an input relative to here."""
    here = tmp_path / "work"
    here.mkdir()
    shutil.copy(rows, here / "rows.jsonl")
    write_sweep(here / "exp" / "sweep.yaml", model_dir, rows, grid={"sampling.temperature": [0.0, 0.5]},
                base=["base.yaml"], out="out", overrides=[o for o in base_overrides(model_dir, rows)
                                                         if not o.startswith("job.input=")])
    (here / "exp" / "base.yaml").write_text("cache:\n  page_size: 8\n")
    argv = ["--sweep-file", "exp/sweep.yaml", "--nproc-per-node", "1", "--slurm", "job.input=rows.jsonl"]
    check = subprocess.run([sys.executable, str(REPO / "launch.py"), *argv], cwd=here, env=_env(), capture_output=True,
                           text=True, timeout=120)
    assert check.returncode == 0, check.stderr
    env = _stub_env(tmp_path)
    (Path(env["STUBS"]) / "sbatch").write_text(SBATCH_STUB)
    (Path(env["STUBS"]) / "sbatch").chmod(0o755)
    out = subprocess.run([BASH, "-c", check.stdout], cwd=here, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    table = results(here / "exp" / "out")  # the last task wrote it
    assert [(r["status"], r["rows"]) for r in table] == [("done", str(ROWS))] * 2
    for run in plan_runs(load_sweep_file(here / "exp" / "sweep.yaml", extra_overrides=[f"job.input={rows}"])):
        assert yaml.safe_load(run.paths.config.read_text())["cache"]["page_size"] == 8  # the base beside the file


@pytest.mark.parametrize(("extra", "message"), [
    (["--sweep", "sampling.top_k=1,2"], "put --sweep axes in the file's 'grid'"),
    (["--config", "configs/default.yaml"], "--config files in its 'base'"),
    (["--out", "elsewhere"], "--out and --name in its 'out' and 'name'"),
    (["sampling.stop=[a, b]"], "the template cannot pass a value with whitespace"),
    (["--nproc-per-node", "0"], "--nproc-per-node must be at least 1"),
    (["--nproc-per-node", "3", "parallel.tp_size=2"], "parallel.tp_size=2 does not divide the world size 3"),
    (["--only-run", "4"], "--only-run 4: the sweep has runs 1 to 2"),
    (["sampling.temprature=0.5"], "unknown config key 'sampling.temprature'"),
], ids=["axes", "config", "out", "whitespace", "nproc-0", "tp-layout", "only-run", "bad-key"])
def test_slurm_flag_refuses_what_the_array_tasks_would_not_run(model_dir, rows, tmp_path, capsys, monkeypatch, extra, message):
    monkeypatch.chdir(REPO)
    file = write_sweep(tmp_path / "sweep.yaml", model_dir, rows, grid={"sampling.temperature": [0.0, 0.5]},
                       overrides=[*base_overrides(model_dir, rows), "parallel.tp_size=1"])
    assert sweep.main(["--sweep-file", str(file), "--slurm", *extra]) == 2
    printed = capsys.readouterr()
    assert message in printed.err and printed.out == ""
    assert not (tmp_path / "out").exists()


def test_slurm_flag_needs_a_sweep_file(tmp_path, capsys):
    assert sweep.main(["--sweep", "--slurm", f"--out={tmp_path / 'o'}", "sampling.temperature=0,0.5"]) == 2
    assert "the array tasks read the sweep from a file: use --sweep-file FILE" in capsys.readouterr().err


@needs_bash
@pytest.mark.parametrize(("env", "message"), [
    ({"SLURM_ARRAY_TASK_ID": "1"}, "set SWEEP to the sweep file"),
    ({"SWEEP": "s.yaml"}, "not an array task"),
    ({"SWEEP": "s.yaml", "SLURM_ARRAY_TASK_ID": "1"}, "SLURM_ARRAY_JOB_ID=unset is not a job id"),
])
def test_sweep_sbatch_needs_a_sweep_and_an_array(tmp_path, env, message):
    out = subprocess.run([BASH, str(SBATCH)], env=_stub_env(tmp_path, SLURM_JOB_ID="7", **env), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr


@needs_bash
def test_sweep_sbatch_usr1_drains_then_requeues_the_task(tmp_path):
    """The task that runs under the array's own id (12): Slurm reads a bare 12 as every task of the array, so
    the drain, the state check and the requeue must name the task as 12_2."""
    env = _stub_env(tmp_path, SWEEP="s.yaml", SLURM_ARRAY_TASK_ID="2", SLURM_ARRAY_JOB_ID="12", SLURM_JOB_ID="12",
                    stub_torchrun="1")
    proc = subprocess.Popen([BASH, str(SBATCH)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stubs = Path(env["STUBS"])
    deadline = time.monotonic() + 30
    while not (stubs / "started").exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGUSR1)
    output, _ = proc.communicate(timeout=60)
    log = (stubs / "log").read_text()
    assert "launch.py --sweep-file s.yaml --only-run 2" in log
    assert log.index("scancel --signal=TERM 12_2") < log.index("drained") < log.index("scontrol show job 12_2") < \
        log.index("scontrol requeue 12_2")
    job_calls = [line for line in log.splitlines() if line.startswith(("scancel", "scontrol show job", "scontrol requeue"))]
    assert all(line.endswith(" 12_2") for line in job_calls), job_calls
    assert proc.returncode == 143 and "sweep s.yaml run 2: job 12_2 (id 12) attempt 1" in output


@needs_bash
@pytest.mark.slow
@pytest.mark.skipif(not LAUNCH_RUNS_SWEEPS, reason="launch.py does not hand --sweep-file to runtime/frontend/sweep.py")
def test_sweep_sbatch_array_tasks_run_one_run_each_and_the_last_writes_results(model_dir, rows, tmp_path):
    """The template with stub srun and the real torchrun_cmd.py, torchrun and launch.py, task by task."""
    file = write_sweep(tmp_path / "sweep.yaml", model_dir, rows, grid={"sampling.temperature": [0.0, 0.5]})
    for task in ("2", "1"):
        env = _stub_env(tmp_path, SWEEP=str(file), SLURM_ARRAY_TASK_ID=task, SLURM_ARRAY_JOB_ID="41",
                        SLURM_JOB_ID=f"4{task}", NPROC_PER_NODE="1")
        out = subprocess.run([BASH, str(SBATCH)], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        assert (tmp_path / "out" / "results.csv").exists() == (task == "1")  # the last task writes the table
    assert [r["status"] for r in results(tmp_path / "out")] == ["done", "done"]


# ---- a live Slurm (scripts/slurm/local_cluster.sh, as tests/test_slurm_live.py) -------------------------------
def _live_sweep(tmp_path: Path, model: Path, temperatures: list[float], rows_n: int, new_tokens: int) -> Path:
    """Token-id rows: the live tests' tiny model has no tokenizer."""
    rows_file = tmp_path / "rows.jsonl"
    rows_file.write_text("".join(json.dumps({"id": i, "prompt": [i + 1, 5, 7]}) + "\n" for i in range(rows_n)))
    spec = {"overrides": [f"model.path={model}", "engine.device=cpu", "model.max_seq_len=2048",
                          "scheduler.max_running_requests=2", "job.progress=false", "job.drain_timeout_s=3",
                          "sampling.ignore_eos=true", f"sampling.max_new_tokens={new_tokens}", f"job.input={rows_file}"],
            "grid": {"sampling.temperature": temperatures}, "out": str(tmp_path / "out")}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return tmp_path / "sweep.yaml"


def _submit_array(env: dict[str, str], file: Path, tasks: int) -> str:
    job_env = {**env, "SWEEP": str(file), "NPROC_PER_NODE": "1", "PYTHON": sys.executable}
    proc = subprocess.run(["sbatch", "--parsable", f"--array=1-{tasks}", "--gpus-per-node=0", "--cpus-per-task=1",
                           "--time=10", f"--output={file.parent}/slurm-%A_%a.out", str(SBATCH)],
                          cwd=REPO, env=job_env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.skipif(not LAUNCH_RUNS_SWEEPS, reason="launch.py does not hand --sweep-file to runtime/frontend/sweep.py")
def test_live_slurm_array_runs_a_4_run_sweep(request, tmp_path):
    from tests.test_slurm_live import wait_done

    env, model = request.getfixturevalue("slurm"), request.getfixturevalue("tiny_model")
    file = _live_sweep(tmp_path, model, [0.0, 0.3, 0.6, 0.9], rows_n=4, new_tokens=8)
    array = _submit_array(env, file, 4)
    for task in range(1, 5):
        info = wait_done(env, f"{array}_{task}")
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", info
    table = results(tmp_path / "out")
    assert len(table) == 4 and {r["status"] for r in table} == {"done"} and {r["rows"] for r in table} == {"4"}


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.skipif(not LAUNCH_RUNS_SWEEPS, reason="launch.py does not hand --sweep-file to runtime/frontend/sweep.py")
def test_live_slurm_a_preempted_array_task_requeues_and_completes(request, tmp_path):
    """USR1 to one task drains and requeues that task alone: the other runs on, never interrupted nor restarted.
    The warned task is the one that runs under the array's own id, which Slurm reads as the whole array."""
    from tests.test_slurm_live import job, wait_done, wait_for_requeued_run, wait_until, warn_batch

    env, model = request.getfixturevalue("slurm"), request.getfixturevalue("tiny_model")
    file = _live_sweep(tmp_path, model, [0.0, 0.5], rows_n=16, new_tokens=400)
    array = _submit_array(env, file, 2)
    tasks = {t: f"{array}_{t}" for t in (1, 2)}
    wait_until(lambda: all(job(env, name).get("JobState") == "RUNNING" for name in tasks.values()), 180,
               "both tasks to run")
    # Once no task is pending, one of them holds the array's own id.
    warned = next((t for t, name in tasks.items() if job(env, name)["JobId"] == array), None)
    assert warned is not None, [job(env, name) for name in tasks.values()]
    other = 3 - warned
    runs = plan_runs(load_sweep_file(file))
    output = runs[warned - 1].paths.output
    wait_until(lambda: output.exists() and output.read_text().strip(), 180, f"run {warned}'s first row")
    warn_batch(env, tasks[warned])  # the time-limit warning to this task only
    wait_for_requeued_run(env, tasks[warned], 1)
    assert wait_done(env, tasks[warned])["JobState"] == "COMPLETED"
    info = wait_done(env, tasks[other])
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", info
    assert ids(output) == list(range(16))  # one row per id across the two attempts
    assert [r["status"] for r in results(tmp_path / "out")] == ["done", "done"]
    record = runs[other - 1].record()
    assert record is not None and [a["interrupted"] for a in record["attempts"]] == [False]  # never drained
    log = (tmp_path / f"slurm-{tasks[warned]}.out").read_text()
    assert "attempt 1" in log and "attempt 2" in log and f"requeueing job {tasks[warned]}" in log
    log = (tmp_path / f"slurm-{tasks[other]}.out").read_text()
    assert "attempt 2" not in log and "got SIG" not in log
