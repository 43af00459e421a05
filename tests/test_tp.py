"""Tensor parallelism on CPU (gloo, several processes): TP=N against TP=1, identical ranks, memory agreement."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.config import load_config
from tests.conftest import make_tiny_llama
from tests.helpers import make_engine, prefill_logits, relative_error
from tests.tp_utils import run_ranks

GEN_OVERRIDES = ["engine.device=cpu", "model.dtype=float32", "scheduler.max_running_requests=8",
                 "model.max_seq_len=512", "cache.page_size=4", "scheduler.max_prefill_tokens=40"]
PARAMS = [
    {"temperature": 0.0, "max_new_tokens": 12},
    {"temperature": 0.8, "top_k": 20, "seed": 7, "max_new_tokens": 12},
    {"temperature": 1.0, "top_p": 0.9, "seed": 3, "max_new_tokens": 10},
    # unseeded: drawn from (engine.seed, request id); penalties and min_p travel to every rank
    {"temperature": 0.7, "presence_penalty": 0.8, "frequency_penalty": 0.4, "min_p": 0.05, "max_new_tokens": 9},
    {"temperature": 1.2, "top_k": 50, "top_p": 0.8, "repetition_penalty": 1.3, "logit_bias": {3: 2.0, 11: -100.0},
     "max_new_tokens": 12},
]


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab - 1, (n,), generator=gen).tolist() for n in lengths]


def generate_on_rank(rank: int, model_dir: str, prompts: list[list[int]], params: list[dict]) -> dict:
    """Rank 0 schedules and generates; the others follow. Every rank records the tokens it sampled."""
    from models.config import ModelConfig
    from runtime import LLM, SamplingParams
    from runtime.engine import Engine
    from runtime.worker import worker_loop

    cfg = load_config(overrides=[*GEN_OVERRIDES, f"model.path={model_dir}"])
    steps: list[list[int]] = []
    if rank == 0:
        llm = LLM(config=cfg)
        forward = llm.engine.forward_batch

        def recorded(batch):  # noqa: ANN001, ANN202
            out = forward(batch)
            steps.append(out.next_tokens_cpu.tolist())
            return out

        llm.engine.forward_batch = recorded
        outs = llm.generate(prompts, [SamplingParams(**p) for p in params])
        llm.shutdown()
        return {"steps": steps, "outputs": [o.token_ids for o in outs]}
    engine = Engine(cfg, model_dir, ModelConfig.from_dir(model_dir))
    worker_loop(engine, on_output=lambda batch, out: steps.append(out.next_tokens_cpu.tolist()))
    return {"steps": steps}


def logits_and_generation(rank: int, model_dir: str, prompts, gen_prompts, params) -> dict:  # noqa: ANN001
    engine = make_engine(model_dir, "cache.page_size=4")
    logits = prefill_logits(engine, prompts, chunk=16, decode_tail=4)
    del engine
    return {"logits": logits, **generate_on_rank(rank, model_dir, gen_prompts, params)}


def reference(model_dir, prompts, gen_prompts, params) -> dict:  # noqa: ANN001
    from runtime import LLM, SamplingParams

    logits = prefill_logits(make_engine(model_dir, "cache.page_size=4"), prompts, chunk=16, decode_tail=4)
    llm = LLM(config=load_config(overrides=[*GEN_OVERRIDES, f"model.path={model_dir}"]))
    outs = llm.generate(gen_prompts, [SamplingParams(**p) for p in params])
    return {"logits": logits, "outputs": [o.token_ids for o in outs]}


def _check(ranks: list[dict], ref: dict) -> None:
    for r in ranks:
        for ours, theirs in zip(r["logits"], ref["logits"]):
            assert relative_error(ours, theirs) <= 1e-5
        for ours, first in zip(r["logits"], ranks[0]["logits"]):
            assert torch.equal(ours, first)  # all-gathered logits are the same bits everywhere
        assert r["steps"] == ranks[0]["steps"]  # identical sampled tokens on every rank, every step
    assert ranks[0]["outputs"] == ref["outputs"]  # greedy and seeded sampling equal TP=1
    assert len(ranks[0]["steps"]) > 10


@pytest.fixture(scope="module")
def tp_tiny_dir(tmp_path_factory) -> str:
    # 8 heads, 4 KV heads, a vocabulary not divisible by 4 (the last shard is padded).
    return str(make_tiny_llama(tmp_path_factory.mktemp("tp_tiny"), vocab=502, heads=8, kv_heads=4, seed=11))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_tiny_llama_tp_equals_tp1(tp_tiny_dir, world):
    prompts = _prompts(502, [5, 23, 61], seed=world)
    gen_prompts = _prompts(502, [3, 17, 45, 8, 30], seed=world + 10)
    ref = reference(tp_tiny_dir, prompts, gen_prompts, PARAMS)
    ranks = run_ranks(world, logits_and_generation, tp_tiny_dir, prompts, gen_prompts, PARAMS)
    _check(ranks, ref)


@pytest.mark.slow
def test_default_model_tp3_equals_tp1(default_model_dir):
    prompts = _prompts(49152, [9, 70], seed=1)
    gen_prompts = _prompts(49152, [12, 40, 25, 7, 33], seed=2)
    ref = reference(str(default_model_dir), prompts, gen_prompts, PARAMS)
    ranks = run_ranks(3, logits_and_generation, str(default_model_dir), prompts, gen_prompts, PARAMS)
    _check(ranks, ref)


def memory_agreement(rank: int, model_dir: str) -> dict:
    import torch.distributed as dist

    from parallel.distributed import agree_on_memory

    calls = []
    original = dist.all_reduce

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(kwargs.get("op"))
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        low, high, after = agree_on_memory([5, 9][rank] * 2**30, [4, 2][rank] * 2**30)
        agreement_calls = len(calls)
        budget = [200, 300][rank] * 2**20  # each rank "has" different free memory
        calls.clear()
        engine = make_engine(model_dir, f"cache.cpu_memory_bytes={budget}", "scheduler.max_running_requests=256",
                             "model.max_seq_len=2048", "parallel.memory_imbalance_bytes=200000000")
        engine_min_calls = calls.count(dist.ReduceOp.MIN)
        try:
            make_engine(model_dir, f"cache.cpu_memory_bytes={budget}", "parallel.memory_imbalance_bytes=1000")
            refused = ""
        except RuntimeError as exc:
            refused = str(exc)
    finally:
        dist.all_reduce = original
    shard_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    return {"min": low, "max": high, "after": after, "calls": agreement_calls, "engine_min_calls": engine_min_calls,
            "num_pages": engine.num_pages, "refused": refused, "shard_bytes": shard_bytes}


@pytest.mark.slow  # spawns ranks
def test_ranks_with_different_free_memory_agree_on_pages(tp_tiny_dir):
    from models.config import ModelConfig
    from runtime.engine.kv_cache import compute_num_pages, page_bytes

    ranks = run_ranks(2, memory_agreement, tp_tiny_dir)
    for r in ranks:
        assert (r["min"], r["max"], r["after"]) == (5 * 2**30, 9 * 2**30, 2 * 2**30)
        assert r["calls"] == 1 and r["engine_min_calls"] == 1  # the page count from ONE all_reduce
        assert "differs across ranks" in r["refused"]
    assert ranks[0]["num_pages"] == ranks[1]["num_pages"]
    # The count follows the smaller budget and this rank's shard of the model.
    mc = ModelConfig.from_dir(tp_tiny_dir)
    per_page = page_bytes(mc.num_layers, mc.num_kv_heads // 2, mc.head_dim, 16, torch.float32)
    assert ranks[0]["num_pages"] == compute_num_pages(200 * 2**20, ranks[0]["shard_bytes"], 0.9, per_page)
    assert ranks[0]["shard_bytes"] < sum(p.numel() * 4 for p in make_engine(tp_tiny_dir).model.parameters()) * 0.6


@pytest.mark.parametrize("heads,kv_heads,tp,named", [(8, 4, 3, "num_attention_heads=8"), (12, 4, 6, "num_key_value_heads=4"),
                                                    (8, 2, 4, None)])
def test_indivisible_head_splits_fail_at_start_naming_the_numbers(heads, kv_heads, tp, named):
    from models.config import ModelConfig
    from models.llama import LlamaForCausalLM
    from parallel.state import TPInfo, set_tp

    cfg = ModelConfig(vocab_size=100, hidden_size=heads * 8, intermediate_size=tp * 16, num_layers=1, num_heads=heads,
                      num_kv_heads=kv_heads, head_dim=8, rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None,
                      max_position_embeddings=64, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                      torch_dtype="float32")
    set_tp(TPInfo(rank=tp - 1, size=tp))
    try:
        with torch.device("meta"):
            if named is None:  # fewer KV heads than ranks, TP a multiple of them: KV heads replicate
                attn = LlamaForCausalLM(cfg).model.layers[0].self_attn
                assert (attn.num_heads, attn.num_kv_heads, attn.qkv_proj.kv_head_start) == (2, 1, 1)
            else:
                with pytest.raises(ValueError, match=named) as err:
                    LlamaForCausalLM(cfg)
                assert f"size {tp}" in str(err.value)
    finally:
        set_tp(TPInfo())


@pytest.mark.parametrize("arch,moe,named", [("LlamaForCausalLM", False, "intermediate_size=129"),
                                            ("MixtralForCausalLM", True, "intermediate_size=129"),
                                            ("Qwen3MoeForCausalLM", True, "moe_intermediate_size=129")])
def test_an_indivisible_mlp_width_fails_naming_its_config_key(arch, moe, named):
    from models.config import ModelConfig
    from models.llama import LlamaForCausalLM
    from parallel.state import TPInfo, set_tp

    moe_fields = {"moe": True, "num_experts": 4, "experts_per_token": 2, "moe_intermediate_size": 129,
                  "sparse_layers": (0,)} if moe else {}
    cfg = ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=129, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None,
                      max_position_embeddings=64, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                      torch_dtype="float32", architecture=arch, **moe_fields)
    set_tp(TPInfo(rank=1, size=2))
    try:
        with torch.device("meta"), pytest.raises(ValueError, match=f"^{named} is not divisible by tensor-parallel"):
            LlamaForCausalLM(cfg)
    finally:
        set_tp(TPInfo())


def random_model_logits(rank: int, config_dir: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    engine = make_engine(config_dir, "model.random_weights=true", "engine.seed=3", "cache.page_size=4")
    return prefill_logits(engine, prompts)


@pytest.mark.slow  # spawns ranks
def test_random_weights_are_one_model_at_every_tp_and_equal_the_saved_checkpoint(tp_tiny_dir, tmp_path):
    """Benchmark weights are drawn per full tensor (sliced, not reseeded per rank), so TP=2 is the TP=1 model,
    and scripts/make_random_checkpoint.py writes exactly that model."""
    from scripts.make_random_checkpoint import write_random_checkpoint

    prompts = _prompts(502, [6, 19], seed=4)
    single = random_model_logits(0, tp_tiny_dir, prompts)
    ranks = run_ranks(2, random_model_logits, tp_tiny_dir, prompts)
    saved = write_random_checkpoint(Path(tp_tiny_dir), tmp_path / "ckpt", seed=3, dtype=torch.float32,
                                    device=torch.device("cpu"))
    from_disk = prefill_logits(make_engine(saved, "cache.page_size=4"), prompts)
    other_seed = prefill_logits(make_engine(tp_tiny_dir, "model.random_weights=true", "engine.seed=4"), prompts)
    for i in range(len(prompts)):
        assert relative_error(ranks[0][i], single[i]) <= 1e-5 and torch.equal(ranks[0][i], ranks[1][i])
        assert torch.equal(from_disk[i], single[i])
        assert relative_error(other_seed[i], single[i]) > 0.1
