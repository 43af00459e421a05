"""Tensor-parallel state and collectives. At world size 1 every collective is a no-op."""

from parallel.state import (
    TPInfo,
    all_gather_last_dim,
    all_reduce,
    all_reduce_max,
    any_rank,
    get_tp,
    linear_all_reduce,
    set_tp,
)

__all__ = ["TPInfo", "all_gather_last_dim", "all_reduce", "all_reduce_max", "any_rank", "get_tp", "linear_all_reduce",
           "set_tp"]
