"""Fused matrix-vector kernels for decode steps of a few tokens (Triton, GPU, TP=1).

At one to four rows a decoder layer is bound by reading its weights, and the unfused layer spends a
third of its time in the small kernels between the GEMVs (two RMSNorms with their residual adds,
SiLU x mul) and in the launch gaps around them. Here a layer is four weight passes and nothing else
but attention:

- ``norm_linear``: ``rmsnorm(h) @ W.T (+ b)``: each program recomputes the row's RMS as it streams
  ``h`` (the row is a few KB), so the norm needs no kernel and no output of its own;
- ``norm_linear_silu``: the same over the stacked ``[gate; up]`` weight, each program taking matching
  gate and up rows, and writing ``silu(gate) * up``;
- ``linear_add_``: ``h += x @ W.T (+ b)``: the residual add in the GEMV's epilogue.

Every program accumulates in float32 over the whole reduction and rounds once (HF rounds the normed
input, the GEMV output and the residual sum to the model dtype in turn: the error is of the same
order, smaller if anything). On Hopper the kernels launch with programmatic dependent launch: each
waits for its predecessor before touching memory (``gdc_wait``) and lets its successor be scheduled
at once, so a kernel's launch and ramp overlap the previous kernel's tail.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never build the fused path
    triton = None

MAX_ROWS = 4  # the kernels keep one accumulator tile per row in registers

if triton is not None:

    @triton.jit
    def _small_gemv(
        x_ptr, x_stride, w_ptr, bias_ptr, norm_ptr, out_ptr, out_stride, eps,
        N: tl.constexpr, K: tl.constexpr, M: tl.constexpr, M_P2: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        NORM: tl.constexpr, SILU: tl.constexpr, ADD: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
    ):
        """``out[m, n] (+)= act(sum_k W[n, k] * x'[m, k] + b[n])`` for the M rows of x; ``x'`` is x, or
        rmsnorm(x) * norm weight when NORM. With SILU the weight has 2N rows (gate, then up) and the
        program combines rows n and N + n into ``silu(gate) * up``."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        m = tl.arange(0, M_P2)
        m_ok = m < M
        kk = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + n[:, None].to(tl.int64) * K
        if PDL:
            tl.extra.cuda.gdc_wait()  # the previous kernel's writes (x, out) are visible from here on
            tl.extra.cuda.gdc_launch_dependents()
        acc = tl.zeros((M_P2, BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((M_P2, BLOCK_N, BLOCK_K), dtype=tl.float32)
        sq = tl.zeros((M_P2, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            k_ok = k < K
            x = tl.load(x_ptr + m[:, None] * x_stride + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            x = x.to(tl.float32)
            if NORM:
                sq += x * x
                x = x * tl.load(norm_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            w_ok = n_ok[:, None] & k_ok[None, :]
            w = tl.load(w_rows + k[None, :], mask=w_ok, other=0.0).to(tl.float32)
            acc += w[None, :, :] * x[:, None, :]
            if SILU:
                up = tl.load(w_rows + N * K + k[None, :], mask=w_ok, other=0.0).to(tl.float32)
                acc_up += up[None, :, :] * x[:, None, :]
        y = tl.sum(acc, axis=2)
        if NORM:
            rstd = tl.rsqrt(tl.sum(sq, axis=1) / K + eps)[:, None]
            y = y * rstd
        if HAS_BIAS:
            y += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if SILU:
            u = tl.sum(acc_up, axis=2)
            if NORM:
                u = u * rstd
            if HAS_BIAS:
                u += tl.load(bias_ptr + N + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            y = y / (1.0 + tl.exp(-y)) * u
        out = out_ptr + m[:, None] * out_stride + n[None, :]
        ok = m_ok[:, None] & n_ok[None, :]
        if ADD:
            y += tl.load(out, mask=ok, other=0.0).to(tl.float32)
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=ok)


def supported(device: torch.device) -> bool:
    """Whether the fused kernels can run on ``device`` (Triton present, a CUDA device)."""
    return triton is not None and device.type == "cuda"


@functools.cache
def _use_pdl(device_index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def tile(n: int, k: int, rows: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an ``[n, k]`` weight at ``rows`` rows.

    Enough programs to give every multiprocessor several (so loads from many rows are in flight), and a
    per-row accumulator tile of at most 4096 floats.
    """
    block_n = 16
    while block_n > 2 and n // block_n < 512:
        block_n //= 2
    block_k = min(512, triton.next_power_of_2(k), 4096 // (block_n * triton.next_power_of_2(rows)))
    return block_n, max(block_k, 32), 4


def _launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm: torch.Tensor | None, eps: float,
    out: torch.Tensor, n: int, silu: bool, add: bool,
) -> None:
    rows, k = x.shape
    if rows > MAX_ROWS:
        raise ValueError(f"the fused GEMV takes at most {MAX_ROWS} rows, got {rows}")
    block_n, block_k, warps = tile(n, k, rows)
    _small_gemv[(triton.cdiv(n, block_n),)](
        x, x.stride(0), weight, bias if bias is not None else weight, norm if norm is not None else weight,
        out, out.stride(0), eps,
        N=n, K=k, M=rows, M_P2=triton.next_power_of_2(rows), BLOCK_N=block_n, BLOCK_K=block_k,
        NORM=norm is not None, SILU=silu, ADD=add, HAS_BIAS=bias is not None,
        PDL=_use_pdl(x.device.index or 0), launch_pdl=_use_pdl(x.device.index or 0), num_warps=warps,
    )


def norm_linear(h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """``rmsnorm(h) * norm_weight @ weight.T + bias`` for a few rows."""
    out = torch.empty(h.shape[0], weight.shape[0], dtype=h.dtype, device=h.device)
    _launch(h, weight, bias, norm_weight, eps, out, weight.shape[0], silu=False, add=False)
    return out


def norm_linear_silu(h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """``silu(g) * u`` where ``[g, u] = rmsnorm(h) * norm_weight @ weight.T + bias`` (weight: gate rows, then up)."""
    n = weight.shape[0] // 2
    out = torch.empty(h.shape[0], n, dtype=h.dtype, device=h.device)
    _launch(h, weight, bias, norm_weight, eps, out, n, silu=True, add=False)
    return out


def linear_add_(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, h: torch.Tensor) -> None:
    """``h += x @ weight.T + bias``, in place."""
    _launch(x, weight, bias, None, 0.0, h, weight.shape[0], silu=False, add=True)
