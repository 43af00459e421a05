"""A batch-invariant all-reduce, gathered then summed in rank order: NCCL's order depends on message size."""

from __future__ import annotations

import torch
import torch.distributed as dist


class OrderedAllReduce:
    def __init__(self, group: dist.ProcessGroup | None, world: int) -> None:
        self.group = group
        self.world = world

    def fits(self, numel: int, dtype: torch.dtype) -> bool:
        return True

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
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
