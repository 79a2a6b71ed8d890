#!/usr/bin/env bash
# Start a single-node SLURM cluster on this machine (Debian's slurm-wlm 22.05 + munge, accounting in slurmdbd on a
# local MariaDB so `sacct` answers, as on a real cluster) if none answers. Idempotent: run it before every
# `snakemake --profile profiles/slurm` on a machine that has no cluster of its own.
# The node declares this machine's CPUs and memory (`slurmd -C`) and its GPUs as gres only where /dev/nvidia* exist.
# Root is needed (the daemons run as root). Logs: /var/log/slurm/, /var/log/mariadb-slurm.log
set -euo pipefail

TIMEOUT_S=${SLURM_START_TIMEOUT_S:-60}
CLUSTER=pipeline
PARTITION=${SLURM_PARTITION_NAME:-pipeline}
CONF=/etc/slurm/slurm.conf
DBD_CONF=/etc/slurm/slurmdbd.conf
MARKER="# written by setup/start-slurm.sh"
LOGDIR=/var/log/slurm

fail() { echo "ERROR: $*" >&2; exit 1; }

wait_for() {  # $1 = what, $2.. = command that succeeds once it is up
  local what=$1 waited=0
  shift
  until "$@" >/dev/null 2>&1; do
    [ "$waited" -lt "$TIMEOUT_S" ] || return 1
    sleep 1; waited=$((waited + 1))
  done
  echo "$what ready (${waited}s)"
}

node_up() { sinfo -h -o %T 2>/dev/null | grep -qvE '^(down|drain|fail|unknown|not_responding)'; }

# --forget-stopped (setup/install.sh): this script's configuration of a cluster whose controller no longer runs (the
# machine restarted) is moved aside, nothing is started. With it in place every SLURM client command waits ~9 s for
# the missing controller, and snakemake-executor-plugin-slurm runs `scontrol show config` whenever snakemake starts:
# every snakemake call, SLURM or not, paid those 9 s. The next start writes the configuration again.
if [ "${1:-}" = --forget-stopped ]; then
  if grep -qF "$MARKER" "$CONF" 2>/dev/null && ! pgrep -x slurmctld >/dev/null; then
    mv "$CONF" "$CONF.stopped"
    echo "moved $CONF aside: its controller does not run (setup/start-slurm.sh starts one again)"
  fi
  exit 0
fi

# 1. The configuration (every SLURM command reads it): one node with this machine's CPUs and memory
node=$(slurmd -C | head -n 1)  # NodeName=<host> CPUs=... RealMemory=...
gres_types="" gres="" gres_conf=""
gpus=$(find /dev -maxdepth 1 -regex '/dev/nvidia[0-9]+' | sort -V)
if [ -n "$gpus" ]; then
  count=$(echo "$gpus" | wc -l)
  gres_types="GresTypes=gpu" gres=" Gres=gpu:$count"
  gres_conf=$(printf '%s\nNodeName=%s Name=gpu File=%s\n' "$MARKER" "$(hostname -s)" "$(echo "$gpus" | paste -sd, -)")
fi
wanted=$(cat <<EOF
$MARKER
ClusterName=$CLUSTER
SlurmctldHost=$(hostname -s)
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOGDIR/slurmctld.log
SlurmdLogFile=$LOGDIR/slurmd.log
# No cgroups: containers and VMs often do not delegate them; memory is enforced by polling every second instead.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=task=1
JobAcctGatherParams=OverMemoryKill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
# Snakemake's executor names each job's rule in its comment: kept, so sacct shows which rule a job ran.
AccountingStoreFlags=job_comment
ReturnToService=2
# A job's tasks run at the nice value of the sbatch that submitted it (root's too): a run started under nice
# leaves the CPUs to everything else on the machine (tests/e2e/test_slurm.py submits its time-limit run so).
PropagatePrioProcess=1
MpiDefault=none
$gres_types
$node State=UNKNOWN$gres
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
)
# A cluster that answers is kept, unless this script started it with another configuration (an older script, a
# changed machine).
ours_current() { ! grep -qF "$MARKER" "$CONF" 2>/dev/null || [ "$(cat "$CONF")" = "$wanted" ]; }
if node_up && sacct -n -X -S now >/dev/null 2>&1 && ours_current; then
  echo "SLURM already answers: $(sinfo -h -o '%P %D node(s) %T' | head -n 1)"
  exit 0
fi
[ "$(id -u)" = 0 ] || fail "no SLURM cluster answers and starting one needs root (run: sudo $0)"
for tool in munged slurmctld slurmd slurmdbd sacctmgr sinfo mariadbd mariadb; do
  command -v "$tool" >/dev/null || fail "$tool not found (apt-get install slurm-wlm slurmdbd munge mariadb-server)"
done
if [ -e "$CONF" ] && ! grep -qF "$MARKER" "$CONF"; then
  fail "$CONF is not this script's and its cluster does not answer (sinfo: $(sinfo 2>&1 | head -n 1)); start that cluster, or move the file away to let this script write a single-node one"
fi
cat >"$CONF" <<<"$wanted"
[ -z "$gres_conf" ] || cat >/etc/slurm/gres.conf <<<"$gres_conf"

mkdir -p "$LOGDIR" /var/spool/slurmctld /var/spool/slurmd /run/munge /run/mysqld
chown munge:munge /run/munge
chown mysql:mysql /run/mysqld

# 2. munge: SLURM's authentication
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  [ -s /etc/munge/munge.key ] || fail "/etc/munge/munge.key is missing (reinstall munge, or run mungekey)"
  runuser -u munge -- munged || fail "munged did not start; see /var/log/munge/munged.log"
  wait_for munge sh -c 'munge -n | unmunge' || fail "munge does not answer after ${TIMEOUT_S}s; see /var/log/munge/munged.log"
fi

# 3. MariaDB and slurmdbd: job accounting, which sacct (and Snakemake's SLURM executor) read
if ! mariadb -e 'select 1' >/dev/null 2>&1; then
  # setsid: the daemon must outlive this script and the shell that ran it
  setsid mariadbd --user=mysql --bind-address=127.0.0.1 >>/var/log/mariadb-slurm.log 2>&1 </dev/null &
  wait_for MariaDB mariadb -e 'select 1' || fail "MariaDB did not answer within ${TIMEOUT_S}s; see /var/log/mariadb-slurm.log"
fi
mariadb -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
  CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
  GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
cat >"$DBD_CONF" <<EOF
$MARKER
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
LogFile=$LOGDIR/slurmdbd.log
PidFile=/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
chmod 600 "$DBD_CONF"
if ! sacctmgr -n show cluster >/dev/null 2>&1; then
  slurmdbd || fail "slurmdbd did not start; see $LOGDIR/slurmdbd.log"
  wait_for slurmdbd sacctmgr -n show cluster || fail "slurmdbd did not answer within ${TIMEOUT_S}s; see $LOGDIR/slurmdbd.log"
fi
sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER" || sacctmgr -i add cluster "$CLUSTER" >/dev/null

# 4. slurmctld and slurmd. A running controller or node daemon from an earlier start would keep its old configuration.
scontrol shutdown >/dev/null 2>&1 || true
for daemon in slurmctld slurmd; do
  for _ in $(seq 10); do pgrep -x "$daemon" >/dev/null || break; sleep 1; done
  pkill -x "$daemon" 2>/dev/null || true
done
slurmctld || fail "slurmctld did not start; see $LOGDIR/slurmctld.log"
slurmd || fail "slurmd did not start; see $LOGDIR/slurmd.log"
if ! wait_for "SLURM node $(hostname -s)" node_up; then
  echo "tail of $LOGDIR/slurmctld.log and slurmd.log:" >&2
  tail -n 10 "$LOGDIR/slurmctld.log" "$LOGDIR/slurmd.log" >&2
  fail "the SLURM node did not come up within ${TIMEOUT_S}s: $(sinfo -h -o '%T %E' 2>&1 | head -n 1)"
fi
echo "SLURM ready: partition $PARTITION, $(sed -n 's/.*\(CPUs=[0-9]*\).*\(RealMemory=[0-9]*\).*/\1 \2 MB/p' <<<"$node")${gres:+,$gres}"
