import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

# --configfile takes several files: targets go before it.
TINY = ["--configfile", "config/tiny.yaml"]


def snakemake(*args: str, check: bool = True, timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run Snakemake in the project root the way a user does; output captured for assertions."""
    result = subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed ({result.returncode}):\n"
                             f"{result.stdout[-5000:]}\n{result.stderr[-10000:]}")
    return result


@pytest.fixture(scope="session")
def tiny_venvs():
    """The stage venvs, made by the pipeline's own `venv` rule (a no-op when they are up to date)."""
    targets = [f".venvs/{name}/pip-freeze.txt" for name in ("compress", "serve-cpu", "eval")]
    snakemake("--cores", "2", *targets, *TINY)
    return {name: ROOT / ".venvs" / name / "bin" / "python" for name in ("compress", "serve-cpu", "eval")}


@pytest.fixture(scope="session")
def tiny_run():
    """The whole tiny DAG to image.tar.gz (what the README's first command does); reused when up to date."""
    result = snakemake("--cores", "2", "image.tar.gz", *TINY)
    return result
