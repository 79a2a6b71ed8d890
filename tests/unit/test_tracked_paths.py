"""What the code, config and docs point at is in a clone, and run narrative stays out of code and config.

results/ is the pipeline's output folder: ignored as a whole, nothing in it tracked. Committed records live under
records/ (records/gpu-proof/), and a `records/...` path the code, config or docs name must be tracked. A path with
`<`, `{` or `*` is a pattern (records/gpu-proof/<gpu>/...), not a path, and is not checked.
"""

import posixpath
import re
import subprocess
from pathlib import Path

from conftest import ROOT

SUFFIXES = {".py", ".smk", ".yaml", ".yml", ".md", ".sh", ".toml"}
NAMES = {"Snakefile", "Dockerfile"}
PATTERN_CHARS = set("<>{}*")
# A path token: letters, digits and the characters of file names and patterns; never preceded by a path character,
# so `myrecords/x` or `a/records/x` are not taken for the project's records/.
RECORDS_PATH = re.compile(r"(?<![\w./-])records/[\w.\-/<>{}*]*")
RELATIVE_PATH = re.compile(r"(?<![\w./-])(?:\.\./)+[\w.\-/<>{}*]+")
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
MACHINE_ID = re.compile(r"\bmachine\d+\b")


def git(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, input=stdin, capture_output=True, text=True)


def tracked() -> list[str]:
    listed = git("ls-files", "-z")
    assert listed.returncode == 0, listed.stderr
    return [name for name in listed.stdout.split("\0") if name]


def sources(names: list[str]) -> list[str]:
    """The tracked code, config and docs (the records under records/ are data, not checked)."""
    return [
        name
        for name in names
        if (Path(name).suffix in SUFFIXES or Path(name).name in NAMES)
        and not name.startswith("records/")
        and (ROOT / name).is_file()
    ]


def known(path: str, files: set[str], folders: set[str]) -> bool:
    path = path.rstrip("/")
    return path in files or path in folders


def folders_of(files: set[str]) -> set[str]:
    return {str(parent) for name in files for parent in Path(name).parents if str(parent) != "."}


def clean(token: str) -> str:
    """A path as written in prose or code, without the sentence's punctuation after it."""
    return token.rstrip(".,:;)")


def named_paths(pattern: re.Pattern, names: list[str]):
    for name in names:
        for number, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1):
            for match in pattern.finditer(line):
                path = clean(match.group(0))
                if path and not PATTERN_CHARS & set(path):
                    yield name, number, path


def ignored(paths: set[str]) -> set[str]:
    """The paths .gitignore ignores (by its patterns, whether or not they exist)."""
    checked = git("check-ignore", "--no-index", "--stdin", stdin="".join(f"{path}\n" for path in sorted(paths)))
    assert checked.returncode in (0, 1), checked.stderr  # 1: none ignored
    return set(checked.stdout.splitlines())


def test_results_is_an_ignored_output_folder_with_nothing_tracked():
    """A run writes results/; a clone carries none of it, so committed records cannot be overwritten by a run."""
    assert [name for name in tracked() if name.startswith("results/")] == []
    probes = {"results/gpu-proof/h200/x.json", "results/summary.json", "results/x/latency_probe/latency.json"}
    assert ignored(probes) == probes


def test_every_records_path_named_is_tracked_and_not_ignored():
    names = tracked()
    files = set(names)
    folders = folders_of(files)
    named = list(named_paths(RECORDS_PATH, sources(names)))
    assert named, "no records/ path found: the scan is broken"
    missing = [f"{name}:{number}: {path}" for name, number, path in named if not known(path, files, folders)]
    assert not missing, "these name records/ paths no clone has (not tracked):\n  " + "\n  ".join(missing)
    assert not ignored({path for _, _, path in named}), "records/ must not be ignored"


def test_every_relative_path_stays_in_the_repository_and_is_tracked():
    """A `../x` path, read from the folder of the file that names it, is a tracked file or folder of the project:
    the docs and code work from a clone. Tests are left out: their `../` paths name files of the scratch trees they
    write."""
    names = tracked()
    files = set(names)
    folders = folders_of(files)
    missing = []
    for name, number, path in named_paths(RELATIVE_PATH, [n for n in sources(names) if not n.startswith("tests/")]):
        target = posixpath.normpath(posixpath.join(posixpath.dirname(name), path))
        if target.startswith("../") or not known(target, files, folders):
            missing.append(f"{name}:{number}: {path}")
    assert not missing, "these name paths outside the repository or not tracked:\n  " + "\n  ".join(missing)


def test_code_and_config_hold_no_dates_or_machine_ids():
    """Dated run narrative belongs in records and commit messages, not in code or config comments."""
    names = [
        name for name in sources(tracked()) if not name.startswith(("tests/", "docs/")) and Path(name).suffix != ".md"
    ]
    found = [
        f"{name}:{number}: {match.group(0)}"
        for name in names
        for number, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1)
        for match in (*DATE.finditer(line), *MACHINE_ID.finditer(line))
    ]
    assert not found, "dates or machine ids in code or config:\n  " + "\n  ".join(found)
