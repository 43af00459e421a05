"""Leader -> TP ranks: each step's batch as a header plus one int64 payload over gloo (no pickling)."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from parallel.state import get_cpu_group
from runtime.batch import Batch

STOP, IDLE, PREFILL, DECODE = 0, 1, 2, 3
_INT_FIELDS = ("rows", "starts", "ext_lens", "sample_rows", "top_k", "seeds")
_FLOAT_FIELDS = ("temperature", "top_p")
_ADMIT_FIELDS = ("admit_rows", "admit_token_lens", "admit_tokens", "admit_page_lens", "admit_pages")
# Per-row arrays that only some steps carry; header[5] has bit i set when _OPTIONAL_FIELDS[i] travels.
_OPTIONAL_FIELDS = ("logprobs", "prompt_logprobs", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "prompt_lens")
_HEADER = 7  # kind, rows, admitted rows, admitted tokens, admitted pages, optional-field flags, logit-bias entries
_OPTIONAL_FLOATS = frozenset(("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"))


def _broadcast(t: torch.Tensor) -> torch.Tensor:
    dist.broadcast(t, group_src=0, group=get_cpu_group())
    return t


def _float_bits(values: np.ndarray) -> np.ndarray:
    """float32 values as their bits in int64, so they travel exactly in the one int64 payload."""
    return values.astype(np.float32).view(np.int32).astype(np.int64)


def _from_bits(values: np.ndarray) -> np.ndarray:
    return values.astype(np.int32).view(np.float32)


def send_batch(batch: Batch | None, stop: bool = False) -> None:
    """Rank 0: publish this step (None = nothing to run now; ``stop`` = the workers exit)."""
    if stop or batch is None:
        _broadcast(torch.tensor([STOP if stop else IDLE] + [0] * (_HEADER - 1), dtype=torch.int64))
        return
    admit = [getattr(batch, f) for f in _ADMIT_FIELDS]
    optional = [getattr(batch, f) for f in _OPTIONAL_FIELDS]
    flags = sum(1 << i for i, a in enumerate(optional) if a is not None)
    n_bias = 0 if batch.bias_tokens is None else len(batch.bias_tokens)
    header = [PREFILL if batch.phase == "prefill" else DECODE, batch.size, len(admit[0]), len(admit[2]), len(admit[4]),
              flags, n_bias]
    parts = [getattr(batch, f).astype(np.int64) for f in _INT_FIELDS]
    parts += [_float_bits(getattr(batch, f)) for f in _FLOAT_FIELDS]
    parts += [a.astype(np.int64) for a in admit]
    parts += [_float_bits(a) if f in _OPTIONAL_FLOATS else a.astype(np.int64)
              for f, a in zip(_OPTIONAL_FIELDS, optional) if a is not None]
    if n_bias:
        parts += [batch.bias_counts.astype(np.int64), batch.bias_tokens.astype(np.int64), _float_bits(batch.bias_values)]
    _broadcast(torch.tensor(header, dtype=torch.int64))
    _broadcast(torch.from_numpy(np.concatenate(parts)))


def recv_batch() -> Batch | int:
    """Other ranks: the next step's batch, or STOP / IDLE."""
    header = _broadcast(torch.zeros(_HEADER, dtype=torch.int64)).tolist()
    kind, n, n_admit, n_tokens, n_pages, flags, n_bias = header
    if kind in (STOP, IDLE):
        return kind
    optional = [f for i, f in enumerate(_OPTIONAL_FIELDS) if flags >> i & 1]
    sizes = [n] * (len(_INT_FIELDS) + len(_FLOAT_FIELDS)) + [n_admit, n_admit, n_tokens, n_admit, n_pages]
    sizes += [n] * len(optional)
    n_optional = len(sizes)
    if n_bias:
        sizes += [n, n_bias, n_bias]
    payload = _broadcast(torch.empty(sum(sizes), dtype=torch.int64)).numpy()
    arrays = np.split(payload, np.cumsum(sizes)[:-1])
    values: dict = {}
    for name, arr in zip(_INT_FIELDS, arrays):
        values[name] = arr.astype(np.int64 if name == "seeds" else np.int32)
    for name, arr in zip(_FLOAT_FIELDS, arrays[len(_INT_FIELDS) :]):
        values[name] = _from_bits(arr)
    for name, arr in zip(_ADMIT_FIELDS, arrays[len(_INT_FIELDS) + len(_FLOAT_FIELDS) :]):
        values[name] = arr.astype(np.int32)
    for name, arr in zip(optional, arrays[n_optional - len(optional) : n_optional]):
        values[name] = _from_bits(arr) if name in _OPTIONAL_FLOATS else arr.astype(np.int32)
    if n_bias:
        counts, tokens, biases = arrays[n_optional:]
        values.update(bias_counts=counts.astype(np.int32), bias_tokens=tokens.astype(np.int32),
                      bias_values=_from_bits(biases))
    return Batch(phase="prefill" if kind == PREFILL else "decode", **values)
