"""CUDA graphs for decode and prefill steps (the GraphRunner of ARCHITECTURE.md).

Decode batch sizes ``[1, 2, 4, 8, 16, 24, ...]`` up to a maximum, and prefill token counts ``[256, 512, ...,
2048, 3072, 4096, ...]`` up to a maximum, are captured largest first into one shared memory pool, each after
a warm-up run. Inputs live in static buffers and logits in one preallocated buffer (model dtype). A decode batch is
padded to the next captured size with dummy requests on the reserved dummy row/page. A prefill step is
padded with dummy tokens (which read and write the dummy page only), and with dummy requests that compute
nothing (one cached token on the dummy page each) up to the graph's fixed request count (flashinfer's
prefill plan in graph mode needs a fixed batch size). A replay copies in only the rows and positions of the
tokens (and, for prefill, each request's last-token index); the graph gathers its token ids and cache slots
from the device pools itself (``runtime.engine.decode_inputs``).
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


# Prefill graphs every 256 tokens up to here, every 1024 above: a small step (the last chunk of a prefill,
# a few new prompts) then always fits a graph with at most 255 dummy tokens. Eagerly, the 1,438-token last
# step of SmolLM2's benchmark prefill took 19-29 ms of host-bound GPU time; in its 1,536-token graph, 2.2 ms.
FINE_PREFILL_TOKENS = 2048


def prefill_graph_sizes(max_tokens: int) -> list[int]:
    """Token counts of the captured prefill graphs: every multiple of 256 up to FINE_PREFILL_TOKENS, every
    multiple of 1024 above it, below ``max_tokens``, and ``max_tokens`` itself (a full chunked-prefill step);
    none for 0."""
    if max_tokens <= 0:
        return []
    fine = range(256, FINE_PREFILL_TOKENS + 1, 256)
    coarse = range((fine[-1] // 1024 + 1) * 1024 if fine else 1024, max_tokens, 1024)
    return [t for t in (*fine, *coarse) if t < max_tokens] + [max_tokens]


def prefill_graph_size(sizes: list[int], tokens: int) -> int | None:
    """The captured size a prefill step of ``tokens`` replays: the smallest that holds it, unless its dummy
    tokens would add more than max(256, size / 16) (GPU work wasted where the GPU, not the host, is the
    bound); None: the step runs eagerly."""
    size = next((t for t in sizes if t >= tokens), None)
    if size is None or size - tokens > max(256, size // 16):
        return None
    return size


class GraphRunner:
    def __init__(self, engine, max_bs: int, prefill_tokens: int = 0) -> None:  # noqa: ANN001 - Engine
        # A weak reference: no Engine <-> GraphRunner cycle, so a dropped engine's graphs are destroyed at
        # once by reference counting, never later by the cyclic GC (which may run while another engine
        # is capturing).
        self.engine = weakref.proxy(engine)
        self.bs_list = graph_batch_sizes(max_bs)
        self.max_bs = self.bs_list[-1]
        self.prefill_sizes = prefill_graph_sizes(prefill_tokens)
        self.max_running = engine.max_running
        tokens = max([self.max_bs, *self.prefill_sizes])
        dev = engine.device
        self.input_ids = torch.zeros(tokens, dtype=torch.int32, device=dev)
        self.out_loc = torch.zeros(tokens, dtype=torch.int64, device=dev)
        # The graph of n tokens reads rows from [:n] and positions from [n:2 * n] (the upload's layout).
        self.rows_pos = torch.zeros(2 * tokens, dtype=torch.int64, device=dev)
        logit_rows = max(self.max_bs, self.requests(self.prefill_sizes[-1], False) if self.prefill_sizes else 0)
        self.logits_idx = torch.zeros(logit_rows, dtype=torch.int64, device=dev)  # prefill: each request's last token
        # In the model's dtype: consumers upcast where they need to (sampling, logprobs), and a float32 buffer
        # would cost a conversion pass over [batch, vocab] every step.
        self.logits = torch.zeros(logit_rows, engine.model_config.vocab_size, dtype=engine.dtype, device=dev)
        self.graphs: dict[tuple[bool, int], torch.cuda.CUDAGraph] = {}  # (is decode, size)
        self._capture_all()

    def graph_size(self, batch: Batch, extra_logit_rows: int = 0) -> int | None:
        """The captured size ``batch`` replays (decode: requests, prefill: tokens), or None to run it eagerly.
        ``extra_logit_rows`` (prompt logprobs: the LM head at more than each request's last token) rules
        graphs out."""
        if extra_logit_rows:
            return None
        if batch.is_decode:
            return next((bs for bs in self.bs_list if bs >= batch.size), None)
        return prefill_graph_size(self.prefill_sizes, batch.num_tokens)

    def requests(self, size: int, decode: bool) -> int:
        """Requests (and logits rows) of the graph of ``size``: a decode graph's size is its request count; a
        prefill graph plans for the most a step can hold, one request per row and per token."""
        return size if decode else min(self.max_running, size)

    def pad(self, batch: Batch, size: int) -> Batch:
        """The batch padded to a captured size with dummy requests on the dummy row, each with one token on
        the dummy page: decode, to ``size`` requests computing that token; prefill, to the graph's request
        count, with it cached and nothing computed (the engine pads the tokens themselves to ``size``)."""
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
        """What a graph is warmed up and captured on: dummy requests on the dummy row, every token at 0 (a
        prefill's tokens spread evenly over its requests, which the attention plan sees)."""
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
        # The graph's inputs are its static buffers.
        batch.input_ids, batch.out_loc = self.input_ids[:size], self.out_loc[:size]
        rows, batch.positions = self.rows_pos[:size].fill_(e.dummy_row), self.rows_pos[size:2 * size].zero_()
        if decode:
            batch.req_rows = rows
        else:
            batch.logits_indices = self.logits_idx[:reqs].zero_()
        return batch

    def _step(self, size: int, decode: bool) -> None:
        """What a graph runs: gather the inputs of the rows and positions copied in, the model."""
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
                self._step(size, decode)  # warm-up: lazy allocations and kernel loads
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=e.stream):
                    self._step(size, decode)
            if pool is None:
                pool = graph.pool()
            self.graphs[decode, size] = graph
        torch.cuda.synchronize(e.device)

    def close(self) -> None:
        """Destroy every captured graph now (and with it NCCL's hold on its communicator)."""
        torch.cuda.synchronize(self.engine.device)
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def replay(self, batch: Batch, rows_pos: torch.Tensor) -> torch.Tensor:
        """Run a padded batch; ``rows_pos``: its tokens' page-table rows, then their positions (int64, on the
        device, from the engine's upload); a prefill's ``logits_indices`` too. Returns its logits."""
        size = batch.padded_size
        self.rows_pos[:2 * size].copy_(rows_pos)
        rows = self.requests(size, batch.is_decode)
        if not batch.is_decode:
            self.logits_idx[:rows].copy_(batch.logits_indices)
        self.engine.attn_backend.prepare_graph(batch)
        self.graphs[batch.is_decode, size].replay()
        return self.logits[:rows]
