"""What the API returns per prompt, and how finished requests become it (n samples per prompt included)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.batch import Req, TokenLogprob
from runtime.output import SampleOutput


@dataclass
class RequestOutput:
    """One prompt's result: the flat fields are sample 0's; ``outputs`` holds every sample, sample 0 first."""

    index: int
    text: str = ""
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    outputs: list[SampleOutput] = field(default_factory=list)

    @property
    def total_completion_tokens(self) -> int:
        return sum(s.completion_tokens for s in self.outputs)


class Results:
    """Collects the results of one ``LLM.run`` by input position; a prompt completes once all its samples do.

    With ``keep=False`` each output goes to ``on_result`` only and nothing of it stays: a job of millions of rows
    holds only the prompts in flight.
    """

    def __init__(self, decode: Callable[[list[int]], str], on_result: Callable[[Any, RequestOutput], None] | None,
                 keep: bool = True):
        self.decode = decode
        self.on_result = on_result
        self.keep = keep
        self.positions = 0
        self.completion_tokens = 0
        self._keys: dict[int, Any] = {}
        self.done: dict[int, RequestOutput] = {}
        self._samples: dict[int, list[SampleOutput]] = {}

    def new_position(self, key: Any) -> int:
        self._keys[self.positions] = key
        self.positions += 1
        return self.positions - 1

    def fail(self, position: int, message: str) -> None:
        self._complete(RequestOutput(index=position, error=message))

    def finished(self, req: Req) -> None:
        samples = self._samples.setdefault(req.index, [])
        samples.append(SampleOutput.from_req(req, self.decode))
        if len(samples) < req.sampling.n:
            return
        del self._samples[req.index]
        samples.sort(key=lambda s: s.sample_index)
        first = samples[0]
        prompt_owner = req.leader or req
        self._complete(RequestOutput(
            index=req.index, text=first.text, token_ids=first.token_ids, finish_reason=first.finish_reason,
            prompt_tokens=req.prompt_len, completion_tokens=first.completion_tokens, logprobs=first.logprobs,
            cumulative_logprob=first.cumulative_logprob, prompt_logprobs=prompt_owner.prompt_logprobs,
            outputs=samples,
        ))

    def _complete(self, out: RequestOutput) -> None:
        self.completion_tokens += out.total_completion_tokens
        if self.keep:
            self.done[out.index] = out
            key = self._keys[out.index]
        else:
            key = self._keys.pop(out.index)
        if self.on_result is not None:
            self.on_result(key, out)

    def in_order(self) -> list[RequestOutput]:
        """Every position's output (none with ``keep=False``); one cut short by a drain is an error saying so."""
        if not self.keep:
            return []
        return [self.done.get(i) or RequestOutput(index=i, error="interrupted before it finished")
                for i in range(self.positions)]
