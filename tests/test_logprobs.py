"""Logprobs (sampled tokens and prompt tokens) and n samples per prompt.

The reference is HF transformers' own LlamaForCausalLM on the same safetensors, float32 on CPU:
log_softmax of its logits, teacher-forced on the prompt plus the tokens we generated. Logprobs are
of the model's distribution before temperature / top-k / top-p, so the reference never applies them.
"""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.batch import Req, make_sample_group
from runtime.loop import run_until_idle
from tests.helpers import relative_error
from tests.tp_utils import run_ranks

TOL = 1e-4  # nats: float32 against float32
TINY = ["engine.device=cpu", "model.dtype=float32", "scheduler.max_running_requests=8", "model.max_seq_len=512",
        "cache.page_size=4", "scheduler.max_prefill_tokens=32"]


def make_llm(model_dir: Path | str, *overrides: str) -> LLM:
    return LLM(str(model_dir), overrides=[*TINY, *overrides])


@functools.cache
def _hf(model_dir: str):  # noqa: ANN202
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def hf_log_softmax(model_dir: Path | str, seq: list[int]) -> torch.Tensor:
    """[len(seq), vocab] float64: row p is the distribution of token p + 1."""
    with torch.no_grad():
        logits = _hf(str(model_dir))(torch.tensor([seq])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def random_prompts(lengths: list[int], seed: int, vocab: int = 511) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def check_entry(entry: dict, ref: torch.Tensor, token: int, k: int) -> None:
    """One entry against the reference distribution ``ref`` [vocab] of its position."""
    assert entry["token_id"] == token
    assert abs(entry["logprob"] - float(ref[token])) <= TOL
    top = entry["top"]
    assert len(top) == k
    ids = [int(t) for t, _ in top]
    assert len(set(ids)) == k
    for t, v in top:
        assert abs(v - float(ref[t])) <= TOL
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    if k:  # they are the k largest (up to ties within the tolerance)
        kth = float(ref.topk(k).values[-1])
        assert min(v for _, v in top) >= kth - TOL


def check_output(model_dir: Path | str, prompt: list[int], out, k: int | None, prompt_k: int | None) -> None:  # noqa: ANN001
    ref = hf_log_softmax(model_dir, prompt + out.token_ids)
    if k is None:
        assert out.logprobs is None and out.cumulative_logprob is None
    else:
        assert len(out.logprobs) == len(out.token_ids)
        for j, (entry, token) in enumerate(zip(out.logprobs, out.token_ids)):
            check_entry(entry, ref[len(prompt) - 1 + j], token, k)
        assert out.cumulative_logprob == pytest.approx(sum(e["logprob"] for e in out.logprobs), abs=1e-9)
    if prompt_k is None:
        assert out.prompt_logprobs is None
    else:
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for p in range(1, len(prompt)):
            check_entry(out.prompt_logprobs[p], ref[p - 1], prompt[p], prompt_k)


# ---------------------------------------------------------------------------------------------------------
# parameters
# ---------------------------------------------------------------------------------------------------------
def test_sampling_params_accept_and_validate_logprobs_and_n():
    p = SamplingParams.from_dict({"logprobs": 0, "prompt_logprobs": 20, "n": 128})
    assert (p.logprobs, p.prompt_logprobs, p.n) == (0, 20, 128)
    assert (SamplingParams().logprobs, SamplingParams().prompt_logprobs, SamplingParams().n) == (None, None, 1)
    for key, bad in [("logprobs", True), ("logprobs", -1), ("logprobs", 21), ("logprobs", "3"), ("logprobs", 2.0),
                     ("prompt_logprobs", False), ("prompt_logprobs", 21), ("n", 0), ("n", 129), ("n", True),
                     ("n", None), ("n", 1.0)]:
        with pytest.raises(ValueError, match=key):
            SamplingParams.from_dict({key: bad})


# ---------------------------------------------------------------------------------------------------------
# logprobs against HF
# ---------------------------------------------------------------------------------------------------------
def test_greedy_logprobs_and_top_k_equal_hf(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    prompts = random_prompts([5, 23, 61, 1], seed=1)  # 61 > max_prefill_tokens: chunked
    ks = [(5, None), (0, 3), (20, 1), (2, 0)]
    params = [SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True, logprobs=k, prompt_logprobs=pk)
              for k, pk in ks]
    outs = llm.generate(prompts, params)
    for prompt, out, (k, pk) in zip(prompts, outs, ks):
        check_output(tiny_llama_dir, prompt, out, k, pk)
        if k:  # greedy: the sampled token is the top alternative
            assert all(e["top"][0][0] == e["token_id"] for e in out.logprobs)
    assert outs[3].prompt_logprobs == [None]  # a one-token prompt has nothing to score
    json.dumps([o.logprobs for o in outs] + [o.prompt_logprobs for o in outs])  # the JSONL row format


@pytest.mark.slow  # the default model against HF
def test_logprobs_on_the_default_model_equal_hf(default_model_dir):
    """The embedded SmolLM2 (tied embeddings, 49k vocabulary), text prompts through its tokenizer."""
    llm = make_llm(default_model_dir)
    texts = ["The capital of France is", "Write one word about the sea:"]
    prompts = [llm.encode(t) for t in texts]
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        check_output(default_model_dir, prompt, out, 5, 3)


def test_prompt_logprobs_are_computed_not_taken_from_the_radix_cache(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, "cache.type=radix", "cache.debug_checks=true")
    prefix = random_prompts([64], seed=2)[0]
    first, with_lp, without = (prefix + tail for tail in random_prompts([5, 6, 3], seed=3))
    greedy = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    llm.generate([first], greedy)  # its prompt (the shared 64-token prefix) is now cached
    stats = llm.scheduler.stats
    computed, cached = stats.prefill_tokens, stats.cached_tokens
    asks = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True, logprobs=1, prompt_logprobs=4)
    outs = llm.generate([with_lp, without], [asks, greedy])
    # The request asking for prompt logprobs computed all 70 positions (in 32-token chunks); the other
    # one took the cached prefix.
    assert stats.cached_tokens - cached == 64
    assert stats.prefill_tokens - computed == len(with_lp) + len(without) - 64
    check_output(tiny_llama_dir, with_lp, outs[0], 1, 4)
    check_output(tiny_llama_dir, without, outs[1], None, None)


def test_logprobs_ignore_temperature_top_k_and_top_p(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    prompts = random_prompts([7, 30, 12], seed=4)
    params = [SamplingParams(temperature=0.6, top_k=3, seed=5, max_new_tokens=12, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=2.5, top_p=0.5, seed=6, max_new_tokens=12, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, logprobs=4, prompt_logprobs=2)]
    outs = llm.generate(prompts, params)
    for prompt, out, p in zip(prompts, outs, params):
        check_output(tiny_llama_dir, prompt, out, p.logprobs, p.prompt_logprobs)
    # Top-k 3 draws only among the model's 3 most likely tokens, which are exactly the reported top 3.
    assert all(e["token_id"] in [t for t, _ in e["top"]] for e in outs[0].logprobs)
    assert any(e["top"][0][0] != e["token_id"] for e in outs[0].logprobs)  # it really sampled


def test_rows_asking_for_logprobs_do_not_change_any_token(tiny_llama_dir):
    prompts = random_prompts([9, 40, 3, 17, 33, 50], seed=7)
    base = [dict(temperature=0, max_new_tokens=10), dict(temperature=0.8, seed=11, max_new_tokens=10),
            dict(temperature=1.0, max_new_tokens=10), dict(temperature=1.0, top_p=0.7, seed=2, max_new_tokens=8),
            dict(temperature=0, max_new_tokens=12), dict(temperature=0.9, top_k=20, max_new_tokens=10)]
    extra = [dict(logprobs=3), {}, dict(logprobs=0, prompt_logprobs=2), dict(prompt_logprobs=5), {}, dict(logprobs=1)]
    plain = make_llm(tiny_llama_dir).generate(prompts, [SamplingParams(**b) for b in base])
    mixed = make_llm(tiny_llama_dir).generate(prompts, [SamplingParams(**b, **e) for b, e in zip(base, extra)])
    assert [o.token_ids for o in mixed] == [o.token_ids for o in plain]
    assert [o.logprobs is not None for o in mixed] == ["logprobs" in e for e in extra]
    assert mixed[2].logprobs[0]["top"] == []  # logprobs=0: the sampled token's logprob alone
    assert len(mixed[3].prompt_logprobs) == len(prompts[3])


# ---------------------------------------------------------------------------------------------------------
# tensor parallelism
# ---------------------------------------------------------------------------------------------------------
def make_tp3_llama(path: Path) -> Path:
    """6 heads, 3 KV heads and an intermediate size that split over 3 ranks; vocab 500 pads the last shard."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(21)
    cfg = LlamaConfig(vocab_size=500, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=1024,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=499, bos_token_id=1)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path, safe_serialization=True)
    return path


TP_PROMPTS = random_prompts([12, 45, 7, 26], seed=8, vocab=499)
TP_PARAMS = [dict(temperature=0, max_new_tokens=8, logprobs=4, prompt_logprobs=3),
             dict(temperature=0.9, seed=4, max_new_tokens=8, logprobs=2),
             dict(temperature=0, max_new_tokens=6),
             dict(temperature=1.0, top_k=10, seed=9, max_new_tokens=8, logprobs=0, prompt_logprobs=1)]


def serve(llm: LLM, reqs: list[Req], publish=None) -> list[Req]:  # noqa: ANN001
    """What LLM.run does with requests it has made: queue them and run the loop until all finish."""
    for r in reqs:
        llm.scheduler.add(r)
    run_until_idle(llm.scheduler, llm.engine, llm.outputs, llm.cfg.scheduler.overlap, lambda r: None, publish)
    return reqs


def sample_group(llm: LLM, prompt: list[int], params: SamplingParams) -> list[Req]:
    first = llm.make_request(prompt, params)
    uids = list(range(llm._next_uid, llm._next_uid + params.n - 1))
    llm._next_uid += params.n - 1
    return make_sample_group(first, uids)


def tp_run(rank: int, model_dir: str) -> dict:
    """Rank 0 generates (logprobs, then a seeded group of 3 samples); every rank records its step logprobs."""
    from runtime.broadcast import send_batch
    from runtime.config import load_config
    from runtime.engine import Engine
    from runtime.worker import worker_loop

    cfg_overrides = [*TINY, f"model.path={model_dir}"]
    steps: list = []

    def record(out) -> None:  # noqa: ANN001
        lp = out.logprobs
        steps.append(None if lp is None else [b and b.logprobs.clone() for b in (lp.sampled, lp.prompt)])

    if rank != 0:
        from models.config import ModelConfig

        worker_loop(Engine(load_config(overrides=cfg_overrides), model_dir, ModelConfig.from_dir(model_dir)),
                    on_output=lambda batch, out: record(out))
        return {"steps": steps}
    llm = LLM(config=load_config(overrides=cfg_overrides))
    forward = llm.engine.forward_batch

    def recorded(batch):  # noqa: ANN001, ANN202
        out = forward(batch)
        record(out)
        return out

    llm.engine.forward_batch = recorded
    outs = llm.generate(TP_PROMPTS, [SamplingParams(**p) for p in TP_PARAMS])
    group = serve(llm, sample_group(llm, TP_PROMPTS[1], SamplingParams(temperature=1.0, seed=3, n=3, max_new_tokens=8,
                                                                       logprobs=1)),
                  send_batch if llm.engine.tp_size > 1 else None)
    llm.shutdown()
    return {"steps": steps, "outputs": [(o.token_ids, o.logprobs, o.prompt_logprobs) for o in outs],
            "group": [(r.output_ids, r.output_logprobs) for r in group]}


def _logprob_values(entries) -> list[float]:  # noqa: ANN001
    return [v for e in entries if e is not None for v in (e["logprob"], *(x[1] for x in e["top"]))]


@pytest.mark.slow
def test_tp3_logprobs_equal_tp1(tmp_path):
    model_dir = str(make_tp3_llama(tmp_path / "tp3"))
    single = tp_run(0, model_dir)
    ranks = run_ranks(3, tp_run, model_dir)
    ours = ranks[0]
    for (tok, lp, plp), (ref_tok, ref_lp, ref_plp) in itertools.chain(
        zip(ours["outputs"], single["outputs"]), ((a + (None,), b + (None,)) for a, b in zip(ours["group"], single["group"]))
    ):
        assert tok == ref_tok
        for mine, ref in ((lp, ref_lp), (plp, ref_plp)):
            assert (mine is None) == (ref is None)
            if mine is not None:
                assert [e and (e["token_id"], [t for t, _ in e["top"]]) for e in mine] == \
                    [e and (e["token_id"], [t for t, _ in e["top"]]) for e in ref]
                assert np.allclose(_logprob_values(mine), _logprob_values(ref), atol=1e-5, rtol=0)
    # Every rank computed the same logprobs, step by step (the logits are all-gathered: the same bits).
    for worker in ranks[1:]:
        assert len(worker["steps"]) == len(ours["steps"])
        for a, b in zip(worker["steps"], ours["steps"]):
            assert (a is None) == (b is None)
            if a is not None:
                assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))
    assert sum(s is not None for s in ours["steps"]) > 10


# ---------------------------------------------------------------------------------------------------------
# n samples of one prompt
# ---------------------------------------------------------------------------------------------------------
def test_samples_compute_the_prompt_once_and_draw_their_own_streams(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, "cache.debug_checks=true")
    prompt = random_prompts([45], seed=10)[0]
    params = SamplingParams(temperature=1.0, seed=123, n=4, max_new_tokens=10, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1)
    group = serve(llm, sample_group(llm, prompt, params))
    # Sample 0 computes the 45 prompt tokens (two chunks); each sibling then finds 44 of them (11 whole
    # pages) cached and computes the last one.
    assert llm.scheduler.stats.prefill_tokens == 45 + 3
    assert llm.scheduler.stats.cached_tokens == 3 * 44
    assert [r.sample_index for r in group] == [0, 1, 2, 3]
    assert len({tuple(r.output_ids) for r in group}) == 4  # temperature 1: each sample its own stream
    for r in group:
        assert r.finish_reason == "length" and len(r.output_ids) == 10
        out = type("Out", (), {"token_ids": r.output_ids, "logprobs": r.output_logprobs,
                               "cumulative_logprob": r.cumulative_logprob, "prompt_logprobs": r.prompt_logprobs})
        check_output(tiny_llama_dir, prompt, out, 2, 1 if r.sample_index == 0 else None)

    # Reproducible: another run, other requests in the batch, no prefix sharing (each sample computes its
    # own prompt, chunked differently): the same samples. Sample 0 is what n=1 with that seed draws.
    other = make_llm(tiny_llama_dir, "cache.type=naive", "scheduler.max_prefill_tokens=16")
    noise = [other.make_request(p, SamplingParams(temperature=0.7, max_new_tokens=6))
             for p in random_prompts([20, 9], seed=11)]
    again = serve(other, [noise[0], *sample_group(other, prompt, params), noise[1]])[1:-1]
    assert [r.output_ids for r in again] == [r.output_ids for r in group]
    assert other.scheduler.stats.cached_tokens == 0
    single = make_llm(tiny_llama_dir).generate([prompt], SamplingParams(temperature=1.0, seed=123, max_new_tokens=10,
                                                                        ignore_eos=True))
    assert single[0].token_ids == group[0].output_ids


def test_greedy_samples_are_identical_and_unseeded_ones_differ(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    prompt = random_prompts([30], seed=12)[0]
    greedy = serve(llm, sample_group(llm, prompt, SamplingParams(temperature=0, n=3, max_new_tokens=8)))
    assert len({tuple(r.output_ids) for r in greedy}) == 1
    unseeded = serve(llm, sample_group(llm, prompt, SamplingParams(temperature=1.0, n=3, max_new_tokens=8)))
    assert len({tuple(r.output_ids) for r in unseeded}) == 3


def test_a_sibling_whose_first_sample_was_never_queued_computes_its_own_prompt(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    prompt = random_prompts([21], seed=13)[0]
    group = sample_group(llm, prompt, SamplingParams(temperature=0, n=3, max_new_tokens=4))
    serve(llm, group[1:])  # sample 0 failed (say) before it was queued
    assert all(r.finish_reason == "length" for r in group[1:])
    assert group[1].output_ids == group[2].output_ids
    assert [r.leader for r in group[1:]] == [None, None]
    assert llm.scheduler.stats.prefill_tokens == 2 * 21  # admitted together: neither waits for the other


@pytest.mark.parametrize("overlap", [True, False])
def test_sample_groups_read_the_right_kv_under_page_pressure(overlap):
    """Groups of samples among plain requests, chunked prompts, a pool too small for all at once: the
    KV-checking engine of test_radix verifies every read; the cache's integrity is checked every step."""
    from runtime.config import load_config
    from runtime.output import OutputProcessor
    from runtime.scheduler import Scheduler
    from tests.test_radix import KVCheckingEngine

    cfg = load_config(overrides=["scheduler.max_running_requests=4", "scheduler.max_prefill_tokens=13"]).scheduler
    sched = Scheduler(cfg, 20, 4, 4096, 4, "radix", debug_checks=True)
    uid = itertools.count()
    reqs: list[Req] = []
    for prompt, n in zip(random_prompts([30, 9, 41, 17, 26], seed=14, vocab=50), [3, 1, 4, 1, 2]):
        params = SamplingParams(temperature=0, max_new_tokens=9, n=n)
        first = Req(next(uid), [t + 10 for t in prompt], params, 9)
        reqs += make_sample_group(first, [next(uid) for _ in range(n - 1)])
    for r in reqs:
        sched.add(r)
    engine = KVCheckingEngine(4, 4)
    run_until_idle(sched, engine, OutputProcessor({2}, 4), overlap, lambda r: None)
    assert all(r.finish_reason is not None for r in reqs)
    for r in reqs:
        seq = list(r.prompt_ids)
        while len(seq) - r.prompt_len < r.max_new_tokens:
            seq.append(KVCheckingEngine.next_token(seq, len(seq)))
        assert r.output_ids == seq[r.prompt_len :]
    assert sched.stats.page_waits > 0
    # Each prompt computed once, plus each sibling's last partial page (here every leader still held its
    # prompt when its siblings came in, so nothing was evicted in between).
    firsts = [r for r in reqs if r.sample_index == 0]
    siblings = [r for r in reqs if r.sample_index > 0]
    assert sched.stats.prefill_tokens == sum(r.prompt_len for r in firsts) + sum(
        r.prompt_len - (r.prompt_len - 1) // 4 * 4 for r in siblings)


# ---------------------------------------------------------------------------------------------------------
# GPU: bf16 logprobs, CUDA graphs on
# ---------------------------------------------------------------------------------------------------------
def _flat_entries(prompt: list[int], out) -> list[tuple[int, int, float, int]]:  # noqa: ANN001
    """(position whose distribution it is, token id, our logprob, entry number) for every value reported."""
    flat = []
    entries = [(len(prompt) - 1 + j, e) for j, e in enumerate(out.logprobs or [])]
    entries += [(p - 1, e) for p, e in enumerate(out.prompt_logprobs or []) if e is not None]
    for n, (pos, e) in enumerate(entries):
        flat += [(pos, e["token_id"], e["logprob"], n)] + [(pos, t, v, n) for t, v in e["top"]]
    return flat


@pytest.mark.gpu
def test_bf16_logprobs_with_cuda_graphs_stay_within_the_bf16_budget():
    """Random weights in SmolLM2's shapes, bf16, flashinfer, CUDA graphs and overlap on: each reported logprob
    against HF float32 on the same weights, within twice HF's own bf16 error on the same values (+2e-3),
    relative to the largest |logprob| (tests/test_gpu_tp.py's logits budget, applied to logprobs)."""
    from tests.test_gpu import COMMON, SMOL, hf_model

    llm = LLM(str(SMOL), overrides=[*COMMON, "engine.cuda_graph_max_bs=16", "scheduler.max_prefill_tokens=128"])
    runner = llm.engine.graph_runner
    assert runner is not None
    replays: list[int] = []
    replay = runner.replay
    runner.replay = lambda batch, rows_pos: (batch.is_decode and replays.append(batch.size)) or replay(batch, rows_pos)
    prompts = random_prompts([9, 40, 300, 17, 5], seed=20, vocab=10000)  # 300 > 128: a chunked prompt
    common = dict(max_new_tokens=24, ignore_eos=True)
    params = [SamplingParams(temperature=0, logprobs=5, prompt_logprobs=5, **common),
              SamplingParams(temperature=0.8, seed=1, logprobs=3, **common),  # counter RNG rows
              SamplingParams(temperature=1.0, logprobs=20, prompt_logprobs=0, **common),  # flashinfer sampling rows
              SamplingParams(temperature=0, **common),  # a row without logprobs in the same graph batches
              SamplingParams(temperature=0.7, top_k=20, top_p=0.9, logprobs=1, **common)]
    outs = llm.generate(prompts, params)
    plain = llm.generate(prompts[3:4], params[3])[0]
    assert plain.token_ids == outs[3].token_ids and outs[3].logprobs is None
    assert max(replays) == 8  # decode of all 5 rows (padded to 8) ran in the graphs, logprob rows included
    ref32, hf16 = hf_model(llm.engine, SMOL, torch.float32), hf_model(llm.engine, SMOL, torch.bfloat16)
    for prompt, out, p in zip(prompts, outs, params):
        assert (out.logprobs is None) == (p.logprobs is None)
        if p.logprobs is None:
            continue
        seq = torch.tensor([prompt + out.token_ids], device="cuda")
        with torch.no_grad():
            lsm32 = torch.log_softmax(ref32(seq).logits[0].float(), dim=-1).cpu()
            lsm16 = torch.log_softmax(hf16(seq).logits[0].float(), dim=-1).cpu()
        flat = _flat_entries(prompt, out)
        pos, ids = torch.tensor([f[0] for f in flat]), torch.tensor([f[1] for f in flat])
        ours = torch.tensor([f[2] for f in flat], dtype=torch.float64)
        ref, theirs = lsm32[pos, ids], lsm16[pos, ids]
        budget = 2 * relative_error(theirs, ref) + 2e-3
        err = relative_error(ours, ref)
        print(f"prompt {len(prompt)}: {len(flat)} values, hf bf16 {relative_error(theirs, ref):.2e}, ours {err:.2e}")
        assert err <= budget
        # The reported alternatives are the k most likely tokens, up to what bf16 can tell apart.
        slack = budget * float(ref.abs().max())
        for n in sorted({f[3] for f in flat}):
            top = [f for f in flat if f[3] == n][1:]
            if top:
                kth = float(lsm32[top[0][0]].topk(len(top)).values[-1])
                assert min(v for _, _, v, _ in top) >= kth - slack
