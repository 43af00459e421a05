"""Process-wide parallel state. Replicas share no collective, only the torchrun store, which has no timeout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0  # within the TP group; 0 runs the replica's scheduler
    size: int = 1
    local_rank: int = 0
    dp_rank: int = 0
    dp_size: int = 1

    @property
    def global_rank(self) -> int:
        return self.dp_rank * self.size + self.rank

    @property
    def is_primary(self) -> bool:
        return self.rank == 0


_tp = TPInfo()
_device_group: dist.ProcessGroup | None = None
_cpu_group: dist.ProcessGroup | None = None


class CustomAllReduce(Protocol):
    def fits(self, numel: int, dtype: torch.dtype) -> bool: ...
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...
    def linear_all_reduce(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...


_custom_all_reduce: CustomAllReduce | None = None


def set_tp(info: TPInfo, device_group: dist.ProcessGroup | None = None, cpu_group: dist.ProcessGroup | None = None) -> None:
    global _tp, _device_group, _cpu_group, _custom_all_reduce
    _tp, _device_group, _cpu_group, _custom_all_reduce = info, device_group, cpu_group, None


def set_custom_all_reduce(comm: CustomAllReduce | None) -> None:
    """Route the all-reduces that ``comm`` fits through it; None: NCCL (or gloo) for all."""
    global _custom_all_reduce
    _custom_all_reduce = comm


def get_tp() -> TPInfo:
    return _tp


def get_store() -> dist.Store | None:
    """The torchrun rendezvous store, or None without groups."""
    if not dist.is_initialized():
        return None
    # Private, but stable across PyTorch 2.x.
    return dist.distributed_c10d._get_default_store()


def get_cpu_group() -> dist.ProcessGroup | None:
    return _cpu_group


def get_device_group() -> dist.ProcessGroup | None:
    return _device_group


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP ranks in place (row-parallel outputs, vocab-parallel embeddings)."""
    comm = _custom_all_reduce
    if comm is not None and comm.fits(x.numel(), x.dtype) and x.is_contiguous():
        return comm.all_reduce(x)
    if _tp.size > 1:
        dist.all_reduce(x, group=_device_group)
    return x


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """Elementwise maximum of ``x`` over the TP ranks, in place (FP8 activation scales shared by the ranks)."""
    if _tp.size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=_device_group)
    return x


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any TP rank: a decision each rank takes from its own slice, made by all alike."""
    if _tp.size == 1:
        return flag
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_cpu_group)
    return bool(t.item())


def linear_all_reduce(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` summed over the TP ranks (row-parallel layers)."""
    comm = _custom_all_reduce
    if comm is not None and comm.fits(x.numel() // x.shape[-1] * weight.shape[0], x.dtype):
        return comm.linear_all_reduce(x, weight)
    return all_reduce(F.linear(x, weight))


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's slice of the last dimension (vocab-parallel logits)."""
    if _tp.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_tp.size)]
    dist.all_gather(parts, x.contiguous(), group=_device_group)
    return torch.cat(parts, dim=-1)


def assert_same_on_all_ranks(x: torch.Tensor, what: str) -> None:
    """Debug check: raise unless every rank holds the same ``x`` (syncs with the device)."""
    if _tp.size == 1:
        return
    parts = [torch.empty_like(x) for _ in range(_tp.size)]
    dist.all_gather(parts, x.contiguous(), group=_device_group)
    for rank, part in enumerate(parts[1:], start=1):
        if not torch.equal(part, parts[0]):
            diff = (part != parts[0]).nonzero().flatten()[:8].tolist()
            raise RuntimeError(f"{what} differ between rank 0 and rank {rank} at positions {diff}")
