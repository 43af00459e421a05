"""The server's Prometheus metrics (``GET /metrics``): queue and KV gauges read at scrape time, token
counters and latency histograms observed once per request (never per token)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from runtime.frontend.llm import LLM
from runtime.frontend.serving import Call, Observer, Serving

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60, 120)
_TOKEN_GAP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1)


class Metrics:
    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.started = time.time()
        self.registry = r = CollectorRegistry()
        sched = llm.scheduler
        Gauge("tpinfer_requests_running", "Requests admitted (prefilling or decoding)",
              registry=r).set_function(lambda: len(sched.running) + len(sched.prefilling))
        Gauge("tpinfer_kv_pages_total", "KV cache pages requests can hold", registry=r).set(
            sched.allocator.num_pages - 1)
        # Pages of cached prefixes that nobody holds can be evicted at any time: they count as free.
        Gauge("tpinfer_kv_pages_in_use", "KV cache pages held by admitted requests", registry=r).set_function(
            lambda: sched.allocator.num_pages - 1 - sched.allocator.num_free - sched.cache.evictable_pages)
        self._waiting = Gauge("tpinfer_requests_waiting", "Requests not admitted yet", registry=r)
        self.prompt_tokens = Counter("tpinfer_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter("tpinfer_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("tpinfer_requests", "Requests finished, by outcome", ["outcome"], registry=r)
        self.rejected = Counter("tpinfer_rejected_requests", "Requests refused before admission", ["reason"],
                                registry=r)
        self.ttft = Histogram("tpinfer_time_to_first_token_seconds", "Arrival to first token on the host",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("tpinfer_time_per_output_token_seconds", "Mean gap between a request's tokens",
                              buckets=_TOKEN_GAP_BUCKETS, registry=r)
        self.latency = Histogram("tpinfer_request_latency_seconds", "Arrival to last token",
                                 buckets=_LATENCY_BUCKETS, registry=r)

    def watch(self, serving: Serving) -> None:
        self._waiting.set_function(lambda: serving.queued)

    def observer(self) -> Observer:
        return Observer(on_first_token=self._first_token, on_finish=self._finished)

    def _first_token(self, call: Call) -> None:
        self.ttft.observe(call.first_token_at - call.started)

    def _finished(self, call: Call) -> None:
        now = time.monotonic()
        tokens = [len(r.output_ids) for r in call.reqs]
        if not call.prompt_only:  # its tokens were dropped, not sent
            self.generated_tokens.inc(sum(tokens))
        self.prompt_tokens.inc(call.prompt_tokens)
        self.requests.labels("aborted" if call.cut else "finished").inc()
        self.latency.observe(now - call.started)
        if call.first_token_at is not None and max(tokens) > 1:
            self.tpot.observe((now - call.first_token_at) / (max(tokens) - 1))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
