"""download: put the model checkpoint in place and record a sha256 manifest of it.

source "hub": snapshot of a pinned commit of the hub repository (real profile).
source "synthetic": the tiny, seeded Qwen3.5-architecture model built by tiny_model (tiny profile).
The checkpoint is assembled in a sibling `.partial` directory and renamed into place only when
complete, so a failed or interrupted run never leaves a checkpoint a rerun would trust.
"""

import os
import re
import shutil
import time
from pathlib import Path

from common import StageError, validate_json, write_json, write_manifest

SCHEMA = Path(__file__).resolve().parent.parent / "schemas" / "download.schema.yaml"

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


def load_generator(path: str | Path):
    """The tiny tasks' generator module (data/tiny/tasks/generate.py): it writes the test splits and the
    training conversations, so both come from one place in the same formats."""
    import importlib.util

    path = Path(path)
    if not path.is_file():
        raise StageError(f"tiny training data generator {path} not found")
    spec = importlib.util.spec_from_file_location("tiny_tasks_generate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def training_plan(train: dict, generator) -> dict | None:
    """train_model's arguments from the config's `model.tiny.train` (None when steps is 0: a random model)."""
    if int(train.get("steps", 0)) <= 0:
        return None
    tests = generator.test_docs()
    conversations = generator.train_conversations(int(train["data_seed"]), int(train["examples"]), tests)
    heldout = generator.train_conversations(int(train["data_seed"]) + 1, int(train["heldout_examples"]), tests,
                                            exclude=conversations)
    return {"conversations": conversations, "heldout": heldout, "steps": int(train["steps"]),
            "lr": float(train["lr"]), "batch_size": int(train["batch_size"]), "seed": int(train["seed"]),
            "threads": int(train["threads"]), "warmup_steps": int(train["warmup_steps"])}


def build_synthetic(tiny: dict, corpus: str, dest: Path, generator: str | None = None) -> dict | None:
    """Build (and, when configured, train) the tiny checkpoint in dest; return the training record."""
    from tiny_model import build_tiny

    if not Path(corpus).is_file():
        raise StageError(f"tiny corpus {corpus} not found")
    train = dict(tiny.get("train") or {})
    plan, extra = None, ""
    if int(train.get("steps", 0)) > 0:
        if not generator:
            raise StageError("model.tiny.train.steps > 0 needs the training data generator as input `generator`")
        module = load_generator(generator)
        plan, extra = training_plan(train, module), module.tokenizer_text()
    result = build_tiny(dest, corpus, seed=int(tiny.get("seed", 0)), vocab_size=int(tiny.get("vocab_size", 4096)),
                        train=plan, tokenizer_extra=extra)
    return result["training"]


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
        generator = getattr(job.input, "generator", None) or None
        fill = lambda tmp: record.update(training=build_synthetic(tiny, corpus, tmp, generator))  # noqa: E731
    else:
        raise StageError(f"params.source must be 'hub' or 'synthetic', got {source!r}")
    record = {"source": source, "training": None}
    record_path = getattr(job.output, "record", None)
    manifest_path = Path(job.output.manifest)
    manifest_path.unlink(missing_ok=True)
    if record_path:
        Path(record_path).unlink(missing_ok=True)
    start = time.monotonic()
    checkpoint = materialise(job.output.checkpoint, fill)
    manifest = write_manifest(checkpoint, manifest_path)
    record.update(seconds=round(time.monotonic() - start, 1), files=len(manifest),
                  bytes=sum(path.stat().st_size for path in checkpoint.rglob("*") if path.is_file()))
    if record_path:
        validate_json(record, SCHEMA)
        write_json(record_path, record)
    if record["training"]:
        t = record["training"]
        print(f"download: trained {t['steps']} steps in {t['seconds']} s, loss {t['first_loss']} -> "
              f"{t['final_loss']}, held-out answer-token accuracy {t['heldout_answer_token_accuracy']}")
    print(f"download: {len(manifest)} files in {checkpoint}")


if __name__ == "__main__":
    from common import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
