"""A decode step's token ids and cache slots, gathered from the device pools so the host never waits for the
previous step's tokens; CUDA graphs gather inside the graph."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs have no CUDA graphs
    triton = None


def gather_torch(
    token_pool: torch.Tensor, page_table: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, page: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, int64 cache slots) of the tokens at (``rows``, ``pos``)."""
    slots = page_table[rows, pos // page].long() * page + pos % page
    return token_pool[rows, pos], slots


if triton is not None:

    @triton.jit
    def _gather(
        rows_pos_ptr, pool_ptr, pool_stride, table_ptr, table_stride, ids_ptr, slots_ptr, bs,
        BLOCK: tl.constexpr, PAGE: tl.constexpr,
    ):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < bs
        row = tl.load(rows_pos_ptr + i, mask=ok, other=0)
        pos = tl.load(rows_pos_ptr + bs + i, mask=ok, other=0)
        tl.store(ids_ptr + i, tl.load(pool_ptr + row * pool_stride + pos, mask=ok), mask=ok)
        page = tl.load(table_ptr + row * table_stride + pos // PAGE, mask=ok).to(tl.int64)
        tl.store(slots_ptr + i, page * PAGE + pos % PAGE, mask=ok)


def gather_into(
    token_pool: torch.Tensor, page_table: torch.Tensor, rows_pos: torch.Tensor, page: int,
    ids: torch.Tensor, slots: torch.Tensor,
) -> None:
    """``gather_torch`` into ``ids`` and ``slots``; ``rows_pos``: the rows, then the positions."""
    bs = ids.shape[0]
    if rows_pos.shape != (2 * bs,) or slots.shape != (bs,):
        raise ValueError(f"rows_pos must be [2 * {bs}] and slots [{bs}], got {tuple(rows_pos.shape)}, "
                         f"{tuple(slots.shape)}")
    block = min(1024, triton.next_power_of_2(bs))
    _gather[(triton.cdiv(bs, block),)](
        rows_pos, token_pool, token_pool.stride(0), page_table, page_table.stride(0), ids, slots, bs,
        BLOCK=block, PAGE=page, num_warps=4 if block <= 256 else 8,
    )
