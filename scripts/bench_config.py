"""The offline benchmark's config: the runtime's schema plus the benchmark's workload section ``bench``.

The workload is the benchmark's business, not the runtime's, so it lives here rather than in
``runtime.config``; the bench YAML files (which may hold a ``bench:`` section) load through
``load_bench_config``, with the runtime's own merging, overrides and validation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from runtime.config import RuntimeConfig, load_config


@dataclass
class BenchSection:
    """The offline benchmark's workload (scripts/bench_offline.py)."""

    num_requests: int = 256
    input_len: list[int] = field(default_factory=lambda: [100, 1024])  # uniform, inclusive
    output_len: list[int] = field(default_factory=lambda: [100, 1024])  # uniform, inclusive
    fixed_output_len: int = 512  # the fixed-length variant (HF static batching needs one length)
    token_id_limit: int = 10000  # prompts are random ids below this
    temperature: float = 0.6
    seed: int = 0
    n: int = 1  # samples per prompt (run tpinfer_n8: 8 samples of 32 prompts, one shared prefill each)
    logprobs: int | None = None  # top-k logprobs on every row (run tpinfer_logprobs5)
    seeded: bool = False  # every request carries its own seed (run tpinfer_seeded)
    peers: list[str] = field(default_factory=lambda: ["hf_continuous", "hf_static"])  # run on the fixed variant
    peer_requests: int = 256  # requests given to the (slow) HF peers
    ablations: list[str] = field(default_factory=lambda: ["no_graphs", "no_overlap"])
    # Shared-prefix workload (ablation "shared_prefix": radix against naive cache).
    shared_prefix_len: int = 1000
    distinct_len: list[int] = field(default_factory=lambda: [50, 200])
    shared_output_len: int = 128


@dataclass
class BenchConfig(RuntimeConfig):
    bench: BenchSection = field(default_factory=BenchSection)


def load_bench_config(paths: list[str | Path] | None = None, overrides: list[str] | None = None) -> BenchConfig:
    """Schema <- each YAML file in order <- ``key=value`` overrides (``bench.*`` included); validated."""
    # load_config builds an instance of the schema it is given, so this is a BenchConfig.
    return cast(BenchConfig, load_config(paths, overrides, schema=BenchConfig))
