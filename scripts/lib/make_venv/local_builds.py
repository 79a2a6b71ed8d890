"""Packages a venv needs that PyPI has no usable wheel of: built here from their pinned source archive.

A requirements line `#! local-build <name>==<version>` (a comment to pip; scripts/make_venv.py) names one of
RECIPES. Each recipe says how to build it and what to take out of it, and why.

arctic-inference==0.1.1 (vLLM's suffix decoding, 0.26 and 0.32: vllm/v1/spec_decode/suffix_decoding.py imports
arctic_inference.suffix_decoding, and SpeculativeConfig asks for exactly this version). PyPI has only its source
archive, whose build pins torch==2.7.0 in an isolated build env: ~1 GB of CUDA torch beside the venv's own torch, for a
setup.py that reads torch only to hand TORCH_CMAKE_PREFIX_PATH to CMake. The one extension it builds by default,
arctic_inference.suffix_decoding._C (a nanobind module, csrc/suffix_decoding), never reads it (its custom CUDA ops
are built only with ARCTIC_INFERENCE_PRECOMPILED_OPS set). So it is built without isolation in a small build venv
(setuptools, wheel, nanobind 2.9.2 as the archive pins, grpcio-tools for its proto step, ninja), with a stub
`torch` module that only carries cmake_prefix_path, against the target venv's Python. Its `vllm.general_plugins`
entry point (`arctic_inference`, which monkeypatches vLLM wholesale for Snowflake's own serving) is removed from
the installed metadata, so vLLM loads only the project's plugins; suffix decoding imports the module directly.
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from lib.stage import StageError

ARCTIC_BUILD_REQUIREMENTS = ["setuptools>=61", "wheel", "nanobind==2.9.2", "grpcio-tools", "ninja"]
TORCH_STUB = 'class utils:\n    cmake_prefix_path = ""\n'


def _run(cmd: list[str], **kwargs) -> None:
    """Run a build step; its output goes where ours goes (the venv rule's log), so a slow step shows progress."""
    cmd = [str(c) for c in cmd]
    print("local-build:", " ".join(cmd), flush=True)
    result = subprocess.run(cmd, **kwargs)
    if result.returncode != 0:
        raise StageError(f"{' '.join(cmd[:6])} ... failed (exit {result.returncode}); its output is above")


def drop_metadata_file(info: Path, name: str) -> None:
    """Remove one file of an installed distribution's metadata, and its line in RECORD."""
    (info / name).unlink(missing_ok=True)
    record = info / "RECORD"
    if record.exists():
        record.write_text(
            "".join(
                line
                for line in record.read_text().splitlines(keepends=True)
                if not line.startswith(f"{info.name}/{name},")
            )
        )


def drop_entry_points(site_packages: Path, dist: str, group: str) -> list[str]:
    """Remove `group` from an installed distribution's entry points (and RECORD's line when none are left);
    returns the entry point lines removed."""
    info = next(site_packages.glob(f"{dist}-*.dist-info"), None)
    if info is None:
        raise StageError(f"{dist} is not installed in {site_packages}")
    path = info / "entry_points.txt"
    if not path.exists():
        return []
    kept, removed, section = [], [], None
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("["):
            section = stripped[1:-1]
        if section == group:
            if stripped and not stripped.startswith("["):
                removed.append(stripped)
            continue
        kept.append(line)
    if any(line.strip() and not line.strip().startswith("[") for line in kept):
        path.write_text("\n".join(kept) + "\n")
    else:
        drop_metadata_file(info, "entry_points.txt")
    return removed


def build_arctic_inference(venv: Path, requirement: str) -> None:
    python = venv / "bin" / "python"
    with tempfile.TemporaryDirectory(prefix="local-build-") as tmp:
        tmp = Path(tmp)
        _run([sys.executable, "-m", "venv", tmp / "build"])
        build_python = tmp / "build" / "bin" / "python"
        _run([build_python, "-m", "pip", "install", "-q", *ARCTIC_BUILD_REQUIREMENTS])
        (tmp / "stub" / "torch").mkdir(parents=True)
        (tmp / "stub" / "torch" / "__init__.py").write_text(TORCH_STUB)
        env = dict(
            os.environ,
            PYTHONPATH=str(tmp / "stub"),
            CMAKE_BUILD_PARALLEL_LEVEL="2",
            # CMake's FindPython would otherwise find the system Python, which has no nanobind
            CMAKE_ARGS=f"-DPython_EXECUTABLE={build_python}",
        )
        env["PATH"] = f"{tmp / 'build' / 'bin'}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"
        # without isolation: pip's metadata step would otherwise install the archive's build pins (torch 2.7.0)
        _run(
            [
                build_python,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "--no-build-isolation",
                "-d",
                tmp / "sdist",
                requirement,
            ],
            env=env,
        )
        sdist = next((tmp / "sdist").glob("arctic_inference-*.tar.gz"))
        _run(["tar", "-xzf", sdist, "-C", tmp])
        source = next(p for p in tmp.glob("arctic_inference-*") if p.is_dir())
        _run(
            [build_python, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w", tmp / "wheel", source],
            env=env,
        )
        wheel = next((tmp / "wheel").glob("arctic_inference-*.whl"))
        _run([python, "-m", "pip", "install", "--no-input", "--no-deps", wheel])
    site_packages = next((venv / "lib").glob("python3.*/site-packages"))
    drop_entry_points(site_packages, "arctic_inference", "vllm.general_plugins")
    # installed from a wheel file in a temporary folder: pip freeze would print that path (a new one every build)
    # instead of the pin
    drop_metadata_file(next(site_packages.glob("arctic_inference-*.dist-info")), "direct_url.json")
    _run([python, "-c", "from arctic_inference.suffix_decoding import SuffixDecodingCache"])


RECIPES = {"arctic-inference==0.1.1": build_arctic_inference}


def build(venv: Path, requirement: str) -> None:
    recipe = RECIPES.get(requirement.strip())
    if recipe is None:
        raise StageError(f"no local-build recipe for {requirement!r}; known: {sorted(RECIPES)}")
    recipe(venv, requirement.strip())
