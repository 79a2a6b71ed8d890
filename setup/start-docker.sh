#!/usr/bin/env bash
# Start Debian's Docker daemon if none answers. Idempotent: safe to run before every pipeline run.
# Root is needed (the daemon runs as root). Log: /var/log/dockerd-pipeline.log
set -euo pipefail

LOG=/var/log/dockerd-pipeline.log
TIMEOUT_S=${DOCKERD_TIMEOUT_S:-60}
DOCKERD=${DOCKERD:-/usr/sbin/dockerd}

if docker info >/dev/null 2>&1; then
  echo "docker daemon already answers"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "ERROR: no Docker daemon answers and starting one needs root (run: sudo $0)" >&2
  exit 1
fi
[ -x "$DOCKERD" ] || { echo "ERROR: $DOCKERD not found (apt-get install docker.io)" >&2; exit 1; }

start() {  # $1 = storage driver; returns 0 once `docker info` answers
  echo "starting dockerd --storage-driver=$1 (log: $LOG)"
  # setsid: the daemon must outlive this script and the shell that ran it
  setsid "$DOCKERD" --storage-driver="$1" >>"$LOG" 2>&1 </dev/null &
  local pid=$! waited=0
  while [ "$waited" -lt "$TIMEOUT_S" ]; do
    if docker info >/dev/null 2>&1; then
      echo "docker daemon ready (pid $pid, storage driver $1, ${waited}s)"
      return 0
    fi
    kill -0 "$pid" 2>/dev/null || { echo "dockerd with $1 exited; see $LOG" >&2; return 1; }
    sleep 1; waited=$((waited + 1))
  done
  echo "ERROR: dockerd (pid $pid) did not answer within ${TIMEOUT_S}s; see $LOG" >&2
  kill "$pid" 2>/dev/null || true
  return 1
}

# overlay2 builds and starts containers far faster than vfs; vfs works on any filesystem
start overlay2 || start vfs || { echo "ERROR: could not start a Docker daemon; tail of $LOG:" >&2; tail -n 20 "$LOG" >&2; exit 1; }
