"""Where does a vLLM start spend its time? Starts bf16 on an empty cache, then on the cache it filled, and
py-spy dumps the engine core every 5 s (after the profiling forward in the first start, throughout the second)
into /tmp/spyout/dumps-<start>.txt. Found FlashInfer's sampler JIT (docs/gpu-proof.md, cold starts).
Run on the device after the vLLM chunks, with py-spy's wheel carried: gpu_proof/experiments/spy.sh."""

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "gpu_proof"))
import driver as D

OUT = Path("/tmp/spyout")
OUT.mkdir(exist_ok=True)
state = Path("/tmp/gp")
d = D.Driver(state, 1, 1)
settings = d.serve_settings(0)
serve_json = state / "serve" / "bf16.json"
serve_json.write_text(json.dumps(settings))
cache = state / "cache" / "spy2"
cache.mkdir(parents=True, exist_ok=True)
for tag in ("first", "second"):
    proc, base, log_path = d.start("bf16", serve_json, d.model_dir, cache, tag)
    t0 = time.monotonic()
    dumps = open(OUT / f"dumps-{tag}.txt", "w")
    while time.monotonic() - t0 < 480:
        time.sleep(5)
        text = log_path.read_text(errors="replace")
        if "Application startup complete" in text or proc.poll() is not None:
            break
        if tag == "second" or "Initial profiling/warmup run took" in text:
            for pid in subprocess.run(
                ["pgrep", "-f", "VLLM::EngineCore"], capture_output=True, text=True
            ).stdout.split():
                r = subprocess.run(
                    ["/tmp/pyspy/bin/py-spy", "dump", "--pid", pid], capture_output=True, text=True, timeout=60
                )
                dumps.write(f"==== t={time.monotonic() - t0:.0f} pid {pid}\n{r.stdout}\n")
                dumps.flush()
    print(tag, "ready after", round(time.monotonic() - t0), flush=True)
    d.stop(proc, log_path)
    (OUT / f"server-{tag}.log").write_text(log_path.read_text(errors="replace"))
