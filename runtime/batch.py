"""Requests and batches.

A ``Batch`` is described by a handful of int arrays (rows, start positions,
lengths, where each sampled token goes, newly admitted prompts and pages).
That descriptor is all the engine needs, so non-zero TP ranks can rebuild a
batch from a broadcast without any ``Req`` objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from runtime.sampling_params import SamplingParams


def unseeded_key(run_seed: int, uid: int) -> int:
    """The RNG key of a request without a seed: a splitmix64 hash of (run seed, request id), so it does
    not collide with small user seeds (``seed=3`` and request 3 must not draw the same noise)."""
    x = (run_seed * 0x9E3779B97F4A7C15 + uid + 0x632BE59BD9B4E019) & (2**64 - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) >> 1  # 63 bits: a valid int64 seed


@dataclass(eq=False)
class Req:
    uid: int
    prompt_ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int  # after clamping to the maximum sequence length
    run_seed: int = 0  # engine.seed: unseeded requests draw from (run_seed, uid)
    index: int = -1  # position in the caller's input list (results come back in input order)
    table_idx: int = -1  # row of the page table and token pool while admitted
    pages: list[int] = field(default_factory=list)
    own_pages: list[int] = field(default_factory=list)  # pages this request must give back (not the tree's)
    cache_node: Any = None  # radix node this request keeps locked (its cached prefix ends there)
    cached_len: int = 0  # tokens whose KV is written (as of the last launched step)
    device_len: int = 0  # tokens the device token pool holds (prompt + launched samples)
    output_ids: list[int] = field(default_factory=list)  # tokens received on the host
    finish_reason: str | None = None
    text: str | None = None  # set when a stop string cut the text; otherwise decoded at the end
    detok: Any = None  # incremental detokenizer, only for requests with stop strings
    sampling_row: tuple = ()  # (temperature, top_k, top_p, seed, seeded), fixed for the request's life

    def __post_init__(self) -> None:
        self.device_len = len(self.prompt_ids)
        p = self.sampling
        seed = p.seed if p.seed is not None else unseeded_key(self.run_seed, self.uid)
        temperature = 0.0 if p.is_greedy else p.temperature
        top_k = p.top_k if 0 < p.top_k < 2**31 else -1  # beyond int32 it cannot restrict any vocabulary
        self.sampling_row = (temperature, top_k, p.top_p, seed, p.seed is not None)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def prefill_done(self) -> bool:
        return self.cached_len >= self.prompt_len

    @property
    def launched_new(self) -> int:
        """Tokens whose sampling has been launched (some may still be in flight)."""
        return self.device_len - self.prompt_len

    @property
    def wants_decode(self) -> bool:
        return self.finish_reason is None and self.prefill_done and self.launched_new < self.max_new_tokens

    def complete_one(self, ext_len: int) -> None:
        """Advance host bookkeeping for a launched step of ``ext_len`` tokens."""
        self.cached_len += ext_len
        if self.cached_len == self.device_len:
            self.device_len += 1  # the step samples the next token into the pool


@dataclass
class Batch:
    phase: Literal["prefill", "decode"]
    rows: np.ndarray  # int32 [B]: page-table / token-pool row of each request
    starts: np.ndarray  # int32 [B]: first position computed this step
    ext_lens: np.ndarray  # int32 [B]: tokens computed this step
    sample_rows: np.ndarray  # int32 [B]: row the sampled token is written to (the dummy row discards it)
    temperature: np.ndarray  # float32 [B], 0 = greedy
    top_k: np.ndarray  # int32 [B], <= 0 disables
    top_p: np.ndarray  # float32 [B]
    seeds: np.ndarray  # int64 [B]: counter-RNG seed for each request
    seeded: np.ndarray  # bool [B]: the request asked for a seed (must not depend on batching)
    # Newly admitted requests: their rows, prompt tokens and KV pages, written before the step.
    admit_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    admit_token_lens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    admit_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    admit_page_lens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    admit_pages: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    reqs: list[Req] = field(default_factory=list)  # rank 0 only
    # Filled by the engine before the forward pass.
    padded_size: int = 0
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    out_loc: torch.Tensor | None = None
    logits_indices: torch.Tensor | None = None
    attn_meta: Any = None

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def is_decode(self) -> bool:
        return self.phase == "decode"

    @property
    def num_tokens(self) -> int:
        return int(self.ext_lens.sum())

    @property
    def kv_lens(self) -> np.ndarray:
        return self.starts + self.ext_lens

    @property
    def all_greedy(self) -> bool:
        return not self.temperature.any()
