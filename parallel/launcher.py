"""Start a one-node torchrun job in-process, so that its exit code and its last words are ours, not a traceback."""

from __future__ import annotations

import signal
import sys

EXIT_DRAINED = 143  # a rank that drained on a signal exits 128 + SIGTERM (runtime.frontend.signals)


def exit_code_of(rank_codes: dict[int, int]) -> int:
    """The launcher's exit code for failed ranks ``{global rank: exit code}`` (negative: killed by that signal)."""
    codes = {rank: 128 - code if code < 0 else code for rank, code in rank_codes.items()}
    failed = {rank: code for rank, code in codes.items() if code != 0}
    if not failed:
        return 0
    if all(code == EXIT_DRAINED for code in failed.values()):
        return EXIT_DRAINED
    first = min(rank for rank, code in failed.items() if code != EXIT_DRAINED)
    return failed[first] if 0 < failed[first] < 256 else 1


def run_torchrun(nproc_per_node: int, script: str, script_args: list[str], stopped_code: int | None = None) -> int:
    """``stopped_code``: the exit code after a SIGTERM/SIGINT passed on to the ranks (default 128 + signal: a job
    drained, resumable); a server is meant to stop, and says 0."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(["--standalone", f"--nproc-per-node={nproc_per_node}", script, *script_args])
    try:
        run(args)
    except SignalException as exc:
        code = 128 + int(exc.sigval) if stopped_code is None else stopped_code
        print(f"launcher: stopped by {signal.Signals(exc.sigval).name}; the ranks have exited (exit {code})",
              file=sys.stderr, flush=True)
        return code
    except ChildFailedError as exc:
        rank_codes = {int(rank): failure.exitcode for rank, failure in exc.failures.items()}
        code = exit_code_of(rank_codes)
        listed = ", ".join(f"rank {rank}: {c}" for rank, c in sorted(rank_codes.items()))
        print(f"launcher: ranks failed ({listed}); their errors are above (exit {code})", file=sys.stderr, flush=True)
        return code
    return 0
