"""conftest's plan for a session: what the background build makes, and the order the e2e modules run in so that each
starts once the build has made what it needs."""

from types import SimpleNamespace

import pytest

import conftest


class Item(SimpleNamespace):
    def get_closest_marker(self, name):
        return object() if name == "e2e" and self.e2e else None


def item(fixtures=(), e2e=True, **module):
    return Item(fixturenames=list(fixtures), e2e=e2e, module=SimpleNamespace(**module))


VARIANT = conftest._tiny_config()["variant"]
IMAGE = f"results/{VARIANT}/build_image/image.json"


def test_a_quick_session_builds_nothing_in_the_background():
    quick = item(["tiny_quantized"], e2e=False, NEEDS=["tiny_quantized"])  # a quick test of a module with NEEDS
    assert conftest.background_targets([quick, item(["tmp_path"]), item(["docker_daemon"])]) == []


def test_the_venvs_alone_when_no_test_needs_the_dag():
    assert conftest.background_targets([item(["tiny_checkpoint"])]) == [conftest.VENV_TARGETS]


def test_a_dag_test_adds_the_default_variant_up_to_its_image_and_modules_add_their_own():
    slurm = item(["slurm_cluster", "tiny_checkpoint"], BACKGROUND_TARGETS=["a/b.json", IMAGE])
    targets = conftest.background_targets([item(["tiny_run"]), slurm])
    assert targets == [[*conftest.VENV_TARGETS, IMAGE, "a/b.json"]]  # each once


def test_what_modules_that_need_the_whole_dag_list_is_built_after_the_rest():
    sweep = item(["tiny_sweep"], BACKGROUND_TARGETS=["results/k1/build_image/image.json", "a/b.json"])
    slurm = item(["slurm_cluster"], BACKGROUND_TARGETS=["a/b.json"])
    targets = conftest.background_targets([sweep, slurm])
    assert targets == [[*conftest.VENV_TARGETS, IMAGE, "a/b.json"], ["results/k1/build_image/image.json"]]


@pytest.mark.parametrize(
    "fixtures, needs, rank",
    [
        ((), (), 0),
        (("tiny_venvs",), (), 0),
        (("tiny_venvs", "tiny_checkpoint"), (), 1),
        (("slurm_cluster", "tiny_checkpoint"), (), 2),
        (("host_server",), ("tiny_quantized",), 3),  # through request.getfixturevalue: the module's NEEDS
        (("tiny_base_image", "tiny_checkpoint"), (), 4),
        (("tiny_venvs", "docker_daemon"), (), 4),
        (("tiny_run", "tiny_base_image"), (), 5),
    ],
)
def test_a_module_ranks_by_the_last_thing_it_needs(fixtures, needs, rank):
    assert conftest.module_rank(item(fixtures, NEEDS=needs)) == rank


def test_a_module_can_run_after_what_it_does_not_need():
    assert conftest.module_rank(item(["tiny_checkpoint"], RUNS_AFTER=["tiny_quantized"])) == 3
    assert conftest.module_rank(item(["tiny_run"], RUNS_AFTER=["tiny_quantized"])) == 5  # never earlier


class Background:
    """A background build that is running for `polls` polls, then ends with `code`."""

    def __init__(self, polls: int, code: int = 0):
        self.polls, self.returncode, self.code = polls, None, code

    def poll(self):
        if self.polls <= 0:
            self.returncode = self.code
        self.polls -= 1
        return self.returncode

    def wait(self):
        self.polls = 0
        return self.poll()


@pytest.fixture
def runs(monkeypatch, tmp_path):
    """build()'s own snakemake runs and its dry runs, recorded; no sleeping."""
    calls = {"run": [], "dry": 0}
    monkeypatch.setattr(conftest, "snakemake", lambda *args, **kw: calls["run"].append(args))
    monkeypatch.setattr(conftest.time, "sleep", lambda s: None)
    log = tmp_path / "background.log"
    log.write_text("MissingInputException in rule quantize")

    def background(process, up_to_date_after: int | None = None):
        def up_to_date(targets, config):
            calls["dry"] += 1
            return up_to_date_after is not None and calls["dry"] > up_to_date_after

        monkeypatch.setattr(conftest, "_up_to_date", up_to_date)
        monkeypatch.setattr(conftest, "_background", {"process": process, "log": log, "targets": ["t"]})
        return calls

    return background


def test_a_target_the_background_made_returns_while_it_runs_without_a_run_of_its_own(runs):
    calls = runs(Background(polls=10), up_to_date_after=2)
    conftest.build("weights/m/manifest.json")
    assert calls["run"] == [] and calls["dry"] == 3


def test_a_target_it_does_not_make_is_built_once_it_has_ended(runs):
    calls = runs(Background(polls=3), up_to_date_after=None)
    conftest.build("results/quantize/other/manifest.json")
    assert calls["run"] == [("--cores", "2", "results/quantize/other/manifest.json", *conftest.TINY)]


def test_the_default_target_waits_for_it_without_dry_runs(runs):
    calls = runs(Background(polls=50), up_to_date_after=0)
    conftest.build()
    assert calls["dry"] == 0 and calls["run"] == [("--cores", "2", *conftest.TINY)]


def test_its_failure_fails_the_fixture_with_its_log(runs):
    runs(Background(polls=1, code=1), up_to_date_after=None)
    with pytest.raises(AssertionError, match="background build of t failed \\(1\\):\n.*MissingInputException"):
        conftest.build("results/quantize/other/manifest.json")


def test_it_looks_for_missing_targets_every_second_and_dry_runs_only_every_poll(runs, monkeypatch, tmp_path):
    """While a target is missing a look costs a stat: the next is a second away. Once all exist, a second dry run
    soon (the first may find the job that wrote them still ending), then POLL_S apart (each costs seconds of CPU
    beside the build)."""
    monkeypatch.setattr(conftest, "ROOT", tmp_path)
    target = tmp_path / "weights" / "m" / "manifest.json"
    calls = runs(Background(polls=10), up_to_date_after=None)
    slept = []

    def sleep(seconds):
        slept.append(seconds)
        if len(slept) == 3:  # the background build writes the target during the third sleep
            target.parent.mkdir(parents=True)
            target.write_text("{}")

    monkeypatch.setattr(conftest.time, "sleep", sleep)
    conftest.build("weights/m/manifest.json")
    assert slept[:3] == [conftest.EXISTS_POLL_S] * 3  # looks while the target is missing
    assert slept[3] == conftest.APPEARED_RETRY_S and set(slept[4:]) == {conftest.POLL_S}  # dry runs once it exists
    assert calls["dry"] == len(slept) == 10  # one look a poll of the build, then a run of its own once it has ended
    assert calls["run"] == [("--cores", "2", "weights/m/manifest.json", *conftest.TINY)]
