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


class IncrementalDetokenizer:
    """Text of a growing token list, emitted once characters are complete; decoding a short window keeps each
    step O(window)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

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
