"""A CUDA graph's input gather (runtime/engine/decode_inputs.py) against plain indexing, on CPU through
Triton's interpreter (conftest sets TRITON_INTERPRET=1 where there is no GPU), and compiled on a GPU
(``pytest -m gpu``); the GPU suites also replay it in every decode graph."""

from __future__ import annotations

import pytest
import torch

from runtime.engine import decode_inputs

# Compiled Triton takes CUDA tensors only; the interpreter runs where there is no GPU.
DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu)] + ([] if torch.cuda.is_available() else ["cpu"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bs, page", [(1, 16), (5, 16), (24, 1), (1100, 32)])
def test_gather_into_matches_indexing(bs: int, page: int, device: str) -> None:
    gen = torch.Generator().manual_seed(bs)
    rows_total, max_len = bs + 3, 300
    pool = torch.randint(0, 50000, (rows_total, max_len + 1), generator=gen, dtype=torch.int32)
    table = torch.randint(1, 10**6, (rows_total, -(-max_len // page)), generator=gen, dtype=torch.int32)
    rows = torch.randperm(rows_total, generator=gen)[:bs] if bs < rows_total else torch.arange(bs)
    pos = torch.randint(0, max_len, (bs,), generator=gen)
    pos[0] = max_len - 1  # the last page of a row
    ids, slots = torch.full((bs,), -1, dtype=torch.int32), torch.full((bs,), -1, dtype=torch.int64)
    dev = [t.to(device) for t in (pool, table, torch.cat((rows, pos)), ids, slots)]
    decode_inputs.gather_into(dev[0], dev[1], dev[2], page, dev[3], dev[4])
    ids, slots = dev[3].cpu(), dev[4].cpu()
    want_ids = torch.tensor([int(pool[r, p]) for r, p in zip(rows.tolist(), pos.tolist())], dtype=torch.int32)
    want_slots = torch.tensor([int(table[r, p // page]) * page + p % page for r, p in zip(rows.tolist(), pos.tolist())])
    assert torch.equal(ids, want_ids)
    assert torch.equal(slots, want_slots)
    torch_ids, torch_slots = decode_inputs.gather_torch(pool, table, rows, pos, page)  # the eager steps' gather
    assert torch.equal(torch_ids, want_ids) and torch.equal(torch_slots, want_slots)


def test_gather_into_names_a_wrong_layout() -> None:
    pool, table = torch.zeros(4, 8, dtype=torch.int32), torch.zeros(4, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"rows_pos must be \[2 \* 3\]"):
        decode_inputs.gather_into(pool, table, torch.zeros(3, dtype=torch.int64), 16,
                                  torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int64))
