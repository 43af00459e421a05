"""flashinfer paged attention (GPU), plus the Triton decode kernels for CUDA graphs.

An FP8 KV cache decodes batches on XQA where it runs (xqa_decode.py), else and for few requests with the Triton
kernel (it reads e4m3); prefill runs flashinfer's bf16 kernel on a copy of the batch's pages widened to the
model dtype (exact), made per layer: prefill is bound by its GEMMs, and the copy is a small share of a prefill
step."""

from __future__ import annotations

import logging

import numpy as np
import torch

from models.context import get_ctx
from runtime.batch import Batch
from runtime.engine.attention import paged_decode as pd
from runtime.engine.attention.kv_fp8 import widen_pages
from runtime.engine.attention.rope_store import rope_and_store
from runtime.engine.attention.xqa_decode import XqaDecode, unsupported_reason
from runtime.engine.kv_cache import KVCache
from runtime.utils import concat_ranges, host_to_device

log = logging.getLogger(__name__)

WORKSPACE_BYTES = 128 << 20
# flashinfer's tensor-core decode (fa2) from this batch up; the CUDA-core kernel exists only for these GQA groups.
TENSOR_CORE_DECODE_MIN_BATCH = 4
CUDA_CORE_GROUP_SIZES = (1, 2, 3, 4, 8)
# Decode graphs from this batch up run paged_decode.py; below it (none by default), flashinfer's decode.
PAGED_DECODE_MIN_BATCH = 1
# Deterministic mode's shortest paged_decode chunk, the same for every batch.
DETERMINISTIC_CHUNK_TOKENS = 1024
# An FP8 cache decodes on XQA from this batch (a graph's padded size) up; below it paged_decode is faster
# (scripts/bench_attention.py --fp8 --impls paged,xqa_engine --batch N).
XQA_MIN_BATCH = 32
# Graph-mode fa2 plans always split the KV, which can overflow the workspace: ``prepare`` disables the split.
PREFILL_BACKEND = "auto"


def paged_layout(kv_lens: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """flashinfer's paged-KV description of a batch: pages per request, indptr, last page length."""
    num_pages = (kv_lens + page_size - 1) // page_size
    indptr = np.concatenate(([0], np.cumsum(num_pages))).astype(np.int32)
    last_len = (kv_lens - (num_pages - 1) * page_size).astype(np.int32)
    return num_pages, indptr, last_len


def grown(held: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if held is not None and held.numel() >= numel:
        return held
    return torch.zeros(max(numel, 1), dtype=dtype, device=device)


class FlashInferBackend:
    supports_graphs = True

    def __init__(
        self, kv_cache: KVCache, page_table: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, deterministic: bool = False,
    ) -> None:
        from models.ops import import_flashinfer

        self.fi = import_flashinfer()
        self.kv_cache = kv_cache
        self.page_table = page_table
        self.device = page_table.device
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.dtype = dtype
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.cuda_cores_allowed = num_qo_heads // num_kv_heads in CUDA_CORE_GROUP_SIZES
        self.prefill = self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=PREFILL_BACKEND)
        self.decode = {tc: self._decode_wrapper(tc) for tc in (False, True)}
        self.graph_decode: dict[int, object] = {}
        self.graph_prefill: dict[int, object] = {}
        self._plan_done: dict[int, torch.cuda.Event] = {}
        self.active: object = None
        # Graphs never run at once, so they share buffers, grown when a size needs more.
        self.paged_graphs: dict[int, tuple[int, int, torch.Tensor, torch.Tensor]] = {}
        self.paged: tuple[int, int, torch.Tensor, torch.Tensor] | None = None
        self._paged_workspace: torch.Tensor | None = None
        self._paged_counters: torch.Tensor | None = None
        # Deterministic: every decode on paged_decode with one chunk size, and prefill never splits the KV.
        self.deterministic = deterministic
        self.kv_fp8 = kv_cache.fp8
        needs_paged = [key for key, on in (("cache.dtype=fp8_e4m3", self.kv_fp8),
                                           ("engine.deterministic=true", deterministic)) if on]
        if needs_paged:
            if not pd.supports(num_qo_heads, num_kv_heads, head_dim, dtype):
                raise ValueError(
                    f"{' and '.join(needs_paged)} {'decode' if len(needs_paged) > 1 else 'decodes'} with paged_decode, "
                    f"which needs Triton, a 16-bit model.dtype, a power-of-two head_dim >= 16 and at most 16 query "
                    f"heads per KV head (got {dtype}, head_dim {head_dim}, {num_qo_heads} query and {num_kv_heads} "
                    "KV heads)"
                )
            self.eager_paged = self._paged_state(page_table.shape[0], page_table.shape[1])
        if self.kv_fp8:
            self.staged_pages: torch.Tensor | None = None  # a prefill's pages, in flashinfer's order
            self.host_scales = kv_cache.scales.tolist()  # flashinfer takes the K and V scales as floats
        self.xqa = self._load_xqa() if self.kv_fp8 and not deterministic else None
        self.xqa_graphs: set[int] = set()
        self.decode_on_xqa = False

    def _load_xqa(self) -> XqaDecode | None:
        """XQA for this model's FP8 cache, built on first use (flashinfer's JIT cache) and run once here, so a
        kernel that cannot build or run falls back to paged_decode before any graph captures it."""
        hq, hkv, dim = self.heads
        reason = unsupported_reason(self.device, hq, hkv, dim, self.kv_cache.page_size, self.dtype)
        if reason is not None:
            log.info("FP8 KV cache: batches decode with paged_decode (%s)", reason)
            return None
        try:
            xqa = XqaDecode(self.page_table, self.page_table.shape[0], hkv, hq // hkv, dim)
            xqa.prepare(torch.zeros(1, dtype=torch.int64, device=self.device),
                        torch.zeros(1, dtype=torch.int64, device=self.device))
            xqa.attend(torch.zeros(1, hq, dim, dtype=self.dtype, device=self.device), self.kv_cache.k(0),
                       self.kv_cache.v(0), *self.host_scales[0])
            torch.cuda.synchronize(self.device)
        except Exception as exc:  # noqa: BLE001 - any failure to build or run means the exact kernel instead
            log.warning("FP8 KV cache: XQA is unavailable (%s: %s); batches decode with paged_decode, slower",
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return None
        return xqa

    def decode_uses_tensor_cores(self, batch_size: int) -> bool:
        return batch_size >= TENSOR_CORE_DECODE_MIN_BATCH or not self.cuda_cores_allowed

    def _decode_wrapper(self, tensor_cores: bool, **graph_buffers: torch.Tensor) -> object:
        graph = bool(graph_buffers)
        if not tensor_cores:
            return self.fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_cuda_graph=graph, **graph_buffers)
        return self.fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=True, backend="fa2", use_cuda_graph=graph, **graph_buffers
        )

    def _indices(self, batch: Batch, num_pages: np.ndarray) -> torch.Tensor:
        rows = np.repeat(batch.rows, num_pages)
        cols = concat_ranges(num_pages)
        idx = host_to_device(np.stack((rows, cols)).astype(np.int64), self.device)
        return self.page_table[idx[0], idx[1]]

    def _plan(self, wrapper: object, plan_call) -> None:  # noqa: ANN001
        event = self._plan_done.get(id(wrapper))
        if event is not None:
            # With overlap scheduling, plan N+1 must not overwrite the pinned staging copy before step N used it.
            event.synchronize()
        plan_call()
        event = event or torch.cuda.Event()
        event.record()
        self._plan_done[id(wrapper)] = event
        self.active = wrapper

    def prepare(self, batch: Batch, wrapper: object | None = None) -> None:
        self.paged = None
        self.decode_on_xqa = self.xqa is not None and batch.is_decode and batch.size >= XQA_MIN_BATCH
        if self.decode_on_xqa:
            self.active = None
            return
        if (self.deterministic or self.kv_fp8) and batch.is_decode:
            self.active, self.paged = None, self.eager_paged
            return
        hq, hkv, dim = self.heads
        page = self.kv_cache.page_size
        num_pages, indptr, last_len = paged_layout(batch.kv_lens, page)
        indices = self._indices(batch, num_pages)
        if self.kv_fp8:  # prefill reads a widened copy of these pages, numbered in order
            self.staged_pages = indices
            indices = torch.arange(indices.numel(), dtype=torch.int32, device=self.device)
        indptr_t, last_t = torch.from_numpy(indptr), torch.from_numpy(last_len)
        if batch.is_decode:
            wrapper = wrapper or self.decode[self.decode_uses_tensor_cores(batch.size)]
            self._plan(wrapper, lambda: wrapper.plan(
                indptr_t, indices, last_t, hq, hkv, dim, page, q_data_type=self.dtype, kv_data_type=self.dtype,
            ))
        else:
            qo_indptr = torch.from_numpy(np.concatenate(([0], np.cumsum(batch.ext_lens))).astype(np.int32))
            wrapper = wrapper or self.prefill
            # Graph mode: see PREFILL_BACKEND. Deterministic: a split would depend on the batch.
            no_split = wrapper is not self.prefill or self.deterministic
            self._plan(wrapper, lambda: wrapper.plan(
                qo_indptr, indptr_t, indices, last_t, hq, hkv, head_dim_qk=dim, page_size=page, causal=True,
                q_data_type=self.dtype, kv_data_type=self.dtype, disable_split_kv=no_split,
            ))

    def forward(self, q: torch.Tensor, kv: torch.Tensor, layer_id: int, cos_sin: torch.Tensor) -> torch.Tensor:
        batch = get_ctx().batch
        cache, scales = self.kv_cache.buffer[layer_id], self.kv_cache.scales[layer_id]
        if self.paged is not None:
            chunk, chunks, workspace, counters = self.paged
            return pd.paged_decode(q, kv, batch.positions, batch.req_rows, batch.out_loc, cos_sin, self.page_table,
                                   cache, workspace, counters, chunk, chunks, scales)
        if self.decode_on_xqa:
            if layer_id == 0:  # once a step: layers run in order, and a graph captures this with them
                self.xqa.prepare(batch.positions, batch.req_rows)
            rotated = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # XQA reads q dense
            rope_and_store(batch.positions, q, kv, cos_sin, self.kv_cache, layer_id, batch.out_loc, q_out=rotated)
            return self.xqa.attend(rotated, self.kv_cache.k(layer_id), self.kv_cache.v(layer_id),
                                   *self.host_scales[layer_id])
        rope_and_store(batch.positions, q, kv, cos_sin, self.kv_cache, layer_id, batch.out_loc)
        if self.kv_fp8:
            k_scale, v_scale = self.host_scales[layer_id]
            staged = widen_pages(cache, self.staged_pages, self.dtype)
            return self.active.run(q, (staged[0], staged[1]), k_scale=k_scale, v_scale=v_scale)
        return self.active.run(q, (self.kv_cache.k(layer_id), self.kv_cache.v(layer_id)))

    def init_graph(self, bs: int, max_pages_per_req: int) -> None:
        dev = self.device
        hq, hkv, dim = self.heads
        if self.deterministic:
            self.paged_graphs[bs] = self._paged_state(bs, max_pages_per_req)
            return
        if self.xqa is not None and bs >= XQA_MIN_BATCH:
            self.xqa_graphs.add(bs)
            return
        if bs >= PAGED_DECODE_MIN_BATCH and pd.supports(hq, hkv, dim, self.dtype):
            max_len = max_pages_per_req * self.kv_cache.page_size
            chunk = pd.chunk_tokens(bs, hkv)
            chunks = pd.num_chunks(max_len, chunk, bs * hkv)
            states = pd.workspace_size(bs, hkv, hq // hkv, dim, chunks)
            self._paged_workspace = grown(self._paged_workspace, states, torch.float32, dev)
            self._paged_counters = grown(self._paged_counters, bs * hkv, torch.int32, dev)
            self.paged_graphs[bs] = chunk, chunks, self._paged_workspace, self._paged_counters
            return
        self.graph_decode[bs] = self._decode_wrapper(
            self.decode_uses_tensor_cores(bs),
            paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buffer=torch.zeros(bs * max_pages_per_req, dtype=torch.int32, device=dev),
            paged_kv_last_page_len_buffer=torch.zeros(bs, dtype=torch.int32, device=dev),
        )

    def _paged_state(self, bs: int, max_pages_per_req: int) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        """paged_decode state independent of the batch: chunks of 1,024 tokens (past 32,768 tokens, a sequence's
        own length split over 32), so a token's summation order never depends on the other requests."""
        hq, hkv, dim = self.heads
        max_len = max_pages_per_req * self.kv_cache.page_size
        chunk = DETERMINISTIC_CHUNK_TOKENS
        chunks = pd.num_chunks(max_len, chunk)
        states = pd.workspace_size(bs, hkv, hq // hkv, dim, chunks)
        self._paged_workspace = grown(self._paged_workspace, states, torch.float32, self.device)
        self._paged_counters = grown(self._paged_counters, bs * hkv, torch.int32, self.device)
        return chunk, chunks, self._paged_workspace, self._paged_counters

    def init_prefill_graph(self, tokens: int, requests: int, max_pages_per_req: int) -> None:
        """A graph-mode prefill wrapper; its batch size and token count are fixed by the capture's plan."""
        dev = self.device
        self.graph_prefill[tokens] = self.fi.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, backend=PREFILL_BACKEND,
            qo_indptr_buf=torch.zeros(requests + 1, dtype=torch.int32, device=dev),
            paged_kv_indptr_buf=torch.zeros(requests + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buf=torch.zeros(requests * max_pages_per_req, dtype=torch.int32, device=dev),
            paged_kv_last_page_len_buf=torch.zeros(requests, dtype=torch.int32, device=dev),
        )

    def prepare_graph(self, batch: Batch) -> None:
        self.paged = None
        self.decode_on_xqa = batch.is_decode and batch.padded_size in self.xqa_graphs
        if self.decode_on_xqa:
            self.active = None
            return
        if not batch.is_decode:
            self.prepare(batch, self.graph_prefill[batch.padded_size])
            return
        paged = self.paged_graphs.get(batch.padded_size)
        if paged is not None:  # the Triton kernel needs no host plan
            self.active, self.paged = None, paged
            return
        self.prepare(batch, self.graph_decode[batch.padded_size])
