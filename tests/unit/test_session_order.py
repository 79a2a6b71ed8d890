"""The scheduler's plan for a session (tests/scheduler.py): what the background build makes, and the order the e2e
modules run in so that each starts once the build has made what it needs."""

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

import scheduler


class Item(SimpleNamespace):
    def get_closest_marker(self, name):
        return object() if name == "e2e" and self.e2e else None


def item(fixtures=(), e2e=True, **module):
    return Item(fixturenames=list(fixtures), e2e=e2e, module=SimpleNamespace(**module))


VARIANT = scheduler._tiny_config()["variant"]
IMAGE = f"results/{VARIANT}/build_image/image.json"
CHECKPOINT = f"weights/{scheduler._tiny_config()['model']['name']}/manifest.json"


def test_a_quick_session_builds_nothing_in_the_background():
    quick = item(["tiny_quantized"], e2e=False, NEEDS=["tiny_quantized"])  # a quick test of a module with NEEDS
    assert scheduler.background_targets([quick, item(["tmp_path"]), item(["docker_daemon"])]) == []


def test_the_venvs_alone_when_no_test_needs_the_dag():
    assert scheduler.background_targets([item(["tiny_checkpoint"])]) == [scheduler.VENV_TARGETS]


def test_a_dag_test_adds_the_base_beside_the_niced_checkpoint_then_the_image_the_probe_and_the_rest():
    slurm = item(["slurm_cluster", "tiny_checkpoint"], BACKGROUND_TARGETS=["a/b.json", IMAGE, CHECKPOINT])
    targets = scheduler.background_targets([item(["tiny_run"]), slurm])
    # each once (modules add their own); the probe runs in the session, between the image and the rest of the DAG
    assert targets == [
        scheduler.VENV_TARGETS,
        scheduler.Niced([CHECKPOINT]),
        [scheduler.BASE_IMAGE],
        [IMAGE, "a/b.json"],
        scheduler.PROBE,
        ["all"],
    ]


def test_what_modules_that_need_the_whole_dag_list_is_built_after_the_image_before_the_probe():
    sweep = item(["tiny_sweep"], BACKGROUND_TARGETS=["results/k1/build_image/image.json", "a/b.json"])
    slurm = item(["slurm_cluster"], BACKGROUND_TARGETS=["a/b.json"])
    targets = scheduler.background_targets([sweep, slurm])
    assert targets == [
        scheduler.VENV_TARGETS,
        scheduler.Niced([CHECKPOINT]),
        [scheduler.BASE_IMAGE],
        [IMAGE, "a/b.json"],
        ["results/k1/build_image/image.json"],
        scheduler.PROBE,
        ["all"],
    ]


def test_the_probe_runs_before_the_modules_that_compute_beside_the_rest_of_the_dag():
    """probe_the_image runs at the first module of PROBE_RANK: after the SLURM module, whose time-limit run outlives
    its tests, and before the quantized checkpoint's modules, which compute beside the rest of the DAG."""
    assert scheduler.READINESS[scheduler.PROBE_RANK - 1] == ("slurm_cluster",)
    assert scheduler.READINESS[scheduler.PROBE_RANK] == ("tiny_quantized",)


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
    assert scheduler.module_rank(item(fixtures, NEEDS=needs)) == rank


def test_a_module_can_run_after_what_it_does_not_need():
    assert scheduler.module_rank(item(["tiny_checkpoint"], RUNS_AFTER=["tiny_quantized"])) == 3
    assert scheduler.module_rank(item(["tiny_run"], RUNS_AFTER=["tiny_quantized"])) == 5  # never earlier


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
    monkeypatch.setattr(scheduler, "snakemake", lambda *args, **kw: calls["run"].append(args))
    monkeypatch.setattr(scheduler.time, "sleep", lambda s: None)
    log = tmp_path / "background.log"
    log.write_text("MissingInputException in rule quantize")

    def background(process, up_to_date_after: int | None = None):
        def up_to_date(targets, config):
            calls["dry"] += 1
            return up_to_date_after is not None and calls["dry"] > up_to_date_after

        monkeypatch.setattr(scheduler, "_up_to_date", up_to_date)
        monkeypatch.setattr(scheduler, "_background", {"process": process, "log": log, "targets": ["t"]})
        return calls

    return background


def test_a_target_the_background_made_returns_while_it_runs_without_a_run_of_its_own(runs):
    calls = runs(Background(polls=10), up_to_date_after=2)
    scheduler.build("weights/m/manifest.json")
    assert calls["run"] == [] and calls["dry"] == 3


def test_a_target_it_does_not_make_is_built_once_it_has_ended(runs):
    calls = runs(Background(polls=3), up_to_date_after=None)
    scheduler.build("results/quantize/other/manifest.json")
    assert calls["run"] == [("--cores", "2", "results/quantize/other/manifest.json", *scheduler.TINY)]


def test_the_default_target_waits_for_it_without_dry_runs(runs):
    calls = runs(Background(polls=50), up_to_date_after=0)
    scheduler.build()
    assert calls["dry"] == 0 and calls["run"] == [("--cores", "2", *scheduler.TINY)]


def test_its_failure_fails_the_fixture_with_its_log(runs):
    runs(Background(polls=1, code=1), up_to_date_after=None)
    with pytest.raises(AssertionError, match="background build of t failed \\(1\\):\n.*MissingInputException"):
        scheduler.build("results/quantize/other/manifest.json")


def test_it_looks_for_missing_targets_every_second_and_dry_runs_only_every_poll(runs, monkeypatch, tmp_path):
    """While a target is missing a look costs a stat: the next is a second away. Once all exist, a second dry run
    soon (the first may find the job that wrote them still ending), then POLL_S apart (each costs seconds of CPU
    beside the build)."""
    monkeypatch.setattr(scheduler, "ROOT", tmp_path)
    target = tmp_path / "weights" / "m" / "manifest.json"
    calls = runs(Background(polls=10), up_to_date_after=None)
    slept = []

    def sleep(seconds):
        slept.append(seconds)
        if len(slept) == 3:  # the background build writes the target during the third sleep
            target.parent.mkdir(parents=True)
            target.write_text("{}")

    monkeypatch.setattr(scheduler.time, "sleep", sleep)
    scheduler.build("weights/m/manifest.json")
    assert slept[:3] == [scheduler.EXISTS_POLL_S] * 3  # looks while the target is missing
    assert slept[3] == scheduler.APPEARED_RETRY_S and set(slept[4:]) == {scheduler.POLL_S}  # dry runs once it exists
    assert calls["dry"] == len(slept) == 10  # one look a poll of the build, then a run of its own once it has ended
    assert calls["run"] == [("--cores", "2", "weights/m/manifest.json", *scheduler.TINY)]


@pytest.fixture
def paused(monkeypatch, tmp_path):
    """A background build paused at PROBE: its image stage has ended (its marker exists), the rest waits for `go`;
    the session's own snakemake runs recorded."""
    calls = []
    monkeypatch.setattr(scheduler, "snakemake", lambda *args, **kw: calls.append(args))
    monkeypatch.setattr(scheduler.time, "sleep", lambda s: None)
    killed = []
    monkeypatch.setattr(scheduler.os, "killpg", lambda pid, sig: killed.append(pid))
    image_stage, rest = (IMAGE, "a/b.json"), ("all",)
    (tmp_path / "image.done").write_text("")
    log = tmp_path / "background.log"
    log.write_text("rule bake_compile_cache failed")
    background = {
        "process": SimpleNamespace(pid=4321, returncode=None, poll=lambda: None),
        "log": log,
        "targets": [*image_stage, *rest],
        "done": {image_stage: tmp_path / "image.done", rest: tmp_path / "rest.done"},
        "probe": f"results/{VARIANT}/latency_probe/latency.json",
        "go": tmp_path / "go",
    }
    monkeypatch.setattr(scheduler, "_background", background)
    monkeypatch.setattr(scheduler, "_previous_module", [None])
    return SimpleNamespace(calls=calls, killed=killed, background=background, tmp_path=tmp_path)


def test_the_probe_runs_once_at_the_first_module_of_its_rank_then_lets_the_build_go_on(paused):
    scheduler.pytest_runtest_setup(item(["slurm_cluster"]))  # before PROBE_RANK: the build stays paused
    assert paused.calls == [] and not paused.background["go"].exists()
    scheduler.pytest_runtest_setup(item(["tiny_quantized"]))
    assert paused.calls == [("--cores", "2", f"results/{VARIANT}/latency_probe/latency.json", *scheduler.TINY)]
    assert paused.background["go"].exists() and paused.killed == []
    scheduler.pytest_runtest_setup(item(["tiny_run"]))
    scheduler.probe_the_image()
    assert len(paused.calls) == 1  # once


def test_the_probe_waits_between_the_tests_of_a_module_until_it_says_its_fixtures_leave_nothing_running(paused):
    (paused.tmp_path / "image.done").unlink()  # the build is still making the image
    serving = item(["tiny_quantized"])
    scheduler.pytest_runtest_setup(serving)  # a module's first test, but no image yet
    (paused.tmp_path / "image.done").write_text("")
    scheduler.pytest_runtest_setup(Item(fixturenames=["tiny_quantized"], e2e=True, module=serving.module))
    assert paused.calls == []  # between two tests of a module whose server may be running
    quantize = item(["tiny_quantized"], PROBE_BETWEEN_TESTS=True)
    scheduler.pytest_runtest_setup(quantize)
    assert len(paused.calls) == 1 and paused.background["go"].exists()


def test_the_first_module_that_needs_the_whole_dag_waits_for_the_image_and_probes(paused, monkeypatch):
    (paused.tmp_path / "image.done").unlink()
    module = SimpleNamespace()
    scheduler.pytest_runtest_setup(Item(fixturenames=["tiny_quantized"], e2e=True, module=module))
    looks = []

    def poll():  # the image stage ends after two more looks
        looks.append(1)
        if len(looks) == 2:
            (paused.tmp_path / "image.done").write_text("")

    paused.background["process"] = SimpleNamespace(pid=4321, returncode=None, poll=poll)
    scheduler.pytest_runtest_setup(Item(fixturenames=["tiny_run"], e2e=True, module=module))
    assert len(paused.calls) == 1 and len(looks) == 2


def test_the_probe_waits_for_the_image_and_fails_with_the_builds_log_when_it_failed(paused):
    (paused.tmp_path / "image.done").unlink()
    paused.background["process"] = SimpleNamespace(pid=4321, returncode=1, poll=lambda: 1)
    with pytest.raises(AssertionError, match="background build of .* failed \\(1\\):\n.*bake_compile_cache failed"):
        scheduler.probe_the_image()
    assert paused.calls == [] and not paused.background["go"].exists()


def test_a_failed_probe_stops_the_build(paused, monkeypatch):
    def fail(*args, **kw):
        raise AssertionError("probe failed")

    monkeypatch.setattr(scheduler, "snakemake", fail)
    with pytest.raises(AssertionError, match="probe failed"):
        scheduler.probe_the_image()
    assert paused.killed == [4321] and not paused.background["go"].exists()


def test_a_stage_is_waited_for_until_its_marker_appears(paused):
    polls = iter([None, None, None])
    marker = paused.tmp_path / "rest.done"

    def poll():
        if next(polls, "done") == "done":
            marker.write_text("")  # the stage ends after three looks
        return None

    paused.background["process"] = SimpleNamespace(pid=4321, returncode=None, poll=poll)
    assert scheduler.wait_for_stage("all") and marker.exists()
    assert not scheduler.wait_for_stage("results/other/build_image/image.json")  # no stage makes it: nothing to wait


@pytest.fixture
def sweep(monkeypatch, tmp_path):
    """A session that plans the sweep, its image already probed; the background build `running` or ended; the
    session's snakemake runs and the processes it starts recorded."""
    calls, started = [], []
    monkeypatch.setattr(scheduler, "snakemake", lambda *args, **kw: calls.append(args))
    monkeypatch.setattr(scheduler.subprocess, "Popen", lambda args, **kw: started.append(args) or "sweep process")
    monkeypatch.setattr(scheduler.tempfile, "mkdtemp", lambda prefix: str(tmp_path))  # the sweep's log
    monkeypatch.setattr(scheduler, "_sweep", {"planned": True})
    monkeypatch.setattr(scheduler, "_tiny_run_done", [True])
    monkeypatch.setattr(scheduler, "_previous_module", [None])
    state = SimpleNamespace(calls=calls, started=started, running=True)
    process = SimpleNamespace(poll=lambda: None if state.running else 0, wait=lambda: 0, returncode=0)
    monkeypatch.setattr(scheduler, "_background", {"process": process})
    return state


def module_item(name, fixtures=("tiny_run",), **attrs):
    return item(fixtures, __file__=f"/x/tests/{name}", **attrs)


def test_the_sweep_probes_alone_at_a_module_beside_it_once_the_build_has_ended_then_runs_in_the_background(sweep):
    scheduler.pytest_runtest_setup(module_item("test_verify_image.py"))  # reads image.tar.gz: never beside the sweep
    scheduler.pytest_runtest_setup(module_item(scheduler.BESIDE_THE_SWEEP[0]))  # the build still runs
    assert sweep.calls == [] and sweep.started == []
    sweep.running = False
    lossless = module_item(scheduler.BESIDE_THE_SWEEP[-1], PROBE_BETWEEN_TESTS=True)
    scheduler.pytest_runtest_setup(lossless)
    probes = [f"results/{name}/latency_probe/latency.json" for name in ("tiny-awq-dflash3", "tiny-awq-ngram4")]
    assert sweep.calls == [("--cores", "2", *probes, *scheduler.TINY_SWEEP)]
    assert len(sweep.started) == 1 and sweep.started[0][2:] == ["snakemake", "--cores", "2", *scheduler.TINY_SWEEP]
    scheduler.pytest_runtest_setup(module_item(scheduler.LAST[0], ("tiny_sweep",)))
    assert len(sweep.calls) == 1 and len(sweep.started) == 1  # once


def test_the_sweep_starts_before_the_last_modules_in_any_case(sweep, monkeypatch):
    monkeypatch.setattr(scheduler, "wait_for_background", lambda: setattr(sweep, "running", False))
    beside = module_item(scheduler.BESIDE_THE_SWEEP[0])
    scheduler.pytest_runtest_setup(beside)
    scheduler.pytest_runtest_setup(Item(fixturenames=["tiny_run"], e2e=True, module=beside.module))
    assert sweep.calls == []  # between the tests of a module that may hold a server: not there
    scheduler.pytest_runtest_setup(module_item(scheduler.LAST[0], ("tiny_sweep",)))
    assert not sweep.running and len(sweep.calls) == 1 and len(sweep.started) == 1


def test_the_default_run_is_complete_before_the_sweep_starts(sweep, monkeypatch):
    """The sweep puts the default target's tarball out of date: a session that reaches the sweep before any test
    needed tiny_run completes that run first."""
    monkeypatch.setattr(scheduler, "_tiny_run_done", [])
    sweep.running = False
    scheduler.pytest_runtest_setup(module_item(scheduler.LAST[0], ("tiny_sweep",)))
    assert sweep.calls[0] == ("--cores", "2", *scheduler.TINY) and sweep.calls[1][-3:] == tuple(scheduler.TINY_SWEEP)
    scheduler.complete_the_tiny_run()
    assert len(sweep.calls) == 2  # the tiny_run fixture has nothing left to do


def _stand_in(log):
    """A stage's run that logs its start (with its nice value) and end; stage "x" fails, "slow" outlasts the others."""

    def command(targets):
        name = targets[0]
        pause = {"slow": 1.5}.get(name, 0.3)
        end = "exit 3" if name == "x" else f"echo end {name} >> {log}"
        return ["sh", "-c", f"echo start {name} $(nice) >> {log}; sleep {pause}; {end}"]

    return command


def _run_script(tmp_path, stages):
    log = tmp_path / "runs.log"
    script, done = scheduler.background_script(stages, tmp_path, tmp_path / "go", _stand_in(log))
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    return result, log.read_text().splitlines() if log.exists() else [], done


def test_a_niced_stage_runs_at_nice_19_beside_the_next_and_its_marker_waits_for_both(tmp_path):
    result, lines, done = _run_script(tmp_path, [["a"], scheduler.Niced(["slow"]), ["b"], ["c"]])
    assert result.returncode == 0, result.stderr
    base = int(subprocess.run(["nice"], capture_output=True, text=True).stdout)
    assert lines[0] == f"start a {base}" and lines[1] == "end a"
    # b does not wait for slow (at nice 19 on a busy host, slow may even start after b has ended), c waits for both
    beside = lines[2:6]
    assert sorted(beside) == sorted([f"start b {base}", "end b", f"start slow {min(base + 19, 19)}", "end slow"])
    assert beside.index(f"start b {base}") < beside.index("end slow")
    assert lines[6:] == [f"start c {base}", "end c"]
    assert all(marker.exists() for marker in done.values())


def test_a_failed_niced_stage_fails_the_build_after_the_stage_beside_it(tmp_path):
    result, lines, done = _run_script(tmp_path, [scheduler.Niced(["x"]), ["b"], ["c"]])
    assert result.returncode == 3 and "end b" in lines and not any("c" in line for line in lines)
    assert done[("b",)].exists() and not done[("x",)].exists()


def test_a_failed_stage_stops_the_niced_run_beside_it(tmp_path):
    result, lines, done = _run_script(tmp_path, [scheduler.Niced(["slow"]), ["x"], ["c"]])
    assert result.returncode == 3 and lines[-1].startswith("start") and "end slow" not in lines
    time.sleep(2)  # past the stand-in's own end: it was stopped, so it never logs it
    assert "end slow" not in (tmp_path / "runs.log").read_text()
    assert not any(marker.exists() for marker in done.values())


# A stand-in plugin for a session run as a user runs it: every Snakemake run and process the scheduler would start is
# recorded instead (in STARTED), and what the session planned written at its end (in PLANNED).
STAND_IN = """
import json, os, subprocess
import scheduler, suite_timing

suite_timing.ROOT = suite_timing.Path(os.environ["PLANNED"]).parent  # the session's timing record: not the suite's
suite_timing.OUT = suite_timing.ROOT / "timing.json"


def record(kind):
    def started(*args, **kw):
        with open(os.environ["STARTED"], "a") as out:
            out.write(json.dumps([kind, [str(a) for a in (args[0] if kind == "Popen" else args)]]) + "\\n")
        raise AssertionError(f"the session started {kind} {args}")

    return started


class Processes:  # the scheduler's subprocess module, but for Popen (other plugins' own processes stay theirs)
    Popen = staticmethod(record("Popen"))

    def __getattr__(self, name):
        return getattr(subprocess, name)


scheduler.snakemake = record("snakemake")
scheduler.subprocess = Processes()


def pytest_sessionfinish(session):
    planned = {"sweep": scheduler._sweep, "background": sorted(scheduler._background)}
    json.dump(planned, open(os.environ["PLANNED"], "w"))
"""
# A module beside the sweep with a quick test and an e2e one, and the sweep's module (scheduler.LAST).
SESSION = {
    scheduler.BESIDE_THE_SWEEP[0]: "import pytest\n\ndef test_quick():\n    pass\n\n\n"
    "@pytest.mark.e2e\ndef test_slow(tiny_run):\n    pass\n",
    scheduler.LAST[0]: "import pytest\n\n\n@pytest.mark.e2e\ndef test_sweep(tiny_sweep):\n    pass\n",
}


def run_session(tmp_path, *args):
    """pytest run on SESSION's modules with tests/conftest.py as a plugin (`conftest`, which loads the scheduler) and
    the stand-in."""
    for name, text in {**SESSION, "stand_in.py": STAND_IN, "pytest.ini": "[pytest]\nmarkers = e2e\n"}.items():
        (tmp_path / name).write_text(text)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(scheduler.ROOT / "tests")]),
        "STARTED": str(tmp_path / "started.jsonl"),
        "PLANNED": str(tmp_path / "planned.json"),
    }
    command = [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "stand_in", "-q", *args]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    started = tmp_path / "started.jsonl"
    return (
        result,
        started.read_text().splitlines() if started.exists() else [],
        json.loads((tmp_path / "planned.json").read_text()),
    )


def test_the_quick_tier_plans_and_starts_no_build(tmp_path):
    """`pytest -m "not e2e"` (the README's quick command) over a module beside the sweep and the sweep's own: the e2e
    tests deselected, nothing is built (it used to plan the sweep from the items before -m deselected them, and start
    the whole tiny DAG at the quick test beside the sweep)."""
    result, started, planned = run_session(tmp_path, "-m", "not e2e")
    assert started == [] and result.returncode == 0, result.stdout + result.stderr
    assert "1 passed, 2 deselected" in result.stdout
    assert not planned["sweep"].get("planned") and planned["background"] == []


def test_a_session_with_the_e2e_tests_plans_the_sweep(tmp_path):
    result, started, planned = run_session(tmp_path, "--collect-only")  # collected only: planned, never started
    assert result.returncode == 0 and started == [], result.stdout + result.stderr
    assert planned["sweep"]["planned"] is True


def test_the_sweep_never_starts_at_a_quick_test_even_once_the_build_has_ended(sweep):
    """The quick tests run first, beside the background build: one that ended early (it failed, or had nothing to
    do) must not start the sweep beside them; the first e2e module beside the sweep does."""
    sweep.running = False
    scheduler.pytest_runtest_setup(module_item(scheduler.BESIDE_THE_SWEEP[0], (), e2e=False))
    assert sweep.calls == [] and sweep.started == []
    scheduler.pytest_runtest_setup(module_item(scheduler.BESIDE_THE_SWEEP[1]))
    assert len(sweep.calls) == 1 and len(sweep.started) == 1
