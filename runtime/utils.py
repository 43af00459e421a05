"""Small helpers and constants shared by the engine, the attention backends, the sampler and the scheduler."""

from __future__ import annotations

import numpy as np
import torch

# The reserved KV page: padded graph slots and unused page-table entries point at it; the allocator never hands it out.
DUMMY_PAGE = 0


def host_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Copy a host array to ``device`` through pinned memory without blocking the host.

    The pinned block comes from PyTorch's caching host allocator, which does not
    hand it out again until the copy that reads it has run: reusing a staging
    buffer under an in-flight copy (an overlap-scheduling hazard) cannot happen.
    """
    t = torch.from_numpy(array)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def concat_ranges(lengths: np.ndarray, starts: np.ndarray | int = 0) -> np.ndarray:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lengths)])`` without a Python loop."""
    total = int(lengths.sum())
    return np.arange(total) - np.repeat(np.cumsum(lengths) - lengths - starts, lengths)
