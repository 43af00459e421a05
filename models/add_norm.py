"""Residual add + RMSNorm in one Triton kernel with the torch path's numerics; flashinfer's is latency-bound."""

from __future__ import annotations

import functools

import torch

from models import fp8
from models.gemv import use_pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs keep the torch and flashinfer norms
    triton = None

if triton is not None:

    @triton.jit
    def _add_rms_norm(
        x_ptr, res_ptr, w_ptr, q_ptr, scale_ptr, rows, x_stride, res_stride, eps, H: tl.constexpr,
        BLOCK_H: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr, QUANTIZE: tl.constexpr,
        FP8_MAX: tl.constexpr, TINY: tl.constexpr,
    ):
        """With QUANTIZE the normed rows go to e4m3 values and scales (``q_ptr``, ``scale_ptr``), not to x."""
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        col = tl.arange(0, BLOCK_H)
        col_ok = col < H
        row_ok = row < rows
        ok = row_ok[:, None] & col_ok[None, :]
        x_at = x_ptr + row.to(tl.int64)[:, None] * x_stride + col[None, :]
        res_at = res_ptr + row.to(tl.int64)[:, None] * res_stride + col[None, :]
        if PDL:
            tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
            tl.extra.cuda.gdc_launch_dependents()
        dtype = x_ptr.dtype.element_ty
        w = tl.load(w_ptr + col, mask=col_ok, other=0.0)
        s = tl.load(x_at, mask=ok, other=0.0).to(tl.float32) + tl.load(res_at, mask=ok, other=0.0).to(tl.float32)
        s = s.to(dtype)
        tl.store(res_at, s, mask=ok)
        s = s.to(tl.float32)
        normed = s * tl.rsqrt(tl.sum(s * s, axis=1) / H + eps)[:, None]
        y = (normed.to(dtype).to(tl.float32) * w.to(tl.float32)[None, :]).to(dtype)
        if QUANTIZE:
            fp8.quantize_epilogue(y.to(tl.float32), row, row_ok, col, col_ok, q_ptr, scale_ptr, H, FP8_MAX, TINY)
        else:
            tl.store(x_at, y, mask=ok)


# Patchable so that benchmarks can compare this kernel with flashinfer's.
PREFERRED = True


@functools.cache
def launch_shape(rows: int, hidden: int) -> tuple[int, int, int]:
    """(rows a program, padded columns, warps); cached because eager steps call it every layer."""
    block = triton.next_power_of_2(hidden)
    return (1 if rows <= 1024 else 4), block, min(8, max(1, block // 256))


def _launch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
            quantized: fp8.QuantizedRows | None) -> None:
    rows, hidden = x.shape
    per_program, block, warps = launch_shape(rows, hidden)
    pdl = use_pdl(x.device.index or 0)
    q, scale = quantized[:2] if quantized is not None else (x, x)
    _add_rms_norm[(triton.cdiv(rows, per_program),)](
        x, residual, weight, q, scale, rows, x.stride(0), residual.stride(0), eps, H=hidden, BLOCK_H=block,
        ROWS=per_program, PDL=pdl, QUANTIZE=quantized is not None, FP8_MAX=fp8.FP8_MAX, TINY=fp8.TINY,
        launch_pdl=pdl, num_warps=warps,
    )


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place, as flashinfer's: ``residual <- x + residual``, ``x <- rmsnorm(residual) * weight``."""
    _launch(x, residual, weight, eps, None)
    return x, residual


def add_rms_norm_quantize(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[fp8.QuantizedRows, torch.Tensor]:
    """``residual <- x + residual`` in place, and ``rmsnorm(residual) * weight`` quantised per token to e4m3 (the
    next FP8 GEMM's input) with the numerics of ``add_rms_norm`` then ``fp8.quantize_rows``; x is left as it was."""
    rows, hidden = x.shape
    quantized = fp8.QuantizedRows(torch.empty(rows, hidden, dtype=fp8.FP8, device=x.device),
                                  torch.empty(rows, dtype=torch.float32, device=x.device), x.dtype)
    _launch(x, residual, weight, eps, quantized)
    return quantized, residual
