"""The lock (scripts/lib/dag/lock.py, config/lock/): entries read, written and checked; the base image's digest through
pull_base and a fake `docker`; the refresh tool (tools/lock.py) against the hub stand-in and the fake docker; the config
checked against the lock before any job runs. download_datasets' side: tests/e2e/test_download_datasets.py.
"""

import json
import multiprocessing
import os
import stat
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import yaml

from conftest import FAKE_DOCKER_HEAD, ROOT
from hub_standin import StandinHub
from lib.dag import config as pipeline_config, lock
from lib.stage import StageError

sys.path.insert(0, str(ROOT))
from tools import lock as lock_tool  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
import pull_base  # noqa: E402

TAG = "docker.io/vllm/vllm-openai:v0.26.0"
DIGEST, MOVED = "sha256:" + "1" * 64, "sha256:" + "2" * 64
COMMIT, MOVED_COMMIT = "c" * 40, "d" * 40


def test_image_references_are_named_as_docker_reads_them():
    assert lock.parse_image("vllm/vllm-openai:v0.26.0") == ("docker.io/vllm/vllm-openai", "v0.26.0", None)
    assert lock.parse_image(f"python:3.11@{DIGEST}") == ("docker.io/library/python", "3.11", DIGEST)
    assert lock.parse_image("localhost:5000/team/img:1") == ("localhost:5000/team/img", "1", None)
    assert lock.image_name("vllm/vllm-openai:v0.26.0") == TAG
    for bad in ("vllm/vllm-openai:v0.26.0@sha256:abc", "Vllm/UPPER:1", "a b:1"):
        with pytest.raises(lock.LockError, match="is not an image reference"):
            lock.parse_image(bad)
    with pytest.raises(lock.LockError, match="names no tag"):
        lock.image_name("vllm/vllm-openai")
    path = lock.entry_path("images", TAG, "L")
    assert path == Path("L/images/docker.io/vllm/vllm-openai/v0.26.0.yaml")
    assert lock.entry_path("datasets", "org/set", "L") == Path("L/datasets/org/set.yaml")


def test_an_entry_reads_back_and_a_misplaced_or_malformed_one_is_refused(tmp_path):
    path = lock.entry_path("datasets", "org/set", tmp_path)
    lock.write_entry(path, "datasets", "org/set", None)
    assert lock.read_entry(path) == lock.Entry("datasets", "org/set", path, None)
    lock.write_entry(path, "datasets", "org/set", COMMIT)
    assert lock.read_entry(path).value == COMMIT and not list(path.parent.glob(".*"))  # no temporary file left
    moved = tmp_path / "datasets" / "org" / "other.yaml"
    moved.write_text(path.read_text())
    with pytest.raises(lock.LockError, match="names dataset org/set, whose entry is <lock dir>/datasets/org/set.yaml"):
        lock.read_entry(moved)
    path.write_text("dataset: org/set\ncommit: main\n")
    with pytest.raises(lock.LockError, match="is not one of"):
        lock.read_entry(path)


def test_a_fetch_fills_an_empty_entry_and_must_match_a_filled_one(tmp_path):
    path = lock.entry_path("datasets", "org/set", tmp_path)
    lock.write_entry(path, "datasets", "org/set", None)
    empty = lock.read_entry(path)
    lock.check(empty, COMMIT, "the hub's main branch of dataset org/set", None, "quality.datasets.org/set")
    assert lock.record([(empty, COMMIT)]) == [lock.Entry("datasets", "org/set", path, COMMIT)]
    filled = lock.read_entry(path)
    lock.check(filled, COMMIT, "the hub's main branch of dataset org/set", None, "quality.datasets.org/set")
    assert lock.record([(filled, COMMIT)]) == []  # the same answer: nothing rewritten

    with pytest.raises(lock.LockError) as moved:
        lock.check(filled, MOVED_COMMIT, "the hub's main branch of dataset org/set", None, "quality.datasets.org/set")
    message = str(moved.value)
    assert f"the hub's main branch of dataset org/set answers {MOVED_COMMIT} now" in message
    assert f"the lock entry {path} holds {COMMIT}" in message
    assert f"'quality.datasets.org/set': {COMMIT}" in message and "tools/lock.py refresh org/set" in message

    with pytest.raises(lock.LockError) as pinned:
        lock.check(filled, MOVED_COMMIT, "the hub", MOVED_COMMIT, "calibration.revision")
    assert f"config key 'calibration.revision' pins {MOVED_COMMIT}, but the lock entry {path} holds {COMMIT}" in str(
        pinned.value
    )
    # filled by someone else since this fetch read it: refused, the other value kept
    with pytest.raises(lock.LockError, match=f"was filled with {COMMIT} while this fetch resolved"):
        lock.record([(empty, MOVED_COMMIT)])
    assert lock.read_entry(path).value == COMMIT


def _fill(lock_dir: str, name: str, value: str) -> str:
    path = lock.entry_path("datasets", name, lock_dir)
    try:
        lock.record([(lock.read_entry(path), value)])
        return "written"
    except lock.LockError:
        return "refused"


def test_parallel_fetches_never_clobber_an_entry(tmp_path):
    names = [f"org/set{i}" for i in range(6)]
    for name in names:
        lock.write_entry(lock.entry_path("datasets", name, tmp_path), "datasets", name, None)
    race = [(str(tmp_path), name, f"{i:x}" * 40) for i, name in enumerate(names)]
    race += [(str(tmp_path), "org/set0", f"{i:x}" * 40) for i in range(6, 12)]  # six more writers on one entry
    with multiprocessing.get_context("fork").Pool(6) as pool:
        outcomes = pool.starmap(_fill, race)
    held = {name: lock.read_entry(lock.entry_path("datasets", name, tmp_path)).value for name in names}
    assert all(held[name] == f"{i:x}" * 40 for i, name in enumerate(names) if i), held
    assert outcomes.count("written") == len(names) and outcomes.count("refused") == 6  # one value per entry
    assert held["org/set0"] in {value for _, name, value in race if name == "org/set0"}


# --- the config against the lock, before any job runs ---------------------------------------------------------------


def hub_config(calibration_pin=None, gate=None, base="local") -> dict:
    config = yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())
    config["calibration"] = {"source": "hf_dataset", "dataset": "org/calib", "revision": calibration_pin}
    config["quality"]["datasets"] = gate or {}
    config["image"]["base"] = base
    return pipeline_config.with_defaults(config)


def test_the_config_is_checked_against_the_lock(tmp_path):
    lock_dir = tmp_path / lock.LOCK_DIR
    config = hub_config(gate={"org/gate": None, "org/pinned": COMMIT}, base="vllm/vllm-openai:v0.26.0")
    problems = lock.problems(config, tmp_path)
    assert len(problems) == 3  # two floating names without an entry; the pinned dataset needs none
    assert any(
        "config key 'calibration.revision': org/calib floats (no pin) and has no lock entry" in p for p in problems
    )
    assert any(f"config key 'image.base': {TAG} floats" in p and "tools/lock.py add" in p for p in problems)
    assert lock.entry_inputs(config, "gate", tmp_path) == []

    lock_tool.add(lock.config_names(config), lock_dir)
    assert lock.problems(config, tmp_path) == []
    assert lock.entry_inputs(config, "gate", tmp_path) == [f"{lock.LOCK_DIR}/datasets/org/gate.yaml"]
    assert not lock.entry_path("datasets", "org/pinned", lock_dir).exists()

    lock.write_entry(lock.entry_path("datasets", "org/calib", lock_dir), "datasets", "org/calib", COMMIT)
    lock.write_entry(lock.entry_path("images", TAG, lock_dir), "images", TAG, DIGEST)
    pinned = hub_config(calibration_pin=MOVED_COMMIT, base=f"vllm/vllm-openai:v0.26.0@{MOVED}")
    problems = lock.problems(pinned, tmp_path)
    assert f"config key 'calibration.revision' pins {MOVED_COMMIT}, but the lock entry" in problems[0]
    assert f"datasets/org/calib.yaml holds {COMMIT}" in problems[0]
    assert f"config key 'image.base' pins {MOVED}, but the lock entry" in problems[1] and DIGEST in problems[1]
    assert lock.problems(hub_config(calibration_pin=COMMIT, base=f"{TAG}@{DIGEST}"), tmp_path) == []


def test_the_real_profile_names_its_base_by_tag_and_its_lock_has_an_entry_for_every_floating_name():
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    assert lock.parse_image(config["image"]["base"])[2] is None  # a tag: the digest is the lock's
    pipeline = pipeline_config.load(config)  # lock.problems among the checks
    names = lock.config_names(pipeline.config)
    assert {name.use for name in names} == {"calibration", "gate", "base"}
    for name in names:
        path = ROOT / lock.entry_path(name.kind, name.name)
        assert path.is_file() or name.pinned, name
    tiny = pipeline_config.load(yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text()))
    assert lock.config_names(tiny.config) == []  # local datasets and a locally built base: nothing floats


def test_a_bare_base_name_is_refused_unless_the_base_may_float():
    config = yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())
    config["image"]["base"] = "vllm/vllm-openai"
    with pytest.raises(pipeline_config.ConfigError, match="config key 'image.base': 'vllm/vllm-openai' names no tag"):
        pipeline_config.load(config)
    config["image"]["allow_unpinned_base"] = True
    assert lock.config_names(pipeline_config.load(config).config) == []


# --- the base image: pull_base with a fake docker -------------------------------------------------------------------

FAKE_DOCKER = (
    FAKE_DOCKER_HEAD
    + """
if args[0] == "info":
    print("20.10.24")
elif args[0] == "pull":
    ref = args[-1]
    name, _, digest = ref.partition("@")
    digest = digest or state["registry"].get(name)
    if not digest:
        sys.exit("Error response from daemon: manifest unknown")
    state["store"][digest] = "sha256:" + digest[-64:][::-1]
    json.dump(state, open(state_path, "w"))
    print(f"{{name.rsplit(':', 1)[-1]}}: Pulling from somewhere\\nDigest: {{digest}}\\nStatus: Downloaded\\n{{ref}}")
elif args[:2] == ["image", "inspect"]:
    found = re.search(r"@(sha256:[0-9a-f]{{64}})$", args[-1])
    if not found or found.group(1) not in state["store"]:
        sys.exit(f"Error: No such image: {{args[-1]}}")
    print(state["store"][found.group(1)])
else:
    sys.exit(f"fake docker: unexpected {{args}}")
"""
)


@pytest.fixture
def fake_docker(tmp_path, monkeypatch):
    """A `docker` on PATH whose registry answers `registry[tag]`; returns the state (re-read with .read())."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(FAKE_DOCKER.format(python=sys.executable))
    (bin_dir / "docker").chmod(stat.S_IRWXU)
    state_path = tmp_path / "docker-state.json"
    state_path.write_text(json.dumps({"registry": {TAG: DIGEST}, "store": {}, "calls": []}))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_DOCKER_STATE", str(state_path))

    class State:
        def read(self):
            return json.loads(state_path.read_text())

        def move_tag(self, digest):
            state = self.read()
            state["registry"][TAG] = digest
            state_path.write_text(json.dumps(state))

    return State()


def pull_job(tmp_path, base=TAG, entries=True, name="out"):
    lock_dir = tmp_path / "lock"
    path = lock.entry_path("images", TAG, lock_dir)
    if entries and not path.exists():
        lock.write_entry(path, "images", TAG, None)
    out = tmp_path / name / "image.json"
    return NS(input=NS(lock=[str(path)] if entries else []), params=NS(base=base), output=NS(image=str(out))), path


def test_the_first_pull_records_the_digest_and_later_pulls_must_match_it(tmp_path, fake_docker):
    job, entry = pull_job(tmp_path)
    pull_base.main(job)
    record = json.loads(Path(job.output.image).read_text())
    assert record["ref"] == f"{TAG}@{DIGEST}" and record["digest"] == DIGEST and record["builder"] == "docker"
    assert record["id"] == "sha256:" + DIGEST[-64:][::-1]
    assert lock.read_entry(entry).value == DIGEST
    assert ["pull", TAG] in fake_docker.read()["calls"]  # the tag, as the config names it: the registry's answer

    written = entry.stat().st_mtime_ns
    job, _ = pull_job(tmp_path, name="again")
    pull_base.main(job)  # the same lock: passes, the entry untouched
    assert json.loads(Path(job.output.image).read_text())["ref"] == f"{TAG}@{DIGEST}"
    assert entry.stat().st_mtime_ns == written

    fake_docker.move_tag(MOVED)  # the tag moved upstream, the lock did not
    job, _ = pull_job(tmp_path, name="moved")
    with pytest.raises(lock.LockError) as caught:
        pull_base.main(job)
    message = str(caught.value)
    assert f"docker pull {TAG} answers {MOVED} now, but the lock entry {entry} holds {DIGEST}" in message
    assert f"config key 'image.base': {TAG}@{DIGEST}" in message and f"tools/lock.py refresh {TAG}" in message
    assert lock.read_entry(entry).value == DIGEST and not Path(job.output.image).exists()

    # a pin in the config wins: the locked digest, pulled by it
    job, _ = pull_job(tmp_path, base=f"{TAG}@{DIGEST}", name="pinned")
    pull_base.main(job)
    assert fake_docker.read()["calls"][-2] == ["pull", f"{TAG}@{DIGEST}"]


def test_a_pin_that_differs_from_the_lock_fails_naming_both_and_the_key(tmp_path, fake_docker):
    job, entry = pull_job(tmp_path)
    lock.write_entry(entry, "images", TAG, DIGEST)
    job.params.base = f"{TAG}@{MOVED}"
    with pytest.raises(lock.LockError) as caught:
        pull_base.main(job)
    assert f"config key 'image.base' pins {MOVED}, but the lock entry {entry} holds {DIGEST}" in str(caught.value)
    assert lock.read_entry(entry).value == DIGEST


def test_an_unlocked_base_is_pulled_and_recorded_without_an_entry(tmp_path, fake_docker):
    job, _ = pull_job(tmp_path, entries=False)
    pull_base.main(job)
    assert json.loads(Path(job.output.image).read_text())["lock"] is None
    assert not (tmp_path / "lock").exists()


def test_a_failed_pull_leaves_the_lock_and_the_record_unwritten(tmp_path, fake_docker):
    job, entry = pull_job(tmp_path)
    fake_docker.move_tag(None)  # the registry no longer knows the tag
    with pytest.raises(StageError, match=f"docker pull {TAG} failed"):
        pull_base.main(job)
    assert lock.read_entry(entry).value is None and not Path(job.output.image).exists()


def test_refresh_moves_the_base_on_purpose_and_leaves_an_unchanged_entry_alone(tmp_path, fake_docker):
    job, entry = pull_job(tmp_path)
    lock.write_entry(entry, "images", TAG, DIGEST)
    config = tmp_path / "profile.yaml"
    profile = yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())
    profile["image"]["base"] = TAG
    config.write_text(yaml.safe_dump(profile))
    lock_dir = str(tmp_path / "lock")
    written = entry.stat().st_mtime_ns
    assert lock_tool.main(["refresh", TAG, "--configfile", str(config), "--lock-dir", lock_dir]) == 0
    assert entry.stat().st_mtime_ns == written  # unchanged: not rewritten, so nothing reruns

    fake_docker.move_tag(MOVED)
    args = ["--configfile", str(config), "--lock-dir", lock_dir]
    assert lock_tool.main(["refresh", "vllm/vllm-openai:v0.26.0", *args]) == 0  # named as Docker reads it
    assert lock.read_entry(entry).value == MOVED
    pull_base.main(job)  # now the pull matches the lock again
    assert json.loads(Path(job.output.image).read_text())["digest"] == MOVED


# --- the datasets: the refresh tool against the hub stand-in --------------------------------------------------------


def test_refresh_resolves_a_dataset_at_the_hub_and_a_pinned_one_at_its_pin(tmp_path, monkeypatch, capsys):
    config = tmp_path / "profile.yaml"
    profile = yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())
    profile["calibration"] = {"source": "hf_dataset", "dataset": "org/calib"}
    profile["quality"]["datasets"] = {"org/gate": COMMIT}
    config.write_text(yaml.safe_dump(profile))
    lock_dir = tmp_path / "lock"
    args = ["--configfile", str(config), "--lock-dir", str(lock_dir)]
    with StandinHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        hub.add("org/calib", COMMIT, {"README.md": b"x"}, repo_type="dataset")
        assert lock_tool.main(["add", *args]) == 0
        calib = lock.entry_path("datasets", "org/calib", lock_dir)
        assert lock.read_entry(calib).value is None
        assert not lock.entry_path("datasets", "org/gate", lock_dir).exists()  # pinned: no entry needed

        assert lock_tool.main(["refresh", *args]) == 0
        assert lock.read_entry(calib).value == COMMIT
        hub.add("org/calib", MOVED_COMMIT, {"README.md": b"y"}, repo_type="dataset")  # main moved
        assert lock_tool.main(["refresh", "org/calib", *args]) == 0
        assert lock.read_entry(calib).value == MOVED_COMMIT
        out = capsys.readouterr().out
        assert f"org/calib: {COMMIT} -> {MOVED_COMMIT} (the hub's main branch)" in out
        assert "org/gate: pinned by quality.datasets.org/gate, which needs no lock entry" in out

        assert lock_tool.main(["refresh", "org/unknown", *args]) == 1
        assert "the profile fetches no org/unknown" in capsys.readouterr().err
        hub.repos.clear()  # the hub no longer knows it: refused, the entry kept
        assert lock_tool.main(["refresh", "org/calib", *args]) == 1
        assert "cannot resolve the dataset org/calib@main" in capsys.readouterr().err
        assert lock.read_entry(calib).value == MOVED_COMMIT
