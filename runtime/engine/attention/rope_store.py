"""RoPE and the KV-cache write in one Triton kernel, saving a launch and a second read of K."""

from __future__ import annotations

import torch

from runtime.engine.kv_cache import KVCache

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never reach the flashinfer backend
    triton = None

if triton is not None:
    from runtime.engine.attention.kv_fp8 import load_scales, to_cache

    @triton.jit
    def _rotate(src, cos, sin, dst, dst1, mask, HALF: tl.constexpr, scale, FP8: tl.constexpr):
        x1 = tl.load(src, mask=mask).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask).to(tl.float32)
        ty = dst.dtype.element_ty
        tl.store(dst, to_cache(x1 * cos - x2 * sin, scale, ty, FP8), mask=mask)
        tl.store(dst1, to_cache(x2 * cos + x1 * sin, scale, ty, FP8), mask=mask)

    @triton.jit
    def _rope_store(
        q_ptr, q_stride, q_out_ptr, q_out_stride, kv_ptr, kv_stride, pos_ptr, cos_sin_ptr, loc_ptr, cache_ptr,
        plane_stride, scale_ptr, HQ: tl.constexpr, HKV: tl.constexpr, HQ_P2: tl.constexpr, HKV_P2: tl.constexpr, HALF: tl.constexpr,
        FP8: tl.constexpr,
    ):
        t = tl.program_id(0)
        dims = tl.arange(0, HALF)[None, :]
        pos = tl.load(pos_ptr + t)
        cos = tl.load(cos_sin_ptr + pos * (2 * HALF) + dims)
        sin = tl.load(cos_sin_ptr + pos * (2 * HALF) + HALF + dims)
        k_scale, v_scale = load_scales(scale_ptr, FP8)
        hq = tl.arange(0, HQ_P2)[:, None]
        q = q_ptr + t.to(tl.int64) * q_stride + hq * (2 * HALF) + dims
        q_out = q_out_ptr + t.to(tl.int64) * q_out_stride + hq * (2 * HALF) + dims
        _rotate(q, cos, sin, q_out, q_out + HALF, hq < HQ, HALF, 1.0, False)
        hk = tl.arange(0, HKV_P2)[:, None]
        k = kv_ptr + t.to(tl.int64) * kv_stride + hk * (2 * HALF) + dims
        v = k + HKV * 2 * HALF
        slot = cache_ptr + tl.load(loc_ptr + t) * (HKV * 2 * HALF) + hk * (2 * HALF) + dims
        _rotate(k, cos, sin, slot, slot + HALF, hk < HKV, HALF, k_scale, FP8)
        ty = cache_ptr.dtype.element_ty
        ok = hk < HKV
        tl.store(slot + plane_stride, to_cache(tl.load(v, mask=ok), v_scale, ty, FP8), mask=ok)
        tl.store(slot + plane_stride + HALF, to_cache(tl.load(v + HALF, mask=ok), v_scale, ty, FP8), mask=ok)


def rope_and_store(
    positions: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, cos_sin: torch.Tensor, kv_cache: KVCache,
    layer: int, out_loc: torch.Tensor, q_out: torch.Tensor | None = None,
) -> None:
    """Rotate ``q`` (into ``q_out`` if given, else in place) and K of ``kv``, and write K and V to ``out_loc``;
    heads and dims must be dense."""
    tokens, heads, dim = q.shape
    kv_heads = kv.shape[2]
    if triton is None:
        from models.ops import import_flashinfer

        import_flashinfer().rope.apply_rope_with_cos_sin_cache_inplace(
            positions, q.view(tokens, -1), kv[:, 0].view(tokens, -1), dim, cos_sin, is_neox=True
        )
        kv_cache.store(layer, out_loc, kv)
        if q_out is not None:
            q_out.copy_(q)
        return
    cache = kv_cache.buffer[layer]
    q_out = q if q_out is None else q_out
    _rope_store[(tokens,)](
        q, q.stride(0), q_out, q_out.stride(0), kv, kv.stride(0), positions, cos_sin, out_loc, cache, cache.stride(0),
        kv_cache.scales[layer],
        HQ=heads, HKV=kv_heads, HQ_P2=triton.next_power_of_2(heads), HKV_P2=triton.next_power_of_2(kv_heads),
        HALF=dim // 2, FP8=kv_cache.fp8, num_warps=4,
    )
