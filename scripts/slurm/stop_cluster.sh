#!/usr/bin/env bash
# Stop the daemons that scripts/slurm/start_cluster.sh started (by their kept PIDs).
set -uo pipefail
STATE="${TITAN_SLURM_STATE:-/var/run/titan-slurm}"
for name in slurmd slurmctld munged; do
    pidfile="$STATE/$name.pidkeep"
    [[ -f "$pidfile" ]] || continue
    pid="$(cat "$pidfile")"
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    rm -f "$pidfile"
done
echo "stop_cluster: stopped" >&2
