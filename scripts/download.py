"""download: put the model checkpoint in place and record a sha256 manifest of it.

source "hub": snapshot of a pinned commit of the hub repository (real profile).
source "synthetic": the tiny, seeded Qwen3.5-architecture model built by lib/tiny (tiny profile), untrained:
train_tiny trains it when model.tiny.train.steps > 0. The checkpoint is assembled in a sibling `.partial`
directory and renamed into place only when complete (lib/checkpoint.py).
"""

import os
import re
import shutil
from pathlib import Path

from lib.checkpoint import write_checkpoint
from lib.stage import StageError

SCHEMA = Path(__file__).resolve().parent.parent / "schemas" / "download.schema.yaml"

COMMIT_RE = re.compile(r"[0-9a-f]{40}")
OFFLINE_VALUES = {"1", "true", "yes", "on"}


def check_revision(repo: str, revision) -> str:
    """Only a full commit hash pins the bytes: a branch or tag can move under the same name."""
    if not isinstance(revision, str) or not COMMIT_RE.fullmatch(revision):
        raise StageError(
            f"revision for {repo} must be a 40-hex commit hash, got {revision!r} "
            "(look it up on the model page under 'Files and versions' -> history)"
        )
    return revision


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in OFFLINE_VALUES


def fetch_hub(repo: str, revision: str, dest: Path) -> None:
    check_revision(repo, revision)
    if hub_offline():
        raise StageError(
            f"cannot download {repo}@{revision}: HF_HUB_OFFLINE is set "
            "(unset it, or place the checkpoint yourself and rerun)"
        )
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(repo_id=repo, revision=revision, local_dir=str(dest))
    except Exception as error:  # offline, unknown repo/commit, gated, HTTP: all end the same way
        raise StageError(
            f"could not download {repo}@{revision} from the hub: {type(error).__name__}: {error}"
        ) from error
    shutil.rmtree(dest / ".cache", ignore_errors=True)  # download bookkeeping, not checkpoint
    if not (dest / "config.json").is_file() or not list(dest.glob("*.safetensors")):
        raise StageError(f"{repo}@{revision} has no config.json or *.safetensors: not a checkpoint")


def build_synthetic(tiny: dict, corpus: str, dest: Path, generator: str | None = None) -> None:
    """The untrained tiny checkpoint in dest. With the training data generator (the model is to be trained),
    the tokenizer also learns the tasks' fixed wording, as a real tokenizer knows its common words."""
    from lib.tiny.synthesis import build_tiny
    from lib.tiny.training import load_generator

    if not Path(corpus).is_file():
        raise StageError(f"tiny corpus {corpus} not found")
    extra = load_generator(generator).tokenizer_text() if generator else ""
    build_tiny(dest, corpus, seed=int(tiny["seed"]), vocab_size=int(tiny["vocab_size"]), tokenizer_extra=extra)


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
        generator = getattr(job.input, "generator", None) or None
        fill = lambda tmp: build_synthetic(tiny, corpus, tmp, generator)  # noqa: E731
    else:
        raise StageError(f"params.source must be 'hub' or 'synthetic', got {source!r}")
    record = write_checkpoint(job.output, fill, {"source": source, "training": None}, SCHEMA)
    print(f"download: {record['files']} files in {job.output.checkpoint}")


if __name__ == "__main__":
    from lib.stage import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
