#!/usr/bin/env bash
# Start a one-node Slurm cluster on this machine (for the test suite and for trying the
# Slurm paths by hand). Idempotent: when `sinfo` already answers with an idle node it does
# nothing. Needs root (it installs Debian's slurm-wlm and munge when they are missing and
# writes /etc/slurm/slurm.conf); anything else prints one line and exits 1.
#
#   scripts/slurm/start_cluster.sh          # install if needed, start, wait for the node
#   scripts/slurm/stop_cluster.sh           # stop what this script started
#
# The node is `localhost` at 127.0.0.1 and declares TITAN_SLURM_CPUS CPUs (default 16;
# SlurmdParameters=config_overrides lets it declare more than the machine has), so several
# small multi-task jobs can run side by side. No accounting storage, no cgroups
# (proctrack/linuxproc, task/none): it runs in a container as well. The daemons run in the
# foreground (-D/-F) in the background of this shell; their PIDs and logs are kept in
# TITAN_SLURM_STATE (default /var/run/titan-slurm).
set -euo pipefail

STATE="${TITAN_SLURM_STATE:-/var/run/titan-slurm}"
CPUS="${TITAN_SLURM_CPUS:-16}"
CONF_DIR=/etc/slurm

say() { echo "start_cluster: $*" >&2; }

node_idle() {
    # The node answers and is idle or partly used (mixed/allocated count as up).
    command -v sinfo >/dev/null 2>&1 || return 1
    local state
    state="$(timeout 10 sinfo -h -N -o '%t' 2>/dev/null | head -n1)" || return 1
    [[ "$state" =~ ^(idle|mix|alloc)$ ]]
}

if node_idle; then
    say "Slurm is up ($(sinfo -h -N -o '%N %t %c CPUs' | head -n1))"
    exit 0
fi

if [[ "$(id -u)" != 0 ]]; then
    say "cannot start Slurm: not root"
    exit 1
fi

if ! command -v slurmctld >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
    if ! command -v apt-get >/dev/null 2>&1; then
        say "cannot start Slurm: slurmctld/munged missing and no apt-get to install them"
        exit 1
    fi
    say "installing slurm-wlm and munge (about 2 minutes)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q slurm-wlm munge >/dev/null
fi

mkdir -p "$STATE" /var/spool/slurmctld /var/spool/slurmd /run/munge /var/log/munge /var/lib/munge
if [[ ! -s /etc/munge/munge.key ]]; then
    mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
        || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
# munged runs as root here: it wants the key, its socket and its state owned by root.
chown root:root /etc/munge/munge.key /etc/munge /run/munge /var/log/munge /var/lib/munge
chmod 0400 /etc/munge/munge.key
chmod 0755 /run/munge
chmod 0700 /etc/munge /var/log/munge /var/lib/munge

host="$(hostname -s)"
mkdir -p "$CONF_DIR"
cat >"$CONF_DIR/slurm.conf" <<EOF
# Written by titan-plugins' scripts/slurm/start_cluster.sh: one node, no accounting.
ClusterName=titan
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job is held cred_expire seconds (default 120) before it may start again, so
# that no credential of its previous run is still live (the tests' preempted jobs wait
# this out). 20 s still covers a step launch on a loaded machine (the other thing it
# bounds). Releasing the hold by hand (StartTime=now) within the requeue's second fails
# the job: "Killing non-startable batch job: Job credential revoked".
AuthInfo=cred_expire=20
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# A job that becomes eligible by time alone (a requeued job's hold ending) starts at the
# next pass of the main scheduling loop: every 60 s by default, every 2 s here.
SchedulerParameters=sched_interval=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SlurmdParameters=config_overrides
ReturnToService=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# A step whose rank died is killed fast (srun --kill-on-bad-exit, time limits).
KillWait=5
InactiveLimit=0
MinJobAge=60
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=1 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
rm -f "$CONF_DIR/cgroup.conf"  # no cgroups: proctrack/linuxproc and task/none need none

start() {  # NAME COMMAND...: start a daemon in the foreground, in the background; keep its PID
    local name="$1"
    shift
    if [[ -f "$STATE/$name.pidkeep" ]] && kill -0 "$(cat "$STATE/$name.pidkeep")" 2>/dev/null; then
        return 0
    fi
    setsid "$@" >>"$STATE/$name.out" 2>&1 </dev/null &
    echo $! >"$STATE/$name.pidkeep"
}

start munged munged -F --force
for _ in $(seq 50); do [[ -S /run/munge/munge.socket.2 ]] && break; sleep 0.1; done
start slurmctld slurmctld -D -i
start slurmd slurmd -D -N localhost

for _ in $(seq 100); do
    if node_idle; then
        say "Slurm is up ($(sinfo -h -N -o '%N %t %c CPUs' | head -n1))"
        exit 0
    fi
    for name in munged slurmctld slurmd; do
        if ! kill -0 "$(cat "$STATE/$name.pidkeep")" 2>/dev/null; then
            say "$name exited; its log ($STATE/$name.out):"
            tail -n 5 "$STATE/$name.out" >&2
            exit 1
        fi
    done
    # A node left DOWN by an earlier run comes back with an update.
    if [[ "$(sinfo -h -N -o '%t' 2>/dev/null | head -n1)" =~ ^(down|drain) ]]; then
        scontrol update nodename=localhost state=resume >/dev/null 2>&1 || true
    fi
    sleep 0.3
done
say "Slurm did not come up within 30 s; logs in $STATE:"
tail -n 5 "$STATE"/*.log "$STATE"/*.out >&2 2>/dev/null || true
exit 1
