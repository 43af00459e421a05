"""Serving benchmark: the OpenAI-compatible server under concurrent streams, against offline throughput.

    python scripts/bench_serve.py --config configs/bench/llama-3.2-1b.yaml --concurrency 64,256 [key=value ...]

The offline benchmark's workload (``bench.*``: prompt and output lengths, temperature, ignore_eos) is sent as
streaming ``/v1/completions`` requests by client processes (closed loop: each of C streams sends its next
request when the last one ends). Offline throughput on the same workload is measured before and after the
server runs, in fresh processes; the server's output tok/s is reported as a share of the faster one. Clients
measure time to first token, the gaps between chunks, and each request's time per output token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The client processes import this module: what needs torch is imported in main() only.

REPO = Path(__file__).resolve().parents[1]
STREAMS_PER_CLIENT = 32  # one client process per this many streams: parsing chunks is the client's CPU work


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", required=True)
    parser.add_argument("--concurrency", default="64,256", help="comma-separated stream counts")
    parser.add_argument("--requests", type=int, default=0, help="requests per concurrency (default: the workload's)")
    parser.add_argument("--out", default="benchmarks")
    parser.add_argument("--name", default=None, help="results file stem (default: serve-<config stem>)")
    parser.add_argument("--no-offline", action="store_true", help="skip the offline runs")
    parser.add_argument("--server-variants", default="", metavar="'K=V K=V;K=V'",
                        help="';'-separated sets of server overrides, each measured with its own server")
    parser.add_argument("overrides", nargs="*", help="key=value: bench.* shape the workload, the rest the server")
    args = parser.parse_args(argv)
    args.patch = []  # bench_offline.measure's
    return args


# ---- the clients ------------------------------------------------------------------------------------------------
async def _one(session, url: str, body: dict) -> dict:  # noqa: ANN001 - aiohttp.ClientSession
    start = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    tokens = 0
    async with session.post(url, json=body) as response:
        if response.status != 200:
            return {"error": f"{response.status}: {(await response.text())[:200]}"}
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            now = time.perf_counter()
            chunk = json.loads(data)
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"]:
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
    return {"ttft": first - start, "gaps": gaps, "tokens": tokens,
            "tpot": (last - first) / (tokens - 1) if tokens > 1 else None, "end": time.time()}


async def _client(base: str, bodies: list[dict], streams: int, start_at: float) -> list[dict]:
    import aiohttp

    queue = list(reversed(bodies))
    results: list[dict] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        results.append({"started": time.time()})  # a late client (slow to spawn) counts from its own start

        async def stream() -> None:
            while queue:
                results.append(await _one(session, base + "/v1/completions", queue.pop()))

        await asyncio.gather(*(stream() for _ in range(streams)))
    return results


def _client_process(job: tuple[str, list[dict], int, float]) -> list[dict]:
    return asyncio.run(_client(*job))


def run_load(base: str, bodies: list[dict], concurrency: int) -> dict:
    """``concurrency`` streams over ``bodies``, spread over client processes; throughput and latencies."""
    clients = max(1, -(-concurrency // STREAMS_PER_CLIENT))
    start_at = time.time() + 2.0  # every client starts at once
    jobs = [(base, bodies[i::clients], concurrency // clients + (i < concurrency % clients), start_at)
            for i in range(clients)]
    with multiprocessing.get_context("spawn").Pool(clients) as pool:
        per_client = pool.map(_client_process, jobs)
    started = min(r["started"] for rs in per_client for r in rs if "started" in r)
    results = [r for rs in per_client for r in rs if "started" not in r]
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    wall = max(r["end"] for r in results) - started
    tokens = sum(r["tokens"] for r in results)
    gaps = np.array([g for r in results for g in r["gaps"]])
    tpot = np.array([r["tpot"] for r in results if r["tpot"] is not None])
    ttft = np.array([r["ttft"] for r in results])

    def pct(values: np.ndarray, q: float) -> float:
        return float(np.percentile(values, q) * 1000) if len(values) else float("nan")

    return {"concurrency": concurrency, "requests": len(results), "clients": clients, "seconds": wall,
            "output_tokens": tokens, "output_tok_s": tokens / wall,
            "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
            "tpot_ms_p50": pct(tpot, 50), "tpot_ms_p99": pct(tpot, 99),
            "chunk_gap_ms_p50": pct(gaps, 50), "chunk_gap_ms_p99": pct(gaps, 99),
            "tokens_per_chunk": tokens / max(1, len(gaps) + len(results))}


# ---- the server -------------------------------------------------------------------------------------------------
def start_server(args: argparse.Namespace, overrides: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, str(REPO / "launch.py"), *(f"--config={c}" for c in args.config), "serve",
           "server.port=0", *overrides]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in proc.stdout:
        print("  server:", line.rstrip(), flush=True)
        found = re.search(r"on (http://[\d.]+:\d+)/v1", line)
        if found:
            return proc, found.group(1)
    raise RuntimeError(f"the server exited ({proc.wait()}) before serving")


def main() -> int:
    from scripts.bench_config import load_bench_config
    from scripts.bench_offline import measure
    from scripts.bench_runs import workload

    args = parse_args()
    server_overrides = [o for o in args.overrides if not o.startswith("bench.")]
    cfg = load_bench_config(args.config, args.overrides)
    prompts, outs = workload(cfg, False)
    count = args.requests or len(prompts)
    bodies = [{"prompt": prompts[i % len(prompts)], "max_tokens": outs[i % len(outs)],
               "temperature": cfg.bench.temperature, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True}} for i in range(count)]
    name = args.name or f"serve-{Path(args.config[-1]).stem}"
    results: dict = {"name": name, "command": " ".join(sys.argv), "overrides": args.overrides, "runs": {}}
    runs = results["runs"]
    if not args.no_offline:
        runs["offline_before"] = measure(args, "tpinfer")
        print("offline_before", json.dumps(runs["offline_before"]), flush=True)
    variants = [v.split() for v in args.server_variants.split(";")] if args.server_variants else [[]]
    for variant in variants:
        label = f"[{' '.join(variant)}]" if variant else ""
        proc, base = start_server(args, server_overrides + variant)
        try:
            warm = [dict(b, max_tokens=16) for b in bodies[:16]]
            run_load(base, warm, 16)
            for concurrency in [int(c) for c in args.concurrency.split(",")]:
                key = f"serve_c{concurrency}{label}"
                runs[key] = run_load(base, bodies, concurrency)
                print(key, json.dumps(runs[key]), flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            results[f"server_exit_code{label}"] = proc.wait(timeout=120)
    if not args.no_offline:
        runs["offline_after"] = measure(args, "tpinfer")
        print("offline_after", json.dumps(runs["offline_after"]), flush=True)
        offline = [runs[k].get("output_tok_s") for k in ("offline_before", "offline_after")]
        if all(offline):
            best = max(offline)  # the first run on a fresh node is cold (kernel caches): the faster one counts
            results["offline_tok_s"] = best
            for key, row in runs.items():
                if key.startswith("serve_"):
                    row["share_of_offline"] = row["output_tok_s"] / best
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2))
    print(f"\n{name}: output tok/s")
    for key, row in runs.items():
        extra = ""
        if "ttft_ms_p50" in row:
            extra = (f"  ttft p50/p99 {row['ttft_ms_p50']:.0f}/{row['ttft_ms_p99']:.0f} ms, tpot p50/p99 "
                     f"{row['tpot_ms_p50']:.1f}/{row['tpot_ms_p99']:.1f} ms, {row['tokens_per_chunk']:.1f} tok/chunk, "
                     f"{row.get('share_of_offline', float('nan')):.0%} of offline")
        print(f"{key:<40}{row.get('output_tok_s', float('nan')):>10.0f}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
