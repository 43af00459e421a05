"""OpenAI request and response shapes for job batch files and the server; nothing here reads files or sockets.

Parameters that change the output but are not implemented (tools, ``response_format`` json...) are refused by
name rather than ignored.
"""

from __future__ import annotations

import codecs
import hashlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runtime.frontend.tokenizer import decode_continuation
from runtime.sampling_params import SEED_LIMIT, SamplingParams

if TYPE_CHECKING:
    from runtime.batch import TokenLogprob

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
URLS = (CHAT, COMPLETIONS)
MIN_LOGPROB = -9999.0  # OpenAI's "very unlikely"; keeps -inf out of the JSON

# top_k, min_p, repetition_penalty, ignore_eos and stop_token_ids are not OpenAI's: vLLM's server takes them too.
_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "logprobs", "user",
           "presence_penalty", "frequency_penalty", "logit_bias", "top_k", "min_p", "repetition_penalty", "ignore_eos",
           "stop_token_ids"}
_ALLOWED = {
    # store and metadata keep a completion for OpenAI's dashboards: nothing in the answer changes
    CHAT: _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "store", "metadata"},
    COMPLETIONS: _COMMON | {"prompt", "echo", "best_of"},
}
# Accepted only at the value that changes nothing (clients send them filled in).
_NEUTRAL: dict[str, tuple[Any, ...]] = {"stream": (False,), "best_of": (1,),
                                        "suffix": ("",), "response_format": ({"type": "text"},),
                                        "tool_choice": ("none", "auto"), "parallel_tool_calls": (True, False)}
# OpenAI's chat roles without tools; "developer" is its newer name for "system", which chat templates know.
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_STREAMING = {"stream", "stream_options"}
_PASSED = ("temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty", "logit_bias",
           "top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids")


class RequestError(ValueError):
    """A request that cannot be served: ``code`` is machine-readable, the message names the parameter, ``param``
    is its name where there is one (the error body's ``param``, as OpenAI fills it)."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


@dataclass(frozen=True)
class Request:

    url: str
    model: str | None
    logprobs: int | None
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None  # as the client asked (max_tokens or max_completion_tokens)
    echo: bool = False  # completions: the prompt comes back before the completion (0 tokens: the prompt alone)

    @property
    def prompt_only(self) -> bool:
        """``echo`` with ``max_tokens=0``: the prompt and its logprobs, nothing generated."""
        return self.echo and self.max_tokens == 0


@dataclass(frozen=True)
class Echo:
    """A prompt as ``echo`` returns it: its text (as sent, or decoded from token ids), its token ids and, with
    logprobs, its entries (the first None: nothing comes before it)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob | None] | None


def parse_line(obj: Any, defaults: SamplingParams) -> tuple[Any, SamplingParams, Request]:
    method = obj.get("method")
    if method != "POST":
        raise RequestError("invalid_method", f"method {method!r} is not supported: batch lines are POST requests")
    url = obj.get("url")
    if url not in URLS:
        raise RequestError("invalid_url", f"url {url!r} is not supported; use one of {list(URLS)}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise RequestError("invalid_request", f"'body' must be a JSON object, not {type(body).__name__}")
    return parse_body(url, body, defaults)


def parse_body(url: str, body: dict[str, Any], defaults: SamplingParams) -> tuple[Any, SamplingParams, Request]:
    """A batch line's body to (prompt, sampling, request); raises RequestError naming what is wrong."""
    prompts, sampling, request = _parse(url, body, defaults, server=False)
    return prompts[0], sampling, request


def parse_request(url: str, body: Any, defaults: SamplingParams) -> tuple[list[Any], SamplingParams, Request]:
    """A server request's body to (prompts, sampling, request); a completion may hold several prompts."""
    if not isinstance(body, dict):
        raise RequestError("invalid_request", f"the request body must be a JSON object, not {type(body).__name__}")
    return _parse(url, body, defaults, server=True)


def _parse(url: str, body: dict[str, Any], defaults: SamplingParams, server: bool
           ) -> tuple[list[Any], SamplingParams, Request]:
    body = {k: v for k, v in body.items() if v is not None}  # null means "the default", as in the API
    stream, include_usage = False, False
    if server:
        stream, include_usage = _stream_flags(body)
        body = {k: v for k, v in body.items() if k not in _STREAMING}
    unknown = sorted(set(body) - _ALLOWED[url] - set(_NEUTRAL))
    if unknown:
        raise RequestError("invalid_request", f"unsupported parameter(s) {unknown} for {url}", unknown[0])
    for name, neutral in _NEUTRAL.items():
        if name in body and not any(body[name] == v and type(body[name]) is type(v) for v in neutral):
            accepted = " or ".join(map(repr, neutral))
            raise RequestError("invalid_request", f"{name}={body[name]!r} is not supported (only {accepted})", name)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("invalid_request", f"'model' must be a string, not {model!r}", "model")
    prompts = [parse_messages(body.get("messages"))] if url == CHAT else _prompts(body.get("prompt"), many=server)
    values = {name: body[name] for name in _PASSED if name in body}
    seed = values.get("seed")
    if type(seed) is int and -SEED_LIMIT <= seed < 0:
        values["seed"] = seed % SEED_LIMIT  # OpenAI's seeds are int64: as reproducible as any other
    if values.get("top_p") == 0 and type(values["top_p"]) in (int, float):
        values["top_p"], values["top_k"] = 1.0, 1  # OpenAI allows 0: a nucleus of the most likely token alone
    names = {"max_new_tokens": "max_tokens"}
    lengths = {k: body[k] for k in ("max_completion_tokens", "max_tokens") if k in body}
    if len(set(map(repr, lengths.values()))) > 1:
        raise RequestError("invalid_request", f"max_tokens and max_completion_tokens differ: {lengths}", "max_tokens")
    if lengths:
        names["max_new_tokens"], values["max_new_tokens"] = next(iter(lengths.items()))
    echo = _echo(body)
    length = values.get("max_new_tokens")
    if length == 0 and type(length) is int and url == COMPLETIONS:
        if not echo:
            raise RequestError("invalid_request", "max_tokens=0 generates nothing: it needs echo=true (the prompt and "
                                                  "its logprobs alone)", "max_tokens")
        values["max_new_tokens"] = 1  # the engine scores the prompt while it makes one token, which is dropped
    logprobs = _logprobs(url, body)
    if logprobs is not None:
        values["logprobs"] = logprobs
        names["logprobs"] = "top_logprobs" if url == CHAT else "logprobs"
        if echo:
            values["prompt_logprobs"] = logprobs
    try:
        sampling = SamplingParams.from_dict(values, base=defaults)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        named = re.match(r"sampling parameter (\w+)=", message)
        param = names.get(named.group(1), named.group(1)) if named else None
        for ours, theirs in names.items():
            message = message.replace(f"sampling parameter {ours}=", f"{theirs}=")
        raise RequestError("invalid_request", message.replace("sampling parameter ", ""), param) from None
    return prompts, sampling, Request(url, model, logprobs, stream, include_usage, length if lengths else None, echo)


def _echo(body: dict[str, Any]) -> bool:
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise RequestError("invalid_request", f"echo={echo!r} must be true or false", "echo")
    return echo


def check_context(request: Request, prompt_tokens: int, max_seq_len: int) -> None:
    """A length the client asked for must fit beside its prompt (as OpenAI refuses it); a default length is cut
    to what fits."""
    if request.max_tokens is not None and prompt_tokens + request.max_tokens > max_seq_len:
        raise RequestError("context_length_exceeded",
                           f"the maximum context length is {max_seq_len} tokens (model.max_seq_len); this request "
                           f"asks for {prompt_tokens + request.max_tokens} ({prompt_tokens} in the prompt, "
                           f"max_tokens={request.max_tokens})", "messages" if request.url == CHAT else "prompt")


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("invalid_request", f"stream={stream!r} must be true or false", "stream")
    options = body.get("stream_options", {})
    if not isinstance(options, dict) or set(options) - set(STREAM_OPTIONS):
        raise RequestError("invalid_request", f"stream_options={options!r}: only {{'include_usage': bool, "
                           "'include_obfuscation': bool}} are supported", "stream_options")
    options = {k: v for k, v in options.items() if v is not None}  # null: the default
    if options and not stream:
        raise RequestError("invalid_request", "stream_options needs stream=true", "stream_options")
    for key, value in options.items():
        if not isinstance(value, bool):
            raise RequestError("invalid_request", f"stream_options.{key}={value!r} must be true or false",
                               "stream_options")
    return stream, options.get("include_usage", False)


# include_obfuscation pads chunks against length side channels on the public internet; this server never pads.
STREAM_OPTIONS = ("include_usage", "include_obfuscation")


def _logprobs(url: str, body: dict[str, Any]) -> int | None:
    value = body.get("logprobs")
    if url == COMPLETIONS:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise RequestError("invalid_request", f"logprobs={value!r} must be an integer (alternatives per token)",
                               "logprobs")
        return value
    if value is not None and not isinstance(value, bool):
        raise RequestError("invalid_request", f"logprobs={value!r} must be true or false", "logprobs")
    top = body.get("top_logprobs")
    if top is not None and not value:
        raise RequestError("invalid_request", "top_logprobs needs logprobs=true", "top_logprobs")
    if not value:
        return None
    if top is not None and (isinstance(top, bool) or not isinstance(top, int)):
        raise RequestError("invalid_request", f"top_logprobs={top!r} must be an integer", "top_logprobs")
    return 0 if top is None else top


def parse_messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise RequestError("invalid_request", "'messages' must be a non-empty list of {role, content} objects",
                           "messages")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError("invalid_request", f"messages[{i}] must be an object with a string 'role'", "messages")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise RequestError("invalid_request", f"messages[{i}].content[{j}] is of type {kind!r}: "
                                                          "only text parts are supported", "messages")
                texts.append(part["text"])
            content = "\n".join(texts)
        if not isinstance(content, str):
            raise RequestError("invalid_request", f"messages[{i}].content must be a string or a list of text parts",
                               "messages")
        role = _ROLES.get(message["role"])
        if role is None:
            raise RequestError("invalid_request", f"messages[{i}].role={message['role']!r} is not one of "
                                                  f"{sorted(_ROLES)} (tools are not supported)", "messages")
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise RequestError("invalid_request", f"messages[{i}].name must be a string", "messages")
        # A participant's name goes to the chat template, which renders it where its model expects (or not at all).
        messages.append({"role": role, "content": content, **({"name": name} if name is not None else {})})
    return messages


MAX_PROMPTS = 1024


def _prompts(value: Any, many: bool) -> list[str | list[int]]:
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        if len(value) > 1 and not many:
            raise RequestError("invalid_request", f"'prompt' holds {len(value)} prompts; a batch line takes one "
                                                  "(a string or a list of token ids): give each its own line", "prompt")
        if len(value) > MAX_PROMPTS:
            raise RequestError("invalid_request", f"'prompt' holds {len(value)} prompts; at most {MAX_PROMPTS}",
                               "prompt")
        return [_prompt(p) for p in value]
    return [_prompt(value)]


def _prompt(value: Any) -> str | list[int]:
    if isinstance(value, str):
        if not value:
            raise RequestError("invalid_request", "'prompt' is empty", "prompt")
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return list(value)
    raise RequestError("invalid_request", "'prompt' must be a string, a non-empty list of token ids, or a list of these",
                       "prompt")


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a byte-level BPE vocabulary uses for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenText:
    """A token's text and UTF-8 bytes; from the byte-level vocabulary entry where there is one, so a token that
    splits a character still has its own bytes."""

    _decoder = _byte_decoder()

    def __init__(self, tokenizer: Any, strips_leading_space: bool = False) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int] | None]] = {}
        self._special = frozenset(getattr(tokenizer, "all_special_ids", None) or ())
        self.strips_leading_space = strips_leading_space  # tokenizer.strips_leading_space, asked by the owner

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special

    def echo(self, prompt: str | list[int], token_ids: list[int], logprobs: list[TokenLogprob | None] | None) -> Echo:
        """A prompt for ``echo``: a text prompt as sent, token ids decoded (special tokens left out)."""
        if isinstance(prompt, str):
            text = prompt
        else:
            text = self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""
        return Echo(text, list(token_ids), logprobs)

    def __call__(self, token_id: int) -> tuple[str, list[int] | None]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._lookup(token_id)
        return found

    def _lookup(self, token_id: int) -> tuple[str, list[int] | None]:
        if self.tokenizer is None:
            return f"token_id:{token_id}", None
        # A generated token's text as it reads after the tokens before it ("▁Paris" is " Paris").
        text = decode_continuation(self.tokenizer, [token_id], self.strips_leading_space, skip_special_tokens=False)
        vocabulary = getattr(self.tokenizer, "convert_ids_to_tokens", None)
        raw = vocabulary(token_id) if vocabulary is not None else None
        if isinstance(raw, str) and raw:
            byte = _BYTE_TOKEN.fullmatch(raw)
            if byte:
                return text, [int(byte.group(1), 16)]
            if all(c in self._decoder for c in raw):
                mapped = [self._decoder[c] for c in raw]
                # Byte-level BPE: the entry spells the token's bytes. A SentencePiece entry of such characters
                # ("é") is text, and its bytes are its text's.
                if bytes(mapped).decode("utf-8", errors="replace") == text:
                    return text, mapped
        return text, list(text.encode("utf-8", errors="surrogatepass"))


def _logprob(value: float) -> float:
    return value if value >= MIN_LOGPROB else MIN_LOGPROB


def _chat_logprobs(entries: list[dict[str, Any]], k: int, tokens: TokenText) -> dict[str, Any]:
    def token(token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = tokens(token_id)
        return {"token": text, "logprob": _logprob(logprob), "bytes": raw}

    content = [{**token(e["token_id"], e["logprob"]), "top_logprobs": [token(int(t), lp) for t, lp in e["top"][:k]]}
               for e in entries]
    return {"content": content, "refusal": None}


class TextOffsets:
    """Where each token of a completion starts in its text: the characters its earlier tokens' bytes decode to.
    The tokens of a character split over several start where it does. One per choice, across a stream's chunks."""

    def __init__(self) -> None:
        self.chars = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, data: bytes) -> int:
        start = self.chars
        self.chars += len(self._decoder.decode(data))
        return start

    def restart(self, chars: int) -> None:
        """Go on from character ``chars`` of a text decoded apart (an echoed prompt): no bytes carry over."""
        self.chars = chars
        self._decoder.reset()


def _completion_token(tokens: TokenText, token_id: int) -> tuple[str, bytes]:
    """A token as the completions API lists it, and its bytes: a token that is no whole UTF-8 text (part of a
    character, decoded as U+FFFD) is ``bytes:\\xNN...``, as OpenAI writes it, so the alternatives of a split
    character stay apart."""
    text, raw = tokens(token_id)
    if "\ufffd" in text and raw is not None:
        data = bytes(raw)
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data), data
    return text, text.encode("utf-8", errors="surrogatepass")


def _completion_logprobs(entries: list[dict[str, Any]], k: int, tokens: TokenText,
                         offsets: TextOffsets | None = None, echo: Echo | None = None,
                         hidden_last: bool = False) -> dict[str, Any]:
    """The completions API's logprobs of ``entries``; with ``echo``, of the prompt's tokens first (the first one's
    logprob and alternatives null). Offsets count characters of the text returned: a special token the prompt's
    text does not spell (a BOS the tokenizer added) takes none, nor does a last entry the text leaves out
    (``hidden_last``: an EOS, listed with echo as vLLM does, so a scored continuation keeps its last token)."""
    offsets = offsets or TextOffsets()
    texts: list[str] = []
    logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    starts: list[int] = []
    rows: list[tuple[int, dict[str, Any] | None]] = []
    prompt_rows = 0
    if echo is not None:
        scored = echo.logprobs or []
        rows = [(t, scored[i] if i < len(scored) else None) for i, t in enumerate(echo.token_ids)]
        prompt_rows = len(rows)
    rows += [(e["token_id"], e) for e in entries]
    for i, (token_id, e) in enumerate(rows):
        if echo is not None and i == prompt_rows:
            offsets.restart(len(echo.text))  # the prompt's text is as sent, not its tokens' bytes
        text, data = _completion_token(tokens, token_id)
        if i < prompt_rows and not echo.text.startswith(text, offsets.chars):
            if tokens.is_special(token_id):
                data = b""
            elif text.startswith(" ") and echo.text.startswith(text[1:], offsets.chars):
                data = data[1:]  # a word-initial token at the start of the text: its space is not there
        if hidden_last and i == len(rows) - 1:
            data = b""
        texts.append(text)
        starts.append(offsets.advance(data))
        if e is None:
            logprobs.append(None)
            tops.append(None)
            continue
        top = {_completion_token(tokens, int(t))[0]: _logprob(lp) for t, lp in e["top"][:k]}
        top.setdefault(text, _logprob(e["logprob"]))  # the sampled token is always listed, as the API does
        logprobs.append(_logprob(e["logprob"]))
        tops.append(top)
    return {"tokens": texts, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": starts}


def response_body(request: Request, output: Any, tokens: TokenText, model: str, created: int,
                  key: str, echoes: list[Echo] | None = None) -> dict[str, Any]:
    """The ``chat.completion`` or ``text_completion`` body of a finished request; ``key`` makes the body's id;
    with ``echo``, ``echoes`` holds each sample's prompt."""
    chat = request.url == CHAT
    choices = []
    for i, sample in enumerate(output.outputs):
        echo = echoes[i] if request.echo and echoes is not None else None
        text, entries, reason = sample.text, sample.logprobs, sample.finish_reason
        if request.prompt_only:
            text, entries, reason = "", [], "length"
        logprobs = None
        if request.logprobs is not None and entries is not None:
            if chat:
                logprobs = _chat_logprobs(entries[: sample.shown_tokens], request.logprobs, tokens)
            else:
                hidden = echo is not None and sample.stop_token_hidden and not request.prompt_only
                logprobs = _completion_logprobs(entries[: sample.shown_tokens + int(hidden)], request.logprobs, tokens,
                                                echo=echo, hidden_last=hidden)
        choice: dict[str, Any] = {"index": sample.sample_index}
        if chat:
            choice["message"] = {"role": "assistant", "content": text, "refusal": None}
        else:
            choice["text"] = text if echo is None else echo.text + text
        choice.update(logprobs=logprobs, finish_reason=reason)
        choices.append(choice)
    completion_tokens = 0 if request.prompt_only else sum(s.completion_tokens for s in output.outputs)
    return {
        "id": _response_id(request, key), "object": "chat.completion" if chat else "text_completion",
        "created": created, "model": request.model or model, "choices": choices,
        "usage": usage(output.prompt_tokens, completion_tokens),
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _response_id(request: Request, key: str) -> str:
    return ("chatcmpl-" if request.url == CHAT else "cmpl-") + _digest(key)


def chunk(request: Request, key: str, model: str, created: int, choices: list[dict[str, Any]]) -> dict[str, Any]:
    body = {"id": _response_id(request, key),
            "object": "chat.completion.chunk" if request.url == CHAT else "text_completion",
            "created": created, "model": request.model or model, "choices": choices}
    if request.include_usage:
        body["usage"] = None
    return body


def chunk_choice(request: Request, index: int, text: str | None, finish_reason: str | None,
                 entries: list[dict[str, Any]] | None, tokens: TokenText, offsets: TextOffsets | None = None,
                 role: bool = False, echo: Echo | None = None, hidden_last: bool = False) -> dict[str, Any]:
    """One choice of a stream's chunk; ``echo``: the prompt goes first (its text is already in ``text``);
    ``hidden_last``: the last entry is a token the text leaves out."""
    logprobs = None
    if request.logprobs is not None and (entries or echo is not None):
        if request.url == CHAT:
            logprobs = _chat_logprobs(entries or [], request.logprobs, tokens)
        else:
            logprobs = _completion_logprobs(entries or [], request.logprobs, tokens, offsets, echo, hidden_last)
    if request.url == CHAT:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}


def usage_chunk(request: Request, key: str, model: str, created: int, prompt_tokens: int,
                completion_tokens: int) -> dict[str, Any]:
    return {**chunk(request, key, model, created, []), "usage": usage(prompt_tokens, completion_tokens)}


def error_body(message: str, code: str | None = None, param: str | None = None,
               kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def result_line(custom_id: str, key: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"id": "batch_req_" + _digest(key), "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": "req_" + _digest(key), "body": body}, "error": None}


# Lines that name no request an endpoint could answer; OpenAI refuses such a file when it validates it, and a
# result line says so in ``error``, its field for failures that are not HTTP responses.
LINE_ERRORS = ("invalid_json", "invalid_url", "invalid_method", "duplicate_custom_id")


def error_line(custom_id: str | None, key: str, code: str, message: str, param: str | None = None
               ) -> dict[str, Any]:
    """A request that failed: as OpenAI writes one the endpoint refused (a 400 response whose body is the error,
    ``error`` null), or, for a line of LINE_ERRORS, no response and the error."""
    line: dict[str, Any] = {"id": "batch_req_" + _digest("error " + key), "custom_id": custom_id}
    if code in LINE_ERRORS:
        return {**line, "response": None, "error": {"code": code, "message": message}}
    return {**line, "response": {"status_code": 400, "request_id": "req_" + _digest("error " + key),
                                 "body": error_body(message, code, param)}, "error": None}


def engine_error_code(message: str) -> str:
    too_long = "maximum sequence length" in message or "maximum context length" in message
    return "context_length_exceeded" if too_long else "invalid_request"


# Request parameters the engine checks against the model (the vocabulary); its messages start with their name.
_ENGINE_CHECKED = ("logit_bias", "stop_token_ids")


def engine_error_param(message: str) -> str | None:
    """The parameter an engine error names, for the error body's ``param``."""
    return next((name for name in _ENGINE_CHECKED if message.startswith(name + " ")), None)


def is_result_line(line: Any) -> bool:
    """A batch result line, served or not: a native result row never carries these keys together."""
    return isinstance(line, dict) and {"custom_id", "response", "error"} <= line.keys()


def is_served(line: dict[str, Any]) -> bool:
    """A result line with a 200 response (error lines, either shape, are retried by the next run)."""
    response = line.get("response") if is_result_line(line) else None
    return isinstance(response, dict) and response.get("status_code") == 200 and line.get("error") is None


def _digest(key: str) -> str:
    """Ids are derived from the request's key, so a rerun writes the same ones."""
    return hashlib.sha256(key.encode("utf-8", errors="surrogatepass")).hexdigest()[:24]
