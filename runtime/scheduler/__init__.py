"""Rank 0's control plane: which requests run in the next step, and who owns which KV page."""

from runtime.scheduler.scheduler import Scheduler

__all__ = ["Scheduler"]
