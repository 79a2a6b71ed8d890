#!/usr/bin/env bash
# unpack vLLM, build the checkpoint, then gpu_proof/experiments/spy_start.py detached (results in /tmp/spyout)
# py-spy: pip download --no-deps --only-binary=:all: --platform manylinux2014_x86_64 py-spy -d .device-stage/pyspy
set -x
cd "$(dirname "$0")/../.."
mkdir -p /tmp/pyspy && cp .device-stage/pyspy/*.whl /root/stash/ 2>/dev/null; python3 -m pip install --no-deps --no-index --target /tmp/pyspy /root/stash/py_spy-*.whl -q
ls /tmp/pyspy/bin
[ -d /tmp/site-vllm ] || (cat /root/stash/vllm.tar.xz.* | xz -d -T8 | tar -C /tmp -x)
mkdir -p /tmp/gp
[ -f /tmp/gp/weights/Qwen3.5-4B-random/config.json ] || python3 gpu_proof/build_checkpoint.py /tmp/gp/weights/Qwen3.5-4B-random /tmp/ck.json > $OUT/ck.log 2>&1
mkdir -p /tmp/spyout; cp -r . /tmp/spyrepo 2>/dev/null; cd /tmp/spyrepo && (setsid nohup env -u PYTHONPATH python3 gpu_proof/experiments/spy_start.py > /tmp/spyout/spy2.out 2>&1 &)
