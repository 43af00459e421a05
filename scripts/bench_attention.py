"""Micro-benchmark of paged decode attention kernels in our cache layout, inside CUDA graphs.

    python scripts/bench_attention.py [--batch 256] [--kv-min 200 --kv-max 2000] [--page-size 16]
        [--heads 32 --kv-heads 8 --head-dim 64] [--impls cuda,tc_fa2,tc_fa3,xqa] [--layouts NHD,HND]

Each implementation runs 10 decode-attention calls per graph replay over the same random paged
cache (pages shuffled, lengths uniform in [kv-min, kv-max]); the line gives microseconds per call,
the KV bytes read over that time, and the largest difference from the first implementation's
output (the same numbers must come out of every kernel). ``xqa`` and the fa3 decode JIT-compile
on first use (FLASHINFER_DISABLE_JIT unset).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

CALLS_PER_GRAPH = 10


def make_cache(a: argparse.Namespace, layout: str, dev: torch.device) -> dict:
    torch.manual_seed(0)
    lens = torch.randint(a.kv_min, a.kv_max + 1, (a.batch,), dtype=torch.int32)
    pages_per = (lens + a.page_size - 1) // a.page_size
    total = int(pages_per.sum())
    max_pages = int(pages_per.max())
    shape = (total + 1, a.page_size, a.kv_heads, a.head_dim)
    if layout == "HND":
        shape = (total + 1, a.kv_heads, a.page_size, a.head_dim)
    k = torch.randn(shape, dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    indices = (torch.randperm(total, device=dev) + 1).int()
    indptr = torch.cat((torch.zeros(1, dtype=torch.int32), pages_per.cumsum(0).int()))
    table = torch.zeros(a.batch, max_pages, dtype=torch.int32, device=dev)
    for b in range(a.batch):
        table[b, : pages_per[b]] = indices[indptr[b] : indptr[b + 1]]
    return dict(
        k=k, v=v, lens=lens, indptr=indptr, indices=indices, table=table, max_len=int(lens.max()),
        last=(lens - (pages_per - 1) * a.page_size).int(),
        q=torch.randn(a.batch, a.heads, a.head_dim, dtype=torch.bfloat16, device=dev),
    )


def wrapper_impl(
    a: argparse.Namespace, c: dict, layout: str, tensor_cores: bool, backend: str, no_split: bool = False
) -> Callable:
    import flashinfer

    dev = c["q"].device
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        ws, layout, use_cuda_graph=True, use_tensor_cores=tensor_cores, backend=backend,
        paged_kv_indptr_buffer=torch.zeros(a.batch + 1, dtype=torch.int32, device=dev),
        paged_kv_indices_buffer=torch.zeros(len(c["indices"]), dtype=torch.int32, device=dev),
        paged_kv_last_page_len_buffer=torch.zeros(a.batch, dtype=torch.int32, device=dev),
    )
    w.plan(c["indptr"], c["indices"], c["last"], a.heads, a.kv_heads, a.head_dim, a.page_size,
           q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, disable_split_kv=no_split)
    out = torch.empty_like(c["q"])
    return lambda: w.run(c["q"], (c["k"], c["v"]), out=out)


def xqa_impl(a: argparse.Namespace, c: dict, layout: str) -> Callable:
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache

    dev = c["q"].device
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    seq_lens = c["lens"].to(dev)
    out = torch.empty_like(c["q"])
    scale = a.head_dim**-0.5
    return lambda: trtllm_batch_decode_with_kv_cache(
        c["q"], (c["k"], c["v"]), ws, c["table"], seq_lens, c["max_len"], bmm1_scale=scale, out=out,
        kv_layout=layout, backend="xqa",
    )


def build(a: argparse.Namespace, impl: str, c: dict, layout: str) -> Callable:
    if impl == "cuda":
        return wrapper_impl(a, c, layout, False, "auto")
    if impl.startswith("tc_"):  # tc_fa2, tc_fa3, tc_auto; a "_nosplit" suffix plans without split-KV
        return wrapper_impl(a, c, layout, True, impl[3:].removesuffix("_nosplit"), impl.endswith("_nosplit"))
    if impl == "xqa":
        return xqa_impl(a, c, layout)
    raise ValueError(f"unknown --impls entry {impl!r} (cuda, tc_fa2, tc_fa3, tc_auto, tc_fa2_nosplit, xqa)")


def time_graph(fn: Callable) -> tuple[float, torch.Tensor]:
    out = fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    reps = 20
    start = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps / CALLS_PER_GRAPH * 1e6, out.clone()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--kv-min", type=int, default=200)
    p.add_argument("--kv-max", type=int, default=2000)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--impls", default="cuda,tc_fa2,tc_fa3,xqa")
    p.add_argument("--layouts", default="NHD,HND")
    a = p.parse_args()
    dev = torch.device("cuda")
    print(f"batch {a.batch}, kv {a.kv_min}-{a.kv_max}, page {a.page_size}, heads {a.heads}/{a.kv_heads}x{a.head_dim}")
    for layout in a.layouts.split(","):
        c = make_cache(a, layout, dev)
        kv_bytes = 2 * int(c["lens"].sum()) * a.kv_heads * a.head_dim * 2
        reference = None
        for impl in a.impls.split(","):
            try:
                us, out = time_graph(build(a, impl, c, layout))
            except Exception as e:  # noqa: BLE001 - a sweep reports what does not run and goes on
                print(f"{impl:8} {layout}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                continue
            reference = out if reference is None else reference
            err = (out.float() - reference.float()).abs().max().item()
            print(f"{impl:8} {layout}: {us:8.1f} us  {kv_bytes / us / 1e3:6.0f} GB/s  max diff {err:.2e}")


if __name__ == "__main__":
    main()
