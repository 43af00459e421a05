"""Micro-benchmark: a Triton GEMV for decode at 1-4 rows against cuBLAS (``torch.mm``), inside CUDA graphs.

    python scripts/bench_gemv.py [--rows 1,2,4]

Each shape's weight is copied until the copies pass 400 MB and every call reads the next copy, so L2
(50 MB on the H200) never serves a weight. Per shape and row count the best of a small tile sweep is
printed next to cuBLAS (microseconds per call and GB/s of weight read). Results and the decision are in
benchmarks/README.md ("Second session on issue 13"): the engine keeps cuBLAS.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl

SHAPES = {  # name: (out features N, in features K)
    "1B qkv": (3072, 2048), "1B o": (2048, 2048), "1B gate_up": (16384, 2048), "1B down": (2048, 8192),
    "8B down": (4096, 14336),
}


@triton.jit
def _gemv_fma(x_ptr, w_ptr, y_ptr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One row: BLOCK_N output features per program, float32 FMAs over K, one reduction at the end."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + (k0 + cols)[None, :])
        acc += w.to(tl.float32) * tl.load(x_ptr + k0 + cols).to(tl.float32)[None, :]
    tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty))


@triton.jit
def _gemv_dot(x_ptr, w_ptr, y_ptr, M, N, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Up to 16 rows through tensor cores (rows past M masked to zero)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ms = tl.arange(0, 16)
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = tl.load(w_ptr + rows[None, :].to(tl.int64) * K + (k0 + cols)[:, None])
        x = tl.load(x_ptr + ms[:, None] * K + (k0 + cols)[None, :], mask=ms[:, None] < M, other=0.0)
        acc = tl.dot(x, w, acc)
    tl.store(y_ptr + ms[:, None] * N + rows[None, :], acc.to(y_ptr.dtype.element_ty), mask=ms[:, None] < M)


def us_per_call(fn: Callable[[torch.Tensor], None], weights: list[torch.Tensor]) -> float:
    """One call per weight copy inside one CUDA graph, replayed 10 times."""
    fn(weights[0])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / 10 / len(weights) * 1e6


def configs(m: int) -> list[tuple]:
    fma = [("fma", *c) for c in itertools.product([8, 16], [256, 512], [4, 8], [2, 4])] if m == 1 else []
    return fma + [("dot", *c) for c in itertools.product([16, 32], [128, 256], [4], [3, 4, 6])]


def best_triton(x: torch.Tensor, y: torch.Tensor, weights: list[torch.Tensor], ref: torch.Tensor) -> tuple[float, tuple]:
    (m, k), n = x.shape, weights[0].shape[0]
    best: tuple[float, tuple] = (float("inf"), ())
    for kind, bn, bk, warps, stages in configs(m):
        if n % bn or k % bk:
            continue
        opts = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
        if kind == "fma":
            def fn(w: torch.Tensor, opts: dict = opts) -> None:
                _gemv_fma[(n // opts["BLOCK_N"],)](x, w, y, k, **opts)
        else:
            def fn(w: torch.Tensor, opts: dict = opts) -> None:
                _gemv_dot[(n // opts["BLOCK_N"],)](x, w, y, m, n, k, **opts)
        fn(weights[0])
        if (y.double() - ref).abs().max().item() > 0.05:  # a wrong tile config is reported, not timed
            print(f"  wrong result: {kind} {bn} {bk} {warps} {stages}")
            continue
        best = min(best, (us_per_call(fn, weights), (kind, bn, bk, warps, stages)))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1")
    args = parser.parse_args()
    dev = torch.device("cuda")
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
                   for _ in range(max(2, int(400e6 // (n * k * 2))))]
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            ref = torch.nn.functional.linear(x.double(), weights[0].double())
            cublas = us_per_call(lambda w, x=x, y=y: torch.mm(x, w.t(), out=y), weights)
            triton_us, tile = best_triton(x, y, weights, ref)
            mb = n * k * 2 / 1e3  # weight kilobytes: kB / us = GB/s
            print(f"{name:12} M={m} N={n} K={k}: cuBLAS {cublas:6.2f} us {mb / cublas:5.0f} GB/s | "
                  f"Triton {triton_us:6.2f} us {mb / triton_us:5.0f} GB/s {tile}", flush=True)


if __name__ == "__main__":
    main()
