"""Elementwise kernels: a torch set, which mirrors HF's numerics so CPU runs match HF, and a flashinfer set."""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual
    return _rms_norm_torch(residual, weight, eps), residual


def _silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_torch(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Neox-style rotary embedding in place; q/k are [tokens, heads, head_dim]."""
    half = cos_sin.shape[-1] // 2
    cs = cos_sin[positions]
    cos = cs[:, None, :half].to(q.dtype)
    sin = cs[:, None, half:].to(q.dtype)
    for t in (q, k):
        x1, x2 = t[..., :half], t[..., half:]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        t.copy_(rotated)


GPU_EXTRA = "pip install 'tpinfer[gpu]'"


def flashinfer_installed() -> bool:
    """Whether the GPU extra is installed (``auto`` kernels fall back to torch's without it)."""
    return importlib.util.find_spec("flashinfer") is not None


@functools.cache
def import_flashinfer() -> Any:
    """The flashinfer module; a CPU-only install lacks it, and the GPU path then says what to install."""
    try:
        import flashinfer
    except ImportError as exc:
        raise RuntimeError(f"the CUDA path needs flashinfer, which is not installed ({exc}); install the GPU "
                           f"extra: {GPU_EXTRA} (from a clone: pip install -e '.[gpu]')") from exc
    return flashinfer


def _rms_norm_fi(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return import_flashinfer().norm.rmsnorm(x, weight, eps)


def _add_rms_norm_fi(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    import_flashinfer().norm.fused_add_rmsnorm(x, residual, weight, eps)
    return x, residual


def _silu_and_mul_fi(x: torch.Tensor) -> torch.Tensor:
    return import_flashinfer().activation.silu_and_mul(x)


@dataclass(frozen=True)
class Kernels:
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    # A batch-invariant GEMM under engine.deterministic.
    linear: Callable[..., torch.Tensor] = F.linear
    fused_gemv: bool = False
    fused_moe: bool = False  # models/fused_moe.py's Triton kernels for the experts (CUDA)
    # Norm and SiLU x mul that quantise their output for the next FP8 GEMM in the same pass (CUDA); without
    # them each FP8 GEMM quantises its own input.
    add_rms_norm_quantize: Callable[..., tuple[Any, torch.Tensor]] | None = None
    silu_and_mul_quantize: Callable[[torch.Tensor], Any] | None = None


TORCH_KERNELS = Kernels(_rms_norm_torch, _add_rms_norm_torch, _silu_and_mul_torch)
FLASHINFER_KERNELS = Kernels(_rms_norm_fi, _add_rms_norm_fi, _silu_and_mul_fi)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies, computed exactly as HF does (float32 on CPU), with llama3 scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended smoothly.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_mid, blended, scaled)


def rope_cos_sin_cache(max_positions: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos of each frequency, then sin (flashinfer's layout)."""
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
