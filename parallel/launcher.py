"""Start a one-node torchrun job in-process, so that its exit code and its last words are ours, not a traceback."""

from __future__ import annotations

import os
import signal
import sys

EXIT_DRAINED = 143  # a rank that drained on a signal exits 128 + SIGTERM (runtime.frontend.signals)


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


def run_torchrun(nproc_per_node: int, script: str, script_args: list[str], stopped_code: int | None = None) -> int:
    """``stopped_code``: the exit code after a SIGTERM, SIGINT or SIGUSR1 passed on to the ranks (default 143: a
    job drained, resumable); a server is meant to stop, and says 0."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(["--standalone", f"--nproc-per-node={nproc_per_node}", script, *script_args])
    # torchrun passes SIGTERM on to the ranks, not SIGUSR1 (Slurm's warning before a preemption): the same drain.
    signal.signal(signal.SIGUSR1, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
    try:
        run(args)
    except SignalException as exc:
        code = EXIT_DRAINED if stopped_code is None else stopped_code  # the ranks drained, whatever the signal
        print(f"launcher: stopped by {signal.Signals(exc.sigval).name}; the ranks have exited (exit {code})",
              file=sys.stderr, flush=True)
        return code
    except ChildFailedError as exc:
        rank_codes = {int(rank): failure.exitcode for rank, failure in exc.failures.items()}
        code = exit_code_of(rank_codes, int(exc.get_first_failure()[0]))
        listed = ", ".join(f"rank {rank}: {c}" for rank, c in sorted(rank_codes.items()))
        print(f"launcher: ranks failed ({listed}); their errors are above (exit {code})", file=sys.stderr, flush=True)
        return code
    return 0
