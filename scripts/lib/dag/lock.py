"""The lock: what each name that can float resolved to when it was first fetched, committed under config/lock/ so
that every clone calibrates, gates and builds on the same bytes.

A name floats where the config leaves it unpinned: a hub dataset whose commit is null (calibration.revision,
quality.datasets: its main branch) and the base image named by tag (image.base). Each such name has one entry file:

    config/lock/datasets/<owner>/<name>.yaml                  dataset: <owner>/<name>    commit: <40 hex> | null
    config/lock/images/<registry>/<repository>/<tag>.yaml     image: <registry>/<repository>:<tag>
                                                              digest: sha256:<64 hex> | null

null: nothing fetched it yet. The stage that fetches a name (download_datasets, pull_base) compares what the hub or
the registry answers with its entry: a filled entry must equal it, else the stage fails naming both; a null entry is
filled with it once the stage's outputs are complete (a failed stage writes nothing). A config pin needs no entry;
where one exists, the pin must equal it. `python3 tools/lock.py` adds entries and moves them on purpose.

Each entry is an input of the rule that fetches its name, so an entry that changes (refreshed here, or by a pulled
commit) reruns that fetch and what was made from it, while the entry a job fills itself does not: Snakemake touches a
job's outputs once it ends. One file per name, each write whole (a temporary file renamed over the entry) and made
under a lock on <lock dir>/.lock: parallel jobs and the tool never interleave a check and a write, and a reader sees
the old entry or the new one.
"""

import fcntl
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

from lib.stage import StageError, write_atomically

LOCK_DIR = "config/lock"
TOOL = "python3 tools/lock.py"
COMMIT_RE = re.compile(r"[0-9a-f]{40}")
DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
# kind -> (key of the entry's name, key of its value, what a value looks like)
KINDS = {"datasets": ("dataset", "commit", COMMIT_RE), "images": ("image", "digest", DIGEST_RE)}
HEADERS = {
    "datasets": "# The commit this hub dataset resolved to at its first fetch (null: not fetched yet), written by\n"
    "# download_datasets; every later fetch must resolve to the same. To move it on purpose:\n",
    "images": "# The digest this image tag resolved to at its first pull (null: not pulled yet), written by\n"
    "# pull_base; every later pull must resolve to the same. To move it on purpose:\n",
}
# A Docker reference: [host[:port]/]path[:tag][@sha256:<hex>], the host told apart as Docker tells it.
_PATH_PART = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_IMAGE_RE = re.compile(
    rf"(?:(?P<host>[A-Za-z0-9.-]+(?::[0-9]+)?)/)?(?P<path>{_PATH_PART}(?:/{_PATH_PART})*)"
    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?"
)


class LockError(StageError):
    """A lock entry that disagrees with the config or with what was fetched, or one that cannot be read."""


@dataclass(frozen=True)
class Entry:
    kind: str  # "datasets" | "images"
    name: str  # the dataset's repository, or the image's <registry>/<repository>:<tag>
    path: Path
    value: str | None  # None: nothing fetched it yet


@dataclass(frozen=True)
class Name:
    """A name the config fetches that the lock can hold: `pinned` is the config's own pin, if any."""

    kind: str
    name: str
    pinned: str | None
    key: str  # the config key that pins it
    use: str  # the fetch that resolves it: calibration, gate (download_datasets) or base (pull_base)


def parse_image(ref: str) -> tuple[str, str | None, str | None]:
    """(<registry>/<repository>, tag, digest) of a Docker reference, the registry spelled out as Docker reads it
    (docker.io when the first part names no host; library/ before an official image's name)."""
    found = _IMAGE_RE.fullmatch(ref)
    if not found:
        raise LockError(f"{ref!r} is not an image reference (registry/repository:tag[@sha256:<64 hex>])")
    host, path = found.group("host"), found.group("path")
    if host and not ("." in host or ":" in host or host == "localhost"):  # a first part that names no host
        host, path = None, f"{host}/{path}"
    if not host:
        host = "docker.io"
        path = path if "/" in path else f"library/{path}"
    return f"{host}/{path}", found.group("tag"), found.group("digest")


def image_name(ref: str) -> str:
    """The lock's name of an image reference: <registry>/<repository>:<tag> (refused without a tag)."""
    repository, tag, _ = parse_image(ref)
    if tag is None:
        raise LockError(f"{ref!r} names no tag: write it as {ref.split('@')[0]}:<tag>")
    return f"{repository}:{tag}"


def dataset_key(use: str, repo: str) -> str:
    return "calibration.revision" if use == "calibration" else f"quality.datasets.{repo}"


def config_names(config: dict) -> list[Name]:
    """Every name the config (defaults filled) has a fetch resolve: hub datasets and a registry base."""
    names = []
    calibration = config["calibration"]
    if calibration["source"] == "hf_dataset":
        repo = calibration["dataset"]
        names.append(Name("datasets", repo, calibration["revision"], dataset_key("calibration", repo), "calibration"))
    for repo, pin in config["quality"]["datasets"].items():
        names.append(Name("datasets", repo, pin, dataset_key("gate", repo), "gate"))
    image = config["image"]
    if image["base"] != "local" and not image["allow_unpinned_base"]:
        repository, tag, digest = parse_image(image["base"])
        if tag:  # a digest alone names one image, whatever the registry's tags say
            names.append(Name("images", f"{repository}:{tag}", digest, "image.base", "base"))
    return names


def entry_path(kind: str, name: str, lock_dir: str | Path = LOCK_DIR) -> Path:
    if kind == "datasets":
        return Path(lock_dir, kind, f"{name}.yaml")
    repository, tag = name.rsplit(":", 1)
    return Path(lock_dir, kind, repository, f"{tag}.yaml")


def lock_root(entry: Entry) -> Path:
    """The lock folder an entry file lies in (where the writers' lock file is)."""
    return entry.path.parents[len(entry_path(entry.kind, entry.name, ".").parts) - 1]


def read_entry(path: str | Path) -> Entry:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise LockError(f"cannot read the lock entry {path}: {error}") from error
    for kind, (name_key, value_key, pattern) in KINDS.items():
        if isinstance(data, dict) and set(data) == {name_key, value_key}:
            name, value = data[name_key], data[value_key]
            if not isinstance(name, str) or not (value is None or pattern.fullmatch(str(value))):
                break
            expected = entry_path(kind, name, ".")
            if path.parts[-len(expected.parts) :] != expected.parts:
                raise LockError(f"the lock entry {path} names {kind[:-1]} {name}, whose entry is <lock dir>/{expected}")
            return Entry(kind, name, path, value)
    shapes = "; ".join(f"{{{n}: <name>, {v}: {p.pattern} or null}}" for n, v, p in KINDS.values())
    raise LockError(f"the lock entry {path} is not one of: {shapes}")


def read_entries(paths) -> list[Entry]:
    """The entries of a rule's input (one path, or a list of them)."""
    return [read_entry(path) for path in ([paths] if isinstance(paths, (str, Path)) else paths or [])]


def entry_text(kind: str, name: str, value: str | None) -> str:
    name_key, value_key, _ = KINDS[kind]
    body = yaml.safe_dump({name_key: name, value_key: value}, sort_keys=False)
    return HEADERS[kind] + f"#   {TOOL} refresh {name}\n" + body


def write_entry(path: str | Path, kind: str, name: str, value: str | None) -> None:
    """The whole entry or none of it (lib.stage.write_atomically)."""
    write_atomically(path, entry_text(kind, name, value))


@contextmanager
def writing(lock_dir: str | Path):
    """Held while entries of `lock_dir` are checked and written (fcntl, which NFS honours too)."""
    Path(lock_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(lock_dir) / ".lock", "a") as handle:
        fcntl.lockf(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(handle, fcntl.LOCK_UN)


def pin_text(entry: Entry, value: str) -> str:
    """How the config pins `value` for this entry's name."""
    return f"{entry.name}@{value}" if entry.kind == "images" else value


def check(entry: Entry, answered: str, source: str, pinned: str | None, key: str) -> None:
    """`answered`: what `source` (the hub, the registry) resolves the name to now; refused unless the entry is empty or
    holds the same."""
    if entry.value is None or entry.value == answered:
        return
    if pinned:
        raise LockError(disagreement(entry, pinned, key))
    raise LockError(
        f"{source} answers {answered} now, but the lock entry {entry.path} holds {entry.value}, what its first fetch "
        f"resolved: it moved upstream. To keep the locked one, pin it (config key '{key}': "
        f"{pin_text(entry, entry.value)}); to move to the new one on purpose: {TOOL} refresh {entry.name}"
    )


def disagreement(entry: Entry, pinned: str, key: str) -> str:
    return (
        f"config key '{key}' pins {pinned}, but the lock entry {entry.path} holds {entry.value}: make them agree "
        f"(pin {pin_text(entry, entry.value)}, or lock the pin: {TOOL} refresh {entry.name})"
    )


def record(answers: list[tuple[Entry, str]]) -> list[Entry]:
    """Fill each empty entry with what its fetch resolved (call once the fetch's outputs are complete); an entry filled
    meanwhile must hold the same. Returns the entries written."""
    written = []
    for entry, value in answers:
        with writing(lock_root(entry)):
            now = read_entry(entry.path)
            if now.value is None:
                write_entry(entry.path, entry.kind, entry.name, value)
                written.append(Entry(entry.kind, entry.name, entry.path, value))
            elif now.value != value:
                raise LockError(
                    f"the lock entry {entry.path} was filled with {now.value} while this fetch resolved "
                    f"{entry.name} to {value}: rerun to check against it"
                )
    return written


def entry_inputs(config: dict, use: str, root: str | Path, lock_dir: str = LOCK_DIR) -> list[str]:
    """The entry files a fetch reads (rule inputs, relative to the project root): every name of `use` whose entry
    exists; lib/config refuses a floating name without one before any job runs."""
    paths = [entry_path(n.kind, n.name, lock_dir) for n in config_names(config) if n.use == use]
    return [str(path) for path in paths if (Path(root) / path).is_file()]


def problems(config: dict, root: str | Path, lock_dir: str = LOCK_DIR) -> list[str]:
    """What a run would trip on, before any job runs: a floating name with no entry, an unreadable entry, a pin that
    disagrees with its entry."""
    found = []
    for name in config_names(config):
        path = entry_path(name.kind, name.name, lock_dir)
        if not (Path(root) / path).is_file():
            if not name.pinned:
                found.append(
                    f"config key '{name.key}': {name.name} floats (no pin) and has no lock entry {path}: add it "
                    f"(`{TOOL} add` writes an empty one its first fetch fills; `{TOOL} refresh {name.name}` resolves "
                    "it now), or pin it"
                )
            continue
        try:
            entry = read_entry(Path(root) / path)
        except LockError as error:
            found.append(f"config key '{name.key}': {error}")
            continue
        entry = Entry(entry.kind, entry.name, path, entry.value)
        if name.pinned and entry.value and name.pinned != entry.value:
            found.append(disagreement(entry, name.pinned, name.key))
    return found
