"""Tokenizer loading, EOS ids and incremental detokenization."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def load_tokenizer(model_dir: Path) -> Any | None:
    """The model's tokenizer, or None for a directory without one (token-id prompts only)."""
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    # Passed explicitly: left unset, some transformers versions warn about its default on every load.
    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True,
                                         clean_up_tokenization_spaces=clean_up_tokenization_spaces(model_dir))


def clean_up_tokenization_spaces(model_dir: Path) -> bool:
    """The model's own setting from tokenizer_config.json; False (transformers' current default) without one."""
    config = model_dir / "tokenizer_config.json"
    value = json.loads(config.read_text()).get("clean_up_tokenization_spaces") if config.is_file() else None
    return bool(value) if value is not None else False


def eos_token_ids(model_dir: Path, tokenizer: Any) -> set[int]:
    """Every EOS id of the model: generation_config.json's (an int or a list), or without that file config.json's, as
    transformers' generate reads them; and the tokenizer's."""
    gen = model_dir / "generation_config.json"
    source = gen if gen.is_file() else model_dir / "config.json"
    value = json.loads(source.read_text()).get("eos_token_id") if source.is_file() else None
    ids = {int(v) for v in (value if isinstance(value, list) else [value]) if isinstance(v, int)}
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def strips_leading_space(tokenizer: Any) -> bool:
    """Whether decoding drops the space a word-initial first token carries, as SentencePiece decoders do
    ("▁Paris" alone decodes to "Paris"): right at the start of a text, a character short after a prompt. Asked
    once per tokenizer (it reads the vocabulary)."""
    vocabulary = getattr(tokenizer, "get_vocab", None)
    if vocabulary is None:
        return False
    for piece, token_id in vocabulary().items():
        word = piece[1:]
        if piece.startswith("\u2581") and word.isascii() and word.isalnum():
            return not tokenizer.decode([token_id]).startswith(" ")
    return False


def decode_continuation(tokenizer: Any, ids: list[int], strips: bool, skip_special_tokens: bool = True) -> str:
    """The text of generated ``ids``, which follow a prompt: with a tokenizer that ``strips`` a leading space, a
    word-initial first token keeps it, as decoding prompt and output together gives."""
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    if strips and text and not text.startswith(" "):
        special = tokenizer.all_special_ids
        first = next((t for t in ids if t not in special), None)
        piece = tokenizer.convert_ids_to_tokens(first) if first is not None else None
        if isinstance(piece, str) and piece.startswith("\u2581"):
            text = " " + text
    return text


class IncrementalDetokenizer:
    """Text of a growing token list, emitted once characters are complete; decoding a short window keeps each
    step O(window)."""

    def __init__(self, tokenizer: Any, strips: bool = False) -> None:
        self.tokenizer = tokenizer
        self.strips = strips  # strips_leading_space(tokenizer), asked once by the caller
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return decode_continuation(self.tokenizer, ids, self.strips)

    def push(self, token: int) -> str:
        return self.extend([token])

    def extend(self, tokens: list[int]) -> str:
        """Append ``tokens``; returns the text they completed (two decodes, however many tokens)."""
        self.ids.extend(tokens)
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        new = after[len(before) :]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += new
        return new
