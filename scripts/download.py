"""download: put the model checkpoint in place and record a sha256 manifest of it.

source "hub": snapshot of a pinned commit of the hub repository (real profile). Every file is checked against the
hashes the hub itself lists for that commit (its tree listing: the LFS sha256 of a large file, the git blob sha1 of
a small one) before anything is kept; the hashes go into the record and the manifest is written from the verified
bytes, which later stages check before they read the checkpoint (lib/checkpoint.verify_manifest).
source "synthetic": the tiny, seeded Qwen3.5-architecture model built by lib/tiny (tiny profile), untrained:
train_tiny trains it when model.tiny.train.steps > 0. The checkpoint is assembled in a sibling `.partial`
directory and renamed into place only when complete (lib/checkpoint.py).
"""

import hashlib
import os
import re
import shutil
from pathlib import Path

from lib.checkpoint import write_checkpoint
from lib.stage import StageError, checkpoint_files, sha256_file

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


def git_blob_sha1(path: str | Path, chunk: int = 1 << 20) -> str:
    """The git object id of a file's bytes (`git hash-object`): what the hub lists as a non-LFS file's oid."""
    path = Path(path)
    digest = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def hub_hashes(entries) -> dict[str, dict]:
    """{path: {size, sha256}} for an LFS file, {path: {size, git_sha1}} for any other, from the hub's tree listing
    (huggingface_hub's RepoFile/RepoFolder objects; folders are skipped)."""
    files = {}
    for entry in entries:
        if not hasattr(entry, "blob_id"):  # a folder
            continue
        lfs = getattr(entry, "lfs", None)
        if lfs is not None:
            files[entry.path] = {"size": int(lfs.size), "sha256": str(lfs.sha256)}
        else:
            files[entry.path] = {"size": int(entry.size), "git_sha1": str(entry.blob_id)}
    return files


def verify_against_hub(dest: Path, expected: dict[str, dict], where: str) -> None:
    """Every file the hub lists is in dest with the hub's hash (an LFS file's sha256, any other's git blob sha1), and
    nothing else is; else StageError naming each file that differs, with both hashes."""
    present = {str(path.relative_to(dest)): path for path in checkpoint_files(dest)}
    problems = [f"{name}: listed by the hub, not downloaded" for name in sorted(set(expected) - set(present))]
    problems += [f"{name}: downloaded, not listed by the hub" for name in sorted(set(present) - set(expected))]
    for name in sorted(set(expected) & set(present)):
        want, path = expected[name], present[name]
        if "sha256" in want:
            kind, hub, actual = "LFS sha256", want["sha256"], sha256_file(path)
        else:
            kind, hub, actual = "git blob sha1", want["git_sha1"], git_blob_sha1(path)
        if actual != hub:
            problems.append(f"{name}: the hub's {kind} is {hub}, the downloaded file's is {actual}")
    if problems:
        raise StageError(
            f"{where}: the download does not match the hub's own hashes (corrupted in transit or on disk, or not "
            "what the hub lists), so nothing was kept:\n  " + "\n  ".join(problems)
        )


def fetch_hub(repo: str, revision: str, dest: Path) -> dict:
    """Snapshot repo@revision into dest and check every file against the hub's hashes for that commit. Returns the
    record's `hub` section."""
    check_revision(repo, revision)
    if hub_offline():
        raise StageError(
            f"cannot download {repo}@{revision}: HF_HUB_OFFLINE is set "
            "(unset it, or place the checkpoint yourself and rerun)"
        )
    from huggingface_hub import HfApi, snapshot_download

    try:
        expected = hub_hashes(HfApi().list_repo_tree(repo, revision=revision, recursive=True))
        snapshot_download(repo_id=repo, revision=revision, local_dir=str(dest))
    except Exception as error:  # offline, unknown repo/commit, gated, HTTP: all end the same way
        raise StageError(
            f"could not download {repo}@{revision} from the hub: {type(error).__name__}: {error}"
        ) from error
    shutil.rmtree(dest / ".cache", ignore_errors=True)  # download bookkeeping, not checkpoint
    if not expected:
        raise StageError(f"the hub lists no files for {repo}@{revision}")
    verify_against_hub(dest, expected, f"{repo}@{revision}")
    if not (dest / "config.json").is_file() or not list(dest.glob("*.safetensors")):
        raise StageError(f"{repo}@{revision} has no config.json or *.safetensors: not a checkpoint")
    return {"hub": {"repo": repo, "revision": revision, "files": expected}}


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
    checked = f", each matching the hub's hash at {record['hub']['revision']}" if "hub" in record else ""
    print(f"download: {record['files']} files in {job.output.checkpoint}{checked}")


if __name__ == "__main__":
    from lib.stage import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
