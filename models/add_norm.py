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
        BLOCK_H: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr, QUANT: tl.constexpr,
        FP8_MAX: tl.constexpr, TINY: tl.constexpr,
    ):
        """``QUANT``: the normed rows go to ``q_ptr`` in e4m3 with a scale per row (``fp8.quantize_rows`` of what
        would be stored in x, bit for bit) instead of to x."""
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        col = tl.arange(0, BLOCK_H)
        col_ok = col < H
        ok = (row < rows)[:, None] & col_ok[None, :]
        row = row.to(tl.int64)[:, None]
        x_at = x_ptr + row * x_stride + col[None, :]
        res_at = res_ptr + row * res_stride + col[None, :]
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
        if QUANT:
            y = tl.where(ok, y.to(tl.float32), 0.0)
            scale = fp8.row_scale(tl.max(tl.abs(y), axis=1), FP8_MAX, TINY)
            tl.store(scale_ptr + row, scale[:, None], mask=(row < rows))
            tl.store(q_ptr + row * H + col[None, :], fp8.to_e4m3(y, scale[:, None], FP8_MAX), mask=ok)
        else:
            tl.store(x_at, y, mask=ok)


# Patchable so that benchmarks can compare this kernel with flashinfer's.
PREFERRED = True


@functools.cache
def launch_shape(rows: int, hidden: int) -> tuple[int, int, int]:
    """(rows a program, padded columns, warps); cached because eager steps call it every layer."""
    block = triton.next_power_of_2(hidden)
    return (1 if rows <= 1024 else 4), block, min(8, max(1, block // 256))


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place, as flashinfer's: ``residual <- x + residual``, ``x <- rmsnorm(residual) * weight``."""
    _launch(x, residual, weight, eps, None)
    return x, residual


def add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[fp8.Fp8Rows, torch.Tensor]:
    """``add_rms_norm`` whose normed rows come quantised for an FP8 GEMM (x is left as it was)."""
    rows, hidden = x.shape
    out = fp8.Fp8Rows(torch.empty(rows, hidden, dtype=fp8.FP8, device=x.device),
                      torch.empty(rows, dtype=torch.float32, device=x.device), x.dtype)
    _launch(x, residual, weight, eps, out)
    return out, residual


def _launch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
            quantized: fp8.Fp8Rows | None) -> None:
    rows, hidden = x.shape
    per_program, block, warps = launch_shape(rows, hidden)
    pdl = use_pdl(x.device.index or 0)
    q, scale = (x, x) if quantized is None else quantized[:2]  # unread unless QUANT
    _add_rms_norm[(triton.cdiv(rows, per_program),)](
        x, residual, weight, q, scale, rows, x.stride(0), residual.stride(0), eps, H=hidden, BLOCK_H=block,
        ROWS=per_program, PDL=pdl, QUANT=quantized is not None, FP8_MAX=fp8.FP8_MAX, TINY=fp8.TINY,
        launch_pdl=pdl, num_warps=warps,
    )
