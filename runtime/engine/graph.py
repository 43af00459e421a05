"""CUDA graphs for decode steps (the GraphRunner of ARCHITECTURE.md).

Batch sizes ``[1, 2, 4, 8, 16, 24, ...]`` up to a maximum are captured largest
first into one shared memory pool, each after a warm-up run. Inputs live in
static buffers and logits in one preallocated buffer (model dtype); a live batch is padded to
the next captured size with dummy requests on the reserved dummy row/page. A replay copies in
only the rows and positions; the graph gathers its token ids and cache slots from the device
pools itself (``runtime.engine.decode_inputs``).
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np
import torch

from runtime.batch import Batch
from runtime.engine.decode_inputs import gather_into


def graph_batch_sizes(max_bs: int) -> list[int]:
    return [bs for bs in [1, 2, 4, *range(8, max_bs + 1, 8)] if bs <= max_bs]


class GraphRunner:
    def __init__(self, engine, max_bs: int) -> None:  # noqa: ANN001 - Engine, avoids an import cycle
        # A weak reference: no Engine <-> GraphRunner cycle, so a dropped engine's graphs are destroyed at
        # once by reference counting, never later by the cyclic GC (which may run while another engine
        # is capturing).
        self.engine = weakref.proxy(engine)
        self.bs_list = graph_batch_sizes(max_bs)
        self.max_bs = self.bs_list[-1]
        dev = engine.device
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int32, device=dev)
        self.out_loc = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        # The graph of size bs reads rows from [:bs] and positions from [bs:2 * bs] (the upload's layout).
        self.rows_pos = torch.zeros(2 * self.max_bs, dtype=torch.int64, device=dev)
        # In the model's dtype: consumers upcast where they need to (sampling, logprobs), and a float32 buffer
        # would cost a conversion pass over [batch, vocab] every step.
        self.logits = torch.zeros(self.max_bs, engine.model_config.vocab_size, dtype=engine.dtype, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture_all()

    def can_use(self, batch: Batch) -> bool:
        return batch.is_decode and batch.size <= self.max_bs

    def pad(self, batch: Batch) -> Batch:
        """The batch padded to the next captured size with dummy requests (row = dummy row, length 1)."""
        size = next(bs for bs in self.bs_list if bs >= batch.size)
        extra = size - batch.size
        padded = dataclasses.replace(
            batch,
            rows=np.concatenate((batch.rows, np.full(extra, self.engine.dummy_row, np.int32))),
            starts=np.concatenate((batch.starts, np.zeros(extra, np.int32))),
            ext_lens=np.concatenate((batch.ext_lens, np.ones(extra, np.int32))),
            sample_rows=np.concatenate((batch.sample_rows, np.full(extra, self.engine.dummy_row, np.int32))),
        )
        padded.padded_size = size
        return padded

    def _dummy_batch(self, bs: int) -> Batch:
        e = self.engine
        zeros = np.zeros(bs, np.int32)
        batch = Batch(
            phase="decode", rows=np.full(bs, e.dummy_row, np.int32), starts=zeros, ext_lens=zeros + 1,
            sample_rows=np.full(bs, e.dummy_row, np.int32), temperature=np.zeros(bs, np.float32),
            top_k=zeros, top_p=np.ones(bs, np.float32), seeds=np.zeros(bs, np.int64), seeded=np.zeros(bs, bool),
        )
        batch.padded_size = bs
        # The graph's inputs are its static buffers; the warm-up and the capture run on dummy requests at 0.
        batch.input_ids, batch.out_loc = self.input_ids[:bs], self.out_loc[:bs]
        batch.req_rows, batch.positions = self.rows_pos[:bs].fill_(e.dummy_row), self.rows_pos[bs:2 * bs].zero_()
        return batch

    def _step(self, bs: int) -> None:
        """What a graph of size bs runs: gather the inputs of the rows and positions copied in, the model."""
        e = self.engine
        gather_into(e.token_pool, e.page_table, self.rows_pos[:2 * bs], e.page_size, self.input_ids[:bs],
                    self.out_loc[:bs])
        self.logits[:bs] = e.model.forward()

    def _capture_all(self) -> None:
        e = self.engine
        pool = None
        for bs in sorted(self.bs_list, reverse=True):
            e.attn_backend.init_graph(bs, e.max_pages_per_req)
            batch = self._dummy_batch(bs)
            e.attn_backend.prepare_graph(batch)
            with e.ctx.forward_batch(batch):
                self._step(bs)  # warm-up: lazy allocations and kernel loads
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=e.stream):
                    self._step(bs)
            if pool is None:
                pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(e.device)

    def close(self) -> None:
        """Destroy every captured graph now (and with it NCCL's hold on its communicator)."""
        torch.cuda.synchronize(self.engine.device)
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def replay(self, batch: Batch, rows_pos: torch.Tensor) -> torch.Tensor:
        """Run a padded decode batch; ``rows_pos``: its page-table rows, then its positions (int64, on the
        device, from the engine's upload). Returns its logits."""
        bs = batch.padded_size
        self.rows_pos[:2 * bs].copy_(rows_pos)
        self.engine.attn_backend.prepare_graph(batch)
        self.graphs[bs].replay()
        return self.logits[:bs]
