"""Tensor-parallel layers whose ``weight_loader`` reads only this rank's slice of a checkpoint tensor."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from models import fp8
from models.config import not_divisible
from models.ops import TORCH_KERNELS, Kernels
from parallel import all_gather_last_dim, all_reduce, all_reduce_max, get_tp, linear_all_reduce

LinearFn = Callable[..., torch.Tensor]


class SliceSource(Protocol):
    def get_shape(self) -> list[int]: ...
    def __getitem__(self, index: Any) -> torch.Tensor: ...


class FullTensor:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.tensor[index]


class Fp8Weight:
    """A checkpoint's e4m3 weight and its scales: per output row ("channel": ``[out]`` or ``[out, 1]``), per
    tensor (``[]`` or ``[1]``) or per block of ``block`` elements (``[ceil(out / rows), ceil(in / cols)]``); the
    weight is values x scale. Indexing, by rows then columns as the layers slice, gives the dequantised float32
    values on ``device`` and reads only the values and scales of the elements asked for."""

    def __init__(self, values: SliceSource, scales: SliceSource, strategy: str, block: tuple[int, int] | None,
                 device: torch.device) -> None:
        self.values, self.scales, self.strategy, self.block, self.device = values, scales, strategy, block, device

    @property
    def per_row(self) -> bool:
        return self.strategy != "block"

    def get_shape(self) -> list[int]:
        return self.values.get_shape()

    def stored(self, index: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The e4m3 values at ``index`` as stored and a float32 scale per row (per-row and per-tensor scales)."""
        rows, cols = self._bounds(index)
        return self.values[rows, cols], self._row_scales(rows)

    def __getitem__(self, index: Any) -> torch.Tensor:
        rows, cols = self._bounds(index)
        values = self.values[rows, cols].to(self.device).float()
        if self.per_row:
            return values * self._row_scales(rows).to(self.device)[:, None]
        assert self.block is not None
        block_rows, block_cols = self.block
        first_row, first_col = rows.start // block_rows, cols.start // block_cols
        scales = self.scales[first_row : -(-rows.stop // block_rows), first_col : -(-cols.stop // block_cols)]
        scales = scales.to(self.device).float().repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)
        top, left = rows.start - first_row * block_rows, cols.start - first_col * block_cols
        return values * scales[top : top + values.shape[0], left : left + values.shape[1]]

    def _row_scales(self, rows: slice) -> torch.Tensor:
        if self.strategy == "tensor":
            return self.scales[...].float().reshape(1).expand(rows.stop - rows.start)
        return self.scales[rows].float().reshape(-1)

    def _bounds(self, index: Any) -> tuple[slice, slice]:
        parts = index if isinstance(index, tuple) else (index,)
        if len(parts) > 2 or not all(isinstance(part, slice) for part in parts):
            raise TypeError(f"an FP8 checkpoint weight is read by row and column slices, not {index!r}")
        parts = (*parts, slice(None))[:2]
        bounds = []
        for part, size in zip(parts, self.get_shape()):
            start, stop, step = part.indices(size)
            if step != 1:
                raise TypeError(f"an FP8 checkpoint weight is read by contiguous slices, not {index!r}")
            bounds.append(slice(start, max(start, stop)))
        return bounds[0], bounds[1]


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(not_divisible(what, numerator, denominator))
    return numerator // denominator


def copy_into(param: torch.Tensor, loaded: torch.Tensor, name: str = "") -> None:
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.copy_(loaded)


def load_replicated(param: torch.Tensor, source: SliceSource, shard_id: Any = None) -> None:
    copy_into(param.data, source[:])


def load_per_tensor_scale(param: torch.Tensor, source: SliceSource, shard_id: Any = None) -> None:
    """A per-tensor scale into a ``[1]`` parameter: checkpoints store it as ``[]`` or ``[1]``, the same on every
    rank."""
    loaded = source[...]
    copy_into(param.data, loaded.reshape(1) if loaded.numel() == 1 else loaded)


def new_param(*shape: int, loader: Any, dtype: torch.dtype | None = None) -> nn.Parameter:
    """A parameter in the model's dtype, or in ``dtype`` whatever the model's (FP8 weights, their scales)."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    param.fixed_dtype = dtype  # type: ignore[attr-defined]
    return param


def as_fp8_rows(source: SliceSource, index: tuple[slice, ...],
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``source[index]`` in e4m3 with a float32 scale per row: a checkpoint's per-row or per-tensor FP8 as stored,
    anything else quantised. A row's scale comes from the whole checkpoint row even where ``index`` takes only
    some of its columns (row-parallel), so every TP size stores the same weights."""
    if isinstance(source, Fp8Weight) and source.per_row:
        return source.stored(index)
    loaded = source[index].to(device)
    width = source.get_shape()[-1]
    partial = len(index) > 1 and index[1].indices(width) != (0, width, 1)
    amax = source[index[0]].to(device).abs().amax(dim=-1) if partial else None
    return fp8.quantize_rows(loaded, amax)


class _Linear(nn.Module):
    """A TP linear layer's weight, in the model's dtype or in FP8 with a scale per output row (models/fp8.py).

    Subclasses say which rows of the weight a checkpoint tensor fills and from where (``_rows``); an FP8 weight
    is quantised as it is written, each rank quantising only its slice, unless the checkpoint holds it in FP8
    with a scale per row or per tensor already (``Fp8Weight``)."""

    def _init_weight(self, rows: int, cols: int, quantized: bool) -> None:
        self.weight = new_param(rows, cols, loader=self._load, dtype=fp8.FP8 if quantized else None)
        self.weight_scale = new_param(rows, loader=None, dtype=torch.float32) if quantized else None

    @property
    def fp8(self) -> bool:
        return self.weight_scale is not None

    def _rows(self, param: torch.Tensor, source: SliceSource, shard_id: Any) -> tuple[slice, tuple[slice, ...]]:
        """(rows of ``param`` to fill, the index of their values in the checkpoint tensor)."""
        raise NotImplementedError

    def _load(self, param: torch.Tensor, source: SliceSource, shard_id: Any = None) -> None:
        rows, index = self._rows(param, source, shard_id)
        if param is not self.weight or self.weight_scale is None:
            copy_into(param.data[rows], source[index])
            return
        values, scale = as_fp8_rows(source, index, param.device)
        copy_into(param.data[rows], values)
        copy_into(self.weight_scale.data[rows], scale)


def vocab_shard(vocab_size: int) -> tuple[int, int, int]:
    """(shard size, first row, end row) of this rank's vocab rows: ``ceil(vocab / tp)`` rows a rank, the last
    shard zero-padded."""
    tp = get_tp()
    size = -(-vocab_size // tp.size)
    start = tp.rank * size
    return size, start, min(start + size, vocab_size)


class VocabParallelEmbedding(nn.Module):
    """Each rank holds ``ceil(vocab / tp)`` rows; ids outside the shard embed to zero before the all-reduce."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.shard_size, self.start, self.end = vocab_shard(vocab_size)
        self.weight = new_param(self.shard_size, dim, loader=self._load)

    def _load(self, param: torch.Tensor, source: SliceSource, shard_id: Any = None) -> None:
        param.data.zero_()
        if self.end > self.start:
            rows = source[self.start : self.end]
            param.data[: self.end - self.start].copy_(rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if get_tp().size == 1:
            return F.embedding(ids, self.weight)
        in_shard = (ids >= self.start) & (ids < self.end)
        local = torch.where(in_shard, ids - self.start, 0)
        out = F.embedding(local, self.weight) * in_shard.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Local logits of this rank's vocab shard, all-gathered to the full vocab."""

    def __init__(self, vocab_size: int, dim: int, linear: LinearFn = F.linear) -> None:
        super().__init__(vocab_size, dim)
        self.linear_fn = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.linear_fn(x, self.weight)
        if get_tp().size == 1:
            return logits
        return all_gather_last_dim(logits)[..., : self.vocab_size]


class ColumnParallelLinear(_Linear):
    """Output features split over ranks; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool, linear: LinearFn = F.linear,
                 quantized: bool = False) -> None:
        super().__init__()
        self.linear_fn = linear
        out_local = divide(out_features, get_tp().size, "output features")
        self._init_weight(out_local, in_features, quantized)
        self.bias = new_param(out_local, loader=self._load) if bias else None

    def _rows(self, param: torch.Tensor, source: SliceSource, shard_id: Any) -> tuple[slice, tuple[slice, ...]]:
        start = get_tp().rank * param.shape[0]
        return slice(None), (slice(start, start + param.shape[0]),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale is not None:
            return fp8.linear(x, self.weight, self.weight_scale, self.bias)
        return self.linear_fn(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections fused along the output (gate and up)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, linear: LinearFn = F.linear,
                 quantized: bool = False) -> None:
        super().__init__(in_features, sum(out_sizes), bias, linear, quantized)
        tp = get_tp().size
        self.local_sizes = [divide(n, tp, "output features") for n in out_sizes]

    def _rows(self, param: torch.Tensor, source: SliceSource, shard_id: Any) -> tuple[slice, tuple[slice, ...]]:
        index = int(shard_id)
        size = self.local_sizes[index]
        offset = sum(self.local_sizes[:index])
        start = get_tp().rank * size
        return slice(offset, offset + size), (slice(start, start + size),)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused Q, K and V split by heads; with fewer KV heads than ranks, KV heads are replicated."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 linear: LinearFn = F.linear, quantized: bool = False) -> None:
        tp = get_tp()
        self.num_heads = divide(num_heads, tp.size, "num_attention_heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = divide(num_kv_heads, tp.size, "num_key_value_heads")
            self.kv_head_start = tp.rank * self.num_kv_heads
        else:  # LlamaForCausalLM checked tp_problem: tp.size is a multiple of num_kv_heads
            self.num_kv_heads = 1
            self.kv_head_start = tp.rank // (tp.size // num_kv_heads)
        self.head_dim = head_dim
        local_out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden, local_out * tp.size, bias, linear, quantized)

    def _rows(self, param: torch.Tensor, source: SliceSource, shard_id: Any) -> tuple[slice, tuple[slice, ...]]:
        d = self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            offset, size, start = 0, q_size, get_tp().rank * q_size
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, start = kv_size, self.kv_head_start * d
        return slice(offset, offset + size), (slice(start, start + size),)


def whole_row_amax(x: torch.Tensor) -> torch.Tensor | None:
    """Each row's largest magnitude over every rank's slice of it, for the input of a layer whose input features
    are split over the TP ranks: its e4m3 scale, and the result, are then TP=1's (one small all-reduce; see
    ARCHITECTURE.md). None at TP=1, where the row is whole."""
    if get_tp().size == 1:
        return None
    return all_reduce_max(x.reshape(-1, x.shape[-1]).abs().amax(dim=-1).float())


class RowParallelLinear(_Linear):
    """Input features split over ranks; partial sums all-reduced, then the bias added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, linear: LinearFn = F.linear,
                 quantized: bool = False) -> None:
        super().__init__()
        self.linear_fn = linear
        in_local = divide(in_features, get_tp().size, "input features")
        self._init_weight(out_features, in_local, quantized)
        self.bias = new_param(out_features, loader=load_replicated) if bias else None

    def _rows(self, param: torch.Tensor, source: SliceSource, shard_id: Any) -> tuple[slice, tuple[slice, ...]]:
        cols = param.shape[1]
        start = get_tp().rank * cols
        return slice(None), (slice(None), slice(start, start + cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale is not None:
            out = all_reduce(fp8.linear(x, self.weight, self.weight_scale, None, whole_row_amax(x)))
        elif self.linear_fn is F.linear:
            out = linear_all_reduce(x, self.weight)  # may write the GEMM straight into the all-reduce's buffer
        else:
            out = all_reduce(self.linear_fn(x, self.weight))
        return out if self.bias is None else out + self.bias


class RMSNorm(nn.Module):
    """RMSNorm that can also add the residual first: ``(norm(x + r), x + r)``."""

    def __init__(self, dim: int, eps: float, kernels: Kernels = TORCH_KERNELS, quantize: bool = False) -> None:
        """``quantize``: an FP8 GEMM reads the output, so the residual-add path returns it quantised
        (``fp8.QuantizedRows``) where the kernels can; the first layer's norm, with no residual, does not."""
        super().__init__()
        self.eps = eps
        self.weight = new_param(dim, loader=load_replicated)
        self.norm, self.add_norm = kernels.rms_norm, kernels.add_rms_norm
        if quantize and kernels.add_rms_norm_quantize is not None:
            self.add_norm = kernels.add_rms_norm_quantize

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.norm(x, self.weight, self.eps), x
        return self.add_norm(x, residual, self.weight, self.eps)
