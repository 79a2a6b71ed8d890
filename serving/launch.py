"""Map serve.json to vLLM's own OpenAI server and exec it.

Paths come from the image layout unless the environment overrides them, so the same code runs in
the image, in host tests and in the compile-cache bake. Before vLLM runs, every patch serve.json turns on
(serving/patches) is checked against the installed vLLM: one tested against another version stops the start.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from serving import patches
from serving.settings import DRAFT_DIR, MIDDLEWARE, SERVE, SettingsError, enabled_patches, setting_env, vllm_args

PACKAGE_DIR = Path(__file__).resolve().parent
# Holds serving_plugins-0.1.dist-info, whose entry points register serving/patches as vLLM general plugins; it has
# to be on sys.path of every vLLM process (the engine core is a subprocess), hence PYTHONPATH rather than an import.
DIST_DIR = PACKAGE_DIR / "_dist"
# vLLM's OpenAI server, which main() execs as `python -m` (serving/patches/fork_start.py recognises that process by it)
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"

# Caches filled at start-up: vLLM's torch.compile artifacts, inductor's, Triton's and FlashInfer's kernels; and
# the two vLLM paths whose defaults hang off HOME and are factors of its compile-cache key (vllm.envs
# compile_factors): fixed here, the bake (root, HOME /root) and the image (its server user, HOME /tmp) key alike.
CACHE_DIRS = {
    "VLLM_CACHE_ROOT": "vllm",
    "VLLM_CONFIG_ROOT": "vllm-config",
    "VLLM_XLA_CACHE_PATH": "vllm-xla",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",  # FlashInfer appends .cache/flashinfer itself
    # inductor's CPU instruction-set probes, remembered by serving/patches/aot_load_fix.py once a cache, not a compile
    "SERVING_ISA_PROBES_DIR": "isa-probes",
}
# Triton's autotuner times every config of a kernel at each start and keeps the fastest only in memory, unless told
# to keep it in its cache dir (above, baked). vLLM's GDN prefill kernels are autotuned over block sizes, which set the
# order of their sums. Kept, every start of a baked image and every variant on one cache runs the block sizes the
# first start picked instead of whatever this start's timing favours (and a later start times nothing). It does not
# make a random model's near-tie tokens reproducible across starts.
KEEP_AUTOTUNING = {"TRITON_CACHE_AUTOTUNING": "1"}


def child_env(environ: dict, settings: dict | None = None) -> dict:
    """Environment for the vLLM process: plugin dist-info and this package importable, the enabled patches,
    middleware settings."""
    env = dict(environ)
    settings = settings or {}
    # Read by serving.middleware inside vLLM's API server process.
    env["DEFAULT_THINKING"] = "1" if settings.get("default_thinking", SERVE["default_thinking"].default) else "0"
    for key, setting in SERVE.items():
        if setting.kind == MIDDLEWARE:
            env[setting.flag] = str(settings.get(key, setting.default))
    env[patches.ENV] = patches.env_value(enabled_patches(settings))  # read by each patch's register()
    env.update(setting_env(settings))  # vLLM's own switches that have no flag (serve.model_runner)
    paths = [str(DIST_DIR), str(PACKAGE_DIR.parent)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        env.setdefault(key, "1")  # the model is always local; never reach for a hub
    # One place decides where start-up caches live, so the bake (which mounts an empty cache dir into the
    # base image) and the finished image (which ships the baked copy) read and write the same paths.
    cache_root = Path(env.get("CACHE_DIR", "/opt/ml/cache"))
    if cache_root.is_dir():
        for key, sub in CACHE_DIRS.items():
            env.setdefault(key, str(cache_root / sub))
        for key, value in KEEP_AUTOTUNING.items():
            env.setdefault(key, value)
    return env


def restore_ninja_mtimes(root: Path) -> int:
    """Give every output a .ninja_log under `root` lists the mtime that log recorded; returns how many changed.

    FlashInfer JIT-compiles its sampling kernels with ninja into the FlashInfer cache, and ninja rebuilds an
    output that is older than its sources. The baked cache reaches the image with zeroed mtimes (the bake's
    deterministic tar, buildah --timestamp), so without this every start on an H100 spent ~110 s re-running
    nvcc (py-spy: JitSpec.build under _dummy_sampler_run). The recorded value is the build's start time: newer
    than the sources, not newer than what .ninja_deps recorded, so ninja finds nothing to do."""
    changed = 0
    for log in sorted(root.rglob(".ninja_log")):
        lines = log.read_text(errors="replace").splitlines()
        if not lines or not lines[0].startswith("# ninja log v"):
            continue
        for line in lines[1:]:
            fields = line.split("\t")
            if len(fields) != 5 or not fields[2].isdigit():
                continue
            mtime_ns = int(fields[2])
            if mtime_ns < 10**12:  # logs of ninja < 1.10 hold seconds
                mtime_ns *= 10**9
            output = Path(fields[3]) if os.path.isabs(fields[3]) else log.parent / fields[3]
            if mtime_ns and output.is_file() and output.stat().st_mtime_ns != mtime_ns:
                os.utime(output, ns=(mtime_ns, mtime_ns))
                changed += 1
    return changed


def cuda_host() -> bool:
    return Path("/dev/nvidiactl").exists()


def patch_refusal(settings: dict, cuda: bool) -> str | None:
    """Why this server must not start: the enabled patches, on this host's platform, that were tested against a vLLM
    other than the installed one (None: every one was)."""
    installed = patches.installed_vllm()
    refusing = patches.refusing(enabled_patches(settings), installed, "cuda" if cuda else "cpu")
    return patches.refusal(refusing, installed) if refusing else None


def main() -> None:
    config = os.environ.get("SERVE_CONFIG", "/opt/ml/serve.json")
    model_dir = os.environ.get("MODEL_DIR", "/opt/ml/model")
    with open(config) as f:
        settings = json.load(f)
    cuda = cuda_host()
    try:
        args = vllm_args(
            settings,
            model_dir,
            host=os.environ.get("HOST", "0.0.0.0"),
            port=int(os.environ.get("PORT", "8080")),
            cuda=cuda,
            draft_dir=os.environ.get("DRAFT_DIR", DRAFT_DIR),
        )
        refusal = patch_refusal(settings, cuda)
    except SettingsError as error:
        sys.exit(f"serving: {config}: {error}")
    if refusal:
        sys.exit(f"serving: {refusal}")
    cmd = [sys.executable, "-m", API_SERVER_MODULE, *args]
    env = child_env(dict(os.environ), settings)
    if Path(env.get("FLASHINFER_WORKSPACE_BASE", "/nonexistent")).is_dir():
        restored = restore_ninja_mtimes(Path(env["FLASHINFER_WORKSPACE_BASE"]))
        print(f"serving: restored the recorded mtimes of {restored} FlashInfer JIT outputs", flush=True)
    print("serving:", " ".join(cmd), flush=True)
    # exec, not a child: vLLM gets the signals (docker stop) and its exit code is ours.
    os.execve(sys.executable, cmd, env)
