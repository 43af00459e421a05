"""Micro-benchmark of flashinfer decode attention in our layout: tensor cores or not, eager or graph.

    python scripts/bench_attention.py [--batch 128] [--kv-len 600] [--page-size 16]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    import flashinfer

    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--kv-len", type=int, default=600)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    a = p.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    pages_per = -(-a.kv_len // a.page_size)
    num_pages = a.batch * pages_per + 1
    k = torch.randn(num_pages, a.page_size, a.kv_heads, a.head_dim, dtype=dt, device=dev)
    v = torch.randn_like(k)
    q = torch.randn(a.batch, a.heads, a.head_dim, dtype=dt, device=dev)
    perm = torch.randperm(num_pages - 1, device=dev)[: a.batch * pages_per].int() + 1
    indptr = torch.arange(a.batch + 1, dtype=torch.int32) * pages_per
    last = torch.full((a.batch,), a.kv_len - (pages_per - 1) * a.page_size, dtype=torch.int32)
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    kv_bytes = 2 * a.batch * a.kv_len * a.kv_heads * a.head_dim * 2
    for tc in (False, True):
        for graph in (False, True):
            kwargs = {}
            if graph:
                kwargs = dict(use_cuda_graph=True, paged_kv_indptr_buffer=torch.zeros(a.batch + 1, dtype=torch.int32, device=dev),
                              paged_kv_indices_buffer=torch.zeros(len(perm), dtype=torch.int32, device=dev),
                              paged_kv_last_page_len_buffer=torch.zeros(a.batch, dtype=torch.int32, device=dev))
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc, **kwargs)
            w.plan(indptr, perm, last, a.heads, a.kv_heads, a.head_dim, a.page_size, q_data_type=dt, kv_data_type=dt)
            out = torch.empty_like(q)
            w.run(q, (k, v), out=out)
            fn = lambda: w.run(q, (k, v), out=out)  # noqa: E731, B023
            if graph:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    w.run(q, (k, v), out=out)
                w.plan(indptr, perm, last, a.heads, a.kv_heads, a.head_dim, a.page_size, q_data_type=dt, kv_data_type=dt)
                fn = g.replay
            torch.cuda.synchronize()
            reps = 200
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
            us = (time.perf_counter() - t) / reps * 1e6
            print(f"tensor_cores={tc!s:5} graph={graph!s:5}: {us:8.1f} us  {kv_bytes / us / 1e3:7.0f} GB/s")


if __name__ == "__main__":
    main()
