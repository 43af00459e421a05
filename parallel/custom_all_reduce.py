"""All-reduce for small messages over PyTorch symmetric memory, capturable in CUDA graphs: at decode sizes NCCL's
fixed latency dominates. NVLink multicast is switched off before the first symmetric allocation."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
# Where two-shot overtakes one-shot (scripts/bench_all_reduce.py).
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

    def fits(self, numel: int, dtype: torch.dtype) -> bool:
        return dtype == self.dtype and numel <= self.max_numel

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.view(-1)
        slot = self.buffer[: flat.numel()]
        slot.copy_(flat)
        self._reduce(slot, flat)
        return x

    def linear_all_reduce(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` summed over the ranks; the GEMM writes straight into the symmetric buffer."""
        rows = x.numel() // x.shape[-1]
        slot = self.buffer[: rows * weight.shape[0]].view(rows, weight.shape[0])
        torch.mm(x.reshape(rows, -1), weight.t(), out=slot)
        out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype, device=x.device)
        self._reduce(slot.view(-1), out.view(-1))
        return out

    def _reduce(self, slot: torch.Tensor, out: torch.Tensor) -> None:
        if slot.numel() * slot.element_size() >= TWO_SHOT_MIN_BYTES and slot.numel() % self.world == 0:
            torch.ops.symm_mem.two_shot_all_reduce_(slot, "sum", self.group_name)
            out.copy_(slot)
        else:
            self._op(slot, "sum", self.group_name, out)


def make_custom_all_reduce(
    kind: str, group: dist.ProcessGroup | None, cpu_group: dist.ProcessGroup | None, world: int,
    device: torch.device, dtype: torch.dtype, max_bytes: int,
) -> SymmMemAllReduce | None:
    """The custom all-reduce ``parallel.all_reduce`` asks for, or None. ``symm_mem`` insists, even at world size 1
    under torchrun, which lets one GPU test the whole path."""
    if kind == "symm_mem" and device.type != "cuda":
        raise ValueError("parallel.all_reduce=symm_mem needs CUDA devices")
    if kind == "nccl" or (kind == "auto" and world == 1) or device.type != "cuda" or group is None:
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
