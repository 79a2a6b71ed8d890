"""Serve the quantized model once, in the image's own base and layout, and keep every cache start-up fills.

vLLM's torch.compile artifacts, inductor's and Triton's kernel caches all land under /opt/ml/cache (the
serving entrypoint points them there), which is mounted from the host here and copied into the image later.
It runs offline like every pipeline container (lib.containers.offline_network): the model is mounted and the serving
entrypoint turns the hub off. One start: latency_probe starts the built image itself and proves from vLLM's log that
it loads this cache (image.require_cache_hit), so a second start here would prove the same a stage earlier, at a full
vLLM start.
"""

import json
import os
import shutil
import time
from pathlib import Path

from lib.bake_compile_cache.cache_tar import deterministic_tar
from lib.probe import warm_up
from lib.stage import validate_json, write_json
from serving.settings import DRAFT_DIR

IMAGE_MODEL_DIR = "/opt/ml/model"
IMAGE_CODE_DIR = "/opt/ml/code"
IMAGE_CACHE_DIR = "/opt/ml/cache"
IMAGE_SERVE_JSON = "/opt/ml/serve.json"


def container_env(base: dict | None) -> dict:
    """PYTHONPATH as the image will have it: our code first, then the base's own packages (local base only)."""
    paths = [IMAGE_CODE_DIR] + ([base["site_packages"]] if base and base.get("site_packages") else [])
    return {"PYTHONPATH": ":".join(paths)}


def coldstart_record(empty_s: float, bake_s: float, packed: dict, image: str, gpu: dict, network: str) -> dict:
    """gpu: {name, compute_capability, arch} of the bake container (lib.containers.container_gpu); build_image
    refuses a cache baked for another architecture than image.gpu_arch. network: the one it ran on."""
    return {
        "gpu": {k: gpu[k] for k in ("name", "compute_capability", "arch")},
        "cold_start_empty_cache_s": round(empty_s, 1),
        "bake_s": round(bake_s, 1),
        "cache_files": packed["files"],
        "cache_bytes": packed["bytes"],
        "image": image,
        "network": network,
    }


def main(job) -> None:
    from lib.containers import container_gpu, run_container

    out_dir = Path(job.output.cache).parent
    cache_dir = out_dir / "cache"
    shutil.rmtree(cache_dir, ignore_errors=True)
    cache_dir.mkdir(parents=True)

    base = json.loads(Path(job.input.base).read_text()) if job.input.base else None
    base_ref = base["ref"] if base else job.params.base_ref
    serving_dir = Path(os.path.commonpath(job.input.serving)).resolve()
    volumes = [
        f"{Path(job.input.model).resolve()}:{IMAGE_MODEL_DIR}:ro",
        f"{serving_dir}:{IMAGE_CODE_DIR}/serving:ro",
        f"{Path(job.input.serve).resolve()}:{IMAGE_SERVE_JSON}:ro",
        f"{cache_dir.resolve()}:{IMAGE_CACHE_DIR}",
    ]
    if job.input.draft:  # a drafted variant's drafter, where the image will hold it
        volumes.append(f"{Path(job.input.draft).resolve()}:{DRAFT_DIR}:ro")
    run = job.params.run
    model = json.loads(Path(job.input.serve).read_text())["served_model_name"]

    started = time.monotonic()
    with run_container(
        base_ref,
        volumes=volumes,
        env=container_env(base),
        gpus=run["gpus"],
        shm_size=run["shm_size"],
        name_prefix="bake",
        args=["python3", "-m", "serving"],
        docker_args=["--entrypoint", ""],
    ) as container:
        empty_s = container.wait_ready(run["ping_timeout_s"])
        gpu = container_gpu(container, run["gpus"])
        print(f"bake container computes on: {gpu['name'] or 'the CPU'} ({gpu['arch']})", flush=True)
        warm_up(container.base_url, model, job.params.categories, job.params.sentence)
        print(container.logs(tail=100000)[-20000:])
    bake_s = time.monotonic() - started
    print(f"cold start on an empty cache: {empty_s:.0f} s; bake {bake_s:.0f} s")
    packed = deterministic_tar(cache_dir, Path(job.output.cache))
    shutil.rmtree(cache_dir)
    record = coldstart_record(empty_s, bake_s, packed, base_ref, gpu, container.network)
    validate_json(record, job.input.schema)
    write_json(job.output.coldstart, record)


if __name__ == "__main__":
    from lib.stage import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
