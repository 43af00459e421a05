"""Fused matrix-vector kernels for single-token steps (Triton, GPU, TP=1).

At one row a decoder layer is bound by reading its weights; unfused, cuBLAS's GEMVs read the 1B
shape's at ~2.5 TB/s and two fused add + RMSNorms and a SiLU x mul run between them. Here a layer is
four weight passes and nothing else but attention (1B: 35.4 against 49.3 us a layer, 3.4 TB/s; 8B: 105
against 124 us, 4.2 TB/s; benchmarks/README.md):

- ``norm_linear``: ``rmsnorm(h) @ W.T (+ b)``: each program recomputes the row's RMS as it streams
  ``h`` (a few KB), so the norm needs no kernel and no output of its own;
- ``norm_linear_silu``: the same over the stacked ``[gate; up]`` weight, each program taking matching
  gate and up rows, and writing ``silu(gate) * up``;
- ``linear_add_``: ``h += x @ W.T (+ b)``: the residual add in the GEMV's epilogue.

Every program accumulates in float32 over the whole reduction and rounds once (HF rounds the normed
input, the GEMV output and the residual sum to the model dtype in turn: the error is of the same
order, smaller if anything). On Hopper the kernels launch with programmatic dependent launch: each
waits for its predecessor before touching memory (``gdc_wait``) and lets its successor be scheduled
at once, so a kernel's launch and ramp overlap the previous kernel's tail. They pay inside CUDA
graphs only: launched eagerly, Triton's per-launch host work costs more than they save.
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

if triton is not None:

    @triton.jit
    def _row_gemv(
        x_ptr, w_ptr, bias_ptr, norm_ptr, out_ptr, eps, N: tl.constexpr, K: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        NORM: tl.constexpr, SILU: tl.constexpr, ADD: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
    ):
        """``out[n] (+)= act(sum_k W[n, k] * x'[k] + b[n])`` for one row ``x``; ``x'`` is x, or
        rmsnorm(x) * norm weight when NORM. With SILU the weight has 2N rows (gate, then up) and the
        program combines rows n and N + n into ``silu(gate) * up``. Products accumulate elementwise over
        K and are reduced once at the end."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        kk = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + n[:, None].to(tl.int64) * K
        # The weights are no kernel's output: the first block is read before gdc_wait, overlapping the
        # previous kernel's tail (without it the dependent launch gained nothing at the 1B shape).
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
        if HAS_BIAS:
            y += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
        if SILU:
            u = tl.sum(acc_up, axis=1)
            if NORM:
                u = u * rstd
            if HAS_BIAS:
                u += tl.load(bias_ptr + N + n, mask=n_ok, other=0.0).to(tl.float32)
            y = y / (1.0 + tl.exp(-y)) * u
        if ADD:
            y += tl.load(out_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


if triton is not None:

    @triton.jit
    def _rows_block(x_rows, norm_ptr, k, k_ok, m_ok, w, u, acc, acc_up, sq,
                    NORM: tl.constexpr, SILU: tl.constexpr, PRECISION: tl.constexpr):
        """One BLOCK_K slice of ``_rows_gemm``: the rows' x (normed: times the norm weight, its squares
        summed for the RMS) against the weight tile(s) ``w`` (and ``u``), on the tensor cores."""
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if NORM:
            xf = x.to(tl.float32)
            sq += tl.sum(xf * xf, axis=1)
            g = tl.load(norm_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            x = xf * g[None, :]
        x = x.to(w.dtype)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
        if SILU:
            acc_up = tl.dot(x, u, acc_up, input_precision=PRECISION)
        return acc, acc_up, sq

    @triton.jit
    def _rows_gemm(
        x_ptr, w_ptr, bias_ptr, norm_ptr, out_ptr, eps, M, stride_x, stride_out,
        N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        NORM: tl.constexpr, SILU: tl.constexpr, ADD: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """``_row_gemv`` for a tile of ``BLOCK_M`` rows: the same three forms (normed input, SiLU x mul over
        gate and up rows, residual add), the products on the tensor cores. The norm scales each row's
        output by its 1/RMS at the end (the norm weight scales x before the dot)."""
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = m < M, n < N
        kk = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + m[:, None].to(tl.int64) * stride_x
        w_cols = w_ptr + n[None, :].to(tl.int64) * K  # W[n, k] as a [BLOCK_K, BLOCK_N] tile
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        # As in _row_gemv: the first weight block is no kernel's output, so it is read before gdc_wait.
        k_ok = kk < K
        w_ok = k_ok[:, None] & n_ok[None, :]
        w = tl.load(w_cols + kk[:, None], mask=w_ok, other=0.0)
        u = w
        if SILU:
            u = tl.load(w_cols + N * K + kk[:, None], mask=w_ok, other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        acc, acc_up, sq = _rows_block(x_rows, norm_ptr, kk, k_ok, m_ok, w, u, acc, acc_up, sq, NORM, SILU, PRECISION)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            k = k0 + kk
            k_ok = k < K
            w_ok = k_ok[:, None] & n_ok[None, :]
            w = tl.load(w_cols + k[:, None], mask=w_ok, other=0.0)
            u = w
            if SILU:
                u = tl.load(w_cols + N * K + k[:, None], mask=w_ok, other=0.0)
            acc, acc_up, sq = _rows_block(x_rows, norm_ptr, k, k_ok, m_ok, w, u, acc, acc_up, sq, NORM, SILU,
                                          PRECISION)
        if NORM:
            rstd = tl.rsqrt(sq / K + eps)
            acc = acc * rstd[:, None]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if SILU:
            if NORM:
                acc_up = acc_up * rstd[:, None]
            if HAS_BIAS:
                acc_up += tl.load(bias_ptr + N + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        out = out_ptr + m[:, None].to(tl.int64) * stride_out + n[None, :]
        ok = m_ok[:, None] & n_ok[None, :]
        if ADD:
            acc += tl.load(out, mask=ok, other=0.0).to(tl.float32)
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=ok)


def supported(device: torch.device) -> bool:
    """Whether the fused kernels can run on ``device`` (Triton present, a CUDA device)."""
    return triton is not None and device.type == "cuda"


@functools.cache
def use_pdl(device_index: int) -> bool:
    """Programmatic dependent launch: Hopper and later, compiled (Triton's interpreter has none)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


# Swept shapes whose best tiles beat the rule below in the engine, (n, k, silu) -> (BLOCK_N, BLOCK_K,
# num_warps, num_stages). scripts/bench_gemv.py --sweep times the whole layer stack with one kernel's tile
# changed at a time (benchmarks/gemv-tiles.json). Llama-3.1-8B: the stack 104.7 against 118.8 us a layer
# with the rule, the batch-1 step 4.02 against 4.52 ms. The 1B shape's bests (34.3 against 35.2 us in the
# stack) lost in the engine (steady step 0.881 against 0.845 ms, qkv's tile alone 0.871) and SmolLM2's
# did not combine (8.39 against 8.25 us): both keep the rule.
TUNED_TILES: dict[tuple[int, int, bool], tuple[int, int, int, int]] = {
    (6144, 4096, False): (16, 512, 8, 4), (4096, 4096, False): (8, 2048, 8, 2),  # qkv, o
    (14336, 4096, True): (1, 1024, 2, 3), (4096, 14336, False): (4, 1024, 2, 4),  # gate_up, down
}


def tile(n: int, k: int, silu: bool) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an ``[n, k]`` weight (``[2n, k]`` with ``silu``).

    A swept shape's best tile, else a rule from the same sweeps: a gate and an up row per program in
    512-wide blocks over 4 warps, 3 in flight; reductions up to 2048 long in one block, so that the whole
    tile is read before ``gdc_wait``, during the previous kernel's tail; longer ones in 1024-wide blocks, 6
    in flight, which keeps enough bytes in flight per SM to read at ~4 TB/s.
    """
    tuned = TUNED_TILES.get((n, k, silu))
    if tuned:
        return tuned
    if silu:
        return 1, min(512, triton.next_power_of_2(k)), 4, 3
    if k <= 2048:
        return 4, triton.next_power_of_2(k), 8, 2
    return 4, 1024, 8, 6


# auto runs decode steps of several rows fused up to this hidden size (wider, cuBLAS's GEMMs win).
ROWS_MAX_HIDDEN = 1024


def fused_max_rows(mode: str, hidden_size: int, graph_max_rows: int) -> int:
    """The most rows a decode step may have to run fused, for ``engine.fused_gemv`` = ``mode``: single-token
    steps at every width (faster at each measured one, 135M to 8B shapes), several rows up to the graphs'
    largest batch where the model is narrow enough (``always``: at every width)."""
    if mode == "never":
        return 0
    if mode == "always" or hidden_size <= ROWS_MAX_HIDDEN:
        return graph_max_rows
    return 1


def rows_tile(m: int, n: int, k: int, silu: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for ``m`` rows against an ``[n, k]`` weight."""
    block_m = 16 if m <= 16 else 32 if m <= 64 else 64
    return block_m, 64, 64, 4, 3


def _launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm: torch.Tensor | None, eps: float,
    out: torch.Tensor, n: int, silu: bool, add: bool,
) -> None:
    rows, k = x.shape
    if x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("the fused kernels take rows with unit stride along the features")
    pdl = use_pdl(x.device.index or 0)
    common = dict(NORM=norm is not None, SILU=silu, ADD=add, HAS_BIAS=bias is not None, PDL=pdl, launch_pdl=pdl)
    args = (x, weight, bias if bias is not None else weight, norm if norm is not None else weight, out, eps)
    if rows == 1:
        block_n, block_k, warps, stages = tile(n, k, silu)
        _row_gemv[(triton.cdiv(n, block_n),)](
            *args, N=n, K=k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages, **common,
        )
        return
    block_m, block_n, block_k, warps, stages = rows_tile(rows, n, k, silu)
    # float32 weights (CPU tests, the interpreter) multiply in full precision, not TF32.
    precision = "ieee" if weight.dtype == torch.float32 else "tf32"
    _rows_gemm[(triton.cdiv(n, block_n), triton.cdiv(rows, block_m))](
        *args, rows, x.stride(0), out.stride(0), N=n, K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION=precision, num_warps=warps, num_stages=stages, **common,
    )


def norm_linear(h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """``rmsnorm(h) * norm_weight @ weight.T + bias`` for the rows of ``h`` ([rows, k])."""
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
