"""Chart of output tokens/s per engine and ablation from bench_offline.py result files.

    python scripts/plot_bench.py benchmarks/*.json --out benchmarks/throughput.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parser = argparse.ArgumentParser()
    parser.add_argument("results", nargs="+")
    parser.add_argument("--out", default="benchmarks/throughput.png")
    args = parser.parse_args()
    files = [json.loads(Path(f).read_text()) for f in args.results]
    fig, axes = plt.subplots(1, len(files), figsize=(5 * len(files), 4.5), squeeze=False)
    for ax, res in zip(axes[0], files):
        runs = {k: v for k, v in res["runs"].items() if "output_tok_s" in v}
        names, values = list(runs), [v["output_tok_s"] for v in runs.values()]
        bars = ax.bar(range(len(names)), values, color=["#2b6cb0" if n.startswith("tpinfer") else "#a0aec0" for n in names])
        for bar, run in zip(bars, runs.values()):
            share = run.get("roofline_share")
            label = f"{bar.get_height():,.0f}" + (f"\n{share:.0%} roof" if share else "")
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
        ax.set_title(f"{res['name']} (H200, random weights)", fontsize=10)
        ax.set_ylabel("output tokens/s")
        ax.set_ylim(0, max(values) * 1.2)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(args.out)


if __name__ == "__main__":
    main()
