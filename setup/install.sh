#!/usr/bin/env bash
# Everything a fresh Debian 12 CPU machine (as root) needs before `snakemake` and `pytest`:
# container tooling, gcc and binutils (the tiny base image's CUDA stand-ins, scripts/lib/base_image/elf_stubs.py), graphviz for
# the DAG picture, a single-node SLURM cluster's packages (setup/start-slurm.sh starts it; tests/e2e/test_slurm.py runs
# the cluster profile on it), the driver's Python packages, and a running Docker daemon.
# Stage venvs (envs/*.txt) are not made here: the DAG's `venv` rule builds them.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v dockerd >/dev/null || ! command -v mmdebstrap >/dev/null || ! command -v dot >/dev/null \
  || ! command -v pigz >/dev/null || ! command -v slurmdbd >/dev/null || ! command -v mariadbd >/dev/null \
  || ! command -v gcc >/dev/null || ! command -v readelf >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io buildah mmdebstrap graphviz pigz gcc binutils \
    slurm-wlm slurmdbd munge mariadb-server >/dev/null
fi
python3 -m pip install -q --disable-pip-version-check -r requirements.txt
bash setup/start-slurm.sh --forget-stopped
bash setup/start-docker.sh
