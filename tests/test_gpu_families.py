"""Qwen2.5-7B, Qwen3-8B and Mistral-7B-v0.3 shapes in bf16 on the GPU against HF float32 (`pytest -m gpu`).

For each, HF's own class (chosen by AutoModelForCausalLM from configs/models/<name>/config.json) is built at
the real width (hidden size, query and KV heads, head_dim, intermediate size, vocabulary) but with only
``LAYERS`` = 2 decoder layers, so that a case takes seconds: what a family adds (q/k/v bias; per-head q/k
RMSNorm, which runs flashinfer's rmsnorm on (-1, head_dim) rows; 28 heads over 4 KV heads) is in every layer,
so more layers of random weights would test nothing new. Its random weights are drawn in bf16 on the GPU,
saved as safetensors and loaded through the LLM API with the defaults: bf16, flashinfer attention and
kernels, CUDA graphs for decode.

The reference is HF float32 on the same weights (the bf16 values upcast). bf16 cannot match it bit for bit,
so the logits budget is twice HF's own bf16 error against it on the same inputs (+2e-3, as in
tests/test_gpu.py), measured per sequence; for greedy tokens, our agreement with the float32 argmax must be
about as good as HF bf16's own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runtime import LLM, SamplingParams
from tests.conftest import perturb_norms_and_biases
from tests.helpers import prefill_logits, relative_error

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[1]
SHAPES = {"qwen2.5-7b": "Qwen2ForCausalLM", "qwen3-8b": "Qwen3ForCausalLM", "mistral-7b-v0.3": "MistralForCausalLM"}
LAYERS = 2
NEW_TOKENS = 16  # greedy tokens per prompt, then teacher-forced through decode steps
PROMPT_LENS = (7, 100, 513, 33, 250, 64, 17, 180)
OVERRIDES = ["engine.device=cuda", "model.max_seq_len=1024", "cache.num_pages=1024",
             f"scheduler.max_running_requests={len(PROMPT_LENS)}", f"engine.cuda_graph_max_bs={len(PROMPT_LENS)}"]


def hf_config(name: str, layers: int = LAYERS, **changes: int):  # noqa: ANN201
    """The HF config of configs/models/<name> with ``layers`` layers (set before it is built: Qwen2's
    per-layer attention types are derived from the layer count)."""
    from transformers import AutoConfig

    fields = json.loads((REPO / "configs" / "models" / name / "config.json").read_text())
    fields.update(num_hidden_layers=layers, **changes)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def save_random_hf_model(config, path: Path, device: str = "cuda") -> Path:  # noqa: ANN001
    """HF's own class for ``config`` with random bf16 weights drawn on ``device``, saved as safetensors."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert type(model).__name__ == config.architectures[0]
    perturb_norms_and_biases(model)
    model.save_pretrained(path, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    return path


def hf_logits(path: Path, seqs: list[list[int]], starts: list[int], dtype: torch.dtype,
              device: str = "cuda") -> list[torch.Tensor]:
    """HF's float32 logits of each sequence from position ``start`` on, the model loaded in ``dtype``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    with torch.no_grad():
        out = [model(torch.tensor([s], device=device)).logits[0, start:].float() for s, start in zip(seqs, starts)]
    del model
    torch.cuda.empty_cache()
    return out


def argmax_gaps(ref: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Per row: how far the chosen token's reference logit is below the reference maximum, relative to the
    row's largest |logit| (0 where the chosen token is the reference argmax)."""
    picked = ref.gather(1, chosen.to(ref.device)[:, None])[:, 0]
    return (ref.max(dim=1).values - picked) / ref.abs().max(dim=1).values


@pytest.fixture(scope="module", params=list(SHAPES))
def checkpoint(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, save_random_hf_model(hf_config(request.param), tmp_path_factory.mktemp(request.param))


def assert_gpu_defaults(eng) -> None:  # noqa: ANN001
    """What is under test: bf16, flashinfer attention, flashinfer norms (the per-head q/k norms too), graphs."""
    from models.ops import FLASHINFER_KERNELS

    attn = eng.model.model.layers[0].self_attn
    assert eng.dtype == torch.bfloat16 and type(eng.attn_backend).__name__ == "FlashInferBackend"
    assert eng.model.model.norm.norm is FLASHINFER_KERNELS.rms_norm and eng.graph_runner is not None
    if attn.qk_norm:
        assert attn.q_norm.norm is FLASHINFER_KERNELS.rms_norm and attn.k_norm.norm is FLASHINFER_KERNELS.rms_norm


def _our_logits(path: Path, prompts: list[list[int]]) -> tuple[list[list[int]], dict[str, list[torch.Tensor]]]:
    """Greedy tokens from the LLM API (scheduler, overlap, graphs), then the logits of prompt + tokens
    teacher-forced: the prompt's last position and one decode step per token, in two ways."""
    llm = LLM(str(path), overrides=OVERRIDES)
    eng = llm.engine
    assert_gpu_defaults(eng)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True))
    tokens = [o.token_ids for o in outs]
    assert all(len(t) == NEW_TOKENS for t in tokens)
    seqs = [p + t for p, t in zip(prompts, tokens)]
    starts = [len(p) - 1 for p in prompts]
    runs = {
        "prefill + graph decode": prefill_logits(eng, seqs, decode_tail=NEW_TOKENS, use_graph=True),
        "chunked prefill + eager decode": prefill_logits(eng, seqs, chunk=64, decode_tail=NEW_TOKENS),
    }
    llm.shutdown()
    del llm, eng
    torch.cuda.empty_cache()
    return tokens, {mode: [x[s:] for x, s in zip(logits, starts)] for mode, logits in runs.items()}


def test_bf16_flashinfer_logits_and_greedy_against_hf_float32(checkpoint):
    name, path = checkpoint
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    tokens, ours = _our_logits(path, prompts)
    seqs = [p + t for p, t in zip(prompts, tokens)]
    starts = [len(p) - 1 for p in prompts]
    ref32 = hf_logits(path, seqs, starts, torch.float32)
    hf16 = hf_logits(path, seqs, starts, torch.bfloat16)
    for i, ref in enumerate(ref32):
        assert ref.shape[0] == NEW_TOKENS + 1  # the prompt's last position, then one row per decode step
        budget = 2 * relative_error(hf16[i], ref) + 2e-3
        for mode, logits in ours.items():
            err = relative_error(logits[i], ref)
            print(f"{name} len {len(prompts[i])} {mode}: {err:.2e} (budget {budget:.2e})")
            assert err <= budget, (name, len(prompts[i]), mode)
    # Greedy: the row before each generated token predicts it; the last row predicts nothing generated.
    ours_gap = torch.cat([argmax_gaps(r[:-1], torch.tensor(t)) for r, t in zip(ref32, tokens)])
    hf16_gap = torch.cat([argmax_gaps(r[:-1], h[:-1].argmax(dim=1)) for r, h in zip(ref32, hf16)])
    ours_agree, hf16_agree = float((ours_gap == 0).float().mean()), float((hf16_gap == 0).float().mean())
    print(f"{name} greedy = float32 argmax: ours {ours_agree:.3f} (worst gap {float(ours_gap.max()):.4f}), "
          f"HF bf16 {hf16_agree:.3f} (worst gap {float(hf16_gap.max()):.4f})")
    assert ours_agree > 0.5 and ours_agree >= hf16_agree - 0.1, name
    assert float(ours_gap.max()) <= max(0.03, 2 * float(hf16_gap.max())), name  # only near-ties may flip


def test_single_request_decode_on_the_fused_path_against_hf_float32(checkpoint):
    """One request decoded from a one-row CUDA graph: every layer as four fused GEMVs (models/gemv.py, with
    the tiles this width gets) around paged_decode.py, at the family's real width (Qwen2's biases, Qwen3's
    per-head q/k norms); its logits at each decode step against HF float32, within the same bf16 budget."""
    name, path = checkpoint
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(0, vocab, (300,), generator=gen).tolist()
    llm = LLM(str(path), overrides=OVERRIDES)
    eng = llm.engine
    assert_gpu_defaults(eng)
    assert eng.model.model.fused_gemv and 1 in eng.attn_backend.paged_graphs
    ours = prefill_logits(eng, [seq], decode_tail=NEW_TOKENS, use_graph=True)[0][-NEW_TOKENS:]
    llm.shutdown()
    del llm, eng
    torch.cuda.empty_cache()
    start = len(seq) - NEW_TOKENS
    ref = hf_logits(path, [seq], [start], torch.float32)[0]
    hf16 = hf_logits(path, [seq], [start], torch.bfloat16)[0]
    budget = 2 * relative_error(hf16, ref) + 2e-3
    err = relative_error(ours, ref)
    print(f"{name} one request, fused decode: {err:.2e} (budget {budget:.2e})")
    assert err <= budget, name
