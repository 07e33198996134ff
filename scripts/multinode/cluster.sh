#!/usr/bin/env bash
# A real Slurm cluster of NODES (default 3) nodes on this one machine, for the multi-node tests (tests/multinode).
#
#   sudo scripts/multinode/cluster.sh install     # Debian's slurm-wlm and munge (once per machine)
#   sudo scripts/multinode/cluster.sh up          # munged, slurmctld, one slurmd per node; waits until all idle
#   sudo scripts/multinode/cluster.sh kill-job-processes 2   # node 2 loses every process of the running job
#   sudo scripts/multinode/cluster.sh down        # stops all of it and removes the namespaces and the bridges
#   scripts/multinode/cluster.sh check            # exit 0 where it can run (root, ip netns, unshare); else one line
#
# Node k (1..NODES) is the network namespace ngrpo-nK with hostname nK (its own UTS namespace), its own PID
# namespace (it sees only its processes) and its own mount namespace, in which /tmp and /dev/shm are fresh tmpfs (Ray's session files and object store stay per node, as on
# real machines) and /etc/hosts maps nK to 127.0.1.1 (as on many cluster nodes: the hostname resolves to loopback).
# Everything else (the repo, the venv, $HOME) is the machine's own filesystem: the shared filesystem of a cluster
# (a repo checked out under /tmp is bound into each node's /tmp at the same path).
# Two interfaces per node, each one end of a veth pair on a bridge that exists only inside this machine, with no
# route out: eth0 10.77.0.1K on ngrpo-br0 (10.77.0.1, the cluster network: slurmctld, Ray), and eth1 10.78.0.1K on
# ngrpo-br1 (a second network, so that nothing can pick "the" interface by chance).
# slurmctld runs on the host at 10.77.0.1; slurmd of node k runs inside node k's namespaces (`slurmd -N nK`), so
# every job step it starts (and everything those start) lives there too.
#
# Environment: NODES (default 2), STATE_DIR (default /var/tmp/nemo_grpo_multinode: configs, logs, spool, pids;
# not /tmp, which each node has its own of), NODE_CPUS (Slurm CPUs per node, default 1).
set -euo pipefail

NODES="${NODES:-3}"
STATE_DIR="${STATE_DIR:-/var/tmp/nemo_grpo_multinode}"
NODE_CPUS="${NODE_CPUS:-1}"
NET0=10.77.0 NET1=10.78.0
BR0=ngrpo-br0 BR1=ngrpo-br1
CTLD_HOST="$(hostname -s)"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

ns() { echo "ngrpo-n$1"; }
say() { echo "[multinode] $*"; }

check() {  # can this machine run the cluster? one line and exit 1 when not
  local why=""
  [[ "$(id -u)" == 0 ]] || why="needs root (network namespaces, mounts, slurmd)"
  [[ -z "$why" ]] && ! command -v ip >/dev/null && why="no 'ip' command (iproute2)"
  [[ -z "$why" ]] && ! command -v unshare >/dev/null && why="no 'unshare' command (util-linux)"
  if [[ -z "$why" ]] && ! ip netns add ngrpo-probe 2>/dev/null; then why="cannot create a network namespace"; fi
  ip netns del ngrpo-probe 2>/dev/null || true
  [[ -z "$why" ]] && ! unshare --uts --mount true 2>/dev/null && why="cannot create UTS and mount namespaces"
  if [[ -n "$why" ]]; then echo "multinode cluster unavailable: $why"; return 1; fi
}

install() {  # Debian's packages; apt-get update only when the lists are missing them
  if command -v slurmctld >/dev/null && command -v munged >/dev/null; then return 0; fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq slurm-wlm munge >/dev/null
}

write_configs() {
  mkdir -p "$STATE_DIR"/{log,spool,ctld,hosts}
  local nodes="" k
  {
    echo "ClusterName=ngrpo"
    echo "SlurmctldHost=$CTLD_HOST($NET0.1)"
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "AuthType=auth/munge"
    # a requeued job waits out the credential's lifetime before it starts again (default 120 s; real clusters keep it)
    echo "AuthInfo=cred_expire=10"
    # and then starts at the backfill scheduler's next pass (default every 30 s): every second here
    echo "SchedulerParameters=bf_interval=1"
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "SelectType=select/linear"
    echo "MpiDefault=none"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "AccountingStorageType=accounting_storage/none"
    echo "StateSaveLocation=$STATE_DIR/ctld"
    echo "SlurmctldPidFile=$STATE_DIR/slurmctld.pid"
    echo "SlurmctldLogFile=$STATE_DIR/log/slurmctld.log"
    echo "SlurmdSpoolDir=$STATE_DIR/spool/%n"
    echo "SlurmdPidFile=$STATE_DIR/spool/%n.pid"
    echo "SlurmdLogFile=$STATE_DIR/log/slurmd-%n.log"
    echo "ReturnToService=2"
    echo "SlurmdTimeout=30"
    echo "KillWait=5"
    echo "MinJobAge=300"
    echo "JobRequeue=0"
    for k in $(seq 1 "$NODES"); do
      echo "NodeName=n$k NodeAddr=$NET0.1$k CPUs=$NODE_CPUS RealMemory=2000 State=UNKNOWN"
      nodes+="${nodes:+,}n$k"
    done
    echo "PartitionName=main Nodes=$nodes Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
  } > "$STATE_DIR/slurm.conf"
  echo "CgroupPlugin=cgroup/v1" > "$STATE_DIR/cgroup.conf"  # autodetect fails on this hybrid hierarchy
  for k in $(seq 1 "$NODES"); do
    printf '127.0.0.1 localhost\n127.0.1.1 n%s\n' "$k" > "$STATE_DIR/hosts/n$k"
    mkdir -p "$STATE_DIR/spool/n$k"
  done
}

bridge_up() {  # bridge_up NAME ADDRESS
  ip link show "$1" >/dev/null 2>&1 || ip link add "$1" type bridge
  ip addr replace "$2/24" dev "$1"
  ip link set "$1" up
}

node_network() {  # node_network K: the namespace, eth0 on BR0 and eth1 on BR1
  local k=$1 n; n=$(ns "$1")
  ip netns add "$n"
  ip link add "ngv$k-0" type veth peer name eth0 netns "$n"
  ip link add "ngv$k-1" type veth peer name eth1 netns "$n"
  ip link set "ngv$k-0" master "$BR0" up
  ip link set "ngv$k-1" master "$BR1" up
  ip -n "$n" addr add "$NET0.1$k/24" dev eth0
  ip -n "$n" addr add "$NET1.1$k/24" dev eth1
  ip -n "$n" link set lo up
  ip -n "$n" link set eth0 up
  ip -n "$n" link set eth1 up
}

start_slurmd() {  # start_slurmd K: slurmd in node K's network, UTS, mount and PID namespaces
  local k=$1 keep=""
  # a checkout under /tmp (a CI clone) stays visible on the nodes: bound into their own /tmp at the same path
  [[ "$REPO" == /tmp/* ]] && keep="$REPO"
  # PID namespace: a node sees only its own processes, as a machine does (`ray stop` there ends its node's Ray,
  # not every Ray on this machine). Its PID 1 is a shell that keeps slurmd (in the foreground) and reaps orphans.
  ip netns exec "$(ns "$k")" unshare --uts --mount --pid --fork --mount-proc --propagation private -- bash -c "
    hostname n$k
    ${keep:+mkdir -p '$STATE_DIR/host-tmp'; mount --bind /tmp '$STATE_DIR/host-tmp'}
    mount -t tmpfs -o mode=1777 tmpfs /tmp
    ${keep:+mkdir -p '$keep'; mount --bind '$STATE_DIR/host-tmp/${keep#/tmp/}' '$keep'}
    mount -t tmpfs -o mode=1777 tmpfs /dev/shm
    mount --bind '$STATE_DIR/hosts/n$k' /etc/hosts
    slurmd -D -f '$STATE_DIR/slurm.conf' -N n$k &
    wait" </dev/null >>"$STATE_DIR/log/start.log" 2>&1 &
}

node_daemons() {  # node_daemons K: host pids of node K's own processes: unshare, its init shell (PID 1), slurmd
  local pid
  for pid in $(ip netns pids "$(ns "$1")" 2>/dev/null); do
    if [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" =~ ^(slurmd|unshare)$ ]] \
        || [[ "$(awk '/^NSpid:/ {print $NF}' "/proc/$pid/status" 2>/dev/null)" == 1 ]]; then
      echo "$pid"
    fi
  done
}

wait_idle() {  # every node idle in sinfo, or fail after 60 s
  local deadline=$((SECONDS + 60)) idle
  while true; do
    idle=$(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 == "idle"' | wc -l)
    [[ "$idle" -ge "$NODES" ]] && return 0
    if (( SECONDS >= deadline )); then
      say "only $idle of $NODES node(s) idle after 60 s:"; sinfo -N 2>&1 || true
      tail -n 20 "$STATE_DIR"/log/*.log >&2 || true
      return 1
    fi
    sleep 0.5
  done
}

up() {
  check
  install
  down >/dev/null 2>&1 || true
  write_configs
  export SLURM_CONF="$STATE_DIR/slurm.conf"
  if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    mkdir -p /run/munge  # a container has no systemd to make it
    munged --force --pid-file="$STATE_DIR/munged.pid" --log-file="$STATE_DIR/log/munged.log"  # key: the package's
  fi
  bridge_up "$BR0" "$NET0.1"
  bridge_up "$BR1" "$NET1.1"
  local k
  for k in $(seq 1 "$NODES"); do node_network "$k"; done
  slurmctld -f "$SLURM_CONF"
  for k in $(seq 1 "$NODES"); do start_slurmd "$k"; done
  wait_idle
  say "up: $NODES node(s) $(sinfo -h -N -o '%N@%t' | tr '\n' ' ')(SLURM_CONF=$SLURM_CONF)"
}

kill_pidfile() {  # end the process of a pid file (SIGTERM, then SIGKILL after 5 s); daemons remove their own file
  local f=$1 pid i
  [[ -f "$f" ]] || return 0
  pid=$(cat "$f")
  kill "$pid" 2>/dev/null || true
  for i in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$f"
}

kill_namespace() {  # kill_namespace K [SPARE_PID...]: SIGKILL every process in node K's network namespace but these
  local k=$1 pid; shift
  for pid in $(ip netns pids "$(ns "$k")" 2>/dev/null); do
    [[ " $* " == *" $pid "* ]] || kill -9 "$pid" 2>/dev/null || true
  done
}

kill_job_processes() {  # node K loses every process of its jobs (slurmstepd, Ray, workers); its slurmd lives on
  local k=$1
  kill_namespace "$k" $(node_daemons "$k")
  say "node n$k: every process of its jobs killed"
}

down() {
  export SLURM_CONF="$STATE_DIR/slurm.conf"
  local k
  for k in $(seq 1 "$NODES"); do
    kill $(node_daemons "$k") 2>/dev/null || true  # slurmd ends its steps; the node's init then exits
  done
  sleep 1
  for k in $(seq 1 "$NODES"); do kill_namespace "$k"; done
  kill_pidfile "$STATE_DIR/slurmctld.pid"
  kill_pidfile "$STATE_DIR/munged.pid"
  for k in $(seq 1 "$NODES"); do
    ip netns del "$(ns "$k")" 2>/dev/null || true
    ip link del "ngv$k-0" 2>/dev/null || true
    ip link del "ngv$k-1" 2>/dev/null || true
  done
  ip link del "$BR0" 2>/dev/null || true
  ip link del "$BR1" 2>/dev/null || true
  rm -rf "$STATE_DIR/ctld" "$STATE_DIR/spool"
  say "down"
}

case "${1:-}" in
  check) check ;;
  install) install ;;
  up) up ;;
  down) down ;;
  kill-job-processes) kill_job_processes "${2:?node index}" ;;
  *) echo "usage: $0 check|install|up|down|kill-job-processes K" >&2; exit 2 ;;
esac
