"""FP8 (e4m3) linear layers: weights stored with a float32 scale per output row, activations quantised per
token at run time; on CUDA one scaled FP8 GEMM (``torch._scaled_mm``, row-wise scales), on CPU the same
arithmetic emulated in float32 so every path is testable without a GPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs quantise with torch
    triton = None

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
_TINY = 1e-12  # an all-zero row keeps a finite scale

if triton is not None:

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
        for k0 in range(0, N, BLOCK):
            ok = k0 + cols < N
            x = tl.load(x_row + k0 + cols, mask=ok, other=0.0).to(tl.float32)
            q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
            tl.store(out_ptr + row * N + k0 + cols, q.to(out_ptr.dtype.element_ty), mask=ok)


def quantize_rows(x: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and a float32 scale per row, ``x ~= values * scale[:, None]``; ``amax`` (per row) if the
    scale must come from more than ``x`` holds (a rank's slice of a longer row). On CUDA one Triton kernel."""
    if x.is_cuda and triton is not None and x.dim() == 2 and x.stride(1) == 1:
        rows, n = x.shape
        values = torch.empty(rows, n, dtype=FP8, device=x.device)
        scale = torch.empty(rows, dtype=torch.float32, device=x.device)
        block = min(triton.next_power_of_2(n), 4096)
        _quantize_rows[(rows,)](x, x.stride(0), amax if amax is not None else scale, values, scale, N=n,
                                FP8_MAX=FP8_MAX, TINY=_TINY, HAS_AMAX=amax is not None, BLOCK=block,
                                num_warps=4 if block <= 2048 else 8)
        return values, scale
    if amax is None:
        amax = x.abs().amax(dim=-1)
    scale = amax.float().clamp(min=_TINY) / FP8_MAX
    values = (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values, scale


def dequantize_rows(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return values.float() * scale[:, None]


def linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
           bias: torch.Tensor | None = None, x_amax: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (weight * weight_scale).T + bias`` with x quantised per token (by ``x_amax`` if given: the
    tokens' amax over whole rows when x is a rank's slice), the result in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    values, scale = quantize_rows(rows, x_amax)
    if x.is_cuda:
        out = torch._scaled_mm(values, weight.t(), scale_a=scale[:, None], scale_b=weight_scale[None, :],
                               bias=bias, out_dtype=x.dtype)
    else:
        out = F.linear(dequantize_rows(values, scale), dequantize_rows(weight, weight_scale),
                       None if bias is None else bias.float()).to(x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])
