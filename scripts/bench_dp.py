"""Data parallelism against tensor parallelism: the same JSONL job through launch.py in each DPxTP layout.

    python scripts/bench_dp.py --config configs/bench/llama-3.2-1b.yaml --layouts 1x1,2x1,1x2 [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bench_config import load_bench_config  # noqa: E402
from scripts.bench_runs import workload  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def write_job(cfg, workdir: Path) -> tuple[Path, Path]:  # noqa: ANN001 - BenchConfig
    """The workload as JSONL rows, and the runtime part of the config as a YAML file."""
    prompts, outs = workload(cfg, fixed=False)
    rows = workdir / "rows.jsonl"
    sampling = {"temperature": cfg.bench.temperature, "ignore_eos": True}
    rows.write_text("".join(json.dumps({"id": i, "prompt": p, "sampling": {**sampling, "max_new_tokens": n}}) + "\n"
                            for i, (p, n) in enumerate(zip(prompts, outs))))
    runtime = OmegaConf.to_container(OmegaConf.structured(cfg))
    runtime.pop("bench")
    config = workdir / "runtime.yaml"
    config.write_text(OmegaConf.to_yaml(runtime))
    return rows, config


def run_layout(dp: int, tp: int, rows: Path, config: Path, workdir: Path) -> dict:
    out = workdir / f"out-dp{dp}-tp{tp}.jsonl"
    world = dp * tp
    launcher = [sys.executable] if world == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc-per-node", str(world)]
    cmd = [*launcher, str(REPO / "launch.py"), "--config", str(config), f"parallel.tp_size={tp}",
           f"job.input={rows}", f"job.output={out}", "job.progress=false", "job.chat_template=false"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-5:], "returncode": proc.returncode}
    m = json.loads(out.with_suffix(".metrics.json").read_text())
    return {
        "output_tok_s": m["output_tokens_per_s"], "wall_s": m["wall_s"], "rows": m["completed"],
        "output_tokens": m["output_tokens"], "gpus": world,
        "replicas": [{k: r[k] for k in ("replica", "rows", "output_tokens", "busy_s")} for r in m["replicas"]],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", required=True)
    parser.add_argument("--layouts", default="1x1,2x1,1x2", help="comma-separated DPxTP layouts")
    parser.add_argument("--out", default="benchmarks")
    parser.add_argument("--name", default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_bench_config(args.config, args.overrides)
    name = args.name or f"dp-{Path(args.config[-1]).stem}"
    results: dict = {"name": name, "command": " ".join(sys.argv), "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        rows, config = write_job(cfg, Path(tmp))
        for layout in args.layouts.split(","):
            dp, tp = (int(x) for x in layout.split("x"))
            results["runs"][f"dp{dp}xtp{tp}"] = run = run_layout(dp, tp, rows, config, Path(tmp))
            print(f"dp{dp}xtp{tp}", json.dumps(run), flush=True)
    base = results["runs"].get("dp1xtp1", {}).get("output_tok_s")
    for key, run in results["runs"].items():
        if base and "output_tok_s" in run:
            run["speedup_over_one_gpu"] = run["output_tok_s"] / base
            print(f"{key}: {run['output_tok_s']:.0f} tok/s, {run['speedup_over_one_gpu']:.2f}x one GPU"
                  + "".join(f"; replica {r['replica']} {r['rows']} rows busy {r['busy_s']:.1f} s"
                            for r in run["replicas"]))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"{name}.json").write_text(json.dumps(results, indent=2))
    return 1 if any("error" in r for r in results["runs"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
