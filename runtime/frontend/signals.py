"""Graceful drain on SIGTERM / SIGUSR1 (Slurm preemption): leaders finish in-flight rows for a bounded time
and exit ``EXIT_PREEMPTED`` so the job can be requeued; worker ranks ignore the signals and follow their leader.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

EXIT_PREEMPTED = 143
# Ctrl-C drains too; a second Ctrl-C interrupts at once.
DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
log = logging.getLogger(__name__)


@dataclass
class Drain:
    signum: int | None = None
    since: float = 0.0
    sync: Callable[[Drain], None] | None = None

    @property
    def requested(self) -> bool:
        if self.sync is not None:
            self.sync(self)
        return self.signum is not None

    def request(self, signum: int, frame: object = None, source: str = "") -> None:
        """A signal handler; ``source`` names where the request came from when it was passed on."""
        if signum == signal.SIGINT and not source:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if self.signum is None:
            self.signum, self.since = signum, time.monotonic()
            log.warning("%s received%s: draining (no new requests, in-flight ones finish)",
                        signal.Signals(signum).name, f" by {source}" if source else "")

    def expired(self, timeout_s: float) -> bool:
        return self.requested and time.monotonic() - self.since > timeout_s


def install_drain_handlers(drain: Drain) -> None:
    for sig in DRAIN_SIGNALS:
        signal.signal(sig, drain.request)


def ignore_drain_signals() -> None:
    for sig in DRAIN_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def restore_default_signals() -> None:
    for sig in DRAIN_SIGNALS:
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


def exit_now(code: int) -> None:
    """Leave at once with ``code`` (logs and streams flushed), skipping teardown that could hang on peers."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
