"""The rank-0 step loop; with overlap, step N+1 launches before step N's tokens are read."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from runtime.batch import Batch, Req
from runtime.engine import Engine, ForwardOutput
from runtime.output import OutputProcessor
from runtime.scheduler import Scheduler


class DrainRequest(Protocol):
    """A drain request, e.g. ``runtime.frontend.signals.Drain``."""

    @property
    def requested(self) -> bool: ...

    def expired(self, timeout_s: float) -> bool: ...


def run_until_idle(
    scheduler: Scheduler, engine: Engine, outputs: OutputProcessor, overlap: bool, on_finish: Callable[[Req], None],
    on_batch: Callable[[Batch | None], None] | None = None, drain: DrainRequest | None = None, drain_timeout_s: float = 0.0,
    refill: Callable[[], bool] | None = None, on_tokens: Callable[[list[Req]], None] | None = None,
) -> bool:
    """Serve until nothing is left; returns False if a drain request cut the run short.

    ``refill`` tops up the waiting queue and says whether more may come.
    """
    last: tuple[Batch, ForwardOutput] | None = None

    def handle(step: tuple[Batch, ForwardOutput]) -> None:
        finished = outputs.process(*step)
        for req in finished:  # all released before any callback, which may raise
            scheduler.finish(req)
        for req in finished:
            on_finish(req)
        if on_tokens is not None:
            on_tokens(step[0].reqs)

    while True:
        more = refill() if refill is not None else False
        if drain is not None and drain.requested:
            scheduler.draining = True  # admit nothing new; what runs may finish
            if drain.expired(drain_timeout_s):
                if last is not None:
                    handle(last)
                scheduler.abort_all()
                return False
        batch = scheduler.schedule()
        if on_batch is not None:
            on_batch(batch)
        output = engine.forward_batch(batch) if batch is not None else None
        had_pending = last is not None
        if last is not None:
            handle(last)
        last = (batch, output) if batch is not None else None
        if last is not None and not overlap:
            handle(last)
            last = None
        if batch is None and not had_pending:
            if scheduler.idle and more:
                continue  # the source may still hand out rows (another replica may have taken the last ones)
            if scheduler.idle:
                return True
            if scheduler.draining:
                scheduler.abort_all()  # only never-admitted requests are left
                return False
            raise RuntimeError("scheduler stalled: requests are waiting but none can be admitted")
