"""torchrun integration: read the environment, create the process groups, agree on memory.

``python launch.py`` without torchrun is world size 1 and creates no groups.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.state import TPInfo, get_cpu_group, get_tp, set_tp


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world_size: int
    local_rank: int


def read_torchrun_env(environ: dict[str, str] | None = None) -> TorchrunEnv:
    """RANK, WORLD_SIZE, LOCAL_RANK as torchrun sets them (MASTER_ADDR/PORT are read by env:// init)."""
    env = os.environ if environ is None else environ
    try:
        return TorchrunEnv(
            rank=int(env.get("RANK", "0")), world_size=int(env.get("WORLD_SIZE", "1")),
            local_rank=int(env.get("LOCAL_RANK", "0")),
        )
    except ValueError as exc:
        raise ValueError(f"malformed torchrun environment (RANK/WORLD_SIZE/LOCAL_RANK): {exc}") from None


def init_distributed(use_cuda: bool, timeout_s: int, env: TorchrunEnv | None = None) -> TPInfo:
    """Join the job: NCCL device group on CUDA (device = LOCAL_RANK), gloo otherwise, plus a gloo CPU group."""
    env = env or read_torchrun_env()
    info = TPInfo(rank=env.rank, size=env.world_size, local_rank=env.local_rank)
    if env.world_size == 1 and "TORCHELASTIC_RUN_ID" not in os.environ:
        set_tp(info)  # plain `python launch.py`: no process groups at all
        return info
    if use_cuda:
        if env.local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK={env.local_rank} but this node has {torch.cuda.device_count()} GPUs; "
                "start one process per GPU (torchrun --nproc-per-node)"
            )
        torch.cuda.set_device(env.local_rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo", rank=env.rank, world_size=env.world_size, timeout=timeout,
            device_id=torch.device("cuda", env.local_rank) if use_cuda else None,
        )
    device_group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    set_tp(info, device_group, cpu_group)
    return info


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    set_tp(TPInfo())


def agree_on_memory(free_bytes: int) -> tuple[int, int]:
    """(min, max) of a number over all ranks with ONE all_reduce(MIN) of [free, -free] on the CPU group."""
    t = torch.tensor([free_bytes, -free_bytes], dtype=torch.int64)
    if get_tp().size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=get_cpu_group())
    return int(t[0]), -int(t[1])
