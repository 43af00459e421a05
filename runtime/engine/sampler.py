"""Token sampling: the Sampler (prepare / sample), flashinfer on GPU, torch elsewhere.

Semantics, shared by both paths: temperature 0 is greedy (exact argmax); else
softmax(logits / T), then top-k, then top-p over the renormalised top-k mass,
then one draw. Requests with an explicit ``seed`` draw from a counter-based
RNG keyed by (seed, position), so their tokens do not depend on what else is
in the batch, on the TP size, or on the device. On CPU every request uses it
(unseeded ones get a seed derived from the run's seed and their id).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runtime.batch import Batch
from runtime.engine.gumbel import sample_with_temperature
from runtime.utils import host_to_device

MIN_T = 1e-6  # a temperature of 0 would divide by zero
MIN_P = 1e-6  # a top_p of 0 would filter out every token

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: decorrelates neighbouring keys
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB


@dataclass
class SamplingArgs:
    temperatures: torch.Tensor | None  # None: the whole batch is greedy
    top_k: torch.Tensor | None = None  # None: no request restricts top-k
    top_p: torch.Tensor | None = None  # None: no request restricts top-p
    greedy: torch.Tensor | None = None  # bool rows that take the argmax (None: no such row)
    seeds: torch.Tensor | None = None  # int64 per row
    positions: torch.Tensor | None = None  # int64 position of the sampled token (counter RNG key)
    seeded_rows: torch.Tensor | None = None  # rows drawn with the counter RNG on GPU (None: none)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser; int64 products wrap around, which is what it needs."""
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def counter_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform(0, 1) noise ``[rows, vocab]`` that is a pure function of (seed, position, token)."""
    key = _mix(seeds * _GOLDEN + positions)
    x = _mix(key[:, None] + torch.arange(vocab, device=seeds.device, dtype=torch.int64)[None, :] * _GOLDEN)
    # 23 bits: (2**23 - 0.5) is exact in float32, so the value stays strictly below 1 (24 bits would round to 1).
    return (_shift_right(x, 41).float() + 0.5) * (1.0 / (1 << 23))


def filter_top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Zero the probabilities outside each row's top-k, then outside its nucleus (top-k first)."""
    if top_k is None and top_p is None:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if top_k is not None:
        keep &= rank < top_k[:, None]
    if top_p is not None:
        kept = sorted_p * keep
        kept = kept / kept.sum(-1, keepdim=True)
        mass_before = kept.cumsum(-1) - kept
        keep &= mass_before < top_p[:, None]  # the top token always survives
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p * keep)


def sample_counter(
    logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
    seeds: torch.Tensor, positions: torch.Tensor,
) -> torch.Tensor:
    """Torch sampling with counter-based noise: the exponential race argmax(p / E), E ~ Exp(1)."""
    probs = torch.softmax(logits.float() / temperatures[:, None], dim=-1)
    probs = filter_top_k_top_p(probs, top_k, top_p)
    noise = -torch.log(counter_uniform(seeds, positions, logits.shape[-1]))
    return (probs / noise).argmax(dim=-1)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, use_flashinfer: bool, seed: int) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.use_flashinfer = use_flashinfer
        # Same seed on every rank and the same sequence of calls: identical draws everywhere.
        self.generator = torch.Generator(device=device).manual_seed(seed) if use_flashinfer else None

    def prepare(self, batch: Batch) -> SamplingArgs:
        if batch.all_greedy:
            return SamplingArgs(temperatures=None)
        greedy = batch.temperature == 0
        temps = np.maximum(batch.temperature, MIN_T).astype(np.float32)
        top_k = np.where((batch.top_k <= 0) | (batch.top_k > self.vocab_size), self.vocab_size, batch.top_k)
        top_p = np.clip(batch.top_p, MIN_P, 1.0).astype(np.float32)
        dev = self.device
        args = SamplingArgs(temperatures=host_to_device(temps, dev))
        if greedy.any():
            args.greedy = host_to_device(greedy, dev)
        if (top_k != self.vocab_size).any():
            args.top_k = host_to_device(top_k.astype(np.int32 if self.use_flashinfer else np.int64), dev)
        if (top_p < 1.0).any():
            args.top_p = host_to_device(top_p, dev)
        counter_rows = np.flatnonzero(batch.seeded & ~greedy) if self.use_flashinfer else np.arange(batch.size)
        if len(counter_rows):
            args.seeds = host_to_device(batch.seeds[counter_rows].astype(np.int64), dev)
            args.positions = host_to_device(batch.kv_lens[counter_rows].astype(np.int64), dev)
            if self.use_flashinfer:
                args.seeded_rows = host_to_device(counter_rows.astype(np.int64), dev)
        return args

    def sample(self, logits: torch.Tensor, args: SamplingArgs) -> torch.Tensor:
        if args.temperatures is None:
            return logits.argmax(dim=-1)
        if self.use_flashinfer:
            out = self._sample_flashinfer(logits, args)
            if args.seeded_rows is not None:
                rows = args.seeded_rows
                out[rows] = sample_counter(
                    logits[rows], args.temperatures[rows],
                    None if args.top_k is None else args.top_k[rows].long(),
                    None if args.top_p is None else args.top_p[rows], args.seeds, args.positions,
                ).to(out.dtype)  # flashinfer returns int32 tokens
        else:
            out = sample_counter(logits, args.temperatures, args.top_k, args.top_p, args.seeds, args.positions)
        if args.greedy is None:
            return out
        return torch.where(args.greedy, logits.argmax(dim=-1), out)

    def _sample_flashinfer(self, logits: torch.Tensor, args: SamplingArgs) -> torch.Tensor:
        from flashinfer import sampling

        gen = self.generator
        if args.top_k is None and args.top_p is None:
            return sample_with_temperature(logits, args.temperatures, gen)
        probs = sampling.softmax(logits, args.temperatures)
        if args.top_p is None:
            return sampling.top_k_sampling_from_probs(probs, args.top_k, generator=gen)
        if args.top_k is None:
            return sampling.top_p_sampling_from_probs(probs, args.top_p, generator=gen)
        return sampling.top_k_top_p_sampling_from_probs(probs, args.top_k, args.top_p, generator=gen)
