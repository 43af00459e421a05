"""The offline benchmark's config: the runtime's schema plus the workload section ``bench``, kept out of
``runtime.config`` because the workload is the benchmark's business."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from runtime.config import RuntimeConfig, load_config


@dataclass
class BenchSection:
    num_requests: int = 256
    input_len: list[int] = field(default_factory=lambda: [100, 1024])  # uniform, inclusive
    output_len: list[int] = field(default_factory=lambda: [100, 1024])
    fixed_output_len: int = 512  # HF static batching needs one length
    token_id_limit: int = 10000
    temperature: float = 0.6
    seed: int = 0
    n: int = 1
    logprobs: int | None = None
    seeded: bool = False
    penalties: bool = False  # every request with min_p and the three penalties (their cost)
    peers: list[str] = field(default_factory=lambda: ["hf_continuous", "hf_static"])  # run on the fixed variant
    peer_requests: int = 256
    ablations: list[str] = field(default_factory=lambda: ["no_graphs", "no_overlap"])
    batch1_context: int = 4  # prompt tokens of the one-request decode run, which then generates 256
    # The "shared_prefix" ablation's workload.
    shared_prefix_len: int = 1000
    distinct_len: list[int] = field(default_factory=lambda: [50, 200])
    shared_output_len: int = 128


@dataclass
class BenchConfig(RuntimeConfig):
    bench: BenchSection = field(default_factory=BenchSection)


def load_bench_config(paths: list[str | Path] | None = None, overrides: list[str] | None = None) -> BenchConfig:
    """Schema <- each YAML file in order <- ``key=value`` overrides (``bench.*`` included); validated."""
    return cast(BenchConfig, load_config(paths, overrides, schema=BenchConfig))
