"""Run a function on N local ranks (spawned processes, gloo) and collect each rank's result."""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from parallel.distributed import init_distributed, shutdown_distributed

    init_distributed(use_cuda=False, timeout_s=120)
    result = fn(rank, *args)
    torch.save(result, Path(out) / f"{rank}.pt")
    shutdown_distributed()


def run_ranks(world: int, fn: Callable, *args: Any, timeout: float = 600) -> list[Any]:
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as out:
        procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, out)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
        codes = [p.exitcode for p in procs]
        assert codes == [0] * world, f"rank exit codes {codes}"
        return [torch.load(Path(out) / f"{r}.pt", weights_only=False) for r in range(world)]


def child_with_rank(parent: int, rank: int) -> int:
    """The pid of the process ``parent`` (a torchrun) started with RANK=``rank``."""
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no child of {parent} has RANK={rank}")
