"""The Python API answers malformed input with a clear error, alone, and never serves it silently."""

from __future__ import annotations

import pytest

from runtime import LLM, SamplingParams
from runtime.batch import Req, unseeded_key


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), overrides=["engine.device=cpu", "model.dtype=float32", "model.max_seq_len=256"])


class NoTokens:
    """A tokenizer that turns whitespace into nothing (like one that adds no BOS)."""

    def encode(self, text: str, **_: object) -> list[int]:
        return [] if not text.strip() else [5, 6]

    def decode(self, ids: list[int], **_: object) -> str:
        return " ".join(map(str, ids))


def test_a_prompt_of_zero_tokens_fails_alone(tiny_llm, monkeypatch):
    monkeypatch.setattr(tiny_llm, "tokenizer", NoTokens())
    outs = tiny_llm.generate(["   ", [7, 8, 9]], SamplingParams(temperature=0, max_new_tokens=3))
    assert outs[0].error == "prompt encodes to zero tokens" and outs[0].token_ids is None
    assert outs[1].error is None and outs[1].completion_tokens == 3


def test_stop_strings_without_a_tokenizer_are_an_error_not_ignored(tiny_llm):
    out = tiny_llm.generate([[7, 8, 9]], SamplingParams(max_new_tokens=3, stop=["x"]))[0]
    assert out.error is not None and "stop strings" in out.error and "tokenizer" in out.error


def test_a_bare_chat_message_is_refused_not_split_into_prompts(tiny_llm):
    with pytest.raises(TypeError, match="wrapped in a list"):
        tiny_llm.generate({"role": "user", "content": "hi"})


def test_prompts_that_are_no_prompt_are_a_named_type_error_and_a_tuple_of_ids_is_one_prompt(tiny_llm):
    for bad in (None, 5, b"abc"):
        with pytest.raises(TypeError, match=f"prompts must be a string, .* not {type(bad).__name__}"):
            tiny_llm.generate(bad)
    greedy = SamplingParams(temperature=0, max_new_tokens=3)
    [as_tuple], [as_list] = tiny_llm.generate((7, 8, 9), greedy), tiny_llm.generate([7, 8, 9], greedy)
    assert as_tuple.error is None and as_tuple.token_ids == as_list.token_ids


def test_overrides_apply_on_top_of_a_given_config_which_is_left_as_it_was(tiny_llama_dir):
    from runtime.config import ConfigError, load_config

    cfg = load_config(overrides=["engine.device=cpu", "model.dtype=float32", "model.max_seq_len=64"])
    llm = LLM(str(tiny_llama_dir), config=cfg, overrides=["cache.page_size=8"])
    assert llm.engine.page_size == 8 and llm.cfg.model.path == str(tiny_llama_dir)
    assert cfg.cache.page_size != 8 and cfg.model.path != str(tiny_llama_dir)
    llm.shutdown()
    with pytest.raises(RuntimeError, match="this LLM was shut down; create a new LLM"):
        llm.generate([[1, 2, 3]])
    with pytest.raises(ConfigError, match="unknown config key 'cache.page_sise'; did you mean 'cache.page_size'"):
        LLM(str(tiny_llama_dir), config=cfg, overrides=["cache.page_sise=8"])
    with pytest.raises(ConfigError, match="a list of 'key=value' strings, not one string"):
        LLM(str(tiny_llama_dir), overrides="engine.device=cpu")


def test_sampling_params_as_a_dict(tiny_llm):
    greedy = tiny_llm.generate([[7, 8, 9]], SamplingParams(temperature=0, max_new_tokens=4))[0]
    as_dict = tiny_llm.generate([[7, 8, 9]], {"temperature": 0, "max_new_tokens": 4})[0]
    assert as_dict.token_ids == greedy.token_ids
    with pytest.raises(ValueError, match="temprature"):
        tiny_llm.generate([[7, 8, 9]], {"temprature": 0})
    with pytest.raises(TypeError, match="sampling_params"):
        tiny_llm.generate([[7, 8, 9]], [0.5])


def test_unseeded_keys_do_not_collide_with_small_user_seeds():
    seeded = {Req(0, [1], SamplingParams(seed=s), 1).sampling_row[3] for s in range(1000)}
    unseeded = {Req(uid, [1], SamplingParams(), 1, stream=unseeded_key(run, uid)).sampling_row[3]
                for uid in range(1000) for run in (0, 1)}
    assert not seeded & unseeded and len(unseeded) == 2000
    assert all(0 <= k < 2**63 for k in unseeded)


def test_a_dropped_llm_frees_its_engine_without_the_cyclic_gc(tiny_llama_dir):
    """Engines (and on GPU their CUDA graphs) must go when the last reference does, not at a later GC pass
    that may run while another engine captures its graphs."""
    import gc
    import weakref

    gc.disable()
    try:
        llm = LLM(str(tiny_llama_dir), overrides=["engine.device=cpu", "model.dtype=float32", "model.max_seq_len=64"])
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=3))
        engine = weakref.ref(llm.engine)
        del llm
        assert engine() is None
    finally:
        gc.enable()


def test_malformed_token_id_prompts_fail_alone_with_the_reason(tiny_llm):
    vocab = tiny_llm.model_config.vocab_size
    prompts = [[], [1, vocab], [-1, 2], [True, 2], [3, 2.0], [4, 5]]
    outs = tiny_llm.generate(prompts, SamplingParams(temperature=0, max_new_tokens=2))
    errors = [o.error for o in outs]
    assert errors[0] == "prompt is empty"
    assert f"[{vocab}]" in errors[1] and "outside the vocabulary" in errors[1]
    assert "[-1]" in errors[2] and "outside the vocabulary" in errors[2]
    assert "a list of token ids (int), not a list of bool, int" in errors[3]  # a bool is not a token id
    assert "not a list of float, int" in errors[4]
    assert errors[5] is None and outs[5].completion_tokens == 2


def test_admit_refuses_a_tokenized_request_before_it_is_queued(tiny_llm):
    """The OpenAI batch job's context check: a refused row is never prefilled."""
    seen: list[tuple[object, int]] = []

    def admit(key: object, req: Req) -> None:
        seen.append((key, req.prompt_len))
        if key == "long":
            raise ValueError(f"{req.prompt_len} prompt tokens is too many")

    greedy = SamplingParams(temperature=0, max_new_tokens=2)
    stats = tiny_llm.scheduler.stats
    before = stats.prefill_tokens + stats.cached_tokens
    outs = tiny_llm.run([("long", [41] * 9, greedy), ("short", [42, 43], greedy)], admit=admit)
    assert seen == [("long", 9), ("short", 2)]
    assert outs[0].error == "9 prompt tokens is too many" and outs[1].error is None and outs[1].completion_tokens == 2
    assert stats.prefill_tokens + stats.cached_tokens - before == 2  # the short prompt only


def test_a_stop_token_id_outside_the_vocabulary_fails_its_request_alone(tiny_llm):
    """A stop id the model can never sample would be silently ignored: the request fails naming it."""
    vocab = tiny_llm.model_config.vocab_size
    params = [SamplingParams(temperature=0, max_new_tokens=2, stop_token_ids=ids) for ids in ([3, vocab + 7], [3])]
    outs = tiny_llm.generate([[4, 5], [4, 5]], params)
    assert "stop_token_ids" in outs[0].error and f"[{vocab + 7}]" in outs[0].error
    assert outs[1].error is None and outs[1].completion_tokens >= 1
