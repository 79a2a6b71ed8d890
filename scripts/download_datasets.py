"""download_datasets: fetch, once, every hub dataset a later stage reads, at a pinned commit, into a datasets cache that
stage then reads with the hub off (lib/stage.run_stage; lib/hub.use_fetched_datasets).

use "calibration": quantize's calibration set (calibration.source hf_dataset), loaded as quantize loads it.
use "gate": every hub dataset the quality gate's tasks load, found by letting lm-eval build each task exactly as
quality_gate does, with `datasets.load_dataset` pinned to the commit quality.datasets names for that dataset.

Each dataset's commit is resolved before anything is loaded (null: its main branch, warned about) and checked against
the dataset's lock entry (lib/dag/lock.py: a filled entry must hold the same commit, else the stage fails naming both);
every file the loader downloaded is checked against the hashes the hub lists for that commit (lib/hub.py) and then
dropped: what is kept is the prepared cache (arrow files), its sha256 manifest and a record of what was fetched, for
which user, at which commit. Built aside and renamed into place (lib/checkpoint.py): a failure keeps nothing a rerun
would trust, and writes no lock entry; an empty entry is filled with the commit fetched once all of it is in place.
"""

import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

from lib.checkpoint import write_checkpoint
from lib.dag import lock
from lib.hub import hub_hashes, hub_repo_cache, verify_against_hub
from lib.progress import Heartbeat, bytes_under, elapsed
from lib.stage import StageError

SCHEMA = Path(__file__).resolve().parent.parent / "schemas" / "datasets.schema.yaml"
HUB_REPO_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
USES = ("calibration", "gate")


def is_hub_dataset(path) -> bool:
    """A `load_dataset` path that names a hub repository (not a packaged builder such as "json", nor a local folder)."""
    return isinstance(path, str) and HUB_REPO_RE.fullmatch(path) is not None and not Path(path).exists()


class Fetcher:
    """Resolves each hub dataset to one commit (once), loads it into `cache_dir`, and remembers what it loaded."""

    def __init__(
        self,
        cache_dir: Path,
        hub_cache: Path,
        pins: dict[str, str | None],
        use: str = "gate",
        locked: dict[str, lock.Entry] | None = None,
    ):
        import datasets

        self.cache_dir, self.hub_cache, self.pins = cache_dir, hub_cache, dict(pins)
        self.use, self.locked = use, dict(locked or {})  # repo -> its lock entry, where it has one
        self.fetched: dict[str, dict] = {}  # repo -> its record entry
        self._load_dataset = datasets.load_dataset  # the library's own, also while fetch_gate stands in for it

    def commit_of(self, repo: str, user: str) -> str:
        if repo not in self.pins:
            raise StageError(
                f"{user} loads the hub dataset {repo}, which is not pinned: add `{repo}: <commit>` (or null for its "
                "main branch, resolved and recorded) to the profile's list of datasets (quality.datasets)"
            )
        entry = self.fetched.get(repo)
        if entry is None:
            from huggingface_hub import HfApi

            revision = self.pins[repo]
            try:
                commit = HfApi().dataset_info(repo, revision=revision or "main").sha
            except Exception as error:  # gated, unknown repo or revision, offline, HTTP
                raise StageError(
                    f"cannot resolve the dataset {repo}@{revision or 'main'} on the hub: "
                    f"{type(error).__name__}: {str(error)[:300]}" + _gated_hint(error)
                ) from error
            if revision and commit != revision:
                raise StageError(f"the hub answers commit {commit} for {repo}@{revision}")
            locked = self.locked.get(repo)
            if locked is not None:
                source = f"the hub's {'commit ' + revision if revision else 'main branch'} of dataset {repo}"
                lock.check(locked, commit, source, revision, lock.dataset_key(self.use, repo))
            if not revision:
                if locked is None:
                    kept = "no lock entry holds it: pin it"
                elif locked.value:
                    kept = f"as its lock entry {locked.path} holds"
                else:
                    kept = f"recorded in its lock entry {locked.path} once fetched"
                print(
                    f"WARNING: dataset {repo} is not pinned: its main branch is {commit} today ({kept})",
                    file=sys.stderr,
                    flush=True,
                )
            entry = self.fetched[repo] = {
                "repo": repo,
                "revision": revision,
                "commit": commit,
                "configs": [],
                "users": [],
            }
        if user not in entry["users"]:
            entry["users"].append(user)
        return entry["commit"]

    def load(self, user: str, path, name=None, **kwargs):
        """`datasets.load_dataset` for `user`, pinned: what the gate's tasks call while they are built."""
        if is_hub_dataset(path):
            commit = self.commit_of(path, user)
            asked = kwargs.get("revision")
            if asked and asked != commit:
                raise StageError(f"{user} asks for {path}@{asked}, the profile pins {commit}")
            kwargs["revision"] = commit
            configs = self.fetched[path]["configs"]
            if name not in configs:
                configs.append(name)
        try:
            return self._load_dataset(path, name, cache_dir=str(self.cache_dir), **kwargs)
        except StageError:
            raise
        except Exception as error:
            raise StageError(
                f"{user}: cannot load the dataset {path}"
                + (f" ({name})" if name else "")
                + f": {type(error).__name__}: {str(error)[:300]}"
                + _gated_hint(error)
            ) from error

    def verify_downloads(self) -> None:
        """Every file downloaded for a dataset is what the hub lists for its commit; record the hub's hashes."""
        from huggingface_hub import HfApi

        for repo, entry in self.fetched.items():
            snapshot = hub_repo_cache(self.hub_cache, "dataset", repo, entry["commit"])
            if not snapshot.is_dir():
                raise StageError(f"nothing was downloaded for {repo}@{entry['commit']} (expected under {snapshot})")
            listed = hub_hashes(
                HfApi().list_repo_tree(repo, revision=entry["commit"], repo_type="dataset", recursive=True)
            )
            checked = verify_against_hub(snapshot, listed, f"dataset {repo}@{entry['commit']}", complete=False)
            entry["files"] = {name: listed[name] for name in checked}


def _gated_hint(error: BaseException) -> str:
    gated = "Gated" in type(error).__name__ or "gated" in str(error).lower()
    return " (a gated dataset: set HF_TOKEN to a token whose account accepted its terms)" if gated else ""


def fetch_calibration(fetcher: Fetcher, calibration: dict) -> None:
    fetcher.load("calibration", calibration["dataset"], split=calibration["split"])


def fetch_gate(fetcher: Fetcher, tasks: list[dict], tasks_dir: str | None) -> None:
    """Build every task as quality_gate does; each hub dataset a task loads is fetched at its pinned commit."""
    import datasets
    from lm_eval.tasks import get_task_dict

    from lib.gate_tasks import task_manager

    manager = task_manager(tasks_dir)
    real = datasets.load_dataset
    try:
        for task in tasks:
            if task["task"] not in manager.all_tasks:
                raise StageError(f"task {task['name']}: lm-eval knows no task {task['task']!r}")
            datasets.load_dataset = lambda path, name=None, _user=f"task {task['name']}", **kw: fetcher.load(
                _user, path, name, **kw
            )
            get_task_dict([task["task"]], manager)
    finally:
        datasets.load_dataset = real


def fetch(use: str, params, dest: Path, hub_cache: Path, locked: dict[str, lock.Entry] | None = None) -> dict:
    """Fill `dest` (the datasets cache) for `use`; return the record's fields."""
    pins = {params.calibration["dataset"]: params.calibration["revision"]} if use == "calibration" else params.pins
    fetcher = Fetcher(dest, hub_cache, dict(pins or {}), use, locked)

    def progress(seconds: float) -> str:
        fetched = ", ".join(fetcher.fetched) or "none yet"
        return (
            f"[download_datasets] {use}: {elapsed(seconds)}; datasets resolved: {fetched}; downloaded "
            f"{bytes_under(hub_cache)}, prepared {bytes_under(dest)}"
        )

    with Heartbeat(progress):
        if use == "calibration":
            fetch_calibration(fetcher, dict(params.calibration))
        else:
            fetch_gate(fetcher, list(params.tasks), params.tasks_dir)
        unused = sorted(set(fetcher.pins) - set(fetcher.fetched))
        if unused:
            print(f"WARNING: no gate task loads {', '.join(unused)} (pinned, not fetched)", file=sys.stderr)
    fetcher.verify_downloads()
    return {"datasets": list(fetcher.fetched.values())}


def main(job) -> None:
    use = job.wildcards.use
    if use not in USES:
        raise StageError(f"download_datasets: use must be one of {USES}, got {use!r}")
    out = Path(job.output.cache).parent
    out.mkdir(parents=True, exist_ok=True)
    locked = {entry.name: entry for entry in lock.read_entries(job.input.lock) if entry.kind == "datasets"}
    # the loader's raw downloads go to a hub cache of their own, checked, then dropped: only the prepared cache stays
    hub_cache = Path(tempfile.mkdtemp(prefix=".hub-", dir=out))
    os.environ["HF_HUB_CACHE"] = str(hub_cache)  # before huggingface_hub is imported (it reads it once)
    try:
        output = SimpleNamespace(checkpoint=job.output.cache, manifest=job.output.manifest, record=job.output.record)
        record = write_checkpoint(
            output, lambda tmp: fetch(use, job.params, tmp, hub_cache, locked), {"use": use}, SCHEMA
        )
    finally:
        shutil.rmtree(hub_cache, ignore_errors=True)
    answers = [(locked[entry["repo"]], entry["commit"]) for entry in record["datasets"] if entry["repo"] in locked]
    for written in lock.record(answers):
        print(f"download_datasets [{use}]: recorded {written.name}@{written.value} in {written.path}")
    for entry in record["datasets"]:
        print(
            f"download_datasets [{use}]: {entry['repo']}@{entry['commit']} for {', '.join(entry['users'])}, "
            f"{len(entry['files'])} files checked against the hub"
        )
    print(
        f"download_datasets [{use}]: {len(record['datasets'])} hub datasets, {record['files']} cache files in "
        f"{job.output.cache}"
    )


if __name__ == "__main__":
    from lib.stage import run_stage

    run_stage(main, globals().get("snakemake"), __file__, online=True)
