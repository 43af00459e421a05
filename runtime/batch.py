"""Requests and batches; a ``Batch`` is plain int arrays so other TP ranks can rebuild it without ``Req``s."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

import numpy as np
import torch

from runtime.sampling_params import SamplingParams


class TokenLogprob(TypedDict):
    """One token's logprob under the model's distribution (before penalties, temperature, top-k, top-p, min-p)."""

    token_id: int
    logprob: float
    top: list[list[int | float]]  # [[token_id, logprob], ...], most likely first


def _splitmix(x: int) -> int:
    """splitmix64's finaliser, truncated to 63 bits (a valid int64 seed)."""
    x &= 2**64 - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) >> 1


def unseeded_key(run_seed: int, key: object) -> int:
    """Seed of an unseeded request, hashed from (run seed, row key) so a row draws the same tokens at any DP
    size, input order or resume, without colliding with small user seeds."""
    digest = int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")
    return _splitmix(run_seed * 0x9E3779B97F4A7C15 + digest + 0x632BE59BD9B4E019)


def sample_seed(seed: int, sample_index: int) -> int:
    """Seed of sample ``sample_index``: sample 0 keeps ``seed``; the others get non-colliding hashes."""
    if sample_index == 0:
        return seed
    return _splitmix(seed * 0xD1B54A32D192ED03 + sample_index * 0x9E3779B97F4A7C15 + 0x2545F4914F6CDD1D)


@dataclass(eq=False)
class Req:
    uid: int
    prompt_ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int  # clamped to the maximum sequence length
    stream: int = 0  # seed used when the request has none (``unseeded_key``)
    index: int = -1
    table_idx: int = -1
    pages: list[int] = field(default_factory=list)
    own_pages: list[int] = field(default_factory=list)  # pages to give back (not the radix tree's)
    cache_node: Any = None  # radix node kept locked while the request runs
    cached_len: int = 0  # tokens whose KV is written (as of the last launched step)
    device_len: int = 0  # prompt + launched samples in the device token pool
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text: str | None = None  # set where a stop string cut the text; else the text decodes ``text_ids``
    stop_token_hidden: bool = False  # it ended on an EOS or one of ``stop_token_ids``: not in the text (as vLLM)
    detok: Any = None
    sampling_row: tuple = ()
    logit_row: tuple = ()  # (min_p, presence, frequency, repetition penalty), rows with ``adjusts_logits`` only
    logit_bias: tuple[np.ndarray, np.ndarray] | None = None  # (int32 token ids, float32 biases), made once
    # Its logits change before sampling (min_p, a penalty, a logit bias): batches then carry those. Fixed when
    # made, so the scheduler's count of such requests holds even if the caller edits the params later.
    adjusts_logits: bool = False
    sample_index: int = 0
    leader: Req | None = None  # sample 0: siblings wait for its prompt KV in the prefix cache
    prompt_cached: bool = False
    output_logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # sample 0 only: the prompt is shared
    logprob_ks: tuple[int, int] = (-1, -1)  # (logprobs k, prompt_logprobs k); -1 = off

    @property
    def text_ids(self) -> list[int]:
        """The output tokens the text shows."""
        return self.output_ids[:-1] if self.stop_token_hidden else self.output_ids

    def __post_init__(self) -> None:
        self.device_len = len(self.prompt_ids)
        p = self.sampling
        seed = sample_seed(p.seed if p.seed is not None else self.stream, self.sample_index)
        temperature = 0.0 if p.is_greedy else p.temperature
        top_k = p.top_k if 0 < p.top_k < 2**31 else -1
        self.sampling_row = (temperature, top_k, p.top_p, seed)
        self.logit_row = (0.0 if temperature == 0 else p.min_p, p.presence_penalty, p.frequency_penalty,
                          p.repetition_penalty)
        self.adjusts_logits = self.logit_row[0] > 0 or p.adjusts_logits
        if p.logit_bias:
            self.logit_bias = (np.fromiter(p.logit_bias.keys(), np.int32, len(p.logit_bias)),
                               np.fromiter(p.logit_bias.values(), np.float32, len(p.logit_bias)))
        prompt_k = p.prompt_logprobs if self.sample_index == 0 and p.prompt_logprobs is not None else -1
        self.logprob_ks = (-1 if p.logprobs is None else p.logprobs, prompt_k)
        if p.logprobs is not None:
            self.output_logprobs, self.cumulative_logprob = [], 0.0
        if prompt_k >= 0:
            self.prompt_logprobs = [None]

    @property
    def wants_logprobs(self) -> bool:
        return self.logprob_ks != (-1, -1)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Every prompt position must be computed: no cached prefix may stand in."""
        return self.logprob_ks[1] >= 0

    def make_sibling(self, uid: int, sample_index: int) -> Req:
        """Sample ``sample_index`` (>= 1) of this prompt; add it to the scheduler after this request so it
        reuses this request's cached prompt KV."""
        assert self.sample_index == 0 and sample_index >= 1, "siblings hang off sample 0"
        sibling = Req(uid, self.prompt_ids, self.sampling, self.max_new_tokens, stream=self.stream,
                      index=self.index, sample_index=sample_index, leader=self)
        if self.detok is not None:
            sibling.detok = type(self.detok)(self.detok.tokenizer, self.detok.strips)
        return sibling

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def prefill_done(self) -> bool:
        return self.cached_len >= self.prompt_len

    @property
    def launched_new(self) -> int:
        return self.device_len - self.prompt_len

    @property
    def wants_decode(self) -> bool:
        return self.finish_reason is None and self.prefill_done and self.launched_new < self.max_new_tokens

    def complete_one(self, ext_len: int) -> None:
        """Advance host bookkeeping for a launched step of ``ext_len`` tokens."""
        self.cached_len += ext_len
        if self.cached_len == self.device_len:
            self.device_len += 1


def make_sample_group(first: Req, uids: list[int]) -> list[Req]:
    """``[first, sibling 1, ...]`` for ``SamplingParams.n``; add them to the scheduler in this order."""
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
    top_p: np.ndarray
    seeds: np.ndarray
    # Newly admitted requests, written before the step.
    admit_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    admit_token_lens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    admit_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    admit_page_lens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    admit_pages: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    # Per row k (-1: off); None when no row asks
    logprobs: np.ndarray | None = None
    prompt_logprobs: np.ndarray | None = None
    # Per row float32 (0, 0, 0, 1: off) and int32 prompt lengths; None when no row adjusts its logits
    min_p: np.ndarray | None = None
    presence_penalty: np.ndarray | None = None
    frequency_penalty: np.ndarray | None = None
    repetition_penalty: np.ndarray | None = None
    prompt_lens: np.ndarray | None = None
    # Logit biases: int32 entries per row, then every row's int32 token ids and float32 biases; None when none
    bias_counts: np.ndarray | None = None
    bias_tokens: np.ndarray | None = None
    bias_values: np.ndarray | None = None
    reqs: list[Req] = field(default_factory=list)  # rank 0 only
    padded_size: int = 0
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    out_loc: torch.Tensor | None = None
    req_rows: torch.Tensor | None = None
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
