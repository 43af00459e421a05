"""Decode attention for CUDA graphs of several requests (Triton, tensor cores): RoPE, the KV write and
split-KV attention over the paged cache in one kernel, with no host plan.

flashinfer's tensor-core decode (its fa2 prefill kernel with a host plan), after our RoPE + KV-write kernel,
reads a 9/3-head x 64 cache at ~2.0 TB/s at 128 requests and ~2.6 TB/s at 256, and adds a split-KV merge
kernel per layer: three kernels, and a plan on the host each step. Here there is one kernel, with one
program per (request, KV head, chunk of ``chunk`` tokens):

- the program rotates its query heads (the GQA group, padded to the 16 rows a tensor-core tile needs) and
  keeps them in registers, rounded to the model dtype as the unfused path holds them; the program whose
  chunk holds the step's token also rotates its K, writes K and V to the token's cache slot and starts its
  softmax state with that token from registers (no program reads a slot written in the same step, so no
  barrier orders a write before a read, and the token's values are not live through the loop);
- it walks its chunk in blocks of 64 tokens through the page table: ``q @ K^T`` and ``P @ V`` on the tensor
  cores (P rounded to the model dtype, as in flashinfer's kernel), online softmax in float32, block loads
  pipelined by Triton (``num_stages``);
- chunks past a request's length return at once (the grid is fixed per captured graph: the longest
  sequence's chunk count), so every live program reads about the same bytes, whatever the mix of lengths;
- with several chunks each leaves its partial softmax state in a workspace, and the last of a (request,
  KV head) to finish merges them (split_decode.py's counter scheme): no second kernel.

The chunk size is chosen per captured batch size (``chunk_tokens``): shorter chunks where there are few
(request, KV head) pairs to spread over the SMs, longer ones where there are many and a chunk's fixed
cost (its q, its state, the merge) would show.
"""

from __future__ import annotations

import math
import os

import torch

from runtime.engine.attention.split_decode import LOG2E

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never reach the flashinfer backend
    triton = None

BLOCK_TOKENS = 64

if triton is not None:
    from runtime.engine.attention.split_decode import _merge_if_last

    @triton.jit
    def _attend_block(
        q, m, lsum, acc, pages, head, t0, end, plane_stride, scale, HKV: tl.constexpr, D: tl.constexpr,
        PAGE: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
    ):
        """One block of cached tokens [t0, t0 + BLOCK_N) below ``end`` folded into the running softmax state
        (q @ K^T and P @ V on the tensor cores, P rounded to the model dtype as flashinfer's kernel does)."""
        t = t0 + tl.arange(0, BLOCK_N)
        t_ok = t < end
        page = tl.load(pages + t // PAGE, mask=t_ok, other=0).to(tl.int64)
        slot = head + ((page * PAGE) + t % PAGE)[:, None] * (HKV * D)
        k = tl.load(slot, mask=t_ok[:, None], other=0.0)
        v = tl.load(slot + plane_stride, mask=t_ok[:, None], other=0.0)
        if INTERPRET:  # the interpreter's bf16 products are wrong: float32 operands, same rounding of P
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(t_ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        lsum = lsum * alpha + tl.sum(p, axis=1)
        if INTERPRET:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
        else:
            pv = tl.dot(p.to(v.dtype), v)
        return m_new, lsum, acc * alpha[:, None] + pv

    @triton.jit
    def _rotate(row, dims, other, sign, cos, sin, mask):
        """Neox RoPE of head rows at ``row`` (``[.., D]`` pointers; ``other``: the same rows' halves swapped),
        in float32: x * cos + sign * swap(x) * sin, i.e. (x1 cos - x2 sin, x2 cos + x1 sin), rope_store.py's."""
        x = tl.load(row + dims, mask=mask, other=0.0).to(tl.float32)
        x_swapped = tl.load(row + other, mask=mask, other=0.0).to(tl.float32)
        return x * cos + sign * x_swapped * sin

    @triton.jit
    def _chunk_attend(
        q_ptr, q_stride, kv_ptr, kv_stride, pos_ptr, row_ptr, loc_ptr, cos_sin_ptr, table_ptr, table_stride,
        cache_ptr, plane_stride, part_ptr, count_ptr, out_ptr, scale, HQ: tl.constexpr, HKV: tl.constexpr,
        GROUP: tl.constexpr, GROUP_P2: tl.constexpr, D: tl.constexpr, QROWS: tl.constexpr, PAGE: tl.constexpr,
        CHUNK: tl.constexpr, CHUNKS_P2: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        c = tl.program_id(2)
        pos = tl.load(pos_ptr + b)  # the step's token: pos cached tokens come before it
        start = c * CHUNK
        if start > pos:  # a chunk past this request's sequence: nothing to read or write (the merge skips it)
            return
        cached_end = tl.minimum(start + CHUNK, pos)  # this chunk's cached tokens (the step's own: from registers)
        pages = table_ptr + tl.load(row_ptr + b).to(tl.int64) * table_stride
        head = cache_ptr + h * D + tl.arange(0, D)[None, :]
        g = tl.arange(0, QROWS)
        g_ok = g < GROUP
        dims = tl.arange(0, D)
        HALF: tl.constexpr = D // 2
        first_half = dims < HALF
        swapped = tl.where(first_half, dims + HALF, dims - HALF)
        sign = tl.where(first_half, -1.0, 1.0)
        freq = tl.where(first_half, dims, dims - HALF)
        cos = tl.load(cos_sin_ptr + pos * D + freq)
        sin = tl.load(cos_sin_ptr + pos * D + HALF + freq)
        dtype = cache_ptr.dtype.element_ty
        # The query heads rotated and rounded to the model dtype, as the unfused path holds them.
        q_rows = q_ptr + b.to(tl.int64) * q_stride + (h * GROUP + g)[:, None] * D
        q = _rotate(q_rows, dims[None, :], swapped[None, :], sign, cos, sin, g_ok[:, None]).to(dtype)
        if start + CHUNK > pos:
            # The chunk that holds the step's token rotates its K, writes K and V to the token's slot, and starts
            # its softmax state with that token, from registers: no program reads a slot written in this step
            # (nothing to order), and nothing of the token stays live through the loop.
            k_row = kv_ptr + b.to(tl.int64) * kv_stride + h * D
            k_new = _rotate(k_row, dims, swapped, sign, cos, sin, dims < D).to(dtype)
            v_new = tl.load(k_row + HKV * D + dims)
            slot = cache_ptr + tl.load(loc_ptr + b).to(tl.int64) * (HKV * D) + h * D + dims
            tl.store(slot, k_new)
            tl.store(slot + plane_stride, v_new)
            m = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale
            lsum = tl.full((QROWS,), 1.0, tl.float32)  # its weight exp2(s - m) = 1, exact in any dtype
            acc = tl.zeros((QROWS, D), tl.float32) + v_new.to(tl.float32)[None, :]
        else:
            m = tl.full((QROWS,), float("-inf"), tl.float32)
            lsum = tl.zeros((QROWS,), tl.float32)
            acc = tl.zeros((QROWS, D), tl.float32)
        if INTERPRET:  # the interpreter cannot range over a runtime bound
            t0 = start
            while t0 < cached_end:
                m, lsum, acc = _attend_block(q, m, lsum, acc, pages, head, t0, cached_end, plane_stride, scale, HKV, D,
                                             PAGE, BLOCK_N, INTERPRET)
                t0 += BLOCK_N
        else:  # a for loop over a trip count known on the device: Triton pipelines its loads (num_stages)
            for i in range(0, tl.cdiv(cached_end - start, BLOCK_N)):
                m, lsum, acc = _attend_block(q, m, lsum, acc, pages, head, start + i * BLOCK_N, cached_end,
                                             plane_stride, scale, HKV, D, PAGE, BLOCK_N, INTERPRET)
        if CHUNKS_P2 == 1:
            out = out_ptr + b.to(tl.int64) * (HQ * D) + (h * GROUP + g)[:, None] * D + dims[None, :]
            tl.store(out, (acc / lsum[:, None]).to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
        else:
            # Workspace [requests, HKV, CHUNKS_P2, GROUP_P2, D + 2], split_decode's layout: the unnormalised
            # sum, the running max (log2 units), the sum.
            part = part_ptr + (((b * HKV + h) * CHUNKS_P2 + c) * GROUP_P2 + g).to(tl.int64) * (D + 2)
            tl.store(part[:, None] + dims[None, :], acc, mask=g_ok[:, None])
            tl.store(part + D, m, mask=g_ok)
            tl.store(part + D + 1, lsum, mask=g_ok)
            _merge_if_last(part_ptr, count_ptr, out_ptr, b, h, tl.cdiv(pos + 1, CHUNK), HQ, HKV, GROUP, GROUP_P2, D,
                           CHUNKS_P2)


def supports(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Triton is present, the head is a power of two of at least 16 (tl.arange, tl.dot), a GQA group fits
    one 16-row tile, and the model is in 16 bits (a float32 ``tl.dot`` would run in TF32)."""
    return (triton is not None and head_dim >= 16 and head_dim & (head_dim - 1) == 0
            and num_heads // num_kv_heads <= 16 and dtype in (torch.bfloat16, torch.float16))


# Limits for long sequence limits, where chunks grow past the rule below: the programs a captured graph
# launches (so that a graph of short requests is not a grid of mostly empty programs, and its workspace stays
# small), and the chunks of one sequence (the merge holds [chunks, group, head_dim] in one program; the
# benchmarks' 2,304-token limit needs at most 18).
MAX_PROGRAMS = 8192
MAX_CHUNKS = 32

# Warps and pipeline stages a program; None: the rule in launch_config (patchable for sweeps).
NUM_WARPS: int | None = None
NUM_STAGES: int | None = None


def launch_config(head_dim: int, chunk: int) -> tuple[int, int]:
    """(num_warps, num_stages) of a program. Heads of 64: 2 warps (more programs an SM: 1-19% faster than 4
    at 16-256 requests of 9/3 heads), and 5 stages for chunks of 1,024 tokens (Triton then double-buffers K
    and V: 68.5 against 70.3 us at 256 requests; fewer stages win at shorter chunks). Heads of 128: 4 warps,
    2 stages. Measured on one H200 with scripts/bench_attention.py's cache (benchmarks/HISTORY.md). The
    kernel never reads back the slot it writes, so the result does not depend on the warp count's timing
    (tests/test_gpu_kernels.py: 200 calls over re-poisoned slots give the same bits)."""
    if head_dim <= 64:
        warps, stages = 2, (5 if chunk >= 1024 else 2)
    else:
        warps, stages = 4, 2
    return NUM_WARPS or warps, NUM_STAGES or stages


def chunk_tokens(batch_size: int, kv_heads: int, max_len: int = 0) -> int:
    """Tokens per program: the (request, KV head) pair count rounded up to a power of two, within 128-1024,
    doubled while a grid over ``max_len`` tokens would exceed MAX_PROGRAMS or MAX_CHUNKS chunks a sequence.
    Measured at 9/3 heads x 64 (scripts/bench_attention.py, 200-1400 tokens): best at 64 requests 256, at
    128 requests 512, at 256 requests 1024 (and 1024 at 32/8 heads)."""
    chunk = max(128, min(1024, triton.next_power_of_2(batch_size * kv_heads)))
    while (batch_size * kv_heads * triton.cdiv(max_len, chunk) > MAX_PROGRAMS
           or triton.cdiv(max_len, chunk) > MAX_CHUNKS):
        chunk *= 2
    return chunk


def num_chunks(max_len: int, chunk: int) -> int:
    """The workspace's chunk axis, a power of two (the merge's tl.arange); the grid launches only
    ``cdiv(max_len, chunk)`` of them."""
    return triton.next_power_of_2(triton.cdiv(max_len, chunk))


def workspace_size(batch_size: int, kv_heads: int, group: int, head_dim: int, chunks: int) -> int:
    """Float32 elements of the chunks' partial states (none with one chunk)."""
    return batch_size * kv_heads * chunks * triton.next_power_of_2(group) * (head_dim + 2) if chunks > 1 else 0


def new_counters(batch_size: int, kv_heads: int, device: torch.device) -> torch.Tensor:
    """One finished-chunks counter per (request, KV head), zeroed; the merging chunk resets its counter, so
    the zeros hold from one call to the next (and across batch sizes sharing the tensor)."""
    return torch.zeros(batch_size * kv_heads, dtype=torch.int32, device=device)


def paged_decode(
    q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, out_loc: torch.Tensor,
    cos_sin: torch.Tensor, page_table: torch.Tensor, cache: torch.Tensor, workspace: torch.Tensor,
    counters: torch.Tensor, chunk: int, chunks: int,
) -> torch.Tensor:
    """Attention of one new token per request over its tokens ``[0, position]``; also rotates q and k (RoPE)
    and writes the new K and V to the cache slots ``out_loc``.

    ``q``: ``[B, heads, d]`` and ``kv``: ``[B, 2, kv_heads, d]`` before RoPE (rows may be strided, heads and
    dims dense; neither is modified); ``positions``, ``rows`` (page-table rows) and ``out_loc``: ``[B]``;
    ``cos_sin``: ``[positions, d]`` float32; ``cache``: this layer's ``[2, pages, page_size, kv_heads, d]``;
    ``workspace``: float32, at least ``workspace_size`` elements; ``counters``: from ``new_counters`` for at
    least this batch. Returns ``[B, heads * d]``.
    """
    batch, heads, dim = q.shape
    kv_heads = cache.shape[3]
    group = heads // kv_heads
    out = torch.empty(batch, heads * dim, dtype=q.dtype, device=q.device)
    grid_chunks = min(chunks, triton.cdiv(page_table.shape[1] * cache.shape[2], chunk))
    warps, stages = launch_config(dim, chunk)
    _chunk_attend[(batch, kv_heads, grid_chunks)](
        q, q.stride(0), kv, kv.stride(0), positions, rows, out_loc, cos_sin, page_table, page_table.stride(0), cache,
        cache.stride(0), workspace, counters, out, LOG2E / math.sqrt(dim),
        HQ=heads, HKV=kv_heads, GROUP=group, GROUP_P2=triton.next_power_of_2(group), D=dim,
        QROWS=max(16, triton.next_power_of_2(group)), PAGE=cache.shape[2], CHUNK=chunk, CHUNKS_P2=chunks,
        BLOCK_N=BLOCK_TOKENS, INTERPRET=os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=warps, num_stages=stages,
    )
    return out
