"""Presence, frequency and repetition penalties and min_p: against transformers' processors, a float64 reference
of OpenAI's definition, and HF ``generate`` on the default model."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.engine.penalties import min_p_offsets, penalize_
from runtime.engine.sampler import kept_tokens, thresholds_with_min_p


def penalize(logits: torch.Tensor, tokens: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
    """Every row of a float32 copy of ``logits`` penalised."""
    x = logits.float().clone()
    penalize_(x, torch.arange(len(x)), tokens, *args)
    return x


def _float64_presence_frequency(x: torch.Tensor, output: list[int], presence: float,
                                frequency: float) -> torch.Tensor:
    """OpenAI's definition: minus ``frequency`` per occurrence in the output so far, minus ``presence`` once."""
    counts = torch.zeros(x.shape[-1], dtype=torch.float64)
    for token in output:
        counts[token] += 1
    return x.double() - frequency * counts - presence * (counts > 0).double()


def test_penalties_against_transformers_and_a_float64_reference():
    from transformers import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(0)
    rows, vocab, width = 6, 300, 40
    logits = torch.randn(rows, vocab, generator=gen) * 4
    logits[:, :3] = torch.tensor([0.0, -2.5, 3.0])  # a zero, a negative and a positive logit, all repeated below
    pool = torch.randint(0, vocab, (rows, width), generator=gen)  # past kv_len: an earlier request's tokens
    pool[:, 20:30] = torch.tensor([0, 1, 2, 0, 1, 2, 0, 7, 7, 7])
    kv_lens = torch.tensor([40, 1, 17, 30, 25, 9])
    prompt_lens = torch.tensor([10, 1, 17, 3, 22, 9])  # rows 1, 2, 5: no output yet
    presence = torch.tensor([0.5, 2.0, -1.0, 0.0, 1.5, 0.25])
    frequency = torch.tensor([0.25, -0.5, 2.0, 1.0, 0.0, 0.75])
    repetition = torch.tensor([1.25, 2.0, 0.75, 1.0, 1.5, 1.0])
    got = penalize(logits, pool, kv_lens, prompt_lens, presence, frequency, repetition)
    assert got.dtype == torch.float32
    changed_by_output = 0
    for i in range(rows):
        seen = pool[i, : kv_lens[i]]
        hf = RepetitionPenaltyLogitsProcessor(penalty=float(repetition[i]))(seen[None], logits[i : i + 1].clone())[0]
        output = pool[i, prompt_lens[i] : kv_lens[i]].tolist()
        ref = _float64_presence_frequency(hf, output, float(presence[i]), float(frequency[i]))
        torch.testing.assert_close(got[i].double(), ref, rtol=0, atol=1e-5)
        outside = torch.ones(vocab, dtype=torch.bool)
        outside[seen] = False
        assert torch.equal(got[i][outside], logits[i][outside])  # tokens not in the sequence keep their logits
        changed_by_output += bool(output) and (presence[i] != 0 or frequency[i] != 0)
    assert changed_by_output >= 3
    neutral = penalize(logits, pool, kv_lens, prompt_lens, torch.zeros(rows), torch.zeros(rows), torch.ones(rows))
    assert torch.equal(neutral, logits)


def test_min_p_keeps_what_transformers_keeps_at_each_temperature():
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper

    gen = torch.Generator().manual_seed(1)
    rows, vocab = 8, 500
    x = torch.randn(rows, vocab, generator=gen) * 3
    temps = np.array([0.5, 1.0, 1.5, 0.7, 1.0, 2.0, 0.0, 1.0], np.float32)
    min_p = np.array([0.1, 0.05, 0.3, 0.0, 1.0, 0.01, 0.2, 0.5], np.float32)
    offsets = min_p_offsets(SimpleNamespace(min_p=min_p), temps)
    assert offsets is not None and np.isneginf(offsets[[3, 6]]).all()  # off, and a greedy row
    inv_t = torch.from_numpy(1 / np.where(temps > 0, temps, 1.0))
    keep = kept_tokens(x, inv_t, thresholds_with_min_p(x, None, torch.from_numpy(offsets)), None)
    sizes = []
    for i in range(rows):
        if temps[i] == 0:
            continue
        scores = TemperatureLogitsWarper(float(temps[i]))(None, x[i : i + 1].clone())
        if min_p[i] > 0:
            scores = MinPLogitsWarper(float(min_p[i]))(None, scores)
        assert torch.equal(keep[i], torch.isfinite(scores[0])), i
        sizes.append(int(keep[i].sum()))
    assert min(sizes) >= 1 and len(set(sizes)) > 3 and max(sizes) == vocab  # rows keep different amounts
    assert min_p_offsets(SimpleNamespace(min_p=np.zeros(3, np.float32)), temps[:3]) is None


def test_out_of_range_values_are_refused_by_name():
    for name, value in [("min_p", 1.5), ("min_p", -0.1), ("presence_penalty", 2.5), ("frequency_penalty", -3),
                        ("repetition_penalty", 0), ("repetition_penalty", math.inf), ("presence_penalty", True),
                        ("temperature", 10**400), ("frequency_penalty", -(10**400))]:  # ints past float's range
        with pytest.raises(ValueError, match=f"{name}="):
            SamplingParams(**{name: value})
    assert not SamplingParams().adjusts_logits and SamplingParams(repetition_penalty=1.1).adjusts_logits
    assert SamplingParams(logit_bias={"5": 1}).logit_bias == {5: 1.0} and SamplingParams(logit_bias={5: 1}).adjusts_logits
    for bias in [{"x": 1}, {-1: 1}, {"5": 101}, {5: math.nan}, {5: 10**400}, {5: True}, {True: 1}, {"5": 1, 5: 2}, [5]]:
        with pytest.raises(ValueError, match="logit_bias="):
            SamplingParams(logit_bias=bias)


def test_openai_bodies_pass_penalties_and_min_p():
    from runtime.frontend.openai_api import RequestError, parse_request

    body = {"prompt": "a", "presence_penalty": 0.5, "frequency_penalty": -0.25, "min_p": 0.1,
            "repetition_penalty": 1.1, "temperature": 0.8, "logit_bias": {"50256": -100, "13": 2}}
    _, sampling, _ = parse_request("/v1/completions", body, SamplingParams())
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.min_p, sampling.repetition_penalty,
            sampling.logit_bias) == (0.5, -0.25, 0.1, 1.1, {50256: -100.0, 13: 2.0})
    for bias in [{"13": 200}, {"13": 10**400}]:
        with pytest.raises(RequestError, match="logit_bias=") as caught:
            parse_request("/v1/completions", {"prompt": "a", "logit_bias": bias}, SamplingParams())
        assert caught.value.param == "logit_bias"


MAX_NEW = 24
PROMPTS = ["Write a list of fruits.", "Name three colors.", "Repeat after me: la la la la la la",
           "Write a short poem about autumn.", "Count from one to five."]
PENALTIES = [dict(repetition_penalty=1.3), {}, dict(presence_penalty=0.8, frequency_penalty=0.6),
             dict(repetition_penalty=1.15, frequency_penalty=0.5), dict(repetition_penalty=1.1)]


@pytest.mark.slow
def test_greedy_with_penalties_matches_hf_generate(default_model_dir):
    """Penalised greedy rows, batched with a plain one, against HF ``generate`` of each prompt alone: repetition
    and logit biases by transformers' own processors (``sequence_bias`` of single tokens), presence and frequency
    by a float64 processor of OpenAI's definition."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

    class PresenceFrequency(LogitsProcessor):
        def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
            self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            output = input_ids[0, self.prompt_len :].tolist()
            return _float64_presence_frequency(scores[0], output, self.presence, self.frequency)[None].float()

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    messages = [[{"role": "user", "content": p}] for p in PROMPTS]
    llm = LLM(str(default_model_dir), overrides=["engine.device=cpu"])
    plain = llm.generate(messages, SamplingParams(temperature=0, max_new_tokens=MAX_NEW))
    banned = plain[4].token_ids[0]  # ban the first token, favour a later one
    favoured = next(t for t in plain[4].token_ids[3:] if t != banned)
    penalties_of = [*PENALTIES[:4], {**PENALTIES[4], "logit_bias": {banned: -100.0, favoured: 3.0}}]
    outs = llm.generate(messages, [SamplingParams(temperature=0, max_new_tokens=MAX_NEW, **p) for p in penalties_of])
    assert outs[4].token_ids[0] != banned
    vocab = llm.model_config.vocab_size
    outside = llm.generate([messages[0]], SamplingParams(logit_bias={vocab: 1.0}))[0]
    assert outside.error == f"logit_bias [{vocab}] are outside the vocabulary [0, {vocab})"
    differs = 0
    for msgs, penalties, out, unpenalised in zip(messages, penalties_of, outs, plain):
        ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False, return_tensors="pt")
        processors = LogitsProcessorList()
        if "presence_penalty" in penalties or "frequency_penalty" in penalties:
            processors.append(PresenceFrequency(ids.shape[1], penalties.get("presence_penalty", 0.0),
                                                penalties.get("frequency_penalty", 0.0)))
        with torch.no_grad():
            biases = {(token,): bias for token, bias in penalties.get("logit_bias", {}).items()}
            ref = hf.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, logits_processor=processors,
                              repetition_penalty=penalties.get("repetition_penalty", 1.0),
                              sequence_bias=biases or None)
        assert out.error is None
        assert out.token_ids == ref[0, ids.shape[1] :].tolist(), penalties
        differs += out.token_ids != unpenalised.token_ids
    assert differs >= 4  # the penalties and biases changed what the rows generated


@pytest.mark.slow
def test_sampled_tokens_keep_to_min_p(default_model_dir):
    """Every token drawn with min_p is at least min_p times as likely (at its temperature) as the likeliest, by
    the model's logprobs; without min_p the same seeds draw tokens that are not."""
    llm = LLM(str(default_model_dir), overrides=["engine.device=cpu"])
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    temperature, min_p = 1.5, 0.2

    def ratios(use_min_p: float) -> list[float]:
        params = SamplingParams(temperature=temperature, min_p=use_min_p, max_new_tokens=16, logprobs=1, seed=3)
        out = []
        for result in llm.generate(prompts, params):
            for entry in result.logprobs:
                out.append((entry["logprob"] - entry["top"][0][1]) / temperature)  # ln(p_T / p_T max)
        return out

    assert min(ratios(min_p)) >= math.log(min_p) - 1e-4
    assert min(ratios(0.0)) < math.log(min_p)


def _batch(pool_rows: list[int], kv_lens: list[int], prompt_lens: list[int], temperature: float = 0.0, **per_row):
    from runtime.batch import Batch

    n = len(pool_rows)
    rows = np.array(pool_rows, np.int32)
    batch = Batch(phase="decode", rows=rows, starts=np.array(kv_lens, np.int32) - 1, ext_lens=np.ones(n, np.int32),
                  sample_rows=rows, temperature=np.full(n, temperature, np.float32), top_k=np.full(n, -1, np.int32),
                  top_p=np.ones(n, np.float32), seeds=np.arange(n, dtype=np.int64),
                  prompt_lens=np.array(prompt_lens, np.int32))
    biases = per_row.pop("logit_bias", None)
    neutral = {"min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
    for name, value in neutral.items():
        setattr(batch, name, np.array(per_row.get(name, [value] * n), np.float32))
    if biases is not None:  # one {token: bias} per row
        batch.bias_counts = np.array([len(b) for b in biases], np.int32)
        batch.bias_tokens = np.array([t for b in biases for t in b], np.int32)
        batch.bias_values = np.array([v for b in biases for v in b.values()], np.float32)
    return batch


def test_the_sampler_counts_every_token_in_the_pool_up_to_this_step():
    """The token sampled last step (the pool's last filled position) is penalised, a pool row's tokens past the
    sequence are not, rows map to their own pool rows, and the logits logprobs read stay unchanged."""
    from runtime.engine.sampler import Sampler

    vocab = 50
    pool = torch.zeros(4, 12, dtype=torch.int32)
    pool[2, :6] = torch.tensor([5, 6, 7, 8, 9, 30])  # prompt 5, 6, 7; output 8, 9, then 30 sampled last step
    pool[2, 6:] = 31  # an earlier request's tokens
    pool[0, :3] = torch.tensor([1, 2, 3])
    logits = torch.zeros(2, vocab)
    logits[:, 30], logits[:, 31], logits[:, 20] = 3.0, 2.9, 2.0  # 30 wins unpenalised
    sampler = Sampler(vocab, torch.device("cpu"), use_kernels=False, token_pool=pool)
    batch = _batch([2, 0], [6, 3], [3, 3], presence_penalty=[0.5, 0.5])
    original = logits.clone()
    assert sampler.sample(logits, sampler.prepare(batch)).tolist() == [31, 30]
    assert torch.equal(logits, original)
    for params, token in [({"frequency_penalty": [0.5, 0.0]}, 31), ({"repetition_penalty": [1.2, 1.0]}, 31),
                          ({}, 30)]:
        assert sampler.sample(logits, sampler.prepare(_batch([2, 0], [6, 3], [3, 3], **params)))[0] == token
    # At the prompt's end (no output yet) presence and frequency change nothing; repetition counts the prompt.
    pool[1, :2] = torch.tensor([30, 4])
    assert sampler.sample(logits[:1], sampler.prepare(_batch([1], [2], [2], presence_penalty=[2.0])))[0] == 30
    assert sampler.sample(logits[:1], sampler.prepare(_batch([1], [2], [2], repetition_penalty=[1.2])))[0] == 31


def test_logit_bias_is_added_on_its_own_rows_before_the_penalties():
    from runtime.engine.penalties import adjusted_logits, prepare_logit_bias, prepare_penalties
    from runtime.engine.sampler import Sampler

    vocab = 50
    pool = torch.zeros(3, 8, dtype=torch.int32)
    pool[0, :4] = torch.tensor([1, 2, 30, 31])  # prompt 1, 2; output 30, 31
    logits = torch.zeros(3, vocab)
    logits[:, 30], logits[:, 31], logits[:, 20] = 3.0, 2.9, 2.0
    sampler = Sampler(vocab, torch.device("cpu"), use_kernels=False, token_pool=pool)
    biases = [{30: -100.0}, {}, {20: 1.5, 31: -0.5}]
    batch = _batch([1, 2, 0], [2, 2, 4], [2, 2, 2], logit_bias=biases)
    assert sampler.sample(logits, sampler.prepare(batch)).tolist() == [31, 30, 20]
    penalised = _batch([1, 2, 0], [2, 2, 4], [2, 2, 2], logit_bias=biases, repetition_penalty=[1.0, 1.0, 1.5],
                       presence_penalty=[0.0, 0.0, 0.25])
    got = adjusted_logits(logits, prepare_logit_bias(penalised, torch.device("cpu")),
                          prepare_penalties(penalised, torch.device("cpu")), pool)
    dense = logits.clone()
    for row, bias in enumerate(biases):
        for token, value in bias.items():
            dense[row, token] += value
    expected = dense.clone()
    expected[2] = penalize(dense[2:], pool[:1].long(), torch.tensor([4]), torch.tensor([2]), torch.tensor([0.25]),
                           torch.tensor([0.0]), torch.tensor([1.5]))[0]
    assert torch.equal(got, expected)
    assert expected[2, 20] == 3.5 and expected[2, 30] == 3.0 / 1.5 - 0.25  # a biased unseen token, a penalised one
