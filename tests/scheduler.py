"""The session's scheduler, a pytest plugin (tests/conftest.py loads it): the background build of the tiny DAG and the
order the tests run in beside it.

When a session includes e2e tests, it starts the tiny DAG in the background at once (venvs and base image, then the
checkpoint, trained alone, then quantized model, bake and image, then the sweep's other images), runs the quick tests
beside it, then each e2e module as soon as the build has made what it needs (a dry run of its targets has nothing
left to do). Once those images are built, the session probes the default image with nothing else running; the build
then makes the rest of the tiny DAG beside the modules that follow. Modules that need the whole DAG run last; the
sweep probes its candidates with nothing beside it, then ranks and checks them beside the last of those modules.

A quick session (`-m "not e2e"`) builds nothing. The fixtures that wait for what the build makes are conftest's; they
call build(), complete_the_tiny_run() and the_sweep() here."""

import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# --configfile takes several files: targets go before it.
TINY = ["--configfile", "config/tiny.yaml"]
TINY_SWEEP = [*TINY, "config/tiny-sweep.yaml"]


def _tiny_config() -> dict:
    import yaml

    return yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())


# Modules run after every other: the sweep replaces image.tar.gz with the selected variant's.
LAST = ("test_sweep.py",)
# Modules that need the whole DAG but read only the default variant's own records and image (never image.tar.gz, nor
# a run of the default target): they run after the other modules that need it, and the sweep runs beside them once it
# has probed its candidates (start_the_sweep).
BESIDE_THE_SWEEP = ("test_gate_teeth.py", "test_load_probe.py", "test_lossless.py")


# Fixtures that build venvs, images or pipeline outputs, or need a Docker daemon: only e2e tests may use them, so
# `pytest -m "not e2e"` stays quick and needs none of it.
HEAVY_FIXTURES = {
    "tiny_venvs",
    "tiny_run",
    "tiny_sweep",
    "tiny_checkpoint",
    "tiny_quantized",
    "tiny_base_image",
    "docker_daemon",
}


# Where a test module sits says its tests' kind: tests/unit/ holds the quick ones, tests/e2e/ those marked e2e.
KIND_FOLDERS = {ROOT / "tests" / "unit": False, ROOT / "tests" / "e2e": True}


def pytest_collection_modifyitems(session, config, items):
    misplaced = [
        item.nodeid
        for item in items
        for folder, e2e in KIND_FOLDERS.items()
        if folder in item.path.parents and is_e2e(item) != e2e
    ]
    if misplaced:
        raise pytest.UsageError(
            "tests/unit/ holds quick tests, tests/e2e/ the ones marked e2e; these sit in the other folder:\n  "
            + "\n  ".join(misplaced)
        )
    light = [
        item.nodeid
        for item in items
        if item.get_closest_marker("e2e") is None and HEAVY_FIXTURES & set(getattr(item, "fixturenames", ()))
    ]
    if light:
        raise pytest.UsageError(
            "tests that use a venv, Docker or a pipeline run must be marked e2e:\n  " + "\n  ".join(light)
        )
    early = [
        item.nodeid
        for item in items
        if item.path.name not in LAST and "tiny_sweep" in getattr(item, "fixturenames", ())
    ]
    if early:
        raise pytest.UsageError(
            "the sweep replaces image.tar.gz: only modules in scheduler.LAST may use tiny_sweep:"
            "\n  " + "\n  ".join(early)
        )
    # The quick tests first, while the background build starts (pytest_collection_finish); then the e2e modules in
    # the order the background build makes what they need (module_rank), BESIDE_THE_SWEEP's and LAST's at the end.
    # Stable: each group keeps its order, and a module's e2e tests stay together (its module fixtures are made once);
    # within a group, modules by name, whether in tests/unit/ or tests/e2e/.
    ranks: dict[Path, int] = {}
    for item in filter(is_e2e, items):
        ranks[item.path] = max(ranks.get(item.path, 0), module_rank(item))
    items.sort(
        key=lambda item: (
            is_e2e(item),
            ranks[item.path] if is_e2e(item) else 0,
            2 if item.path.name in LAST else 1 if is_e2e(item) and item.path.name in BESIDE_THE_SWEEP else 0,
            item.path.name,
        )
    )


def is_e2e(item) -> bool:
    return item.get_closest_marker("e2e") is not None


# What an e2e test needs, in the order the session's background build has it ready: a module runs once the build has
# made what its tests need, while the build goes on. The base image is made beside the training (background_targets),
# which, niced, takes only what it and the modules that need the venvs only leave. The SLURM module
# comes before those that need the quantized checkpoint: it mostly waits on the scheduler, so it runs beside the
# build's quantize and bakes, and the modules that compute run after them. From the first module that needs the
# quantized checkpoint on, once the build has made the images, the session probes the default variant's image with
# nothing else running (probe_the_image), then the build makes the rest of the tiny DAG beside the modules that
# follow; those that need the whole DAG (tiny_run) come last.
READINESS = (
    ("tiny_venvs",),
    ("tiny_checkpoint",),
    ("slurm_cluster",),
    ("tiny_quantized",),
    ("tiny_base_image", "docker_daemon"),
    ("tiny_run", "tiny_sweep"),
)


def module_listed(item, name: str) -> tuple[str, ...]:
    """What the test's module lists under name (NEEDS, RUNS_AFTER, BACKGROUND_TARGETS); nothing if it has none."""
    return tuple(getattr(getattr(item, "module", None), name, ()))


def needed_fixtures(item) -> set[str]:
    """The fixtures a test uses, with its module's NEEDS: those it gets through request.getfixturevalue, which
    fixturenames does not list."""
    return set(getattr(item, "fixturenames", ())) | set(module_listed(item, "NEEDS"))


def module_rank(item) -> int:
    """The last READINESS entry the item needs, or that its module names in RUNS_AFTER: a module whose tests compute
    hard runs after the build's stages they would collide with (two torch processes on 2 cores)."""
    names = needed_fixtures(item) | set(module_listed(item, "RUNS_AFTER"))
    return max((rank for rank, needs in enumerate(READINESS) if names & set(needs)), default=0)


# torch's thread count in the torch processes a test starts itself (a stage script, a training). They run beside the
# background build's, which use both cores, and two processes of 2 OpenMP threads each on 2 cores keep waiting for
# each other's descheduled threads. Measured: an AWQ recipe run on the tiny checkpoint, 11 s alone, took 71 s beside
# another such run and 108 s beside the training, which took 3x its own time; at 1 thread it took 14-17 s and the
# training almost its own time. The count does not change quantize's bytes (same at 1 and 2).
TEST_TORCH_THREADS = 1
# ...and the background build's quantize, which took 188 s beside them at 2 threads, 35 s alone (train_tiny keeps its
# configured count: its bytes depend on it)
BESIDE_TESTS = ["--set-threads", f"quantize={TEST_TORCH_THREADS}"]
VENVS = ("compress", "serve-cpu", "eval")
VENV_TARGETS = [f".venvs/{name}/pip-freeze.txt" for name in VENVS]
# The session's background build: {"process": Popen, "log": Path, "targets": [...], "done": {stage: marker file},
# "probe": the default variant's probe target while the session has yet to run it, "go": the file that lets the build
# go on after the probe}.
_background: dict = {}
# How often a fixture asks Snakemake (a dry run, ~2.5 s of CPU) whether the background build has made its targets,
POLL_S = 15
# ...and, until they all exist, how often it looks for them (a stat; no dry run needed before): a fixture whose
# targets appeared mid-sleep waited up to POLL_S for nothing (CI: 5-12 s after the venvs and the checkpoint).
EXISTS_POLL_S = 1
# ...and the second dry run's delay: a job's outputs appear a moment before Snakemake has marked it done (a torch
# stage's exit), and the first dry run may still find it running
APPEARED_RETRY_S = 3
# The pause in the background build where the session probes the default variant's image (probe_the_image): the
# stages after it wait until the probe has run with nothing else running.
PROBE = "probe"
# The first module rank that runs after the probe: the modules before it (the SLURM one) start processes of their own
# that outlive a test, and those from it on compute beside the rest of the tiny DAG.
PROBE_RANK = 3


BASE_IMAGE = "results/base_image/image.json"  # the tiny profile's local base (rule base_image)


class Niced(tuple):
    """A background stage run niced (nice -n 19, its own Snakemake run: --nolock) beside the stage that follows it,
    and waited for once that one has ended: it takes only the CPU that stage and the quick tests leave, then the
    machine alone. The training's OpenMP threads wait for each other whenever another process takes a core (beside
    the quick tests at equal priority it took 485 s, alone 291 s); niced, the others never wait for it."""


def _model_manifest() -> str:
    return f"weights/{_tiny_config()['model']['name']}/manifest.json"


def _default_image() -> str:
    return f"results/{_tiny_config()['variant']}/build_image/image.json"


def _default_probe() -> str:
    return f"results/{_tiny_config()['variant']}/latency_probe/latency.json"


def background_targets(items) -> list:
    """What the session builds in the background from its start, in stages run one after the other (each a Snakemake
    run): first the stage venvs when a test needs them. When a test needs the tiny DAG: after them the trained
    checkpoint (Niced) beside the base image, then the default variant up to its image (quantized model, bake) with
    what the modules before the whole DAG list in BACKGROUND_TARGETS, then what the modules that need the whole DAG
    list (the sweep's images: their bakes beside the SLURM and quantize modules, which compute little or on one
    thread); then PROBE, where the build waits while the session probes the default image with nothing else running
    (probe_the_image); then the rest of the default target (`all`: gate, load probe, lossless check, tarball, verify),
    beside the modules that run before those that need it.

    The base image takes one core beside the quick tests and those that need the venvs only; the niced training takes
    what they leave, then trains alone while the session, with nothing left to run, waits for the checkpoint.
    """
    items = list(filter(is_e2e, items))
    needs = set().union(*(needed_fixtures(item) for item in items))
    if not needs & (HEAVY_FIXTURES - {"docker_daemon"}):
        return []
    whole_dag = len(READINESS) - 1
    dag = bool(needs & set(READINESS[-1]))
    first = [*VENV_TARGETS, BASE_IMAGE] if dag else list(VENV_TARGETS)
    checkpoint = [_model_manifest()] if dag else []
    second = [_default_image()] if dag else []
    second += [
        t for t in _listed(i for i in items if module_rank(i) < whole_dag) if t not in first + checkpoint + second
    ]
    # a target that an earlier module needs too is made in an earlier stage
    later = [
        t for t in _listed(i for i in items if module_rank(i) == whole_dag) if t not in first + checkpoint + second
    ]
    if dag:  # all venvs first: the eval venv made beside the base image delayed it by its own time
        stages = [list(VENV_TARGETS), Niced(checkpoint), [BASE_IMAGE], second]
    else:
        stages = [first, second] if second else [first]
    stages += [later] if later else []
    return stages + [PROBE, ["all"]] if dag else stages


def _listed(items) -> list[str]:
    """The BACKGROUND_TARGETS of the items' modules, each once, in order."""
    targets = (t for item in items for t in module_listed(item, "BACKGROUND_TARGETS"))
    return list(dict.fromkeys(targets))


def pytest_collection_finish(session):
    """Start the background build (background_targets) beside the quick tests, which run first, and the e2e modules
    that need less than it makes (pytest_collection_modifyitems): on 2 cores the serving and Docker stages leave
    about half the CPU idle. Fixtures wait for what they need (build, wait_for_stage)."""
    # From the items that run: pytest_collection_modifyitems sees them before `-m "not e2e"` deselects the e2e ones,
    # and a quick session planning the sweep started the whole tiny DAG (start_the_sweep).
    _sweep["planned"] = any("tiny_sweep" in getattr(item, "fixturenames", ()) for item in session.items)
    stages = [] if session.config.option.collectonly else background_targets(session.items)
    if not stages:
        return
    folder = Path(tempfile.mkdtemp(prefix="qwen35-serve-background-"))
    log_path, go = folder / "snakemake.log", folder / "probed"
    script, done = background_script(stages, folder, go, _stage_command)
    with open(log_path, "w") as log:
        _background.update(
            process=subprocess.Popen(
                ["bash", "-c", script],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # stopped as a group: the shell and the snakemake it runs
            ),
            log=log_path,
            targets=[target for targets in stages if targets != PROBE for target in targets],
            done=done,
            probe=_default_probe() if PROBE in stages else None,
            go=go,
        )


def _stage_command(targets) -> list[str]:
    """A background stage's Snakemake run: the stage that makes the base image makes it first, the one that makes the
    image its image first; a Niced stage's run leaves the directory's lock to the stage it runs beside."""
    first = [t for t in targets if t in (BASE_IMAGE, _default_image())][:1]
    prioritize = ["--prioritize", *first] if first else []
    nolock = ["--nolock"] if isinstance(targets, Niced) else []
    return [sys.executable, "-m", "snakemake", "--cores", "2", *targets, *prioritize, *nolock, *BESIDE_TESTS, *TINY]


def background_script(stages, folder: Path, go: Path, command) -> tuple[str, dict]:
    """The bash script that runs the stages (command(targets): a stage's run) and {stage: its done marker}: each
    marker is touched once its stage has ended, a Niced stage's once it and the stage beside it have. PROBE waits
    for `go`. A failed stage ends the script (-e), and the niced run beside it with it."""
    stop_niced = 'status=$?; [ -z "${niced:-}" ] || kill "$niced" 2>/dev/null || true; exit $status'
    runs, done, niced_marker = ["set -e", f"trap {shlex.quote(stop_niced)} EXIT"], {}, None
    for index, targets in enumerate(stages):
        if targets == PROBE:
            runs.append(f"until [ -e {shlex.quote(str(go))} ]; do sleep 1; done")
            continue
        done[tuple(targets)] = folder / f"stage-{index}.done"
        if isinstance(targets, Niced):  # $niced: its pid, until it has been waited for
            runs.append(f"nice -n 19 {shlex.join(command(targets))} & niced=$!")
            niced_marker = done[tuple(targets)]
            continue
        runs += [shlex.join(command(targets)), shlex.join(["touch", str(done[tuple(targets)])])]
        if niced_marker is not None:
            runs += ['wait "$niced"', "niced=", shlex.join(["touch", str(niced_marker)])]
            niced_marker = None
    return "\n".join(runs), done


_previous_module: list = [None]  # the module of the last test set up


def pytest_runtest_setup(item):
    """Probe the default variant's image (probe_the_image) between two tests, with nothing else running: from the
    first module of PROBE_RANK on, as soon as the build has made the images, at a module's first test (the previous
    module's processes have ended with its fixtures) or between the tests of a module that says its fixtures leave
    no process running (PROBE_BETWEEN_TESTS); before the first module that needs the whole DAG in any case."""
    module = getattr(item, "module", None)
    first_of_module, _previous_module[0] = module is not _previous_module[0], module
    may_probe = first_of_module or getattr(module, "PROBE_BETWEEN_TESTS", False)
    if _background.get("probe") and is_e2e(item) and module_rank(item) >= PROBE_RANK:
        if module_rank(item) == len(READINESS) - 1 or (may_probe and _ready_to_probe()):
            probe_the_image()
    # ...and, likewise, the sweep's other candidates once the build has ended: from the first module that may run
    # beside the sweep on, before LAST's in any case
    name = Path(getattr(module, "__file__", "")).name
    beside = name in BESIDE_THE_SWEEP and may_probe and _background_ended()
    # at an e2e test only: the quick tests run first, and a build that ended early must not start the sweep beside them
    if _sweep.get("planned") and is_e2e(item) and (name in LAST or beside):
        start_the_sweep()


def _background_ended() -> bool:
    process = _background.get("process")
    return process is None or process.poll() is not None


def _ready_to_probe() -> bool:
    """The stages before PROBE have ended."""
    return _background["done"][_before_probe()].exists()


def _before_probe() -> tuple[str, ...]:
    return list(_background["done"])[-2]  # PROBE's stage comes before the last, `all`


def _failed_background() -> AssertionError:
    process = _background["process"]
    log = _background["log"].read_text()
    return AssertionError(
        f"the background build of {' '.join(_background['targets'])} failed ({process.returncode}):\n{log[-10000:]}"
    )


def wait_for_stage(*targets: str) -> bool:
    """Wait until the background stage that makes exactly `targets` has ended; False when no stage makes them (or no
    background build runs). The background build's failure fails the caller, with its log."""
    marker = _background.get("done", {}).get(targets)
    process = _background.get("process")
    if marker is None or process is None:
        return False
    while not marker.exists() and process.poll() is None:
        time.sleep(EXISTS_POLL_S)
    if not marker.exists():
        raise _failed_background()
    return True


def wait_for_background() -> None:
    """Wait until the background build has ended: a test that writes a whole image into the container stores waits
    for the build's own image writes (two at once filled a CI disk: rules/build_image.smk's image_writes). Its
    failure fails the caller, with its log."""
    process = _background.get("process")
    if process is not None and process.wait() != 0:
        raise _failed_background()


def probe_the_image() -> None:
    """The default variant's latency probe, run here while nothing else runs: the background build has made the images
    and waits (PROBE) until this has run, then goes on with the rest of the DAG beside the tests. The probe's numbers
    rank the sweep's candidates (rank_candidates), whose own probes also run with nothing beside them (tiny_sweep).
    Once per session; a failed probe stops the background build."""
    target = _background.pop("probe", None)
    if target is None:
        return
    wait_for_stage(*_before_probe())
    try:
        snakemake("--cores", "2", target, *TINY)
    except BaseException:
        os.killpg(_background["process"].pid, signal.SIGTERM)
        raise
    _background["go"].touch()


# The tiny sweep, run in the background once its probes have run (start_the_sweep): {"planned": a test needs it,
# "started": time.time() at its probes' start, "process": Popen, "log": Path}.
_sweep: dict = {}


def _sweep_probes() -> list[str]:
    """The latency probes of the sweep's candidates other than the default variant (probed before: probe_the_image)."""
    import yaml

    candidates = yaml.safe_load((ROOT / TINY_SWEEP[-1]).read_text())["select"]["candidates"]
    return [f"results/{name}/latency_probe/latency.json" for name in candidates if name != _tiny_config()["variant"]]


def start_the_sweep() -> None:
    """Once the background build has ended (the default DAG and the sweep's images), probe the sweep's other
    candidates with nothing else running, then run the rest of the sweep (ranking, the walk's lossless checks and
    gates, the selected variant's tarball, verification and load probe: nothing it times) in the background, beside
    BESIDE_THE_SWEEP's modules; tiny_sweep waits for it. Once per session."""
    if "started" in _sweep:
        return
    complete_the_tiny_run()  # the sweep puts the default target's tarball out of date: its run is over first
    wait_for_background()
    _sweep["started"] = time.time()
    snakemake("--cores", "2", *_sweep_probes(), *TINY_SWEEP)
    _sweep["log"] = Path(tempfile.mkdtemp(prefix="qwen35-serve-sweep-")) / "snakemake.log"
    with open(_sweep["log"], "w") as log:
        _sweep["process"] = subprocess.Popen(
            [sys.executable, "-m", "snakemake", "--cores", "2", *TINY_SWEEP],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def pytest_sessionfinish(session):
    for running in (_background, _sweep):
        process = running.get("process")
        if process is not None and process.poll() is None:  # the session ended before it finished
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(120)


def _all_exist(targets: tuple[str, ...]) -> bool:
    return all((ROOT / target).exists() for target in targets)


def _up_to_date(targets: tuple[str, ...], config: list[str]) -> bool:
    if not _all_exist(targets):
        return False
    result = snakemake("-n", "--nolock", *targets, *config, check=False)
    return result.returncode == 0 and "Nothing to be done" in result.stdout


def build(*targets: str, config: list[str] | None = None) -> None:
    """Make targets in the project (none: the default target, the README's first command). While the background
    build runs, wait until a dry run of them has nothing to do (one building run per directory: Snakemake's lock);
    after it, or without one, a run of their own (a no-op for what it made). The background build's failure fails
    every fixture that needs the project's outputs, with its log."""
    config = TINY if config is None else config
    process = _background.get("process")
    if not targets and process is not None:
        process.wait()  # the default target is more than the background build makes
    dry_runs = 0  # since the targets all exist
    while process is not None and process.poll() is None:
        if _up_to_date(targets, config):
            return
        dry_runs = dry_runs + 1 if _all_exist(targets) else 0
        time.sleep({0: EXISTS_POLL_S, 1: APPEARED_RETRY_S}.get(dry_runs, POLL_S))
    if process is not None and process.returncode != 0:
        raise _failed_background()
    snakemake("--cores", "2", *targets, *config)


# A dry run (-n) in the project root runs beside the session's background build: while a job of it runs, its outputs
# are marked incomplete, and a plain dry run refuses to plan anything (IncompleteFilesException: CI failed on it, a
# quick test's dry run during the build's download). With this flag it plans that job as still to run, which it is.
DRY_RUN_BESIDE_A_BUILD = "--rerun-incomplete"


def snakemake(
    *args: str, check: bool = True, timeout: float | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    """Run Snakemake in the project root (or another checkout, cwd) the way a user does; output captured."""
    if "-n" in args:
        args = (*args, DRY_RUN_BESIDE_A_BUILD)
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"snakemake {' '.join(args)} failed ({result.returncode}):\n"
            f"{result.stdout[-5000:]}\n{result.stderr[-10000:]}"
        )
    return result


_tiny_run_done: list = []


def complete_the_tiny_run() -> None:
    if not _tiny_run_done:
        probe_the_image()
        wait_for_stage("all")
        snakemake("--cores", "2", *TINY)
        _tiny_run_done.append(True)


def the_sweep() -> float:
    """The tiny sweep, once start_the_sweep has run it: its probes with nothing else running, the rest beside
    BESIDE_THE_SWEEP's modules; a run of it here checks that nothing is left to do. Returns when it started
    (time.time()): a record older than that is the default run's."""
    start_the_sweep()
    process = _sweep.get("process")
    if process is None:
        raise AssertionError("the sweep's probes failed: see the test that ran them (start_the_sweep)")
    if process.wait() != 0:
        raise AssertionError(f"the sweep failed ({process.returncode}):\n{_sweep['log'].read_text()[-10000:]}")
    snakemake("--cores", "2", *TINY_SWEEP)
    return _sweep["started"]
