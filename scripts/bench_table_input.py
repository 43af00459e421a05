"""How soon a large Parquet input starts serving, and how much host memory the job holds meanwhile.

    python scripts/bench_table_input.py [--rows 200000] [--serve-s 20] [key=value ...]

Measures the reader alone, the whole job through ``launch.py``, and a small baseline job for the model's own cost.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
READER = """
import json, resource, sys, time
from types import SimpleNamespace
from pathlib import Path
from runtime.config import JobColumnsSection
from runtime.frontend.job import Todo
from runtime.frontend.job_inputs import open_input
from runtime.sampling_params import SamplingParams

def peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

before = peak_mib()
start = time.perf_counter()
job = SimpleNamespace(format="auto", columns=JobColumnsSection(prompt="question"), chat_template=True)
source = open_input(Path(sys.argv[1]), job, SamplingParams(max_new_tokens=8))
todo = Todo(source.rows(), set())
todo.fill(0)
first = todo.rows(range(0, 1))
first_s = time.perf_counter() - start
n = 0
while True:
    got = todo.rows(range(n, n + 4096))
    if not got:
        break
    n += len(got)
print(json.dumps({"first_row_s": first_s, "all_rows_s": time.perf_counter() - start, "rows": n,
                  "peak_rss_mib_before": before, "peak_rss_mib_after": peak_mib()}))
"""


def write_table(path: Path, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    topics = ["the sea", "a mountain", "prime numbers", "the moon", "bread", "a violin", "rain", "GPUs"]
    with pq.ParquetWriter(path, pa.schema([("qid", pa.int64()), ("question", pa.string())])) as writer:
        for start in range(0, rows, 10_000):
            ids = range(start, min(start + 10_000, rows))
            questions = [f"Question {i}: in two sentences, what should everyone know about {topics[i % 8]}? "
                         "Be concrete." for i in ids]
            writer.write_table(pa.table({"qid": list(ids), "question": questions}))


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run_job(table: Path, out: Path, serve_s: float, overrides: list[str]) -> dict[str, float]:
    cmd = [sys.executable, "launch.py", f"job.input={table}", f"job.output={out}", "job.columns.id=qid",
           "job.columns.prompt=question", "job.progress=false", "sampling.max_new_tokens=16",
           "scheduler.max_running_requests=32", *overrides]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    config_copy = out.with_suffix(".config.yaml")
    job_start = first_row = None
    peak = 0.0
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the job ended early (exit {proc.returncode}): {proc.stderr.read()[-2000:]}")
            peak = max(peak, peak_rss_mib(proc.pid))
            now = time.perf_counter() - start
            if job_start is None and config_copy.exists():
                job_start = now
            if first_row is None and out.exists() and b"\n" in out.read_bytes()[:1 << 20]:
                first_row = now
            if first_row is not None and now - first_row >= serve_s:
                break
            time.sleep(0.02)
    finally:
        proc.kill()
        proc.wait()
    served = sum(1 for _ in out.open("rb"))
    return {"process_to_job_start_s": job_start, "process_to_first_row_s": first_row,
            "job_start_to_first_row_s": first_row - job_start, "rows_served": served,
            "peak_rss_mib": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--serve-s", type=float, default=20.0, help="how long the job serves after its first row")
    parser.add_argument("--baseline-rows", type=int, default=1000)
    parser.add_argument("overrides", nargs="*", help="launch.py overrides, e.g. model.path=/models/x")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        table = Path(tmp) / "questions.parquet"
        start = time.perf_counter()
        write_table(table, args.rows)
        result: dict[str, object] = {"rows": args.rows, "table_mib": round(table.stat().st_size / 2**20, 1),
                                     "write_table_s": round(time.perf_counter() - start, 2)}
        reader = subprocess.run([sys.executable, "-c", READER, str(table)], cwd=REPO, capture_output=True, text=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)
        result["reader"] = json.loads(reader.stdout.strip().splitlines()[-1])
        result["job"] = run_job(table, Path(tmp) / "out.jsonl", args.serve_s, args.overrides)
        small = Path(tmp) / "small.parquet"
        write_table(small, args.baseline_rows)
        result["baseline_job"] = {"rows": args.baseline_rows,
                                  **run_job(small, Path(tmp) / "small.jsonl", args.serve_s, args.overrides)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
