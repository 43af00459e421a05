"""Micro-benchmark of paged decode attention kernels in our cache layout, inside CUDA graphs.

    python scripts/bench_attention.py [--batch 256] [--kv-min 200 --kv-max 2000] [--page-size 16]
        [--heads 32 --kv-heads 8 --head-dim 64] [--impls cuda,tc_fa2,tc_fa3,xqa] [--layouts NHD,HND] [--fp8]
        [--max-len 131072]

Outputs are checked against the first implementation's. Only ``+rope`` entries (with our RoPE + KV-store kernel)
and ``xqa_engine`` (the engine's FP8 decode: that kernel writing a dense q, then XQA) compare with ``paged``,
which includes those steps. ``paged_b<tokens>_w<warps>_s<stages>`` runs
paged_decode with those launch settings. ``--fp8`` stores the cache in e4m3 (paged and xqa; GB/s counts 1 byte).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
    kv = torch.randn((2, *shape), dtype=torch.bfloat16, device=dev)
    kv_scales = None
    if a.fp8:  # the cache holds K / k_scale: scales that put randn's range well inside e4m3's
        kv_scales = torch.tensor([0.02, 0.03], device=dev)
        kv = (kv.float() / kv_scales.view(2, 1, 1, 1, 1)).to(torch.float8_e4m3fn)
    k, v = kv[0], kv[1]
    indices = (torch.randperm(total, device=dev) + 1).int()
    indptr = torch.cat((torch.zeros(1, dtype=torch.int32), pages_per.cumsum(0).int()))
    table = torch.zeros(a.batch, max_pages, dtype=torch.int32, device=dev)
    for b in range(a.batch):
        table[b, : pages_per[b]] = indices[indptr[b] : indptr[b + 1]]
    positions = (lens - 1).long().to(dev)
    last_page = table[torch.arange(a.batch, device=dev), positions // a.page_size].long()
    qkv = torch.randn(a.batch, (a.heads + 2 * a.kv_heads) * a.head_dim, dtype=torch.bfloat16, device=dev)
    return dict(
        kv=kv, kv_scales=kv_scales, qkv=qkv, positions=positions,
        out_loc=last_page * a.page_size + positions % a.page_size, k=k, v=v, lens=lens, indptr=indptr,
        indices=indices, table=table, max_len=int(lens.max()),
        last=(lens - (pages_per - 1) * a.page_size).int(),
        q=torch.randn(a.batch, a.heads, a.head_dim, dtype=torch.bfloat16, device=dev),
    )


def qkv_views(a: argparse.Namespace, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = qkv[:, : a.heads * a.head_dim].view(a.batch, a.heads, a.head_dim)
    return q, qkv[:, a.heads * a.head_dim :].view(a.batch, 2, a.kv_heads, a.head_dim)


def cos_sin_table(a: argparse.Namespace, c: dict) -> torch.Tensor:
    from models.ops import rope_cos_sin_cache, rope_inv_freq

    return rope_cos_sin_cache(c["max_len"] + 1, rope_inv_freq(a.head_dim, 500000.0, None)).to(c["q"].device)


def _stub_cache(a: argparse.Namespace, c: dict) -> object:
    """A one-layer KVCache over the benchmark's pages, for the RoPE + KV-write kernel."""
    from runtime.engine.kv_cache import KVCache

    cache = KVCache.__new__(KVCache)
    cache.buffer, cache.page_size = c["kv"][None], a.page_size
    cache.fp8 = c["kv_scales"] is not None
    cache.scales = (c["kv_scales"] if cache.fp8 else torch.ones(2, device=c["kv"].device)).view(1, 2)
    return cache


def with_rope(a: argparse.Namespace, c: dict, attend: Callable) -> Callable:
    """The engine's unfused layer: RoPE and the KV write, then ``attend(q)``."""
    from runtime.engine.attention.rope_store import rope_and_store

    q, kv = qkv_views(a, c["qkv"].clone())  # rotated in place: a copy per implementation
    cache = _stub_cache(a, c)
    cos_sin = cos_sin_table(a, c)

    def run() -> torch.Tensor:
        rope_and_store(c["positions"], q, kv, cos_sin, cache, 0, c["out_loc"])
        return attend(q)

    return run


def paged_impl(a: argparse.Namespace, c: dict, settings: str = "") -> Callable:
    """paged_decode.py with the engine's chunk rule (comparable with the ``+rope`` entries); ``settings``:
    ``b<tokens>_w<warps>_s<stages>`` (any subset) instead of the module's."""
    from runtime.engine.attention import paged_decode as pd

    block = pd.FP8_BLOCK_TOKENS if a.fp8 else pd.BLOCK_TOKENS
    chosen = {"b": block, "w": pd.NUM_WARPS, "s": pd.NUM_STAGES}
    chosen.update({part[0]: int(part[1:]) for part in settings.split("_") if part})

    dev = c["q"].device
    q, kv = qkv_views(a, c["qkv"])
    cos_sin = cos_sin_table(a, c)
    max_len = a.max_len or c["table"].shape[1] * a.page_size
    chunk = pd.chunk_tokens(a.batch, a.kv_heads)
    chunks = pd.num_chunks(max_len, chunk, a.batch * a.kv_heads)
    workspace = torch.empty(max(pd.workspace_size(a.batch, a.kv_heads, a.heads // a.kv_heads, a.head_dim, chunks), 1),
                            device=dev)
    counters = pd.new_counters(a.batch, a.kv_heads, dev)
    rows = torch.arange(a.batch, device=dev)

    def run() -> torch.Tensor:
        saved = pd.BLOCK_TOKENS, pd.FP8_BLOCK_TOKENS, pd.NUM_WARPS, pd.NUM_STAGES
        pd.BLOCK_TOKENS = pd.FP8_BLOCK_TOKENS = chosen["b"]
        pd.NUM_WARPS, pd.NUM_STAGES = chosen["w"], chosen["s"]
        try:
            out = pd.paged_decode(q, kv, c["positions"], rows, c["out_loc"], cos_sin, c["table"], c["kv"], workspace,
                                  counters, chunk, chunks, c["kv_scales"])
        finally:
            pd.BLOCK_TOKENS, pd.FP8_BLOCK_TOKENS, pd.NUM_WARPS, pd.NUM_STAGES = saved
        return out.view(a.batch, a.heads, a.head_dim)

    return run


def wrapper_impl(
    a: argparse.Namespace, c: dict, layout: str, tensor_cores: bool, backend: str, no_split: bool = False,
    rope: bool = False, split_size: int | None = None,
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
           q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, disable_split_kv=no_split,
           fixed_split_size=split_size)
    out = torch.empty_like(c["q"])
    if rope:
        return with_rope(a, c, lambda q: w.run(q, (c["k"], c["v"]), out=out))
    return lambda: w.run(c["q"], (c["k"], c["v"]), out=out)


def xqa_impl(a: argparse.Namespace, c: dict, layout: str, rope: bool = False) -> Callable:
    """TensorRT-LLM's XQA decode kernel through flashinfer; over an e4m3 cache its Hopper FP8 kernel."""
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache

    dev = c["q"].device
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    seq_lens = c["lens"].to(dev)
    out = torch.empty_like(c["q"])
    k_scale, v_scale = c["kv_scales"].tolist() if c["kv_scales"] is not None else (1.0, 1.0)
    scale = a.head_dim**-0.5 * k_scale

    def attend(q: torch.Tensor) -> torch.Tensor:
        return trtllm_batch_decode_with_kv_cache(  # it reads q as dense [batch, heads, dim]
            q.contiguous(), (c["k"], c["v"]), ws, c["table"], seq_lens, c["max_len"], bmm1_scale=scale,
            bmm2_scale=v_scale, out=out, kv_layout=layout, backend="xqa",
        )

    return with_rope(a, c, attend) if rope else (lambda: attend(c["q"]))


def xqa_engine_impl(a: argparse.Namespace, c: dict) -> Callable:
    """The engine's FP8 decode: our RoPE + KV write into a dense q, then XQA (attention/xqa_decode.py)."""
    from runtime.engine.attention.rope_store import rope_and_store
    from runtime.engine.attention.xqa_decode import XqaDecode

    dev = c["q"].device
    q, kv = qkv_views(a, c["qkv"].clone())
    cache = _stub_cache(a, c)
    cos_sin = cos_sin_table(a, c)
    xqa = XqaDecode(c["table"], a.batch, a.kv_heads, a.heads // a.kv_heads, a.head_dim)
    rows = torch.arange(a.batch, device=dev)
    k_scale, v_scale = cache.scales[0].tolist()

    def run() -> torch.Tensor:
        rotated = torch.empty(q.shape, dtype=q.dtype, device=dev)
        rope_and_store(c["positions"], q, kv, cos_sin, cache, 0, c["out_loc"], q_out=rotated)
        xqa.prepare(c["positions"], rows)
        return xqa.attend(rotated, c["k"], c["v"], k_scale, v_scale)

    return run


def build(a: argparse.Namespace, impl: str, c: dict, layout: str) -> Callable:
    rope = impl.endswith("+rope")
    impl = impl.removesuffix("+rope")
    if impl == "paged" or impl.startswith("paged_"):
        return paged_impl(a, c, impl[6:])
    if impl == "cuda":
        return wrapper_impl(a, c, layout, False, "auto", rope=rope)
    if impl.startswith("tc_"):
        name, _, split = impl[3:].removesuffix("_nosplit").partition("_split")
        return wrapper_impl(a, c, layout, True, name, impl.endswith("_nosplit"), rope=rope,
                            split_size=int(split) if split else None)
    if impl == "xqa":
        return xqa_impl(a, c, layout, rope)
    if impl == "xqa_engine":
        if layout != "NHD":
            raise ValueError("xqa_engine reads the engine's NHD pages (--layouts NHD)")
        return xqa_engine_impl(a, c)
    raise ValueError(f"unknown --impls entry {impl!r} (cuda, tc_fa2, tc_fa3, tc_auto, tc_fa2_nosplit, tc_fa2_split<N>, xqa, "
                     "with +rope; paged, paged_b<N>_w<N>_s<N>; xqa_engine)")


def time_graph(fn: Callable) -> tuple[float, torch.Tensor]:
    out = fn().clone()  # the first call's: +rope variants rotate their q again on every call
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
    return (time.perf_counter() - start) / reps / CALLS_PER_GRAPH * 1e6, out


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
    p.add_argument("--fp8", action="store_true", help="an e4m3 cache (paged_decode and xqa)")
    p.add_argument("--max-len", type=int, default=0,
                   help="the engine's sequence limit, which sets paged_decode's chunk count (default: the page table's)")
    a = p.parse_args()
    dev = torch.device("cuda")
    print(f"batch {a.batch}, kv {a.kv_min}-{a.kv_max}, page {a.page_size}, heads {a.heads}/{a.kv_heads}x{a.head_dim}")
    for layout in a.layouts.split(","):
        c = make_cache(a, layout, dev)
        kv_bytes = 2 * int(c["lens"].sum()) * a.kv_heads * a.head_dim * c["kv"].element_size()
        reference = None
        for impl in a.impls.split(","):
            try:
                us, out = time_graph(build(a, impl, c, layout))
            except Exception as e:  # noqa: BLE001 - a sweep reports what does not run and goes on
                print(f"{impl:8} {layout}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                continue
            reference = out if reference is None else reference
            diff = out.float() - reference.float()
            rel = (diff.norm() / reference.float().norm()).item()
            print(f"{impl:8} {layout}: {us:8.1f} us  {kv_bytes / us / 1e3:6.0f} GB/s  max diff {diff.abs().max():.2e}"
                  f"  relative {rel:.1e}")


if __name__ == "__main__":
    main()
