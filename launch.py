"""Entry point: ``python launch.py`` or ``torchrun --nproc-per-node N launch.py``, with YAML configs and overrides.

    python launch.py                                   # configs/default.yaml: built-in prompts
    python launch.py --config my.yaml cache.page_size=1
    python launch.py --nproc-per-node 3 job.input=rows.jsonl job.output=out.jsonl   # starts torchrun itself
    python launch.py --sweep-file configs/sweeps/example.yaml   # an experiment sweep (runtime/frontend/sweep.py)
    python launch.py serve server.port=8000             # the OpenAI-compatible server (runtime/frontend/server.py)
    python launch.py --nproc-per-node 2 serve model.path=/models/Llama-3.1-8B-Instruct   # ... on a TP group of 2
    torchrun --nproc-per-node 3 launch.py job.input=rows.jsonl job.output=out.jsonl
    torchrun --nproc-per-node 8 launch.py parallel.tp_size=2 model.path=/models/Llama-3.1-8B-Instruct \
        job.input=rows.jsonl job.output=out.jsonl   # DP 4 x TP 2 (the default model's 9 heads split over 1, 3 or 9)

The first rank of each TP group runs that replica's scheduler; every other rank runs the worker loop.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import resource
import signal
import sys
import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING

from parallel.launcher import record_exit_code
from runtime.config import ConfigError, RuntimeConfig, load_config, to_yaml
from runtime.frontend import sweep
from runtime.frontend.signals import exit_now

if TYPE_CHECKING:
    from runtime.frontend.llm import LLM
    from runtime.frontend.signals import Drain

CONFIG_ERROR_GRACE_S = 10.0
# Short spins, so on shared cores a worker waiting at a barrier gives its core back.
GOMP_SPINCOUNT = 1000
DEFAULT_CONFIG = Path(__file__).parent / "configs" / "default.yaml"
log = logging.getLogger("tpinfer")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="tpinfer: tensor-parallel batch jobs, and an OpenAI-compatible "
                                                 "server (launch.py serve ...), for decoder LLMs",
                                     epilog="experiment sweeps: --sweep-file FILE, or --sweep key=a,b ... "
                                            "(python launch.py --sweep --help)")
    parser.add_argument("--config", action="append", default=None,
                        help="YAML config in place of configs/default.yaml (repeatable; merged in order)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                        help="start N ranks on this node through torchrun's launcher, with our exit codes: 143 "
                             "after a drain, a failed rank's own code, no launcher traceback (parallel/launcher.py)")
    parser.add_argument("overrides", nargs="*", help="'serve' (the OpenAI-compatible server), then key=value "
                                                      "overrides, e.g. cache.page_size=1")
    args = parser.parse_intermixed_args(argv)  # options after the overrides too
    args.serve = bool(args.overrides) and args.overrides[0] == "serve"
    if args.serve:
        args.overrides = args.overrides[1:]
    if "serve" in args.overrides:
        parser.error("'serve' comes first, before the key=value overrides: python launch.py serve key=value ...")
    return args


def configure_cpu_threads(local_ranks: int, environ: MutableMapping[str, str] = os.environ) -> None:
    """Before torch is imported: give each of this node's ranks an equal share of the cores and short OpenMP
    spins; variables already set win."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // max(local_ranks, 1))))
    if "OMP_WAIT_POLICY" not in environ:
        environ.setdefault("GOMP_SPINCOUNT", str(GOMP_SPINCOUNT))


def run_leader(cfg: RuntimeConfig, serve_http: bool = False, output_locked: bool = False) -> int:
    """``output_locked``: main() holds job.output's lock for this run."""
    from runtime.frontend.llm import LLM
    from runtime.frontend.signals import Drain, install_drain_handlers, restore_default_signals

    drain = Drain()
    install_drain_handlers(drain)  # before the long model load, so a signal still drains cleanly
    try:
        llm = LLM(config=cfg)
        llm.drain = drain
        try:
            if serve_http:
                import asyncio

                from runtime.frontend.server import run_server

                return asyncio.run(run_server(llm, cfg.server))
            return serve_as_own_error(cfg, llm, drain, output_locked)
        except BaseException:
            with contextlib.suppress(Exception):  # a dead peer must not mask the first error
                llm.shutdown()
            raise
        finally:
            llm.shutdown()
    finally:
        restore_default_signals()


def serve_as_own_error(cfg: RuntimeConfig, llm: LLM, drain: Drain, output_locked: bool = False) -> int:
    """``serve``; a ValueError while serving is this rank's own, not a shared config error, so it is re-raised
    as a RuntimeError."""
    try:
        return serve(cfg, llm, drain, output_locked)
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise RuntimeError(f"{type(exc).__name__}: {exc}") from exc


def serve(cfg: RuntimeConfig, llm: LLM, drain: Drain, output_locked: bool = False) -> int:
    """The job (JSONL in, JSONL out) or the configured prompts; returns the exit code."""
    from parallel.state import get_tp
    from runtime.frontend.signals import EXIT_PREEMPTED

    if cfg.job.input:
        from runtime.frontend.job import run_job, served_nothing
        from runtime.frontend.job_files import JobPaths

        m = run_job(llm, to_yaml(cfg), output_locked)
        if get_tp().dp_rank == 0:
            replicas = f" over {m['dp_size']} replicas" if m["dp_size"] > 1 else ""
            print(f"{m['completed']} rows done, {m['errors']} errors, {m['already_done']} done before -> "
                  f"{cfg.job.output}; {m['output_tokens']} tokens at {m['output_tokens_per_s']:.1f} tokens/s{replicas}")
        # A signal after the last row leaves a complete output: nothing to resume, so no 143 asking for a requeue.
        if m["interrupted"]:
            if get_tp().dp_rank == 0:  # every replica's leader exits 143; one says why
                print(f"interrupted by signal: finished rows are on disk; rerun to complete (exit {EXIT_PREEMPTED})",
                      file=sys.stderr)
            return EXIT_PREEMPTED
        if served_nothing(m):
            if get_tp().dp_rank == 0:
                print(f"error: no row could be served; why is in {JobPaths.from_config(cfg.job).errors}",
                      file=sys.stderr)
            return 1
        return 0
    tp = get_tp()
    mine = cfg.job.prompts[tp.dp_rank :: tp.dp_size]
    if not mine:
        return 0
    outputs = llm.generate([[{"role": "user", "content": p}] if cfg.job.chat_template else p for p in mine])
    replica = f" [replica {tp.dp_rank}]" if tp.dp_size > 1 else ""
    for prompt, out in zip(mine, outputs):
        print(f"###{replica} {prompt}\n{out.error if out.error else out.text}\n")
    stats = llm.last_stats
    print(f"{stats['output_tokens']} tokens in {stats['seconds']:.2f} s: {stats['tokens_per_s']:.1f} tokens/s "
          f"({llm.engine.device.type}, tp={tp.size}, {len(outputs)} requests){replica}")
    return 1 if all(out.error for out in outputs) else 0  # as a job that serves no row


def run_worker(cfg: RuntimeConfig) -> int:
    from runtime.frontend.signals import ignore_drain_signals
    from runtime.worker import run_worker as follow_rank0

    ignore_drain_signals()  # a worker leaving early would stall everyone
    follow_rank0(cfg)
    return 0


def report_peak_memory(rank: int) -> None:
    import torch

    host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    device = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_initialized() else 0.0
    log.info("rank %d peak memory: host %.2f GiB, device %.2f GiB", rank, host, device)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if sweep.requested(argv):
        return sweep.main(argv, script=str(Path(__file__).resolve()), configure_threads=configure_cpu_threads)
    args = parse_args(argv)
    try:
        cfg = load_config(args.config or [DEFAULT_CONFIG], args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}{sweep_hint(exc)}", file=sys.stderr)
        return 2
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    if args.serve and cfg.job.input:
        print("error: 'serve' answers HTTP requests; leave job.input unset (a job runs without 'serve')",
              file=sys.stderr)
        return 2
    if args.nproc_per_node is not None:
        if args.serve and replicas(cfg, args.nproc_per_node) > 1:
            return serve_needs_one_replica(cfg, args.nproc_per_node)
        configure_cpu_threads(args.nproc_per_node)
        return start_ranks(args)
    configure_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.serve and replicas(cfg, world) > 1:
        return serve_needs_one_replica(cfg, world)
    if args.serve and int(os.environ.get("RANK", "0")) == 0:  # rank 0 listens; a bad address fails before the load
        from runtime.frontend.server import listen_problem

        problem = listen_problem(cfg.server.host, cfg.server.port)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    if bool(cfg.job.input) != bool(cfg.job.output):
        print("error: config keys 'job.input' and 'job.output' must be set together", file=sys.stderr)
        return 2
    if cfg.job.input and not Path(cfg.job.input).exists():
        print(f"error: config key 'job.input'={cfg.job.input} does not exist", file=sys.stderr)
        return 2
    if cfg.job.input:
        from runtime.frontend.job_files import JobPaths
        from runtime.frontend.job_inputs import check_output, open_input
        from runtime.sampling_params import SamplingParams

        try:  # bad input fails before the model loads
            paths = JobPaths.from_config(cfg.job)
            paths.check_distinct()
            paths.check_writable()
            paths.check_same_rows(to_yaml(cfg))
            source = open_input(paths.input, cfg.job, SamplingParams(**vars(cfg.sampling)))
            check_output(paths.output, source, repair=False)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2

    from parallel.distributed import init_distributed, read_torchrun_env, shutdown_distributed
    from runtime.engine.engine import wants_cuda

    rank = read_torchrun_env().rank
    logging.basicConfig(level=cfg.logging.level, format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s")
    held = contextlib.ExitStack()
    locked = bool(cfg.job.input) and cfg.job.lock and rank == 0  # global rank 0 leads replica 0, the output's writer
    if locked:  # before any collective: a second run stops here, before its peers or its model start
        from runtime.frontend.job import output_lock
        from runtime.frontend.output_lock import OutputLocked

        try:
            held.enter_context(output_lock(Path(cfg.job.output), cfg.job.lock_wait_s))
        except OutputLocked as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 1
        except OSError as exc:  # its lock file cannot be made (a read-only file system, say)
            print(f"error: config key 'job.output'={cfg.job.output}: its lock file cannot be made ({exc.strerror}: "
                  f"{exc.filename})", file=sys.stderr, flush=True)
            return 2
    try:
        with held:
            tp = init_distributed(wants_cuda(cfg.engine.device), cfg.parallel.timeout_s, tp_size=cfg.parallel.tp_size)
            try:
                code = run_leader(cfg, args.serve, locked) if tp.rank == 0 else run_worker(cfg)
            except BaseException as exc:
                from runtime.frontend.replicas import announce_failure

                announce_failure(exc)  # other replicas, on other nodes too, stop waiting for this one
                raise
            report_peak_memory(tp.global_rank)
    except KeyboardInterrupt:
        print(f"rank {rank}: interrupted (a second Ctrl-C); finished rows are on disk", file=sys.stderr, flush=True)
        exit_now(130)
    except (FileNotFoundError, ValueError, RuntimeError, OSError) as exc:
        # A config error is the same on every rank: rank 0 says it, once.
        if rank == 0 or not isinstance(exc, ValueError):
            print(f"error on rank {rank}: {exc}", file=sys.stderr, flush=True)
        elif read_torchrun_env().world_size > 1:
            # Leave rank 0 time to say it: torchrun ends every rank (SIGTERM, fatal here now) once the first one
            # exits. Still alive after that, this rank failed alone (its copy of the model, say): it says why.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(CONFIG_ERROR_GRACE_S)
            print(f"error on rank {rank}: {exc}", file=sys.stderr, flush=True)
        if read_torchrun_env().world_size > 1:
            # Peers may be stuck in a collective, so a graceful teardown could hang; finished rows are on disk.
            exit_now(1)
        return 1
    # Every engine released its CUDA graphs on the way out, so destroying the groups cannot block.
    shutdown_distributed()
    return code


def sweep_hint(exc: ConfigError) -> str:
    """An override the config refuses whose value is a list of values (``key=a,b``) was likely meant as a sweep
    axis: say how to run one."""
    from runtime.frontend.sweep_plan import split_top_level

    if exc.override is None or len(split_top_level(exc.override.partition("=")[2])) < 2:
        return ""
    return f" (for one run per value, sweep it: python launch.py --sweep {exc.override} ...)"


def replicas(cfg: RuntimeConfig, world_size: int) -> int:
    tp = cfg.parallel.tp_size or world_size
    return max(1, world_size // tp)


def serve_needs_one_replica(cfg: RuntimeConfig, world_size: int) -> int:
    print(f"error: 'serve' runs one TP group, but parallel.tp_size={cfg.parallel.tp_size} makes "
          f"{replicas(cfg, world_size)} replicas of {world_size} ranks: use parallel.tp_size=0 (all ranks), or one "
          "server per replica behind a load balancer", file=sys.stderr)
    return 2


def start_ranks(args: argparse.Namespace) -> int:
    """``--nproc-per-node N``: this process becomes the launcher of N ranks running this script."""
    from parallel.launcher import rank_launch_error, run_torchrun

    error = rank_launch_error(args.nproc_per_node)
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    script_args = [f"--config={c}" for c in args.config or []] + (["serve"] if args.serve else []) + args.overrides
    return run_torchrun(args.nproc_per_node, str(Path(__file__).resolve()), script_args,
                        stopped_code=0 if args.serve else None)


if __name__ == "__main__":
    sys.exit(record_exit_code(main()))
