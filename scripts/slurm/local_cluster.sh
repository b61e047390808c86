#!/usr/bin/env bash
# A real single-node SLURM on this machine, for the tests marked `slurm` (tests/test_slurm.py) and for
# trying scripts/slurm/pretrain.sbatch by hand: munged, slurmctld and slurmd on localhost, with job
# accounting (slurmdbd on a local MariaDB) so that `sacct` shows each allocation of a requeued job.
#   make slurm-cluster             start it (as root; idempotent: what already runs is left running)
#   scripts/slurm/local_cluster.sh stop
# Needs Debian's packages: apt-get install slurm-wlm slurmdbd munge mariadb-server (.ci/run does).
# Seen working with Slurm 22.05 from Debian 12 as root, without systemd or cgroups: processes are
# tracked by their parent pids (proctrack/linuxproc), tasks are not bound (task/none), no cgroup.conf.
# Exits non-zero, with the daemons' last log lines, when the node does not come up idle.
set -euo pipefail

CONF_DIR=${SLURM_CONF_DIR:-/etc/slurm}
LOG_DIR=/var/log/slurm
SPOOL=/var/spool

up() { sinfo --noheader --format=%T 2>/dev/null | grep -qxE "idle|mixed|allocated|completing"; }

stop() {
    scontrol shutdown 2>/dev/null || true  # slurmctld and every slurmd
    for pidfile in /run/slurmdbd.pid /run/munge/munged.pid; do
        [[ -f $pidfile ]] && kill "$(cat "$pidfile")" 2>/dev/null || true
    done
    mariadb-admin shutdown 2>/dev/null || true
}

if [[ ${1:-start} == stop ]]; then
    stop
    exit 0
fi
if up; then
    echo "slurm-cluster: already up: $(sinfo --noheader --format='%P %D %T %N')"
    exit 0
fi
if [[ $(id -u) != 0 ]]; then
    echo "slurm-cluster: run as root (it writes $CONF_DIR and starts system daemons)" >&2
    exit 1
fi
for cmd in munged slurmctld slurmd slurmdbd mariadbd; do
    command -v "$cmd" >/dev/null || {
        echo "slurm-cluster: $cmd is missing: apt-get install slurm-wlm slurmdbd munge mariadb-server" >&2
        exit 1
    }
done
mkdir -p "$CONF_DIR" "$LOG_DIR" "$SPOOL/slurmctld" "$SPOOL/slurmd" /run/munge /run/mysqld
chown munge:munge /run/munge
chown mysql:mysql /run/mysqld
HOST=$(hostname -s)

# What slurmd finds on this machine: CPUs, sockets, cores, threads, memory (awk reads all of it: head
# would exit first, and the SIGPIPE to slurmd would fail this script under pipefail).
NODE=$(slurmd -C | awk 'NR == 1')
cat >"$CONF_DIR/slurm.conf" <<EOF
# Written by scripts/slurm/local_cluster.sh: one node on localhost, everything as root.
ClusterName=lmpretrain
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits cred_expire seconds before it may start again (default 120).
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Start a job that has become eligible (a requeued one) within seconds, not at the next minute.
SchedulerParameters=sched_interval=2,bf_interval=2
ReturnToService=2
StateSaveLocation=$SPOOL/slurmctld
SlurmdSpoolDir=$SPOOL/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/linux
$NODE State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
cat >"$CONF_DIR/slurmdbd.conf" <<EOF
# Written by scripts/slurm/local_cluster.sh: accounting in the local MariaDB, reached as root over its socket.
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
PidFile=/run/slurmdbd.pid
LogFile=$LOG_DIR/slurmdbd.log
EOF
chmod 600 "$CONF_DIR/slurmdbd.conf"

running() { pgrep -x -r R,S,D "$1" >/dev/null; }  # not a zombie left by a daemon's fork
wait_for() {  # wait_for WHAT SECONDS COMMAND...: until COMMAND succeeds
    local what=$1 seconds=$2
    shift 2
    for _ in $(seq $((seconds * 5))); do
        "$@" >/dev/null 2>&1 && return 0
        sleep 0.2
    done
    echo "slurm-cluster: $what did not come up in ${seconds} s" >&2
    tail -n 20 "$LOG_DIR"/*.log >&2 2>/dev/null || true
    exit 1
}

[[ -s /etc/munge/munge.key ]] || mungekey --create --keyfile=/etc/munge/munge.key
chown munge:munge /etc/munge/munge.key
chmod 400 /etc/munge/munge.key
running munged || runuser -u munge -- munged
wait_for munged 10 munge -n
if ! running mariadbd; then
    setsid mariadbd --user=mysql --bind-address=127.0.0.1 >"$LOG_DIR/mariadb.log" 2>&1 </dev/null &
fi
wait_for mariadb 30 mariadb -e 'select 1'
running slurmdbd || slurmdbd
wait_for slurmdbd 30 sacctmgr --noheader list cluster
running slurmctld || slurmctld
wait_for slurmctld 30 scontrol ping
running slurmd || slurmd
wait_for "the node ($NODE)" 60 up
echo "slurm-cluster: up: $(sinfo --noheader --format='%P %D %T %N'), $(slurmctld -V)"
