"""Token sampling: Gumbel-max over top-k, then the nucleus, with noise that is a pure function of (seed, position,
token), so a row's tokens never depend on the batch or the device. The GPU kernels are in ``runtime.engine.gumbel``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runtime.batch import Batch
from runtime.engine.penalties import (
    LogitBias,
    Penalties,
    adjusted_logits,
    min_p_offsets,
    prepare_logit_bias,
    prepare_penalties,
)
from runtime.utils import host_to_device

SMALLEST_TOP_P = 1e-6  # a top_p of 0 would keep nothing
_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingArgs:
    temperatures: torch.Tensor | None  # None: the whole batch is greedy
    top_p: torch.Tensor | None = None  # None: no row restricts (the torch path then skips the sort)
    top_k: torch.Tensor | None = None
    max_k: int = 0  # known on the host, so no device sync asks
    seeds: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    top_p_values: torch.Tensor | None = None  # every row's top-p, 1.0 where unused (the kernels read it always)
    min_p_offsets: torch.Tensor | None = None  # per row T * ln(min_p), -inf where off; None: no row uses min_p
    penalties: Penalties | None = None
    logit_bias: LogitBias | None = None


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """32-bit noise keys (as int64) of (seed, position) pairs, bit for bit the GPU kernel's."""
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    return _lowbias32(lo ^ _lowbias32(hi ^ _lowbias32((positions & _MASK32) ^ 0x9E3779B9)))


def counter_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform(0, 1) noise ``[rows, vocab]`` that is a pure function of (seed, position, token)."""
    cols = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    h = _lowbias32(cols[None, :] ^ row_keys(seeds, positions)[:, None])
    # 23 bits: (2**23 - 0.5) / 2**23 is exact in float32, so the value stays strictly below 1.
    return ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))


def top_k_thresholds(logits: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    """Per row, the k-th largest logit (float32; -inf for rows with k = 0, which keep every token)."""
    values = logits.topk(max_k, dim=-1).values.float()
    kth = values.gather(1, (top_k.clamp(1, max_k) - 1)[:, None])[:, 0]
    return torch.where(top_k > 0, kth, float("-inf"))


def thresholds_with_min_p(x: torch.Tensor, thresholds: torch.Tensor | None,
                          offsets: torch.Tensor | None) -> torch.Tensor | None:
    """Top-k thresholds raised to each row's min_p threshold (its largest logit plus ``offsets``)."""
    if offsets is None:
        return thresholds
    min_p = x.max(dim=-1).values.float() + offsets
    return min_p if thresholds is None else torch.maximum(thresholds, min_p)


def kept_tokens(x: torch.Tensor, inv_t: torch.Tensor, thresholds: torch.Tensor | None,
                top_p: torch.Tensor | None) -> torch.Tensor:
    """Bool ``[rows, vocab]``: the top-k tokens, then their nucleus; tied tokens stay or go together."""
    keep = x >= thresholds[:, None] if thresholds is not None else torch.ones_like(x, dtype=torch.bool)
    if top_p is None:
        return keep
    weight = torch.exp((x - x.max(-1, keepdim=True).values) * inv_t[:, None]) * keep
    sorted_x, order = x.sort(dim=-1, descending=True)
    sorted_w = weight.gather(1, order)
    before = torch.cat((torch.zeros_like(sorted_w[:, :1]), sorted_w.cumsum(-1)[:, :-1]), dim=-1)
    # Tied logits share the mass strictly above them: the mass before the first of their run.
    descending = -sorted_x
    first_of_run = torch.searchsorted(descending.contiguous(), descending.contiguous(), side="left")
    above = torch.empty_like(before).scatter_(1, order, before.gather(1, first_of_run))
    # A row at top_p = 1 keeps its whole tail even where float32 sums round ``above`` up to the total.
    return keep & ((above < top_p[:, None] * weight.sum(-1, keepdim=True)) | (top_p[:, None] >= 1.0))


def sample_torch(logits: torch.Tensor, args: SamplingArgs) -> torch.Tensor:
    x = logits.float()
    greedy_tokens = x.argmax(dim=-1)
    if args.temperatures is None:
        return greedy_tokens
    greedy = args.temperatures <= 0
    inv_t = 1.0 / torch.where(greedy, 1.0, args.temperatures)
    thresholds = top_k_thresholds(x, args.top_k, args.max_k) if args.top_k is not None else None
    thresholds = thresholds_with_min_p(x, thresholds, args.min_p_offsets)
    keep = kept_tokens(x, inv_t, thresholds, args.top_p)
    noise = -torch.log(-torch.log(counter_uniform(args.seeds, args.positions, x.shape[-1])))
    score = torch.where(keep, x * inv_t[:, None] + noise, float("-inf"))
    return torch.where(greedy, greedy_tokens, score.argmax(dim=-1))


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, use_kernels: bool,
                 token_pool: torch.Tensor | None = None) -> None:
        self.vocab_size = vocab_size
        self.token_pool = token_pool  # penalties count the tokens here
        self.device = device
        self.kernels = None
        if use_kernels:
            from runtime.engine import gumbel

            self.kernels = gumbel if gumbel.triton is not None else None
        self._no_thresholds = torch.empty(0)  # -inf per row, grown as batches grow: no fill kernel a step

    def prepare(self, batch: Batch) -> SamplingArgs:
        penalties = prepare_penalties(batch, self.device)
        bias = prepare_logit_bias(batch, self.device)
        if batch.all_greedy:
            return SamplingArgs(temperatures=None, penalties=penalties, logit_bias=bias)
        temps = batch.temperature.astype(np.float32)
        sampled = temps > 0
        top_k = np.where(sampled & (batch.top_k > 0) & (batch.top_k < self.vocab_size), batch.top_k, 0)
        top_p = np.where(sampled, np.clip(batch.top_p, SMALLEST_TOP_P, 1.0), 1.0).astype(np.float32)
        offsets = min_p_offsets(batch, temps)
        floats = host_to_device(np.concatenate((temps, top_p, *(() if offsets is None else (offsets,)))),
                                self.device).view(-1, len(temps))
        ints = host_to_device(np.concatenate((batch.seeds, batch.kv_lens, top_k)).astype(np.int64), self.device)
        seeds, positions, top_k_dev = ints.view(3, -1)
        max_k = int(top_k.max())
        return SamplingArgs(
            temperatures=floats[0], top_p=floats[1] if (top_p < 1.0).any() else None, top_p_values=floats[1],
            top_k=top_k_dev if max_k else None, max_k=max_k, seeds=seeds, positions=positions,
            min_p_offsets=floats[2] if offsets is not None else None, penalties=penalties, logit_bias=bias,
        )

    def sample(self, logits: torch.Tensor, args: SamplingArgs) -> torch.Tensor:
        if args.penalties is not None or args.logit_bias is not None:
            logits = adjusted_logits(logits, args.logit_bias, args.penalties, self.token_pool)
        if args.temperatures is None:
            return logits.argmax(dim=-1)
        if self.kernels is None:
            return sample_torch(logits, args)
        n = logits.shape[0]
        thresholds = top_k_thresholds(logits, args.top_k, args.max_k) if args.top_k is not None else None
        thresholds = thresholds_with_min_p(logits, thresholds, args.min_p_offsets)
        if thresholds is None:
            if self._no_thresholds.numel() < n:
                self._no_thresholds = torch.full((max(n, 256),), float("-inf"), device=logits.device)
            thresholds = self._no_thresholds[:n]
        return self.kernels.sample(logits, args.temperatures, thresholds, args.top_p_values, args.seeds,
                                   args.positions)
