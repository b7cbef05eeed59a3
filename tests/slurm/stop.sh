#!/usr/bin/env bash
# Stop the local Slurm that tests/slurm/setup.sh started: slurmd, slurmctld and munged.
#
#   bash tests/slurm/stop.sh      # as root; does nothing where they are not running
#
# The packages (slurm-wlm, munge) stay installed; remove them with
# `apt-get remove slurmctld slurmd slurm-client munge` if wanted. setup.sh starts them again.
set -uo pipefail
STATE="${COSMOFLOW_SLURM_STATE:-/var/spool/cosmoflow-slurm}"

stop() {  # stop <name> <pid file>: TERM the daemon recorded in the pid file (or found by name)
    local pid
    pid="$(cat "$2" 2>/dev/null || pgrep -x "$1" | head -n 1)"
    if [ -n "$pid" ] && kill "$pid" 2>/dev/null; then
        for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        echo "slurm-stop: stopped $1 (pid $pid)"
    else
        echo "slurm-stop: $1 was not running"
    fi
}

stop slurmd "$STATE/slurmd.pid"
stop slurmctld "$STATE/slurmctld.pid"
stop munged /run/munge/munged.pid
