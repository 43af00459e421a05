"""One writer per output: an exclusive ``flock`` on ``<output>.lock`` (and ``.lock-<r>`` for replica r's part).

The OS drops a ``flock`` when its process dies, so a killed run never blocks its own resume. A run that finds
the lock held waits ``job.lock_wait_s`` first, since a killed torchrun's ranks take a while to exit. On NFS the
lock holds across clients; Lustre needs ``-o flock`` (``job.lock=false`` runs without the check).
"""

from __future__ import annotations

import errno
import fcntl
import glob
import json
import logging
import os
import socket
import time
from datetime import datetime
from pathlib import Path
from types import TracebackType

log = logging.getLogger(__name__)

_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class OutputLocked(RuntimeError):
    """Another live run holds the output; the message names the output and the holder."""


def lock_path(output: Path, replica: int = 0) -> Path:
    """``<output>.lock`` for replica 0, ``<output>.lock-<r>`` for replica r (not ``.part-``: tools list parts
    by that name)."""
    return output.with_name(f"{output.name}.lock" + (f"-{replica}" if replica else ""))


def part_locks(output: Path) -> list[Path]:
    """The lock files of replicas' parts of ``output`` that exist now (held, or left by a killed run)."""
    return sorted(output.parent.glob(glob.escape(output.name) + ".lock-*"))


class OutputLock:
    """``with OutputLock(path, what):`` holds ``path`` exclusively or raises ``OutputLocked`` at once."""

    def __init__(self, path: Path, what: str, wait_s: float = 0.0) -> None:
        self.path, self.what = path, what
        self.wait_s = wait_s  # a holder that is exiting gets this long
        self.fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.wait_s
        waiting = False
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    if time.monotonic() < deadline:
                        if not waiting:
                            log.warning("%s is in use by another run (%s); waiting up to %.0f s for it to end",
                                        self.what, self.holder(), self.wait_s)
                            waiting = True
                        time.sleep(0.2)
                        continue
                    raise OutputLocked(f"{self.what} is in use by another run ({self.holder()}); wait for it to "
                                       f"end or stop it (its lock: {self.path})") from None
                if exc.errno in _UNSUPPORTED:
                    raise OutputLocked(f"the filesystem of {self.path} does not support file locks ({exc.strerror}); "
                                       "on Lustre mount with -o flock, or set job.lock=false to run without the "
                                       "one-writer check") from None
                raise
            # The previous holder may have removed the file between our open and our lock: only a lock on the file the
            # path names now counts.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        started = datetime.now().astimezone().isoformat(timespec="seconds")
        record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": started, "output": self.what})
        os.ftruncate(fd, 0)
        os.pwrite(fd, (record + "\n").encode(), 0)
        self.fd = fd

    def holder(self) -> str:
        """Who holds the lock, from its file; the holder writes it right after locking, so retry briefly."""
        for _ in range(20):
            try:
                info = json.loads(self.path.read_text())
                return f"host {info['host']}, pid {info['pid']}, started {info['started']}"
            except (OSError, ValueError, KeyError, TypeError):
                time.sleep(0.025)
        return "holder unknown: its lock file is empty or unreadable"

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink()  # while still locked: nobody can take the name between our unlink and unlock
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
