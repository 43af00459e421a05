"""Run under torchrun by tests/test_gpu_tp.py: one rank's view of a TP job on GPUs.

    torchrun --nproc-per-node N tests/gpu_tp_probe.py MODEL_DIR OUT_DIR [key=value ...]

Every rank: teacher-forced logits (prefill, chunked prefill, decode through the CUDA
graphs) computed in lockstep, then a scheduler run (rank 0 schedules, the others
follow) with CUDA graphs, overlap and ``parallel.check_tokens`` on, greedy, seeded
and unseeded sampling, recording the tokens this rank sampled at every step.
Writes ``OUT_DIR/rank{R}.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.config import ModelConfig  # noqa: E402
from parallel.distributed import init_distributed, shutdown_distributed  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402
from runtime.config import load_config  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.worker import worker_loop  # noqa: E402
from tests.helpers import prefill_logits  # noqa: E402

OVERRIDES = ["engine.device=cuda", "model.max_seq_len=1024", "cache.num_pages=2048", "scheduler.max_running_requests=32",
             "engine.cuda_graph_max_bs=32", "scheduler.overlap=true", "parallel.check_tokens=true"]
KEEP = 8  # logits of the last positions of each prompt that are saved


def probe_prompts() -> tuple[list[list[int]], list[list[int]]]:
    gen = torch.Generator().manual_seed(0)
    logit_prompts = [torch.randint(0, 10000, (n,), generator=gen).tolist() for n in (7, 100, 513)]
    gen_prompts = [torch.randint(0, 10000, (int(torch.randint(5, 200, (1,), generator=gen)),), generator=gen).tolist()
                   for _ in range(24)]
    return logit_prompts, gen_prompts


def sampling_params() -> list[SamplingParams]:
    greedy = [SamplingParams(temperature=0, max_new_tokens=48, ignore_eos=True) for _ in range(8)]
    seeded = [SamplingParams(temperature=0.8, top_k=50, seed=i, max_new_tokens=32, ignore_eos=True) for i in range(8)]
    unseeded = [SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=32, ignore_eos=True) for _ in range(8)]
    return greedy + seeded + unseeded


def main() -> int:
    model_dir, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    tp = init_distributed(use_cuda=True, timeout_s=300)
    cfg = load_config(overrides=[*OVERRIDES, f"model.path={model_dir}", *sys.argv[3:]])
    logit_prompts, gen_prompts = probe_prompts()
    engine = Engine(cfg, model_dir, ModelConfig.from_dir(model_dir))
    result: dict = {"tp": tp.size}
    with torch.no_grad():  # every rank runs the same teacher-forced steps, so the collectives line up
        result["prefill"] = [x[-KEEP:].cpu() for x in prefill_logits(engine, logit_prompts)]
        result["chunked"] = [x[-KEEP:].cpu() for x in prefill_logits(engine, logit_prompts, chunk=64, decode_tail=KEEP)]
        result["graph_decode"] = [x[-KEEP:].cpu() for x in prefill_logits(
            engine, logit_prompts, decode_tail=KEEP, use_graph=True)]
    engine.close()
    del engine
    steps: list[torch.Tensor] = []

    def record(engine: Engine, out) -> None:  # noqa: ANN001
        with torch.cuda.stream(engine.stream):  # a device-side copy: no sync, overlap stays as it is
            steps.append(out.next_tokens_gpu.clone())

    if tp.rank == 0:
        llm = LLM(config=cfg)
        forward = llm.engine.forward_batch

        def recorded(batch):  # noqa: ANN001, ANN202
            out = forward(batch)
            record(llm.engine, out)
            return out

        llm.engine.forward_batch = recorded
        outs = llm.generate(gen_prompts, sampling_params())
        torch.cuda.synchronize()
        llm.shutdown()
        result["outputs"] = [o.token_ids for o in outs]
        result["prompts"] = gen_prompts
        result["logit_prompts"] = logit_prompts
    else:
        engine = Engine(cfg, model_dir, ModelConfig.from_dir(model_dir))
        worker_loop(engine, on_output=lambda batch, out: record(engine, out))
        torch.cuda.synchronize()
        engine.close()
    result["steps"] = [s.tolist() for s in steps]
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(result, out_dir / f"rank{tp.rank}.pt")
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
