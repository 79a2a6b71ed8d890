#!/usr/bin/env bash
# The GPU proof's commands on the lent host (one device `run` call each, back to back: the host goes back when idle).
#   bash gpu_proof/device.sh chunk NAME K       copy a staged bundle chunk (.device-stage/NAME/cK, carried) to /root/stash
#   bash gpu_proof/device.sh start DRIVER_ARGS  unpack the bundles, start gpu_proof/driver.py detached (--variants ...);
#                                               it runs the tree of .device-stage/tree/c0/tree.tar when that is carried
#                                               (`git archive -o .device-stage/tree/c0/tree.tar HEAD`: a commit, not
#                                               whatever the working tree holds), else this working tree
#   bash gpu_proof/device.sh wait SECONDS       follow the driver; bring results.tar.gz and driver.log back in $OUT
#                                               (ask for a minute less than the device time left: a call cut at the
#                                               budget brings nothing back)
# Bundles (how they reach an offline host is site-specific), xz-packed site-packages trees split in parts in
# /root/stash: vLLM (NAME.tar.xz.*, NAME from VLLM_BUNDLE, default `vllm`: the release engine.vllm names, with the
# torch and NCCL it pins where the host's differ) and llmcompressor (llmcompressor.tar.xz.*), and for suffix decoding
# arctic-inference built the way scripts/lib/local_builds.py builds it (a wheel). A trained checkpoint to serve
# (--checkpoint, --quantized) travels as models.tar.
# The driver runs from a copy of the tree in $STATE/repo, so a later call's fresh tree does not move under it.
set -u
STATE=${STATE:-/tmp/gp}
case "$1" in
  chunk)
    mkdir -p /root/stash && cp ".device-stage/$2/c$3/"* /root/stash/ && ls -la /root/stash ;;
  start)
    if [ -f "$STATE/driver.pid" ] && kill -0 "$(cat "$STATE/driver.pid")" 2>/dev/null; then
      echo "driver already running (pid $(cat "$STATE/driver.pid"))"; exit 0
    fi
    mkdir -p "$STATE/repo"
    if [ -f .device-stage/tree/c0/tree.tar ]; then tar -C "$STATE/repo" -xf .device-stage/tree/c0/tree.tar
    else tar --exclude=./.device-stage --exclude=./.git --exclude=./.venvs -cf - . | tar -C "$STATE/repo" -xf -; fi
    rm -f "$STATE/driver.done"
    setsid nohup bash "$STATE/repo/gpu_proof/device.sh" run "${@:2}" >> "$STATE/driver.log" 2>&1 < /dev/null &
    sleep 2; cat "$STATE/driver.log" ;;
  run)  # (detached) unpack, then drive
    echo $$ > "$STATE/driver.pid"
    cd "$STATE/repo"
    t0=$(date +%s)
    bundle=${VLLM_BUNDLE:-vllm}
    export SITE_VLLM=/tmp/site-$bundle
    if ls /root/stash/$bundle.whl.tar.* >/dev/null 2>&1; then  # its wheels as they are (already compressed)
      [ -d "$SITE_VLLM" ] || (mkdir -p /tmp/whl-$bundle && cat /root/stash/$bundle.whl.tar.* | tar -C /tmp/whl-$bundle -x \
        && python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE_VLLM" /tmp/whl-$bundle/wheels/*.whl) &
    else
      [ -d "$SITE_VLLM" ] || (cat /root/stash/$bundle.tar.xz.* | xz -d -T4 | tar -C /tmp -x) &
    fi
    [ -d /tmp/site-llmcompressor ] || (cat /root/stash/llmcompressor.tar.xz.* | xz -d -T4 | tar -C /tmp -x) &
    wait
    # arctic-inference without its vllm.general_plugins entry point (it would patch vLLM wholesale)
    for wheel in /root/stash/arctic_inference-*.whl; do
      [ -f "$wheel" ] && [ ! -d "$SITE_VLLM/arctic_inference" ] || continue
      python3 -m zipfile -e "$wheel" "$SITE_VLLM/" && rm -f "$SITE_VLLM"/arctic_inference-*.dist-info/entry_points.txt
    done
    mkdir -p /tmp/site-extra  # jsonschema & co. for the driver's config check and quantize's report check
    for m in jsonschema jsonschema_specifications referencing rpds attrs; do
      [ -d "/tmp/site-extra/$m" ] || cp -r "$SITE_VLLM/$m" /tmp/site-extra/ 2>/dev/null || true
    done
    cp -r "$SITE_VLLM"/{jsonschema,referencing,rpds_py,jsonschema_specifications,attrs}-*.dist-info /tmp/site-extra/ 2>/dev/null
    models=/root/stash/models.tar
    [ -f "$models" ] && [ ! -d /tmp/models ] && mkdir -p /tmp/models && tar -C /tmp/models -xf "$models"
    # the engine must import before any step is spent on it
    PYTHONPATH=$SITE_VLLM python3 -c 'import torch, vllm; print("engine:", "vllm", vllm.__version__, "torch", torch.__version__, torch.cuda.get_device_name(0))' \
      || { echo "driver exit: the engine does not import"; touch "$STATE/driver.done"; exit 1; }
    echo "[unpack] $(( $(date +%s) - t0 )) s"
    env PYTHONPATH=/tmp/site-extra PYTHONUNBUFFERED=1 python3 -u gpu_proof/driver.py --state "$STATE" "${@:2}"
    echo "driver exit $?"
    touch "$STATE/driver.done" ;;
  wait)
    limit=${2:-560}; t0=$(date +%s)
    while :; do
      [ -d "$STATE/results" ] && tar czf "$OUT/results.tar.gz.tmp" -C "$STATE" results \
        && mv "$OUT/results.tar.gz.tmp" "$OUT/results.tar.gz"
      [ -f "$STATE/driver.log" ] && tail -c 3000000 "$STATE/driver.log" > "$OUT/driver.log"
      [ -f "$STATE/driver.done" ] && { echo "driver finished"; break; }
      [ $(( $(date +%s) - t0 )) -ge "$limit" ] && { echo "still running after $limit s"; break; }
      sleep 10
    done
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
    grep -E '^\[|===|FAILED|ready after' "$STATE/driver.log" | tail -60 ;;
esac
