"""Test helpers: drive the engine directly for teacher-forced logits; watch a running job's output."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from models import fp8
from models.config import ModelConfig
from runtime.batch import Batch
from runtime.config import load_config
from runtime.engine import Engine
from runtime.scheduler.pages import PageAllocator


def make_engine(model_dir: Path, *overrides: str) -> Engine:
    cfg = load_config(overrides=["engine.device=cpu", "model.dtype=float32", "scheduler.max_running_requests=8",
                                 "model.max_seq_len=1024", *overrides])
    return Engine(cfg, model_dir, ModelConfig.from_dir(model_dir))


def prefill_logits(
    engine: Engine, prompts: list[list[int]], chunk: int | None = None, decode_tail: int = 0, use_graph: bool = False
) -> list[torch.Tensor]:
    """Logits at every position of each prompt, computed through the paged cache.

    With ``chunk``, each prompt is fed ``chunk`` tokens per step, so later chunks
    attend to KV written by earlier steps; the last ``decode_tail`` tokens of
    every prompt go through decode steps (one token per request per step).
    """
    out: list[torch.Tensor] = []
    group = engine.max_running  # one page-table row per prompt
    with engine._stream(), torch.no_grad():
        for i in range(0, len(prompts), group):
            out += _teacher_forced(engine, prompts[i : i + group], chunk, decode_tail, use_graph)
    if engine.stream is not None:
        torch.cuda.synchronize()
    return out


def _teacher_forced(
    engine: Engine, prompts: list[list[int]], chunk: int | None, decode_tail: int, use_graph: bool
) -> list[torch.Tensor]:
    allocator = PageAllocator(engine.num_pages)
    page = engine.page_size
    rows = np.arange(len(prompts), dtype=np.int32)
    pages = [allocator.alloc(-(-len(p) // page)) for p in prompts]
    lens = np.array([len(p) for p in prompts], np.int32)
    step = chunk or int(lens.max())
    out: list[list[torch.Tensor]] = [[] for _ in prompts]
    start = np.zeros(len(prompts), np.int32)
    first = True
    while (start < lens).any():
        live = np.flatnonzero(start < lens)
        decoding = bool((start[live] >= lens[live] - decode_tail).all()) and not first
        ext = np.minimum(lens[live] - start[live], 1 if decoding else step).astype(np.int32)
        if not decoding and decode_tail:
            ext = np.minimum(ext, np.maximum(lens[live] - decode_tail - start[live], 1)).astype(np.int32)
        n = len(live)
        batch = Batch(
            phase="decode" if decoding else "prefill", rows=rows[live], starts=start[live].copy(), ext_lens=ext,
            sample_rows=np.full(n, engine.dummy_row, np.int32), temperature=np.zeros(n, np.float32),
            top_k=np.zeros(n, np.int32), top_p=np.ones(n, np.float32), seeds=np.zeros(n, np.int64),
        )
        if first:
            batch.admit_rows = rows
            batch.admit_token_lens = lens
            batch.admit_tokens = np.concatenate([np.asarray(p, np.int32) for p in prompts])
            batch.admit_page_lens = np.array([len(p) for p in pages], np.int32)
            batch.admit_pages = np.concatenate([np.asarray(p, np.int32) for p in pages])
            first = False
        if decoding and use_graph:
            run = engine.graph_runner.pad(batch, engine.graph_runner.graph_size(batch))
            rows_pos = engine._prepare_inputs(run, graph=True)[2]
            with engine.ctx.forward_batch(run):
                logits = engine.graph_runner.replay(run, rows_pos)[:n].clone().float()
        else:
            engine._prepare_inputs(batch)
            batch.logits_indices = None  # every position, not only the last
            engine.attn_backend.prepare(batch)
            with engine.ctx.forward_batch(batch):
                logits = engine.model.forward().float()
        for i, part in zip(live, logits.split(ext.tolist())):
            out[i].append(part)
        start[live] += ext
    return [torch.cat(parts) for parts in out]


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.double() - ref.double()).abs().max() / ref.double().abs().max())


def assert_same_quantization(got: fp8.QuantizedRows, values: torch.Tensor, scale: torch.Tensor,
                             exact_share: float, scale_rtol: float) -> None:
    """The scales equal within ``scale_rtol``; the values equal but for a share of ties one e4m3 step apart (a
    rounding of the model-dtype activation can differ where another kernel computes an exp or sums in another
    order)."""
    assert got.values.dtype == fp8.FP8 and got.scale.dtype == torch.float32
    torch.testing.assert_close(got.scale, scale, rtol=scale_rtol, atol=0)
    a, b = got.values.float(), values.float()
    assert float((a == b).float().mean()) >= exact_share
    assert torch.all((a - b).abs() <= b.abs() * 2**-3 + 2**-9)


def rows_written(out: Path) -> int:
    """Distinct ids in the output and the part files: a run killed between merging a part file into the
    output and deleting it leaves those rows in both."""
    ids = set()
    for f in [out, *out.parent.glob(out.name + ".part-*")]:
        try:
            data = f.read_bytes()
        except FileNotFoundError:  # not written yet, or a part file just merged away
            continue
        for line in data.splitlines(keepends=True):
            if line.endswith(b"\n"):  # a complete line (the last one may be mid-write)
                ids.add(json.loads(line)["id"])
    return len(ids)


def wait_for_rows(proc: subprocess.Popen, out: Path, n: int) -> None:
    """Until ``n`` rows of a running job are on disk; fails if the job ends first (or after 10 minutes)."""
    deadline = time.time() + 600
    while rows_written(out) < n:
        assert proc.poll() is None and time.time() < deadline, "the job ended before it could be interrupted"
        time.sleep(0.05)
