"""The Hugging Face Hub as every fetching stage sees it: pinned commits, the hub's own file hashes, offline mode.

download (the model) and download_datasets (calibration and gate data) both check what arrived against what the hub
lists for the pinned commit; every other stage runs with the hub switched off (lib/stage.run_stage).
"""

import hashlib
import os
import re
import shutil
from pathlib import Path

from lib.progress import Heartbeat, bytes_under, elapsed
from lib.stage import StageError, checkpoint_files, sha256_file

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


def verify_against_hub(dest: Path, expected: dict[str, dict], where: str, complete: bool = True) -> list[str]:
    """Every file the hub lists is in dest with the hub's hash (an LFS file's sha256, any other's git blob sha1), and
    nothing else is; else StageError naming each file that differs, with both hashes. `complete=False`: only the
    files a loader chose to fetch are there (a dataset's other configs are not), each as the hub lists it.
    Returns the files checked, sorted."""
    present = {str(path.relative_to(dest)): path for path in checkpoint_files(dest)}
    missing = sorted(set(expected) - set(present)) if complete else []
    problems = [f"{name}: listed by the hub, not downloaded" for name in missing]
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
    return sorted(present)


def hub_repo_cache(hub_cache: str | Path, repo_type: str, repo: str, commit: str) -> Path:
    """Where huggingface_hub keeps the files of repo@commit it downloaded into the hub cache `hub_cache`."""
    return Path(hub_cache) / f"{repo_type}s--{repo.replace('/', '--')}" / "snapshots" / commit


def use_fetched_datasets(cache_dir: str | Path, manifest_path: str | Path) -> Path:
    """Read hub datasets from the cache download_datasets prepared (quantize, quality_gate), after checking it against
    its manifest. With the hub off (lib/stage.run_stage), `datasets.load_dataset(<repo>)` then answers from this cache,
    and a dataset that was never fetched fails at once, naming it."""
    import datasets

    from lib.checkpoint import verify_manifest

    verify_manifest(cache_dir, manifest_path, allow_empty=True)
    # read at each load (a builder's cache root), so this holds whenever datasets was imported
    datasets.config.HF_DATASETS_CACHE = Path(cache_dir).resolve()
    return Path(cache_dir)


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

    def progress(seconds: float) -> str:
        return f"[download] {repo}@{revision[:12]}: {bytes_under(dest)} after {elapsed(seconds)}"

    try:
        expected = hub_hashes(HfApi().list_repo_tree(repo, revision=revision, recursive=True))
        with Heartbeat(progress):  # ~9 GB for Qwen3.5-4B: a line every 30 s on the console
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
