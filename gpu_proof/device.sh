#!/usr/bin/env bash
# The GPU proof's commands on the lent host (one device `run` call each, back to back: the host goes back when idle).
#   bash gpu_proof/device.sh chunk NAME K       copy a staged bundle chunk (.device-stage/NAME/cK, carried) to /root/stash
#   bash gpu_proof/device.sh unpack             unpack every carried bundle, check each vLLM imports (once a lease)
#   bash gpu_proof/device.sh arctic             build arctic-inference's wheel for the host's Python from its source
#                                               archive and build wheels (.device-stage/arctic/c0/arctic, carried)
#   bash gpu_proof/device.sh start DRIVER_ARGS  start gpu_proof/driver.py detached (--variants ...) in STATE, on the
#                                               bundle VLLM_BUNDLE names (unpacked first where it is not);
#                                               it runs the tree of .device-stage/tree/c0/tree.tar when that is carried
#                                               (`git archive -o .device-stage/tree/c0/tree.tar HEAD`: a commit, not
#                                               whatever the working tree holds; TREE names another archive),
#                                               else this working tree
#   STATES="A B" bash gpu_proof/device.sh waitall SECONDS   follow drivers started side by side (each its STATE)
#   bash gpu_proof/device.sh wait SECONDS       follow the driver; bring results.tar.gz and driver.log back in $OUT
#                                               (ask for a minute less than the device time left: a call cut at the
#                                               budget brings nothing back)
# Bundles (how they reach an offline host is site-specific), xz-packed site-packages trees split in parts in
# /root/stash: vLLM (NAME.tar.xz.*, NAME from VLLM_BUNDLE, default `vllm`: the release engine.vllm names, with the
# torch and NCCL it pins where the host's differ) and llmcompressor (llmcompressor.tar.xz.*), and for suffix decoding
# arctic-inference built the way scripts/lib/make_venv/local_builds.py builds it (a wheel). A trained checkpoint to serve
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
    tree=${TREE:-.device-stage/tree/c0/tree.tar}  # TREE: another commit's archive (an older engine's own patches)
    if [ -f "$tree" ]; then tar -C "$STATE/repo" -xf "$tree"
    else tar --exclude=./.device-stage --exclude=./.git --exclude=./.venvs -cf - . | tar -C "$STATE/repo" -xf -; fi
    rm -f "$STATE/driver.done"
    setsid nohup bash "$STATE/repo/gpu_proof/device.sh" run "${@:2}" >> "$STATE/driver.log" 2>&1 < /dev/null &
    sleep 2; cat "$STATE/driver.log" ;;
  unpack)  # every bundle in /root/stash, once: vLLM bundles (NAME.whl.tar.* or NAME.tar.xz.*), llmcompressor, models
    t0=$(date +%s)
    for first in /root/stash/*.whl.tar.00; do  # wheels as they are (already compressed), one tree per bundle
      [ -f "$first" ] || continue
      name=$(basename "$first" .whl.tar.00)
      [ -d "/tmp/whl-$name" ] || { mkdir -p "/tmp/whl-$name" && cat /root/stash/$name.whl.tar.* | tar -C "/tmp/whl-$name" -x; }
    done
    for tree in /tmp/whl-*; do  # a bundle's NEEDS.txt names its wheels in any bundle's tree (shared ones travel once)
      [ -d "$tree" ] || continue
      name=${tree#/tmp/whl-}; site=/tmp/site-$name
      [ -d "$site" ] && continue
      if [ -f "$tree/wheels/NEEDS.txt" ]; then
        wheels=$(grep '[.]whl$' "$tree/wheels/NEEDS.txt" | while read -r w; do ls /tmp/whl-*/wheels/"$w" | head -1; done)
      else wheels=$(ls "$tree"/wheels/*.whl); fi
      python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" $wheels &
    done
    for first in /root/stash/*.tar.xz.00; do
      name=$(basename "$first" .tar.xz.00)
      [ -d "/tmp/site-$name" ] || (cat /root/stash/$name.tar.xz.* | xz -d -T4 | tar -C /tmp -x) &
    done
    wait
    mkdir -p /tmp/site-extra  # jsonschema & co. for the driver's config check and quantize's report check
    for site in /tmp/site-vllm*; do
      for m in jsonschema jsonschema_specifications referencing rpds attrs; do
        [ -d "/tmp/site-extra/$m" ] || cp -r "$site/$m" /tmp/site-extra/ 2>/dev/null || true
      done
      cp -rn "$site"/{jsonschema,referencing,rpds_py,jsonschema_specifications,attrs}-*.dist-info /tmp/site-extra/ 2>/dev/null
    done
    [ -f /root/stash/models.tar ] && [ ! -d /tmp/models ] && mkdir -p /tmp/models && tar -C /tmp/models -xf /root/stash/models.tar
    for site in /tmp/site-vllm*; do  # each engine must import before any step is spent on it
      PYTHONPATH=$site python3 -c 'import torch, vllm; print(vllm.__file__.split("/")[2], "vllm", vllm.__version__, "torch", torch.__version__, torch.cuda.get_device_name(0))' 2>&1 | tail -3
    done
    echo "[unpack] $(( $(date +%s) - t0 )) s" ;;
  arctic)  # the way scripts/lib/make_venv/local_builds.py builds it: no isolation, a stub torch, its vLLM plugin left out
    src=$PWD/.device-stage/arctic/c0/arctic; b=/tmp/arctic-build; t0=$(date +%s)
    ls /root/stash/arctic_inference-*.whl 2>/dev/null && exit 0
    rm -rf "$b" && mkdir -p "$b/stub/torch" /root/stash
    printf 'class utils:\n    cmake_prefix_path = ""\n' > "$b/stub/torch/__init__.py"
    python3 -m pip install -q --no-index --no-deps --target "$b/site" "$src"/*.whl || exit 1
    tar -xzf "$src"/arctic_inference-*.tar.gz -C "$b"
    (cd "$b"/arctic_inference-*/ && PATH="$b/site/bin:$PATH" PYTHONPATH="$b/site:$b/stub" CMAKE_BUILD_PARALLEL_LEVEL=8 \
      CMAKE_ARGS="-DPython_EXECUTABLE=$(command -v python3)" \
      python3 -m pip wheel -q --no-build-isolation --no-deps --no-index -w /root/stash . 2>&1 | tail -20)
    ls -la /root/stash/arctic_inference-*.whl && echo "[arctic] $(( $(date +%s) - t0 )) s" ;;
  run)  # (detached) drive, on the bundle VLLM_BUNDLE names (unpacked first where it is not)
    echo $$ > "$STATE/driver.pid"
    cd "$STATE/repo"
    export SITE_VLLM=/tmp/site-${VLLM_BUNDLE:-vllm}
    [ -d "$SITE_VLLM" ] || bash gpu_proof/device.sh unpack
    # arctic-inference without its vllm.general_plugins entry point (it would patch vLLM wholesale)
    for wheel in /root/stash/arctic_inference-*.whl; do
      [ -f "$wheel" ] && [ ! -d "$SITE_VLLM/arctic_inference" ] || continue
      python3 -m zipfile -e "$wheel" "$SITE_VLLM/" && rm -f "$SITE_VLLM"/arctic_inference-*.dist-info/entry_points.txt
    done
    PYTHONPATH=$SITE_VLLM python3 -c 'import vllm' \
      || { echo "driver exit: the engine does not import"; touch "$STATE/driver.done"; exit 1; }
    env PYTHONPATH=/tmp/site-extra PYTHONUNBUFFERED=1 python3 -u gpu_proof/driver.py --state "$STATE" "${@:2}"
    echo "driver exit $?"
    touch "$STATE/driver.done" ;;
  wait|waitall)  # follow the driver of STATE (wait: results.tar.gz, driver.log) or of each of STATES (<folder>.*)
    limit=${2:-560}; t0=$(date +%s); states=$STATE; size=3000000
    [ "$1" = waitall ] && { states=$STATES; size=1000000; }
    while :; do
      left=0
      for state in $states; do
        name=results log=driver; [ "$1" = waitall ] && { name=$(basename "$state"); log=$name; }
        [ -d "$state/results" ] && tar czf "$OUT/$name.tar.gz.tmp" -C "$state" results && mv "$OUT/$name.tar.gz.tmp" "$OUT/$name.tar.gz"
        [ -f "$state/driver.log" ] && tail -c $size "$state/driver.log" > "$OUT/$log.log"
        [ -f "$state/driver.done" ] || left=$((left + 1))
      done
      [ "$left" = 0 ] && { echo "driver(s) finished"; break; }
      [ $(( $(date +%s) - t0 )) -ge "$limit" ] && { echo "$left still running after $limit s"; break; }
      sleep 10
    done
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
    for state in $states; do echo "== $state"; grep -E '^\[|===|FAILED|ready after|driver exit' "$state/driver.log" | tail -40; done ;;
esac
