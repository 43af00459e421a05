"""Process-wide tensor-parallel state: this rank's place and its two groups.

The device group (NCCL on CUDA, gloo on CPU) carries activations; the CPU group
(always gloo) carries control traffic: batch descriptors and memory agreement.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_primary(self) -> bool:
        return self.rank == 0


_tp = TPInfo()
_device_group: dist.ProcessGroup | None = None
_cpu_group: dist.ProcessGroup | None = None


def set_tp(info: TPInfo, device_group: dist.ProcessGroup | None = None, cpu_group: dist.ProcessGroup | None = None) -> None:
    global _tp, _device_group, _cpu_group
    _tp, _device_group, _cpu_group = info, device_group, cpu_group


def get_tp() -> TPInfo:
    return _tp


def get_cpu_group() -> dist.ProcessGroup | None:
    return _cpu_group


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP ranks in place (row-parallel outputs, vocab-parallel embeddings)."""
    if _tp.size > 1:
        dist.all_reduce(x, group=_device_group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's slice of the last dimension (vocab-parallel logits)."""
    if _tp.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_tp.size)]
    dist.all_gather(parts, x.contiguous(), group=_device_group)
    return torch.cat(parts, dim=-1)
