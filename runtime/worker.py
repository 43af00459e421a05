"""The loop of ranks other than 0: rebuild each broadcast batch and run the same step."""

from __future__ import annotations

from collections.abc import Callable

from runtime.batch import Batch
from runtime.broadcast import IDLE, STOP, recv_batch
from runtime.config import RuntimeConfig
from runtime.engine import Engine, ForwardOutput


def worker_loop(engine: Engine, on_output: Callable[[Batch, ForwardOutput], None] | None = None) -> None:
    while True:
        item = recv_batch()
        if isinstance(item, int):
            if item == STOP:
                return
            assert item == IDLE
            continue
        output = engine.forward_batch(item)
        if on_output is not None:
            on_output(item, output)


def run_worker(cfg: RuntimeConfig) -> None:
    """Follow rank 0 until it says stop; rank 0 builds its engine in ``LLM`` concurrently (collective loading)."""
    engine = Engine.from_config(cfg)
    try:
        worker_loop(engine)
    finally:
        engine.close()
