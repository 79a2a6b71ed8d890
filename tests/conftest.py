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
sys.path.insert(0, str(ROOT / "scripts"))

from suite_timing import pytest_runtest_protocol, pytest_terminal_summary  # noqa: E402, F401  (hooks, by name)

# --configfile takes several files: targets go before it.
# Modules run after every other: the sweep replaces image.tar.gz with the selected variant's.
LAST = ("test_sweep_e2e.py",)


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


def pytest_collection_modifyitems(session, config, items):
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
            "the sweep replaces image.tar.gz: only modules in conftest.LAST may use tiny_sweep:"
            "\n  " + "\n  ".join(early)
        )
    # The quick tests first, while the stage venvs build in the background (pytest_collection_finish); then the e2e
    # ones, LAST's at the end. Stable: each group keeps its order.
    items.sort(key=lambda item: (item.get_closest_marker("e2e") is not None, item.path.name in LAST))


VENVS = ("compress", "serve-cpu", "eval")
VENV_TARGETS = [f".venvs/{name}/pip-freeze.txt" for name in VENVS]
# The venvs' build when this session started it in the background: {"process": Popen, "log": Path}.
_background_venvs: dict = {}


def pytest_collection_finish(session):
    """A session with a test that needs the stage venvs starts their build now, beside the quick tests, which run
    first: its downloads and bytecode compiling (~3 min on 2 cores) overlap them instead of following them. No timed
    stage runs then; tiny_venvs waits for the build."""
    if session.config.option.collectonly or not any(
        "tiny_venvs" in getattr(item, "fixturenames", ()) for item in session.items
    ):
        return
    log_path = Path(tempfile.mkdtemp(prefix="qwen35-serve-venvs-")) / "snakemake.log"
    with open(log_path, "w") as log:
        _background_venvs.update(
            process=subprocess.Popen(
                [sys.executable, "-m", "snakemake", "--cores", "2", *VENV_TARGETS, *TINY],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            ),
            log=log_path,
        )


def pytest_sessionfinish(session):
    process = _background_venvs.get("process")
    if process is not None and process.poll() is None:  # the session ended before any test needed the venvs
        process.terminate()
        process.wait(60)


TINY = ["--configfile", "config/tiny.yaml"]
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


def snakemake(
    *args: str, check: bool = True, timeout: float | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    """Run Snakemake in the project root (or another checkout, cwd) the way a user does; output captured."""
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"snakemake {' '.join(args)} failed ({result.returncode}):\n"
            f"{result.stdout[-5000:]}\n{result.stderr[-10000:]}"
        )
    return result


@pytest.fixture(scope="session")
def tiny_venvs():
    """The stage venvs, made by the pipeline's own `venv` rule (a no-op when they are up to date): the build this
    session started in the background, waited for, then checked by a run of its own."""
    process = _background_venvs.pop("process", None)
    if process is not None and process.wait() != 0:
        log = _background_venvs["log"].read_text()
        raise AssertionError(f"the stage venvs' build failed ({process.returncode}):\n{log[-10000:]}")
    snakemake("--cores", "2", *VENV_TARGETS, *TINY)
    return {name: ROOT / ".venvs" / name / "bin" / "python" for name in VENVS}


@pytest.fixture(scope="session")
def tiny_run(tiny_venvs):
    """The whole tiny DAG (what the README's first command does: image.tar.gz and its verification). Run once per
    session: every e2e module reads its outputs instead of running stages again."""
    result = snakemake("--cores", "2", *TINY)
    return result


TINY_SWEEP = [*TINY, "config/tiny-sweep.yaml"]


@pytest.fixture(scope="session")
def tiny_sweep(tiny_run):
    """The tiny sweep over the default run (README: "...and ship the fastest"): it reuses tiny_run's variant and
    quantized checkpoint and adds the others. It replaces image.tar.gz with the selected variant's, so only modules
    in LAST may use it."""
    return snakemake("--cores", "2", *TINY_SWEEP)


def _tiny_config() -> dict:
    import yaml

    return yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())


@pytest.fixture(scope="session")
def docker_daemon():
    """A Docker daemon, started the way setup/install.sh starts it when none answers."""
    subprocess.run(["bash", str(ROOT / "setup" / "start-docker.sh")], check=True, timeout=120)


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_venvs) -> Path:
    """The tiny profile's synthetic checkpoint, made by the pipeline's `download` rule."""
    name = _tiny_config()["model"]["name"]
    snakemake("--cores", "2", f"weights/{name}/manifest.json", *TINY)
    return ROOT / "weights" / name / "checkpoint"


@pytest.fixture(scope="session")
def tiny_quantized(tiny_venvs) -> Path:
    """The tiny default variant's W4A16 checkpoint, made by the pipeline's `quantize` rule (one per recipe)."""
    config = _tiny_config()
    recipe = Path(config["variants"][config["variant"]]["recipe"]).stem
    snakemake("--cores", "2", f"results/quantize/{recipe}/manifest.json", *TINY)
    return ROOT / "results" / "quantize" / recipe / "model"


@pytest.fixture(scope="session")
def tiny_base_image(tiny_venvs, docker_daemon) -> dict:
    """The tiny profile's local base image (Debian + the CPU serving venv), made by `base_image`."""
    import json

    snakemake("--cores", "2", "results/base_image/image.json", *TINY)
    return json.loads((ROOT / "results" / "base_image" / "image.json").read_text())
