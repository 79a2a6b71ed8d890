"""The lock (config/lock/, scripts/lib/dag/lock.py): what each hub dataset and registry base the profile fetches
resolved to.

    python3 tools/lock.py                       # every name the profile fetches, its pin and its lock entry
    python3 tools/lock.py add                   # an empty entry for each floating name that has none: the first
                                                # fetch (download_datasets, pull_base) fills it
    python3 tools/lock.py refresh [NAME ...]    # resolve the names now (all of the profile's unless named) and write
                                                # the entries that changed: the next `snakemake` run refetches those
    python3 tools/lock.py --configfile config/tiny.yaml mine.yaml ...   # another profile, layered as snakemake does

refresh resolves a hub dataset's main branch through the hub's API (HF_ENDPOINT, HF_TOKEN or the token `hf auth login`
saved; a gated set needs one) and a base image's tag by `docker pull` (the digest the registry answers); a name the
config pins is locked at its pin, unasked. An entry is rewritten only when its value changes, so an unchanged
refresh reruns nothing.
"""

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from lib import registry  # noqa: E402  (after the path it lives on)
from lib.dag import lock  # noqa: E402
from lib.dag.config import ConfigError, with_defaults  # noqa: E402
from lib.stage import StageError  # noqa: E402


def profile(configfiles: list[str]) -> dict:
    """The config as Snakemake reads it: config.yaml unless --configfile names others, each layered on the last."""
    merged: dict = {}

    def layer(into: dict, update: dict) -> None:
        for key, value in update.items():
            if isinstance(value, dict) and isinstance(into.get(key), dict):
                layer(into[key], value)
            else:
                into[key] = value

    for path in configfiles or [str(ROOT / "config.yaml")]:
        layer(merged, yaml.safe_load(Path(path).read_text()) or {})
    return with_defaults(merged)


def hub_token() -> str | None:
    token = os.environ.get("HF_TOKEN")
    if token:
        return token
    saved = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "token"
    return saved.read_text().strip() if saved.is_file() else None


def hub_commit(repo: str, revision: str = "main") -> str:
    """The commit the hub answers for dataset repo@revision (what huggingface_hub's dataset_info asks)."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    url = f"{endpoint}/api/datasets/{repo}/revision/{urllib.parse.quote(revision, safe='')}"
    token = hub_token()
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            commit = json.load(response).get("sha")
    except (urllib.error.URLError, OSError, ValueError) as error:
        raise lock.LockError(f"cannot resolve the dataset {repo}@{revision} at {endpoint}: {error}") from error
    if not isinstance(commit, str) or not lock.COMMIT_RE.fullmatch(commit):
        raise lock.LockError(f"{url} answered no commit (sha: {commit!r})")
    return commit


def resolve(name: lock.Name) -> tuple[str, str]:
    """(value, where it came from) for one name."""
    if name.pinned:
        return name.pinned, f"pinned by {name.key}"
    if name.kind == "datasets":
        return hub_commit(name.name), "the hub's main branch"
    return registry.pull_image(name.name), f"docker pull {name.name}"


def current(name: lock.Name, lock_dir: Path) -> lock.Entry | None:
    path = lock.entry_path(name.kind, name.name, lock_dir)
    return lock.read_entry(path) if path.is_file() else None


def show(names: list[lock.Name], lock_dir: Path) -> None:
    if not names:
        print("the profile fetches no hub dataset and no registry base: nothing to lock")
    for name in names:
        entry = current(name, lock_dir)
        held = "no entry" if entry is None else (entry.value or "empty: the first fetch fills it")
        pin = f"pinned {name.pinned}" if name.pinned else "floats"
        path = os.path.relpath(lock.entry_path(name.kind, name.name, lock_dir))
        print(f"{name.name} ({name.key}: {pin}): {path}: {held}")


def add(names: list[lock.Name], lock_dir: Path) -> None:
    for name in names:
        path = lock.entry_path(name.kind, name.name, lock_dir)
        if name.pinned or path.is_file():
            continue
        with lock.writing(lock_dir):
            if not path.is_file():
                lock.write_entry(path, name.kind, name.name, None)
                print(f"{name.name}: added {path} (empty: its first fetch fills it)")


def refresh(names: list[lock.Name], lock_dir: Path) -> None:
    for name in names:
        value, source = resolve(name)
        path = lock.entry_path(name.kind, name.name, lock_dir)
        with lock.writing(lock_dir):
            before = current(name, lock_dir)
            if before is None and name.pinned:
                print(f"{name.name}: {source}, which needs no lock entry")
                continue
            if before is not None and before.value == value:
                print(f"{name.name}: {value} ({source}), unchanged in {path}")
                continue
            lock.write_entry(path, name.kind, name.name, value)
        old = "no entry" if before is None else before.value
        print(f"{name.name}: {old} -> {value} ({source}) in {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", nargs="?", choices=["show", "add", "refresh"], default="show")
    parser.add_argument("names", nargs="*", help="datasets (owner/name) or images (registry/repository:tag)")
    parser.add_argument("--configfile", nargs="+", default=[], help="the profile, as snakemake --configfile")
    parser.add_argument("--lock-dir", default=str(ROOT / lock.LOCK_DIR), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    lock_dir = Path(args.lock_dir)
    try:
        names = lock.config_names(profile(args.configfile))
        if args.names:
            wanted = {name if "/" in name and ":" not in name else lock.image_name(name) for name in args.names}
            unknown = wanted - {name.name for name in names}
            if unknown:
                known = ", ".join(name.name for name in names) or "none"
                raise lock.LockError(f"the profile fetches no {', '.join(sorted(unknown))} (it fetches: {known})")
            names = [name for name in names if name.name in wanted]
        {"show": show, "add": add, "refresh": refresh}[args.action](names, lock_dir)
    except (StageError, ConfigError, OSError) as error:  # a LockError is a StageError
        print(f"tools/lock.py: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
