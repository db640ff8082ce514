#!/usr/bin/env bash
# A one-node SLURM on this machine, for the tests of the emitted sbatch script (tests/test_slurm.py) and a
# developer's own tries: installs Debian's slurm-wlm and munge when absent, writes a configuration of its own
# (never /etc/slurm/slurm.conf: a machine's real one stays untouched) and starts munged, slurmctld and slurmd
# unless they already run. Root only; no cgroups (a container has none to give): processes tracked by their
# parent, tasks not bound. Idempotent. Prints the configuration's path: the clients need it as SLURM_CONF.
#   bash scripts/slurm.sh            # install when absent, start when not running
#   bash scripts/slurm.sh install    # install only (CI, in the background)
#   bash scripts/slurm.sh stop       # stop the daemons it started
set -euo pipefail
STATE=${BENCHTRAIN_SLURM_DIR:-/var/lib/benchtrain-slurm}
CONF="$STATE/slurm.conf"
export SLURM_CONF="$CONF"

if [ "$(id -u)" != 0 ]; then
  echo "scripts/slurm.sh: needs root (it installs packages and starts daemons as root)" >&2
  exit 1
fi

install() {
  if ! command -v slurmctld >/dev/null 2>&1 || ! command -v slurmd >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
    if [ ! -d /var/lib/apt/lists/partial ] || [ -z "$(ls /var/lib/apt/lists 2>/dev/null | grep -v -e lock -e partial)" ]; then
      apt-get update -qq
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
  fi
}

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop() {
  for daemon in slurmd slurmctld munged; do
    if running "$STATE/$daemon.pid"; then kill "$(cat "$STATE/$daemon.pid")"; fi
  done
}

case "${1:-start}" in
  install) install; exit 0 ;;
  stop) stop; exit 0 ;;
  start) ;;
  *) echo "scripts/slurm.sh: start | install | stop" >&2; exit 2 ;;
esac

install
mkdir -p "$STATE/ctld" "$STATE/d" "$STATE/munge"
chown munge:munge "$STATE/munge"

# munge: the authentication every SLURM message carries (its key comes with the package; made here when absent).
if [ ! -s /etc/munge/munge.key ]; then
  mungekey --create --keyfile /etc/munge/munge.key
  chown munge:munge /etc/munge/munge.key
  chmod 600 /etc/munge/munge.key
fi
if ! running "$STATE/munged.pid"; then
  mkdir -p /run/munge && chown munge:munge /run/munge
  runuser -u munge -- munged --pid-file "$STATE/munge/munged.pid" --log-file "$STATE/munge/munged.log"
  ln -sf "$STATE/munge/munged.pid" "$STATE/munged.pid"
fi

host=$(hostname -s)
# This machine as slurmd sees it (CPUs, sockets, cores, RealMemory), named as SLURM will look it up.
node=$(slurmd -C | head -n1 | sed "s/^NodeName=[^ ]*/NodeName=$host NodeAddr=127.0.0.1/")
cat >"$CONF.new" <<EOF
ClusterName=benchtrain
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
# No cgroups: processes tracked through their parents, tasks not bound to cores.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
# A finished job leaves squeue/scontrol after 10 s (the tests read its state before), the node is back by itself.
MinJobAge=10
ReturnToService=2
KillWait=30
$node State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
mv "$CONF.new" "$CONF"

if ! running "$STATE/slurmctld.pid"; then
  slurmctld -f "$CONF"
fi
if ! running "$STATE/slurmd.pid"; then
  slurmd -f "$CONF"
fi
# Ready when the node takes jobs (about 20 s on a fresh start).
for _ in $(seq 1 120); do
  if sinfo -h -N -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
    echo "$CONF"
    exit 0
  fi
  sleep 0.5
done
echo "scripts/slurm.sh: slurmd did not register with slurmctld within 60 s; see $STATE/slurmctld.log and $STATE/slurmd.log" >&2
exit 1
