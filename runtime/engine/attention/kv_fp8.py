"""The KV cache's FP8 encoding inside the Triton kernels: ``K / k_scale`` (or V) saturated to e4m3, as
``kv_cache.quantize_kv`` does in torch; a bf16/fp16 cache stores the value as it is."""

from __future__ import annotations

import torch

from models import fp8

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never reach the Triton kernels
    triton = None

if triton is not None:

    @triton.jit
    def to_cache(x, scale, cache_ty: tl.constexpr, FP8: tl.constexpr):
        """``x`` (any float) as the cache stores it."""
        if FP8:
            x = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -448.0, 448.0)
            if fp8.INTERPRET:
                x = fp8.on_e4m3_grid(x)
        return x.to(cache_ty)

    @triton.jit
    def load_scales(scale_ptr, FP8: tl.constexpr):
        """This layer's (k_scale, v_scale); 1.0 for a bf16/fp16 cache."""
        if FP8:
            return tl.load(scale_ptr), tl.load(scale_ptr + 1)
        return 1.0, 1.0

    @triton.jit
    def _widen_pages(cache_ptr, pages_ptr, out_ptr, cache_pages, staged_pages, PAGE: tl.constexpr,
                     BLOCK: tl.constexpr):
        """One staged page of K or V (program axis 1): gathered from the cache and widened, in one pass."""
        i = tl.program_id(0)
        plane = tl.program_id(1).to(tl.int64)
        page = tl.load(pages_ptr + i).to(tl.int64)
        src = cache_ptr + (plane * cache_pages + page) * PAGE
        dst = out_ptr + (plane * staged_pages + i) * PAGE
        for start in range(0, PAGE, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ok = offs < PAGE
            tl.store(dst + offs, tl.load(src + offs, mask=ok).to(out_ptr.dtype.element_ty), mask=ok)


def is_fp8_cache(cache: torch.Tensor, kv_scales: torch.Tensor | None) -> bool:
    """Whether a decode kernel reads ``cache`` as e4m3, which needs the layer's (k_scale, v_scale)."""
    stored_fp8 = cache.dtype == torch.float8_e4m3fn
    if stored_fp8 and kv_scales is None:
        raise ValueError("an FP8 KV cache needs its layer's kv_scales")
    return stored_fp8


def widen_pages(cache: torch.Tensor, pages: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``cache[:, pages].to(dtype)`` (a layer's [2, pages, page_size, heads, dim]) in one kernel on CUDA: the
    e4m3 values exactly, which prefill's bf16 attention kernel reads with the layer's scales."""
    if triton is None or not cache.is_cuda or not cache.is_contiguous():
        return cache[:, pages].to(dtype)
    out = torch.empty(2, pages.numel(), *cache.shape[2:], dtype=dtype, device=cache.device)
    page = cache[0, 0].numel()
    if pages.numel():
        _widen_pages[(pages.numel(), 2)](cache, pages, out, cache.shape[1], pages.numel(), PAGE=page,
                                         BLOCK=min(4096, triton.next_power_of_2(page)), num_warps=4)
    return out
