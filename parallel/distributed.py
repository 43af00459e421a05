"""torchrun integration: read the environment, lay out DP x TP, create the process groups, agree on memory."""

from __future__ import annotations

import atexit
import ctypes
import datetime
import os
import signal
import sys
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.state import TPInfo, get_cpu_group, get_store, get_tp, set_tp

HEARTBEAT_S = 2.0  # how often each rank counts up its heartbeat in the store
_heartbeat: threading.Thread | None = None
_heartbeat_stop = threading.Event()


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world_size: int
    local_rank: int


def read_torchrun_env(environ: dict[str, str] | None = None) -> TorchrunEnv:
    env = os.environ if environ is None else environ
    try:
        return TorchrunEnv(
            rank=int(env.get("RANK", "0")), world_size=int(env.get("WORLD_SIZE", "1")),
            local_rank=int(env.get("LOCAL_RANK", "0")),
        )
    except ValueError as exc:
        raise ValueError(f"malformed torchrun environment (RANK/WORLD_SIZE/LOCAL_RANK): {exc}") from None


def layout(env: TorchrunEnv, tp_size: int) -> TPInfo:
    """This rank's place in DP x TP; replicas are contiguous rank blocks, so a TP group stays inside a node."""
    tp = tp_size or env.world_size
    if tp < 0 or env.world_size % tp != 0:
        raise ValueError(
            f"parallel.tp_size={tp_size} does not divide the world size {env.world_size}: "
            f"the world is DP replicas x TP ranks (use a divisor of {env.world_size}, or 0 for TP over all ranks)"
        )
    return TPInfo(rank=env.rank % tp, size=tp, local_rank=env.local_rank, dp_rank=env.rank // tp,
                  dp_size=env.world_size // tp)


def init_distributed(use_cuda: bool, timeout_s: int, env: TorchrunEnv | None = None, tp_size: int = 0) -> TPInfo:
    """Join the job: per replica a device group (NCCL on CUDA, else gloo) and a gloo CPU group."""
    env = env or read_torchrun_env()
    info = layout(env, tp_size)
    if env.world_size == 1 and "TORCHELASTIC_RUN_ID" not in os.environ:
        set_tp(info)
        return info
    if "TORCHELASTIC_RUN_ID" in os.environ:
        end_with_the_agent()
    if use_cuda:
        if env.local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK={env.local_rank} but this node has {torch.cuda.device_count()} GPUs; "
                "start one process per GPU (torchrun --nproc-per-node)"
            )
        torch.cuda.set_device(env.local_rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo", rank=env.rank, world_size=env.world_size, timeout=timeout,
            device_id=torch.device("cuda", env.local_rank) if use_cuda else None,
        )
    if info.dp_size == 1:
        device_group, cpu_group = dist.group.WORLD, dist.new_group(backend="gloo", timeout=timeout)
    else:
        # Every rank creates every replica's groups, in the same order (new_group is collective).
        for replica in range(info.dp_size):
            ranks = list(range(replica * info.size, (replica + 1) * info.size))
            device = dist.new_group(ranks, timeout=timeout)
            cpu = dist.new_group(ranks, backend="gloo", timeout=timeout)
            if replica == info.dp_rank:
                device_group, cpu_group = device, cpu
    set_tp(info, device_group, cpu_group)
    start_heartbeat(env.rank)
    return info


def attempt_key(name: str) -> str:
    """``name`` in the store under this torchrun attempt, so a restarted job never reads its last attempt's keys."""
    return f"tpinfer/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{name}"


def heartbeat_key(global_rank: int) -> str:
    return attempt_key(f"alive/{global_rank}")


def start_heartbeat(global_rank: int) -> None:
    """Count up this rank's heartbeat in the store every ``HEARTBEAT_S`` while the process lives (a daemon thread;
    TCPStore serialises its calls), so a replica waiting for another can tell a slow one (loading, merging) from
    one that is gone without a word (killed by the OOM killer, its node lost), where no launcher ends the rest."""
    global _heartbeat
    store = get_store()
    if _heartbeat is not None or store is None:
        return

    def beat() -> None:
        key = heartbeat_key(global_rank)
        while not _heartbeat_stop.is_set():
            try:
                store.add(key, 1)
            except Exception:  # noqa: BLE001 (the store is gone, and the job with it)
                return
            _heartbeat_stop.wait(HEARTBEAT_S)

    _heartbeat_stop.clear()
    _heartbeat = threading.Thread(target=beat, name="tpinfer-heartbeat", daemon=True)
    _heartbeat.start()


def stop_heartbeat() -> None:
    """End the heartbeat thread and wait for it (at exit, and when the groups go). A daemon thread still inside a
    store call when the interpreter finalises is ended from within that C++ call, which aborts the process
    ("terminate called without an active exception", SIGABRT) after its rows are written."""
    global _heartbeat
    thread, _heartbeat = _heartbeat, None
    if thread is None:
        return
    _heartbeat_stop.set()
    thread.join(timeout=HEARTBEAT_S + 5.0)  # one store call; a store gone for good fails it sooner or later


atexit.register(stop_heartbeat)  # before the interpreter finalises; a no-op without a heartbeat


def end_with_the_agent() -> None:
    """torchrun starts each rank in a session of its own, so a killed agent (kill -9 of torchrun or of launch.py)
    would leave a TP-only job's ranks serving on, holding the output a rerun waits for. On Linux the kernel sends
    this rank SIGTERM when its parent dies: a drain, as torchrun itself would have sent."""
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    agent = os.getppid()  # may be pid 1 and alive: torchrun as a container's entry point
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0) == 0 \
            and os.getppid() != agent:
        os.kill(os.getpid(), signal.SIGTERM)  # the agent died before the request took effect


def shutdown_distributed() -> None:
    stop_heartbeat()
    if dist.is_initialized():
        dist.destroy_process_group()
    set_tp(TPInfo())


def agree_on_memory(free_before: int, free_after: int) -> tuple[int, int, int]:
    """The min and max over all ranks of the free memory before the model loaded, and the min after it, in one
    all_reduce(MIN) of [before, -before, after]."""
    t = torch.tensor([free_before, -free_before, free_after], dtype=torch.int64)
    if get_tp().size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=get_cpu_group())
    return int(t[0]), -int(t[1]), int(t[2])
