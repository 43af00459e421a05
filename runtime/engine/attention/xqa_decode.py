"""Decode over an FP8 KV cache on Hopper with TensorRT-LLM's XQA kernel, as flashinfer builds it.

XQA multiplies on FP8 tensor cores, so it reads e4m3 pages near the memory roofline, where paged_decode's
mixed-precision dots are bound by their instruction stream. The price: q and the softmax probabilities are
rounded to e4m3 too (benchmarks/README.md gives the error). paged_decode stays the exact kernel: one request,
small batches and engine.deterministic use it."""

from __future__ import annotations

import torch

# flashinfer's own split of an XQA workspace: the multi-block semaphores first (zeroed once, the kernel leaves
# them zero), the partial results after.
SEMAPHORE_BYTES = 8 << 20
PAGE_SIZES = (16, 32, 64, 128)


def unsupported_reason(
    device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
) -> str | None:
    """Why XQA cannot decode this model's FP8 cache here, or None when it can."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return "XQA's FP8 kernel needs a Hopper GPU (sm90)"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"XQA needs a 16-bit model.dtype, not {dtype}"
    if page_size not in PAGE_SIZES:
        return f"XQA needs cache.page_size in {PAGE_SIZES}, not {page_size}"
    if head_dim % 16 or not 16 <= head_dim <= 256:
        return f"XQA needs a head_dim that is a multiple of 16 up to 256, not {head_dim}"
    if num_heads % num_kv_heads:
        return f"XQA needs query heads in whole groups per KV head ({num_heads} and {num_kv_heads})"
    return None


class XqaDecode:
    """Per-batch inputs of the kernel (each request's page list and length, in batch order) and its workspace,
    sized for ``max_batch`` requests; one instance serves every layer, eager steps and every graph."""

    def __init__(self, page_table: torch.Tensor, max_batch: int, num_kv_heads: int, group: int, head_dim: int) -> None:
        import importlib

        from models.ops import import_flashinfer

        import_flashinfer()  # its message when flashinfer is missing
        self.xqa = importlib.import_module("flashinfer.xqa").xqa
        dev = page_table.device
        self.page_table = page_table
        self.num_kv_heads = num_kv_heads
        self.tables = torch.zeros(max_batch, page_table.shape[1], dtype=torch.int32, device=dev)
        self.lens = torch.zeros(max_batch, 1, dtype=torch.int32, device=dev)  # read as uint32
        # A partial result per (request, KV head, KV split): XQA splits a sequence at most ~3 CTAs an SM over all
        # of them, so the splits beyond one per pair are bounded by the SM count. Each holds a group's rows and
        # row statistics; twice that bound leaves room for the kernel's alignment.
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        splits = max_batch * num_kv_heads + 3 * sms
        self.workspace = torch.zeros(SEMAPHORE_BYTES + splits * group * (head_dim * 2 + 8) * 2, dtype=torch.uint8,
                                     device=dev)

    def prepare(self, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """This step's page lists and lengths (the new token included); device work, so graphs capture it."""
        batch = positions.shape[0]
        torch.index_select(self.page_table, 0, rows, out=self.tables[:batch])
        self.lens[:batch, 0].copy_(positions + 1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: float, v_scale: float) -> torch.Tensor:
        """``q``: dense ``[batch, heads, dim]``, rotated; ``k``/``v``: the layer's e4m3 pages
        ``[pages, page_size, kv_heads, dim]`` holding ``K / k_scale`` and ``V / v_scale``."""
        batch = q.shape[0]
        out = torch.empty_like(q)
        # XQA scales q by q_scale and both K and V by kv_scale: with kv_scale = v_scale, q_scale carries the ratio.
        self.xqa(
            q.unsqueeze(1), k, v, self.tables[:batch], self.lens[:batch], out.unsqueeze(1),
            self.workspace[SEMAPHORE_BYTES:], self.workspace[:SEMAPHORE_BYTES], self.num_kv_heads, k.shape[1],
            q_scale=k_scale / v_scale, kv_scale=v_scale, kv_layout="NHD", enable_pdl=False,
        )
        return out
