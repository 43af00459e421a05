"""The data plane, on every rank: weights, KV cache, attention backends, CUDA graphs, sampling."""

from runtime.engine.engine import Engine, ForwardOutput

__all__ = ["Engine", "ForwardOutput"]
