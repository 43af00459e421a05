"""Tokenizer loading: settings that transformers warns about when left unset are passed explicitly; EOS ids."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest

from runtime.frontend import tokenizer


@pytest.mark.parametrize(("config", "expected"), [
    ({}, False),  # the default model's converted tokenizer states nothing: transformers' current default
    ({"clean_up_tokenization_spaces": True}, True),
    ({"clean_up_tokenization_spaces": False}, False),
    ({"clean_up_tokenization_spaces": None}, False),
])
def test_load_passes_clean_up_tokenization_spaces_from_the_model(tmp_path: Path, monkeypatch, config, expected):
    import transformers

    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    calls: list[dict] = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda path, **kwargs: calls.append({"path": path, **kwargs}) or "tok")
    assert tokenizer.load_tokenizer(tmp_path) == "tok"
    assert calls == [{"path": str(tmp_path), "local_files_only": True, "clean_up_tokenization_spaces": expected}]


def test_a_directory_without_tokenizer_files_has_no_tokenizer(tmp_path: Path):
    assert tokenizer.load_tokenizer(tmp_path) is None


@pytest.fixture(scope="module")
def llama_without_generation_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.conftest import make_tiny_llama

    path = make_tiny_llama(tmp_path_factory.mktemp("eos"), layers=1)
    (path / "generation_config.json").unlink()
    return path


@pytest.mark.parametrize(("config_eos", "generation_config"), [
    (7, None),  # no generation_config.json: config.json's
    ([7, 9], None),
    (7, {"eos_token_id": [3, 4]}),  # generation_config.json's, config.json's not added
    (7, {"bos_token_id": 1}),  # generation_config.json without one: none, config.json's not taken
])
def test_eos_ids_are_the_ones_transformers_generate_stops_at(llama_without_generation_config: Path, tmp_path: Path,
                                                              config_eos, generation_config):
    import torch
    from transformers import AutoModelForCausalLM

    path = shutil.copytree(llama_without_generation_config, tmp_path / "model")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": config_eos}))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).generation_config.eos_token_id
    expected = set(theirs if isinstance(theirs, list) else [theirs]) - {None}
    assert tokenizer.eos_token_ids(path, None) == expected


def _sentencepiece_tokenizer(words: list[str]):  # noqa: ANN202
    """A Llama-2 / Mistral style tokenizer: SentencePiece pieces ("▁" marks a word's start), byte fallback, and
    the decoder that strips the leading space of a text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", *words]:
        vocab[piece] = len(vocab)
    sp = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=sp, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_generated_text_keeps_the_space_a_sentencepiece_decoder_strips(tmp_path: Path, default_model_dir: Path):
    """The reference is the prompt and output decoded together, less the prompt's text: what the output adds.
    SentencePiece decoders drop a text's leading space, so the output decoded alone would lose its first word's
    space ("is" + "Paris")."""
    from transformers import AutoTokenizer

    from runtime import LLM, SamplingParams
    from tests.conftest import make_tiny_llama

    path = make_tiny_llama(tmp_path, seed=1)
    _sentencepiece_tokenizer([f"▁w{i}" for i in range(200)]).save_pretrained(path)
    ref_tok = AutoTokenizer.from_pretrained(path)
    assert tokenizer.strips_leading_space(ref_tok)
    assert not tokenizer.strips_leading_space(tokenizer.load_tokenizer(default_model_dir))  # byte-level BPE

    llm = LLM(str(path), overrides=["engine.device=cpu"])
    prompts = [f"w{i} w{i + 1}" for i in range(0, 60, 3)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = ref_tok.encode(prompt)
        whole = ref_tok.decode(ids + out.token_ids, skip_special_tokens=True)
        assert out.text == whole[len(ref_tok.decode(ids, skip_special_tokens=True)):], (prompt, out.token_ids)
        if "\ufffd" in out.text:
            continue  # random bytes: a window decodes them apart from the whole (the final text is the whole's)
        streamed = tokenizer.IncrementalDetokenizer(ref_tok, strips=True)
        for token in out.token_ids:  # the stop-string and streaming path, one token at a time
            streamed.push(token)
        assert streamed.text == out.text
    assert any(out.text.startswith(" ") and "\ufffd" not in out.text for out in outs)  # the case is met
    # Every sample of a request sees the space: a stop string that starts with it cuts each one alike.
    prompt, out = next((p, o) for p, o in zip(prompts, outs)
                       if o.text.startswith(" ") and "\ufffd" not in o.text and len(o.text.split()) >= 3)
    words = out.text.split()
    for stop, kept in ((" " + words[0], ""), (" " + words[2], " " + " ".join(words[:2]))):
        samples = llm.generate(prompt, SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True, n=3,
                                                      stop=[stop]))[0].outputs
        assert [(s.text, s.finish_reason) for s in samples] == [(kept, "stop")] * 3, (prompt, stop)
    llm.shutdown()


def test_logprobs_list_a_token_that_finishes_a_character_before_a_stop_strings_cut(default_model_dir: Path):
    """A stop string cut right after a character whose bytes span two tokens: both tokens spell the text."""
    from types import SimpleNamespace

    from runtime.output import shown_tokens

    tok = tokenizer.load_tokenizer(default_model_dir)
    wide = tok.encode("\uff15", add_special_tokens=False)  # a fullwidth digit five: 3 UTF-8 bytes
    assert len(wide) >= 2 and "\ufffd" in tok.decode(wide[:1])  # the case is met: its first token alone is no character
    ids = wide + tok.encode("\nmore", add_special_tokens=False)
    decode = functools.partial(tok.decode, skip_special_tokens=True)
    for text, shown in (("\uff15", len(wide)), ("", 0), ("\uff15\n", len(wide) + 1)):
        assert shown_tokens(SimpleNamespace(text_ids=ids, text=text), decode) == shown, text
