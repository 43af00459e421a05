"""GPU numerics and fast-path checks (run on a GPU with `pytest -m gpu`).

Random weights in real model shapes: the reference is HF transformers in
float32 on the same weights. bf16 kernels cannot be bitwise equal to it, so
the bound is relative to HF's own bf16 error on the same inputs. Generated
sequences are checked token by token against a float32 teacher-forced
reference: a corrupted KV cache or a wrong padded graph slot produces tokens
far from the reference argmax, while bf16 rounding only flips near-ties.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch

from models.config import ModelConfig
from models.weights.loader import to_hf_state_dict
from runtime import LLM, SamplingParams
from runtime.config import load_config
from runtime.engine import Engine
from runtime.engine.attention.flashinfer_backend import PAGED_DECODE_MIN_BATCH
from tests.helpers import prefill_logits, relative_error

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[1]
LLAMA_1B = REPO / "configs" / "models" / "llama-3.2-1b"
SMOL = REPO / "configs" / "models" / "smollm2-135m"
COMMON = ["model.random_weights=true", "engine.device=cuda", "model.max_seq_len=2048", "cache.num_pages=4096",
          "scheduler.max_running_requests=64"]


def engine(model_dir: Path, *overrides: str) -> Engine:
    cfg = load_config(overrides=[*COMMON, *overrides])
    return Engine(cfg, model_dir, ModelConfig.from_dir(model_dir))


def hf_model(eng: Engine, model_dir: Path, dtype: torch.dtype):
    """HF LlamaForCausalLM over our engine's weights (shared when the dtype matches, else copied)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    state = {k: v.to(dtype) for k, v in to_hf_state_dict(eng.model).items()}
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = type(model.model.rotary_emb)(cfg).to("cuda")
    return model.eval()


@pytest.fixture(scope="module")
def fi_engine() -> Engine:
    return engine(LLAMA_1B, "engine.cuda_graph_max_bs=64")


def _hf_logits(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(torch.tensor([p], device="cuda")).logits[0].float() for p in prompts]


def test_flashinfer_bf16_logits_against_hf_float32(fi_engine):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 10000, (n,), generator=gen).tolist() for n in (7, 100, 513)]
    ref32 = _hf_logits(hf_model(fi_engine, LLAMA_1B, torch.float32), prompts)
    hf16 = _hf_logits(hf_model(fi_engine, LLAMA_1B, torch.bfloat16), prompts)
    ours_prefill = prefill_logits(fi_engine, prompts)
    ours_chunked = prefill_logits(fi_engine, prompts, chunk=64, decode_tail=8)
    torch_eng = engine(LLAMA_1B, "engine.attention_backend=torch", "engine.kernels=torch", "engine.cuda_graph_max_bs=0")
    ours_torch = prefill_logits(torch_eng, prompts)
    for i, ref in enumerate(ref32):
        hf_err = relative_error(hf16[i], ref)
        budget = 2 * hf_err + 2e-3
        print(f"len {len(prompts[i])}: hf bf16 {hf_err:.2e}, flashinfer {relative_error(ours_prefill[i], ref):.2e}, "
              f"chunked+decode {relative_error(ours_chunked[i], ref):.2e}, torch backend {relative_error(ours_torch[i], ref):.2e}")
        assert relative_error(ours_prefill[i], ref) <= budget
        assert relative_error(ours_chunked[i], ref) <= budget
        assert relative_error(ours_torch[i], ref) <= budget
        assert relative_error(ours_prefill[i], ours_torch[i]) <= budget


def test_fused_gemv_decode_against_hf_float32_and_the_unfused_layers(fi_engine):
    """Single-request decode steps run the fused GEMV layers (models/gemv.py), in graphs and eagerly;
    their logits stay within the bf16 budget of HF float32 and of the unfused layers (fused_gemv=never)."""
    assert fi_engine.model.model.fused_gemv
    unfused = engine(LLAMA_1B, "engine.cuda_graph_max_bs=4", "engine.fused_gemv=never")
    assert not unfused.model.model.fused_gemv
    gen = torch.Generator().manual_seed(3)
    ref32_model = hf_model(fi_engine, LLAMA_1B, torch.float32)
    hf16_model = hf_model(fi_engine, LLAMA_1B, torch.bfloat16)
    for length in (20, 150, 700):
        prompts = [torch.randint(0, 10000, (length,), generator=gen).tolist()]
        ref32, hf16 = _hf_logits(ref32_model, prompts), _hf_logits(hf16_model, prompts)
        graph = prefill_logits(fi_engine, prompts, decode_tail=12, use_graph=True)
        eager = prefill_logits(fi_engine, prompts, decode_tail=12)
        plain = prefill_logits(unfused, prompts, decode_tail=12, use_graph=True)
        for i, ref in enumerate(ref32):
            tail = slice(-12, None)  # the decode steps
            budget = 2 * relative_error(hf16[i][tail], ref[tail]) + 2e-3
            errors = [relative_error(x[i][tail], ref[tail]) for x in (graph, eager, plain)]
            print(f"{length} tokens: hf bf16 {budget:.2e} budget; fused graph/eager, unfused: {errors}")
            assert max(errors) <= budget
            assert relative_error(graph[i][tail], plain[i][tail]) <= budget


DECODE_INPUT = 7  # the token every row decodes after its prompt (the same for the graph and eager runs)


def _chunked_prefill_then_decode(
    eng: Engine, prompts: list[list[int]], chunk: int,
) -> tuple[list[torch.Tensor], list[list[tuple[int, int]]]]:
    """Through ``forward_batch``: each prompt prefilled in chunks of ``chunk`` tokens (the second attends to
    the cached first), then one decode step of every row on DECODE_INPUT. Returns each step's logits as the
    sampler received them (float32), and for each of its rows the (prompt, position) they predict from."""
    import numpy as np

    from runtime.batch import Batch

    seen: list[torch.Tensor] = []
    where: list[list[tuple[int, int]]] = []
    sample = eng.sampler.sample
    eng.sampler.sample = lambda logits, args: seen.append(logits.float().clone()) or sample(logits, args)
    try:
        n, page = len(prompts), eng.page_size
        lens = np.array([len(p) for p in prompts], np.int32)
        rows = np.arange(n, dtype=np.int32)
        pages = [np.arange(1 + 200 * i, 1 + 200 * i + -(-len(p) // page) + 1, dtype=np.int32) for i, p in enumerate(prompts)]
        start = np.zeros(n, np.int32)

        def step(phase: str, live: np.ndarray, ext: np.ndarray) -> Batch:
            k = len(live)
            ends = start[live] + ext >= lens[live]  # a chunk that ends its prompt samples; the others discard
            return Batch(phase=phase, rows=rows[live], starts=start[live].copy(), ext_lens=ext.astype(np.int32),
                         sample_rows=np.where(ends, rows[live], eng.dummy_row).astype(np.int32), temperature=np.zeros(k, np.float32), top_k=np.zeros(k, np.int32),
                         top_p=np.ones(k, np.float32), seeds=np.zeros(k, np.int64))

        first = True
        while (start < lens).any():
            live = np.flatnonzero(start < lens)
            batch = step("prefill", live, np.minimum(lens[live] - start[live], chunk))
            if first:
                batch.admit_rows, batch.admit_token_lens = rows, lens
                batch.admit_tokens = np.concatenate([np.asarray(p, np.int32) for p in prompts])
                batch.admit_page_lens = np.array([len(p) for p in pages], np.int32)
                batch.admit_pages = np.concatenate(pages)
                first = False
            eng.forward_batch(batch)
            start[live] += batch.ext_lens
            where.append([(int(i), int(start[i]) - 1) for i in live])
        torch.cuda.synchronize()
        eng.token_pool[torch.from_numpy(rows).long(), torch.from_numpy(lens).long()] = DECODE_INPUT
        eng.forward_batch(step("decode", np.arange(n), np.ones(n)))
        where.append([(i, int(lens[i])) for i in range(n)])
        torch.cuda.synchronize()
    finally:
        eng.sampler.sample = sample
    return seen, where


def test_prefill_graphs_match_eager_prefill_and_hf_float32(fi_engine):
    """Chunked prefill steps replayed from CUDA graphs (padded with dummy tokens, which write only the dummy
    page, and dummy requests computing no tokens), and the decode step after them, against HF float32 on the same
    weights (within twice HF's own bf16 error + 2e-3, as test_flashinfer_bf16_logits_against_hf_float32) and
    against the same steps run eagerly. The KV cache is poisoned with NaN before each run, so a real slot
    the graph failed to write shows; a dummy token's write into a real slot would show in the later steps."""
    runner = fi_engine.graph_runner
    assert runner.prefill_sizes[:4] == [256, 512, 768, 1024] and set(fi_engine.attn_backend.graph_prefill) == set(
        runner.prefill_sizes)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 10000, (n,), generator=gen).tolist() for n in (700, 45, 300, 5, 260)]
    replays: list[int] = []
    replay = runner.replay
    runner.replay = lambda batch, rows_pos: (not batch.is_decode and replays.append(batch.padded_size)) or replay(
        batch, rows_pos)
    sizes = runner.prefill_sizes
    try:
        fi_engine.kv_cache.buffer.fill_(float("nan"))
        # Steps of 910 tokens (5 requests), 300 (the 700-token prompt's second chunk), 100 (its third).
        graph, where = _chunked_prefill_then_decode(fi_engine, prompts, 300)
        assert replays == [1024, 512, 256]
        runner.prefill_sizes = []  # every prefill step eager
        fi_engine.kv_cache.buffer.fill_(float("nan"))
        eager, _ = _chunked_prefill_then_decode(fi_engine, prompts, 300)
        assert replays == [1024, 512, 256]
    finally:
        runner.replay, runner.prefill_sizes = replay, sizes
    assert [len(w) for w in where] == [len(g) for g in graph] == [len(e) for e in eager] == [5, 1, 1, 5]
    seqs = [p + [DECODE_INPUT] for p in prompts]
    ref32 = _hf_logits(hf_model(fi_engine, LLAMA_1B, torch.float32), seqs)
    hf16 = _hf_logits(hf_model(fi_engine, LLAMA_1B, torch.bfloat16), seqs)
    for s, rows in enumerate(where):
        for j, (i, pos) in enumerate(rows):
            ref = ref32[i][pos]
            budget = 2 * relative_error(hf16[i][pos], ref) + 2e-3
            errors = (relative_error(graph[s][j], ref), relative_error(eager[s][j], ref))
            print(f"step {s}, prompt {i} at {pos}: budget {budget:.2e}, graph {errors[0]:.2e}, eager {errors[1]:.2e},"
                  f" graph against eager {relative_error(graph[s][j], eager[s][j]):.2e}")
            assert max(errors) <= budget, (s, i)


def test_graph_replay_matches_eager_for_every_size(fi_engine):
    """Decode logits from each captured graph (and padded sizes) equal the eager decode logits.

    Where the padded graph size and the live size pick different decode kernels (flashinfer's CUDA cores
    below TENSOR_CORE_DECODE_MIN_BATCH, its tensor cores above, paged_decode.py in graphs from
    PAGED_DECODE_MIN_BATCH), the two differ by bf16 rounding, as HF's bf16 differs from float32 (2-3e-2 on
    these weights); a wrong slot or plan gives errors near 1.
    """
    runner = fi_engine.graph_runner
    backend = fi_engine.attn_backend
    assert runner is not None and runner.bs_list[0] == 1 and runner.bs_list[-1] == 64
    assert set(backend.paged_graphs) == {bs for bs in runner.bs_list if bs >= PAGED_DECODE_MIN_BATCH}

    def kernel(bs: int, graph: bool) -> str:
        if graph and bs in backend.paged_graphs:
            return "paged"
        return "tensor cores" if backend.decode_uses_tensor_cores(bs) else "cuda cores"
    gen = torch.Generator().manual_seed(1)
    for n in sorted(set(runner.bs_list) | {3, 5, 13, 63}):
        prompts = [torch.randint(0, 10000, (int(torch.randint(4, 60, (1,), generator=gen)),), generator=gen).tolist()
                   for _ in range(n)]
        eager = prefill_logits(fi_engine, prompts, decode_tail=1, use_graph=False)
        graph = prefill_logits(fi_engine, prompts, decode_tail=1, use_graph=True)
        padded = next(bs for bs in runner.bs_list if bs >= n)
        same_kernel = kernel(n, graph=False) == kernel(padded, graph=True)
        for e, g in zip(eager, graph):
            print(f"{n} rows: eager {kernel(n, False)}, graph {kernel(padded, True)}: {relative_error(g[-1], e[-1]):.2e}")
            assert relative_error(g[-1], e[-1]) <= (1e-2 if same_kernel else 4e-2), n
            if same_kernel:
                assert int(g[-1].argmax()) == int(e[-1].argmax()) or relative_error(g[-1], e[-1]) <= 2e-3


def _validate_against_reference(ref_engine: Engine, prompts, outputs, max_gap: float) -> float:
    """Every greedy token must be the reference argmax or within ``max_gap`` (relative to the row's
    largest |logit|) of it; returns the share of tokens that are exactly the reference argmax."""
    seqs = [p + o.token_ids for p, o in zip(prompts, outputs)]
    logits = prefill_logits(ref_engine, seqs)
    agree = total = 0
    for p, o, lg in zip(prompts, outputs, logits):
        steps = lg[len(p) - 1 : len(p) - 1 + len(o.token_ids)]
        chosen = steps.gather(1, torch.tensor(o.token_ids, device=steps.device)[:, None])[:, 0]
        gap = (steps.max(dim=1).values - chosen) / steps.abs().max(dim=1).values
        assert float(gap.max()) <= max_gap, f"token {int(gap.argmax())} is {float(gap.max()):.3f} below the argmax"
        agree += int((gap == 0).sum())
        total += len(o.token_ids)
    return agree / total


@pytest.mark.parametrize("graphs,overlap", [(True, True), (False, True), (True, False), (False, False)])
def test_generation_long_run_is_not_corrupted(graphs, overlap):
    """64-slot run, 160 requests of mixed lengths arriving as others finish, validated token by token."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 10000, (int(torch.randint(5, 300, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(160)]
    params = [SamplingParams(temperature=0, max_new_tokens=int(torch.randint(1, 80, (1,), generator=gen)), ignore_eos=True)
              for _ in prompts]
    llm = LLM(str(SMOL), overrides=[*COMMON, "scheduler.max_running_requests=48",
                                    f"engine.cuda_graph_max_bs={48 if graphs else 0}", f"scheduler.overlap={overlap}"])
    outs = llm.generate(prompts, params)
    assert [o.completion_tokens for o in outs] == [p.max_new_tokens for p in params]
    ref = engine(SMOL, "engine.attention_backend=torch", "engine.kernels=torch", "model.dtype=float32",
                 "engine.cuda_graph_max_bs=0")
    agreement = _validate_against_reference(ref, prompts, outs, max_gap=0.03)
    print(f"graphs={graphs} overlap={overlap}: {agreement:.4f} of tokens equal the float32 argmax")
    assert agreement >= 0.97


def _decode_batch(n: int, temperature: float, top_k: int, top_p: float, position: int):
    import numpy as np

    from runtime.batch import Batch

    rows = np.arange(n, dtype=np.int32)
    return Batch(
        phase="decode", rows=rows, starts=np.full(n, position, np.int32), ext_lens=np.ones(n, np.int32),
        sample_rows=rows, temperature=np.full(n, temperature, np.float32), top_k=np.full(n, top_k, np.int32),
        top_p=np.full(n, top_p, np.float32), seeds=np.arange(n, dtype=np.int64),
    )


def test_gpu_sampler_honours_top_k_top_p_and_greedy():
    from runtime.engine.sampler import Sampler

    sampler = Sampler(1000, torch.device("cuda"), use_kernels=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(8, 1000, device="cuda", generator=gen) * 3
    top5 = logits.topk(5, dim=-1).indices
    probs = torch.softmax(logits.double(), dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    nucleus_size = ((sorted_p.cumsum(-1) - sorted_p) < 0.5).sum(-1)
    seen_k, seen_p = set(), set()
    for step in range(200):
        tokens = sampler.sample(logits, sampler.prepare(_decode_batch(8, 1.0, 5, 1.0, step)))
        assert bool((tokens[:, None] == top5).any(dim=1).all())
        seen_k.update(tokens.tolist())
        tokens = sampler.sample(logits, sampler.prepare(_decode_batch(8, 1.0, -1, 0.5, step)))
        for row, tok in enumerate(tokens.tolist()):
            assert tok in order[row, : int(nucleus_size[row])].tolist()
            seen_p.add((row, tok))
    assert len(seen_k) > 8  # it really samples
    assert len(seen_p) > 8 and len({row for row, _ in seen_p}) == 8  # top-p sampling too, on every row
    greedy = sampler.sample(logits, sampler.prepare(_decode_batch(8, 0.0, -1, 1.0, 0)))
    assert torch.equal(greedy, logits.argmax(-1))
    cold = sampler.sample(logits, sampler.prepare(_decode_batch(8, 1e-5, -1, 1.0, 0)))
    assert torch.equal(cold.long(), logits.argmax(-1))


def test_gpu_sampling_kernel_equals_the_torch_reference_and_ignores_the_batch():
    """The two Triton kernels draw what the torch reference draws (greedy, temperature, top-k, top-p and both,
    on one vocabulary of 128k), and a row's token is the same alone, in the batch, and on a repeat."""
    from runtime.engine import gumbel
    from runtime.engine.sampler import SamplingArgs, sample_torch, top_k_thresholds

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, vocab = 96, 128256
    logits = (torch.randn(rows, vocab, device="cuda", generator=gen) * 3).bfloat16()
    temps = torch.rand(rows, device="cuda", generator=gen) + 0.3
    temps[:8] = 0
    top_k = torch.where(torch.arange(rows, device="cuda") % 3 == 0, torch.arange(rows, device="cuda") % 97 + 1, 0)
    top_p = torch.where(torch.arange(rows, device="cuda") % 2 == 0, 0.5 + torch.arange(rows, device="cuda") / 400, 1.0)
    seeds = torch.randint(0, 2**62, (rows,), device="cuda", generator=gen)
    positions = torch.randint(0, 4000, (rows,), device="cuda", generator=gen)
    max_k = int(top_k.max())
    reference = sample_torch(logits, SamplingArgs(temps, top_p, top_k, max_k, seeds, positions))
    thresholds = top_k_thresholds(logits, top_k, max_k)
    tokens = gumbel.sample(logits, temps, thresholds, top_p, seeds, positions)
    # The kernel's approximate logarithm and block-wise sums may flip a near-tie, never more than that.
    assert (tokens == reference).float().mean().item() >= 0.98, (tokens != reference).nonzero()
    assert torch.equal(tokens[:8].long(), logits[:8].argmax(-1))
    alone = torch.cat([gumbel.sample(logits[i:i + 1], temps[i:i + 1], thresholds[i:i + 1], top_p[i:i + 1],
                                     seeds[i:i + 1], positions[i:i + 1]) for i in range(rows)])
    assert torch.equal(alone, tokens)
    assert torch.equal(gumbel.sample(logits, temps, thresholds, top_p, seeds, positions), tokens)


def test_gpu_sampler_kernels_with_penalties_and_min_p_equal_the_torch_path():
    """On the device: logit biases, penalties read from the device token pool, min_p joined to the kernels'
    thresholds; the Triton sampler draws what the torch path draws from the same adjusted logits."""
    import numpy as np

    from runtime.engine.sampler import Sampler
    from tests.test_penalties import _batch

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, vocab = 64, 128256
    pool = torch.randint(0, 64, (rows, 300), device="cuda", generator=gen, dtype=torch.int32)  # many repeats
    logits = torch.randn(rows, vocab, device="cuda", generator=gen).bfloat16()
    logits[:, :64] += 4  # the repeated tokens are the likely ones, so penalties decide draws
    pick = np.arange(rows)
    params = {"presence_penalty": np.where(pick % 2 == 0, 1.0, 0.0), "frequency_penalty": np.where(pick % 3 == 0, 0.5, 0),
              "repetition_penalty": np.where(pick % 4 == 1, 1.3, 1.0), "min_p": np.where(pick % 5 < 3, 0.2, 0.0)}
    kv_lens = list(range(100, 100 + rows * 3, 3))
    biases = [{5: 3.0, int(logits[i].float().argmax()): -100.0} if i % 7 == 0 else {} for i in range(rows)]
    batch = _batch(list(range(rows)), kv_lens, [50] * rows, logit_bias=biases,
                   **{k: v.tolist() for k, v in params.items()})
    batch.temperature = np.where(pick < 8, 0.0, 1.2).astype(np.float32)
    kernels = Sampler(vocab, torch.device("cuda"), use_kernels=True, token_pool=pool)
    torch_path = Sampler(vocab, torch.device("cuda"), use_kernels=False, token_pool=pool)
    assert kernels.kernels is not None
    drawn = kernels.sample(logits, kernels.prepare(batch))
    reference = torch_path.sample(logits, torch_path.prepare(batch))
    assert (drawn == reference).float().mean().item() >= 0.98
    plain = torch_path.sample(logits, torch_path.prepare(_batch(list(range(rows)), kv_lens, [50] * rows, 1.2)))
    assert (plain != reference).sum().item() >= rows // 4  # the penalties and min_p changed the draws


def test_gpu_penalties_and_min_p_in_graph_decode_against_the_models_own_logprobs():
    """CUDA graphs and overlap scheduling: each greedy token under presence and frequency penalties is the best of
    the step's logprobs less the penalties of the output before it (float64, over the top 20: the logprobs share
    the logits' per-row shift), a plain greedy row of the same prompt takes the top logprob, and every token drawn
    with min_p is at least min_p times as likely as the likeliest."""
    import math
    from collections import Counter

    llm = LLM(str(SMOL), overrides=[*COMMON, "scheduler.overlap=true"])
    assert llm.engine.graph_runner is not None
    presence, frequency, min_p, temperature = 0.8, 0.6, 0.2, 1.5
    prompts = [list(range(100, 140)), list(range(7, 300, 9))]
    penalised = SamplingParams(temperature=0, max_new_tokens=40, logprobs=20, presence_penalty=presence,
                               frequency_penalty=frequency)
    plain = SamplingParams(temperature=0, max_new_tokens=40, logprobs=20)
    sampled = SamplingParams(temperature=temperature, min_p=min_p, max_new_tokens=40, logprobs=1, seed=3)
    outs = llm.generate(prompts * 3, [penalised] * 2 + [plain] * 2 + [sampled] * 2)
    for out in outs[:2]:
        for t, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            counts = Counter(out.token_ids[:t])
            scores = {tok: lp - frequency * counts[tok] - presence * (counts[tok] > 0)
                      for tok, lp in [*entry["top"], [token, entry["logprob"]]]}
            assert scores[token] >= max(scores.values()) - 1e-3, (t, token, scores)
    for out in outs[2:4]:
        assert all(e["logprob"] >= e["top"][0][1] - 1e-3 for e in out.logprobs)
    assert outs[0].token_ids != outs[2].token_ids and outs[1].token_ids != outs[3].token_ids
    ratios = [(e["logprob"] - e["top"][0][1]) / temperature for out in outs[4:] for e in out.logprobs]
    assert len(ratios) > 40 and min(ratios) >= math.log(min_p) - 1e-3


def test_gpu_top_p_walk_ends_on_rows_of_nan_or_infinite_logits():
    """Compiled, the top-p walk over rows of NaN, one NaN, one +inf and all -inf logits ends with tokens inside the
    vocabulary (it once spun forever on a NaN row, holding the GPU)."""
    import threading

    from runtime.engine import gumbel

    rows, vocab = 4, 128256
    logits = torch.randn(rows, vocab, device="cuda").bfloat16()
    logits[0] = float("nan")
    logits[1, 7] = float("nan")
    logits[2, 11] = float("inf")
    logits[3] = float("-inf")
    ones = torch.ones(rows, device="cuda")
    steps = torch.arange(rows, device="cuda")
    result: list[list[int]] = []
    worker = threading.Thread(target=lambda: result.append(gumbel.sample(
        logits, ones, torch.full((rows,), float("-inf"), device="cuda"), ones * 0.9, steps, steps).tolist()),
        daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert result, "the top-p walk did not end"
    assert all(0 <= t < vocab for t in result[0]) and result[0][2] == 11 and result[0][1] != 7


@pytest.mark.parametrize("temperature", [0.6, 1.0, 2.0])
def test_gpu_temperature_sampling_matches_softmax_of_bf16_logits(temperature):
    """The temperature-only path (the Gumbel-max kernel over bf16 logits) draws from softmax(logits / T):
    chi-square over 40k rows of distinct seeds, and no token is ever out of place."""
    import numpy as np

    from runtime.engine.sampler import Sampler
    from tests.test_sampler import chi2_critical, softmax64

    vocab, n = 10, 40_000
    base = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5, 1.3, -0.2, 0.7, -3.0], dtype=torch.bfloat16, device="cuda")
    sampler = Sampler(vocab, torch.device("cuda"), use_kernels=True)
    tokens = sampler.sample(base.expand(n, vocab), sampler.prepare(_decode_batch(n, temperature, -1, 1.0, 0)))
    counts = np.bincount(tokens.cpu().numpy(), minlength=vocab)
    expected = softmax64(base.float().cpu().numpy(), temperature) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < chi2_critical(vocab - 1), (chi2, counts, expected.round())
    # The same seeds and positions, the same tokens (what keeps TP ranks in step); the next position draws anew.
    twin = Sampler(vocab, torch.device("cuda"), use_kernels=True)
    again = twin.sample(base.expand(n, vocab), twin.prepare(_decode_batch(n, temperature, -1, 1.0, 0)))
    assert torch.equal(again, tokens)
    following = twin.sample(base.expand(n, vocab), twin.prepare(_decode_batch(n, temperature, -1, 1.0, 1)))
    assert not torch.equal(following, tokens)


def test_many_engines_in_one_process():
    """Notebooks and test suites build engine after engine in one process; each must capture its graphs and
    generate correctly, whether or not the previous one was shut down."""
    prompts = [[1, 2, 3, 4], list(range(10, 60))]
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    first = None
    for i in range(6):
        llm = LLM(str(SMOL), overrides=[*COMMON, "engine.cuda_graph_max_bs=32", f"scheduler.overlap={i % 2 == 0}"])
        outs = [o.token_ids for o in llm.generate(prompts, params)]
        first = first or outs
        assert outs == first, i
        if i % 3 == 0:
            llm.shutdown()  # the others are simply dropped
        engine = weakref.ref(llm.engine)
        del llm
        assert engine() is None  # freed (its graphs destroyed) now, not at some later GC pass


# A graph engine, then an eager one, then a graph engine, in one process, on the Llama-3.2-1B shape with the
# benchmark's settings: before the engine stream waited for the default stream's fills, the third engine's
# first graph warm-up read its page table before the fill and hit "an illegal memory access" (reproduced on
# the H200 every time; ARCHITECTURE.md, invariant 14).
ENGINE_SEQUENCE = """
import gc, sys, torch
sys.path.insert(0, ".")
from runtime import LLM, SamplingParams
from scripts.bench_config import load_bench_config
for graphs in (8, 0, 8):
    cfg = load_bench_config(["configs/bench/llama-3.2-1b.yaml"], [f"engine.cuda_graph_max_bs={graphs}"])
    llm = LLM(config=cfg)
    llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_new_tokens=1))
    llm.shutdown()
    llm.__dict__.clear()
    gc.collect()
    torch.cuda.empty_cache()
"""


def test_a_graph_engine_after_an_eager_engine_after_a_graph_engine():
    """Each engine reuses memory the one before freed; its first work on the engine stream must come after
    the fills it made on the default stream."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", ENGINE_SEQUENCE], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _lag_before(fn):  # noqa: ANN001, ANN202
    """``fn`` after a ~10 ms busy-wait kernel on the current stream: the host then runs that far ahead of the GPU."""

    def lagged(self, *args, **kwargs):  # noqa: ANN001, ANN202
        torch.cuda._sleep(20_000_000)
        return fn(self, *args, **kwargs)

    return lagged


def test_tokens_do_not_change_when_the_host_runs_far_ahead_of_the_gpu(monkeypatch):
    """Host/GPU races (say, flashinfer's pinned plan buffer rewritten before the GPU copied the previous plan)
    stay hidden while the GPU keeps up with the host. A busy-wait before every attention plan and graph
    replay puts the host ~10 ms ahead of each step, as a slow step would; greedy tokens must not change."""
    from runtime.engine import graph
    from runtime.engine.attention import flashinfer_backend

    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 10000, (int(torch.randint(5, 200, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(24)]
    params = [SamplingParams(temperature=0, max_new_tokens=int(torch.randint(4, 40, (1,), generator=gen)), ignore_eos=True)
              for _ in prompts]

    def generate() -> list[list[int]]:
        llm = LLM(str(SMOL), overrides=[*COMMON, "scheduler.max_running_requests=12", "engine.cuda_graph_max_bs=8"])
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
        llm.shutdown()
        return tokens

    in_step = generate()
    monkeypatch.setattr(flashinfer_backend.FlashInferBackend, "prepare", _lag_before(flashinfer_backend.FlashInferBackend.prepare))
    monkeypatch.setattr(graph.GraphRunner, "replay", _lag_before(graph.GraphRunner.replay))
    assert generate() == in_step
