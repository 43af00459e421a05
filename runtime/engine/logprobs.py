"""Logprobs of the model's own distribution: log_softmax of the float32 logits, before temperature, top-k and
top-p. Computed on the device for the rows that ask, copied to the host with the sampled tokens (no sync).

Two kinds, one shape (``LogprobBlock``): each asking row's sampled token (one entry per row), and prompt
tokens (every position p of the row's chunk whose next token, p + 1, is a prompt token: the entry is that
token's logprob given the tokens up to p). Prompt entries need the LM head at every position of the chunk,
so ``LogprobPlan.extra_index`` adds those positions after the usual one-per-row last positions: the
sampling logits stay ``logits[:n]`` and the prompt entries' logits are ``logits[n:]``, in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runtime.batch import Batch, Req, TokenLogprob
from runtime.utils import concat_ranges

BLOCK_ROWS = 1024  # logits rows per log_softmax: bounds the float32 temporaries of a long prompt chunk


@dataclass
class LogprobPlan:
    """Host side: which rows and positions get logprobs this step; built from the batch descriptor alone,
    so every TP rank plans the same step. The engine uploads the index arrays with its other inputs."""

    out_rows: np.ndarray  # batch rows whose sampled token gets a logprob (mid-prompt chunks sample nothing)
    out_ks: np.ndarray  # alternatives per such row
    prompt_rows: np.ndarray  # batch rows with prompt entries in this chunk
    prompt_counts: np.ndarray  # entries per such row
    prompt_ks: np.ndarray
    extra_index: np.ndarray  # packed token index of each prompt entry's position: extra LM-head rows
    target_rows: np.ndarray  # token-pool row and position of each prompt entry's token (position + 1)
    target_pos: np.ndarray
    out_rows_dev: torch.Tensor | None = None
    target_tokens: torch.Tensor | None = None  # gathered from the token pool once admissions are written

    def upload_parts(self) -> list[np.ndarray]:
        return [self.out_rows, self.target_rows, self.target_pos]

    def bind(self, parts: list[torch.Tensor], token_pool: torch.Tensor) -> None:
        self.out_rows_dev = parts[0]
        self.target_tokens = token_pool[parts[1], parts[2]]


def plan_logprobs(batch: Batch, dummy_row: int) -> LogprobPlan | None:
    """None when no row asks (the usual step: nothing extra is computed, uploaded or copied back)."""
    if batch.logprobs is None and batch.prompt_logprobs is None:
        return None
    empty = np.zeros(0, np.int64)
    samples = batch.sample_rows != dummy_row
    out_rows = empty if batch.logprobs is None else np.flatnonzero((batch.logprobs >= 0) & samples)
    prompt_rows, counts, offsets = empty, empty, empty
    if batch.prompt_logprobs is not None and not batch.is_decode:
        # The chunk that completes the prompt ends at its last token, whose logits give a sampled token.
        all_counts = batch.ext_lens.astype(np.int64) - samples
        prompt_rows = np.flatnonzero((batch.prompt_logprobs >= 0) & (all_counts > 0))
        counts = all_counts[prompt_rows]
        offsets = (np.cumsum(batch.ext_lens) - batch.ext_lens)[prompt_rows]
    if not len(out_rows) and not len(prompt_rows):
        return None
    return LogprobPlan(
        out_rows=out_rows, out_ks=empty if batch.logprobs is None else batch.logprobs[out_rows],
        prompt_rows=prompt_rows, prompt_counts=counts,
        prompt_ks=empty if batch.prompt_logprobs is None else batch.prompt_logprobs[prompt_rows],
        extra_index=concat_ranges(counts, offsets),
        target_rows=np.repeat(batch.rows[prompt_rows], counts),
        target_pos=concat_ranges(counts, batch.starts[prompt_rows] + 1),
    )


@dataclass
class LogprobBlock:
    token_ids: torch.Tensor  # [E] the token each entry is about
    logprobs: torch.Tensor  # float32 [E]
    top_ids: torch.Tensor  # int64 [E, K]: K = the largest k asked in the block
    top_logprobs: torch.Tensor  # float32 [E, K]

    def to_host(self) -> LogprobBlock:
        """Pinned host copies enqueued on the current stream (the step's copy event covers them)."""
        def copy(t: torch.Tensor) -> torch.Tensor:
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

        return LogprobBlock(*(copy(t) for t in (self.token_ids, self.logprobs, self.top_ids, self.top_logprobs)))

    def entries(self, ks: np.ndarray, counts: np.ndarray) -> list[TokenLogprob]:
        """Host side, after the copy: one entry per row of the block, each row's top cut to its own k."""
        # This runs on rank 0 between steps for every asking row: plain list building only (3x faster than
        # slicing each row; at 256 rows x top 5 it was 2 ms a step, enough to leave the GPU idle).
        tokens, lps = self.token_ids.tolist(), self.logprobs.tolist()
        ids, vals = self.top_ids.tolist(), self.top_logprobs.tolist()
        width = self.top_ids.shape[1]
        row_k = np.repeat(ks, counts).tolist()
        return [
            {"token_id": t, "logprob": lp,
             "top": list(map(list, zip(ti, tv) if k == width else zip(ti[:k], tv[:k])))}
            for t, lp, ti, tv, k in zip(tokens, lps, ids, vals, row_k)
        ]


def logprob_block(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobBlock:
    """log_softmax in float32 (whatever the logits' dtype), the tokens' entries and the top ``k``."""
    lps, top_ids, top_lps = [], [], []
    for lo in range(0, logits.shape[0], BLOCK_ROWS):
        lsm = torch.log_softmax(logits[lo : lo + BLOCK_ROWS].float(), dim=-1)
        lps.append(lsm.gather(1, token_ids[lo : lo + BLOCK_ROWS, None].long())[:, 0])
        if k:
            values, indices = lsm.topk(k, dim=-1)
        else:  # only the tokens' own logprobs were asked for
            values, indices = lsm[:, :0], torch.zeros_like(lsm[:, :0], dtype=torch.int64)
        top_ids.append(indices)
        top_lps.append(values)
    return LogprobBlock(token_ids.long(), torch.cat(lps), torch.cat(top_ids), torch.cat(top_lps))


@dataclass
class LogprobsOutput:
    """A step's logprobs (device tensors, or host copies from ``to_host``), applied to requests on rank 0."""

    plan: LogprobPlan
    sampled: LogprobBlock | None  # one entry per ``plan.out_rows``
    prompt: LogprobBlock | None  # ``plan.prompt_counts`` entries per ``plan.prompt_rows``

    def to_host(self) -> LogprobsOutput:
        sampled = self.sampled.to_host() if self.sampled is not None else None
        return LogprobsOutput(self.plan, sampled, self.prompt.to_host() if self.prompt is not None else None)

    def apply(self, reqs: list[Req]) -> None:
        """Append the entries to their requests; call before this step's tokens are appended (a request that
        finished while the step was in flight gets neither)."""
        plan = self.plan
        if self.sampled is not None:
            entries = self.sampled.entries(plan.out_ks, np.ones(len(plan.out_rows), np.int64))
            for row, entry in zip(plan.out_rows.tolist(), entries):
                req = reqs[row]
                if req.finish_reason is None:
                    req.output_logprobs.append(entry)
                    req.cumulative_logprob += entry["logprob"]
        if self.prompt is not None:
            entries = self.prompt.entries(plan.prompt_ks, plan.prompt_counts)
            start = 0
            for row, count in zip(plan.prompt_rows.tolist(), plan.prompt_counts.tolist()):
                req = reqs[row]
                if req.finish_reason is None:
                    req.prompt_logprobs.extend(entries[start : start + count])
                start += count


def compute_logprobs(plan: LogprobPlan, logits: torch.Tensor, next_tokens: torch.Tensor, n: int) -> LogprobsOutput:
    """On the device, after sampling (the sampler never writes into ``logits``): ``logits[:n]`` are the rows'
    last positions (a CUDA graph's static buffer for decode), ``logits[n:]`` the plan's prompt positions."""
    sampled = prompt = None
    if len(plan.out_rows):
        rows = plan.out_rows_dev
        sampled = logprob_block(logits[rows], next_tokens[rows], int(plan.out_ks.max()))
    if len(plan.prompt_rows):
        prompt = logprob_block(logits[n:], plan.target_tokens, int(plan.prompt_ks.max()))
    return LogprobsOutput(plan, sampled, prompt)
