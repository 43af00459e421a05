"""Logprobs of the model's own distribution, before temperature, top-k and top-p. Prompt entries need the LM head
at every chunk position: their logits follow the sampling rows' ``logits[:n]``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runtime.batch import Batch, Req, TokenLogprob
from runtime.utils import concat_ranges

BLOCK_ROWS = 1024  # bounds the float32 temporaries of a long prompt chunk


@dataclass
class LogprobPlan:
    """Which rows and positions get logprobs; built from the batch descriptor alone, so every TP rank agrees."""

    out_rows: np.ndarray
    out_ks: np.ndarray
    prompt_rows: np.ndarray
    prompt_counts: np.ndarray
    prompt_ks: np.ndarray
    extra_index: np.ndarray
    target_rows: np.ndarray
    target_pos: np.ndarray
    out_rows_dev: torch.Tensor | None = None
    target_tokens: torch.Tensor | None = None  # gathered once admissions are written

    def upload_parts(self) -> list[np.ndarray]:
        return [self.out_rows, self.target_rows, self.target_pos]

    def bind(self, parts: list[torch.Tensor], token_pool: torch.Tensor) -> None:
        self.out_rows_dev = parts[0]
        self.target_tokens = token_pool[parts[1], parts[2]]


def plan_logprobs(batch: Batch, dummy_row: int) -> LogprobPlan | None:
    """None when no row asks."""
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
    token_ids: torch.Tensor
    logprobs: torch.Tensor
    top_ids: torch.Tensor  # [E, K]: K = the largest k asked in the block
    top_logprobs: torch.Tensor

    def to_host(self) -> LogprobBlock:
        """Pinned host copies, covered by the step's copy event."""
        def copy(t: torch.Tensor) -> torch.Tensor:
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

        return LogprobBlock(*(copy(t) for t in (self.token_ids, self.logprobs, self.top_ids, self.top_logprobs)))

    def entries(self, ks: np.ndarray, counts: np.ndarray) -> list[TokenLogprob]:
        # Runs on rank 0 between steps: plain list building, since slicing each row can leave the GPU idle.
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
    lps, top_ids, top_lps = [], [], []
    for lo in range(0, logits.shape[0], BLOCK_ROWS):
        lsm = torch.log_softmax(logits[lo : lo + BLOCK_ROWS].float(), dim=-1)
        lps.append(lsm.gather(1, token_ids[lo : lo + BLOCK_ROWS, None].long())[:, 0])
        if k:
            values, indices = lsm.topk(k, dim=-1)
        else:
            values, indices = lsm[:, :0], torch.zeros_like(lsm[:, :0], dtype=torch.int64)
        top_ids.append(indices)
        top_lps.append(values)
    return LogprobBlock(token_ids.long(), torch.cat(lps), torch.cat(top_ids), torch.cat(top_lps))


@dataclass
class LogprobsOutput:
    """A step's logprobs, applied to requests on rank 0."""

    plan: LogprobPlan
    sampled: LogprobBlock | None
    prompt: LogprobBlock | None

    def to_host(self) -> LogprobsOutput:
        sampled = self.sampled.to_host() if self.sampled is not None else None
        return LogprobsOutput(self.plan, sampled, self.prompt.to_host() if self.prompt is not None else None)

    def apply(self, reqs: list[Req]) -> None:
        """Append the entries to their requests; call before this step's tokens are appended."""
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
    """On the device, after sampling (which never writes into ``logits``)."""
    sampled = prompt = None
    if len(plan.out_rows):
        rows = plan.out_rows_dev
        sampled = logprob_block(logits[rows], next_tokens[rows], int(plan.out_ks.max()))
    if len(plan.prompt_rows):
        prompt = logprob_block(logits[n:], plan.target_tokens, int(plan.prompt_ks.max()))
    return LogprobsOutput(plan, sampled, prompt)
