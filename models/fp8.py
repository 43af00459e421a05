"""FP8 (e4m3) linear layers: weights stored with a float32 scale per output row, activations quantised per
token at run time; on CUDA one scaled FP8 GEMM (``torch._scaled_mm``, row-wise scales), on CPU the same
arithmetic emulated in float32 so every path is testable without a GPU."""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs quantise with torch
    triton = None

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
# Hopper's FP8 tensor cores keep a narrower accumulator unless the GEMM promotes it to float32 as it goes;
# skipping that adds an error an order of magnitude below e4m3's own rounding of the operands, and saves time.
FAST_ACCUM = True
# At decode batch sizes cuBLASLt's per-tensor-scaled FP8 GEMM is much faster than the row-wise kernel: it runs
# with unit scales into float32, and one small kernel applies the token and channel scales. That kernel's
# traffic grows with the product, the GEMM's gain does not: it pays below this many float32 outputs.
SCALES_AFTER_MAX_OUTPUTS = 1 << 21
TINY = 1e-12  # an all-zero row keeps a finite scale


class QuantizedRows(NamedTuple):
    """Activations already quantised per token by the kernel that made them (a norm, SiLU x mul), which saves
    the GEMM a pass over them in the model dtype."""

    values: torch.Tensor  # [tokens, k], e4m3
    scale: torch.Tensor  # [tokens], float32
    dtype: torch.dtype  # the model dtype the GEMM returns


if triton is not None:
    # Triton's interpreter rounds float32 -> e4m3 wrongly (no carry into the exponent, ties away from zero),
    # so under it the value is first rounded on e4m3's grid in float32 arithmetic; the GPU converts in hardware.
    INTERPRET: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")

    @triton.jit
    def on_e4m3_grid(x):
        """``x`` (float32, |x| <= 448) rounded to the nearest e4m3 value, ties to even, still in float32."""
        exponent = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # subnormals: 2^-9 steps
        step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
        steps = tl.abs(x) / step  # exact: a power of two
        steps = (steps + 8388608.0) - 8388608.0  # round to nearest even at 2^23
        return tl.where(x < 0, -steps, steps) * step

    @triton.jit
    def to_e4m3(q, FP8_MAX: tl.constexpr):
        """Scaled values (|q| at most a rounding above FP8_MAX) ready for the e4m3 store. The GPU's conversion
        saturates, so only the interpreter needs the clamp and the rounding on e4m3's grid."""
        if INTERPRET:
            q = on_e4m3_grid(tl.clamp(q, -FP8_MAX, FP8_MAX))
        return q

    @triton.jit
    def _quantize_rows(
        x_ptr, x_stride, amax_ptr, out_ptr, scale_ptr, N: tl.constexpr, FP8_MAX: tl.constexpr, TINY: tl.constexpr,
        HAS_AMAX: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """One row: its amax (unless given), then the e4m3 values; the same arithmetic as ``quantize_rows``."""
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * x_stride
        cols = tl.arange(0, BLOCK)
        if HAS_AMAX:
            amax = tl.load(amax_ptr + row).to(tl.float32)
        else:
            peak = tl.zeros((BLOCK,), tl.float32)
            for k0 in range(0, N, BLOCK):
                x = tl.load(x_row + k0 + cols, mask=k0 + cols < N, other=0.0).to(tl.float32)
                peak = tl.maximum(peak, tl.abs(x))
            amax = tl.max(peak, axis=0)
        scale = tl.math.div_rn(tl.maximum(amax, TINY), FP8_MAX)  # correctly rounded, as torch divides
        tl.store(scale_ptr + row, scale)
        inverse = tl.math.div_rn(1.0, scale)
        for k0 in range(0, N, BLOCK):
            ok = k0 + cols < N
            x = tl.load(x_row + k0 + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + row * N + k0 + cols, to_e4m3(x * inverse, FP8_MAX).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def quantize_epilogue(y, rows, row_ok, cols, col_ok, out_ptr, scale_ptr, N: tl.constexpr,
                          FP8_MAX: tl.constexpr, TINY: tl.constexpr):
        """Whole rows ``y`` ([R, BLOCK] float32, already rounded to the model dtype) to e4m3 values and a scale
        per row: ``quantize_rows``' arithmetic, for kernels that make activations and quantise them in one pass."""
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(y), axis=1), TINY), FP8_MAX)
        tl.store(scale_ptr + rows, scale, mask=row_ok)
        q = to_e4m3(y * tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)[:, None], FP8_MAX)
        ok = row_ok[:, None] & col_ok[None, :]
        tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], q.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _apply_scales(acc_ptr, row_scale_ptr, col_scale_ptr, bias_ptr, out_ptr, N: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        """``out = acc * row_scale[:, None] * col_scale[None, :] (+ bias)``: the row-wise GEMM's epilogue."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < N
        y = tl.load(acc_ptr + row * N + cols, mask=ok, other=0.0) * tl.load(row_scale_ptr + row)
        y *= tl.load(col_scale_ptr + cols, mask=ok, other=0.0)
        if HAS_BIAS:
            y += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * N + cols, y.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_mul_quantize(
        x_ptr, out_ptr, scale_ptr, N: tl.constexpr, FP8_MAX: tl.constexpr, TINY: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """One row of ``[gate, up]``, whole in registers: ``silu(gate) * up`` rounded to the model dtype, as the
        unfused kernel rounds it, then its e4m3 values and scale."""
        rows = tl.program_id(0) + tl.arange(0, 1)
        cols = tl.arange(0, BLOCK)
        col_ok = cols < N
        ok = col_ok[None, :]
        at = x_ptr + rows[:, None].to(tl.int64) * 2 * N + cols[None, :]
        gate = tl.load(at, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(at + N, mask=ok, other=0.0).to(tl.float32)
        y = (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
        quantize_epilogue(y, rows, rows >= 0, cols, col_ok, out_ptr, scale_ptr, N, FP8_MAX, TINY)

# The widest SiLU x mul row the fused kernel holds in registers (32 values a thread at 32 warps).
SILU_QUANTIZE_MAX = 32768


def quantize_rows(x: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and a float32 scale per row, ``x ~= values * scale[:, None]``; ``amax`` (per row) if the
    scale must come from more than ``x`` holds (a rank's slice of a longer row). On CUDA one Triton kernel."""
    if x.is_cuda and triton is not None and x.dim() == 2 and x.stride(1) == 1:
        rows, n = x.shape
        values = torch.empty(rows, n, dtype=FP8, device=x.device)
        scale = torch.empty(rows, dtype=torch.float32, device=x.device)
        block = min(triton.next_power_of_2(n), 4096)
        _quantize_rows[(rows,)](x, x.stride(0), amax if amax is not None else scale, values, scale, N=n,
                                FP8_MAX=FP8_MAX, TINY=TINY, HAS_AMAX=amax is not None, BLOCK=block,
                                num_warps=4 if block <= 2048 else 8)
        return values, scale
    if amax is None:
        amax = x.abs().amax(dim=-1)
    scale = amax.float().clamp(min=TINY) / FP8_MAX
    # Times the reciprocal, as the kernels do: a multiply costs them far fewer instructions than a division.
    values = (x.float() * (1.0 / scale)[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values, scale


def quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked expert weights ([experts, rows, columns]) in e4m3 with a float32 scale per row ([experts, rows]),
    as models/moe.py stores them."""
    values, scale = quantize_rows(w.reshape(-1, w.shape[-1]))
    return values.view(w.shape), scale.view(w.shape[:2])


def dequantize_rows(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return values.float() * scale[:, None]


def silu_mul_quantize(x: torch.Tensor) -> QuantizedRows:
    """``silu(gate) * up`` of ``x = [gate, up]`` ([tokens, 2n]), quantised per token: on CUDA (and under Triton's
    interpreter, for tests) one kernel; else the unfused arithmetic."""
    n = x.shape[-1] // 2
    if triton is not None and (x.is_cuda or INTERPRET) and x.is_contiguous() and n <= SILU_QUANTIZE_MAX:
        rows = x.shape[0]
        values = torch.empty(rows, n, dtype=FP8, device=x.device)
        scale = torch.empty(rows, dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(n)
        _silu_mul_quantize[(rows,)](x, values, scale, N=n, FP8_MAX=FP8_MAX, TINY=TINY, BLOCK=block,
                                    num_warps=min(32, max(4, block // 1024)))
        return QuantizedRows(values, scale, x.dtype)
    gate, up = x.chunk(2, dim=-1)
    return QuantizedRows(*quantize_rows(F.silu(gate) * up), x.dtype)


def linear(x: torch.Tensor | QuantizedRows, weight: torch.Tensor, weight_scale: torch.Tensor,
           bias: torch.Tensor | None = None, x_amax: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (weight * weight_scale).T + bias`` with x quantised per token (by ``x_amax`` if given: the
    tokens' amax over whole rows when x is a rank's slice), the result in x's dtype. ``x`` may come quantised."""
    if isinstance(x, QuantizedRows):
        values, scale, dtype = x
        lead = values.shape[:-1]
    else:
        values, scale = quantize_rows(x.reshape(-1, x.shape[-1]), x_amax)
        dtype, lead = x.dtype, x.shape[:-1]
    if not values.is_cuda:
        out = F.linear(dequantize_rows(values, scale), dequantize_rows(weight, weight_scale),
                       None if bias is None else bias.float()).to(dtype)
    elif triton is not None and 0 < values.shape[0] * weight.shape[0] < SCALES_AFTER_MAX_OUTPUTS:
        out = _scales_after(values, scale, weight, weight_scale, bias, dtype)
    else:
        out = torch._scaled_mm(values, weight.t(), scale_a=scale[:, None], scale_b=weight_scale[None, :],
                               bias=bias, out_dtype=dtype, use_fast_accum=FAST_ACCUM)
    return out.reshape(*lead, weight.shape[0])


@functools.cache
def _unit_scale(device: torch.device) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32, device=device)


def _scales_after(values: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The row-wise scaled GEMM as a per-tensor one with unit scales (float32 out), then the scales applied."""
    unit = _unit_scale(values.device)
    acc = torch._scaled_mm(values, weight.t(), scale_a=unit, scale_b=unit, out_dtype=torch.float32,
                           use_fast_accum=FAST_ACCUM)
    rows, n = acc.shape
    out = torch.empty(rows, n, dtype=dtype, device=acc.device)
    block = min(triton.next_power_of_2(n), 2048)
    _apply_scales[(rows, triton.cdiv(n, block))](acc, scale, weight_scale, bias if bias is not None else acc, out,
                                                 N=n, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return out
