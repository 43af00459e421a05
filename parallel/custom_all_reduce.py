"""All-reduce for small messages over CUDA IPC (PyTorch symmetric memory), without NCCL.

Decode steps all-reduce a few KB to a few MB twice per layer; NCCL's ring/tree
protocols pay a fixed latency that dominates at that size. Each rank owns one
symmetric buffer that every peer maps over NVLink/PCIe P2P; an all-reduce
copies the input into it and runs a one-shot kernel (every rank reads all
peers' buffers and sums), which is capturable in CUDA graphs. Larger messages
(prefill) keep NCCL. NVLink multicast (NVLS) is never used: it is switched off
before the first symmetric allocation.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
# Measured in CUDA graphs on two H200s (scripts/bench_all_reduce.py): one-shot is faster up to
# 256 KB (8.7 us against 10.0 us at 128 KB), two-shot from 512 KB on (16.5 us against 20.5 at 2 MB).
TWO_SHOT_MIN_BYTES = 512 << 10


class SymmMemAllReduce:
    """In-place SUM of tensors up to ``max_bytes`` through one symmetric buffer per rank."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype, max_bytes: int) -> None:
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        self.world = group.size()
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.dtype = dtype
        self.max_numel = max_bytes // dtype.itemsize
        self.buffer = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)
        self._op = torch.ops.symm_mem.one_shot_all_reduce_out

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() <= self.max_numel and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.view(-1)
        slot = self.buffer[: flat.numel()]
        slot.copy_(flat)
        if flat.numel() * flat.element_size() >= TWO_SHOT_MIN_BYTES and flat.numel() % self.world == 0:
            torch.ops.symm_mem.two_shot_all_reduce_(slot, "sum", self.group_name)
            flat.copy_(slot)
        else:
            self._op(slot, "sum", self.group_name, flat)
        return x


def make_custom_all_reduce(
    kind: str, group: dist.ProcessGroup | None, cpu_group: dist.ProcessGroup | None, world: int,
    device: torch.device, dtype: torch.dtype, max_bytes: int,
) -> SymmMemAllReduce | None:
    """The custom all-reduce that ``parallel.all_reduce`` asks for, or None (NCCL only).

    ``auto`` uses symmetric memory on CUDA at TP > 1 when this PyTorch build has it and
    falls back to NCCL with a log line when it cannot be set up; ``symm_mem`` insists.
    """
    if kind == "nccl" or world == 1 or device.type != "cuda" or group is None:
        if kind == "symm_mem" and device.type != "cuda":
            raise ValueError("parallel.all_reduce=symm_mem needs CUDA devices")
        return None
    comm, error = None, None
    try:
        comm = SymmMemAllReduce(group, device, dtype, max_bytes)
    except (ImportError, AttributeError, RuntimeError) as exc:
        error = exc
    # Every rank must take the same path, or the ranks would wait in different collectives.
    ok = torch.tensor([int(comm is not None)], dtype=torch.int64)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=cpu_group)
    if int(ok) == 1:
        return comm
    if kind == "symm_mem":
        raise RuntimeError(f"parallel.all_reduce=symm_mem could not be set up on every rank: {error or 'another rank failed'}")
    log.warning("symmetric-memory all-reduce unavailable (%s); using NCCL for every all-reduce", error or "on another rank")
    return None
