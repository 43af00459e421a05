"""How the data-parallel replicas of one job share it, through the torchrun store.

Replicas claim rows from one shared counter and never meet in a collective: a replica waiting for the others
could outlast any collective timeout. Keys carry the torchrun restart count, so a restarted job never reads
its previous attempt's counters.
"""

from __future__ import annotations

import json
import time
from typing import Any

from parallel.distributed import attempt_key, heartbeat_key
from parallel.state import get_store, get_tp
from runtime.frontend.signals import Drain

BARRIER_GRACE_S = 10.0  # after a drain's timeout, how long a barrier still waits
# A replica whose leader's heartbeat (parallel.distributed.start_heartbeat) stood still this long is gone.
SILENT_S = 120.0
HEARD_POLL_S = 1.0
DRAIN_POLL_S = 0.5
PROGRESS_PUSH_S = 0.5
_jobs_started = 0  # every leader runs the same jobs in order: the n-th job's keys are shared


def _failure_key() -> str:
    # One per attempt, not per job: a replica may fail before its job starts (loading its model), and a failed
    # run of a multi-rank sweep stops the sweep, so no later job reads it.
    return attempt_key("failed")


def announce_failure(exc: BaseException) -> None:
    """Tell the other replicas that this one stops on ``exc``, so their barriers end now rather than wait for it
    (on another node nothing else would end them); the first failure's reason is kept."""
    info = get_tp()
    store = get_store() if info.dp_size > 1 else None
    if store is None:
        return
    try:
        if not store.check([_failure_key()]):
            store.set(_failure_key(), f"replica {info.dp_rank}: {type(exc).__name__}: {exc}"[:1000])
    except Exception:  # noqa: BLE001 (the store may have gone down with the failure; nothing more to tell)
        pass


def number_next_job(number: int) -> None:
    """The next job's number, for ranks that did not all start each job (a sweep), so all name the same keys."""
    global _jobs_started
    _jobs_started = number - 1


class Replicas:
    def __init__(self, drain: Drain | None = None, drain_timeout_s: float = 0.0) -> None:
        global _jobs_started
        _jobs_started += 1
        info = get_tp()
        self.index, self.count, self.tp_size = info.dp_rank, info.dp_size, info.size
        self.store = get_store() if self.count > 1 else None
        self.prefix = attempt_key(f"job{_jobs_started}")
        self.drain, self.drain_timeout_s = drain, drain_timeout_s
        self._claimed = 0
        self._drain_published = False
        self._last_poll = 0.0
        self._finished = self._pushed = self._finished_all = 0
        self._last_push = float("-inf")

    @property
    def first(self) -> bool:
        return self.index == 0

    def claim(self, count: int, total: int) -> range:
        """The next ``count`` positions of the job's todo list (fewer at the end, empty when it is done)."""
        if count <= 0:
            return range(0)
        if self.store is None:
            start, self._claimed = self._claimed, self._claimed + count
            return range(min(start, total), min(start + count, total))
        # Guided self-scheduling: take at most a share of what is left so no replica sits on rows at the end.
        count = min(count, max(1, (total - self._claimed) // (4 * self.count)))
        end = self.store.add(f"{self.prefix}/next", count)
        self._claimed = end
        return range(min(end - count, total), min(end, total))

    def claimed_all(self, total: int) -> bool:
        """Whether every replica together has claimed the todo list's ``total`` rows."""
        claimed = self.store.add(f"{self.prefix}/next", 0) if self.store is not None else self._claimed
        return claimed >= total

    def finished(self, count: int = 1) -> int:
        """Count rows finished here; returns every replica's finished rows so far (others' arrive with a delay)."""
        self._finished += count
        if self.store is None:
            return self._finished
        now = time.monotonic()
        if now - self._last_push >= PROGRESS_PUSH_S:
            self._last_push = now
            self._finished_all = self.store.add(f"{self.prefix}/finished", self._finished - self._pushed)
            self._pushed = self._finished
        return self._finished_all + self._finished - self._pushed

    def share_drain(self, drain: Drain) -> None:
        """``Drain.sync`` while a job runs: drains are shared between replicas, polled at most every ``DRAIN_POLL_S``."""
        key = f"{self.prefix}/drain"
        if drain.signum is not None:
            if not self._drain_published:
                self.store.set(key, str(drain.signum))
                self._drain_published = True
            return
        now = time.monotonic()
        if now - self._last_poll >= DRAIN_POLL_S:
            self._last_poll = now
            if self.store.check([key]):
                self._drain_published = True
                drain.request(int(self.store.get(key)), source="another replica")

    def barrier(self, name: str, give_up_after_drain: bool = True) -> None:
        """Wait until every replica got here (no timeout: replicas finish their share at different times), or
        until one says it failed. Callers keep their TP workers waiting meanwhile (``LLM.workers_kept_waiting``).
        ``give_up_after_drain``: stop waiting a while after a drain, for a replica that may never come."""
        if self.store is None:
            return
        key, failed = f"{self.prefix}/{name}", _failure_key()
        self.store.add(key, 1)
        delay = 0.001
        heard: dict[int, tuple[int, float]] = {}  # other replicas: (heartbeat count, when it last moved)
        last_poll = float("-inf")
        while self.store.add(key, 0) < self.count:
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
            if self.store.check([failed]):
                raise RuntimeError(f"{self.store.get(failed).decode(errors='replace')}; replicas stop with it (at "
                                   f"'{name}'); finished rows are on disk")
            now = time.monotonic()
            if now - last_poll >= HEARD_POLL_S:
                last_poll = now
                silent = self._silent_replica(heard, now)
                if silent is not None:
                    raise RuntimeError(f"replica {silent} has not been heard from for {SILENT_S:.0f} s (killed, or "
                                       f"its node lost); replicas stop (at '{name}'); finished rows are on disk")
            if give_up_after_drain and self.drain is not None and \
                    self.drain.expired(self.drain_timeout_s + BARRIER_GRACE_S):
                raise RuntimeError(f"not every replica reached '{name}' after the drain; finished rows are on disk")

    def _silent_replica(self, heard: dict[int, tuple[int, float]], now: float) -> int | None:
        """The first other replica whose leader's heartbeat has not moved for ``SILENT_S``, else None."""
        for replica in range(self.count):
            if replica == self.index:
                continue
            count = self.store.add(heartbeat_key(replica * self.tp_size), 0)
            before = heard.get(replica)
            if before is None or count != before[0]:
                heard[replica] = (count, now)
            elif now - before[1] > SILENT_S:
                return replica
        return None

    def gather(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        """Every replica's ``mine``, in replica order (all replicas call it; a barrier included)."""
        if self.store is None:
            return [mine]
        self.store.set(f"{self.prefix}/report/{self.index}", json.dumps(mine))
        self.barrier("reported")
        return [json.loads(self.store.get(f"{self.prefix}/report/{r}")) for r in range(self.count)]
