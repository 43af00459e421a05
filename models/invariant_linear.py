"""Batch-invariant linear layers: each output row is the same bits whatever rows share the call. cuBLAS picks
split-K by shape, changing the summation order; the Triton GEMM here never splits K."""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use cpu_linear
    triton = None

if triton is not None:

    @triton.jit
    def _linear_kernel(
        x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, x_stride, w_stride, out_stride, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        # Grouped order: programs that run together share weight tiles in L2.
        group = pid // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        size_m = tl.minimum(tiles_m - first_m, GROUP_M)
        tile_m = first_m + (pid % (GROUP_M * tiles_n)) % size_m
        tile_n = (pid % (GROUP_M * tiles_n)) // size_m
        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        x_tile = x_ptr + rows[:, None].to(tl.int64) * x_stride + ks[None, :]
        w_tile = w_ptr + cols[:, None].to(tl.int64) * w_stride + ks[None, :]
        row_ok = rows[:, None] < M
        col_ok = cols[:, None] < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_ok = ks[None, :] < K - k * BLOCK_K
            x = tl.load(x_tile, mask=row_ok & k_ok, other=0.0)
            w = tl.load(w_tile, mask=col_ok & k_ok, other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
            x_tile += BLOCK_K
            w_tile += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok & (cols[None, :] < N))


# Every config runs the same instruction over the same K order, so a row gets the same bits from any of them.
SMALL = (64, 64, 128, 4, 4)  # decode: few rows, many programs over N to keep HBM busy
LARGE = (128, 128, 64, 8, 4)
LARGE_FROM_ROWS = 512


def config_for(rows: int) -> tuple[int, int, int, int, int]:
    return LARGE if rows >= LARGE_FROM_ROWS else SMALL


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """Batch-invariant ``F.linear(x, weight, bias)`` for 2-D ``x``; ``config`` overrides the tile choice."""
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n, block_k, warps, stages = config or config_for(m)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _linear_kernel[grid](
        x, weight, bias if bias is not None else x, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
        num_warps=warps, num_stages=stages,
    )
    return out


class BatchInvariantLinear:
    """``F.linear`` with the Triton GEMM's bits: each shape is probed once against cuBLAS, which serves it if the
    bits match. Shapes first met during graph capture, where nothing may sync, take the Triton GEMM."""

    def __init__(self) -> None:
        self.cublas_ok: dict[tuple[int, int, int, bool], bool] = {}

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        key = (flat.shape[0], weight.shape[0], weight.shape[1], bias is not None)
        use_cublas = self.cublas_ok.get(key)
        if use_cublas is None:
            if torch.cuda.is_current_stream_capturing():
                use_cublas = False
            else:
                use_cublas = self.cublas_ok[key] = self._cublas_matches(flat.shape[0], weight, bias)
        out = F.linear(flat, weight, bias) if use_cublas else linear(flat, weight, bias)
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def _cublas_matches(rows: int, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        gen = torch.Generator(device=weight.device).manual_seed(rows)
        probe = torch.randn(max(rows, 1), weight.shape[1], device=weight.device, generator=gen).to(weight.dtype)
        return torch.equal(F.linear(probe, weight, bias), linear(probe, weight, bias))


CPU_BLOCK_ROWS = 32


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` over zero-padded blocks of CPU_BLOCK_ROWS rows: BLAS switches paths by row count."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    padded = -(-rows // CPU_BLOCK_ROWS) * CPU_BLOCK_ROWS
    if padded != rows:
        flat = torch.cat((flat, flat.new_zeros(padded - rows, flat.shape[1])))
    blocks = [F.linear(block, weight, bias) for block in flat.split(CPU_BLOCK_ROWS)]
    out = torch.cat(blocks)[:rows] if blocks else flat.new_zeros(0, weight.shape[0])
    return out.view(*x.shape[:-1], weight.shape[0])
