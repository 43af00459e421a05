"""Append each step's sampled tokens and detect finished requests (runs while the GPU computes the next step)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runtime.batch import Batch, Req, TokenLogprob


@dataclass
class SampleOutput:
    """One sample of a prompt (``SamplingParams.n``); prompt data comes from sample 0."""

    sample_index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    completion_tokens: int
    logprobs: list[TokenLogprob] | None = None  # one per token id
    cumulative_logprob: float | None = None
    shown_tokens: int = 0  # the leading token ids the text shows (OpenAI's logprobs list only these)
    stop_token_hidden: bool = False  # the last token id is an EOS or stop token the text leaves out

    @classmethod
    def from_req(cls, req: Req, decode: Callable[[list[int]], str]) -> SampleOutput:
        text = req.text if req.text is not None else decode(req.text_ids)
        shown = shown_tokens(req, decode) if req.output_logprobs is not None else len(req.text_ids)
        return cls(req.sample_index, text, list(req.output_ids), req.finish_reason, len(req.output_ids),
                   req.output_logprobs, req.cumulative_logprob, shown, req.stop_token_hidden)


def shown_tokens(req: Req, decode: Callable[[list[int]], str]) -> int:
    """How many leading output tokens the text shows: not a hidden EOS or stop token, and where a stop string cut
    the text, the fewest tokens that spell it (found by decoding prefixes: only such requests pay). A token that
    finishes a character begun before the cut counts, though its prefix alone decodes that character as U+FFFD."""
    ids = req.text_ids
    if req.text is None:
        return len(ids)
    text, lo, hi = req.text, 0, len(ids)
    while lo < hi:  # the fewest tokens k whose text starts with the cut text
        k = (lo + hi) // 2
        if decode(ids[:k]).startswith(text):
            hi = k
        else:
            lo = k + 1
    return lo


class OutputProcessor:
    def __init__(self, eos_ids: set[int], dummy_row: int) -> None:
        self.eos_ids = frozenset(eos_ids)
        self.dummy_row = dummy_row

    def process(self, batch: Batch, output: Any) -> list[Req]:
        """Take a finished step's tokens; returns the requests that finished with them."""
        if output.copy_done_event is not None:
            output.copy_done_event.synchronize()
        if output.logprobs is not None:  # before the tokens: a request finishing now still gets its last entry
            output.logprobs.apply(batch.reqs)
        tokens = output.next_tokens_cpu.tolist()
        finished = []
        for req, token, row in zip(batch.reqs, tokens, batch.sample_rows.tolist()):
            if row == self.dummy_row or req.finish_reason is not None:
                continue  # a mid-prompt chunk, or a request that finished while this step was in flight
            req.output_ids.append(token)
            req.finish_reason = self.finish_reason(req, token)
            if req.finish_reason is not None:
                finished.append(req)
        return finished

    def finish_reason(self, req: Req, token: int) -> str | None:
        params = req.sampling
        if (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            req.stop_token_hidden = True
            return "stop"
        if req.detok is not None:
            new = req.detok.push(token)
            at = find_stop(req.detok.text, len(new), params.stop) if new else -1
            if at >= 0:
                req.text = req.detok.text[:at]
                return "stop"
        if len(req.output_ids) >= req.max_new_tokens:
            return "length"
        return None


def find_stop(text: str, new_len: int, stops: list[str]) -> int:
    """Index in ``text`` where the earliest stop string that the last ``new_len`` characters completed starts, or -1."""
    best = -1
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        at = text.find(stop, start)
        if at != -1 and (best == -1 or at < best):
            best = at
    return best
