"""FP8 (e4m3) linear layers: weights stored with a float32 scale per output row, activations quantised per
token at run time; on CUDA one scaled FP8 GEMM (``torch._scaled_mm``, row-wise scales), on CPU the same
arithmetic emulated in float32 so every path is testable without a GPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
_TINY = 1e-12  # an all-zero row keeps a finite scale


def quantize_rows(x: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and a float32 scale per row, ``x ~= values * scale[:, None]``; ``amax`` (per row) if the
    scale must come from more than ``x`` holds (a rank's slice of a longer row)."""
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
