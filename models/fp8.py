"""FP8 (e4m3) linear layers: weights stored with a float32 scale per output row, activations quantised per
token at run time; on CUDA one scaled FP8 GEMM (``torch._scaled_mm``, row-wise scales), on CPU the same
arithmetic emulated in float32 so every path is testable without a GPU."""

from __future__ import annotations

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
TINY = 1e-12  # an all-zero row keeps a finite scale


class Fp8Rows(NamedTuple):
    """Activations already quantised per row, ``x ~= values * scale[:, None]``, by the kernel that produced them
    (add_norm, ``silu_and_mul_rows``); ``dtype``: the unquantised rows' dtype, which the GEMM returns."""

    values: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


if triton is not None:

    @triton.jit
    def row_scale(amax, FP8_MAX: tl.constexpr, TINY: tl.constexpr):
        """The e4m3 scale of rows whose largest magnitude is ``amax``, correctly rounded as torch divides."""
        return tl.math.div_rn(tl.maximum(amax, TINY), FP8_MAX)

    @triton.jit
    def to_e4m3(x, scale, FP8_MAX: tl.constexpr):
        """``x`` (float32) over its row's scale, saturated, in e4m3: quantize_rows' arithmetic."""
        return tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX).to(tl.float8e4nv)

    @triton.jit
    def _silu_mul_rows(
        x_ptr, x_stride, out_ptr, scale_ptr, N: tl.constexpr, FP8_MAX: tl.constexpr, TINY: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """One row of ``silu(gate) * up`` rounded to x's dtype (as the unfused kernel stores it), quantised: a
        first pass for the amax, a second, from L2, for the values."""
        row = tl.program_id(0).to(tl.int64)
        gate = x_ptr + row * x_stride
        cols = tl.arange(0, BLOCK)
        dtype = x_ptr.dtype.element_ty
        peak = tl.zeros((BLOCK,), tl.float32)
        for k0 in range(0, N, BLOCK):
            ok = k0 + cols < N
            g = tl.load(gate + k0 + cols, mask=ok, other=0.0).to(tl.float32)
            u = tl.load(gate + N + k0 + cols, mask=ok, other=0.0).to(tl.float32)
            y = (tl.math.div_rn(g, 1.0 + tl.exp(-g)) * u).to(dtype).to(tl.float32)
            peak = tl.maximum(peak, tl.abs(y))
        scale = row_scale(tl.max(peak, axis=0), FP8_MAX, TINY)
        tl.store(scale_ptr + row, scale)
        for k0 in range(0, N, BLOCK):
            ok = k0 + cols < N
            g = tl.load(gate + k0 + cols, mask=ok, other=0.0).to(tl.float32)
            u = tl.load(gate + N + k0 + cols, mask=ok, other=0.0).to(tl.float32)
            y = (tl.math.div_rn(g, 1.0 + tl.exp(-g)) * u).to(dtype).to(tl.float32)
            tl.store(out_ptr + row * N + k0 + cols, to_e4m3(y, scale, FP8_MAX), mask=ok)

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
        scale = row_scale(amax, FP8_MAX, TINY)
        tl.store(scale_ptr + row, scale)
        for k0 in range(0, N, BLOCK):
            ok = k0 + cols < N
            x = tl.load(x_row + k0 + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + row * N + k0 + cols, to_e4m3(x, scale, FP8_MAX), mask=ok)


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
    values = (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values, scale


def dequantize_rows(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return values.float() * scale[:, None]


def silu_and_mul_rows(x: torch.Tensor) -> Fp8Rows:
    """``silu(gate) * up`` of ``x = [gate | up]`` (2-D), quantised per row in the same pass: on CUDA one Triton
    kernel, elsewhere the unfused arithmetic."""
    rows, width = x.shape
    n = width // 2
    if not (x.is_cuda and triton is not None and x.stride(1) == 1):
        gate, up = x.float().chunk(2, dim=-1)
        return Fp8Rows(*quantize_rows((F.silu(gate) * up).to(x.dtype)), x.dtype)
    values = torch.empty(rows, n, dtype=FP8, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    block = min(triton.next_power_of_2(n), 2048)
    _silu_mul_rows[(rows,)](x, x.stride(0), values, scale, N=n, FP8_MAX=FP8_MAX, TINY=TINY, BLOCK=block,
                            num_warps=4)
    return Fp8Rows(values, scale, x.dtype)


def linear(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor,
           bias: torch.Tensor | None = None, x_amax: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (weight * weight_scale).T + bias`` with x quantised per token (by ``x_amax`` if given: the
    tokens' amax over whole rows when x is a rank's slice; already, if ``Fp8Rows``), the result in x's dtype."""
    if isinstance(x, Fp8Rows):
        values, scale, dtype = x
        lead: tuple[int, ...] = values.shape[:-1]
    else:
        values, scale = quantize_rows(x.reshape(-1, x.shape[-1]), x_amax)
        dtype, lead = x.dtype, x.shape[:-1]
    if values.is_cuda:
        out = torch._scaled_mm(values, weight.t(), scale_a=scale[:, None], scale_b=weight_scale[None, :],
                               bias=bias, out_dtype=dtype)
    else:
        out = F.linear(dequantize_rows(values, scale), dequantize_rows(weight, weight_scale),
                       None if bias is None else bias.float()).to(dtype)
    return out.reshape(*lead, weight.shape[0])
