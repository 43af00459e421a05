"""Tensor-parallel state and collectives. At world size 1 every collective is a no-op."""

from __future__ import annotations

from typing import Any

__all__ = ["TPInfo", "all_gather_last_dim", "all_reduce", "all_reduce_max", "any_rank", "get_tp", "linear_all_reduce",
           "set_tp"]


def __getattr__(name: str) -> Any:  # `import parallel.launcher` stays light (no torch): launchers and Slurm wrappers
    if name in __all__:
        from parallel import state

        return getattr(state, name)
    raise AttributeError(f"module 'parallel' has no attribute {name!r}")
