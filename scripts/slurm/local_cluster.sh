#!/usr/bin/env bash
# A throwaway single-node Slurm cluster on this machine, for trying the sbatch templates for real.
#
#   scripts/slurm/local_cluster.sh install      # apt-get install slurm-wlm munge (root; only when asked)
#   scripts/slurm/local_cluster.sh start DIR    # munge + slurmctld + slurmd, all state under DIR
#   export SLURM_CONF=DIR/slurm.conf            # then sbatch / squeue / scontrol talk to it
#   scripts/slurm/local_cluster.sh stop DIR
#
# Runs as root: one node with this machine's CPUs and no GPUs, proctrack/linuxproc, task/none,
# no accounting. Ports are picked free at start. Exit codes: 0 ok, 2 usage, 3 Slurm or munge is
# not installed, 4 a daemon did not come up (its log is printed).
set -euo pipefail

usage() { echo "usage: $0 install | start DIR | stop DIR" >&2; exit 2; }

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

require() {
    for tool in munged slurmctld slurmd sbatch scontrol; do
        command -v "$tool" >/dev/null || { echo "$tool is not installed (run: $0 install)" >&2; exit 3; }
    done
}

write_conf() {
    local dir=$1 host cpus mem
    host=$(hostname -s)
    cpus=$(nproc)
    mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
    cat > "$dir/slurm.conf" <<EOF
ClusterName=tpinfer-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge.socket
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobRequeue=1
ReturnToService=2
KillWait=30
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
}

wait_for() {  # wait_for SECONDS LOG COMMAND...: poll COMMAND until it succeeds, else show LOG and fail
    local seconds=$1 log=$2
    shift 2
    for _ in $(seq "$((seconds * 5))"); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.2
    done
    echo "timed out waiting for: $*" >&2
    [[ -f $log ]] && tail -n 30 "$log" >&2
    exit 4
}

start() {
    local dir
    require
    mkdir -p "$1"
    dir=$(cd "$1" && pwd)
    mkdir -p "$dir/state" "$dir/spool"
    [[ -f $dir/munge.key ]] || { head -c 1024 /dev/urandom > "$dir/munge.key"; chmod 400 "$dir/munge.key"; }
    munged --force --key-file="$dir/munge.key" --socket="$dir/munge.socket" --pid-file="$dir/munged.pid" \
        --log-file="$dir/munged.log" --seed-file="$dir/munge.seed"
    wait_for 10 "$dir/munged.log" test -S "$dir/munge.socket"
    write_conf "$dir"
    export SLURM_CONF=$dir/slurm.conf
    slurmctld -f "$SLURM_CONF"
    wait_for 30 "$dir/slurmctld.log" scontrol ping
    slurmd -f "$SLURM_CONF"
    wait_for 60 "$dir/slurmd.log" bash -c "sinfo -h -o %T | grep -qx idle"
    echo "Slurm is up: export SLURM_CONF=$SLURM_CONF"
}

stop() {
    local dir
    dir=$(cd "$1" && pwd)
    export SLURM_CONF=$dir/slurm.conf
    for pidfile in slurmd.pid slurmctld.pid munged.pid; do
        if [[ -f $dir/$pidfile ]]; then kill "$(cat "$dir/$pidfile")" 2>/dev/null || true; fi
    done
    for pidfile in slurmd.pid slurmctld.pid munged.pid; do
        for _ in $(seq 50); do
            [[ -f $dir/$pidfile ]] && kill -0 "$(cat "$dir/$pidfile")" 2>/dev/null || break
            sleep 0.1
        done
    done
}

case "${1:-}" in
    install) DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge ;;
    start) [[ $# -eq 2 ]] || usage; start "$2" ;;
    stop) [[ $# -eq 2 ]] || usage; stop "$2" ;;
    *) usage ;;
esac
