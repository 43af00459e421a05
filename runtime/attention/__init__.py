"""Attention backends behind one interface.

``prepare(batch)`` builds the backend's metadata once per step (shared by all
layers); ``forward(q, k, v, layer_id)`` writes this step's K/V into the paged
cache and returns attention over the cached sequence.
"""

from __future__ import annotations

from typing import Protocol

import torch

from runtime.batch import Batch


class AttentionBackend(Protocol):
    def prepare(self, batch: Batch) -> None: ...
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor: ...


def host_to_device(array, device: torch.device) -> torch.Tensor:  # noqa: ANN001 - numpy array
    """Copy a host array to ``device`` through pinned memory without blocking the host.

    The pinned block comes from PyTorch's caching host allocator, which does not
    hand it out again until the copy that reads it has run: reusing a staging
    buffer under an in-flight copy (an overlap-scheduling hazard) cannot happen.
    """
    t = torch.from_numpy(array)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
