"""All-reduce latency inside CUDA graphs: NCCL against symmetric-memory one-shot and two-shot.

    torchrun --nproc-per-node 2 scripts/bench_all_reduce.py [--dtype bfloat16]

Prints the time per all-reduce at each message size and the largest difference from NCCL's result.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel.custom_all_reduce import SymmMemAllReduce  # noqa: E402

SIZES_KB = [8, 32, 128, 512, 1024, 2048, 4096]
REPS = 20


def graph_time_us(fn, x: torch.Tensor) -> float:  # noqa: ANN001
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(REPS):
            fn(x)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / (10 * REPS)
    graph.reset()
    return us


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
    dtype = getattr(torch, args.dtype)
    group = dist.group.WORLD
    symm = SymmMemAllReduce(group, torch.device("cuda"), dtype, max(SIZES_KB) << 10)
    two_shot = torch.ops.symm_mem.two_shot_all_reduce_

    def two_shot_fn(x: torch.Tensor) -> None:
        slot = symm.buffer[: x.numel()]
        slot.copy_(x.view(-1))
        two_shot(slot, "sum", symm.group_name)
        x.view(-1).copy_(slot)

    rows = []
    for kb in SIZES_KB:
        numel = (kb << 10) // dtype.itemsize
        gen = torch.Generator(device="cuda").manual_seed(rank)
        x = torch.randn(numel, device="cuda", dtype=dtype, generator=gen)
        ref, a, b = x.clone(), x.clone(), x.clone()
        dist.all_reduce(ref, group=group)
        symm.all_reduce(a)
        two_shot_fn(b)
        row = {
            "kb": kb, "nccl_us": graph_time_us(lambda t: dist.all_reduce(t, group=group), x.clone()),
            "one_shot_us": graph_time_us(symm.all_reduce, x.clone()), "two_shot_us": graph_time_us(two_shot_fn, x.clone()),
            "one_shot_max_diff": float((a.float() - ref.float()).abs().max()),
            "two_shot_max_diff": float((b.float() - ref.float()).abs().max()),
        }
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    torch.cuda.synchronize()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
