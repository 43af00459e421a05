"""CUDA graphs for decode and prefill steps. Batches are padded to a captured size on the dummy row and page; a
prefill also to the graph's fixed request count, which flashinfer's graph-mode prefill plan needs."""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np
import torch

from runtime.batch import Batch
from runtime.engine.decode_inputs import gather_into


def graph_batch_sizes(max_bs: int) -> list[int]:
    return [bs for bs in [1, 2, 4, *range(8, max_bs + 1, 8)] if bs <= max_bs]


# Fine-grained prefill graphs up to here: small steps are host-bound when eager.
FINE_PREFILL_TOKENS = 2048


def prefill_graph_sizes(max_tokens: int) -> list[int]:
    if max_tokens <= 0:
        return []
    fine = range(256, FINE_PREFILL_TOKENS + 1, 256)
    coarse = range((fine[-1] // 1024 + 1) * 1024 if fine else 1024, max_tokens, 1024)
    return [t for t in (*fine, *coarse) if t < max_tokens] + [max_tokens]


def prefill_graph_size(sizes: list[int], tokens: int) -> int | None:
    """The smallest captured size that holds ``tokens``, or None where padding would waste more than it saves."""
    size = next((t for t in sizes if t >= tokens), None)
    if size is None or size - tokens > max(256, size // 16):
        return None
    return size


class GraphRunner:
    def __init__(self, engine, max_bs: int, prefill_tokens: int = 0) -> None:  # noqa: ANN001 - Engine
        # A weak reference: no cycle, so a dropped engine's graphs are freed at once by reference counting,
        # never later by the cyclic GC, which may run while another engine is capturing.
        self.engine = weakref.proxy(engine)
        self.bs_list = graph_batch_sizes(max_bs)
        self.max_bs = self.bs_list[-1]
        self.prefill_sizes = prefill_graph_sizes(prefill_tokens)
        self.max_running = engine.max_running
        tokens = max([self.max_bs, *self.prefill_sizes])
        dev = engine.device
        self.input_ids = torch.zeros(tokens, dtype=torch.int32, device=dev)
        self.out_loc = torch.zeros(tokens, dtype=torch.int64, device=dev)
        # Rows in [:n], positions in [n:2 * n]: the upload's layout.
        self.rows_pos = torch.zeros(2 * tokens, dtype=torch.int64, device=dev)
        logit_rows = max(self.max_bs, self.requests(self.prefill_sizes[-1], False) if self.prefill_sizes else 0)
        self.logits_idx = torch.zeros(logit_rows, dtype=torch.int64, device=dev)
        # Model dtype: a float32 buffer would cost a conversion pass over [batch, vocab] every step.
        self.logits = torch.zeros(logit_rows, engine.model_config.vocab_size, dtype=engine.dtype, device=dev)
        self.graphs: dict[tuple[bool, int], torch.cuda.CUDAGraph] = {}
        self._capture_all()

    def graph_size(self, batch: Batch, extra_logit_rows: int = 0) -> int | None:
        """The captured size ``batch`` replays, or None to run it eagerly."""
        if extra_logit_rows:
            return None
        if batch.is_decode:
            return next((bs for bs in self.bs_list if bs >= batch.size), None)
        return prefill_graph_size(self.prefill_sizes, batch.num_tokens)

    def requests(self, size: int, decode: bool) -> int:
        return size if decode else min(self.max_running, size)

    def pad(self, batch: Batch, size: int) -> Batch:
        decode = batch.is_decode
        extra = self.requests(size, decode) - batch.size
        dummy = self.engine.dummy_row
        padded = dataclasses.replace(
            batch,
            rows=np.concatenate((batch.rows, np.full(extra, dummy, np.int32))),
            starts=np.concatenate((batch.starts, np.full(extra, int(not decode), np.int32))),
            ext_lens=np.concatenate((batch.ext_lens, np.full(extra, int(decode), np.int32))),
            sample_rows=np.concatenate((batch.sample_rows, np.full(extra, dummy, np.int32))),
        )
        padded.padded_size = size
        return padded

    def _dummy_batch(self, size: int, decode: bool) -> Batch:
        """Dummy requests to warm up and capture on; a prefill's tokens spread evenly, as the attention plan sees."""
        e = self.engine
        reqs = self.requests(size, decode)
        ext = np.full(reqs, size // reqs, np.int32)
        ext[: size % reqs] += 1
        zeros = np.zeros(reqs, np.int32)
        batch = Batch(
            phase="decode" if decode else "prefill", rows=np.full(reqs, e.dummy_row, np.int32), starts=zeros,
            ext_lens=ext, sample_rows=np.full(reqs, e.dummy_row, np.int32), temperature=np.zeros(reqs, np.float32),
            top_k=zeros, top_p=np.ones(reqs, np.float32), seeds=np.zeros(reqs, np.int64),
        )
        batch.padded_size = size
        batch.input_ids, batch.out_loc = self.input_ids[:size], self.out_loc[:size]
        rows, batch.positions = self.rows_pos[:size].fill_(e.dummy_row), self.rows_pos[size:2 * size].zero_()
        if decode:
            batch.req_rows = rows
        else:
            batch.logits_indices = self.logits_idx[:reqs].zero_()
        return batch

    def _step(self, size: int, decode: bool) -> None:
        e = self.engine
        gather_into(e.token_pool, e.page_table, self.rows_pos[:2 * size], e.page_size, self.input_ids[:size],
                    self.out_loc[:size])
        self.logits[: self.requests(size, decode)] = e.model.forward()

    def _capture_all(self) -> None:
        e = self.engine
        pool = None
        # Prefill first: the largest activations, which every later graph's allocations then reuse.
        shapes = [(False, t) for t in reversed(self.prefill_sizes)] + [(True, bs) for bs in reversed(self.bs_list)]
        for decode, size in shapes:
            if decode:
                e.attn_backend.init_graph(size, e.max_pages_per_req)
            else:
                e.attn_backend.init_prefill_graph(size, self.requests(size, False), e.max_pages_per_req)
            batch = self._dummy_batch(size, decode)
            e.attn_backend.prepare_graph(batch)
            with e.ctx.forward_batch(batch):
                self._step(size, decode)  # warm-up
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=e.stream):
                    self._step(size, decode)
            if pool is None:
                pool = graph.pool()
            self.graphs[decode, size] = graph
        torch.cuda.synchronize(e.device)

    def close(self) -> None:
        """Destroy every captured graph now, releasing NCCL's hold on its communicator."""
        torch.cuda.synchronize(self.engine.device)
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def replay(self, batch: Batch, rows_pos: torch.Tensor) -> torch.Tensor:
        size = batch.padded_size
        self.rows_pos[:2 * size].copy_(rows_pos)
        rows = self.requests(size, batch.is_decode)
        if not batch.is_decode:
            self.logits_idx[:rows].copy_(batch.logits_indices)
        self.engine.attn_backend.prepare_graph(batch)
        self.graphs[batch.is_decode, size].replay()
        return self.logits[:rows]
