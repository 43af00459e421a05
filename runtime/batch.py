"""Requests and batches.

A ``Batch`` is described by a handful of int arrays (rows, start positions,
lengths, where each sampled token goes, newly admitted prompts and pages).
That descriptor is all the engine needs, so non-zero TP ranks can rebuild a
batch from a broadcast without any ``Req`` objects.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

import numpy as np
import torch

from runtime.sampling_params import SamplingParams


class TokenLogprob(TypedDict):
    """One token's logprob under the model's distribution (before temperature / top-k / top-p), JSON-ready."""

    token_id: int
    logprob: float
    top: list[list[int | float]]  # [[token_id, logprob], ...], most likely first; k entries


def _splitmix(x: int) -> int:
    """splitmix64's finaliser, truncated to 63 bits (a valid int64 seed)."""
    x &= 2**64 - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) >> 1


def unseeded_key(run_seed: int, key: object) -> int:
    """The seed of a request without one: a hash of (run seed, the caller's key for the row: a job row's id, a
    prompt's index in its call). It names the row, not the request counter, the replica or the batch, so a
    row draws the same tokens at any data-parallel size, in any input order and after a resume; and it does
    not collide with small user seeds (``seed=3`` and row 3 must not draw the same noise)."""
    digest = int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")
    return _splitmix(run_seed * 0x9E3779B97F4A7C15 + digest + 0x632BE59BD9B4E019)


def sample_seed(seed: int, sample_index: int) -> int:
    """The seed of sample ``sample_index`` of a request seeded with ``seed``: sample 0 keeps ``seed`` (n=1 draws
    exactly what it always drew); the others hash (seed, index) with their own constant, so they collide
    neither with each other, nor with small user seeds, nor with ``unseeded_key`` streams."""
    if sample_index == 0:
        return seed
    return _splitmix(seed * 0xD1B54A32D192ED03 + sample_index * 0x9E3779B97F4A7C15 + 0x2545F4914F6CDD1D)


@dataclass(eq=False)
class Req:
    uid: int
    prompt_ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int  # after clamping to the maximum sequence length
    stream: int = 0  # the seed of an unseeded request (``unseeded_key``); a request's own seed wins
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
    sampling_row: tuple = ()  # (temperature, top_k, top_p, seed), fixed for the request's life
    # n > 1: sample i of a prompt is a request of its own; the siblings (i > 0) point at sample 0.
    sample_index: int = 0
    leader: Req | None = None  # sample 0, whose prompt KV the siblings wait for in the prefix cache
    prompt_cached: bool = False  # the whole prompt's KV has been offered to the prefix cache
    # Logprobs (None when not asked): per generated token, and per prompt token (None for the first).
    output_logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs
    prompt_logprobs: list[TokenLogprob | None] | None = None  # asked of sample 0 only: the prompt is shared
    logprob_ks: tuple[int, int] = (-1, -1)  # (logprobs k, prompt_logprobs k) for the batch; -1 = off

    def __post_init__(self) -> None:
        self.device_len = len(self.prompt_ids)
        p = self.sampling
        seed = sample_seed(p.seed if p.seed is not None else self.stream, self.sample_index)
        temperature = 0.0 if p.is_greedy else p.temperature
        top_k = p.top_k if 0 < p.top_k < 2**31 else -1  # beyond int32 it cannot restrict any vocabulary
        self.sampling_row = (temperature, top_k, p.top_p, seed)
        prompt_k = p.prompt_logprobs if self.sample_index == 0 and p.prompt_logprobs is not None else -1
        self.logprob_ks = (-1 if p.logprobs is None else p.logprobs, prompt_k)
        if p.logprobs is not None:
            self.output_logprobs, self.cumulative_logprob = [], 0.0
        if prompt_k >= 0:
            self.prompt_logprobs = [None]  # the first prompt token has no context to be predicted from

    @property
    def wants_logprobs(self) -> bool:
        return self.logprob_ks != (-1, -1)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Every prompt position must be computed (no cached prefix may stand in for it)."""
        return self.logprob_ks[1] >= 0

    def make_sibling(self, uid: int, sample_index: int) -> Req:
        """Sample ``sample_index`` (>= 1) of this request's prompt: same prompt, parameters and input index,
        its own ``uid`` and its own seed derived from the prompt's (``sample_seed``).

        Add it to the scheduler after this request: with the radix cache it is admitted only once this
        request's prompt KV is cached, and then computes just the prompt's last partial page.
        """
        assert self.sample_index == 0 and sample_index >= 1, "siblings hang off sample 0"
        sibling = Req(uid, self.prompt_ids, self.sampling, self.max_new_tokens, stream=self.stream,
                      index=self.index, sample_index=sample_index, leader=self)
        if self.detok is not None:  # stop strings: each sample detokenizes its own text
            sibling.detok = type(self.detok)(self.detok.tokenizer)
        return sibling

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


def make_sample_group(first: Req, uids: list[int]) -> list[Req]:
    """``[first, sibling 1, ...]``: the ``len(uids) + 1`` samples of ``first``'s prompt (``SamplingParams.n``),
    ``uids`` being fresh request ids for the siblings. Add them to the scheduler in this order."""
    return [first] + [first.make_sibling(uid, i) for i, uid in enumerate(uids, start=1)]


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
    seeds: np.ndarray  # int64 [B]: each request's noise seed (runtime.engine.sampler)
    # Newly admitted requests: their rows, prompt tokens and KV pages, written before the step.
    admit_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    admit_token_lens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    admit_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    admit_page_lens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    admit_pages: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    # Logprobs, per row (-1: this row does not ask); None when no row asks, so such steps do nothing extra.
    logprobs: np.ndarray | None = None  # int32 [B]: alternatives reported with each sampled token
    prompt_logprobs: np.ndarray | None = None  # int32 [B], prefill only: the same for the chunk's prompt tokens
    reqs: list[Req] = field(default_factory=list)  # rank 0 only
    # Filled by the engine before the forward pass.
    padded_size: int = 0
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    out_loc: torch.Tensor | None = None
    req_rows: torch.Tensor | None = None  # decode: each request's page-table row, on the device
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
