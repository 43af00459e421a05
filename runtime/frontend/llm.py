"""The Python API: ``LLM(...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Union

from parallel.state import get_tp
from runtime.batch import Batch, Req, make_sample_group, unseeded_key
from runtime.broadcast import send_batch
from runtime.config import RuntimeConfig, apply_overrides, load_config
from runtime.engine import Engine
from runtime.frontend.results import RequestOutput, Results
from runtime.frontend.signals import Drain
from runtime.frontend.tokenizer import (
    IncrementalDetokenizer,
    decode_continuation,
    eos_token_ids,
    load_tokenizer,
    strips_leading_space,
)
from runtime.loop import run_until_idle
from runtime.output import OutputProcessor
from runtime.sampling_params import SamplingParams
from runtime.scheduler import Scheduler

log = logging.getLogger(__name__)

Prompt = Union[str, list[int], list[dict[str, str]]]
Item = tuple[Any, Prompt, SamplingParams]
ItemSource = Callable[[int], Union[Sequence[Item], None]]
# Requests asked beyond the free rows: the next admission never waits, and no DP replica hoards rows.
REFILL_SLACK = 4


GC_YOUNG_THRESHOLD = 50_000
_gc_lock = threading.Lock()
_gc_quiet: dict[str, Any] = {"loops": 0, "thresholds": None}  # step loops running in this process


@contextlib.contextmanager
def quiet_garbage_collector() -> Iterator[None]:
    """Keep Python's cyclic GC off the step loop: finished requests pile up small containers that the default
    thresholds rescan so often the host falls behind the GPU, and each full pass would walk the model's objects.
    What is alive on entry is frozen (never scanned) until the loop ends: frozen objects are never collected either,
    so a dropped LLM, or the caller's data, must not stay frozen after it. Step loops of several LLMs on several
    threads share one quiet period: the GC comes back when the last of them ends."""
    with _gc_lock:
        if _gc_quiet["loops"] == 0:
            _gc_quiet["thresholds"] = thresholds = gc.get_threshold()
            gc.freeze()
            gc.set_threshold(max(thresholds[0], GC_YOUNG_THRESHOLD), *thresholds[1:])
        _gc_quiet["loops"] += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_quiet["loops"] -= 1
            if _gc_quiet["loops"] == 0:
                gc.set_threshold(*_gc_quiet["thresholds"])
                gc.unfreeze()


def _check_unicode(text: str, what: str) -> None:
    """A lone surrogate (JSON allows "\\ud800") is no character a tokenizer can encode: said as such."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid Unicode: a lone surrogate U+{ord(text[exc.start]):04X} at character "
                         f"{exc.start}") from None


def _kind(prompt: object) -> str:
    if isinstance(prompt, list):
        return f"a list of {', '.join(sorted({type(t).__name__ for t in prompt}))}"
    return type(prompt).__name__


class LLM:
    def __init__(
        self, model: str | os.PathLike[str] | None = None, *, config: RuntimeConfig | None = None,
        overrides: Sequence[str] = (),
    ) -> None:
        # A copy: the caller's config is left as it was, and overrides apply on top of it too.
        cfg = load_config(overrides=overrides) if config is None else apply_overrides(config, overrides)
        if model is not None:
            cfg.model.path = os.fspath(model)
        self.cfg = cfg
        self._closed = False
        self._keepalive_lock = threading.Lock()
        self._generating = threading.Lock()  # one run at a time: the scheduler and engine have one owner
        gc.collect()  # a dropped LLM's cycles go before this one captures CUDA graphs
        self.engine = Engine.from_config(cfg)
        if get_tp().size > 1:
            atexit.register(self.shutdown)  # workers wait for rank 0's STOP
        with self.workers_kept_waiting():  # they wait for a batch from here on; a tokenizer can load slowly
            self.model_dir, self.model_config = self.engine.model_dir, self.engine.model_config
            self.tokenizer = load_tokenizer(self.model_dir)
            # The server gives the step loop its own tokenizer: a fast tokenizer used on two threads fails.
            self.stop_tokenizer = self.tokenizer
            self.eos_ids = eos_token_ids(self.model_dir, self.tokenizer)
            self.strips_leading_space = strips_leading_space(self.tokenizer)
            e = self.engine
            self.scheduler = Scheduler(
                cfg.scheduler, e.num_pages, e.page_size, e.max_seq_len, e.dummy_row, cfg.cache.type,
                cfg.cache.debug_checks,
            )
            self.outputs = OutputProcessor(self.eos_ids, e.dummy_row)
            # Request ids differ between DP replicas (sampling noise comes from row keys, not uids).
            self._next_uid = get_tp().dp_rank << 40
            self.last_stats: dict[str, float] = {}
            self.drain: Drain | None = None
            self.interrupted = False
            self._page_waits = 0

    def encode(self, prompt: Prompt) -> list[int]:
        # Token ids first: one pass over the element types in C (bools are not ids), then the range.
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt is empty")
        if isinstance(prompt, list) and set(map(type, prompt)) <= {int}:
            vocab = self.model_config.vocab_size
            if min(prompt) < 0 or max(prompt) >= vocab:
                bad = [t for t in prompt if not 0 <= t < vocab]
                raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
            return list(prompt)
        if self.tokenizer is None:
            raise ValueError(f"model directory {self.model_dir} has no tokenizer: a prompt must be a list of token ids"
                             f" (int), not {_kind(prompt)}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            _check_unicode(prompt, "prompt")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            for i, m in enumerate(prompt):
                if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                    raise ValueError("each chat message needs string 'role' and 'content' fields")
                _check_unicode(m["content"], f"message {i}'s content")
            text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            return self.tokenizer.encode(text, add_special_tokens=False)
        raise ValueError(f"a prompt must be a string, a list of token ids (int) or a list of chat messages, not "
                         f"{_kind(prompt)}")

    def make_request(self, prompt: Prompt, params: SamplingParams, key: object = None) -> Req:
        """A request for ``prompt``; ``key`` names the row, so unseeded noise is the same at any batch or DP size."""
        params.validate()
        ids = self.encode(prompt)
        if not ids:  # no position to sample from
            raise ValueError("prompt encodes to zero tokens")
        vocab = self.model_config.vocab_size
        # A stop there could never fire, a bias there has no logit to change.
        for name, tokens in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias)):
            bad = [t for t in tokens if t >= vocab]
            if bad:
                raise ValueError(f"{name} {bad[:5]} are outside the vocabulary [0, {vocab})")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings {params.stop} need a tokenizer; model directory {self.model_dir} has none")
        limit = self.engine.max_seq_len
        if len(ids) >= limit:
            raise ValueError(
                f"prompt has {len(ids)} tokens; the maximum sequence length is {limit} (model.max_seq_len),"
                " which must leave room for at least one new token"
            )
        uid = self._take_uid()
        stream = unseeded_key(self.cfg.engine.seed, uid if key is None else key)
        req = Req(uid, ids, params, min(params.max_new_tokens, limit - len(ids)), stream=stream)
        if params.stop:
            req.detok = IncrementalDetokenizer(self.stop_tokenizer, self.strips_leading_space)
        return req

    def make_requests(self, prompt: Prompt, params: SamplingParams, key: object = None) -> list[Req]:
        first = self.make_request(prompt, params, key)
        return make_sample_group(first, [self._take_uid() for _ in range(params.n - 1)])

    def default_sampling(self) -> SamplingParams:
        return SamplingParams(**vars(self.cfg.sampling))

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in input order, a failed request as its error.

        ``sampling_params`` may also be a dict (or a list of dicts) of SamplingParams fields.
        """
        if isinstance(prompts, dict):
            raise TypeError("a single chat message must be wrapped in a list: generate([{'role': ..., 'content': ...}])")
        if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, (str, Iterable)):
            raise TypeError(f"prompts must be a string, a list of token ids, a chat (a list of messages) or a list "
                            f"of these, not {type(prompts).__name__}")
        if isinstance(prompts, tuple) and prompts and isinstance(prompts[0], (int, dict)):
            prompts = list(prompts)  # token ids or a chat as a tuple: one prompt
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.default_sampling()
        if isinstance(sampling_params, (SamplingParams, dict)):
            sampling_params = [sampling_params] * len(prompts)
        if not isinstance(sampling_params, Iterable) or isinstance(sampling_params, (str, bytes)):
            raise TypeError(f"sampling_params must be SamplingParams, a dict of its fields, or a list of either, not "
                            f"{type(sampling_params).__name__}")
        params = [SamplingParams.from_dict(p, self.default_sampling()) if isinstance(p, dict) else p
                  for p in sampling_params]
        if not all(isinstance(p, SamplingParams) for p in params):
            raise TypeError("sampling_params must be SamplingParams, a dict of its fields, or a list of either")
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling parameter sets")
        return self.run([(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))])

    def chat(
        self, conversations: list[dict[str, str]] | Sequence[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Replies to one conversation or a list of them, through the model's chat template."""
        if isinstance(conversations, list) and conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        conversations = list(conversations)  # a generator is read once
        for conversation in conversations:
            if not isinstance(conversation, list) or not all(isinstance(m, dict) for m in conversation):
                raise TypeError("chat takes a conversation (a list of {'role', 'content'} dicts) or a list of them")
        return self.generate(conversations, sampling_params)

    def run(
        self, items: Sequence[Item] | ItemSource, on_result=None, on_batch=None,  # noqa: ANN001
        admit: Callable[[Any, Req], None] | None = None, keep_results: bool = True,
    ) -> list[RequestOutput]:
        """Serve (key, prompt, params) items; ``on_result(key, output)`` fires as each one completes.

        ``items`` is a list, or a source ``source(n)`` returning up to ``n`` more items ([] for none now, None at
        the end), so DP replicas take rows as they have room. ``admit(key, request)`` may refuse a tokenized
        request before it is queued by raising ValueError; its message is the item's error. Runs called from
        several threads take turns. ``keep_results=False``: outputs reach ``on_result`` only and the run returns
        [], so a long job's memory does not grow with the rows it has served.
        """
        with self._generating:
            return self._run(items, on_result, on_batch, admit, keep_results)

    def _run(
        self, items: Sequence[Item] | ItemSource, on_result: Callable[[Any, RequestOutput], None] | None,
        on_batch: Callable[[Batch | None], None] | None, admit: Callable[[Any, Req], None] | None, keep: bool,
    ) -> list[RequestOutput]:
        if self._closed:  # its workers have left and its CUDA graphs are freed
            raise RuntimeError("this LLM was shut down; create a new LLM to generate")
        results = Results(self._decode, on_result, keep)

        def submit(new_items: Sequence[Item]) -> None:
            for key, prompt, params in new_items:
                position = results.new_position(key)
                try:
                    req = self.make_request(prompt, params, key)
                    if admit is not None:
                        admit(key, req)
                    self._queue(req, position)
                except Exception as exc:  # noqa: BLE001 - one request's failure (a template's TemplateError...) is its own
                    results.fail(position, str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}")

        source = items if callable(items) else None

        def refill() -> bool:
            nonlocal source
            if source is None:
                return False
            if self.drain is not None and self.drain.requested:
                return False
            new = source(self._room())
            if new is None:
                source = None
                return False
            submit(new)
            return True

        stats = self.scheduler.stats
        start, prefilled, cached = time.perf_counter(), stats.prefill_tokens, stats.cached_tokens
        try:
            submit([] if source is not None else items)
            cut_short = not self.step_loop(results.finished, refill, on_batch)
            # A drain that stopped the refills before the source ran dry leaves rows unread, even if every
            # admitted request finished.
            self.interrupted = cut_short or source is not None
        except BaseException:
            # Ctrl-C, or an on_result that raised: nothing this run admitted may outlive it, or the next run
            # would finish its half-served requests under its own keys (or stall on them).
            self.scheduler.abort_all()
            raise
        elapsed = time.perf_counter() - start
        generated = results.completion_tokens
        self.last_stats = {
            "seconds": elapsed, "output_tokens": generated, "tokens_per_s": generated / max(elapsed, 1e-9),
            "prefill_tokens": stats.prefill_tokens - prefilled, "cached_tokens": stats.cached_tokens - cached,
        }
        return results.in_order()

    def step_loop(
        self, on_finish: Callable[[Req], None], refill: Callable[[], bool] | None = None,
        on_batch: Callable[[Batch | None], None] | None = None, on_tokens: Callable[[list[Req]], None] | None = None,
    ) -> bool:
        """Run the step loop with this replica's TP ranks following; False if a drain cut it short."""
        publish = on_batch
        if get_tp().size > 1:

            def publish(batch: Batch | None) -> None:
                send_batch(batch)
                if on_batch is not None:
                    on_batch(batch)

        with quiet_garbage_collector():
            return run_until_idle(
                self.scheduler, self.engine, self.outputs, self.cfg.scheduler.overlap, on_finish, publish,
                self.drain, self.cfg.job.drain_timeout_s, refill, on_tokens,
            )

    def _queue(self, req: Req, position: int) -> None:
        req.index = position
        self.scheduler.add(req)
        for sibling in make_sample_group(req, [self._take_uid() for _ in range(req.sampling.n - 1)])[1:]:
            self.scheduler.add(sibling)

    def _take_uid(self) -> int:
        self._next_uid += 1
        return self._next_uid - 1

    def _decode(self, token_ids: list[int]) -> str:
        """Generated tokens' text (they follow a prompt)."""
        return decode_continuation(self.tokenizer, token_ids, self.strips_leading_space) if self.tokenizer else ""

    def _room(self) -> int:
        """How many more requests the scheduler wants now: free rows (none while pages are short) + slack."""
        sched = self.scheduler
        pages_short, self._page_waits = sched.stats.page_waits > self._page_waits, sched.stats.page_waits
        free_rows = 0 if pages_short else len(sched.free_rows)
        return max(0, free_rows + REFILL_SLACK - len(sched.waiting))

    def keep_workers_waiting(self) -> None:
        """TP: tell the worker ranks that nothing runs yet, so their wait for a batch does not time out."""
        if get_tp().size > 1:
            with self._keepalive_lock:  # the pinging thread and the caller's thread send one at a time
                if not self._closed:
                    send_batch(None)

    @contextlib.contextmanager
    def workers_kept_waiting(self) -> Iterator[None]:
        """TP: while the leader works without the model (waiting for locks and other replicas, reading or merging
        outputs: longer than parallel.timeout_s on a large job), a thread pings the workers on entry and then
        every min(5 s, timeout / 4). Nothing else may send them batches meanwhile."""
        if get_tp().size == 1:
            yield
            return
        every_s = min(5.0, self.cfg.parallel.timeout_s / 4)
        stop = threading.Event()

        def ping() -> None:
            while True:  # the first at once: the leader may have been busy before it got here
                try:
                    self.keep_workers_waiting()
                except RuntimeError as exc:  # a worker is gone: the leader's next collective says so
                    log.warning("stopped pinging the TP workers: %s", exc)
                    return
                if stop.wait(every_s):
                    return

        thread = threading.Thread(target=ping, name="tpinfer-worker-keepalive", daemon=True)
        try:
            thread.start()
            yield
        finally:
            stop.set()
            if thread.ident is not None:  # started
                thread.join()

    def shutdown(self) -> None:
        """Release the worker ranks and this engine's CUDA graphs; idempotent. Under torchrun, call it before
        ``destroy_process_group``."""
        with self._keepalive_lock:  # a ping being sent ends before STOP, and none starts after it
            if self._closed:
                return
            self._closed = True
        try:
            if get_tp().size > 1:
                send_batch(None, stop=True)
        finally:
            self.engine.close()
