"""download_datasets against a local stand-in of the hub (tests/support/hub_standin.py), through the real
huggingface_hub, datasets and lm-eval of the eval venv: pinned commits, the hub's own hashes, the lock
(lib/dag/lock.py: the first fetch records the commit, later ones must resolve to it, tools/lock.py moves it), and later
stages reading the fetched cache with the hub off (quality_gate's task loading, quantize's calibration loading)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from hub_standin import StandinHub, run_stage_script
from lib.dag import lock
from lib.stage import HUB_OFFLINE_ENV

sys.path.insert(0, str(ROOT))
from tools import lock as lock_tool  # noqa: E402

SCRIPT = ROOT / "scripts" / "download_datasets.py"
EVAL = ROOT / ".venvs" / "eval" / "bin" / "python"
COMPRESS = ROOT / ".venvs" / "compress" / "bin" / "python"
COMMIT, OTHER_COMMIT, MOVED_COMMIT = "c" * 40, "d" * 40, "f" * 40
DATA = "data/train-00000-of-00001.jsonl"
CARD = b"---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/train-*.jsonl\n---\n"
TASK_YAML = """task: {task}
dataset_path: {repo}
test_split: train
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs: {{until: ["\\n"]}}
metric_list:
  - metric: exact_match
"""


def jsonl(rows: dict) -> bytes:
    """Columns as JSON lines, one row a line (the driver has no pyarrow to write parquet)."""
    return "".join(
        json.dumps(dict(zip(rows, row, strict=True))) + "\n" for row in zip(*rows.values(), strict=True)
    ).encode()


GATE_ROWS = {"question": ["2+2?", "3+3?"], "answer": ["4", "6"]}
CALIBRATION_ROWS = {"text": [f"calibration sample {i}" for i in range(5)]}


@pytest.fixture
def hub():
    with StandinHub() as standin:
        for repo, commit, rows in (
            ("org/gate-qa", COMMIT, GATE_ROWS),
            ("org/other-qa", OTHER_COMMIT, GATE_ROWS),
            ("org/calib", COMMIT, CALIBRATION_ROWS),
        ):
            standin.add(repo, commit, {"README.md": CARD, DATA: jsonl(rows)}, lfs={DATA}, repo_type="dataset")
        yield standin


@pytest.fixture
def tasks_dir(tmp_path):
    folder = tmp_path / "tasks"
    folder.mkdir()
    for task, repo in (("pinned_qa", "org/gate-qa"), ("other_qa", "org/other-qa")):
        (folder / f"{task}.yaml").write_text(TASK_YAML.format(task=task, repo=repo))
    return folder


def fetch(tmp_path, hub, use, params, name="out", lock_entries=()):
    out = tmp_path / name / use
    job = {
        "rule": "download_datasets",
        "input": {"lock": [str(path) for path in lock_entries]},
        "output": {"cache": str(out / "cache"), "manifest": str(out / "manifest.json"), "record": str(out / "d.json")},
        "params": {"calibration": None, "tasks": None, "pins": None, "tasks_dir": None, **params},
        "log": [],
        "threads": 1,
        "wildcards": {"use": use},
    }
    return run_stage_script(EVAL, SCRIPT, job, hub, tmp_path), out


def gate_params(tasks_dir, pins, tasks=("pinned_qa",)):
    return {
        "tasks": [{"name": task.split("_")[0], "task": task} for task in tasks],
        "pins": pins,
        "tasks_dir": str(tasks_dir),
    }


OFFLINE_GATE_READ = """
import json, sys
from lib.gate_tasks import task_manager
from lib.hub import use_fetched_datasets
from lm_eval.tasks import get_task_dict
use_fetched_datasets(sys.argv[1], sys.argv[2])
manager = task_manager(sys.argv[3])
docs = list(get_task_dict(["pinned_qa"], manager)["pinned_qa"].test_docs())
print("DOCS " + json.dumps(docs))
try:
    get_task_dict(["other_qa"], manager)
except Exception as error:
    print("UNFETCHED " + json.dumps(f"{type(error).__name__}: {error}"))
"""


def offline(python, code, *args, tmp_path):
    env = {"PYTHONPATH": str(ROOT / "scripts"), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **HUB_OFFLINE_ENV}
    env["HF_HOME"] = str(tmp_path / "offline-home")  # nothing cached there: only the fetched cache can answer
    run = subprocess.run([str(python), "-c", code, *map(str, args)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in run.stdout.splitlines() if " " in line}


@pytest.mark.e2e
@pytest.mark.usefixtures("tiny_venvs")
def test_gate_datasets_are_fetched_at_their_pin_checked_and_read_with_the_hub_off(tmp_path, hub, tasks_dir):
    result, out = fetch(tmp_path, hub, "gate", gate_params(tasks_dir, {"org/gate-qa": COMMIT}))
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((out / "d.json").read_text())
    (entry,) = record["datasets"]
    assert entry["repo"] == "org/gate-qa" and entry["commit"] == COMMIT and entry["revision"] == COMMIT
    assert entry["users"] == ["task pinned"] and entry["configs"] == [None]
    assert entry["files"][DATA]["sha256"] == hub.repos[("dataset", "org/gate-qa")].entry(DATA)["lfs"]["oid"]
    assert record["files"] == len(json.loads((out / "manifest.json").read_text())) > 0
    assert not list(out.glob(".hub-*"))  # the raw downloads were dropped once checked
    assert any(f"/datasets/org/gate-qa/resolve/{COMMIT}/" in path for _, _, path in hub.requests)
    assert not any("/resolve/main/" in path for _, _, path in hub.requests)  # the pin, never the branch

    asked = len(hub.requests)
    seen = offline(EVAL, OFFLINE_GATE_READ, out / "cache", out / "manifest.json", tasks_dir, tmp_path=tmp_path)
    assert seen["DOCS"] == [{"question": q, "answer": a} for q, a in zip(*GATE_ROWS.values(), strict=True)]
    assert "org/other-qa" in seen["UNFETCHED"]  # a task whose dataset nobody fetched fails, naming it
    assert len(hub.requests) == asked  # the hub was never asked


@pytest.mark.e2e
@pytest.mark.usefixtures("tiny_venvs")
def test_an_unpinned_dataset_is_resolved_and_recorded_an_unlisted_one_refused(tmp_path, hub, tasks_dir):
    result, out = fetch(tmp_path, hub, "gate", gate_params(tasks_dir, {"org/gate-qa": None}))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"dataset org/gate-qa is not pinned: its main branch is {COMMIT}" in result.stderr
    (entry,) = json.loads((out / "d.json").read_text())["datasets"]
    assert entry["revision"] is None and entry["commit"] == COMMIT

    params = gate_params(tasks_dir, {"org/gate-qa": COMMIT}, tasks=("pinned_qa", "other_qa"))
    result, out = fetch(tmp_path, hub, "gate", params, name="unlisted")
    assert result.returncode != 0
    assert "task other loads the hub dataset org/other-qa, which is not pinned" in result.stderr
    assert not (out / "cache").exists() and not (out / "manifest.json").exists() and not (out / "d.json").exists()


@pytest.mark.e2e
@pytest.mark.usefixtures("tiny_venvs")
def test_a_corrupted_or_unknown_dataset_keeps_nothing(tmp_path, hub, tasks_dir):
    hub.serve_instead("org/gate-qa", DATA, jsonl({"question": ["2+2?", "3+3?"], "answer": ["5", "6"]}), "dataset")
    result, out = fetch(tmp_path, hub, "gate", gate_params(tasks_dir, {"org/gate-qa": COMMIT}))
    assert result.returncode != 0
    assert f"dataset org/gate-qa@{COMMIT}: the download does not match the hub's own hashes" in result.stderr
    assert f"{DATA}: the hub's LFS sha256 is" in result.stderr
    assert not (out / "cache").exists() and not (out / "manifest.json").exists() and not (out / "d.json").exists()
    assert not list(out.glob(".hub-*")) and not list(out.glob("*.partial"))

    result, _ = fetch(tmp_path, hub, "gate", gate_params(tasks_dir, {"org/gate-qa": "e" * 40}), name="unknown")
    assert result.returncode != 0 and f"cannot resolve the dataset org/gate-qa@{'e' * 40} on the hub" in result.stderr


def lock_entry(tmp_path, repo, value=None) -> Path:
    path = lock.entry_path("datasets", repo, tmp_path / "lock")
    lock.write_entry(path, "datasets", repo, value)
    return path


def kept_nothing(out: Path) -> bool:
    return not (out / "cache").exists() and not (out / "manifest.json").exists() and not (out / "d.json").exists()


@pytest.mark.e2e
@pytest.mark.usefixtures("tiny_venvs")
def test_the_first_fetch_locks_the_commit_and_every_later_fetch_must_resolve_to_it(
    tmp_path, hub, tasks_dir, monkeypatch
):
    entry = lock_entry(tmp_path, "org/gate-qa")
    params = gate_params(tasks_dir, {"org/gate-qa": None})  # floating: main, as the lock holds it
    result, _ = fetch(tmp_path, hub, "gate", params, lock_entries=[entry])
    assert result.returncode == 0, result.stderr[-3000:]
    assert lock.read_entry(entry).value == COMMIT
    assert f"recorded org/gate-qa@{COMMIT} in {entry}" in result.stdout
    written = entry.stat().st_mtime_ns

    result, _ = fetch(tmp_path, hub, "gate", params, name="again", lock_entries=[entry])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"its main branch is {COMMIT} today (as its lock entry {entry} holds)" in result.stderr
    assert entry.stat().st_mtime_ns == written  # matched, not rewritten

    hub.add(
        "org/gate-qa", MOVED_COMMIT, dict(hub.repos[("dataset", "org/gate-qa")].files), lfs={DATA}, repo_type="dataset"
    )
    result, out = fetch(tmp_path, hub, "gate", params, name="moved", lock_entries=[entry])
    assert result.returncode != 0
    assert (
        f"the hub's main branch of dataset org/gate-qa answers {MOVED_COMMIT} now, but the lock entry {entry} holds "
        f"{COMMIT}" in result.stderr
    )
    assert f"(config key 'quality.datasets.org/gate-qa': {COMMIT})" in result.stderr
    assert "python3 tools/lock.py refresh org/gate-qa" in result.stderr
    assert kept_nothing(out) and lock.read_entry(entry).value == COMMIT

    # the refresh command moves the entry to what the hub answers now; the fetch then passes
    profile = yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())
    profile["quality"]["datasets"] = {"org/gate-qa": None}
    (tmp_path / "profile.yaml").write_text(yaml.safe_dump(profile))
    for key, value in (("HF_ENDPOINT", hub.endpoint), ("NO_PROXY", "127.0.0.1"), ("HF_HOME", str(tmp_path / "h"))):
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    refresh = ["refresh", "org/gate-qa", "--configfile", str(tmp_path / "profile.yaml")]
    assert lock_tool.main([*refresh, "--lock-dir", str(entry.parents[2])]) == 0
    assert lock.read_entry(entry).value == MOVED_COMMIT
    result, _ = fetch(tmp_path, hub, "gate", params, name="refreshed", lock_entries=[entry])
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.e2e
@pytest.mark.usefixtures("tiny_venvs")
def test_a_pin_the_lock_disagrees_with_fails_naming_both_and_the_key(tmp_path, hub):
    entry = lock_entry(tmp_path, "org/calib", OTHER_COMMIT)
    calibration = {"dataset": "org/calib", "split": "train", "revision": COMMIT}
    result, out = fetch(tmp_path, hub, "calibration", {"calibration": calibration}, lock_entries=[entry])
    assert result.returncode != 0
    assert f"config key 'calibration.revision' pins {COMMIT}, but the lock entry {entry} holds {OTHER_COMMIT}" in (
        result.stderr
    )
    assert kept_nothing(out) and lock.read_entry(entry).value == OTHER_COMMIT


OFFLINE_CALIBRATION = """
import json, sys
from lib.hub import use_fetched_datasets
import quantize
use_fetched_datasets(sys.argv[1], sys.argv[2])
texts = quantize.load_calibration_texts("hf_dataset", 3, 0, dataset="org/calib", split="train", revision=sys.argv[3])
print("TEXTS " + json.dumps(texts))
"""


@pytest.mark.e2e
@pytest.mark.usefixtures("tiny_venvs")
def test_the_calibration_set_is_fetched_once_and_quantize_reads_it_offline(tmp_path, hub):
    calibration = {"dataset": "org/calib", "split": "train", "revision": COMMIT}
    result, out = fetch(tmp_path, hub, "calibration", {"calibration": calibration})
    assert result.returncode == 0, result.stderr[-3000:]
    (entry,) = json.loads((out / "d.json").read_text())["datasets"]
    assert entry["users"] == ["calibration"] and entry["commit"] == COMMIT
    seen = offline(COMPRESS, OFFLINE_CALIBRATION, out / "cache", out / "manifest.json", COMMIT, tmp_path=tmp_path)
    assert len(seen["TEXTS"]) == 3 and set(seen["TEXTS"]) <= set(CALIBRATION_ROWS["text"])
