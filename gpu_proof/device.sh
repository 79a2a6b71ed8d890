#!/usr/bin/env bash
# Commands of the GPU proof on the device host (one `run` call each, back to back, so the host stays warm):
#   bash gpu_proof/device.sh chunk NAME K     copy a staged bundle chunk (.device-stage/NAME/cK, carried) to /root/stash
#   bash gpu_proof/device.sh start            unpack the bundles, start gpu_proof/driver.py detached (setsid)
#   bash gpu_proof/device.sh restart          stop the driver and its server, start again (done steps are skipped)
#   bash gpu_proof/device.sh wait SECONDS     follow the driver; copy results.tar.gz and driver.log to $OUT (ask
#                                             for a minute less than the device time left: a call cut at the budget
#                                             brings nothing back, machine32's last 506 s)
#   bash gpu_proof/device.sh traces           the six newest kept profiler traces to $OUT (with wait's two files,
#                                             the eight files a call brings back)
# The driver runs from a copy of the tree in /tmp/gp/repo, so a later call's fresh tree does not move under it.
set -u
STATE=${STATE:-/tmp/gp}
case "$1" in
  chunk)
    mkdir -p /root/stash && cp ".device-stage/$2/c$3/"* /root/stash/ && ls -la /root/stash ;;
  restart)  # stop a running driver and the server it started (each its own session), then start again
    for f in "$STATE/driver.pid" "$STATE/server.pid"; do
      [ -f "$f" ] && kill -TERM -- "-$(cat "$f")" 2>/dev/null; true
    done
    sleep 5
    for f in "$STATE/driver.pid" "$STATE/server.pid"; do
      [ -f "$f" ] && kill -KILL -- "-$(cat "$f")" 2>/dev/null; rm -f "$f"
    done
    exec bash "$0" start "${@:2}" ;;
  start)
    if [ -f "$STATE/driver.pid" ] && kill -0 "$(cat "$STATE/driver.pid")" 2>/dev/null; then
      echo "driver already running (pid $(cat "$STATE/driver.pid"))"; exit 0
    fi
    mkdir -p "$STATE/repo"
    tar --exclude=./.device-stage --exclude=./.git -cf - . | tar -C "$STATE/repo" -xf -
    rm -f "$STATE/driver.done"
    setsid nohup bash "$STATE/repo/gpu_proof/device.sh" run "${@:2}" >> "$STATE/driver.log" 2>&1 < /dev/null &
    sleep 2; cat "$STATE/driver.log" ;;
  run)  # (detached) unpack, then drive
    echo $$ > "$STATE/driver.pid"
    cd "$STATE/repo"
    t0=$(date +%s)
    [ -d /tmp/site-vllm ] || (cat /root/stash/vllm.tar.xz.* | xz -d -T4 | tar -C /tmp -x) &
    [ -d /tmp/site-llmcompressor ] || (cat /root/stash/llmcompressor.tar.xz.* | xz -d -T4 | tar -C /tmp -x) &
    wait
    # suffix decoding's arctic-inference 0.1.1 (PyPI has only its source): a cp312 wheel built off the device the way
    # scripts/lib/local_builds.py builds it, carried as .device-stage/arctic/c0; unpacked into the vLLM bundle
    # without its vllm.general_plugins entry point (it would patch vLLM wholesale), as in the tiny serve venv
    for wheel in /root/stash/arctic_inference-*.whl; do
      [ -f "$wheel" ] && [ ! -d /tmp/site-vllm/arctic_inference ] || continue
      python3 -m zipfile -e "$wheel" /tmp/site-vllm/ && rm -f /tmp/site-vllm/arctic_inference-*.dist-info/entry_points.txt
    done
    # GemLite (PyPI `gemlite`, pure Python over the host's Triton), as pip would install it, entry point kept: its vLLM
    # backend does nothing unless the server's environment sets VLLM_GEMLITE_ENABLE
    for wheel in /root/stash/gemlite-*.whl; do
      [ -f "$wheel" ] && [ ! -d /tmp/site-vllm/gemlite ] || continue
      python3 -m zipfile -e "$wheel" /tmp/site-vllm/
    done
    # py-spy (a static binary in its wheel) for the driver's `spy` variants, outside every Python path
    for wheel in /root/stash/py_spy-*.whl; do
      [ -f "$wheel" ] && [ ! -x /tmp/pyspy/bin/py-spy ] || continue
      python3 -m pip install --no-deps --no-index --target /tmp/pyspy "$wheel" -q
    done
    mkdir -p /tmp/site-extra
    for m in jsonschema jsonschema_specifications referencing rpds; do
      [ -d "/tmp/site-extra/$m" ] || cp -r "/tmp/site-vllm/$m" /tmp/site-extra/ 2>/dev/null || true
    done
    cp -r /tmp/site-vllm/jsonschema-*.dist-info /tmp/site-vllm/referencing-*.dist-info \
      /tmp/site-vllm/rpds_py-*.dist-info /tmp/site-vllm/jsonschema_specifications-*.dist-info /tmp/site-extra/ 2>/dev/null || true
    echo "[unpack] $(( $(date +%s) - t0 )) s; $(ls /tmp/site-vllm | wc -l) entries in site-vllm, $(ls /tmp/site-llmcompressor 2>/dev/null | wc -l) in site-llmcompressor"
    env -u PYTHONPATH PYTHONUNBUFFERED=1 python3 -u gpu_proof/driver.py --state "$STATE" "${@:2}"
    echo "driver exit $?"
    touch "$STATE/driver.done" ;;
  wait)
    limit=${2:-560}; t0=$(date +%s)
    while :; do
      # the records and logs; the profiler traces (3-6 MB each) stay behind, too large to come back together
      [ -d "$STATE/results" ] && tar czf "$OUT/results.tar.gz.tmp" -C "$STATE" --exclude=results/profiles results \
        && mv "$OUT/results.tar.gz.tmp" "$OUT/results.tar.gz"
      [ -f "$STATE/driver.log" ] && tail -c 3000000 "$STATE/driver.log" > "$OUT/driver.log"
      [ -f "$STATE/driver.done" ] && { echo "driver finished"; break; }
      [ $(( $(date +%s) - t0 )) -ge "$limit" ] && { echo "still running after $limit s"; break; }
      sleep 10
    done
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
    grep -E '^\[|===|FAILED|ready after|median' "$STATE/driver.log" | tail -60 ;;
  traces)
    ls -t "$STATE"/results/profiles/*.json.gz 2>/dev/null | head -6 | while read -r trace; do
      cp "$trace" "$OUT/" && ls -la "$OUT/$(basename "$trace")"
    done ;;
esac
