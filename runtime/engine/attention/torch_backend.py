"""Reference paged attention in plain PyTorch: exact, not fast."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from models.context import get_ctx
from models.ops import rope_torch
from runtime.batch import Batch
from runtime.engine.kv_cache import KVCache
from runtime.utils import host_to_device


@dataclass
class TorchAttnMeta:
    kv_slots: torch.Tensor
    mask: torch.Tensor
    q_index: torch.Tensor
    out_index: torch.Tensor
    token_request: np.ndarray | None = None
    token_kv_len: np.ndarray | None = None
    request_kv_len: list[int] | None = None  # keys each request's last token attends to


class TorchAttentionBackend:
    supports_graphs = False  # its metadata is rebuilt by host work every step

    def __init__(self, kv_cache: KVCache, page_table: torch.Tensor, head_dim: int, deterministic: bool = False) -> None:
        self.deterministic = deterministic
        self.kv_cache = kv_cache
        self.page_table = page_table
        self.scale = head_dim**-0.5
        self.meta: TorchAttnMeta | None = None

    def prepare(self, batch: Batch) -> None:
        device = self.page_table.device
        page = self.kv_cache.page_size
        q_lens, kv_lens = batch.ext_lens, batch.kv_lens
        n, max_q, max_kv = batch.size, int(q_lens.max()), int(kv_lens.max())
        cu_q = np.concatenate(([0], np.cumsum(q_lens)))
        i = np.arange(max_q)
        q_valid = i[None, :] < q_lens[:, None]
        q_index = np.where(q_valid, cu_q[:-1, None] + i[None, :], cu_q[-1])
        out_index = (np.arange(n)[:, None] * max_q + i[None, :])[q_valid]
        host = np.concatenate((q_index.ravel(), out_index, batch.rows, batch.starts, q_lens, kv_lens)).astype(np.int64)
        dev = host_to_device(host, device)
        sizes = [n * max_q, len(out_index), n, n, n, n]
        q_index_d, out_index_d, rows, starts, q_lens_d, kv_lens_d = dev.split(sizes)
        j = torch.arange(max_kv, device=device)
        slots = self.page_table[rows][:, j // page].long() * page + j % page
        key_ok = j[None, :] < kv_lens_d[:, None]
        query_pos = starts[:, None] + torch.arange(max_q, device=device)[None, :]
        causal = j[None, None, :] <= query_pos[:, :, None]
        q_ok = torch.arange(max_q, device=device)[None, :] < q_lens_d[:, None]
        # Padded query rows attend to key 0 only so softmax stays finite; their output is dropped.
        mask = (causal & key_ok[:, None, :]) | (~q_ok[:, :, None] & (j == 0)[None, None, :])
        self.meta = TorchAttnMeta(slots, mask[:, None], q_index_d.view(n, max_q), out_index_d)
        if self.deterministic:
            self.meta.token_request = np.repeat(np.arange(n), q_lens)
            self.meta.token_kv_len = np.concatenate([np.arange(s, s + e) for s, e in zip(batch.starts, q_lens)]) + 1
            self.meta.request_kv_len = kv_lens.tolist()
        batch.attn_meta = self.meta

    def forward(self, q: torch.Tensor, kv: torch.Tensor, layer_id: int, cos_sin: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        batch = get_ctx().batch
        rope_torch(batch.positions, q, kv[:, 0], cos_sin)
        self.kv_cache.store(layer_id, batch.out_loc, kv)
        heads, dim = q.shape[1:]
        if self.deterministic:
            return self._per_token(q, layer_id)
        q_pad = torch.cat((q, q.new_zeros(1, heads, dim)))[meta.q_index]
        keys = self.kv_cache.read(layer_id, 0, meta.kv_slots, q.dtype)
        values = self.kv_cache.read(layer_id, 1, meta.kv_slots, q.dtype)
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=meta.mask, scale=self.scale, enable_gqa=True,
        )
        return out.transpose(1, 2).reshape(-1, heads, dim)[meta.out_index]

    def _per_token(self, q: torch.Tensor, layer_id: int) -> torch.Tensor:
        """One SDPA call a token over exactly its own keys: BLAS splits work by shape. A request's keys are read
        once a layer and each of its tokens takes a prefix of them (a view laid out as its own read would be):
        reading them per token made a long prompt's prefill quadratic in copies."""
        meta = self.meta
        out = torch.empty_like(q)
        read_for = -1
        for token, (request, length) in enumerate(zip(meta.token_request.tolist(), meta.token_kv_len.tolist())):
            if request != read_for:  # a request's tokens are adjacent
                slots = meta.kv_slots[request, : meta.request_kv_len[request]]
                all_keys, all_values = (self.kv_cache.read(layer_id, plane, slots, q.dtype) for plane in (0, 1))
                read_for = request
            keys, values = all_keys[:length], all_values[:length]
            out[token] = F.scaled_dot_product_attention(
                q[token, :, None], keys.transpose(0, 1), values.transpose(0, 1), scale=self.scale, enable_gqa=True,
            )[:, 0]
        return out

    def init_graph(self, bs: int, max_pages_per_req: int) -> None:
        raise NotImplementedError("the torch attention backend does not serve CUDA graphs")

    def prepare_graph(self, batch: Batch) -> None:
        raise NotImplementedError("the torch attention backend does not serve CUDA graphs")
