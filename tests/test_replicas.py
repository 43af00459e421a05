"""How replicas share a job's progress through the store (in one process, on a HashStore)."""

from __future__ import annotations

import torch.distributed as dist

from runtime.frontend import replicas as replicas_module
from runtime.frontend.replicas import Replicas


def _replica(index: int, count: int, store: dist.Store) -> Replicas:
    r = Replicas()
    r.index, r.count, r.store, r.prefix = index, count, store, "job"  # every leader's n-th job: one prefix
    return r


def test_one_replica_counts_its_own_rows() -> None:
    r = Replicas()
    assert r.store is None and [r.finished() for _ in range(3)] == [1, 2, 3]


def test_finished_rows_are_counted_over_every_replica(monkeypatch) -> None:
    store = dist.HashStore()
    first, second = _replica(0, 2, store), _replica(1, 2, store)
    assert second.finished(3) == 3
    assert first.finished() == 4  # its own row and the other replica's three
    monkeypatch.setattr(replicas_module, "PROGRESS_PUSH_S", 3600.0)
    assert second.finished(2) == 5  # not pushed: its own rows at once, the other's as of its last push
    assert first.finished() == 5
    monkeypatch.setattr(replicas_module, "PROGRESS_PUSH_S", 0.0)
    first.finished(0), second.finished(0)  # both push what they hold
    assert first.finished(0) == second.finished(0) == 7


def test_a_leader_waiting_at_a_barrier_pings_its_workers_inside_their_timeout(monkeypatch) -> None:
    """TP workers give up a receive after parallel.timeout_s: a leader idle at a barrier must ping them more often
    than that, however short it is set (a fixed 5 s interval failed finished jobs at timeout_s=4)."""
    import threading
    import time
    from types import SimpleNamespace

    from runtime.frontend import llm as llm_module

    monkeypatch.setattr(llm_module, "get_tp", lambda: SimpleNamespace(size=2))
    pings: list[float] = []
    leader = SimpleNamespace(cfg=SimpleNamespace(parallel=SimpleNamespace(timeout_s=0.2)),
                             keep_workers_waiting=lambda: pings.append(time.monotonic()))
    store = dist.HashStore()
    waiting, late = _replica(0, 2, store), _replica(1, 2, store)
    arrive = threading.Timer(1.5, late.barrier, args=("reported",))
    arrive.start()
    start = time.monotonic()
    with llm_module.LLM.workers_kept_waiting(leader):
        waiting.barrier("reported")
    left = time.monotonic()
    arrive.join()
    time.sleep(0.2)
    gaps = [b - a for a, b in zip([start, *pings], pings)]
    assert len(pings) >= 3 and max(gaps) < 1.0, gaps  # the first on arrival
    assert all(t <= left for t in pings)  # none once the leader is back


def test_a_replica_that_fails_ends_the_others_barriers_with_its_reason(monkeypatch) -> None:
    """Without it a replica on another node, which no launcher stops, would wait at the barrier for ever. The
    failure may come before the replica's job started (its model load), so any barrier of the attempt ends."""
    import threading
    import time
    from types import SimpleNamespace

    import pytest

    store = dist.HashStore()
    monkeypatch.setattr(replicas_module, "get_tp", lambda: SimpleNamespace(dp_rank=1, dp_size=2, size=1))
    monkeypatch.setattr(replicas_module, "get_store", lambda: store)
    waiting = _replica(0, 2, store)
    fails = threading.Timer(0.3, replicas_module.announce_failure, args=(ValueError("row 7 broke it"),))
    fails.start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"replica 1: ValueError: row 7 broke it; replicas stop with it "
                                           r"\(at 'planned'\)"):
        waiting.barrier("planned")
    assert time.monotonic() - start < 2.0
    fails.join()
    replicas_module.announce_failure(RuntimeError("a later failure"))  # the first reason is the one kept
    with pytest.raises(RuntimeError, match="row 7 broke it"):
        _replica(0, 2, store).barrier("merged")


def test_the_last_barrier_waits_for_replica_0_past_a_drains_timeout() -> None:
    """After a drain the other replicas still wait for replica 0's merge (``give_up_after_drain=False``); the
    barriers before it give up, as a replica may never come."""
    import threading
    import time

    import pytest

    from runtime.frontend.signals import Drain

    store = dist.HashStore()
    drain = Drain(signum=15, since=time.monotonic() - 3600)  # drained an hour ago
    waiting = _replica(1, 2, store)
    waiting.drain, waiting.drain_timeout_s = drain, 1.0
    with pytest.raises(RuntimeError, match="not every replica reached 'reported' after the drain"):
        waiting.barrier("reported")
    merging = threading.Timer(0.5, _replica(0, 2, store).barrier, args=("merged",))
    merging.start()
    start = time.monotonic()
    waiting.barrier("merged", give_up_after_drain=False)
    assert time.monotonic() - start >= 0.4
    merging.join()


def test_a_barrier_ends_when_a_replica_falls_silent_not_when_it_is_slow(monkeypatch) -> None:
    """A replica killed without a word (the OOM killer, a lost node) stops counting its leader's heartbeat: the
    others stop waiting after SILENT_S. One whose heartbeat moves is waited for, however long it takes."""
    import threading
    import time

    import pytest

    from parallel.distributed import heartbeat_key

    monkeypatch.setattr(replicas_module, "SILENT_S", 0.6)
    monkeypatch.setattr(replicas_module, "HEARD_POLL_S", 0.05)
    store = dist.HashStore()
    waiting = _replica(0, 3, store)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"replica 1 has not been heard from for 1 s .* \(at 'reported'\)"):
        waiting.barrier("reported")  # replicas 1 and 2 never beat
    assert time.monotonic() - start < 3.0

    stop = threading.Event()

    def beat(rank: int) -> None:  # as parallel.distributed.start_heartbeat does, faster
        while not stop.is_set():
            store.add(heartbeat_key(rank), 1)
            time.sleep(0.1)

    beats = [threading.Thread(target=beat, args=(rank,), daemon=True) for rank in (1, 2)]
    for thread in beats:
        thread.start()
    late = [threading.Timer(2.0, _replica(r, 3, store).barrier, args=("merged",)) for r in (1, 2)]
    for timer in late:
        timer.start()
    start = time.monotonic()
    waiting.barrier("merged")  # slow (2 s, past SILENT_S) but alive: waited for
    assert time.monotonic() - start >= 1.9
    stop.set()
    for thread in [*beats, *late]:
        thread.join()


_EXITS_DURING_A_HEARTBEAT = """
import sys, time
import torch.distributed as dist
from parallel import distributed
store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
distributed.get_store = lambda: store
distributed.HEARTBEAT_S = 0.0  # a store call in flight at any moment, as one every 2 s is now and then
distributed.start_heartbeat(0)
time.sleep(0.3)
assert store.add(distributed.heartbeat_key(0), 0) > 0
sys.exit(0)
"""


def test_a_rank_exits_cleanly_while_its_heartbeat_is_inside_a_store_call() -> None:
    """The heartbeat is stopped and joined at exit: a daemon thread inside a TCPStore call when the interpreter
    finalises aborts the process (SIGABRT), which failed finished torchrun jobs now and then."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-c", _EXITS_DURING_A_HEARTBEAT], cwd=repo, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "terminate called" not in proc.stderr
