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


def _launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm: torch.Tensor | None, eps: float,
    out: torch.Tensor, n: int, silu: bool, add: bool,
) -> None:
    rows, k = x.shape
    if rows != 1:
        raise ValueError(f"the fused GEMV takes one row, got {rows}")
    block_n, block_k, warps, stages = tile(n, k, silu)
    pdl = use_pdl(x.device.index or 0)
    _row_gemv[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, norm if norm is not None else weight, out, eps,
        N=n, K=k, BLOCK_N=block_n, BLOCK_K=block_k,
        NORM=norm is not None, SILU=silu, ADD=add, HAS_BIAS=bias is not None, PDL=pdl,
        launch_pdl=pdl, num_warps=warps, num_stages=stages,
    )


def norm_linear(h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """``rmsnorm(h) * norm_weight @ weight.T + bias`` for one row ``h`` ([1, k])."""
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
