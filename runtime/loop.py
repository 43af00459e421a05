"""The step loop on rank 0: schedule, launch, then handle the previous step's tokens.

With overlap on, step N+1 is scheduled and launched before step N's tokens are
read, so the host's bookkeeping runs while the GPU computes.
"""

from __future__ import annotations

from collections.abc import Callable

from runtime.batch import Batch, Req
from runtime.engine import Engine, ForwardOutput
from runtime.scheduler import Scheduler


def run_until_idle(
    scheduler: Scheduler, engine: Engine, overlap: bool, on_finish: Callable[[Req], None],
    on_batch: Callable[[Batch | None], None] | None = None,
) -> None:
    last: tuple[Batch, ForwardOutput] | None = None

    def handle(step: tuple[Batch, ForwardOutput]) -> None:
        for req in scheduler.process(*step):
            on_finish(req)

    while True:
        batch = scheduler.schedule()
        if on_batch is not None:
            on_batch(batch)  # TP: broadcast the descriptor (None tells the workers the job is idle)
        output = engine.forward_batch(batch) if batch is not None else None
        had_pending = last is not None
        if last is not None:
            handle(last)
        last = (batch, output) if batch is not None else None
        if last is not None and not overlap:
            handle(last)
            last = None
        if batch is None and not had_pending:
            if scheduler.idle:
                return
            raise RuntimeError("scheduler stalled: requests are waiting but none can be admitted")
