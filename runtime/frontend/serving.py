"""The server's engine side: the step loop on its own thread, fed from the HTTP event loop through a queue.

Everything that touches the scheduler runs on the loop's thread; progress crosses back as one
``call_soon_threadsafe`` per step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from runtime.batch import Req
from runtime.frontend.llm import LLM

IDLE_WAIT_S = 0.2  # with nothing to run, how long the loop sleeps on the queue
log = logging.getLogger(__name__)


@dataclass(eq=False)
class Call:
    """One HTTP request in flight: one request per choice, in choice order."""

    reqs: list[Req]
    prompt_tokens: int
    stream: bool
    loop: asyncio.AbstractEventLoop
    prompt_only: bool = False  # echo with max_tokens=0: each request's one token only scored the prompt
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # set on the event loop
    started: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    done: int = 0  # engine thread
    closed: bool = False  # engine thread: finished or aborted, and counted once

    @property
    def finished(self) -> bool:
        return self.done == len(self.reqs)

    @property
    def cut(self) -> bool:
        """Some choice was aborted."""
        return any(r.finish_reason == "abort" for r in self.reqs)


@dataclass
class Observer:
    """Metric hooks, called on the loop's thread."""

    on_first_token: Callable[[Call], None] = lambda call: None
    on_finish: Callable[[Call], None] = lambda call: None


class Serving:
    """Runs ``llm``'s step loop until stopped or drained (``llm.drain``, set by the launcher)."""

    def __init__(self, llm: LLM, observer: Observer | None = None) -> None:
        self.llm = llm
        self.observer = observer or Observer()
        self._inbox: queue.SimpleQueue[Call] = queue.SimpleQueue()
        self._aborts: queue.SimpleQueue[Call] = queue.SimpleQueue()
        self._calls: dict[int, Call] = {}  # loop thread only
        self._woken: list[Call] = []
        self._stopping = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="step-loop", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, call: Call) -> None:
        self._inbox.put(call)

    def abort(self, call: Call) -> None:
        """The client went away: its requests stop at the next step."""
        self._aborts.put(call)

    def stop(self) -> None:
        """Finish: the loop takes nothing new and returns once what runs is done."""
        self._stopping = True

    @property
    def queued(self) -> int:
        """Requests not admitted yet (submitted calls still in the queue count as one each)."""
        return self._inbox.qsize() + len(self.llm.scheduler.waiting)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def _run(self) -> None:
        try:
            self.llm.step_loop(self._finished, self._refill, on_tokens=self._on_tokens)
        except BaseException as exc:  # noqa: BLE001 - reported by the front end, which then stops the server
            self.error = exc
            log.exception("the step loop failed")
        finally:
            self.llm.scheduler.abort_all()
            for call in list(self._calls.values()):
                self._close(call)
            while not self._inbox.empty():
                call = self._inbox.get_nowait()
                for req in call.reqs:
                    req.finish_reason = "abort"
                self._close(call)
            self._wake()

    def _refill(self) -> bool:
        while not self._aborts.empty():
            call = self._aborts.get_nowait()
            for req in call.reqs:
                self.llm.scheduler.abort(req)
            self._close(call)
        if self._stopping or (self.llm.drain is not None and self.llm.drain.requested):
            return False
        try:
            call = self._inbox.get(timeout=IDLE_WAIT_S) if self.llm.scheduler.idle else self._inbox.get_nowait()
            while True:
                self._admit(call)
                call = self._inbox.get_nowait()
        except queue.Empty:
            pass
        self._wake()  # what it closed (aborted, or refused when admitted): an idle server runs no step to send it
        return True

    def _admit(self, call: Call) -> None:
        if call.closed:  # its client left while it was queued: closed by the abort, never admitted
            return
        for req in call.reqs:
            self._calls[req.uid] = call
        try:
            for req in call.reqs:
                self.llm.scheduler.add(req)  # checked by the front end already: does not raise
        except ValueError:
            log.exception("a request the front end accepted was refused")
            for req in call.reqs:
                self.llm.scheduler.abort(req)
            self._close(call)

    def _finished(self, req: Req) -> None:
        call = self._calls.get(req.uid)
        if call is None:
            return
        call.done += 1
        self._first_token(call, req)  # a request that ends on its first token never reaches _on_tokens
        if call.finished:
            self._close(call)

    def _close(self, call: Call) -> None:
        """Once per call: a client that leaves after the last chunk aborts a call already closed."""
        if call.closed:
            return
        call.closed = True
        call.done = len(call.reqs)
        self._forget(call)
        self.observer.on_finish(call)
        self._woken.append(call)

    def _forget(self, call: Call) -> None:
        for req in call.reqs:
            self._calls.pop(req.uid, None)

    def _on_tokens(self, reqs: list[Req]) -> None:
        woken = self._woken
        for req in reqs:
            call = self._calls.get(req.uid)
            if call is None:
                continue
            self._first_token(call, req)
            if call.stream:
                woken.append(call)
        self._wake()

    def _first_token(self, call: Call, req: Req) -> None:
        if call.first_token_at is None and req.output_ids:
            call.first_token_at = time.monotonic()
            self.observer.on_first_token(call)

    def _wake(self) -> None:
        if not self._woken:
            return
        by_loop: dict[asyncio.AbstractEventLoop, set[Call]] = {}
        for call in self._woken:
            by_loop.setdefault(call.loop, set()).add(call)
        self._woken = []
        for loop, calls in by_loop.items():
            try:
                loop.call_soon_threadsafe(_set_all, calls)
            except RuntimeError:  # the event loop is closed
                pass


def _set_all(calls: set[Call]) -> None:
    for call in calls:
        call.changed.set()
