"""Serve the quantized model once, in the image's own base and layout, and keep every cache start-up fills.

vLLM's torch.compile artifacts, inductor's and Triton's kernel caches all land under /opt/ml/cache (the
serving entrypoint points them there), which is mounted from the host here and copied into the image later.
A second start on the filled cache measures what the baked image will see and proves the hit from vLLM's log.
"""

import json
import os
import re
import shutil
import tarfile
import time
from pathlib import Path

from common import StageError, validate_json, write_json

# vLLM's own words when it skips compiling: the AOT artifact (torch >= 2.10) or the per-graph Inductor cache.
CACHE_HIT = re.compile(r"Directly load (AOT compilation|the compiled graph)[^\n]*")
CACHE_MISS = re.compile(r"Compiling model again due to a load failure[^\n]*")

IMAGE_MODEL_DIR = "/opt/ml/model"
IMAGE_CODE_DIR = "/opt/ml/code"
IMAGE_CACHE_DIR = "/opt/ml/cache"
IMAGE_SERVE_JSON = "/opt/ml/serve.json"


def deterministic_tar(source: Path, tar_path: Path) -> dict:
    """Tar `source` sorted, with zeroed owners and times, so the same cache gives the same bytes."""
    partial = tar_path.with_name(tar_path.name + ".partial")
    files = bytes_total = 0

    def normalise(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = 0
        return info

    with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as archive:
        for path in sorted(source.rglob("*")):
            archive.add(path, arcname=str(path.relative_to(source)), recursive=False, filter=normalise)
            if path.is_file():
                files += 1
                bytes_total += path.stat().st_size
    partial.replace(tar_path)
    return {"files": files, "bytes": bytes_total}


def warm_up(base_url: str, model: str, categories: list[dict], sentence: str, log=print) -> None:
    """One request per probe size (compiled graphs and kernels are specialised by shape), plus chat both ways."""
    from latency_probe import build_prompt, post_json, timed_completion

    for category in categories:
        prompt = build_prompt(base_url, model, [sentence], category["prompt_tokens"])
        result = timed_completion(base_url, model, prompt, category["output_tokens"], ignore_eos=True)
        log(f"warm-up {category['name']}: {result['latency_ms']:.0f} ms")
    for thinking in (False, True):
        post_json(base_url, "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16,
            "temperature": 0.0, "chat_template_kwargs": {"enable_thinking": thinking}})


def container_env(base: dict | None) -> dict:
    """PYTHONPATH as the image will have it: our code first, then the base's own packages (local base only)."""
    paths = [IMAGE_CODE_DIR] + ([base["site_packages"]] if base and base.get("site_packages") else [])
    return {"PYTHONPATH": ":".join(paths)}


def cache_evidence(log_text: str) -> dict:
    """What vLLM said about its compile cache on a start: hit lines and reload failures."""
    return {"hits": [m.group(0) for m in CACHE_HIT.finditer(log_text)][:8],
            "misses": [m.group(0) for m in CACHE_MISS.finditer(log_text)][:8]}


def coldstart_record(empty_s: float, baked_s: float, evidence: dict, bake_s: float, packed: dict, image: str) -> dict:
    return {"cold_start_empty_cache_s": round(empty_s, 1), "cold_start_baked_cache_s": round(baked_s, 1),
            "saved_s": round(empty_s - baked_s, 1), "cache_hit": bool(evidence["hits"]) and not evidence["misses"],
            "cache_hit_evidence": evidence["hits"], "cache_load_failures": evidence["misses"],
            "bake_s": round(bake_s, 1), "cache_files": packed["files"], "cache_bytes": packed["bytes"], "image": image}


def main(job) -> None:
    from containers import run_container

    out_dir = Path(job.output.cache).parent
    cache_dir = out_dir / "cache"
    shutil.rmtree(cache_dir, ignore_errors=True)
    cache_dir.mkdir(parents=True)
    write_json(job.output.serve, job.params.serve)

    base = json.loads(Path(job.input.base).read_text()) if job.input.base else None
    base_ref = base["ref"] if base else job.params.base_ref
    serving_dir = Path(os.path.commonpath(job.input.serving)).resolve()
    volumes = [
        f"{Path(job.input.model).resolve()}:{IMAGE_MODEL_DIR}:ro",
        f"{serving_dir}:{IMAGE_CODE_DIR}/serving:ro",
        f"{Path(job.output.serve).resolve()}:{IMAGE_SERVE_JSON}:ro",
        f"{cache_dir.resolve()}:{IMAGE_CACHE_DIR}",
    ]
    run = job.params.run
    model = job.params.serve["served_model_name"]

    def start(name_prefix):
        return run_container(base_ref, volumes=volumes, env=container_env(base), gpus=run["gpus"],
                             shm_size=run["shm_size"], name_prefix=name_prefix, args=["python3", "-m", "serving"],
                             docker_args=["--entrypoint", ""])

    started = time.monotonic()
    with start("bake") as container:
        empty_s = container.wait_ready(run["ping_timeout_s"])
        warm_up(container.base_url, model, job.params.categories, job.params.sentence)
        print(container.logs(tail=100000)[-20000:])
    # The image starts exactly like this: same base, layout and serve.json, the cache now filled.
    with start("bake-rerun") as container:
        baked_s = container.wait_ready(run["ping_timeout_s"])
        warm_up(container.base_url, model, job.params.categories[:1], job.params.sentence)
        rerun_log = container.logs(tail=100000)
    print(rerun_log[-20000:])
    bake_s = time.monotonic() - started
    evidence = cache_evidence(rerun_log)
    print(f"cold start: {empty_s:.0f} s empty cache, {baked_s:.0f} s baked; hits {evidence['hits']}; "
          f"load failures {evidence['misses']}")
    if job.params.require_cache_hit and (not evidence["hits"] or evidence["misses"]):
        shutil.rmtree(cache_dir)
        Path(job.output.serve).unlink(missing_ok=True)
        raise StageError("the second start did not load the compile cache it had just filled "
                         f"(vLLM said: {evidence['misses'] or 'no Directly load line'}); the baked cache would be "
                         "dead weight in the image. Set image.require_cache_hit: false to ship it anyway.")
    packed = deterministic_tar(cache_dir, Path(job.output.cache))
    shutil.rmtree(cache_dir)
    record = coldstart_record(empty_s, baked_s, evidence, bake_s, packed, base_ref)
    validate_json(record, job.input.schema)
    write_json(job.output.coldstart, record)


if __name__ == "__main__":
    from common import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
