"""A batch-invariant all-reduce: every rank's tensor gathered, then summed in rank order.

NCCL picks its algorithm and chunking by message size, and the one-shot and two-shot kernels differ too, so
an element's sum can be ordered differently when the batch has more rows. Here an element is always
``((x_0 + x_1) + x_2) + ...`` whatever the size. It moves TP times the bytes of a ring all-reduce, the price
of ``engine.deterministic`` at TP > 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class OrderedAllReduce:
    """The ``CustomAllReduce`` interface of ``parallel.state`` for every message size."""

    def __init__(self, group: dist.ProcessGroup | None, world: int) -> None:
        self.group = group
        self.world = world

    def fits(self, numel: int, dtype: torch.dtype) -> bool:
        return True

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the ranks in rank order, in place."""
        flat = x.reshape(-1).contiguous()
        parts = [torch.empty_like(flat) for _ in range(self.world)]
        dist.all_gather(parts, flat, group=self.group)  # a list: gloo (CPU) has no single-tensor form
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        x.copy_(total.view_as(x))
        return x

    def linear_all_reduce(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("deterministic row-parallel layers all-reduce their own GEMM's output")
