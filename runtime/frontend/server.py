"""The OpenAI-compatible HTTP server: ``python launch.py serve`` (rank 0 of a replica; its TP ranks follow).

aiohttp's ``AppRunner`` installs no signal handlers of its own, so SIGTERM drains as it does for jobs.
"""

from __future__ import annotations

import asyncio
import bisect
import hmac
import json
import logging
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from runtime.batch import Req
from runtime.config import ServerSection
from runtime.frontend import openai_api as api
from runtime.frontend.llm import LLM
from runtime.frontend.metrics import Metrics
from runtime.frontend.results import RequestOutput
from runtime.frontend.serving import Call, Serving
from runtime.frontend.tokenizer import IncrementalDetokenizer, decode_continuation, load_tokenizer
from runtime.frontend.tokenizer_api import detokenize_ids, tokenize, tokenizer_info
from runtime.output import SampleOutput, shown_tokens

DISCONNECT_POLL_S = 1.0
HANDLER_GRACE_S = 5.0  # at shutdown, in-flight responses get this long to finish
log = logging.getLogger("tpinfer.server")


@dataclass
class ServerState:
    """``llm.tokenizer`` encodes prompts on the ``prompts`` thread, so a long prompt holds up no other request;
    the event loop decodes with its own ``tokenizer`` (a fast tokenizer used on two threads fails)."""

    llm: LLM
    serving: Serving
    cfg: ServerSection
    model: str
    tokenizer: Any
    metrics: Metrics
    prompts: ThreadPoolExecutor
    accepting: bool = True

    def __post_init__(self) -> None:
        self.tokens = api.TokenText(self.tokenizer, self.llm.strips_leading_space)

    def decode(self, token_ids: list[int]) -> str:
        """Generated tokens' text (they follow a prompt)."""
        if self.tokenizer is None:
            return ""
        return decode_continuation(self.tokenizer, token_ids, self.tokens.strips_leading_space)


STATE = web.AppKey("state", ServerState)


def _error(status: int, message: str, code: str | None = None, param: str | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"  # OpenAI's types; the code says more
    return web.json_response(api.error_body(message, code, param, kind), status=status)


OPEN_PATHS = ("/health", "/metrics")  # probes answer without the API key


@web.middleware
async def _errors_and_auth(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every error in OpenAI's shape; with ``server.api_key`` set, every path but the probes (``/health``,
    ``/metrics``) needs ``Authorization: Bearer <key>``."""
    key = request.app[STATE].cfg.api_key
    if key and request.path not in OPEN_PATHS:
        given = request.headers.get("Authorization", "")
        # aiohttp keeps bytes that are not UTF-8 as surrogates: compared as the bytes sent, never an error
        if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), f"Bearer {key}".encode()):
            return _error(401, "invalid or missing API key (Authorization: Bearer <key>)", "invalid_api_key")
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.status, f"{exc.reason}: {request.method} {request.path}")
    except Exception:  # a bug must cost one request, never the server
        log.exception("request %s %s failed", request.method, request.path)
        return _error(500, "internal server error (logged on the server)", "internal_error")


def build_app(state: ServerState) -> web.Application:
    app = web.Application(middlewares=[_errors_and_auth], client_max_size=64 << 20)
    app[STATE] = state
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model:.+}", _model)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
    app.router.add_get("/tokenizer_info", _tokenizer_info)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_entry(request.app[STATE])]})


async def _model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = request.match_info["model"]
    if name != state.model:
        return _error(404, f"the model {name!r} does not exist; this server serves {state.model!r}",
                      "model_not_found", "model")
    return web.json_response(_model_entry(state))


def _model_entry(state: ServerState) -> dict[str, Any]:
    return {"id": state.model, "object": "model", "created": int(state.metrics.started), "owned_by": "tpinfer",
            "max_model_len": state.llm.engine.max_seq_len}


async def _tokenize(request: web.Request) -> web.Response:
    state, body = request.app[STATE], await _tokenizer_body(request)
    if isinstance(body, web.Response):
        return body
    try:  # on the prompts thread, with its tokenizer: a long prompt holds up no other request
        answer = await asyncio.get_running_loop().run_in_executor(state.prompts, tokenize, state.llm.tokenizer, body)
    except api.RequestError as exc:
        return _error(400, str(exc), exc.code, exc.param)
    except Exception as exc:  # noqa: BLE001 - a chat template's own error, say
        return _error(400, f"{type(exc).__name__}: {exc}", "invalid_request")
    answer = {"count": len(answer["tokens"]), "max_model_len": state.llm.engine.max_seq_len, **answer}
    return web.json_response(answer, dumps=_dumps)


async def _detokenize(request: web.Request) -> web.Response:
    state, body = request.app[STATE], await _tokenizer_body(request)
    if isinstance(body, web.Response):
        return body
    try:
        tokens = detokenize_ids(body, state.llm.model_config.vocab_size)
    except api.RequestError as exc:
        return _error(400, str(exc), exc.code, exc.param)
    # On the prompts thread (a long list holds up no stream); special tokens kept, so decode undoes /tokenize.
    text = await asyncio.get_running_loop().run_in_executor(state.prompts, state.llm.tokenizer.decode, tokens)
    return web.json_response({"prompt": text}, dumps=_dumps)


async def _tokenizer_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    refused = _no_tokenizer(state)
    if refused is not None:
        return refused
    return web.json_response(tokenizer_info(state.tokenizer, state.llm.engine.max_seq_len), dumps=_dumps)


async def _tokenizer_body(request: web.Request) -> Any:
    """A /tokenize or /detokenize body, or the response refusing it (no JSON, no tokenizer, another model)."""
    state, body = request.app[STATE], await _json_body(request)
    if isinstance(body, web.Response):
        return body
    refused = _no_tokenizer(state) or _other_model(state, body)
    return body if refused is None else refused


async def _json_body(request: web.Request) -> Any:
    """The request's JSON, or the 400 response saying why it is not JSON."""
    try:
        return await request.json()
    except (ValueError, LookupError) as exc:  # JSONDecodeError, UnicodeDecodeError, a charset Python does not know
        return _error(400, f"the request body is not valid JSON: {exc}", "invalid_json")
    except RecursionError:
        return _error(400, "the request body is not valid JSON: nested too deeply", "invalid_json")


def _no_tokenizer(state: ServerState) -> web.Response | None:
    if state.tokenizer is None:
        return _error(400, f"the model directory {state.llm.model_dir} has no tokenizer", "invalid_request")
    return None


def _other_model(state: ServerState, body: Any) -> web.Response | None:
    model = body.get("model") if isinstance(body, dict) else None
    if model is not None and model != state.model:
        return _error(404, f"the model {model!r} does not exist; this server serves {state.model!r}",
                      "model_not_found", "model")
    return None


async def _health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not state.serving.alive or not state.accepting:
        return web.Response(status=503, text="draining\n" if state.serving.alive else "step loop stopped\n")
    return web.Response(text="ok\n")


async def _metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, api.COMPLETIONS)


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _complete(request, api.CHAT)


async def _complete(request: web.Request, url: str) -> web.StreamResponse:
    state = request.app[STATE]
    if not state.accepting:
        return _error(503, "the server is shutting down", "unavailable")
    body = await _json_body(request)
    if isinstance(body, web.Response):
        return body
    key, created = uuid.uuid4().hex, int(time.time())
    try:
        prompts, sampling, spec = api.parse_request(url, body, state.llm.default_sampling())
        refused = _other_model(state, body)
        if refused is not None:
            return refused
        reqs, sources, prompt_tokens = await asyncio.get_running_loop().run_in_executor(
            state.prompts, _make_requests, state.llm, prompts, sampling, spec, key)
    except api.RequestError as exc:
        return _error(400, str(exc), exc.code, exc.param)
    except ValueError as exc:
        return _error(400, str(exc), api.engine_error_code(str(exc)), api.engine_error_param(str(exc)))
    except Exception as exc:  # noqa: BLE001 - a chat template's own error, say
        return _error(400, f"{type(exc).__name__}: {exc}", "invalid_request")
    if state.serving.queued >= state.cfg.max_queue:
        state.metrics.rejected.labels("queue_full").inc()
        return _error(503, f"{state.serving.queued} requests are waiting (server.max_queue={state.cfg.max_queue}):"
                           " retry later", "queue_full")
    call = Call(reqs, prompt_tokens, spec.stream, asyncio.get_running_loop(), prompt_only=spec.prompt_only)
    state.serving.submit(call)
    if spec.stream:
        return await _stream(request, state, call, spec, key, created, sources)
    if not await _wait(request, state, call):
        return web.Response(status=499)
    if call.cut:
        return _error(503, "the request was cut short: the server is shutting down", "unavailable")
    samples = [replace(SampleOutput.from_req(r, state.decode), sample_index=i) for i, r in enumerate(call.reqs)]
    output = RequestOutput(index=0, prompt_tokens=prompt_tokens, outputs=samples)
    echoes = [_echo(state, r, source) for r, source in zip(call.reqs, sources)] if spec.echo else None
    return web.json_response(api.response_body(spec, output, state.tokens, state.model, created, key, echoes),
                             dumps=_dumps)


def _make_requests(llm: LLM, prompts: list[Any], sampling: Any, spec: api.Request, key: str
                   ) -> tuple[list[Any], list[Any], int]:
    """Encode (and render) the prompts and check that they fit; on the prompts thread. Returns the requests, the
    prompt each came from, and the prompts' tokens. Unseeded noise is keyed by the response id (``key``), random:
    keyed by the engine's request count, as a job's rows are by their ids, a restarted server would repeat the
    draws it made before."""
    reqs, sources, prompt_tokens = [], [], 0
    for i, prompt in enumerate(prompts):
        group = llm.make_requests(prompt, sampling, key=(key, i))
        api.check_context(spec, group[0].prompt_len, llm.engine.max_seq_len)
        llm.scheduler.check(group[0])
        reqs += group
        sources += [prompt] * len(group)
        prompt_tokens += group[0].prompt_len
    return reqs, sources, prompt_tokens


def _echo(state: ServerState, req: Req, source: Any) -> api.Echo:
    """The prompt ``echo`` returns; its logprobs are sample 0's (complete once any sample has a token)."""
    return state.tokens.echo(source, req.prompt_ids, (req.leader or req).prompt_logprobs)


def _gone(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


async def _wait(request: web.Request, state: ServerState, call: Call) -> bool:
    """Until the call is finished (True) or its client has gone (False: the call is aborted)."""
    while not call.finished:
        if not await _wait_changed(request, state, call):
            return False
    return True


def visible_end(text: str, start: int, stops: list[str]) -> int:
    """How much of ``text`` may be sent: not a stop string, nor a tail that may be the start of one."""
    end = len(text)
    for stop in stops:
        at = text.find(stop, max(0, start - len(stop) + 1))
        if at != -1:
            end = min(end, at)
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                end = min(end, len(text) - k)
                break
    return max(end, start)


class _ChoiceStream:
    """One choice's progress through a stream. A token's logprob entry goes out with its text: one whose text is
    held back (it may start a stop string) keeps its entry back too."""

    def __init__(self, state: ServerState, req: Req, echo: bool = False) -> None:
        self.req, self.decode = req, state.decode
        self.echo = echo  # with echo an ending EOS or stop token is listed too (zero width), as vLLM does
        self.echo_pending = echo  # the prompt goes out with the choice's first token (or its end)
        self.hidden_last = False  # the entries sent last end with such a token
        self.detok = None
        if state.tokenizer is not None:
            self.detok = IncrementalDetokenizer(state.tokenizer, state.tokens.strips_leading_space)
        params = req.sampling
        self.hidden = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else state.llm.eos_ids)
        # With logprobs and stop strings: where each token's text starts, to hold back its entry with its text.
        self.starts: list[int] | None = [] if req.output_logprobs is not None and params.stop and self.detok else None
        self.tokens_sent = self.entries_sent = self.chars_sent = 0
        self.offsets = api.TextOffsets()  # the tokens' text offsets (completions logprobs), across chunks
        self.done = False

    def advance(self) -> tuple[str, list[Any] | None, str | None, int]:
        """(new text, logprob entries of the tokens it shows, finish reason or None, new tokens)."""
        req = self.req
        reason = req.finish_reason  # read first: once it is set, every token is there
        count = len(req.output_ids)
        if reason is None and count > self.tokens_sent and req.output_ids[count - 1] in self.hidden:
            count -= 1  # an EOS or stop token whose finish is being set: its text is never output
        new = req.output_ids[self.tokens_sent : count]
        self.tokens_sent = count
        # Woken with no token of its own (a sibling's or another prompt's token), held entries stay held.
        shown = count if self.starts is None else self.entries_sent
        if reason is not None:
            self.done = True
            text = (req.text if req.text is not None else self.decode(req.text_ids))[self.chars_sent :]
            if req.output_logprobs is not None:
                shown = shown_tokens(req, self.decode)
                if self.echo and req.stop_token_hidden:
                    shown, self.hidden_last = shown + 1, True
        elif self.detok is not None and new:
            if self.starts is None:
                self.detok.extend(new)
            else:
                for token in new:
                    self.starts.append(len(self.detok.text))
                    self.detok.push(token)
            full = self.detok.text
            end = visible_end(full, self.chars_sent, req.sampling.stop)
            text = full[self.chars_sent : end]
            if self.starts is not None:
                shown = bisect.bisect_left(self.starts, end)  # the tokens that start before the visible end
        else:
            text = ""
        entries = None
        if req.output_logprobs is not None:
            shown = max(shown, self.entries_sent)
            entries = req.output_logprobs[self.entries_sent : shown]
            self.entries_sent = shown
        self.chars_sent += len(text)
        return text, entries, reason, len(new)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _event(obj: Any) -> bytes:
    return b"data: " + _dumps(obj).encode() + b"\n\n"


_MARK = "\x00text\x00"


def _text_chunk_template(spec: api.Request, key: str, model: str, created: int, index: int) -> tuple[bytes, bytes]:
    """Choice ``index``'s chunk bytes around its text, built once per stream: the step loop needs the host more
    than a JSON encoder does."""
    piece = api.chunk_choice(spec, index, _MARK, None, None, None)
    head, tail = _event(api.chunk(spec, key, model, created, [piece])).split(_dumps(_MARK).encode())
    return head, tail


async def _stream(request: web.Request, state: ServerState, call: Call, spec: api.Request, key: str,
                  created: int, sources: list[Any]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    choices = [_ChoiceStream(state, r, spec.echo) for r in call.reqs]
    interval = state.cfg.stream_interval_ms / 1000
    plain = [_text_chunk_template(spec, key, state.model, created, i) for i in range(len(choices))]
    try:
        await response.prepare(request)
        if spec.url == api.CHAT:
            first = [api.chunk_choice(spec, i, "", None, None, state.tokens, role=True) for i in range(len(choices))]
            await response.write(_event(api.chunk(spec, key, state.model, created, first)))
        while True:
            if not await _wait_changed(request, state, call):
                return response
            out = bytearray()
            cut = False
            for i, choice in enumerate(choices):
                if choice.done:
                    continue
                text, entries, reason, new = choice.advance()
                if spec.prompt_only and reason != "abort":  # the one token made while scoring the prompt is dropped
                    text, entries, new = "", None, 0
                    reason = "length" if reason else None
                echo = None
                if choice.echo_pending and (new or reason) and reason != "abort":
                    echo, choice.echo_pending = _echo(state, choice.req, sources[i]), False
                    text = echo.text + text
                if reason == "abort":  # not a finish reason OpenAI clients know: the stream ends in an error
                    cut = True
                elif reason is None and not entries and new and echo is None:
                    head, tail = plain[i]
                    out += head + _dumps(text).encode() + tail
                elif new or reason or echo is not None or entries:
                    piece = api.chunk_choice(spec, i, text, reason, entries, state.tokens, choice.offsets, echo=echo,
                                             hidden_last=choice.hidden_last)
                    out += _event(api.chunk(spec, key, state.model, created, [piece]))
            if cut:
                # OpenAI's clients raise an APIError on an error event; no [DONE]: the answer is not complete.
                out += _event(api.error_body("the request was cut short: the server is shutting down", "unavailable",
                                             kind="server_error"))
                await response.write(bytes(out))
                await response.write_eof()
                return response
            if out:
                await response.write(bytes(out))
            if all(c.done for c in choices):
                break
            if interval > 0:
                await asyncio.sleep(interval)  # fewer, larger chunks
        if spec.include_usage:
            completion = 0 if spec.prompt_only else sum(len(r.output_ids) for r in call.reqs)
            await response.write(_event(api.usage_chunk(spec, key, state.model, created, call.prompt_tokens,
                                                        completion)))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionError:
        state.serving.abort(call)
    except asyncio.CancelledError:
        state.serving.abort(call)
        raise
    return response


async def _wait_changed(request: web.Request, state: ServerState, call: Call) -> bool:
    """Until the call has news (True) or its client has gone (False: the call is aborted)."""
    while not call.changed.is_set():
        try:
            await asyncio.wait_for(call.changed.wait(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if _gone(request):
                state.serving.abort(call)
                return False
    call.changed.clear()
    return True


def served_model_name(llm: LLM, cfg: ServerSection) -> str:
    return cfg.served_model_name or llm.model_dir.name


def listen_problem(host: str, port: int) -> str | None:
    """Why the server could not listen on ``host:port`` (a name that does not resolve, a port in use), found
    before the model loads: a bind that is let go at once. None where it can."""
    where = f"cannot listen on {host}:{port} (server.host, server.port)"
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        return f"{where}: {exc}"
    for family, kind, proto, _, address in addresses:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server's own socket
                probe.bind(address)
        except OSError as exc:
            return f"{where}: {exc}"
    return None


async def run_server(llm: LLM, cfg: ServerSection) -> int:
    """Serve until SIGTERM/SIGINT (``llm.drain``) or a failed step loop; returns the exit code."""
    llm.stop_tokenizer = load_tokenizer(llm.model_dir)  # the step loop's own instance (see LLM.stop_tokenizer)
    metrics = Metrics(llm)
    serving = Serving(llm, metrics.observer())
    metrics.watch(serving)
    prompts = ThreadPoolExecutor(1, thread_name_prefix="tpinfer-prompts")
    state = ServerState(llm, serving, cfg, served_model_name(llm, cfg), load_tokenizer(llm.model_dir), metrics,
                        prompts)
    runner = web.AppRunner(build_app(state), access_log=None, handle_signals=False,
                           shutdown_timeout=HANDLER_GRACE_S)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise RuntimeError(f"cannot listen on {cfg.host}:{cfg.port} (server.host, server.port): {exc}") from None
    host, port = runner.addresses[0][:2]
    serving.start()
    print(f"serving {state.model!r} on http://{host}:{port}/v1 (OpenAI API; /tokenize, /health, /metrics)", flush=True)
    try:
        while serving.alive:
            if state.accepting and llm.drain is not None and llm.drain.requested:
                state.accepting = False
                log.warning("draining: in-flight requests finish within job.drain_timeout_s=%s",
                            llm.cfg.job.drain_timeout_s)
            await asyncio.sleep(0.1)
        state.accepting = False
        await asyncio.sleep(0)
    finally:
        serving.stop()
        await runner.cleanup()
        prompts.shutdown(wait=False, cancel_futures=True)
    if serving.error is not None:
        raise RuntimeError(f"the step loop failed: {type(serving.error).__name__}: {serving.error}")
    return 0
