#!/usr/bin/env bash
# A real one-node Slurm on this machine, for tests/test_slurm.py (the profiles/slurm tests).
#
#   tests/slurm/setup.sh        # as root; idempotent: exits 0 at once when Slurm already answers
#
# Installs Debian's slurmctld, slurmd, slurm-client and munge when missing, creates a munge key
# when there is none, starts munged (as the munge user), writes /etc/slurm/slurm.conf from
# tests/slurm/slurm.conf.in for this host, starts slurmctld and slurmd without systemd and waits
# until `sinfo` shows the node idle. No accounting database: profiles/slurm polls job states
# with squeue, and the configuration keeps finished jobs visible for MinJobAge = 600 s.
#
# It never fails CI: when it cannot give a working Slurm (not root, no apt, daemons that do not
# start) it prints one line "slurm-setup: unavailable: <reason>" and exits 0; the tests then skip
# with that reason. The last line of its output is always "slurm-setup: ready ..." or that line.
# Environment: COSMOFLOW_SLURM_STATE (state, spool and logs; default /var/spool/cosmoflow-slurm),
# COSMOFLOW_SLURM_WAIT (seconds to wait for an idle node; default 60).
set -uo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
STATE="${COSMOFLOW_SLURM_STATE:-/var/spool/cosmoflow-slurm}"
WAIT="${COSMOFLOW_SLURM_WAIT:-60}"
CONF=/etc/slurm/slurm.conf
MARKER="cosmoflow-local-slurm"
START=$SECONDS

unavailable() {
    echo "slurm-setup: unavailable: $*"
    exit 0
}

node_state() {  # the node's state as sinfo prints it (idle, mix, alloc, down*, ...), or nothing
    timeout 10 sinfo --noheader --format=%T 2>/dev/null | head -n 1
}

slurm_answers() {
    command -v scontrol >/dev/null 2>&1 && command -v sinfo >/dev/null 2>&1 || return 1
    timeout 10 scontrol ping 2>/dev/null | grep -q "is UP" || return 1
    case "$(node_state)" in idle | mixed | mix | allocated | alloc | completing | comp) return 0 ;; esac
    return 1
}

if slurm_answers; then
    echo "slurm-setup: ready (already running; node $(node_state))"
    exit 0
fi

[ "$(id -u)" = 0 ] || unavailable "Slurm is not running and setting it up needs root (run tests/slurm/setup.sh as root)"

# 1. packages
missing=()
for pair in slurmctld:slurmctld slurmd:slurmd sinfo:slurm-client munged:munge; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
    command -v apt-get >/dev/null 2>&1 || unavailable "no apt-get to install ${missing[*]}"
    echo "slurm-setup: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt_log="$(mktemp)"
    if ! { apt-get update -q && apt-get install -y -q --no-install-recommends "${missing[@]}"; } >"$apt_log" 2>&1; then
        tail -n 5 "$apt_log"
        unavailable "apt-get could not install ${missing[*]} (log: $apt_log)"
    fi
    rm -f "$apt_log"
fi

# 2. munge: key and daemon
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --keyfile=/etc/munge/munge.key >/dev/null 2>&1 \
        || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none \
        || unavailable "could not create /etc/munge/munge.key"
fi
chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    runuser -u munge -- /usr/sbin/munged >/dev/null 2>&1 || unavailable "munged did not start (see /var/log/munge/munged.log)"
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 || unavailable "munged does not answer (see /var/log/munge/munged.log)"
fi

# 3. slurm.conf for this host (never overwrite a configuration that this script did not write)
if [ -e "$CONF" ] && ! grep -q "$MARKER" "$CONF"; then
    unavailable "$CONF exists and was not written by this script; not touching it"
fi
host="$(hostname -s)"
node_line="$(slurmd -C 2>/dev/null | grep '^NodeName=')" || unavailable "slurmd -C does not describe this node"
memory="$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$node_line")"
[ -n "$memory" ] || unavailable "slurmd -C gave no RealMemory: $node_line"
# a little below what the node has, so that a busy node is not drained for low memory
node_line="$(sed "s/RealMemory=[0-9]*/RealMemory=$((memory * 9 / 10))/" <<<"$node_line")"
install -d -m 0755 /etc/slurm "$STATE" "$STATE/slurmctld" "$STATE/slurmd"
new_conf="$(sed -e "s|@HOST@|$host|g" -e "s|@NODE_LINE@|$node_line|" -e "s|@STATE@|$STATE|g" "$HERE/slurm.conf.in")"
if [ ! -e "$CONF" ] || [ "$(cat "$CONF")" != "$new_conf" ]; then
    printf '%s\n' "$new_conf" >"$CONF"
    changed=1
fi

# 4. daemons, without systemd
running() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
if running "$STATE/slurmctld.pid" && [ -n "${changed:-}" ]; then
    kill "$(cat "$STATE/slurmctld.pid")" 2>/dev/null; sleep 1
fi
if running "$STATE/slurmd.pid" && [ -n "${changed:-}" ]; then
    kill "$(cat "$STATE/slurmd.pid")" 2>/dev/null; sleep 1
fi
running "$STATE/slurmctld.pid" || slurmctld || unavailable "slurmctld did not start: $(tail -n 3 "$STATE/slurmctld.log" 2>/dev/null)"
running "$STATE/slurmd.pid" || slurmd || unavailable "slurmd did not start: $(tail -n 3 "$STATE/slurmd.log" 2>/dev/null)"

# 5. wait for an idle node
deadline=$((SECONDS + WAIT))
until slurm_answers; do
    if [ $SECONDS -ge $deadline ]; then
        echo "--- $STATE/slurmctld.log"; tail -n 5 "$STATE/slurmctld.log" 2>/dev/null
        echo "--- $STATE/slurmd.log"; tail -n 5 "$STATE/slurmd.log" 2>/dev/null
        unavailable "the node is not idle after ${WAIT} s (sinfo: '$(node_state)'; logs in $STATE)"
    fi
    case "$(node_state)" in
        down* | drain* | fail*) scontrol update NodeName="$host" State=RESUME >/dev/null 2>&1 ;;
    esac
    sleep 1
done
echo "slurm-setup: ready (started in $((SECONDS - START)) s; node $(node_state); config $CONF)"
