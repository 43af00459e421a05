"""Build the torchrun command for the current Slurm allocation; print it, or run it and exit with its ranks' codes.

    python scripts/slurm/torchrun_cmd.py [--dry-run] [--nproc-per-node N] [--tp-size T] [--rdzv-port 29500] \
        -- launch.py ...

Started once per node (srun --ntasks-per-node=1): every node's torchrun meets the others
through the c10d rendezvous on the first host of the node list, and torchrun starts one
rank per GPU. ``--tp-size T`` splits the world (nodes x ranks per node) into data-parallel
replicas of T ranks each (``parallel.tp_size``). Bad or missing Slurm variables, and a T
that does not divide the world, exit with code 2 and name what is wrong.

torchrun runs as a child, and this node's exit code is its ranks' own (0: done, 143: drained with
rows left) when every rank left one (``node_exit_code``): torchrun exits 1 after any signal.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo: parallel.launcher, which loads no torch

from parallel.launcher import EXIT_CODE_DIR_ENV, EXIT_DRAINED, recorded_exit_codes  # noqa: E402

DEFAULT_PORT = 29500
# The signals torchrun passes on to its ranks (its default --signals-to-handle). They reach this process too, since
# scancel --signal and srun signal every process of the step; it waits for torchrun instead of dying.
TORCHRUN_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
_BRACKET = re.compile(r"\[([^\[\]]*)\]")


class SlurmEnvError(ValueError):
    """A Slurm variable is missing or malformed; the message names it."""


def _split_top_level(nodelist: str) -> list[str]:
    """Split on commas outside brackets: 'a[1,3],b' -> ['a[1,3]', 'b']."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' in node list {nodelist!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in node list {nodelist!r}")
        elif ch == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unclosed '[' in node list {nodelist!r}")
    items.append(nodelist[start:])
    return items


def _expand_ranges(body: str) -> list[str]:
    """'01-03,7' -> ['01', '02', '03', '7']; the low bound's width sets the zero padding, as in Slurm."""
    out: list[str] = []
    for part in body.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {part!r} in [{body}]")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"descending range {part!r} in [{body}]")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm node-list syntax: 'gpu[01-03,07],cpu5' -> ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'cpu5'].

    Several bracket groups in one name expand as a cartesian product, left group slowest
    ('r[1-2]n[1-2]' -> r1n1 r1n2 r2n1 r2n2), matching `scontrol show hostnames`.
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        item = item.strip()
        if not item:
            raise ValueError(f"empty host name in node list {nodelist!r}")
        names = [""]
        # re.split with one capture group alternates literal, group body, literal, ...
        for i, piece in enumerate(_BRACKET.split(item)):
            choices = _expand_ranges(piece) if i % 2 else [piece]
            names = [name + choice for name in names for choice in choices]
        hosts.extend(names)
    return hosts


def resolve_hostnames(nodelist: str) -> list[str]:
    """Slurm's own expansion when scontrol is on PATH (it is the authority); ours otherwise."""
    scontrol = shutil.which("scontrol")
    if scontrol:
        try:
            proc = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True,
                                  check=True, timeout=60)
            return proc.stdout.split()
        except (OSError, subprocess.SubprocessError) as exc:
            # e.g. a login node without slurm.conf: the syntax is still ours to expand.
            print(f"torchrun_cmd: warning: scontrol failed ({exc}); expanding the node list in Python",
                  file=sys.stderr)
    return expand_nodelist(nodelist)


def _first(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """(name, value) of the first variable that is set and non-empty."""
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return name, value
    return None


def _positive_int(name: str, value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise SlurmEnvError(f"{name}={value!r} is not a positive integer")
    return int(value)


def _require(env: Mapping[str, str], *names: str) -> tuple[str, str]:
    found = _first(env, *names)
    if found is None:
        raise SlurmEnvError(f"{' or '.join(names)} is not set (run inside a Slurm allocation, or fake it for --dry-run)")
    return found


def describe_layout(nnodes: int, nproc: int, tp_size: int) -> str:
    """DP x TP in words; raises SlurmEnvError when ``tp_size`` does not divide the world."""
    world = nnodes * nproc
    if world % tp_size:
        raise SlurmEnvError(f"--tp-size {tp_size} does not divide the world of {nnodes} nodes x {nproc} ranks = {world}")
    where = ("each TP group inside one node" if nproc % tp_size == 0
             else "WARNING: TP groups span nodes, every all-reduce crosses the network")
    return f"{nnodes} nodes x {nproc} ranks = {world} ranks: DP {world // tp_size} x TP {tp_size} ({where})"


def ranks_per_node(env: Mapping[str, str], nproc: int | None) -> int:
    """``nproc`` when given, else one per GPU (SLURM_GPUS_ON_NODE), else one per task, else 1."""
    if nproc is not None:
        return nproc
    found = _first(env, "SLURM_GPUS_ON_NODE", "SLURM_NTASKS_PER_NODE")
    return _positive_int(*found) if found else 1


def build_command(env: Mapping[str, str], nproc: int | None, port: int, passthrough: list[str], *,
                  hostnames: Callable[[str], list[str]] = resolve_hostnames, tp_size: int | None = None) -> list[str]:
    """The torchrun argv for this allocation; raises SlurmEnvError naming the bad variable."""
    nnodes = _positive_int(*_require(env, "SLURM_JOB_NUM_NODES", "SLURM_NNODES"))
    list_var, nodelist = _require(env, "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    _, job_id = _require(env, "SLURM_JOB_ID")
    try:
        hosts = hostnames(nodelist)
    except ValueError as exc:
        raise SlurmEnvError(f"{list_var}: {exc}") from None
    # A count that disagrees with the list would leave torchrun waiting for nodes that never come.
    if len(hosts) != nnodes:
        raise SlurmEnvError(f"SLURM_JOB_NUM_NODES={nnodes} but {list_var}={nodelist!r} names {len(hosts)} hosts")
    nproc = ranks_per_node(env, nproc)
    if tp_size is not None:
        print(f"torchrun_cmd: {describe_layout(nnodes, nproc, tp_size)}", file=sys.stderr)
        passthrough = [*passthrough, f"parallel.tp_size={tp_size}"]
    return [
        "torchrun", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
        # c10d: the first host runs the rendezvous store itself, so no etcd or fixed MASTER_ADDR is needed.
        "--rdzv-backend=c10d", f"--rdzv-endpoint={hosts[0]}:{port}", f"--rdzv-id={job_id}",
        # A failed rank fails the job: restarting in place would redo work the requeue path resumes anyway.
        "--max-restarts=0",
        *passthrough,
    ]


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1-65535)")
    return int(text)


def _nproc(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def main(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    env = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(
        prog="torchrun_cmd.py", usage="%(prog)s [--dry-run] [--nproc-per-node N] [--tp-size T] [--rdzv-port PORT] -- launch.py ...",
        description="Build the torchrun command for this Slurm allocation and run it (or print it).")
    parser.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    parser.add_argument("--nproc-per-node", type=_nproc, default=None,
                        help="ranks per node (default: SLURM_GPUS_ON_NODE, else SLURM_NTASKS_PER_NODE, else 1)")
    parser.add_argument("--tp-size", type=_nproc, default=None,
                        help="ranks per tensor-parallel group; the world is split into DP = world / T replicas")
    parser.add_argument("--rdzv-port", type=_port, default=DEFAULT_PORT, help=f"rendezvous port (default {DEFAULT_PORT})")
    # Split at the first `--` ourselves: argparse would otherwise try to read launch.py's own options.
    if "--" not in argv:
        parser.error("put the command for torchrun after `--`, e.g. -- launch.py --config configs/default.yaml")
    split = argv.index("--")
    args, passthrough = parser.parse_args(argv[:split]), argv[split + 1:]
    if not passthrough:
        parser.error("nothing to run after `--`")
    try:
        cmd = build_command(env, args.nproc_per_node, args.rdzv_port, passthrough, tp_size=args.tp_size)
    except SlurmEnvError as exc:
        print(f"torchrun_cmd: error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    # Every node logs into the same job output file: say which node this line comes from.
    node = f"torchrun_cmd [node {env.get('SLURM_NODEID', '?')}]"
    print(f"{node}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    return run(cmd, ranks_per_node(env, args.nproc_per_node), node)


def node_exit_code(torchrun_code: int, rank_codes: Mapping[int, int], nproc: int) -> int:
    """This node's exit code: its ranks' own when all ``nproc`` of them left one, else torchrun's.

    torchrun answers SIGTERM by passing it on to its ranks and waiting for them, then exits 1 whatever they
    returned; the ranks of a job that finished its last rows while draining all exit 0, and the batch script
    must not requeue it. Ranks that all drained with rows left (143, some with 0) give 143; any other failure,
    or a rank that left no code (killed, crashed), keeps torchrun's code.
    """
    if torchrun_code == 0 or len(rank_codes) < nproc:
        return torchrun_code
    failed = {code for code in rank_codes.values() if code != 0}
    if not failed:
        return 0
    return EXIT_DRAINED if failed == {EXIT_DRAINED} else torchrun_code


def run(cmd: list[str], nproc: int, node: str = "torchrun_cmd") -> int:
    """Run ``cmd`` (torchrun) and return ``node_exit_code``; the ranks leave their codes in a fresh folder."""
    got: list[str] = []
    for sig in TORCHRUN_SIGNALS:
        # Not passed on: torchrun has it already, and a second one would cut short its wait for the draining ranks.
        signal.signal(sig, lambda signum, _frame: got.append(signal.Signals(signum).name))
    with tempfile.TemporaryDirectory(prefix="tpinfer-exit-codes-") as folder:
        try:
            proc = subprocess.Popen(cmd, env={**os.environ, EXIT_CODE_DIR_ENV: folder})
        except OSError as exc:
            print(f"torchrun_cmd: error: cannot run {cmd[0]}: {exc}", file=sys.stderr)
            return 127
        code = proc.wait()
        torchrun_code = 128 - code if code < 0 else code  # killed by a signal: as a shell reports it
        rank_codes = recorded_exit_codes(folder)
    mine = node_exit_code(torchrun_code, rank_codes, nproc)
    if mine != torchrun_code:
        after = f" after {', '.join(got)}" if got else ""
        listed = ", ".join(f"rank {rank}: {c}" for rank, c in sorted(rank_codes.items()))
        print(f"{node}: torchrun exited {torchrun_code}{after}; its ranks exited {listed}: exit {mine}",
              file=sys.stderr, flush=True)
    return mine


if __name__ == "__main__":
    sys.exit(main())
