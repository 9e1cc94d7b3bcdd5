#!/usr/bin/env bash
# A real single-node SLURM cluster for CI: Debian's slurm-wlm and munge, with fake GPU GRES.
#
#   bash scripts/slurm-ci-cluster.sh          install (apt-get, as root), configure, start; idempotent
#   bash scripts/slurm-ci-cluster.sh stop     stop the daemons this script started
#   bash scripts/slurm-ci-cluster.sh status   sinfo + the node's GRES
#
# The node advertises $FAKE_GPUS GPUs (GRES count only, no device files): sbatch --gpus=N is
# scheduled and accounted exactly as on a GPU node, but nothing is bound. There is no slurmdbd, so
# sacct has no data: status polling must go through squeue, which needs a long MinJobAge.
# No systemd is assumed; the daemons run as root and log under /var/log/slurm.
set -euo pipefail

FAKE_GPUS=${FAKE_GPUS:-4}
PARTITION=${PARTITION:-gpu}
CONF=/etc/slurm
LOGS=/var/log/slurm
STATE=/var/lib/slurm

log() { echo "slurm-ci-cluster: $*"; }

install() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
     && command -v sbatch >/dev/null; then
    return
  fi
  [ "$(id -u)" = 0 ] || { echo "slurm-ci-cluster: run as root (apt-get and the daemons need it)" >&2; exit 1; }
  log "installing slurm-wlm and munge"
  export DEBIAN_FRONTEND=noninteractive
  local try
  for try in 1 2 3; do  # the package mirror drops a download now and then: try again before failing CI
    apt-get update -qq && apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null && return
    log "apt-get failed (try $try of 3)"
    sleep $((try * 15))
  done
  echo "slurm-ci-cluster: slurm-wlm and munge did not install (apt-get failed three times)" >&2
  exit 1
}

write_conf() {
  local host cpus mem_mb
  host=$(hostname -s)
  cpus=$(nproc)
  # leave 1 GB to the OS so slurmd never drains the node for "low RealMemory"
  mem_mb=$(awk '/MemTotal/ {printf "%d", $2 / 1024 - 1024}' /proc/meminfo)
  mkdir -p "$CONF" "$LOGS" "$STATE/slurmctld" "$STATE/slurmd"
  cat > "$CONF/slurm.conf.new" <<EOF
# written by scripts/slurm-ci-cluster.sh
ClusterName=hybridrl-ci
SlurmctldHost=${host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$STATE/slurmctld
SlurmdSpoolDir=$STATE/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
# no cgroup plugins: CI machines are often containers without a delegated cgroup tree
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
GresTypes=gpu
# squeue is the only status source without slurmdbd: keep finished jobs visible for 10 minutes
MinJobAge=600
# time between SIGTERM and SIGKILL when a job is cancelled, preempted or requeued
KillWait=30
JobRequeue=1
# a requeued job waits for the step credential lifetime before it may start again (default 120 s)
AuthInfo=cred_expire=30
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
MaxArraySize=1001
NodeName=${host} NodeAddr=127.0.0.1 CPUs=${cpus} RealMemory=${mem_mb} Gres=gpu:${FAKE_GPUS} State=UNKNOWN
PartitionName=${PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
  # Fake GPUs: plain files stand in for /dev/nvidiaN. slurmd counts them (a Count= line alone
  # registers 0 GPUs and drains the node); with TaskPlugin=task/none nothing is bound to them.
  mkdir -p "$STATE/fake-gpu"
  for i in $(seq 0 $((FAKE_GPUS - 1))); do touch "$STATE/fake-gpu/nvidia$i"; done
  printf 'AutoDetect=off\nNodeName=%s Name=gpu File=%s/fake-gpu/nvidia[0-%d]\n' \
    "$host" "$STATE" $((FAKE_GPUS - 1)) > "$CONF/gres.conf.new"
  local changed=0 f
  for f in slurm.conf gres.conf; do
    if ! cmp -s "$CONF/$f.new" "$CONF/$f"; then mv "$CONF/$f.new" "$CONF/$f"; changed=1; else rm -f "$CONF/$f.new"; fi
  done
  echo "$changed"
}

start_munge() {
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
  fi
  chown munge:munge /etc/munge/munge.key 2>/dev/null || true
  chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
  if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    log "starting munged"
    if id munge >/dev/null 2>&1; then
      su -s /bin/sh munge -c "/usr/sbin/munged --force" || /usr/sbin/munged --force
    else
      /usr/sbin/munged --force
    fi
    for _ in $(seq 20); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.5; done
  fi
  munge -n | unmunge >/dev/null || { echo "slurm-ci-cluster: munge does not work" >&2; exit 1; }
}

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop_daemon() {  # stop_daemon PIDFILE: only the daemon this script recorded
  if running "$1"; then
    kill "$(cat "$1")"
    for _ in $(seq 40); do running "$1" || break; sleep 0.25; done
  fi
  rm -f "$1"
}

start_slurm() {
  local restart=$1
  if [ "$restart" = 1 ]; then
    stop_daemon /run/slurmd.pid
    stop_daemon /run/slurmctld.pid
  fi
  if ! running /run/slurmctld.pid; then
    log "starting slurmctld"
    /usr/sbin/slurmctld
  fi
  for _ in $(seq 60); do scontrol ping 2>/dev/null | grep -q "is UP" && break; sleep 0.5; done
  if ! scontrol ping 2>/dev/null | grep -q "is UP"; then
    echo "slurm-ci-cluster: slurmctld did not come up; the end of $LOGS/slurmctld.log:" >&2
    tail -n 20 "$LOGS/slurmctld.log" >&2
    exit 1
  fi
  if ! running /run/slurmd.pid; then
    log "starting slurmd"
    /usr/sbin/slurmd
  fi
  local host state
  host=$(hostname -s)
  for _ in $(seq 60); do
    state=$(sinfo -h -n "$host" -o %T 2>/dev/null | head -1)
    case "$state" in idle|mixed|allocated) break ;; esac
    sleep 0.5
  done
  case "$state" in
    idle|mixed|allocated) ;;
    *) # a node left DOWN or DRAIN by an earlier run is put back
      scontrol update nodename="$host" state=resume 2>/dev/null || true
      sleep 1
      state=$(sinfo -h -n "$host" -o %T | head -1) ;;
  esac
  case "$state" in
    idle|mixed|allocated) ;;
    *) echo "slurm-ci-cluster: node $host is '$state'; see $LOGS/slurmd.log and $LOGS/slurmctld.log" >&2
       tail -n 20 "$LOGS/slurmd.log" "$LOGS/slurmctld.log" >&2 || true
       exit 1 ;;
  esac
}

case "${1:-up}" in
  up)
    install
    changed=$(write_conf)
    start_munge
    start_slurm "$changed"
    sinfo -o "%P %N %T %c %m %G"
    ;;
  stop)
    stop_daemon /run/slurmd.pid
    stop_daemon /run/slurmctld.pid
    ;;
  status)
    sinfo -o "%P %N %T %c %m %G"
    scontrol show node "$(hostname -s)" | grep -E "Gres|CfgTRES|State"
    ;;
  *) echo "usage: $0 [up|stop|status]" >&2; exit 2 ;;
esac
