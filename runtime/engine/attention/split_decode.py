"""Decode attention for one-request CUDA graphs: RoPE, the KV write and split-KV attention in one Triton kernel.
Scores run on CUDA cores: a few query heads per KV head give a tensor core nothing to do."""

from __future__ import annotations

import math

import torch

from models.gemv import use_pdl
from runtime.engine.attention.kv_fp8 import is_fp8_cache

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never reach the flashinfer backend
    triton = None

LOG2E = 1.4426950408889634

if triton is not None:
    from runtime.engine.attention.kv_fp8 import load_scales, to_cache

    @triton.jit
    def _load_block(
        pages, head, t0, end, plane_stride, HKV: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        t = t0 + tl.arange(0, BLOCK_N)
        t_ok = t < end
        page = tl.load(pages + t // PAGE, mask=t_ok, other=0).to(tl.int64)
        tok = head + ((page * PAGE) + t % PAGE)[:, None] * (HKV * 2 * HALF)
        ok = t_ok[:, None]
        k1 = tl.load(tok, mask=ok, other=0.0)
        k2 = tl.load(tok + HALF, mask=ok, other=0.0)
        v1 = tl.load(tok + plane_stride, mask=ok, other=0.0)
        v2 = tl.load(tok + plane_stride + HALF, mask=ok, other=0.0)
        return t_ok, k1, k2, v1, v2

    @triton.jit
    def _share(pos, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
        return tl.cdiv(tl.cdiv(pos + 1, SPLITS), BLOCK_N) * BLOCK_N

    @triton.jit
    def _split_attend(
        q_ptr, q_stride, kv_ptr, kv_stride, pos_ptr, row_ptr, loc_ptr, cos_sin_ptr, table_ptr, table_stride,
        cache_ptr, plane_stride, kv_scale_ptr, part_ptr, count_ptr, out_ptr, scale,
        HQ: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HALF: tl.constexpr,
        PAGE: tl.constexpr, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr, PDL: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        D: tl.constexpr = 2 * HALF
        dims = tl.arange(0, HALF)
        g = tl.arange(0, GROUP_P2)
        g_ok = g < GROUP
        dtype = q_ptr.dtype.element_ty
        cache_ty = cache_ptr.dtype.element_ty
        # An FP8 cache holds K / k_scale and V / v_scale: k_scale goes into q's scale, v_scale onto the output.
        k_scale, v_scale = load_scales(kv_scale_ptr, KV_FP8)
        # Before gdc_wait, read only what no PDL kernel of this step writes (ARCHITECTURE.md, invariant 13).
        pos = tl.load(pos_ptr + b)
        share = _share(pos, SPLITS, BLOCK_N)
        start = s * share
        if start > pos:  # past the sequence; the merge skips it
            return
        end = tl.minimum(start + share, pos)
        pages = table_ptr + tl.load(row_ptr + b).to(tl.int64) * table_stride
        head = cache_ptr + h * D + dims[None, :]
        t_ok, ck1, ck2, cv1, cv2 = _load_block(pages, head, start, end, plane_stride, HKV, HALF, PAGE, BLOCK_N)
        cos = tl.load(cos_sin_ptr + pos * D + dims)
        sin = tl.load(cos_sin_ptr + pos * D + HALF + dims)
        if PDL:
            tl.extra.cuda.gdc_wait()  # q, k and v of this step are written from here on
            tl.extra.cuda.gdc_launch_dependents()

        q = q_ptr + b.to(tl.int64) * q_stride + (h * GROUP + g)[:, None] * D + dims[None, :]
        q1 = tl.load(q, mask=g_ok[:, None], other=0.0).to(tl.float32)
        q2 = tl.load(q + HALF, mask=g_ok[:, None], other=0.0).to(tl.float32)
        q1, q2 = (q1 * cos - q2 * sin).to(dtype).to(tl.float32), (q2 * cos + q1 * sin).to(dtype).to(tl.float32)
        q1 *= scale * k_scale
        q2 *= scale * k_scale
        k_new = kv_ptr + b.to(tl.int64) * kv_stride + h * D + dims
        k1 = tl.load(k_new).to(tl.float32)
        k2 = tl.load(k_new + HALF).to(tl.float32)
        # The new token as cached, so this step sees what later steps will read.
        k1, k2 = to_cache(k1 * cos - k2 * sin, k_scale, cache_ty, KV_FP8), to_cache(k2 * cos + k1 * sin, k_scale,
                                                                                  cache_ty, KV_FP8)
        v1 = to_cache(tl.load(k_new + HKV * D), v_scale, cache_ty, KV_FP8)
        v2 = to_cache(tl.load(k_new + HKV * D + HALF), v_scale, cache_ty, KV_FP8)
        if s == 0:
            slot = cache_ptr + tl.load(loc_ptr + b) * (HKV * D) + h * D + dims
            tl.store(slot, k1)
            tl.store(slot + HALF, k2)
            tl.store(slot + plane_stride, v1)
            tl.store(slot + plane_stride + HALF, v2)

        m = tl.full((GROUP_P2,), float("-inf"), tl.float32)
        lsum = tl.zeros((GROUP_P2,), tl.float32)
        acc1 = tl.zeros((GROUP_P2, HALF), tl.float32)
        acc2 = tl.zeros((GROUP_P2, HALF), tl.float32)
        t0 = start
        while t0 < end:  # Triton's interpreter cannot range over runtime bounds
            x = tl.sum(q1[:, None, :] * ck1.to(tl.float32)[None, :, :], axis=2)
            x += tl.sum(q2[:, None, :] * ck2.to(tl.float32)[None, :, :], axis=2)
            x = tl.where(t_ok[None, :], x, float("-inf"))
            m_new = tl.maximum(m, tl.max(x, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(x - m_new[:, None])
            lsum = lsum * alpha + tl.sum(p, axis=1)
            acc1 = acc1 * alpha[:, None] + tl.sum(p[:, :, None] * cv1.to(tl.float32)[None, :, :], axis=1)
            acc2 = acc2 * alpha[:, None] + tl.sum(p[:, :, None] * cv2.to(tl.float32)[None, :, :], axis=1)
            m = m_new
            t0 += BLOCK_N
            t_ok, ck1, ck2, cv1, cv2 = _load_block(pages, head, t0, end, plane_stride, HKV, HALF, PAGE, BLOCK_N)
        if pos < start + share:  # the new token, from registers
            x = tl.sum(q1 * k1.to(tl.float32)[None, :], axis=1) + tl.sum(q2 * k2.to(tl.float32)[None, :], axis=1)
            m_new = tl.maximum(m, x)
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(x - m_new)
            lsum = lsum * alpha + p
            acc1 = acc1 * alpha[:, None] + p[:, None] * v1.to(tl.float32)[None, :]
            acc2 = acc2 * alpha[:, None] + p[:, None] * v2.to(tl.float32)[None, :]
            m = m_new
        if KV_FP8:
            acc1 *= v_scale
            acc2 *= v_scale
        if SPLITS == 1:
            out = out_ptr + b.to(tl.int64) * (HQ * D) + (h * GROUP + g)[:, None] * D + dims[None, :]
            tl.store(out, (acc1 / lsum[:, None]).to(dtype), mask=g_ok[:, None])
            tl.store(out + HALF, (acc2 / lsum[:, None]).to(dtype), mask=g_ok[:, None])
        else:
            part = part_ptr + (((b * HKV + h) * SPLITS + s) * GROUP_P2 + g).to(tl.int64) * (D + 2)
            tl.store(part[:, None] + dims[None, :], acc1)
            tl.store(part[:, None] + HALF + dims[None, :], acc2)
            tl.store(part + D, m)
            tl.store(part + D + 1, lsum)
            _merge_if_last(part_ptr, count_ptr, out_ptr, b, h, tl.cdiv(pos + 1, share), HQ, HKV, GROUP, GROUP_P2,
                           D, SPLITS)

    @triton.jit
    def _merge(
        part_ptr, out_ptr, b, h, live_splits, HQ: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr,
        GROUP_P2: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
    ):
        """Merge the partial states, read through L2 (``.cg``): this SM's L1 may hold the previous layer's lines."""
        sp = tl.arange(0, SPLITS)[:, None]
        g = tl.arange(0, GROUP_P2)[None, :]
        live = sp < live_splits
        part = part_ptr + (((b * HKV + h) * SPLITS + sp) * GROUP_P2 + g).to(tl.int64) * (D + 2)
        m = tl.load(part + D, mask=live, other=float("-inf"), cache_modifier=".cg")
        lsum = tl.load(part + D + 1, mask=live, other=0.0, cache_modifier=".cg")
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
        part_ptr, count_ptr, out_ptr, b, h, live_splits, HQ: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr,
        GROUP_P2: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
    ):
        """The last live split to get here merges. The barrier orders all threads' stores before the release; the
        acquire and _merge's L2 reads make the other splits' stores visible."""
        tl.debug_barrier()
        count = count_ptr + b * HKV + h
        finished = tl.atomic_add(count, 1, sem="acq_rel")
        if finished == live_splits - 1:
            _merge(part_ptr, out_ptr, b, h, live_splits, HQ, HKV, GROUP, GROUP_P2, D, SPLITS)
            tl.atomic_xchg(count, 0)


def supports(head_dim: int) -> bool:
    return triton is not None and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def num_splits(batch_size: int, kv_heads: int, group: int, head_dim: int, max_len: int) -> int:
    """Splits per (request, KV head): one block per program, so all cached K and V is read before ``gdc_wait``."""
    want = min(triton.cdiv(max_len, block_tokens(group, head_dim)), 64, max(1, 4096 // (batch_size * kv_heads)))
    return min(64, triton.next_power_of_2(want))


def block_tokens(group: int, head_dim: int) -> int:
    """Tokens per loop step, bounding the [group, tokens, head_dim / 2] products' registers."""
    return max(8, min(64, 4096 // (triton.next_power_of_2(group) * head_dim // 2)))


def new_workspace(batch_size: int, kv_heads: int, group: int, head_dim: int, splits: int,
                  device: torch.device) -> torch.Tensor:
    """Partial softmax states, then zeroed counters that the merging split resets, so they stay zero."""
    states = batch_size * kv_heads * splits * triton.next_power_of_2(group) * (head_dim + 2)
    return torch.zeros(states + batch_size * kv_heads, dtype=torch.float32, device=device)


def split_decode(
    q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, out_loc: torch.Tensor,
    cos_sin: torch.Tensor, page_table: torch.Tensor, cache: torch.Tensor, workspace: torch.Tensor, splits: int,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per request, applying RoPE and writing its K and V to the cache;
    ``kv_scales``: the layer's (k_scale, v_scale), needed by an FP8 cache."""
    batch, heads, dim = q.shape
    kv_heads = kv.shape[2]
    group = heads // kv_heads
    out = torch.empty(batch, heads * dim, dtype=q.dtype, device=q.device)
    pdl = use_pdl(q.device.index or 0)
    block = block_tokens(group, dim)
    warps = 4 if group * dim <= 512 else 8
    counters = workspace[workspace.numel() - batch * kv_heads:].view(torch.int32)
    fp8 = is_fp8_cache(cache, kv_scales)
    _split_attend[(batch, kv_heads, splits)](
        q, q.stride(0), kv, kv.stride(0), positions, rows, out_loc, cos_sin, page_table, page_table.stride(0),
        cache, cache.stride(0), kv_scales if fp8 else workspace, workspace, counters, out, LOG2E / math.sqrt(dim),
        HQ=heads, HKV=kv_heads, GROUP=group, GROUP_P2=triton.next_power_of_2(group), HALF=dim // 2,
        PAGE=cache.shape[2], SPLITS=splits, BLOCK_N=block, KV_FP8=fp8, PDL=pdl, launch_pdl=pdl, num_warps=warps,
    )
    return out
