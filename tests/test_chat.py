"""LLM.chat: conversations through the chat template, on the embedded default model."""

from __future__ import annotations

import pytest

from runtime import LLM, SamplingParams


@pytest.mark.slow
def test_chat_answers_a_question_and_takes_one_or_many_conversations():
    llm = LLM(overrides=["engine.device=cpu"])
    question = [{"role": "user", "content": "What is 2+2?"}]
    greedy = SamplingParams(temperature=0, max_new_tokens=16)
    (one,) = llm.chat(question, greedy)
    assert one.error is None and one.text.strip()
    # A list of conversations; the first is the same question, so the same greedy answer.
    both = llm.chat([question, [{"role": "user", "content": "Name a colour."}]], greedy)
    assert [o.text for o in both][0] == one.text and both[1].text.strip()
    # The raw string through generate is not templated: another prompt, another continuation.
    raw = llm.generate("What is 2+2?", greedy)[0]
    assert raw.prompt_tokens < one.prompt_tokens
    with pytest.raises(TypeError, match="conversation"):
        llm.chat(["What is 2+2?"])
    llm.shutdown()


@pytest.mark.slow
def test_a_lone_surrogate_fails_its_prompt_alone_saying_so():
    """JSON can carry "\\ud800", which no tokenizer encodes: the prompt's error says what and where, as a chat
    message's does; the prompts beside it are served."""
    llm = LLM(overrides=["engine.device=cpu"])
    greedy = SamplingParams(temperature=0, max_new_tokens=2)
    outs = llm.generate(["ab\ud800c", "Hello"], greedy)
    assert outs[0].error == "prompt is not valid Unicode: a lone surrogate U+D800 at character 2"
    assert outs[1].error is None and outs[1].completion_tokens == 2
    (chat,) = llm.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "\udfff"}], greedy)
    assert chat.error == "message 1's content is not valid Unicode: a lone surrogate U+DFFF at character 0"
    llm.shutdown()
