"""Fused GEMVs for single-token steps (TP=1): at one row a layer is bound by reading its weights, so the norms,
SiLU x mul and residual add are folded in. Programmatic dependent launch pays only inside CUDA graphs."""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never build the fused path
    triton = None

if triton is not None:

    @triton.jit
    def _row_gemv(
        x_ptr, w_ptr, scale_ptr, bias_ptr, norm_ptr, out_ptr, eps, N: tl.constexpr, K: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr, SILU: tl.constexpr, ADD: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, PDL: tl.constexpr,
    ):
        """``out[n] (+)= act(sum_k W[n, k] * x'[k] + b[n])``; with SILU the weight is gate rows, then up rows.
        FP8 weights (HAS_SCALE) are scaled per row after the sum; x stays in the model dtype."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        kk = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + n[:, None].to(tl.int64) * K
        # Weights are no kernel's output: read the first block before gdc_wait, overlapping the previous kernel.
        w_ok = n_ok[:, None] & (kk < K)[None, :]
        w = tl.load(w_rows + kk[None, :], mask=w_ok, other=0.0, eviction_policy="evict_first")
        if SILU:
            up = tl.load(w_rows + N * K + kk[None, :], mask=w_ok, other=0.0, eviction_policy="evict_first")
        else:
            up = w
        if PDL:
            tl.extra.cuda.gdc_wait()  # the previous kernel's writes (x, out) are visible from here on
            tl.extra.cuda.gdc_launch_dependents()
        x = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        sq = x * x
        if NORM:
            x = x * tl.load(norm_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        acc = w.to(tl.float32) * x[None, :]
        acc_up = up.to(tl.float32) * x[None, :]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            k = k0 + kk
            k_ok = k < K
            x = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            if NORM:
                sq += x * x
                x = x * tl.load(norm_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            w_ok = n_ok[:, None] & k_ok[None, :]
            # Weights are read once per step: keep them from pushing x and the activations out of L2.
            w = tl.load(w_rows + k[None, :], mask=w_ok, other=0.0, eviction_policy="evict_first")
            acc += w.to(tl.float32) * x[None, :]
            if SILU:
                up = tl.load(w_rows + N * K + k[None, :], mask=w_ok, other=0.0, eviction_policy="evict_first")
                acc_up += up.to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1)
        if NORM:
            rstd = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
            y = y * rstd
        if HAS_SCALE:
            y *= tl.load(scale_ptr + n, mask=n_ok, other=0.0)
        if HAS_BIAS:
            y += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
        if SILU:
            u = tl.sum(acc_up, axis=1)
            if NORM:
                u = u * rstd
            if HAS_SCALE:
                u *= tl.load(scale_ptr + N + n, mask=n_ok, other=0.0)
            if HAS_BIAS:
                u += tl.load(bias_ptr + N + n, mask=n_ok, other=0.0).to(tl.float32)
            y = y / (1.0 + tl.exp(-y)) * u
        if ADD:
            y += tl.load(out_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


def supported(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


@functools.cache
def use_pdl(device_index: int) -> bool:
    """Programmatic dependent launch: Hopper and later, compiled (Triton's interpreter has none)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


# Swept shapes whose best tile beats ``tile``'s rule in the engine (scripts/bench_gemv.py --sweep).
TUNED_TILES: dict[tuple[int, int, bool], tuple[int, int, int, int]] = {
    (6144, 4096, False): (16, 512, 8, 4), (4096, 4096, False): (8, 2048, 8, 2),  # qkv, o
    (14336, 4096, True): (1, 1024, 2, 3), (4096, 14336, False): (4, 1024, 2, 4),  # gate_up, down
}


# The same for FP8 weights (scripts/bench_gemv.py --fp8 --sweep): a block of e4m3 holds half the bytes.
TUNED_FP8_TILES: dict[tuple[int, int, bool], tuple[int, int, int, int]] = {
    (6144, 4096, False): (8, 512, 2, 4), (4096, 4096, False): (8, 1024, 4, 6),  # qkv, o
    (14336, 4096, True): (8, 256, 2, 2), (4096, 14336, False): (4, 1024, 2, 2),  # gate_up, down
}


def tile(n: int, k: int, silu: bool, fp8: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages); short reductions fit one block, read before ``gdc_wait``."""
    tuned = (TUNED_FP8_TILES if fp8 else TUNED_TILES).get((n, k, silu))
    if tuned:
        return tuned
    if silu:
        return 1, min(512, triton.next_power_of_2(k)), 4, 3
    if k <= 2048:
        return 4, triton.next_power_of_2(k), 8, 2
    return 4, 1024, 8, 6


def _launch(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
    norm: torch.Tensor | None, eps: float, out: torch.Tensor, n: int, silu: bool, add: bool,
) -> None:
    rows, k = x.shape
    if rows != 1:
        raise ValueError(f"the fused GEMV takes one row, got {rows}")
    block_n, block_k, warps, stages = tile(n, k, silu, scale is not None)
    pdl = use_pdl(x.device.index or 0)
    _row_gemv[(triton.cdiv(n, block_n),)](
        x, weight, scale if scale is not None else weight, bias if bias is not None else weight,
        norm if norm is not None else weight, out, eps, N=n, K=k, BLOCK_N=block_n, BLOCK_K=block_k,
        NORM=norm is not None, SILU=silu, ADD=add, HAS_BIAS=bias is not None, HAS_SCALE=scale is not None, PDL=pdl,
        launch_pdl=pdl, num_warps=warps, num_stages=stages,
    )


def norm_linear(h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                bias: torch.Tensor | None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``rmsnorm(h) * norm_weight @ (weight * scale).T + bias`` for one row ``h`` ([1, k]); ``scale``: an FP8
    weight's per-row scale."""
    out = torch.empty(h.shape[0], weight.shape[0], dtype=h.dtype, device=h.device)
    _launch(h, weight, scale, bias, norm_weight, eps, out, weight.shape[0], silu=False, add=False)
    return out


def norm_linear_silu(h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                     bias: torch.Tensor | None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(g) * u`` where ``[g, u] = rmsnorm(h) * norm_weight @ weight.T + bias`` (weight: gate rows, then up)."""
    n = weight.shape[0] // 2
    out = torch.empty(h.shape[0], n, dtype=h.dtype, device=h.device)
    _launch(h, weight, scale, bias, norm_weight, eps, out, n, silu=True, add=False)
    return out


def linear_add_(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, h: torch.Tensor,
                scale: torch.Tensor | None = None) -> None:
    """``h += x @ (weight * scale).T + bias``, in place."""
    _launch(x, weight, scale, bias, None, 0.0, h, weight.shape[0], silu=False, add=True)
