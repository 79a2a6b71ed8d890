"""download: put the model checkpoint in place and record a sha256 manifest of it.

source "hub": snapshot of a pinned commit of the hub repository (real profile).
source "synthetic": the tiny, seeded Qwen3.5-architecture model built by tiny_model (tiny profile).
The checkpoint is assembled in a sibling `.partial` directory and renamed into place only when
complete, so a failed or interrupted run never leaves a checkpoint a rerun would trust.
"""

import os
import re
import shutil
from pathlib import Path

from common import StageError, write_manifest

COMMIT_RE = re.compile(r"[0-9a-f]{40}")
OFFLINE_VALUES = {"1", "true", "yes", "on"}


def check_revision(repo: str, revision) -> str:
    """Only a full commit hash pins the bytes: a branch or tag can move under the same name."""
    if not isinstance(revision, str) or not COMMIT_RE.fullmatch(revision):
        raise StageError(f"revision for {repo} must be a 40-hex commit hash, got {revision!r} "
                         "(look it up on the model page under 'Files and versions' -> history)")
    return revision


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in OFFLINE_VALUES


def fetch_hub(repo: str, revision: str, dest: Path) -> None:
    check_revision(repo, revision)
    if hub_offline():
        raise StageError(f"cannot download {repo}@{revision}: HF_HUB_OFFLINE is set "
                         "(unset it, or place the checkpoint yourself and rerun)")
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(repo_id=repo, revision=revision, local_dir=str(dest))
    except Exception as error:  # offline, unknown repo/commit, gated, HTTP: all end the same way
        raise StageError(f"could not download {repo}@{revision} from the hub: "
                         f"{type(error).__name__}: {error}") from error
    shutil.rmtree(dest / ".cache", ignore_errors=True)  # download bookkeeping, not checkpoint
    if not (dest / "config.json").is_file() or not list(dest.glob("*.safetensors")):
        raise StageError(f"{repo}@{revision} has no config.json or *.safetensors: not a checkpoint")


def build_synthetic(tiny: dict, corpus: str, dest: Path) -> None:
    from tiny_model import build_tiny

    if not Path(corpus).is_file():
        raise StageError(f"tiny corpus {corpus} not found")
    build_tiny(dest, corpus, seed=int(tiny.get("seed", 0)), vocab_size=int(tiny.get("vocab_size", 4096)))


def materialise(checkpoint: str | Path, fill) -> Path:
    """Run fill(tmp_dir), then rename tmp_dir to `checkpoint`; on any failure remove both."""
    checkpoint = Path(checkpoint)
    tmp = checkpoint.with_name(checkpoint.name + ".partial")
    for path in (tmp, checkpoint):
        shutil.rmtree(path, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        fill(tmp)
        tmp.rename(checkpoint)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return checkpoint


def main(job) -> None:
    params = job.params
    source = params.source
    if source == "hub":
        repo, revision = params.repo, params.revision
        check_revision(repo, revision)  # fail before touching anything
        fill = lambda tmp: fetch_hub(repo, revision, tmp)  # noqa: E731
    elif source == "synthetic":
        tiny = dict(params.tiny or {})
        corpus = getattr(job.input, "corpus", None) or tiny.get("corpus")
        fill = lambda tmp: build_synthetic(tiny, corpus, tmp)  # noqa: E731
    else:
        raise StageError(f"params.source must be 'hub' or 'synthetic', got {source!r}")
    manifest_path = Path(job.output.manifest)
    manifest_path.unlink(missing_ok=True)
    checkpoint = materialise(job.output.checkpoint, fill)
    manifest = write_manifest(checkpoint, manifest_path)
    print(f"download: {len(manifest)} files in {checkpoint}")


if __name__ == "__main__":
    from common import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
