"""The OpenAI-compatible server: the real `launch.py serve` as a subprocess, driven by the official `openai` client.

Greedy texts are compared with `LLM.generate` on the same prompts; both run with engine.deterministic, so a
prompt's tokens do not depend on which other requests share its batches.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from runtime.frontend.openai_api import RequestError, parse_request
from runtime.frontend.server import visible_end
from runtime.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[1]
KEY = "test-key"
COMMON = ["engine.device=cpu", "engine.deterministic=true", "server.port=0", "job.drain_timeout_s=4"]
PROMPTS = [f"Write one sentence about the number {i}." for i in range(32)]


def start_server(*overrides: str, nproc: int | None = None) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, str(REPO / "launch.py")]
    if nproc:
        cmd += ["--nproc-per-node", str(nproc)]
    cmd += ["serve", *COMMON, *overrides]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 300
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError("the server exited before serving:\n" + "".join(lines))
        lines.append(line)
        found = re.search(r"on (http://[\d.]+:\d+)/v1", line)
        if found:
            return proc, found.group(1)
    proc.kill()
    raise AssertionError("the server did not start:\n" + "".join(lines))


def stop_server(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, float, str]:
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, time.monotonic() - start, out


def metrics(base: str) -> dict[str, float]:
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(tpinfer_\w+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


@pytest.fixture(scope="module")
def server():
    proc, base = start_server(f"server.api_key={KEY}", "server.served_model_name=smol")
    yield base
    code, _, out = stop_server(proc)
    assert code == 0, out


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def llm():
    from runtime import LLM

    engine = LLM(overrides=["engine.device=cpu", "engine.deterministic=true"])
    yield engine
    engine.shutdown()


def greedy(max_tokens: int, **extra) -> dict:
    return {"temperature": 0, "max_tokens": max_tokens, **extra}


# ---- pure functions ---------------------------------------------------------------------------------------------
def test_visible_end_holds_back_what_may_start_a_stop_string():
    assert visible_end("Hello wor", 0, ["world"]) == 6  # "wor" may become "world"
    assert visible_end("Hello world!", 0, ["world"]) == 6  # a whole stop string is never sent
    assert visible_end("Hello", 0, ["xyz"]) == 5
    assert visible_end("Hello w", 3, ["w", "lo w"]) == 3  # never before what was already sent
    assert visible_end("abc", 0, []) == 3


def test_server_requests_parse_streaming_and_several_prompts_and_refuse_bad_ones():
    defaults = SamplingParams(temperature=0.0, max_new_tokens=8)
    prompts, sampling, spec = parse_request("/v1/completions", {"prompt": ["a", [1, 2]], "stream": True,
                                                                "stream_options": {"include_usage": True}}, defaults)
    assert prompts == ["a", [1, 2]] and spec.stream and spec.include_usage and sampling.max_new_tokens == 8
    # Every stream option the API has; null is its default. This server never pads chunks (include_obfuscation).
    for options, usage in [({"include_usage": None}, False), ({"include_obfuscation": False}, False),
                           ({"include_usage": True, "include_obfuscation": True}, True)]:
        _, _, spec = parse_request("/v1/completions", {"prompt": "a", "stream": True, "stream_options": options},
                                   defaults)
        assert spec.stream and spec.include_usage == usage
    for body, message in [({"prompt": "a", "stream": "yes"}, "stream="),
                          ({"prompt": "a", "stream_options": {"include_usage": True}}, "needs stream=true"),
                          ({"prompt": "a", "stream": True, "stream_options": {"include_obfuscation": 1}},
                           "include_obfuscation=1 must be true or false"),
                          ({"prompt": "a", "stream": True, "stream_options": {"chunk_size": 4}}, "are supported"),
                          ({"prompt": "a", "suffix": "b"}, "suffix"),
                          ({"prompt": "a", "echo": "yes"}, "echo="),
                          ({"prompt": "a", "max_tokens": 0}, "needs echo=true"),
                          ([1, 2], "JSON object")]:
        with pytest.raises(RequestError, match=message):
            parse_request("/v1/completions", body, defaults)
    with pytest.raises(RequestError, match="echo"):  # the chat API has no echo
        parse_request("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "echo": True}, defaults)
    _, sampling, spec = parse_request("/v1/completions", {"prompt": "a", "echo": True, "logprobs": 2}, defaults)
    assert spec.echo and not spec.prompt_only and sampling.prompt_logprobs == 2 and sampling.logprobs == 2
    _, sampling, spec = parse_request("/v1/completions", {"prompt": "a", "echo": True, "max_tokens": 0}, defaults)
    assert spec.prompt_only and sampling.max_new_tokens == 1 and sampling.prompt_logprobs is None
    # The error body's param names the parameter, in the API's own words, as OpenAI fills it.
    for url, body, param in [("/v1/completions", {"prompt": "a", "temperature": -1}, "temperature"),
                             ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
                             ("/v1/chat/completions", {"messages": [], "n": 2}, "messages"),
                             ("/v1/completions", {"prompt": "a", "logprobs": 99}, "logprobs"),
                             ("/v1/completions", {"prompt": "a", "tools": []}, "tools"),
                             ("/v1/completions", {"prompt": ""}, "prompt")]:
        with pytest.raises(RequestError) as caught:
            parse_request(url, body, defaults)
        assert caught.value.param == param, (body, caught.value)


def test_completion_logprobs_keep_apart_the_tokens_of_a_split_character(llm):
    """Tokens holding part of a UTF-8 character are listed as ``bytes:\\xNN`` (their decoded text is U+FFFD for
    all of them, so the alternatives collapsed into one key); offsets count whole characters."""
    from runtime.frontend.openai_api import TokenText, _completion_logprobs

    tokens = TokenText(llm.tokenizer, llm.strips_leading_space)
    text = "日本の首都は東京です。"
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    raw = [bytes(tokens(t)[1]) for t in ids]
    assert b"".join(raw).decode() == text
    partial = [t for t, b in zip(ids, raw) if not _valid_utf8(b)]
    assert len(set(partial)) >= 3  # the tokenizer splits these characters
    entries = [{"token_id": t, "logprob": -0.5, "top": [(t, -0.5)] + [(p, -1.0 - i) for i, p in
                                                                     enumerate(x for x in dict.fromkeys(partial)
                                                                               if x != t)][:3]} for t in ids]
    lp = _completion_logprobs(entries, 4, tokens)
    for t, b, name, top in zip(ids, raw, lp["tokens"], lp["top_logprobs"]):
        assert name == (tokens(t)[0] if _valid_utf8(b) else "bytes:" + "".join(f"\\x{c:02x}" for c in b))
        assert len(top) == 4 and top[name] == -0.5
    # Where each token starts: the whole characters its earlier tokens' bytes make.
    starts = [len(b"".join(raw[:i]).decode("utf-8", errors="ignore")) for i in range(len(ids))]
    assert lp["text_offset"] == starts


def test_a_sentencepiece_token_of_latin_letters_is_text_not_bytes():
    """"é" is in the byte-level alphabet too (byte 0xE9), but in a SentencePiece vocabulary it is the letter:
    its bytes are its UTF-8, and completions list it as text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from runtime.frontend.openai_api import TokenText, _completion_logprobs
    from runtime.frontend.tokenizer import strips_leading_space

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in ["▁", "é", "ür", "▁caf"]:
        vocab[piece] = len(vocab)
    sp = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    sp_tokenizer = PreTrainedTokenizerFast(tokenizer_object=sp)
    tokens = TokenText(sp_tokenizer, strips_leading_space(sp_tokenizer))
    assert tokens(vocab["é"]) == ("é", list("é".encode())) and tokens(vocab["ür"]) == ("ür", list("ür".encode()))
    assert tokens(vocab["<0xE9>"])[1] == [0xE9]
    ids = [vocab["▁caf"], vocab["é"], vocab["<0xC3>"], vocab["<0xBC>"]]  # café, then ü split into its bytes
    lp = _completion_logprobs([{"token_id": t, "logprob": -1.0, "top": [(t, -1.0)]} for t in ids], 1, tokens)
    # A generated word-initial token reads with its space, as the completion's text has it after the prompt.
    assert lp["tokens"] == [" caf", "é", "bytes:\\xc3", "bytes:\\xbc"] and lp["text_offset"] == [0, 4, 5, 5]


def _valid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# ---- the server -------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_models_health_and_auth(server, client):
    assert [m.id for m in client.models.list().data] == ["smol"]
    assert client.models.retrieve("smol").id == "smol"
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("other")
    assert urllib.request.urlopen(server + "/health", timeout=10).status == 200
    wrong = openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.models.list()
    assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="other", prompt="Hi", max_tokens=2)
    # A key of bytes that are not UTF-8 is a wrong key too: 401 in OpenAI's shape, not a server error.
    import socket
    from urllib.parse import urlsplit

    address = urlsplit(server)
    with socket.create_connection((address.hostname, address.port), timeout=30) as raw:
        raw.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                    b"Authorization: Bearer \xff\xfe\r\n\r\n")
        answer = b""
        while chunk := raw.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 401") and json.loads(body)["error"]["code"] == "invalid_api_key", answer


def _call(url: str, body: object = None, key: str | None = KEY) -> tuple[int, dict]:
    """(status, JSON body) of a GET (no body) or a POST."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_tokenizer_endpoints_answer_as_the_models_tokenizer(server, llm):
    """vLLM's /tokenize, /detokenize and /tokenizer_info, against transformers' tokenizer of the same model; what
    lm-evaluation-harness checks before it tokenizes on the server."""
    tok = llm.tokenizer
    text = "Hello world: tokenizers, and 3.14159 sélectionné"
    status, answer = _call(server + "/tokenize", {"prompt": text, "model": "smol"})
    assert status == 200 and answer["tokens"] == tok.encode(text) and answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] == llm.engine.max_seq_len
    status, answer = _call(server + "/tokenize", {"prompt": "test", "add_special_tokens": False})
    assert status == 200 and answer["tokens"] == tok.encode("test", add_special_tokens=False)
    chat = [{"role": "user", "content": "What is 2+2?"}]
    status, answer = _call(server + "/tokenize", {"messages": chat})
    assert status == 200 and answer["tokens"] == llm.encode(chat)  # what a chat request sends the model
    ids = [tok.convert_tokens_to_ids(tok.eos_token), *tok.encode(text)]
    status, answer = _call(server + "/detokenize", {"tokens": ids})
    assert status == 200 and answer["prompt"] == tok.decode(ids) and tok.eos_token in answer["prompt"]  # undoes it
    status, answer = _call(server + "/tokenize", {"prompt": text, "return_token_strs": True,
                                                  "add_special_tokens": None})
    assert status == 200 and answer["token_strs"] == tok.convert_ids_to_tokens(tok.encode(text))
    status, info = _call(server + "/tokenizer_info")
    assert status == 200 and info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    assert info["model_max_length"] == llm.engine.max_seq_len
    for path, body, code, param in [("/tokenize", {"prompt": "a", "messages": chat}, 400, "prompt"),
                                    ("/tokenize", {"prompt": 3}, 400, "prompt"),
                                    ("/tokenize", {"prompt": "a", "truncate": 2}, 400, "truncate"),
                                    ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, 400,
                                     "add_special_tokens"),
                                    ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
                                    ("/detokenize", {"tokens": [tok.vocab_size + 10**6]}, 400, "tokens"),
                                    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
                                    ("/tokenize", b"{not json", 400, None)]:
        status, answer = _call(server + path, body)
        assert (status, answer["error"]["param"]) == (code, param), (path, body, answer)
    assert _call(server + "/tokenize", {"prompt": "a"}, key=None)[0] == 401  # only the probes answer without it


@pytest.mark.slow
def test_chat_and_completion_stream_and_not_equal_generate(client, llm):
    question = [{"role": "user", "content": "What is 2+2?"}]
    ref_chat = llm.chat(question, SamplingParams(temperature=0, max_new_tokens=24))[0]
    ref_text = llm.generate("The capital of France is", SamplingParams(temperature=0, max_new_tokens=24))[0]

    chat = client.chat.completions.create(model="smol", messages=question, **greedy(24))
    assert chat.object == "chat.completion" and chat.choices[0].message.content == ref_chat.text
    assert chat.choices[0].finish_reason == ref_chat.finish_reason
    assert chat.usage.prompt_tokens == ref_chat.prompt_tokens
    assert chat.usage.completion_tokens == ref_chat.completion_tokens

    done = client.completions.create(model="smol", prompt="The capital of France is", **greedy(24))
    assert done.object == "text_completion" and done.choices[0].text == ref_text.text

    pieces, roles, finish, usage = [], [], None, None
    for chunk in client.chat.completions.create(model="smol", messages=question, stream=True,
                                                stream_options={"include_usage": True}, **greedy(24)):
        assert chunk.object == "chat.completion.chunk"
        if not chunk.choices:
            usage = chunk.usage
            continue
        delta = chunk.choices[0].delta
        roles += [delta.role] if delta.role else []
        pieces.append(delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    assert roles == ["assistant"] and "".join(pieces) == ref_chat.text and finish == ref_chat.finish_reason
    assert usage.completion_tokens == ref_chat.completion_tokens and usage.prompt_tokens == ref_chat.prompt_tokens
    assert len([p for p in pieces if p]) > 1  # streamed, not one piece at the end

    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smol", prompt="The capital of France is", stream=True, **greedy(24)) if c.choices)
    assert streamed == ref_text.text


@pytest.mark.slow
def test_n_logprobs_stop_and_seed(client, llm):
    out = client.completions.create(model="smol", prompt=["Once upon a time", "Roses are red,"], n=2, logprobs=3,
                                    temperature=0.8, max_tokens=12, seed=7)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for choice in out.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) > 0
        assert "".join(lp.tokens) == choice.text
        assert all(len(top) >= 3 and all(v <= 0 for v in top.values()) for top in lp.top_logprobs)
    again = client.completions.create(model="smol", prompt=["Once upon a time", "Roses are red,"], n=2,
                                      temperature=0.8, max_tokens=12, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # same seed, same texts
    assert out.choices[0].text != out.choices[1].text  # the two samples of one prompt differ

    chat = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Say hello."}],
                                          logprobs=True, top_logprobs=2, **greedy(10))
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content  # an ending EOS is not listed
    assert len(content) >= chat.usage.completion_tokens - 1 and all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].token == content[0].top_logprobs[0].token  # greedy: the most likely token

    full = client.completions.create(model="smol", prompt="One, two, three, four,", **greedy(16)).choices[0].text
    stop = full.strip().split()[1]  # a word the greedy continuation reaches
    cut = client.completions.create(model="smol", prompt="One, two, three, four,", stop=[stop], **greedy(16))
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == full[: full.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smol", prompt="One, two, three, four,", stop=[stop], stream=True, **greedy(16)) if c.choices)
    assert streamed == cut.choices[0].text and stop not in streamed  # no partial stop string leaked


def test_echo_returns_the_prompt_and_its_logprobs_as_lm_eval_reads_them(server, client, llm):
    """lm-evaluation-harness scores a continuation with token-id prompts, echo, max_tokens=1, logprobs=1 and
    temperature 0, then reads token_logprobs[len(context):-1] and compares each with its alternatives' best."""
    encode = llm.tokenizer.encode
    context = encode("The capital of France is")
    # The third ends an answer: the model's next token is its EOS, which the text leaves out but the scores keep.
    answered = llm.encode([{"role": "user", "content": "Say hello"}]) + encode("Hello! How can I help you today?")
    prompts = [context + encode(" Paris"), context + encode(" a small town"), answered]
    out = client.completions.create(model="smol", prompt=prompts, echo=True, logprobs=1, max_tokens=1,
                                    temperature=0, seed=1234)
    ref = llm.generate(prompts, SamplingParams(temperature=0, max_new_tokens=1, logprobs=1, prompt_logprobs=1))
    assert [c.index for c in out.choices] == [0, 1, 2] and ref[2].finish_reason == "stop" and ref[2].text == ""
    for choice, prompt, r in zip(out.choices, prompts, ref):
        lp = choice.logprobs
        assert choice.text == llm.tokenizer.decode(prompt, skip_special_tokens=True) + r.text
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(prompt) + 1
        ends = [*lp.text_offset[1:], len(choice.text)]
        for token_id, t, o, end in zip([*prompt, *r.token_ids], lp.tokens, lp.text_offset, ends):
            # A token stands at its offset, or takes no room: a special token the text leaves out.
            assert choice.text[o : o + len(t)] == t or (token_id in llm.tokenizer.all_special_ids and end == o)
        assert lp.text_offset[-1] == len(choice.text) - len(r.text)  # the completion starts after the prompt
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing comes before it
        assert lp.token_logprobs[1:-1] == pytest.approx([e["logprob"] for e in r.prompt_logprobs[1:]], abs=1e-5)
        assert lp.token_logprobs[-1] == pytest.approx(r.logprobs[0]["logprob"], abs=1e-5)
        for p in range(1, len(prompt)):  # lm-eval's is_greedy test, against the engine's own top choice
            greedy_here = lp.token_logprobs[p] == max(lp.top_logprobs[p].values())
            assert greedy_here == (r.prompt_logprobs[p]["top"][0][0] == prompt[p])
        assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())  # the greedy token itself
    assert out.usage.prompt_tokens == sum(map(len, prompts)) and out.usage.completion_tokens == 3
    streamed = [c.choices[0] for c in client.completions.create(
        model="smol", prompt=[answered], echo=True, logprobs=1, max_tokens=1, temperature=0, stream=True) if c.choices]
    assert [v for c in streamed if c.logprobs for v in c.logprobs.token_logprobs] == out.choices[2].logprobs.token_logprobs
    assert [v for c in streamed if c.logprobs for v in c.logprobs.text_offset] == out.choices[2].logprobs.text_offset

    # A prompt that ends inside a character: the completion's offsets go on from the prompt's text as returned.
    split = encode("café 日本語")[:-1]
    cut = client.completions.create(model="smol", prompt=[split], echo=True, logprobs=0, **greedy(3)).choices[0]
    shown = llm.tokenizer.decode(split, skip_special_tokens=True)
    assert cut.text.startswith(shown) and cut.logprobs.text_offset[len(split)] == len(shown)

    # A text prompt comes back as sent; offsets point into the returned text; a stream says the same.
    asked = dict(model="smol", prompt="The capital of France is", echo=True, logprobs=2, **greedy(4))
    plain = client.completions.create(**asked).choices[0]
    assert plain.text.startswith("The capital of France is") and len(plain.text) > len("The capital of France is")
    lp = plain.logprobs
    assert all(plain.text[o : o + len(t)] == t for t, o in zip(lp.tokens, lp.text_offset))
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **asked) if c.choices]
    assert "".join(c.text for c in chunks) == plain.text
    assert [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs] == lp.token_logprobs

    # max_tokens=0: the prompt and its logprobs alone, nothing generated (as the legacy API answered it), and
    # nothing counted as generated.
    generated = metrics(server)["tpinfer_generation_tokens_total"]
    for stream in (False, True):
        only = dict(model="smol", prompt=[prompts[0]], echo=True, logprobs=0, max_tokens=0)
        if stream:
            chunks = [c for c in client.completions.create(stream=True, stream_options={"include_usage": True},
                                                           **only)]
            choices = [c.choices[0] for c in chunks if c.choices]
            text = "".join(c.text for c in choices)
            token_logprobs = [v for c in choices if c.logprobs for v in c.logprobs.token_logprobs]
            reason, usage = choices[-1].finish_reason, chunks[-1].usage
        else:
            answer = client.completions.create(**only)
            text, token_logprobs = answer.choices[0].text, answer.choices[0].logprobs.token_logprobs
            reason, usage = answer.choices[0].finish_reason, answer.usage
        assert text == llm.tokenizer.decode(prompts[0]) and reason == "length"
        assert token_logprobs[1:] == pytest.approx([e["logprob"] for e in ref[0].prompt_logprobs[1:]], abs=1e-5)
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompts[0]), 0)
    assert metrics(server)["tpinfer_generation_tokens_total"] == generated


@pytest.mark.slow
def test_streamed_text_offsets_and_first_token_times_equal_the_unstreamed(server, client):
    """A stop string's possible start holds text back in a stream; the tokens' text offsets must not move with
    it. A request that ends on its first token still counts one time to first token."""
    prompt = "One, two, three, four,"
    full = client.completions.create(model="smol", prompt=prompt, **greedy(16)).choices[0].text
    held = full.strip().split()[1] + "\u2603"  # its word comes, the whole never does: that text is held back
    asked = dict(model="smol", prompt=prompt, logprobs=2, stop=[held], **greedy(16))
    plain = client.completions.create(**asked).choices[0]
    assert plain.text == full
    starts = list(plain.logprobs.text_offset)
    assert starts == [len("".join(plain.logprobs.tokens[:i])) for i in range(len(starts))]
    streamed = [o for c in client.completions.create(stream=True, **asked) if c.choices and c.choices[0].logprobs
                for o in c.choices[0].logprobs.text_offset]
    assert streamed == starts
    before = metrics(server)["tpinfer_time_to_first_token_seconds_count"]
    for _ in range(3):
        client.completions.create(model="smol", prompt="Hello", max_tokens=1)
    assert metrics(server)["tpinfer_time_to_first_token_seconds_count"] == before + 3


@pytest.mark.slow
def test_logprobs_list_the_tokens_the_text_shows(client, llm):
    """Not an ending EOS, nor a hidden stop token, nor tokens that start past a stop string's cut; a stream lists
    the same tokens."""
    question = [{"role": "user", "content": "Say hello."}]

    def chat(stream: bool = False, **extra) -> tuple[str, list[str]]:
        asked = dict(model="smol", messages=question, logprobs=True, **extra, **greedy(40))
        if not stream:
            out = client.chat.completions.create(**asked).choices[0]
            return out.message.content, [t.token for t in out.logprobs.content]
        text, tokens = "", []
        for c in client.chat.completions.create(stream=True, **asked):
            if c.choices:
                text += c.choices[0].delta.content or ""
                tokens += [t.token for t in c.choices[0].logprobs.content] if c.choices[0].logprobs else []
        return text, tokens

    ref = llm.chat(question, SamplingParams(temperature=0, max_new_tokens=40))[0]
    assert ref.finish_reason == "stop" and ref.token_ids[-1] in llm.eos_ids  # it ends on its EOS
    text, tokens = chat()
    assert text == ref.text and "".join(tokens) == text and len(tokens) == len(ref.token_ids) - 1
    assert chat(stream=True) == (text, tokens)

    hidden = ref.token_ids[3]
    assert hidden not in ref.token_ids[:3]
    cut_text, cut_tokens = chat(extra_body={"stop_token_ids": [hidden]})
    assert cut_tokens == tokens[:3] and cut_text == "".join(tokens[:3])
    assert chat(stream=True, extra_body={"stop_token_ids": [hidden]}) == (cut_text, cut_tokens)

    stop = text.split()[1][1:]  # starts inside a token
    cut_text, cut_tokens = chat(stop=[stop])
    assert cut_text == text[: text.index(stop)]
    assert len("".join(cut_tokens[:-1])) < len(cut_text) < len("".join(cut_tokens))  # the last starts before the cut
    assert cut_tokens == tokens[: len(cut_tokens)]
    assert chat(stream=True, stop=[stop]) == (cut_text, cut_tokens)

    # Several choices wake one stream together: an entry held back with its text must still go out once the text
    # does, whichever choice's token woke the stream.
    asked = dict(model="smol", prompt="The capital of France is", n=3, logprobs=1, **greedy(6))
    first = client.completions.create(**asked).choices[0].logprobs.tokens[0]
    asked["stop"] = [first + "\u2603"]  # the first token's text is held until the next token shows it is no stop
    plain = [(c.text, c.logprobs.tokens, c.logprobs.text_offset) for c in client.completions.create(**asked).choices]
    streamed = [("", [], []) for _ in plain]
    for chunk in client.completions.create(stream=True, **asked):
        for c in chunk.choices:
            text, tokens, offsets = streamed[c.index]
            lp = c.logprobs
            streamed[c.index] = (text + c.text, tokens + (lp.tokens if lp else []), offsets + (lp.text_offset if lp else []))
    assert streamed == plain and all(p[1][0] == first for p in plain)


@pytest.mark.slow
def test_a_long_prompt_being_tokenized_holds_up_no_other_request(server):
    """Prompts are encoded off the event loop: /health answers while a 17 MB prompt (seconds to tokenize here)
    is encoded, and that prompt then gets its own 400."""
    import threading

    body = json.dumps({"model": "smol", "prompt": "hello world " * 1_400_000, "max_tokens": 1}).encode()
    answer: dict = {}

    def post() -> None:
        request = urllib.request.Request(server + "/v1/completions", data=body, method="POST", headers={
            "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        try:
            urllib.request.urlopen(request, timeout=300)
        except urllib.error.HTTPError as exc:
            answer.update(status=exc.code, body=json.loads(exc.read()))

    thread = threading.Thread(target=post)
    thread.start()
    waits = []
    while thread.is_alive():
        start = time.monotonic()
        assert urllib.request.urlopen(server + "/health", timeout=60).status == 200
        waits.append(time.monotonic() - start)
        time.sleep(0.1)
    thread.join()
    assert answer["status"] == 400 and answer["body"]["error"]["code"] == "context_length_exceeded", answer
    assert len(waits) >= 3 and max(waits) < 2.0, waits


@pytest.mark.slow
def test_bad_bodies_get_400_in_openais_shape_and_the_server_stays_up(server, client):
    def post(body: bytes, path: str = "/v1/chat/completions", kind: str = "application/json") -> tuple[int, dict]:
        request = urllib.request.Request(server + path, data=body, method="POST", headers={
            "Authorization": f"Bearer {KEY}", "Content-Type": kind})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    cases = [b"{not json", b'{"messages": "hi"}', b'{"messages": [{"role": "user", "content": "x"}], "n": 0}',
             b'{"messages": [{"role": "user", "content": "x"}], "tools": []}', b"[1, 2]",
             json.dumps({"messages": [{"role": "user", "content": "word " * 5000}]}).encode()]
    for body in cases:
        status, answer = post(body)
        assert status == 400, (body[:60], answer)
        assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["message"]
    # Not a server error either: a charset Python does not know, JSON nested past Python's recursion limit.
    status, answer = post(b'{"prompt": "x", "max_tokens": 1}', "/v1/completions", "application/json; charset=bogus")
    assert status == 400 and answer["error"]["code"] == "invalid_json", answer
    status, answer = post(b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "/v1/completions")
    assert status == 400 and answer["error"]["code"] == "invalid_json", answer
    assert post(b'{"prompt": "x"}', "/v1/nowhere")[0] == 404
    status, answer = post(b'{"prompt": [5, 6, 7], "max_tokens": 1000000}', "/v1/completions")
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer  # not cut short
    assert answer["error"]["type"] == "invalid_request_error" and "3 in the prompt" in answer["error"]["message"]
    for extra, param in [({"logit_bias": {"99999999": 1}}, "logit_bias"), ({"stop_token_ids": [99999999]},
                                                                             "stop_token_ids")]:
        status, answer = post(json.dumps({"prompt": "x", "max_tokens": 1, **extra}).encode(), "/v1/completions")
        assert (status, answer["error"]["param"]) == (400, param), answer  # checked against the model's vocabulary
        assert "outside the vocabulary" in answer["error"]["message"]
    ok = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], **greedy(4))
    assert ok.choices[0].message.content is not None


@pytest.mark.slow
def test_32_concurrent_streams_complete_with_generates_texts(server, llm):
    openai = pytest.importorskip("openai")
    refs = [o.text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=16))]

    async def one(client, prompt: str) -> str:
        stream = await client.completions.create(model="smol", prompt=prompt, stream=True, **greedy(16))
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run_all() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0) as client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    assert asyncio.run(run_all()) == refs


def test_a_call_aborted_while_queued_is_never_admitted(llm):
    """The client leaves before the loop takes its call from the queue: the abort is seen first, and the call must
    not then take a row and pages that nothing would give back."""
    from runtime.frontend.serving import Call, Serving

    serving = Serving(llm)  # not started: its loop's refill runs here, on this thread
    free_rows, free_pages = len(llm.scheduler.free_rows), llm.scheduler.allocator.num_free
    reqs = llm.make_requests("Hello there", SamplingParams(n=4, max_new_tokens=3))
    loop = asyncio.new_event_loop()
    try:
        call = Call(reqs, reqs[0].prompt_len, False, loop)
        serving.submit(call)
        serving.abort(call)
        assert serving._refill()
        assert call.finished and all(r.finish_reason == "abort" for r in reqs)
        assert not llm.scheduler.waiting and llm.scheduler.idle and not serving._calls
        assert (len(llm.scheduler.free_rows), llm.scheduler.allocator.num_free) == (free_rows, free_pages)
    finally:
        loop.close()


def test_a_call_is_counted_once_when_its_client_leaves_after_the_last_chunk(llm):
    """Writing the last chunk fails and the front end aborts a call the loop already closed: metrics must not
    count it again."""
    from runtime.frontend.serving import Call, Observer, Serving

    finished: list[Call] = []
    serving = Serving(llm, Observer(on_finish=finished.append))  # not started: its refill runs on this thread
    reqs = llm.make_requests("Hello there", SamplingParams(max_new_tokens=3))
    loop = asyncio.new_event_loop()
    try:
        call = Call(reqs, reqs[0].prompt_len, True, loop)
        serving._close(call)  # the loop finished it
        serving.abort(call)  # then the client left
        assert serving._refill()
        assert finished == [call]
    finally:
        loop.close()


@pytest.mark.slow
def test_a_client_that_leaves_mid_stream_gives_its_pages_back(server, client):
    stream = client.completions.create(model="smol", prompt="Tell me a long story.", stream=True, max_tokens=3000,
                                       extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 5:
            break
    assert metrics(server)["tpinfer_kv_pages_in_use"] > 0  # still decoding, holding its pages
    stream.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = metrics(server)
        if now["tpinfer_kv_pages_in_use"] == 0 and now["tpinfer_requests_running"] == 0:
            break
        time.sleep(0.2)
    assert now["tpinfer_kv_pages_in_use"] == 0 and now["tpinfer_requests_running"] == 0
    assert now['tpinfer_requests_total{outcome="aborted"}'] >= 1


@pytest.mark.slow
def test_sigterm_with_requests_in_flight_exits_0_within_the_drain_timeout():
    openai = pytest.importorskip("openai")
    proc, base = start_server()
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    streams = [client.completions.create(model=client.models.list().data[0].id,
                                         prompt=f"Story {i}:", stream=True, max_tokens=3000,
                                         extra_body={"ignore_eos": True}) for i in range(3)]
    for stream in streams:
        next(iter(stream))  # each is running
    code, seconds, out = stop_server(proc)
    assert code == 0, out
    assert seconds < 4 + 10, out  # the drain timeout, plus the exit
    for stream in streams:  # cut at the timeout, and told so: not a complete answer
        with pytest.raises(openai.APIError, match="cut short") as caught:
            for _ in stream:
                pass
        assert caught.value.body["code"] == "unavailable"
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(base + "/health", timeout=5)  # the port is closed


@pytest.mark.slow
def test_an_unseeded_request_draws_new_noise_after_a_restart():
    """Unseeded noise is keyed by the response id, not by the engine's count of requests, which starts at 0 again:
    a restarted server (a requeued Slurm job, say) does not repeat the draws it made before."""
    body = {"prompt": "Name a random animal, then describe it:", "temperature": 1.0, "max_tokens": 24}
    texts = []
    for _ in range(2):
        proc, base = start_server()
        try:
            status, out = _call(base + "/v1/completions", body, key=None)
        finally:
            code, _, log = stop_server(proc)
        assert status == 200 and code == 0, log
        texts.append(out["choices"][0]["text"])
    assert texts[0] and texts[1] and texts[0] != texts[1]


@pytest.mark.slow
def test_tp3_server_on_gloo_gives_tp1s_greedy_texts(llm):
    openai = pytest.importorskip("openai")
    refs = [o.text for o in llm.generate(PROMPTS[:6], SamplingParams(temperature=0, max_new_tokens=16))]
    proc, base = start_server(nproc=3)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        texts = [client.completions.create(model=model, prompt=p, **greedy(16)).choices[0].text for p in PROMPTS[:6]]
    finally:
        code, seconds, out = stop_server(proc)
    assert texts == refs
    assert code == 0 and seconds < 30, out
