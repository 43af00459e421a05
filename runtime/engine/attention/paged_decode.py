"""Decode attention for CUDA graphs, one request or many: RoPE, the KV write and split-KV attention in one Triton
kernel, with no host plan. The last chunk of a (request, KV head) to finish merges the chunks' partial states."""

from __future__ import annotations

import math
import os

import torch

from models.gemv import use_pdl
from runtime.engine.attention.kv_fp8 import is_fp8_cache

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never reach the flashinfer backend
    triton = None

LOG2E = 1.4426950408889634
BLOCK_TOKENS = 64
# An e4m3 tile of 128 tokens holds the bytes of a 64-token bf16 one: with 64 the FP8 kernel kept too few bytes in
# flight (scripts/bench_attention.py --fp8).
FP8_BLOCK_TOKENS = 128
# Triton picks interpreted or compiled when a kernel is defined (at import); read once here too, not per launch.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

if triton is not None:
    from runtime.engine.attention.kv_fp8 import load_scales, to_cache

    @triton.jit
    def _attend_block(
        q, m, lsum, acc, pages, head, t0, end, plane_stride, scale, HKV: tl.constexpr, D: tl.constexpr,
        PAGE: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
    ):
        """Fold cached tokens [t0, t0 + BLOCK_N) into the softmax state (P rounded as flashinfer's kernel does).
        An FP8 cache's values widen exactly to q's dtype (fp16); their scales are in ``scale`` and the output."""
        t = t0 + tl.arange(0, BLOCK_N)
        t_ok = t < end
        page = tl.load(pages + t // PAGE, mask=t_ok, other=0).to(tl.int64)
        slot = head + ((page * PAGE) + t % PAGE)[:, None] * (HKV * D)
        k = tl.load(slot, mask=t_ok[:, None], other=0.0).to(q.dtype)
        v = tl.load(slot + plane_stride, mask=t_ok[:, None], other=0.0).to(q.dtype)
        if INTERPRET:  # the interpreter's bf16 products are wrong
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
    def _merge(
        part_ptr, out_ptr, b, h, live_chunks, HQ: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr,
        GROUP_P2: tl.constexpr, D: tl.constexpr, CHUNKS: tl.constexpr,
    ):
        """Merge the partial states, read through L2 (``.cg``): this SM's L1 may hold the previous layer's lines.
        Rows past the group (GROUP < GROUP_P2) were never written: they read as a state that merges to 0."""
        ch = tl.arange(0, CHUNKS)[:, None]
        g = tl.arange(0, GROUP_P2)[None, :]
        g_ok = g < GROUP
        live = (ch < live_chunks) & g_ok
        part = part_ptr + (((b * HKV + h) * CHUNKS + ch) * GROUP_P2 + g).to(tl.int64) * (D + 2)
        m = tl.where(g_ok, tl.load(part + D, mask=live, other=float("-inf"), cache_modifier=".cg"), 0.0)
        lsum = tl.where(g_ok, tl.load(part + D + 1, mask=live, other=0.0, cache_modifier=".cg"), 1.0)
        m_all = tl.max(m, axis=0)
        w = tl.exp2(m - m_all[None, :])
        denom = tl.sum(w * lsum, axis=0)
        dims = tl.arange(0, D)[None, None, :]
        acc = tl.load(part[:, :, None] + dims, mask=live[:, :, None], other=0.0, cache_modifier=".cg")
        o = tl.sum(w[:, :, None] * acc, axis=0) / denom[:, None]
        gg = tl.arange(0, GROUP_P2)[:, None]
        out = out_ptr + b.to(tl.int64) * (HQ * D) + (h * GROUP + gg) * D + tl.arange(0, D)[None, :]
        tl.store(out, o.to(out_ptr.dtype.element_ty), mask=gg < GROUP)

    @triton.jit
    def _merge_if_last(
        part_ptr, count_ptr, out_ptr, b, h, live_chunks, HQ: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr,
        GROUP_P2: tl.constexpr, D: tl.constexpr, CHUNKS: tl.constexpr,
    ):
        """The last live chunk to get here merges. The barrier orders all threads' stores before the release; the
        acquire and _merge's L2 reads make the other chunks' stores visible."""
        tl.debug_barrier()
        count = count_ptr + b * HKV + h
        finished = tl.atomic_add(count, 1, sem="acq_rel")
        if finished == live_chunks - 1:
            _merge(part_ptr, out_ptr, b, h, live_chunks, HQ, HKV, GROUP, GROUP_P2, D, CHUNKS)
            tl.atomic_xchg(count, 0)

    @triton.jit
    def _rotate(row, dims, other, sign, cos, sin, mask):
        x = tl.load(row + dims, mask=mask, other=0.0).to(tl.float32)
        x_swapped = tl.load(row + other, mask=mask, other=0.0).to(tl.float32)
        return x * cos + sign * x_swapped * sin

    @triton.jit
    def _chunk_attend(
        q_ptr, q_stride, kv_ptr, kv_stride, pos_ptr, row_ptr, loc_ptr, cos_sin_ptr, table_ptr, table_stride,
        cache_ptr, plane_stride, kv_scale_ptr, part_ptr, count_ptr, out_ptr, scale, HQ: tl.constexpr,
        HKV: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, D: tl.constexpr, QROWS: tl.constexpr,
        PAGE: tl.constexpr, CHUNK: tl.constexpr, CHUNKS_P2: tl.constexpr, BLOCK_N: tl.constexpr,
        KV_FP8: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        c = tl.program_id(2)
        pos = tl.load(pos_ptr + b)
        # This sequence's own length split over the chunks (CHUNK tokens at least), whatever the limit.
        span = tl.maximum(CHUNK, tl.cdiv(tl.cdiv(pos + 1, CHUNKS_P2), BLOCK_N) * BLOCK_N)
        start = c * span
        if start > pos:  # the merge skips it
            return
        cached_end = tl.minimum(start + span, pos)
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
        # Before gdc_wait, read only what no kernel of this step writes (ARCHITECTURE.md, invariant 13): positions,
        # req_rows, cos/sin.
        if PDL:
            tl.extra.cuda.gdc_wait()  # q, k and v of this step are written from here on
            tl.extra.cuda.gdc_launch_dependents()
        dtype = q_ptr.dtype.element_ty
        if KV_FP8 and dtype == tl.bfloat16:
            # e4m3 widens to fp16 in one instruction (to bf16 only through float32): the products run in fp16.
            dtype = tl.float16
        cache_ty = cache_ptr.dtype.element_ty
        k_scale, v_scale = load_scales(kv_scale_ptr, KV_FP8)
        scale = scale * k_scale
        q_rows = q_ptr + b.to(tl.int64) * q_stride + (h * GROUP + g)[:, None] * D
        q = _rotate(q_rows, dims[None, :], swapped[None, :], sign, cos, sin, g_ok[:, None]).to(dtype)
        if start + span > pos:
            # Seeding the state from registers means no program reads a slot written in this step: nothing to order.
            # The seed is the value as cached, so this step sees what later steps will read.
            k_row = kv_ptr + b.to(tl.int64) * kv_stride + h * D
            k_new = to_cache(_rotate(k_row, dims, swapped, sign, cos, sin, dims < D), k_scale, cache_ty, KV_FP8)
            v_new = to_cache(tl.load(k_row + HKV * D + dims), v_scale, cache_ty, KV_FP8)
            slot = cache_ptr + tl.load(loc_ptr + b).to(tl.int64) * (HKV * D) + h * D + dims
            tl.store(slot, k_new)
            tl.store(slot + plane_stride, v_new)
            m = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale
            lsum = tl.full((QROWS,), 1.0, tl.float32)
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
        else:  # a for loop lets Triton pipeline the loads
            for i in range(0, tl.cdiv(cached_end - start, BLOCK_N)):
                m, lsum, acc = _attend_block(q, m, lsum, acc, pages, head, start + i * BLOCK_N, cached_end,
                                             plane_stride, scale, HKV, D, PAGE, BLOCK_N, INTERPRET)
        if KV_FP8:
            acc *= v_scale
        if CHUNKS_P2 == 1:
            out = out_ptr + b.to(tl.int64) * (HQ * D) + (h * GROUP + g)[:, None] * D + dims[None, :]
            tl.store(out, (acc / lsum[:, None]).to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
        else:
            part = part_ptr + (((b * HKV + h) * CHUNKS_P2 + c) * GROUP_P2 + g).to(tl.int64) * (D + 2)
            tl.store(part[:, None] + dims[None, :], acc, mask=g_ok[:, None])
            tl.store(part + D, m, mask=g_ok)
            tl.store(part + D + 1, lsum, mask=g_ok)
            _merge_if_last(part_ptr, count_ptr, out_ptr, b, h, tl.cdiv(pos + 1, span), HQ, HKV, GROUP, GROUP_P2, D,
                           CHUNKS_P2)


def supports(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Power-of-two heads >= 16, GQA groups within one 16-row tile, 16-bit models (float32 ``tl.dot`` is TF32)."""
    return (triton is not None and head_dim >= 16 and head_dim & (head_dim - 1) == 0
            and num_heads // num_kv_heads <= 16 and dtype in (torch.bfloat16, torch.float16))


# Caps on a sequence's chunk count (the merge holds [chunks, group, head_dim] in one program); past them a long
# sequence gets longer chunks.
MAX_PROGRAMS = 8192
MAX_CHUNKS = 32

# Patchable for sweeps; None: launch_config's rule.
NUM_WARPS: int | None = None
NUM_STAGES: int | None = None


def launch_config(head_dim: int, chunk: int, fp8: bool = False) -> tuple[int, int]:
    """(num_warps, num_stages), tuned with scripts/bench_attention.py [--fp8]."""
    if head_dim <= 64:
        # Two warps would each hold half of a 128-token e4m3 tile widened to fp16: too many registers a thread.
        warps, stages = (4 if fp8 else 2), (5 if chunk >= 1024 else 2)
    else:
        warps, stages = 4, 2
    return NUM_WARPS or warps, NUM_STAGES or stages


def chunk_tokens(batch_size: int, kv_heads: int) -> int:
    """The fewest tokens a program takes: short chunks when few (request, KV head) pairs must fill the SMs."""
    return max(128, min(1024, triton.next_power_of_2(batch_size * kv_heads)))


def num_chunks(max_len: int, chunk: int, pairs: int = 1) -> int:
    """Chunks a sequence, a power of two for the merge: enough for ``max_len`` at ``chunk`` tokens, within
    MAX_CHUNKS and MAX_PROGRAMS over ``pairs`` (request, KV head) pairs. The kernel splits each sequence's own
    length over them, so a short one in a long limit still spreads over the SMs."""
    cap = min(MAX_CHUNKS, 1 << (max(1, MAX_PROGRAMS // pairs).bit_length() - 1))
    return min(triton.next_power_of_2(triton.cdiv(max_len, chunk)), cap)


def workspace_size(batch_size: int, kv_heads: int, group: int, head_dim: int, chunks: int) -> int:
    return batch_size * kv_heads * chunks * triton.next_power_of_2(group) * (head_dim + 2) if chunks > 1 else 0


def new_counters(batch_size: int, kv_heads: int, device: torch.device) -> torch.Tensor:
    """Zeroed finished-chunk counters; the merging chunk resets its own, so they stay zero between calls."""
    return torch.zeros(batch_size * kv_heads, dtype=torch.int32, device=device)


def paged_decode(
    q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, out_loc: torch.Tensor,
    cos_sin: torch.Tensor, page_table: torch.Tensor, cache: torch.Tensor, workspace: torch.Tensor,
    counters: torch.Tensor, chunk: int, chunks: int, kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per request, applying RoPE and writing its K and V to ``out_loc``;
    ``kv_scales``: the layer's (k_scale, v_scale), needed by an FP8 cache."""
    batch, heads, dim = q.shape
    kv_heads = cache.shape[3]
    group = heads // kv_heads
    out = torch.empty(batch, heads * dim, dtype=q.dtype, device=q.device)
    grid_chunks = min(chunks, triton.cdiv(page_table.shape[1] * cache.shape[2], chunk))
    fp8 = is_fp8_cache(cache, kv_scales)
    warps, stages = launch_config(dim, chunk, fp8)
    pdl = use_pdl(q.device.index or 0)
    _chunk_attend[(batch, kv_heads, grid_chunks)](
        q, q.stride(0), kv, kv.stride(0), positions, rows, out_loc, cos_sin, page_table, page_table.stride(0), cache,
        cache.stride(0), kv_scales if fp8 else workspace, workspace, counters, out,
        LOG2E / math.sqrt(dim),
        HQ=heads, HKV=kv_heads, GROUP=group, GROUP_P2=triton.next_power_of_2(group), D=dim,
        QROWS=max(16, triton.next_power_of_2(group)), PAGE=cache.shape[2], CHUNK=chunk, CHUNKS_P2=chunks,
        BLOCK_N=FP8_BLOCK_TOKENS if fp8 else BLOCK_TOKENS, KV_FP8=fp8,
        INTERPRET=INTERPRET, PDL=pdl,
        launch_pdl=pdl, num_warps=warps, num_stages=stages,
    )
    return out
