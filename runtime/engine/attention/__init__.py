"""Attention backends behind one interface. ``forward`` applies RoPE, writes the step's K/V to the paged cache and
attends; graph-capable backends call ``prepare_graph`` before the capture and before every replay."""

from __future__ import annotations

from typing import Protocol

import torch

from runtime.batch import Batch
from runtime.engine.kv_cache import KVCache


class AttentionBackend(Protocol):
    supports_graphs: bool

    def prepare(self, batch: Batch) -> None: ...
    def forward(self, q: torch.Tensor, kv: torch.Tensor, layer_id: int, cos_sin: torch.Tensor) -> torch.Tensor: ...
    def init_graph(self, bs: int, max_pages_per_req: int) -> None: ...
    def prepare_graph(self, batch: Batch) -> None: ...


def make_attention_backend(
    name: str, kv_cache: KVCache, page_table: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, deterministic: bool = False,
) -> AttentionBackend:
    """``engine.attention_backend``: ``auto`` is flashinfer on CUDA and the torch reference elsewhere."""
    on_gpu = page_table.device.type == "cuda"
    if name == "auto":
        from models.ops import flashinfer_installed

        name = "flashinfer" if on_gpu and flashinfer_installed() else "torch"
    if name == "flashinfer":
        if not on_gpu:
            raise ValueError("engine.attention_backend=flashinfer needs a CUDA device")
        from runtime.engine.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(kv_cache, page_table, num_heads, num_kv_heads, head_dim, dtype, deterministic)
    from runtime.engine.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(kv_cache, page_table, head_dim, deterministic)
