"""Verify image.tar.gz, a gzipped docker-archive, without a daemon, and smoke its image with one.

Why both a function and a rule: a DAG cannot make `tarball` depend on a rule that reads tarball's own output.
So tarball calls verify_archive() (lib/docker_archive.py) on the archive it has just written, before it writes
the .sha256; a failure deletes the archive, and image.tar.gz only ever exists as a finished output once it
passed. The `verify_image` rule (which `rule all` asks for) runs the same check again on the file as it lies on
disk and keeps the record (labels, env, layer digests, timings) as results/<variant>/verify_image/verify.json,
for people and tests to read without docker.

With a Docker daemon (image.verify_run: auto, or always), the rule then also runs the archived image and smokes
its endpoints: /ping, /invocations with a prompt body and with a messages body, /v1/completions,
/v1/chat/completions and /metrics. It runs the image by the ID the archive's config hashes to (loading the
archive first when the daemon lacks that ID), so what answers is the archive's image, not a later rebuild: where its
tag points now does not matter here (the stages before tarball refuse a moved tag, lib.containers.recorded_image).
Like every container the pipeline starts, it runs offline (lib.containers.offline_network).
"""

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lib.containers import docker_answers, image_exists, run, run_container
from lib.docker_archive import gpu_arch_problems, load_image_record, verify_archive
from lib.openai_client import request
from lib.stage import StageError, validate_json, write_json

# --- with a daemon: run the archived image and smoke its endpoints ---

SMOKE_PROMPT = "The capital of France is"
SMOKE_MESSAGES = [{"role": "user", "content": "Say hello."}]
SMOKE_MAX_TOKENS = 8


def _completion_text(reply: dict) -> str:
    text = reply["choices"][0]["text"]
    if not isinstance(text, str):
        raise ValueError(f"choices[0].text is {type(text).__name__}, not a string")
    return text


def _chat_message(reply: dict) -> str:
    message = reply["choices"][0]["message"]
    if message.get("role") != "assistant":
        raise ValueError(f"choices[0].message.role is {message.get('role')!r}, not 'assistant'")
    content = message.get("content") or message.get("reasoning_content") or ""
    return content if isinstance(content, str) else str(content)


def smoke_checks(model: str) -> list[tuple[str, str, dict | None, object]]:
    """(name, path, JSON body or None for GET, check of the reply): each check returns a short detail or raises."""
    gen = {"max_tokens": SMOKE_MAX_TOKENS, "temperature": 0.0}
    return [
        ("ping", "/ping", None, lambda text: "ok"),
        (
            "invocations_prompt",
            "/invocations",
            {"prompt": SMOKE_PROMPT, **gen},
            lambda text: _completion_text(json.loads(text)),
        ),
        (
            "invocations_messages",
            "/invocations",
            {"messages": SMOKE_MESSAGES, **gen},
            lambda text: _chat_message(json.loads(text)),
        ),
        (
            "completions",
            "/v1/completions",
            {"model": model, "prompt": SMOKE_PROMPT, **gen},
            lambda text: _completion_text(_served_by(json.loads(text), model)),
        ),
        (
            "chat_completions",
            "/v1/chat/completions",
            {"model": model, "messages": SMOKE_MESSAGES, **gen},
            lambda text: _chat_message(_served_by(json.loads(text), model)),
        ),
        ("metrics", "/metrics", None, _vllm_metrics),
    ]


def _served_by(reply: dict, model: str) -> dict:
    if reply.get("model") != model:
        raise ValueError(f"answered as model {reply.get('model')!r}, expected {model!r}")
    return reply


def _vllm_metrics(text: str) -> str:
    count = sum(1 for line in text.splitlines() if line.startswith("vllm:"))
    if not count:
        raise ValueError("no vllm: metric in the exposition")
    return f"{count} vllm: samples"


def smoke_endpoints(base_url: str, model: str) -> tuple[dict, list[str]]:
    """Every endpoint is tried (one failure does not hide the next); returns (record, failures)."""
    record, failures = {}, []
    for name, path, body, check in smoke_checks(model):
        status, text, seconds = request(base_url, path, body)
        entry = {
            "path": path,
            "method": "POST" if body is not None else "GET",
            "status": status,
            "seconds": round(seconds, 2),
            "ok": False,
        }
        if status != 200:
            entry["error"] = f"HTTP {status}: {text.strip()[:300]}" if status else text
        else:
            try:
                entry["detail"] = str(check(text))[:200]
                entry["ok"] = True
            except (ValueError, KeyError, IndexError, TypeError, AttributeError) as error:
                entry["error"] = f"unexpected reply ({error}): {text.strip()[:300]}"
        if not entry["ok"]:
            failures.append(f"{entry['method']} {path} ({name}): {entry['error']}")
        record[name] = entry
    return record, failures


def docker_image_for(archive: str | Path, image_id: str) -> bool:
    """Make sure the daemon holds the archive's image (by ID); True when it had to be loaded from the archive."""
    if image_exists(image_id):
        return False
    run(["docker", "load", "-q", "-i", str(archive)], what=f"docker load -i {archive}")
    if not image_exists(image_id):
        raise StageError(f"docker load -i {archive} did not give image {image_id}")
    return True


def smoke_image(archive: str | Path, image_id: str, mode: str, run_settings: dict, model: str) -> dict:
    """Run the archive's image and smoke it (mode auto|always|never); the record says whether and why not."""
    if mode == "never":
        return {"ran": False, "reason": "image.verify_run is never"}
    if not docker_answers():
        if mode == "always":
            raise StageError(
                "image.verify_run is always but no Docker daemon answers `docker info` "
                "(start one with `bash setup/start-docker.sh`, or set image.verify_run: auto)"
            )
        return {"ran": False, "reason": "no Docker daemon answers"}
    started = time.monotonic()
    loaded = docker_image_for(archive, image_id)
    with run_container(
        image_id, gpus=run_settings["gpus"], shm_size=run_settings["shm_size"], name_prefix="verify-image"
    ) as container:
        ping_s = container.wait_ready(run_settings["ping_timeout_s"])
        endpoints, failures = smoke_endpoints(container.base_url, model)
        if failures:
            raise StageError(
                f"image {image_id} from {archive} answered /ping but failed the smoke test:\n  - "
                + "\n  - ".join(failures)
                + "\ncontainer log:\n"
                + container.failure_summary()
            )
    return {
        "ran": True,
        "image_id": image_id,
        "network": container.network,
        "loaded_from_archive": loaded,
        "ping_s": round(ping_s, 1),
        "model": model,
        "endpoints": endpoints,
        "seconds": round(time.monotonic() - started, 1),
    }


def main(job) -> None:
    image = load_image_record(job.input.image)
    params = job.params
    with ThreadPoolExecutor(1) as pool:
        # Reading the whole archive and starting its image overlap (the start waits on the server, not this process).
        # The smoke runs image.json's ID, which the check proves the archive's config hashes to; with both failing,
        # the archive's problem is the one reported.
        checking = pool.submit(verify_archive, job.input.tarball, image["ref"], image["labels"], image["id"])
        try:
            smoke = smoke_image(job.input.tarball, image["id"], params.verify_run, dict(params.run), params.model_name)
        except StageError:
            checking.result()
            raise
        record = checking.result()
    arch_problems = gpu_arch_problems(record["labels"], job.params.gpu_arch, job.params.allow_arch_mismatch)
    if arch_problems:
        raise StageError(f"{job.input.tarball} failed verification:\n  - " + "\n  - ".join(arch_problems))
    recorded = Path(job.input.sha256).read_text().split()[0]
    if recorded != record["archive_sha256"]:
        raise StageError(
            f"{job.input.tarball} has sha256 {record['archive_sha256']} but {job.input.sha256} "
            f"says {recorded}; rerun with `-R tarball`"
        )
    print(
        f"{job.input.tarball}: verified ({len(record['layers'])} layers, {record['archive_bytes'] / 1e9:.2f} GB) "
        f"in {record['seconds']} s",
        flush=True,
    )
    record["smoke"] = smoke
    if record["smoke"]["ran"]:
        print(
            f"smoke test: /ping after {record['smoke']['ping_s']} s; "
            + ", ".join(f"{e['method']} {e['path']} {e['status']}" for e in record["smoke"]["endpoints"].values())
        )
    else:
        print(f"smoke test skipped: {record['smoke']['reason']}")
    validate_json(record, job.input.schema)
    write_json(job.output.report, record)


if __name__ == "__main__":
    from lib.stage import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
