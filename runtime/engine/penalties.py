"""Logit changes before sampling: logit biases; presence, frequency and repetition penalties, read from the device
token pool (so the token sampled last step counts without waiting for the host); min_p as a per-row threshold."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runtime.batch import Batch
from runtime.utils import host_to_device


@dataclass
class Penalties:
    rows: torch.Tensor  # int64 [m]: the batch rows that penalise
    pool_rows: torch.Tensor  # int64 [m]: their token-pool rows
    kv_lens: torch.Tensor  # int64 [m]: tokens in the pool so far (prompt and output)
    prompt_lens: torch.Tensor  # int64 [m]: where the output starts
    presence: torch.Tensor  # float32 [m]
    frequency: torch.Tensor
    repetition: torch.Tensor
    max_len: int  # the longest kv_len, known on the host


@dataclass
class LogitBias:
    rows: torch.Tensor  # int64 [e]: each entry's batch row
    tokens: torch.Tensor  # int64 [e]
    values: torch.Tensor  # float32 [e]


def prepare_logit_bias(batch: Batch, device: torch.device) -> LogitBias | None:
    if batch.bias_tokens is None:
        return None
    rows = np.repeat(np.arange(batch.size), batch.bias_counts)
    ints = host_to_device(np.concatenate((rows, batch.bias_tokens)).astype(np.int64), device).view(2, -1)
    return LogitBias(*ints, host_to_device(batch.bias_values.astype(np.float32), device))


def prepare_penalties(batch: Batch, device: torch.device) -> Penalties | None:
    """The penalising rows of ``batch`` on the device, or None when no row penalises."""
    if batch.presence_penalty is None:
        return None
    rows = np.flatnonzero((batch.presence_penalty != 0) | (batch.frequency_penalty != 0)
                          | (batch.repetition_penalty != 1))
    if not len(rows):
        return None
    kv_lens = batch.kv_lens[rows]
    ints = host_to_device(np.concatenate((rows, batch.rows[rows], kv_lens, batch.prompt_lens[rows])).astype(np.int64),
                          device).view(4, -1)
    floats = host_to_device(np.concatenate((batch.presence_penalty[rows], batch.frequency_penalty[rows],
                                            batch.repetition_penalty[rows])).astype(np.float32), device).view(3, -1)
    return Penalties(*ints, *floats, max_len=int(kv_lens.max()))


def penalize_(x: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, kv_lens: torch.Tensor,
              prompt_lens: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
              repetition: torch.Tensor) -> None:
    """Penalises float32 logits ``x`` in place at batch ``rows``, whose token ids so far are
    ``tokens[i, :kv_lens[i]]`` (the output from ``prompt_lens[i]``): repetition over prompt and output, as
    transformers (a token seen anywhere has its logit divided by the penalty where positive, multiplied where
    not); presence and frequency over the output, as OpenAI (minus ``presence`` once and ``frequency`` per
    occurrence).

    Only the sequences' own tokens are touched: ``[rows, vocab]`` temporaries would cost several passes over
    the logits each step (a quarter of the 1B shape's decode throughput at 256 rows)."""
    cols = torch.arange(tokens.shape[1], device=tokens.device)
    in_sequence = cols[None, :] < kv_lens[:, None]
    generated = in_sequence & (cols[None, :] >= prompt_lens[:, None])
    # Past kv_len the pool holds stale ids: they become copies of the row's first token, so every write below
    # of one (row, token) carries the same value and the scatter's order cannot matter.
    tokens = torch.where(in_sequence, tokens, tokens[:, :1])
    # Occurrences in the output, by binary search in the row's sorted output ids (the vocabulary size pads).
    vocab = x.shape[1]
    output_sorted = torch.where(generated, tokens, vocab).sort(dim=1).values
    counts = (torch.searchsorted(output_sorted, tokens, right=True) - torch.searchsorted(output_sorted, tokens))
    at = (rows[:, None].expand_as(tokens), tokens)
    at_seen = x[at]  # the logits of the row's own tokens
    rep = repetition[:, None]
    penalised = torch.where(at_seen > 0, at_seen / rep, at_seen * rep)
    x.index_put_(at, penalised - frequency[:, None] * counts - presence[:, None] * (counts > 0))


def adjusted_logits(logits: torch.Tensor, bias: LogitBias | None, penalties: Penalties | None,
                    token_pool: torch.Tensor) -> torch.Tensor:
    """A float32 copy of ``logits`` with the biases added, then the penalties applied (vLLM's order); ``logits``
    stays as it was (logprobs read it: they describe the model's distribution)."""
    out = logits.to(torch.float32, copy=True)
    if bias is not None:
        out.index_put_((bias.rows, bias.tokens), bias.values, accumulate=True)
    if penalties is not None:
        p = penalties
        tokens = token_pool[p.pool_rows, : p.max_len].long()
        penalize_(out, p.rows, tokens, p.kv_lens, p.prompt_lens, p.presence, p.frequency, p.repetition)
    return out


def min_p_offsets(batch: Batch, temperatures: np.ndarray) -> np.ndarray | None:
    """Per row ``T * ln(min_p)`` (-inf where off): a token is kept where its logit is at least the row's largest
    plus this, that is where its probability at temperature T is at least min_p times the likeliest's."""
    if batch.min_p is None or not (batch.min_p > 0).any():
        return None
    on = (batch.min_p > 0) & (temperatures > 0)
    return np.where(on, temperatures * np.log(np.where(on, batch.min_p, 1.0)), -np.inf).astype(np.float32)
