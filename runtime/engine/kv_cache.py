"""Paged KV cache on the device. Page 0 is the dummy page for padding, so every index the kernels read is valid."""

from __future__ import annotations

import torch

from models.fp8 import FP8, FP8_MAX


def page_bytes(num_layers: int, num_kv_heads_local: int, head_dim: int, page_size: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * num_kv_heads_local * head_dim * page_size * dtype.itemsize


def compute_num_pages(free_before_load: int, model_bytes: int, memory_ratio: float, bytes_per_page: int) -> int:
    """The KV budget (ARCHITECTURE.md, invariant 8): ``memory_ratio`` of the free memory before loading, less the model."""
    available = int(memory_ratio * free_before_load) - model_bytes
    return max(available // bytes_per_page, 0)


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 of ``x / scale`` (one scale for K or V of a layer), saturated: what every kernel writes."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


class KVCache:
    """One tensor ``[layers, 2, pages, page_size, kv_heads, head_dim]`` (flashinfer's NHD layout per layer).

    In FP8 (``dtype`` e4m3) each layer's K and V carry one float32 scale each, ``scales[layer] = (k, v)``:
    the cache holds ``K / k_scale``; readers fold the scales into the softmax scale and the output."""

    def __init__(
        self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        self.fp8 = dtype == FP8
        self.buffer = torch.zeros(num_layers, 2, num_pages, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.scales = torch.ones(num_layers, 2, dtype=torch.float32, device=device)

    def k(self, layer: int) -> torch.Tensor:
        return self.buffer[layer, 0]

    def v(self, layer: int) -> torch.Tensor:
        return self.buffer[layer, 1]

    def store(self, layer: int, out_loc: torch.Tensor, kv: torch.Tensor) -> None:
        """Write this step's K and V at flat slot indices in one indexed copy."""
        heads, dim = kv.shape[-2:]
        kv = kv.transpose(0, 1)
        if self.fp8:
            kv = quantize_kv(kv, self.scales[layer].view(2, 1, 1, 1))
        self.buffer[layer].view(2, -1, heads, dim)[:, out_loc] = kv

    def read(self, layer: int, plane: int, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """K (plane 0) or V (plane 1) at flat slot indices, ``[*slots.shape, heads, dim]``, in ``dtype``."""
        heads, dim = self.buffer.shape[-2:]
        values = self.buffer[layer, plane].view(-1, heads, dim)[slots]
        if not self.fp8:
            return values
        return (values.float() * self.scales[layer, plane]).to(dtype)
