"""profiles/slurm against a real scheduler: a single-node SLURM cluster (setup/start-slurm.sh: Debian's slurm-wlm,
munge, slurmdbd on MariaDB) runs the tiny profile's cheap fan-out through `snakemake --profile profiles/slurm`:
`download`, `download_datasets` and two `quantize` recipes, each a SLURM job. The jobs must appear in `sacct` with
the memory and time limit their rules declare (config/tiny.yaml's `resources`), leave their logs under logs/, and
give the same bytes as a local run; a missing partition, a memory kill, a time-limit kill and no controller each
fail the run with SLURM's words. The runs are in copies of the checkout, so the project's own outputs are
untouched: the trained tiny checkpoint is copied in (train_tiny takes minutes), the venvs are linked. The time-limit
run, which waits the longest, has a copy of its own and runs beside the others.
"""

import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, TEST_TORCH_THREADS, TINY, _tiny_config, build, snakemake

pytestmark = pytest.mark.e2e

CONFIG = _tiny_config()
MODEL = f"weights/{CONFIG['model']['name']}"
RECIPES = ("awq-w4a16-g32-broad", "w8a16")  # the default variant's recipe and a second one
QUANTIZED = [f"results/quantize/{recipe}" for recipe in RECIPES]
UNTRAINED = f"{MODEL}/untrained"
# Two runs: the fan-out on the trained checkpoint, then download again (in one run its new checkpoint would make
# train_tiny, minutes on 2 cores, rerun before quantize).
FAN_OUT = ["datasets/gate/datasets.json", *[f"{q}/report.json" for q in QUANTIZED]]
DOWNLOAD = f"{UNTRAINED}/download.json"
# made locally by the session's background build (scheduler), beside the tests that run before this module
BACKGROUND_TARGETS = [*FAN_OUT, DOWNLOAD]
RULES = ("download", "download_datasets", "quantize")
SOURCES_TIME = 946684800  # 2000-01-01: the copy's tracked files (checkout_copy)
# Status checks every few seconds instead of the executor's 40 s: the jobs here take seconds. quantize asks for 4
# threads (what a real node has): --max-threads caps what a job asks SLURM for, at the count of the tests' own torch
# processes, as the jobs run beside the session's background build (scheduler.TEST_TORCH_THREADS).
FAST = ["--slurm-init-seconds-before-status-checks", "2", "--max-threads", str(TEST_TORCH_THREADS)]


# The records (download.json, report.json) also hold how long a stage took: compared are the checkpoints.
NOT_COMPARED = {".snakemake_timestamp", "download.json", "report.json"}


def tree_digest(path: Path) -> dict[str, str]:
    """sha256 of every file under path, by relative name; Snakemake's directory marker and the records left out."""
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name not in NOT_COMPARED)
    assert files, f"nothing under {path}"
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def checkout_copy(dest: Path) -> Path:
    """The tracked files of this checkout (with uncommitted edits, file times kept), the untrained and trained
    checkpoints, and the venvs linked."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
            # Older than every copied output: a test may rewrite a tracked data file with the same bytes (the tiny
            # tasks' test splits), and the copy has no Snakemake records to tell a new time from new content.
            os.utime(dest / name, (SOURCES_TIME, SOURCES_TIME))
    for name in ("checkpoint", "manifest.json", "download.json"):  # download's and train_tiny's outputs
        for source, target in (
            (ROOT / UNTRAINED / name, dest / UNTRAINED / name),
            (ROOT / MODEL / name, dest / MODEL / name),
        ):
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(source, target) if source.is_dir() else shutil.copy2(source, target)
    (dest / ".venvs").symlink_to(ROOT / ".venvs")
    return dest


def slurm_args(*args: str) -> list[str]:
    """snakemake's arguments for a run of the tiny profile through profiles/slurm."""
    return ["--profile", "profiles/slurm", *args, *FAST, *TINY]


def on_slurm(workdir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return snakemake(*slurm_args(*args), check=check, cwd=workdir)


def forced_with_resource(target: str, rule: str, resource: str) -> list[str]:
    """Arguments that make target with rule forced and one of its resources set (`mem_mb=50`), so that SLURM ends
    the job."""
    return [target, "--forcerun", rule, "--set-resources", f"{rule}:{resource}"]


def failed_without_target(workdir: Path, target: str, returncode: int, out: str) -> str:
    """The run failed and left no target; returns its output."""
    assert returncode != 0, out[-3000:]
    assert not (workdir / target).exists()
    return out


def failing_with_resource(workdir: Path, target: str, rule: str, resource: str) -> str:
    """Make target as forced_with_resource says: the run must fail and leave no target. Returns the run's output."""
    result = on_slurm(workdir, *forced_with_resource(target, rule, resource), check=False)
    return failed_without_target(workdir, target, result.returncode, result.stdout + result.stderr)


def sacct_jobs(since: str, workdir: Path) -> list[dict]:
    """The jobs SLURM accounted for since a time, of the runs in workdir."""
    fields = ["JobIDRaw", "JobName", "State", "ReqMem", "Timelimit", "Comment", "ExitCode", "WorkDir"]
    out = subprocess.run(
        ["sacct", "-X", "-P", "-n", "-S", since, f"--format={','.join(fields)}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    jobs = [dict(zip(fields, line.split("|"), strict=True)) for line in out.splitlines() if line]
    return [job for job in jobs if job["WorkDir"] == str(workdir)]


@pytest.fixture(scope="module")
def slurm_cluster():
    subprocess.run(["bash", str(ROOT / "setup" / "start-slurm.sh")], check=True, timeout=180)


@pytest.fixture(scope="module")
def local_outputs(tiny_checkpoint):
    """The same targets built the ordinary way in the project itself (most exist already after the tiny DAG)."""
    build(*BACKGROUND_TARGETS)
    return {target: tree_digest(ROOT / target) for target in (UNTRAINED, *QUANTIZED)}


TRAINED = f"{MODEL}/download.json"


@pytest.fixture(scope="module")
def time_limit_run(slurm_cluster, tiny_checkpoint, tmp_path_factory):
    """train_tiny (minutes on any CPU) given 1 minute, in a checkout of its own, started before the other runs and
    left running beside them: slurmctld checks time limits every 30 s, so SLURM ends the job 60-90 s in, and the
    executor, whose status checks space out while no job finishes, reports it and exits up to a minute later. Its
    training only has to outlast the limit: its sbatch runs under `nice` (a stand-in first on PATH), which the job
    inherits (setup/start-slurm.sh's PropagatePrioProcess), so it takes only CPU time that the other runs and the
    session's background build leave; the executor itself, which reports the job, keeps its priority."""
    workdir = checkout_copy(tmp_path_factory.mktemp("slurm-time-limit") / "checkout")
    log = workdir.parent / "snakemake.log"
    niced = workdir.parent / "niced-sbatch"
    niced.mkdir()
    (niced / "sbatch").write_text(f'#!/bin/sh\nexec nice -n 19 {shutil.which("sbatch")} "$@"\n')
    (niced / "sbatch").chmod(0o755)
    args = slurm_args(*forced_with_resource(TRAINED, "train_tiny", "runtime=1"))
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "snakemake", *args],
            cwd=workdir,
            env={**os.environ, "PATH": f"{niced}{os.pathsep}{os.environ['PATH']}"},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    yield {"process": process, "workdir": workdir, "log": log}
    if process.poll() is None:  # a test before the one that waits for it failed the session
        process.terminate()
        process.wait(120)


@pytest.fixture(scope="module")
def cluster_run(slurm_cluster, time_limit_run, local_outputs, tmp_path_factory):
    workdir = checkout_copy(tmp_path_factory.mktemp("slurm") / "checkout")
    since = time.strftime("%Y-%m-%dT%H:%M:%S")
    started = time.monotonic()
    on_slurm(workdir, *FAN_OUT)
    again = on_slurm(workdir, "-n", *FAN_OUT).stdout  # before download runs again, which makes train_tiny out of date
    on_slurm(workdir, DOWNLOAD, "--forcerun", "download")
    return {"workdir": workdir, "since": since, "seconds": time.monotonic() - started, "dry_run_after": again}


def test_each_rule_ran_as_a_slurm_job_with_its_declared_resources(cluster_run):
    jobs = sacct_jobs(cluster_run["since"], cluster_run["workdir"])
    by_rule = {}
    for job in jobs:
        rule = re.match(r"rule_(\w+?)(?:_wildcards_|$)", job["Comment"])
        if rule:
            by_rule.setdefault(rule.group(1), []).append(job)
    assert sorted(by_rule) == sorted(RULES), jobs
    assert len(by_rule["quantize"]) == len(RECIPES)
    for rule, rule_jobs in by_rule.items():
        declared = CONFIG["resources"][rule]
        for job in rule_jobs:
            assert job["State"] == "COMPLETED" and job["ExitCode"] == "0:0", job
            assert job["ReqMem"] == f"{declared['mem_mb']}M", (rule, job)
            hours, minutes, seconds = (int(part) for part in job["Timelimit"].split(":"))
            assert hours * 60 + minutes == declared["runtime"] and seconds == 0, (rule, job)
    assert sorted(job["JobIDRaw"] for job in jobs) == sorted(set(job["JobIDRaw"] for job in jobs))
    print(f"SLURM: {len(jobs)} jobs in {cluster_run['seconds']:.0f} s")


def test_the_cluster_gives_the_same_outputs_as_a_local_run(cluster_run, local_outputs):
    workdir = cluster_run["workdir"]
    for target, digest in local_outputs.items():
        assert tree_digest(workdir / target) == digest, target


def test_each_job_leaves_its_logs_under_logs(cluster_run):
    logs = cluster_run["workdir"] / "logs"
    for name in ("download/download.log", "download_datasets/gate.log", *[f"quantize/{r}.log" for r in RECIPES]):
        assert (logs / name).stat().st_size > 0, name
    slurm_logs = list((logs / "slurm").rglob("*.log"))  # SLURM's own output of each job (profiles/slurm: slurm-logdir)
    assert {p.relative_to(logs / "slurm").parts[0] for p in slurm_logs} == {f"rule_{rule}" for rule in RULES}
    assert len(slurm_logs) == 1 + 1 + len(RECIPES) and all(p.stat().st_size for p in slurm_logs), slurm_logs


def test_a_rerun_on_the_cluster_has_nothing_to_do(cluster_run):
    assert "Nothing to be done" in cluster_run["dry_run_after"], cluster_run["dry_run_after"][-2000:]


# ---- failures: SLURM's reason in the message, no output a rerun would trust --------------------------------------


def test_a_partition_that_does_not_exist_is_named(cluster_run):
    result = on_slurm(
        cluster_run["workdir"], DOWNLOAD, "--forcerun", "download",
        "--default-resources", "slurm_partition=no-such-partition", check=False,
    )  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode != 0 and "invalid partition specified: no-such-partition" in out, out[-3000:]
    assert not (cluster_run["workdir"] / DOWNLOAD).exists()


def test_a_job_the_scheduler_kills_fails_the_run_with_slurms_reason(cluster_run):
    """download asks for 50 MB and uses ~850: SLURM (OverMemoryKill, setup/start-slurm.sh) kills it, and the outputs
    the job wrote before are removed."""
    out = failing_with_resource(cluster_run["workdir"], DOWNLOAD, "download", "mem_mb=50")
    # The executor reports the state (FAILED); SLURM's own log, which the profile shows, says why, in either of
    # slurmstepd's words (CI has seen both): "Exceeded job memory limit", or "StepId=<job>.batch exceeded memory limit
    # (<bytes> > <limit>), being killed" alone when the job is cancelled before the first is written
    assert "SLURM status is: 'FAILED'" in out, out[-3000:]
    killed = r"Exceeded job memory limit|StepId=\d+\.batch exceeded memory limit \(\d+ > \d+\)"
    assert re.search(killed, out), out[-3000:]


def test_no_reachable_scheduler_is_a_clear_error(cluster_run, tmp_path):
    """SLURM_CONF naming a controller nobody runs: sbatch's own error ends the run."""
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=nowhere\nSlurmctldHost=localhost(127.0.0.2)\nSlurmctldPort=1\nMessageTimeout=2\n")
    env = dict(os.environ, SLURM_CONF=str(conf))
    result = subprocess.run(
        ["python3", "-m", "snakemake", *slurm_args(DOWNLOAD, "--forcerun", "download")],
        cwd=cluster_run["workdir"], env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-3000:]
    assert "Unable to contact slurm controller" in out, out[-3000:]
    assert not (cluster_run["workdir"] / DOWNLOAD).exists()


def test_a_job_past_its_time_limit_fails_the_run_with_slurms_reason(time_limit_run):
    """time_limit_run, which trains from the untrained checkpoint of its copy (no download job first). Last: it
    waits for that run, while the tests above run beside it."""
    process, workdir = time_limit_run["process"], time_limit_run["workdir"]
    process.wait(600)
    out = failed_without_target(workdir, TRAINED, process.returncode, time_limit_run["log"].read_text())
    assert "SLURM status is: 'TIMEOUT'" in out, out[-3000:]
    assert "DUE TO TIME LIMIT" in out, out[-3000:]  # slurmstepd's line in SLURM's job log
    assert not (workdir / MODEL / "checkpoint").exists()
