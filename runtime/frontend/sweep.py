"""Experiment sweeps: one base config, some keys varied, one run per combination, one results table.

    python launch.py --sweep-file configs/sweeps/example.yaml      # every run, then results.csv / .md / .png
    python launch.py --sweep sampling.temperature=0,0.7 job.input=rows.jsonl   # key=a,b: a grid axis

A run whose ``run.json`` says done is skipped; any other is (re)run through the job's own resume. Under
torchrun every rank walks the same runs; global rank 0 decides which are left and writes the records.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.config import ConfigError, RuntimeConfig, to_yaml
from runtime.frontend.job_files import write_atomic
from runtime.frontend.signals import EXIT_PREEMPTED, exit_now
from runtime.frontend.sweep_plan import (
    DONE,
    FAILED,
    INTERRUPTED,
    PENDING,
    RUNNING,
    LayoutError,
    Run,
    Sweep,
    check_layout,
    check_resumable,
    load_sweep_file,
    plan_runs,
    shorthand_sweep,
    write_record,
)
from runtime.frontend.sweep_results import write_results

if TYPE_CHECKING:
    from runtime.frontend.llm import LLM
    from runtime.frontend.signals import Drain

SWEEP_FLAGS = ("--sweep", "--sweep-file", "--collect")
REPO = Path(__file__).resolve().parents[2]
SBATCH_TEMPLATE = "scripts/slurm/sweep.sbatch"  # relative to REPO
log = logging.getLogger("tpinfer.sweep")


@dataclass
class SweepStats:

    runs: int = 0
    skipped: int = 0
    done: int = 0
    failed: int = 0
    interrupted: int = 0
    loads: int = 0
    reused: int = 0
    load_s: float = 0.0


last_stats: SweepStats | None = None


class SweepStopped(Exception):
    """A run failed on a sweep of several ranks: they stop, as a peer may wait in a collective for the failed one."""


def requested(argv: list[str]) -> bool:
    return any(a.split("=", 1)[0] in SWEEP_FLAGS for a in argv)


def parse_args(argv: list[str]) -> argparse.Namespace:
    # No flag may begin one of torchrun's options: torchrun reads them as abbreviations of its own.
    parser = argparse.ArgumentParser(prog="launch.py", allow_abbrev=False,
                                     description="tpinfer experiment sweeps (runtime/frontend/sweep.py)")
    parser.add_argument("--sweep-file", metavar="FILE", help="a sweep file (base, overrides, grid, zip, name, out)")
    parser.add_argument("--sweep", action="store_true",
                        help="overrides with comma-separated values (key=a,b) are grid axes")
    parser.add_argument("--collect", action="store_true", help="only assemble results.csv/.md/.png from the folders")
    parser.add_argument("--list", action="store_true", help="print the runs, their folders and states, and exit")
    parser.add_argument("--slurm", action="store_true",
                        help="validate the sweep, print the sbatch command that runs it as a Slurm array "
                             f"({SBATCH_TEMPLATE}), and exit without submitting")
    parser.add_argument("--only-run", type=int, metavar="N",
                        help="only run N (1-based, as --list numbers them; a Slurm array task's id)")
    parser.add_argument("--out", help="the sweep's folder (default: the sweep file's 'out'; for --sweep alone: "
                                      "outputs/sweep-<hash of the arguments>)")
    parser.add_argument("--name", help="run folder template, e.g. 't{sampling.temperature}' (default: the sweep "
                                       "file's 'name', else the swept key=value pairs)")
    parser.add_argument("--config", action="append", default=None, help="YAML config (repeatable; merged in order)")
    parser.add_argument("--nproc-per-node", type=int, default=None, metavar="N", help="run every run over N ranks")
    parser.add_argument("overrides", nargs="*", help="key=value overrides (and key=a,b axes with --sweep)")
    return parser.parse_intermixed_args(argv)  # options after the overrides too, as in launch.py


def main(argv: list[str], script: str | None = None, configure_threads: Callable[[int], None] | None = None) -> int:
    """Run, list or collect a sweep; returns the exit code (2: a bad sweep, 143: drained, 1: a run failed).

    ``configure_threads(local ranks)`` runs before torch is imported."""
    args = parse_args(argv)
    if configure_threads is not None:
        configure_threads(args.nproc_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    only_files = args.collect or args.list
    try:
        if only_files:
            world = None
        elif args.slurm:  # a task's ranks: --nproc-per-node, else one per GPU of the template
            world = args.nproc_per_node if args.nproc_per_node is not None else template_gpus()
        else:
            world = args.nproc_per_node or int(os.environ.get("WORLD_SIZE", "1"))
        sweep = build_sweep(args)
        runs = plan_runs(sweep)
        if args.only_run is not None and not 1 <= args.only_run <= len(runs):
            raise ConfigError(f"--only-run {args.only_run}: the sweep has runs 1 to {len(runs)}")
        for run in runs:  # --collect too: another config's results must not be reported as this sweep's
            check_resumable(run)
        if not only_files:
            check_inputs(runs)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.collect:
        try:
            paths = write_results(sweep, runs)
        except OSError as exc:
            print(f"error: --collect: cannot write the results in {sweep.out}: {exc}", file=sys.stderr)
            return 2
        for path in paths:
            print(path)
        return 0
    if args.list:
        print_plan(runs, args)
        return 0
    if args.slurm:
        try:
            command = slurm_command(args, len(runs))
        except ConfigError as exc:
            print(f"error: --slurm: {exc}", file=sys.stderr)
            return 2
    if world is not None and world > 0:
        # An array's every run; here only the runs this call may run (a finished run's model may be gone).
        todo = runs if args.slurm else [r for r in runs if (args.only_run is None or r.index == args.only_run)
                                         and (r.record() or {}).get("status") != DONE]
        try:
            check_layout(todo, world, sweep.source)
        except (ConfigError, RuntimeError) as exc:  # RuntimeError: the default model could not be prepared
            ranks = ""
            if isinstance(exc, LayoutError) and args.slurm and args.nproc_per_node is None:
                ranks = (f" (an array task runs {world} ranks, one per GPU of {SBATCH_TEMPLATE}'s --gpus-per-node; "
                         "--nproc-per-node N sets the count)")
            print(f"error: {exc}{ranks}", file=sys.stderr)
            return 2
    if args.slurm:
        print(f"{sweep.source}: {len(runs)} runs are valid; nothing submitted. To submit, from this folder:",
              file=sys.stderr)
        print(command)
        return 0
    if args.nproc_per_node is not None:
        return start_ranks(args, script)
    return execute(sweep, runs, args.only_run)


def check_inputs(runs: list[Run]) -> None:
    """Each run's input opens with its columns and format, and its output (when resumed) is of that input's kind:
    checked before any model loads, as a single job checks its own, so a bad input costs no load per run."""
    from runtime.frontend.job_inputs import check_output, open_input
    from runtime.sampling_params import SamplingParams

    sources: dict[str, Any] = {}  # one opening per distinct input and way of reading it
    for run in runs:
        if run.prompts_input:
            continue
        job = run.cfg.job
        reading = json.dumps([job.input, job.format, vars(job.columns), job.chat_template], default=str)
        try:
            if reading not in sources:
                sources[reading] = open_input(Path(job.input), job, SamplingParams(**vars(run.cfg.sampling)))
            source = sources[reading]
            check_output(run.paths.output, source, repair=False)
        except ValueError as exc:
            raise ConfigError(f"run {run.index} ({run.described}): {exc}") from None


def build_sweep(args: argparse.Namespace) -> Sweep:
    configs = args.config or []
    if args.sweep_file:
        plain = args.overrides if not args.sweep else []
        sweep = load_sweep_file(args.sweep_file, configs, plain, args.out, args.name)
        if args.sweep:
            extra = shorthand_sweep([], args.overrides)
            clash = set(extra.grid) & set(sweep.swept)
            if clash:
                raise ConfigError(f"--sweep: {sorted(clash)} already swept in {args.sweep_file}")
            sweep.grid.update(extra.grid)
            sweep.overrides += extra.overrides
        return sweep
    if not args.sweep:
        raise ConfigError("--collect, --list and --slurm need the sweep: --sweep-file FILE, or --sweep with the same "
                          "arguments")
    return shorthand_sweep(configs, args.overrides, args.out, args.name)


def start_ranks(args: argparse.Namespace, script: str | None) -> int:
    from parallel.launcher import rank_launch_error, run_torchrun

    error = rank_launch_error(args.nproc_per_node)
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if script is None:
        print("error: --nproc-per-node needs the launcher: python launch.py --nproc-per-node N ...", file=sys.stderr)
        return 2
    return run_torchrun(args.nproc_per_node, script, forwarded_args(args))


def forwarded_args(args: argparse.Namespace) -> list[str]:
    out = [f"--config={c}" for c in args.config or []]
    out += [f"--sweep-file={args.sweep_file}"] if args.sweep_file else []
    out += ["--sweep"] if args.sweep else []
    named = (("only-run", args.only_run), ("out", args.out), ("name", args.name))
    out += [f"--{flag}={value}" for flag, value in named if value is not None]
    return out + list(args.overrides)


def print_plan(runs: list[Run], args: argparse.Namespace) -> None:
    for run in runs:
        status = (run.record() or {}).get("status", PENDING)
        print(f"{run.index:>3}  {status:<11}  {run.dir}")
    try:
        print(f"as a Slurm array: {slurm_command(args, len(runs))}")
    except ConfigError as exc:
        print(f"not as a Slurm array: {exc}")


GPU_REQUEST = re.compile(r"^#SBATCH\s+--(?:gpus-per-node|gpus|gres)[= ](?:gpu:)?(?:[\w.-]+:)?(\d+)\s*(?:#.*)?$",
                         re.MULTILINE)


def template_gpus() -> int:
    """The GPUs a node of the template asks for (``#SBATCH --gpus-per-node=[type:]N``, ``--gres=gpu[:type]:N`` or
    ``--gpus=N``): an array task's ranks when NPROC_PER_NODE is unset."""
    template = REPO / SBATCH_TEMPLATE
    found = GPU_REQUEST.search(template.read_text())
    if found is None:
        raise ConfigError(f"{template} asks for no GPU count this can read (#SBATCH --gpus-per-node=N, "
                          "--gres=gpu:N or --gpus=N): give --nproc-per-node N, the ranks of an array task")
    return int(found.group(1))


def slurm_command(args: argparse.Namespace, runs: int) -> str:
    """The shell line that submits this sweep as a Slurm array; ConfigError where the template cannot run it."""
    if not args.sweep_file:
        raise ConfigError("the array tasks read the sweep from a file: use --sweep-file FILE")
    if args.sweep or args.config or args.out or args.name:
        raise ConfigError("the array tasks get only the sweep file and plain key=value overrides: put --sweep axes "
                          "in the file's 'grid', --config files in its 'base', --out and --name in its 'out' and "
                          "'name'")
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node must be at least 1, got {args.nproc_per_node}")
    for override in args.overrides:
        if not override or any(c.isspace() for c in override):  # the template splits OVERRIDES on whitespace
            raise ConfigError(f"override {override!r}: the template cannot pass a value with whitespace; "
                              "set it in the sweep file's 'overrides'")
    # The tasks start in the folder sbatch runs in, so run from here they read relative paths as this check did;
    # from another folder than the repo's, the line names the repo (TPINFER_REPO) and the template's full path.
    env = {"SWEEP": args.sweep_file}
    if args.overrides:
        env["OVERRIDES"] = " ".join(args.overrides)
    if args.nproc_per_node is not None:
        env["NPROC_PER_NODE"] = str(args.nproc_per_node)
    here = Path.cwd().resolve() == REPO
    if not here:
        env["TPINFER_REPO"] = str(REPO)
    array = str(args.only_run) if args.only_run is not None else f"1-{runs}"
    line = " ".join(f"{key}={shlex.quote(value)}" for key, value in env.items())
    return f"{line} sbatch --array={array} {SBATCH_TEMPLATE if here else shlex.quote(str(REPO / SBATCH_TEMPLATE))}"


def execute(sweep: Sweep, runs: list[Run], only: int | None = None) -> int:
    from parallel.distributed import read_torchrun_env, shutdown_distributed

    global last_stats
    env = read_torchrun_env()
    logging.basicConfig(level=runs[0].cfg.logging.level,
                        format=f"%(asctime)s [rank {env.rank}] %(levelname)s %(name)s: %(message)s")
    stats = last_stats = SweepStats(runs=len(runs))
    try:
        code = _Sweeper(sweep, runs, stats, env.rank, env.world_size).run(only)
    except KeyboardInterrupt:
        print(f"rank {env.rank}: interrupted (a second Ctrl-C); finished rows are on disk", file=sys.stderr, flush=True)
        exit_now(130)
    except SweepStopped:  # said and recorded; peers may be stuck in a collective
        exit_now(1)
    except (FileNotFoundError, ValueError, RuntimeError, OSError) as exc:
        print(f"error on rank {env.rank}: {exc}", file=sys.stderr, flush=True)
        if env.world_size > 1:  # peers may be stuck in a collective
            exit_now(1)
        return 1
    shutdown_distributed()
    return code


class _Sweeper:

    def __init__(self, sweep: Sweep, runs: list[Run], stats: SweepStats, rank: int, world_size: int) -> None:
        self.sweep, self.runs, self.stats = sweep, runs, stats
        self.rank, self.writer = rank, rank == 0
        self.world_size = world_size
        self.tp_size: int | None = None
        self.jobs = 0  # the same count on every rank
        self.todo: list[Run] = []  # in the order they run
        self.last_run: Run | None = None  # a signal after its last row leaves nothing to resume
        from parallel.distributed import attempt_key

        self.prefix = attempt_key("sweep")

    def run(self, only: int | None) -> int:
        from runtime.frontend.signals import Drain, restore_default_signals

        drain = Drain()
        self.join(self.runs[0].cfg)
        todo = self.todo = self.agree_on_todo(only)
        self.last_run = todo[-1] if todo else None
        stopped = False
        # The results are written under the drain handlers: a rank that leaves first with exit code 1 (a failed
        # run) makes torchrun SIGTERM the others, and that must not cut the table short.
        try:
            for g, group in enumerate(self.groups(todo)):
                tp = self.join(group[0].cfg)  # a rank may lead in one TP layout and follow in another
                stopped = self.lead(group, drain, g) if tp.rank == 0 else self.follow(group, g)
                if stopped:
                    break
            if self.writer:
                self.finish(only, stopped)
        except SweepStopped as exc:  # its run's failure was announced where it was caught
            if self.writer:
                self.finish(only, stopped=False)
            print(f"rank {self.rank}: {exc}", file=sys.stderr, flush=True)
            raise
        except BaseException as exc:  # outside a run: a follower's engine, a change of TP layout, the results table
            from runtime.frontend.replicas import announce_failure

            announce_failure(exc)
            raise
        finally:
            restore_default_signals()
        if stopped:
            return EXIT_PREEMPTED
        return 1 if self.stats.failed else 0

    def join(self, cfg: RuntimeConfig) -> Any:
        """This rank's place for ``cfg``'s TP size; new process groups only when it changes."""
        from parallel.distributed import init_distributed
        from parallel.state import get_tp
        from runtime.engine.engine import wants_cuda

        if cfg.parallel.tp_size != self.tp_size:
            init_distributed(wants_cuda(cfg.engine.device), cfg.parallel.timeout_s, tp_size=cfg.parallel.tp_size)
            self.tp_size = cfg.parallel.tp_size
        return get_tp()

    def agree_on_todo(self, only: int | None) -> list[Run]:
        """Global rank 0 decides which runs are left; every rank gets its list, so all ranks agree. Runs that failed
        before go last: a failure stops a sweep of several ranks, so the runs it kept from starting go first."""
        from parallel.state import get_store

        store = get_store()
        key = f"{self.prefix}/todo"
        if self.writer:
            chosen = [r for r in self.runs if only in (None, r.index)]
            todo, failed = [], []
            for run in chosen:
                status = (run.record() or {}).get("status")
                if status == DONE:
                    print(f"run {run.index}/{len(self.runs)} {run.name}: done before, skipped", flush=True)
                    self.stats.skipped += 1
                else:
                    prepare(run)
                    (failed if status == FAILED else todo).append(run.index)
            todo += failed
            if store is not None:
                store.set(key, json.dumps(todo))
        else:
            todo = json.loads(store.get(key))
            self.stats.skipped = len([r for r in self.runs if only in (None, r.index)]) - len(todo)
        return [self.runs[i - 1] for i in todo]

    def groups(self, todo: list[Run]) -> list[list[Run]]:
        groups: list[list[Run]] = []
        for run in todo:
            if groups and self.sweep.reuse_engine and groups[-1][-1].engine_key() == run.engine_key():
                groups[-1].append(run)
            else:
                groups.append([run])
        return groups

    def agree_to_stop(self, local: bool, run: Run) -> bool:
        """Any replica's drain stops every one, else a replica would wait in the next run's barrier."""
        from parallel.state import get_store, get_tp

        tp = get_tp()
        if tp.dp_size == 1:
            return local
        store = get_store()
        key = f"{self.prefix}/run{run.index}/stop"
        store.set(f"{key}/{tp.dp_rank}", "1" if local else "0")
        keys = [f"{key}/{r}" for r in range(tp.dp_size)]
        delay = 0.001
        while not store.check(keys):  # polled, not a get: that times out while replica 0 merges a large output
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
        return any(store.get(k) == b"1" for k in keys)

    def lead(self, group: list[Run], drain: Drain, g: int) -> bool:
        """Serve ``group``'s runs on one loaded engine; returns whether the sweep stops."""
        from parallel.state import get_store, get_tp
        from runtime.frontend.llm import LLM
        from runtime.frontend.signals import install_drain_handlers

        install_drain_handlers(drain)  # before the long model load, so a signal still drains cleanly
        llm: LLM | None = None
        stopped = False
        try:
            for run in group:
                started, began = time.perf_counter(), _now()
                self.jobs += 1
                try:
                    if llm is None:
                        llm = LLM(config=run.cfg)
                        llm.drain = drain
                        self.stats.loads += 1
                        loaded = time.perf_counter() - started
                        self.stats.load_s += loaded
                    else:
                        reuse_engine(llm, run.cfg)
                        self.stats.reused += 1
                        loaded = 0.0
                    metrics = self.serve(llm, run)
                except Exception as exc:  # noqa: BLE001 - a run's failure is recorded; KeyboardInterrupt is not one
                    self.fail(run, exc, began, time.perf_counter() - started)
                    if self.world_size > 1:
                        from runtime.frontend.replicas import announce_failure

                        announce_failure(exc)  # other replicas may be waiting for this one at a barrier
                        raise SweepStopped(self.stop_message(run)) from exc
                    if llm is not None:  # its state after a failure is unknown
                        llm.shutdown()
                        llm = None
                    continue
                more = run is not self.last_run
                with llm.workers_kept_waiting():  # replica 0 may still be merging the run's output
                    stopped = self.agree_to_stop(metrics["interrupted"] or (drain.requested and more), run)
                    self.record(run, metrics, began, loaded, time.perf_counter() - started)
                if stopped:
                    break
        finally:
            if llm is not None:
                llm.shutdown()
        if get_tp().size > 1:
            get_store().set(f"{self.prefix}/group{g}/replica{get_tp().dp_rank}", "stop" if stopped else "go")
        return stopped

    def serve(self, llm: LLM, run: Run) -> dict[str, Any]:
        from runtime.frontend import job, replicas

        if self.writer:
            record = run.record() or {}
            write_record(run.dir, {**_record_head(run), "status": RUNNING, "error": "",
                                   "attempts": record.get("attempts", [])})
            write_atomic(run.paths.config, to_yaml(run.cfg))
        # Store keys are named by job number; followers ran fewer jobs, so every rank numbers jobs the same way.
        replicas.number_next_job(self.jobs)
        return job.run_job(llm, to_yaml(run.cfg))

    def record(self, run: Run, m: dict[str, Any], began: str, load_s: float, wall_s: float) -> None:
        interrupted = m["interrupted"]  # rows left: a drain that came after the last one leaves the run done
        from runtime.frontend.job import served_nothing

        failed = served_nothing(m)  # as the job alone exits 1; failed, so a rerun serves it again
        error = f"no row could be served; why is in {run.paths.errors}" if failed else ""
        status = INTERRUPTED if interrupted else FAILED if failed else DONE
        self.stats.interrupted += interrupted
        self.stats.failed += failed
        self.stats.done += status == DONE
        if failed:
            print(f"run {run.index}/{len(self.runs)} {run.name}: failed: {error}", file=sys.stderr, flush=True)
        if not self.writer:
            return
        attempt = {"started": began, "wall_s": round(wall_s, 4), "load_s": round(load_s, 4),
                   "job_s": m["wall_s"], "output_tokens": m["output_tokens"], "completed": m["completed"],
                   "already_done": m["already_done"], "interrupted": interrupted, "engine": "loaded" if load_s else "reused"}
        before = (run.record() or {}).get("attempts", [])
        write_record(run.dir, {**_record_head(run), "status": status, "error": error, "attempts": [*before, attempt]})
        engine = f"model loaded in {load_s:.1f} s" if load_s else "model reused"
        print(f"run {run.index}/{len(self.runs)} {run.name}: {status}, {m['completed']} rows ({m['already_done']} done "
              f"before), {m['errors']} errors, {m['output_tokens']} tokens at {m['output_tokens_per_s']:.1f} tokens/s; "
              f"{engine}", flush=True)

    def fail(self, run: Run, exc: Exception, began: str, wall_s: float) -> None:
        self.stats.failed += 1
        message = f"{type(exc).__name__}: {exc}"
        print(f"run {run.index}/{len(self.runs)} {run.name}: failed: {message}", file=sys.stderr, flush=True)
        if self.writer:
            before = (run.record() or {}).get("attempts", [])
            attempt = {"started": began, "wall_s": round(wall_s, 4), "error": message}
            write_record(run.dir, {**_record_head(run), "status": FAILED, "error": message,
                                   "attempts": [*before, attempt]})

    def stop_message(self, failed: Run) -> str:
        left = self.todo[self.todo.index(failed) + 1:]
        untried = sum((r.record() or {}).get("status") != FAILED for r in left)  # failed before: last in the todo
        then = (f"rerun the same command: it runs the other runs left ({untried}) first, the failed ones last"
                if untried else "every other run is done or failed before: fix what failed (run.json says), then rerun")
        return (f"the sweep stops after run {failed.index}/{len(self.runs)} {failed.name} failed: its {self.world_size} "
                f"ranks cannot go on past a failed run (another rank may wait for this one in a collective); {then} "
                "(exit 1)")

    def follow(self, group: list[Run], g: int) -> bool:
        """Build this rank's engine and follow the group's first rank; then learn whether the sweep goes on."""
        from parallel.state import get_store, get_tp
        from runtime.frontend.signals import ignore_drain_signals
        from runtime.worker import run_worker

        ignore_drain_signals()
        run_worker(group[0].cfg)
        self.jobs += len(group)
        return get_store().get(f"{self.prefix}/group{g}/replica{get_tp().dp_rank}") == b"stop"

    def finish(self, only: int | None, stopped: bool) -> None:
        """The results: at the end of a whole sweep, or after one run only when every run has finished."""
        finished = all((r.record() or {}).get("status") in (DONE, FAILED) for r in self.runs)
        if only is None or finished:
            paths = write_results(self.sweep, self.runs)
            s = self.stats
            print(f"sweep: {s.runs} runs: {s.done} done, {s.skipped} skipped, {s.failed} failed, {s.interrupted} "
                  f"interrupted; {s.loads} model loads ({s.load_s:.1f} s), {s.reused} reused -> {paths[0]}", flush=True)
        if stopped:
            print(f"interrupted by signal: finished rows are on disk; rerun to complete (exit {EXIT_PREEMPTED})",
                  file=sys.stderr, flush=True)


def reuse_engine(llm: LLM, cfg: RuntimeConfig) -> None:
    """Serve ``cfg`` on ``llm``'s loaded engine (only sampling.* and job.* differ). The prefix cache is emptied
    so a run measures what a fresh engine would."""
    llm.cfg = cfg
    scheduler = llm.scheduler
    scheduler.cache.evict(scheduler.allocator.num_pages)


def prepare(run: Run) -> None:
    if run.prompts_input:
        rows = "".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(run.cfg.job.prompts))
        path = Path(run.cfg.job.input)
        if not path.is_file() or path.read_text() != rows:
            write_atomic(path, rows)


def _record_head(run: Run) -> dict[str, Any]:
    return {"index": run.index, "name": run.name, "swept": run.swept_values(), "config": run.identity()}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
