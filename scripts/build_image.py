"""Build the serving image: base + quantized model + baked compile cache + serving code.

The build context is staged next to the output (hard links, not copies, for the weights) so that the
Dockerfile sees a fixed layout: model/ cache/ serving/ serve.json Dockerfile.
"""

import json
import os
import shutil
import tarfile
import time
from pathlib import Path

from common import StageError, write_json
from containers import detect_builder, image_exists, image_id, image_size, run


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


def build(context: Path, tag: str, base_ref: str, builder: str) -> None:
    if builder == "docker":
        cmd = ["docker", "build", "--force-rm", "--build-arg", f"BASE={base_ref}", "-t", tag, str(context)]
    else:  # --timestamp 0: identical inputs give an identical image (and image.tar.gz)
        cmd = ["buildah", "bud", "--timestamp", "0", "--build-arg", f"BASE={base_ref}", "-t", tag,
               "-f", str(context / "Dockerfile"), str(context)]
    run(cmd, builder=builder, what=f"{builder} build {tag}")


def main(job) -> None:
    params, inputs = job.params, job.input
    started = time.monotonic()
    builder = detect_builder(getattr(params, "builder", "auto"))
    base = resolve_base(getattr(inputs, "base", None), getattr(params, "base_ref", None), builder)
    out = Path(job.output.image)
    context = out.parent / "context"
    try:
        stage_context(context, Path(inputs.model), Path(inputs.cache), inputs.serving, Path(inputs.serve),
                      Path(inputs.dockerfile))
        print(f"staged {context}: {time.monotonic() - started:.0f} s", flush=True)
        t = time.monotonic()
        build(context, params.tag, base["ref"], builder)
        print(f"{builder} build {params.tag}: {time.monotonic() - t:.0f} s", flush=True)
    finally:
        shutil.rmtree(context, ignore_errors=True)
    if base["id"] is None and builder == "docker":
        base["id"] = image_id(base["ref"], builder)  # pulled during the build
    write_json(out, {"ref": params.tag, "id": image_id(params.tag, builder), "builder": builder, "base": base,
                     "size_bytes": image_size(params.tag, builder)})


if __name__ == "__main__":
    from common import run_stage
    run_stage(main, globals().get("snakemake"), __file__)
