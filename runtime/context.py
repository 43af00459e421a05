"""The global forward context: what ``model.forward()`` reads instead of taking arguments."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from models import ops

if TYPE_CHECKING:
    from runtime.batch import Batch


@dataclass
class ForwardContext:
    attn_backend: Any
    use_flashinfer_kernels: bool = False
    batch: Batch | None = None

    @contextmanager
    def forward_batch(self, batch: Batch) -> Iterator[None]:
        if _ctx is not self:  # several engines may live in one process (tests, comparisons)
            set_ctx(self)
        self.batch = batch
        try:
            yield
        finally:
            self.batch = None


_ctx: ForwardContext | None = None


def set_ctx(ctx: ForwardContext) -> None:
    """Make ``ctx`` current, with the kernel set its engine chose."""
    global _ctx
    _ctx = ctx
    ops.use_flashinfer(ctx.use_flashinfer_kernels)


def get_ctx() -> ForwardContext:
    if _ctx is None:
        raise RuntimeError("no forward context: the engine sets it before running the model")
    return _ctx
