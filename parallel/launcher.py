"""Start a one-node torchrun job in-process, so that its exit code and its last words are ours, not a traceback."""

from __future__ import annotations

import os
import signal
import sys
import tempfile

EXIT_DRAINED = 143  # a rank that drained on a signal exits 128 + SIGTERM (runtime.frontend.signals)
# A launcher that reports its ranks' own exit codes (this one, scripts/slurm/torchrun_cmd.py) names a folder here,
# and each rank leaves its code there as a file named by its global rank: torchrun exits 1 after any signal,
# whatever its ranks returned, so a drain that finished the last rows would otherwise read as a failure.
EXIT_CODE_DIR_ENV = "TPINFER_EXIT_CODE_DIR"


def exit_code_of(rank_codes: dict[int, int], first_failed: int | None = None) -> int:
    """The launcher's exit code for failed ranks ``{global rank: exit code}`` (negative: killed by that signal):
    the first failure's own code (``first_failed``, as torchrun saw it; else the lowest rank's), not that of a
    rank ended because of it."""
    codes = {rank: 128 - code if code < 0 else code for rank, code in rank_codes.items()}
    failed = {rank: code for rank, code in codes.items() if code != 0}
    if not failed:
        return 0
    if all(code == EXIT_DRAINED for code in failed.values()):
        return EXIT_DRAINED
    real = [rank for rank, code in failed.items() if code != EXIT_DRAINED]
    first = first_failed if first_failed in real else min(real)
    return failed[first] if 0 < failed[first] < 256 else 1


def record_exit_code(code: int) -> int:
    """Leave this rank's exit code for its launcher when one asks (``EXIT_CODE_DIR_ENV`` and torchrun's ``RANK``
    set); returns ``code``. A rank killed before this, or while writing, leaves no code."""
    folder, rank = os.environ.get(EXIT_CODE_DIR_ENV), os.environ.get("RANK", "")
    if folder and rank.isdigit():
        path = os.path.join(folder, rank)
        try:
            with open(f"{path}.tmp", "w") as f:
                f.write(f"{code}\n")
            os.replace(f"{path}.tmp", path)  # whole or absent, never half a number
        except OSError as exc:  # the launcher then reports torchrun's own code
            print(f"rank {rank}: cannot leave its exit code in {folder}: {exc}", file=sys.stderr, flush=True)
    return code


def recorded_exit_codes(folder: str) -> dict[int, int]:
    """``{global rank: exit code}`` of the ranks that left one in ``folder`` (``record_exit_code``)."""
    codes = {}
    for name in os.listdir(folder):
        if name.isdigit():
            try:
                with open(os.path.join(folder, name)) as f:
                    codes[int(name)] = int(f.read())
            except (OSError, ValueError):
                continue
    return codes


def rank_launch_error(nproc_per_node: int) -> str | None:
    """Why ``--nproc-per-node N`` cannot start N ranks from here, or None."""
    if nproc_per_node < 1:
        return f"--nproc-per-node must be at least 1, got {nproc_per_node}"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "--nproc-per-node starts the ranks itself; under torchrun leave it out"
    return None


def run_torchrun(nproc_per_node: int, script: str, script_args: list[str], stopped_code: int | None = None) -> int:
    """After a SIGTERM, SIGINT or SIGUSR1 passed on to the ranks, their own exit code (0: a job done while draining)
    when every rank left one, else ``stopped_code`` (default 143: a job drained, resumable; a server is meant to
    stop, and says 0). torchrun itself raises after such a signal whatever its ranks returned."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(["--standalone", f"--nproc-per-node={nproc_per_node}", script, *script_args])
    # torchrun passes SIGTERM on to the ranks, not SIGUSR1 (Slurm's warning before a preemption): the same drain.
    signal.signal(signal.SIGUSR1, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
    with tempfile.TemporaryDirectory(prefix="tpinfer-exit-codes-") as folder:
        os.environ[EXIT_CODE_DIR_ENV] = folder  # the ranks inherit this process's environment
        try:
            run(args)
        except SignalException as exc:
            ranks = recorded_exit_codes(folder)
            if len(ranks) == nproc_per_node:
                code = exit_code_of(ranks)
            else:  # a rank was killed before it could say: the ranks drained, whatever the signal
                code = EXIT_DRAINED if stopped_code is None else stopped_code
            print(f"launcher: stopped by {signal.Signals(exc.sigval).name}; the ranks have exited (exit {code})",
                  file=sys.stderr, flush=True)
            return code
        except ChildFailedError as exc:
            rank_codes = {int(rank): failure.exitcode for rank, failure in exc.failures.items()}
            code = exit_code_of(rank_codes, int(exc.get_first_failure()[0]))
            listed = ", ".join(f"rank {rank}: {c}" for rank, c in sorted(rank_codes.items()))
            print(f"launcher: ranks failed ({listed}); their errors are above (exit {code})", file=sys.stderr,
                  flush=True)
            return code
        finally:
            os.environ.pop(EXIT_CODE_DIR_ENV, None)
    return 0
