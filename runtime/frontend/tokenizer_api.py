"""The tokenizer endpoints served beside the OpenAI API, in vLLM's shapes: ``/tokenize``, ``/detokenize`` and
``/tokenizer_info``. Clients that count or build prompts in tokens (lm-evaluation-harness's remote tokenizer) use
the server's own tokenizer through them; nothing here reads sockets."""

from __future__ import annotations

from typing import Any

from runtime.frontend.openai_api import RequestError, parse_messages


def tokenize(tokenizer: Any, body: Any) -> dict[str, Any]:
    """``{"prompt": str, "add_special_tokens"?: bool (true)}`` or ``{"messages": [...], "add_generation_prompt"?:
    bool (true)}`` to token ids, as a completion or a chat request would send them to the model
    (``return_token_strs``: each one's vocabulary string too): ``{"tokens": [...], "token_strs"?: [...]}``."""
    if not isinstance(body, dict):
        raise RequestError("invalid_request", f"the request body must be a JSON object, not {type(body).__name__}")
    body = {k: v for k, v in body.items() if v is not None}  # null means "the default", as in the API
    unknown = sorted(set(body) - {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                                  "return_token_strs"})
    if unknown:
        raise RequestError("invalid_request", f"unsupported parameter(s) {unknown} for /tokenize", unknown[0])
    tokens = _tokens(tokenizer, body)
    if _flag(body, "return_token_strs", False):
        return {"tokens": tokens, "token_strs": tokenizer.convert_ids_to_tokens(tokens)}
    return {"tokens": tokens}


def _tokens(tokenizer: Any, body: dict[str, Any]) -> list[int]:
    if ("prompt" in body) == ("messages" in body):
        raise RequestError("invalid_request", "/tokenize takes one of 'prompt' (a string) and 'messages'", "prompt")
    if "messages" in body:
        add_generation_prompt = _flag(body, "add_generation_prompt", True)
        text = tokenizer.apply_chat_template(parse_messages(body["messages"]), tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
        return tokenizer.encode(text, add_special_tokens=_flag(body, "add_special_tokens", False))
    prompt = body["prompt"]
    if not isinstance(prompt, str):
        raise RequestError("invalid_request", f"'prompt' must be a string, not {type(prompt).__name__}", "prompt")
    return tokenizer.encode(prompt, add_special_tokens=_flag(body, "add_special_tokens", True))


def detokenize_ids(body: Any, vocab_size: int) -> list[int]:
    """The token ids of ``{"tokens": [int, ...]}``, each checked to be in the vocabulary."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise RequestError("invalid_request", "/detokenize takes {'tokens': [token ids]}", "tokens")
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise RequestError("invalid_request", f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
                           "tokens")
    return tokens


def tokenizer_info(tokenizer: Any, max_model_len: int) -> dict[str, Any]:
    """The special tokens and chat template a client needs to build prompts as the server does."""
    template = getattr(tokenizer, "chat_template", None)
    return {"tokenizer_class": type(tokenizer).__name__, "eos_token": tokenizer.eos_token,
            "bos_token": tokenizer.bos_token, "pad_token": tokenizer.pad_token,
            "chat_template": template if isinstance(template, str) else None, "model_max_length": max_model_len}


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise RequestError("invalid_request", f"{name}={value!r} must be true or false", name)
    return value
