"""OpenAI Batch files in and out: request bodies to sampling, response bodies in OpenAI's shapes (checked key by
key against the API reference, and with the `openai` package's types when it is installed), error lines, resume
by custom_id, kill -9 and rerun (CPU, a tiny random Llama with the default model's tokenizer)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from runtime import LLM
from runtime.frontend import openai_api
from runtime.frontend.job import run_job
from runtime.frontend.job_files import InputError, drop_error_lines, read_rows
from runtime.sampling_params import SamplingParams
from tests.conftest import make_tiny_text_llama
from tests.test_output_lock import kill_job

REPO = Path(__file__).resolve().parents[1]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
DEFAULTS = SamplingParams(temperature=0.0, max_new_tokens=7)

# The documented (API reference) keys of each object, all of them present in what we write.
LINE_KEYS = {"id", "custom_id", "response", "error"}
RESPONSE_KEYS = {"status_code", "request_id", "body"}
BODY_KEYS = {"id", "object", "created", "model", "choices", "usage"}
USAGE_KEYS = {"prompt_tokens", "completion_tokens", "total_tokens"}
CHAT_CHOICE_KEYS = {"index", "message", "logprobs", "finish_reason"}
MESSAGE_KEYS = {"role", "content", "refusal"}
CHAT_LOGPROBS_KEYS = {"content", "refusal"}
CHAT_TOKEN_KEYS = {"token", "logprob", "bytes", "top_logprobs"}
TOP_TOKEN_KEYS = {"token", "logprob", "bytes"}
COMPLETION_CHOICE_KEYS = {"index", "text", "logprobs", "finish_reason"}
COMPLETION_LOGPROBS_KEYS = {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
ERROR_KEYS = {"code", "message"}  # a line that names no request: its own error
API_ERROR_KEYS = {"message", "type", "param", "code"}  # a refused request: its 400 response's body.error


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _served(r: dict) -> bool:
    """A line OpenAI's clients read as an answer: a 200 response and no error."""
    return r["error"] is None and r["response"]["status_code"] == 200


def _error(r: dict) -> dict:
    """A failed line's error: its own, or its 400 response's, as OpenAI writes a request its endpoint refused."""
    return r["error"] or r["response"]["body"]["error"]


def _line(custom_id: str, url: str, **body: object) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


# ---- request bodies ----------------------------------------------------------------------------------------------
def test_chat_body_maps_to_sampling_params():
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    prompt, sampling, request = openai_api.parse_body(CHAT, {
        "model": "m", "messages": messages, "max_completion_tokens": 9, "temperature": 0.5, "top_p": 0.9, "n": 3,
        "stop": "\n", "seed": 4, "logprobs": True, "top_logprobs": 2, "top_k": 5, "ignore_eos": True,
        "stop_token_ids": [7], "frequency_penalty": 0, "user": "u", "stream": False, "presence_penalty": None,
    }, DEFAULTS)
    assert prompt == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"}]
    assert (sampling.max_new_tokens, sampling.temperature, sampling.top_p, sampling.n) == (9, 0.5, 0.9, 3)
    assert (sampling.stop, sampling.seed, sampling.logprobs, sampling.top_k) == (["\n"], 4, 2, 5)
    assert sampling.ignore_eos and sampling.stop_token_ids == [7]
    assert request == openai_api.Request(CHAT, "m", 2, max_tokens=9)
    _, plain, request = openai_api.parse_body(CHAT, {"messages": messages, "logprobs": True}, DEFAULTS)
    assert plain.max_new_tokens == 7 and plain.temperature == 0.0 and plain.logprobs == 0  # defaults; k = 0
    assert request.model is None and request.logprobs == 0 and request.max_tokens is None  # not asked for
    assert openai_api.parse_body(CHAT, {"messages": messages}, DEFAULTS)[2].logprobs is None


def test_completion_body_maps_to_sampling_params():
    prompt, sampling, request = openai_api.parse_body(COMPLETIONS, {
        "prompt": "Once", "max_tokens": 3, "logprobs": 4, "n": 2, "echo": False, "best_of": 1}, DEFAULTS)
    assert prompt == "Once" and (sampling.max_new_tokens, sampling.logprobs, sampling.n) == (3, 4, 2)
    assert request == openai_api.Request(COMPLETIONS, None, 4, max_tokens=3)
    assert openai_api.parse_body(COMPLETIONS, {"prompt": [1, 2, 3]}, DEFAULTS)[0] == [1, 2, 3]
    assert openai_api.parse_body(COMPLETIONS, {"prompt": [[1, 2]]}, DEFAULTS)[0] == [1, 2]  # a batch of one


def test_chat_body_fields_that_change_no_answer_are_accepted():
    messages = [{"role": "user", "content": "x"}]
    plain = openai_api.parse_body(CHAT, {"messages": messages}, DEFAULTS)
    assert openai_api.parse_body(CHAT, {"messages": messages, "store": True, "metadata": {"run": "7"}},
                                 DEFAULTS) == plain
    # Clients fill these in at values that change nothing; any other value is refused, naming the accepted ones.
    filled = {"response_format": {"type": "text"}, "tool_choice": "none", "parallel_tool_calls": False}
    assert openai_api.parse_body(CHAT, {"messages": messages, **filled}, DEFAULTS) == plain
    for name, value, accepted in [("response_format", {"type": "json_object"}, "{'type': 'text'}"),
                                  ("tool_choice", "required", "'none' or 'auto'")]:
        with pytest.raises(openai_api.RequestError, match=re.escape(f"{name}={value!r} is not supported "
                                                                    f"(only {accepted})")):
            openai_api.parse_body(CHAT, {"messages": messages, name: value}, DEFAULTS)


def test_developer_messages_are_system_messages_and_unknown_roles_are_refused():
    as_developer = openai_api.parse_body(CHAT, {"messages": [{"role": "developer", "content": "be brief"},
                                                             {"role": "user", "content": "x"}]}, DEFAULTS)
    as_system = openai_api.parse_body(CHAT, {"messages": [{"role": "system", "content": "be brief"},
                                                          {"role": "user", "content": "x"}]}, DEFAULTS)
    assert as_developer == as_system and as_system[0][0]["role"] == "system"
    for role in ("tool", "robot"):
        with pytest.raises(openai_api.RequestError, match=rf"messages\[1\].role='{role}' is not one of"):
            openai_api.parse_body(CHAT, {"messages": [{"role": "user", "content": "x"},
                                                      {"role": role, "content": "y"}]}, DEFAULTS)


def test_message_names_reach_the_chat_template_and_must_be_strings():
    messages = [{"role": "user", "content": "hi", "name": "ada"}, {"role": "user", "content": "yo"}]
    parsed = openai_api.parse_body(CHAT, {"messages": messages}, DEFAULTS)[0]
    assert parsed == [{"role": "user", "content": "hi", "name": "ada"}, {"role": "user", "content": "yo"}]
    template = "{% for m in messages %}[{{ m.name | default('-') }}] {{ m.content }}\n{% endfor %}"
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"x": 0}, unk_token="x")))
    assert tok.apply_chat_template(parsed, chat_template=template, tokenize=False) == "[ada] hi\n[-] yo\n"
    with pytest.raises(openai_api.RequestError, match=r"messages\[0\].name must be a string"):
        openai_api.parse_body(CHAT, {"messages": [{"role": "user", "content": "hi", "name": 7}]}, DEFAULTS)


def test_openai_ranges_of_seed_and_top_p_map_onto_ours():
    def sampling(**body):
        return openai_api.parse_body(COMPLETIONS, {"prompt": "x", **body}, DEFAULTS)[1]
    # OpenAI's seeds are int64: a negative one is taken modulo 2**63, so it is as reproducible as any other.
    assert sampling(seed=-1).seed == 2**63 - 1 and sampling(seed=-2**63).seed == 0
    assert sampling(seed=-5) == sampling(seed=2**63 - 5) != sampling(seed=5)
    with pytest.raises(openai_api.RequestError, match="seed="):
        sampling(seed=-2**63 - 1)
    # top_p=0 (OpenAI's range is [0, 1]): the nucleus is the most likely token alone.
    greedy_nucleus = sampling(top_p=0, top_k=40, temperature=0.7)
    assert (greedy_nucleus.top_p, greedy_nucleus.top_k, greedy_nucleus.temperature) == (1.0, 1, 0.7)
    assert sampling(top_p=0.5).top_p == 0.5 and sampling(top_p=0.5).top_k == DEFAULTS.top_k
    with pytest.raises(openai_api.RequestError, match="top_p=-0.1"):
        sampling(top_p=-0.1)


@pytest.mark.parametrize(("url", "body", "message"), [
    (COMPLETIONS, {"prompt": "x", "echo": 1}, "echo=1 must be true or false"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, "max_tokens=0 generates nothing: it needs echo=true"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
     "response_format="),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 2.5}, "frequency_penalty=2.5"),
    (COMPLETIONS, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty=0"),
    (COMPLETIONS, {"prompt": "x", "min_p": 1.5}, "min_p=1.5"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": []}, "unsupported parameter(s) ['tools']"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs needs logprobs=true"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens=0 must be an integer > 0"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 99}, "top_logprobs=99"),
    (CHAT, {"messages": []}, "'messages' must be a non-empty list"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text parts"),
    (COMPLETIONS, {"prompt": ["a", "b"]}, "holds 2 prompts"),
    (COMPLETIONS, {"prompt": "x", "logprobs": True}, "logprobs=True must be an integer"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 3, "max_completion_tokens": 4}, "unsupported parameter(s)"),
])
def test_bad_bodies_name_the_parameter(url, body, message):
    with pytest.raises(openai_api.RequestError) as raised:
        openai_api.parse_body(url, body, DEFAULTS)
    assert message in str(raised.value) and raised.value.code == "invalid_request"


def test_bad_lines_get_their_own_codes():
    with pytest.raises(openai_api.RequestError) as method:
        openai_api.parse_line({"method": "GET", "url": CHAT, "body": {}}, DEFAULTS)
    assert method.value.code == "invalid_method" and "'GET'" in str(method.value)
    with pytest.raises(openai_api.RequestError) as url:
        openai_api.parse_line({"method": "POST", "url": "/v1/embeddings", "body": {}}, DEFAULTS)
    assert url.value.code == "invalid_url" and "/v1/embeddings" in str(url.value)


def test_a_row_of_the_other_kind_is_an_error_row_and_the_rows_after_it_are_served(tmp_path):
    native = json.dumps({"id": 1, "prompt": "x"})
    batch = json.dumps(_line("a", COMPLETIONS, prompt="x"))
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(["{not json", native, "", batch, native.replace("1", "2")]) + "\n")
    rows = list(read_rows(path, DEFAULTS, chat_template=False, fmt="auto"))
    assert [(r.line, r.id, r.error is None) for r in rows] == [(1, None, False), (2, 1, True), (4, None, False),
                                                               (5, 2, True)]
    assert re.search(r"rows.jsonl:4 is an OpenAI batch line .* in a file of native rows \(as its first row says\)",
                     rows[2].error)
    path.write_text("\n".join([batch, batch.replace('"a"', '"b"'), native]) + "\n")
    rows = list(read_rows(path, DEFAULTS, chat_template=False, fmt="openai"))
    assert [(r.id, r.error is None) for r in rows] == [("a", True), ("b", True), (None, False)]
    assert re.search(r"rows.jsonl:3 is a native row .* in a file of OpenAI batch lines \(job.format=openai\)",
                     rows[2].error)
    # A native row that carries a custom_id of its own and misspells its prompt: the error names the key.
    path.write_text("\n".join([native, json.dumps({"id": 3, "promt": "x", "custom_id": "c"})]) + "\n")
    rows = list(read_rows(path, DEFAULTS, chat_template=False, fmt="auto"))
    assert rows[1].id == 3 and "unknown key 'promt' (did you mean 'prompt'?)" in rows[1].error
    # A forced format the file's first row contradicts stops the job before any row is read.
    path.write_text(native + "\n")
    with pytest.raises(InputError, match=r"rows.jsonl: its first row is a native row .*job.format=openai"):
        list(read_rows(path, DEFAULTS, chat_template=False, fmt="openai"))


# ---- response bodies ---------------------------------------------------------------------------------------------
def _output(samples: list[SimpleNamespace], prompt_tokens: int = 4) -> SimpleNamespace:
    return SimpleNamespace(outputs=samples, prompt_tokens=prompt_tokens)


def _sample(index: int, text: str, ids: list[int], logprobs: bool) -> SimpleNamespace:
    entries = [{"token_id": t, "logprob": -0.5 * (i + 1), "top": [[t, -0.5 * (i + 1)], [t + 1, -3.0], [t + 2, -4.0]]}
               for i, t in enumerate(ids)] if logprobs else None
    return SimpleNamespace(sample_index=index, text=text, token_ids=ids, finish_reason="length",
                           completion_tokens=len(ids), logprobs=entries, shown_tokens=len(ids))


class Vocab:
    """Byte-level tokens: 'Ġ' is a space's byte."""

    words = {5: "Ġhi", 6: "Ġthere", 7: "!", 8: "Ġyou", 9: "Ġme", 10: "."}

    def decode(self, ids: list[int], **_: object) -> str:
        return "".join(self.words[i].replace("Ġ", " ") for i in ids)

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.words[token_id]


def test_chat_and_completion_bodies_have_openai_shapes():
    tokens = openai_api.TokenText(Vocab())
    out = _output([_sample(0, " hi there", [5, 6], True), _sample(1, "! you", [7, 8], True)])
    chat = openai_api.response_body(openai_api.Request(CHAT, "my-model", 2), out, tokens, "dir", 123, '"a"')
    assert set(chat) == BODY_KEYS and chat["object"] == "chat.completion" and chat["model"] == "my-model"
    assert chat["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}  # every choice counts
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    choice = chat["choices"][0]
    assert set(choice) == CHAT_CHOICE_KEYS and set(choice["message"]) == MESSAGE_KEYS
    assert choice["message"] == {"role": "assistant", "content": " hi there", "refusal": None}
    assert set(choice["logprobs"]) == CHAT_LOGPROBS_KEYS
    first = choice["logprobs"]["content"][0]
    assert set(first) == CHAT_TOKEN_KEYS and first["token"] == " hi" and first["bytes"] == [32, 104, 105]
    assert [set(t) for t in first["top_logprobs"]] == [TOP_TOKEN_KEYS] * 2  # k = 2 of the 3 computed
    assert [t["token"] for t in first["top_logprobs"]] == [" hi", " there"]

    text = openai_api.response_body(openai_api.Request(COMPLETIONS, None, 1), out, tokens, "dir", 123, '"b"')
    assert set(text) == BODY_KEYS and text["object"] == "text_completion" and text["model"] == "dir"
    choice = text["choices"][1]
    assert set(choice) == COMPLETION_CHOICE_KEYS and choice["text"] == "! you"
    assert set(choice["logprobs"]) == COMPLETION_LOGPROBS_KEYS
    assert choice["logprobs"]["tokens"] == ["!", " you"] and choice["logprobs"]["text_offset"] == [0, 1]
    assert choice["logprobs"]["top_logprobs"] == [{"!": -0.5}, {" you": -1.0}]
    assert choice["logprobs"]["token_logprobs"] == [-0.5, -1.0]

    no_logprobs = openai_api.response_body(openai_api.Request(CHAT, None, None), out, tokens, "d", 1, '"c"')
    assert all(c["logprobs"] is None for c in no_logprobs["choices"])
    _validate(chat)
    _validate(text)


def _validate(body: dict) -> None:
    """With the official package's types, where it is installed (the key checks above stand without it)."""
    try:
        from openai.types import Completion
        from openai.types.chat import ChatCompletion
    except ImportError:
        return
    model = ChatCompletion if body["object"] == "chat.completion" else Completion
    assert model.model_validate(body).model_dump(exclude_unset=True)["choices"]


# ---- a whole batch file ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def text_model(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A tiny random Llama with the default model's tokenizer and chat template, so rows are text and chats."""
    path = make_tiny_text_llama(tmp_path_factory.mktemp("openai_model"), default_model_dir, seed=3)
    return path


def _launch(model: Path, rows: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "launch.py", f"model.path={model}", "engine.device=cpu", "model.max_seq_len=128",
         f"job.input={rows}", f"job.output={out}", "job.progress=false", "job.chat_template=false",
         "sampling.temperature=0", *extra], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


HELLO = [{"role": "user", "content": "Hello! Who are you?"}]
GOOD = [
    _line("chat-n2", CHAT, model="gpt-4o-mini", messages=HELLO, max_tokens=6, n=2, logprobs=True, top_logprobs=3),
    _line("chat", CHAT, messages=[{"role": "system", "content": "Be brief."}, *HELLO], max_completion_tokens=5),
    _line("chat-sampled", CHAT, messages=HELLO, max_tokens=6, temperature=0.8),  # unseeded: noise from its key
    _line("text-n2", COMPLETIONS, prompt="Once upon a time", max_tokens=6, n=2, logprobs=2),
    _line("text-ids", COMPLETIONS, prompt=[504, 2617, 253, 655], max_tokens=4),
]
BAD = {  # custom_id: (line, code)
    "broken": ('{"custom_id": "broken", "method": "POST", "url": "/v1/completions", "body": {"prompt": ',
               "invalid_json"),
    "embed": (json.dumps(_line("embed", "/v1/embeddings", input="x")), "invalid_url"),
    "long": (json.dumps(_line("long", COMPLETIONS, prompt="word " * 300, max_tokens=2)), "context_length_exceeded"),
    "wide": (json.dumps(_line("wide", COMPLETIONS, prompt="Tell me a story", max_tokens=126)),
             "context_length_exceeded"),  # fits no 128-token context beside its prompt: refused, not cut short
    "wider": (json.dumps(_line("wider", CHAT, messages=HELLO, max_completion_tokens=4000)), "context_length_exceeded"),
    "get": (json.dumps({**_line("get", COMPLETIONS, prompt="x"), "method": "GET"}), "invalid_method"),
    "echo": (json.dumps(_line("echo", COMPLETIONS, prompt="x", echo="yes")), "invalid_request"),
    "bias": (json.dumps(_line("bias", COMPLETIONS, prompt="x", logit_bias={"99999999": 1})), "invalid_request"),
}
ECHO = [  # the prompt comes back with its logprobs (lm-evaluation-harness scores continuations so)
    _line("text-echo", COMPLETIONS, prompt="Once upon a time", max_tokens=2, echo=True, logprobs=1),
    _line("ids-echo-only", COMPLETIONS, prompt=[504, 2617, 253, 655], max_tokens=0, echo=True, logprobs=0),
]


def test_a_batch_file_with_good_and_bad_lines(text_model, tmp_path):
    rows = tmp_path / "batch.jsonl"
    lines = [json.dumps(line) for line in GOOD]
    lines[2:2] = [BAD["broken"][0], BAD["embed"][0]]
    lines += [BAD["long"][0], BAD["get"][0], json.dumps(_line("chat", CHAT, messages=HELLO)), BAD["echo"][0],
              BAD["wide"][0], BAD["wider"][0], BAD["bias"][0], *map(json.dumps, ECHO)]
    rows.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    proc = _launch(text_model, rows, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = _read(out)
    assert all(set(r) == LINE_KEYS for r in results)
    served = {r["custom_id"]: r for r in results if _served(r)}
    failed = [r for r in results if not _served(r)]
    assert sorted(served) == sorted(line["custom_id"] for line in GOOD + ECHO)
    assert sorted((r["custom_id"], _error(r)["code"]) for r in failed) == sorted(
        [(cid, code) for cid, (_, code) in BAD.items()] + [("chat", "duplicate_custom_id")])
    for r in failed:
        if r["error"] is not None:  # unreadable, no such endpoint or method, a repeated custom_id
            assert r["response"] is None and set(r["error"]) == ERROR_KEYS and r["error"]["message"]
            assert r["error"]["code"] in openai_api.LINE_ERRORS
        else:  # refused as the endpoint refuses it
            assert set(r["response"]) == RESPONSE_KEYS and r["response"]["status_code"] == 400
            assert set(r["response"]["body"]) == {"error"} and set(_error(r)) == API_ERROR_KEYS and _error(r)["message"]
            assert _error(r)["type"] == "invalid_request_error"
    assert {r["custom_id"] for r in failed if r["error"] is None} == {"long", "wide", "wider", "echo", "bias"}
    assert next(_error(r)["param"] for r in failed if r["custom_id"] == "echo") == "echo"
    assert next(_error(r)["param"] for r in failed if r["custom_id"] == "bias") == "logit_bias"  # the model refused it
    assert len({r["id"] for r in results}) == len(results)

    for line in GOOD:
        r = served[line["custom_id"]]
        assert set(r["response"]) == RESPONSE_KEYS and r["response"]["status_code"] == 200
        body = r["response"]["body"]
        assert set(body) == BODY_KEYS and set(body["usage"]) == USAGE_KEYS
        assert body["model"] == line["body"].get("model", text_model.name)
        n = line["body"].get("n", 1)
        assert [c["index"] for c in body["choices"]] == list(range(n))
        chat = line["url"] == CHAT
        assert body["object"] == ("chat.completion" if chat else "text_completion")
        for c in body["choices"]:
            assert set(c) == (CHAT_CHOICE_KEYS if chat else COMPLETION_CHOICE_KEYS)
            assert c["finish_reason"] in ("stop", "length")
            if chat:
                assert set(c["message"]) == MESSAGE_KEYS and c["message"]["role"] == "assistant"
        _validate(body)
    n2 = served["chat-n2"]["response"]["body"]
    for c in n2["choices"]:
        assert set(c["logprobs"]) == CHAT_LOGPROBS_KEYS
        for entry in c["logprobs"]["content"]:
            assert set(entry) == CHAT_TOKEN_KEYS and len(entry["top_logprobs"]) == 3
            assert all(set(t) == TOP_TOKEN_KEYS for t in entry["top_logprobs"])
    assert n2["usage"]["completion_tokens"] == sum(len(c["logprobs"]["content"]) for c in n2["choices"])
    assert n2["usage"]["total_tokens"] == n2["usage"]["prompt_tokens"] + n2["usage"]["completion_tokens"]
    text = served["text-n2"]["response"]["body"]
    for c in text["choices"]:
        lp = c["logprobs"]
        assert set(lp) == COMPLETION_LOGPROBS_KEYS and len(lp["tokens"]) == len(lp["token_logprobs"])
        assert lp["text_offset"][0] == 0 and all(1 <= len(top) <= 3 for top in lp["top_logprobs"])
    assert text["choices"][0]["text"] == text["choices"][1]["text"]  # greedy
    echoed = served["text-echo"]["response"]["body"]
    choice, lp = echoed["choices"][0], echoed["choices"][0]["logprobs"]
    prompt_tokens = echoed["usage"]["prompt_tokens"]
    assert choice["text"].startswith("Once upon a time") and echoed["usage"]["completion_tokens"] == 2
    assert text["choices"][0]["text"].startswith(choice["text"][len("Once upon a time"):])  # greedy, 2 of its 6
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == prompt_tokens + 2
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:]) and all(1 <= len(t) <= 2 for t in lp["top_logprobs"][1:])
    alone = served["ids-echo-only"]["response"]["body"]
    choice, lp = alone["choices"][0], alone["choices"][0]["logprobs"]
    assert (alone["usage"]["prompt_tokens"], alone["usage"]["completion_tokens"]) == (4, 0)
    assert choice["finish_reason"] == "length" and choice["text"] == "".join(lp["tokens"])
    assert len(lp["token_logprobs"]) == 4 and lp["token_logprobs"][0] is None
    # Not _validate(d): the openai package types token_logprobs as floats; the API itself sends the first as null.

    # The same prompts as native rows, with the same ids: the same texts (greedy, and sampled: a row's noise
    # comes from its key, the custom_id).
    native = tmp_path / "native.jsonl"
    native.write_text("".join(json.dumps({
        "id": line["custom_id"], **({"messages": line["body"]["messages"]} if line["url"] == CHAT
                                     else {"prompt": line["body"]["prompt"]}),
        "sampling": {"max_new_tokens": line["body"].get("max_tokens") or line["body"]["max_completion_tokens"],
                     "temperature": line["body"].get("temperature", 0.0)},
    }) + "\n" for line in GOOD))
    assert _launch(text_model, native, tmp_path / "native_out.jsonl").returncode == 0
    expected = {r["id"]: r["text"] for r in _read(tmp_path / "native_out.jsonl")}
    got = {line["custom_id"]: served[line["custom_id"]]["response"]["body"]["choices"][0] for line in GOOD}
    assert {cid: c.get("text", c.get("message", {}).get("content")) for cid, c in got.items()} == expected


def test_a_rerun_retries_error_lines_and_keeps_one_line_per_custom_id(tiny_llama_dir, tmp_path):
    rows = tmp_path / "batch.jsonl"
    lines = [_line(f"r{i}", COMPLETIONS, prompt=list(range(5, 5 + 10 * i)), max_tokens=2) for i in range(1, 6)]
    rows.write_text("".join(json.dumps(line) + "\n" for line in lines) + "{broken\n")
    out = tmp_path / "out.jsonl"

    def run(max_seq_len: int) -> dict:
        llm = LLM(str(tiny_llama_dir), overrides=["engine.device=cpu", "model.dtype=float32", "job.progress=false",
                                                  f"model.max_seq_len={max_seq_len}", f"job.input={rows}",
                                                  f"job.output={out}"])
        return run_job(llm, "cfg")

    first = run(25)  # r3..r5 are too long
    assert (first["completed"], first["errors"]) == (2, 4)
    assert sorted(r["custom_id"] or "" for r in _read(out) if not _served(r)) == ["", "r3", "r4", "r5"]
    second = run(128)
    assert (second["completed"], second["already_done"], second["errors"]) == (3, 2, 1)
    results = _read(out)
    assert sorted(r["custom_id"] for r in results if _served(r)) == ["r1", "r2", "r3", "r4", "r5"]
    assert [_error(r)["code"] for r in results if not _served(r)] == ["invalid_json"]  # the old error lines went
    assert json.loads(out.with_suffix(".metrics.json").read_text())["input_format"] == "openai"


def test_error_lines_of_either_shape_are_retried_and_served_lines_kept(tmp_path):
    """A refused request is a 400 response; older outputs wrote it as an error with no response: a rerun retries
    both, and keeps what was served."""
    from runtime.frontend.job_files import served_custom_ids

    old = {"id": "batch_req_1", "custom_id": "old", "response": None,
           "error": {"code": "context_length_exceeded", "message": "too long"}}
    refused = openai_api.error_line("new", '"new"', "context_length_exceeded", "too long", "messages")
    unreadable = openai_api.error_line(None, "line:3", "invalid_json", "line 3 is not valid JSON")
    served = openai_api.result_line("ok", '"ok"', {"choices": []})
    assert refused["error"] is None and refused["response"]["status_code"] == 400
    assert refused["response"]["body"] == {"error": {"message": "too long", "type": "invalid_request_error",
                                                     "param": "messages", "code": "context_length_exceeded"}}
    assert unreadable["response"] is None and unreadable["error"]["code"] == "invalid_json"
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps(line) + "\n" for line in (old, refused, unreadable, served)))
    assert served_custom_ids(out) == {'"ok"'}
    assert drop_error_lines(out) == 3 and _read(out) == [served]


def test_an_output_of_the_other_kind_is_refused_before_anything_is_rewritten(tiny_llama_dir, tmp_path):
    """An OpenAI batch job on an output an earlier native job wrote (or the reverse) stops, naming the file, and
    leaves it whole: a rerun of an OpenAI job drops its error lines, and only those."""
    batch, rows, out = tmp_path / "batch.jsonl", tmp_path / "rows.jsonl", tmp_path / "out.jsonl"
    batch.write_text(json.dumps(_line("a", COMPLETIONS, prompt=[5, 6, 7], max_tokens=2)) + "\n")
    rows.write_text(json.dumps({"id": 1, "prompt": [5, 6, 7], "sampling": {"max_new_tokens": 2}}) + "\n")
    native_rows = "".join(json.dumps({"id": i, "text": "x", "finish_reason": "length", "completion_tokens": 2,
                                      "prompt_tokens": 3}) + "\n" for i in (7, 8))
    error = openai_api.error_line("b", '"b"', "invalid_request", "line 2: bad")
    served = openai_api.result_line("c", '"c"', {"choices": []})
    llm = LLM(str(tiny_llama_dir), overrides=["engine.device=cpu", "model.dtype=float32", "job.progress=false",
                                              "model.max_seq_len=64", f"job.output={out}"])
    for source, held, message in [(batch, native_rows, r"holds native result rows \(.*out.jsonl:1\), and this job "
                                                       r"writes OpenAI batch result lines: use another job.output"),
                                  (rows, json.dumps(served) + "\n", r"holds OpenAI batch result lines")]:
        out.write_text(held)
        llm.cfg.job.input = str(source)
        with pytest.raises(ValueError, match=message):
            run_job(llm, "cfg")
        assert out.read_text() == held
        proc = _launch(tiny_llama_dir, source, out, "model.path=/nonexistent")
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
        assert proc.returncode == 2 and len(errors) == 1 and "job.output=" in errors[0], proc.stderr
        assert "nonexistent" not in proc.stderr  # before the model loads
    mixed = native_rows + json.dumps(error) + "\n" + json.dumps(served) + "\n"  # as older versions could leave it
    out.write_text(mixed)
    assert drop_error_lines(out) == 1
    assert out.read_text() == native_rows + json.dumps(served) + "\n"


# ---- kill -9 and rerun -------------------------------------------------------------------------------------------
def _served_ids(out: Path) -> set[str]:
    ids = set()
    for f in [out, *out.parent.glob(out.name + ".part-*")]:
        if f.exists():
            for line in f.read_bytes().splitlines(keepends=True):
                if line.endswith(b"\n") and _served(json.loads(line)):
                    ids.add(json.loads(line)["custom_id"])
    return ids


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2], ids=["dp1", "dp2"])
def test_kill_9_mid_batch_then_rerun_gives_one_line_per_custom_id(text_model, tmp_path, nproc):
    rows = tmp_path / "batch.jsonl"
    good = [_line(f"r{i}", COMPLETIONS, prompt=f"Row {i}: a story about {i}.", max_tokens=8 + (i * 7) % 24,
                  ignore_eos=True) for i in range(36)]
    lines = [json.dumps(line) for line in good]
    lines[5:5] = ['{"custom_id": "torn", "method"', json.dumps(_line("bad", "/v1/nope"))]
    rows.write_text("\n".join(lines) + "\n")
    reference = tmp_path / "reference.jsonl"
    assert _launch(text_model, rows, reference).returncode == 0
    out = tmp_path / "out.jsonl"
    launch = [f"--nproc-per-node={nproc}"] if nproc > 1 else []
    cmd = [sys.executable, "launch.py", *launch, f"model.path={text_model}", "engine.device=cpu",
           "model.max_seq_len=128", f"job.input={rows}", f"job.output={out}", "job.progress=false",
           "job.chat_template=false", "sampling.temperature=0", "scheduler.max_running_requests=2"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while len(_served_ids(out)) < 8:
            assert proc.poll() is None and time.time() < deadline, "the job ended before it could be killed"
            time.sleep(0.05)
    finally:
        kill_job(proc)
    assert 8 <= len(_served_ids(out)) < 36
    assert (tmp_path / "out.jsonl.lock").exists()  # left by the killed run; it must not block the rerun
    rerun = subprocess.run(cmd[:2] + cmd[2 + len(launch):], cwd=REPO, env=_env(), capture_output=True, text=True,
                           timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    results = _read(out)
    served = [r["custom_id"] for r in results if _served(r)]
    assert sorted(served) == sorted(f"r{i}" for i in range(36))  # exactly one line per custom_id
    assert sorted(r["custom_id"] for r in results if not _served(r)) == ["bad", "torn"]  # each error once
    texts = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in results if _served(r)}
    assert texts == {r["custom_id"]: r["response"]["body"]["choices"][0]["text"]
                     for r in _read(reference) if _served(r)}
    assert not list(tmp_path.glob("out.jsonl.part-*"))
