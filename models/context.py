"""The global forward context that ``model.forward()`` reads: CUDA-graph capture needs a fixed signature."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class Attention(Protocol):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor: ...


@dataclass
class ForwardContext:
    attn_backend: Attention
    batch: Any = None

    @contextmanager
    def forward_batch(self, batch: Any) -> Iterator[None]:
        global _ctx
        _ctx = self  # several engines may live in one process (tests, comparisons)
        self.batch = batch
        try:
            yield
        finally:
            self.batch = None


_ctx: ForwardContext | None = None


def get_ctx() -> ForwardContext:
    if _ctx is None or _ctx.batch is None:
        raise RuntimeError("no forward context: the engine sets it around each model call")
    return _ctx
