"""Small helpers and constants shared by the engine, sampler and scheduler."""

from __future__ import annotations

import numpy as np
import torch

# The reserved KV page: padded graph slots and unused page-table entries point at it; the allocator never hands it out.
DUMMY_PAGE = 0


def host_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Non-blocking copy through pinned memory; the caching host allocator keeps the block until the copy ran."""
    t = torch.from_numpy(array)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def concat_ranges(lengths: np.ndarray, starts: np.ndarray | int = 0) -> np.ndarray:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lengths)])`` without a Python loop."""
    total = int(lengths.sum())
    return np.arange(total) - np.repeat(np.cumsum(lengths) - lengths - starts, lengths)
