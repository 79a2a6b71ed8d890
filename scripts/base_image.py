"""Build a local Python base image holding the CPU serving environment (tiny profile only).

No registry is reachable on the tiny host, so the base is a Debian minbase rootfs from mmdebstrap
with the serve-cpu venv's site-packages copied in and put on PYTHONPATH. The real profile uses a
pinned vLLM image instead and skips this rule.
"""

import fnmatch
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from lib.base_image.elf_stubs import build_stub
from lib.containers import base_into_buildah, buildah_works, builder_env, detect_builder, image_id, image_size, run
from lib.files import link_or_copy
from lib.stage import StageError, write_json

SITE = "/opt/venv/site-packages"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Left out of the CPU image (0.64 GB of triton, 0.86 GB of CUDA files): triton is the GPU compiler, and it has no
# CPU backend here. PyPI's torch is the CUDA build, so `import torch` links cuBLAS, cuFFT, NCCL, cuDNN's loader and
# the rest even on a CPU (CUDA_STAND_INS); the files below are only ever dlopen'ed by CUDA work (cuDNN's engines,
# NVRTC's alternative ABI, multi-GPU cuSOLVER, profiler and device-side NVSHMEM, CUDA linalg), run by GPU
# compilation (ptxas) or are static archives and headers: none is mapped by a CPU server (checked in
# /proc/<pid>/maps of the tiny one).
# torch/include stays: inductor compiles C++ against it at start-up.
SITE_EXCLUDE = (
    "triton",
    "triton-*.dist-info",
    "nvidia/*/include",
    "nvidia/cudnn/lib/libcudnn_*.so.*",
    "nvidia/cu13/lib/libnvrtc.alt.so.*",
    "nvidia/cu13/lib/libnvrtc-builtins.alt.so.*",
    "nvidia/cu13/lib/libcusolverMg.so.*",
    "nvidia/cu13/lib/libnvperf_*.so",
    "nvidia/cu13/lib/*.a",
    "nvidia/nvshmem/lib/libnvshmem_device.*",
    "torch/lib/libtorch_cuda_linalg.so",
    "torch/bin/ptxas",
)
# Linked by `import torch` but never called on a CPU (2.0 GB): replaced by stand-ins that export the same symbols and
# abort with a message if called (lib/base_image/elf_stubs.py). The small ones that CPU work does call stay real: the
# CUDA runtime (torch.cuda.is_available asks it) and cuDNN's loader (torch.backends.cudnn.version).
CUDA_STAND_INS = (
    "nvidia/cu13/lib/libcublasLt.so.*",
    "nvidia/cu13/lib/libcublas.so.*",
    "nvidia/cu13/lib/libcufft.so.*",
    "nvidia/cu13/lib/libcusparse.so.*",
    "nvidia/cu13/lib/libcusolver.so.*",
    "nvidia/cu13/lib/libcurand.so.*",
    "nvidia/cu13/lib/libnvrtc.so.*",
    "nvidia/cu13/lib/libnvJitLink.so.*",
    "nvidia/cusparselt/lib/libcusparseLt.so.*",
    "nvidia/nccl/lib/libnccl.so.*",
    "nvidia/nvshmem/lib/libnvshmem_host.so.*",
)
SMOKE_TEST = "import torch, vllm; print(vllm.__version__, torch.__version__)"


def venv_site_packages(venv_marker: str | Path) -> Path:
    found = sorted((Path(venv_marker).parent / "lib").glob("python3.*/site-packages"))
    if len(found) != 1:
        raise StageError(f"expected one lib/python3.*/site-packages next to {venv_marker}, found {found}")
    return found[0]


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve()) + "/"
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1].replace("\\040", " ") for line in mounts]
    return sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True)


def remove_rootfs(path: Path) -> None:
    """rm -rf that first unmounts what the bootstrap may have left mounted (it mounts /dev, /proc and /sys in the
    rootfs while it installs): deleting through a live bind mount would delete the host's files."""
    if not path.exists():
        return
    for point in _mounts_under(path):
        subprocess.run(["umount", "-l", point], capture_output=True)
    if _mounts_under(path):
        raise StageError(f"{path} still has mounts ({_mounts_under(path)}); unmount them and delete it by hand")
    shutil.rmtree(path)


def bootstrap_rootfs(rootfs: Path, suite: str, mirror: str, packages: list[str]) -> None:
    """A Debian minbase rootfs with `packages`. mmdebstrap, not debootstrap: apt resolves and installs in one pass
    and leaves no package cache (22 s against debootstrap's 50-75 s on 2 cores)."""
    if shutil.which("mmdebstrap") is None:
        raise StageError("mmdebstrap is not installed (apt-get install mmdebstrap; setup/install.sh does)")
    cmd = ["mmdebstrap", "--variant=minbase", f"--include={','.join(packages)}", suite, str(rootfs), mirror]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-20:]
        raise StageError(f"mmdebstrap {suite} from {mirror} failed (exit {result.returncode}):\n" + "\n".join(tail))


def _excluded(rel: str, patterns) -> bool:
    return any(fnmatch.fnmatch(rel, pattern) for pattern in patterns)


def copy_site_packages(src: Path, dst: Path, exclude=SITE_EXCLUDE) -> None:
    """Copy src to dst leaving out paths (relative to src, glob patterns) in exclude."""

    def ignore(directory, names):
        rel_dir = Path(directory).relative_to(src)
        return {n for n in names if _excluded(str(rel_dir / n) if str(rel_dir) != "." else n, exclude)}

    # the rootfs is only read, then deleted: links save a 3 GB copy
    shutil.copytree(src, dst, symlinks=True, ignore=ignore, copy_function=link_or_copy)


def stand_in_libraries(src: Path, dst: Path, patterns=CUDA_STAND_INS) -> dict[str, int]:
    """Write a stand-in (lib/base_image/elf_stubs.py) at dst for every library under src matching patterns (relative
    glob patterns); returns {relative path: bytes saved}. A pattern that matches nothing is reported: the serve venv's
    torch changed its CUDA libraries, and this list needs the new names for the image to stay small."""
    saved = {}
    for pattern in patterns:
        found = sorted(p for p in src.glob(pattern) if p.is_file() and not p.is_symlink())
        if not found:
            print(f"warning: no {pattern} in {src}: nothing stood in for it (the image keeps what torch brings)")
        for library in found:
            rel = library.relative_to(src)
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            build_stub(library, dst / rel)
            saved[str(rel)] = library.stat().st_size - (dst / rel).stat().st_size
    return saved


def chroot_python(rootfs: Path, code: str) -> str:
    env = {"PATH": PATH, "PYTHONPATH": SITE, "LANG": "C.UTF-8", "HOME": "/root"}
    result = subprocess.run(["chroot", str(rootfs), "python3", "-c", code], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise StageError(
            f"python3 in the base rootfs failed on {code!r}:\n" + "\n".join(result.stderr.strip().splitlines()[-15:])
        )
    return result.stdout.strip()


def image_env() -> dict[str, str]:
    return {"PATH": PATH, "PYTHONPATH": SITE, "LANG": "C.UTF-8"}


def import_rootfs(rootfs: Path, ref: str, builder: str, workdir: Path) -> None:
    env = image_env()
    if builder == "docker":
        changes = [f"ENV {k}={v}" for k, v in env.items()] + ['CMD ["python3"]']
        cmd = ["docker", "import", *(a for c in changes for a in ("--change", c)), "-", ref]
        tar = subprocess.Popen(["tar", "--numeric-owner", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        result = subprocess.run(cmd, stdin=tar.stdout, capture_output=True, text=True, env=builder_env("docker"))
        tar.stdout.close()
        if tar.wait() != 0 or result.returncode != 0:
            raise StageError(f"docker import of the base rootfs failed: {result.stderr.strip()[-2000:]}")
        return
    archive = workdir / "rootfs.tar"
    run(["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(archive), "."], what="tar of the base rootfs")
    container = run(["buildah", "from", "scratch"], builder="buildah").strip()
    try:
        run(["buildah", "add", container, str(archive), "/"], builder="buildah", what="buildah add rootfs")
        run(
            [
                "buildah",
                "config",
                *(a for k, v in env.items() for a in ("--env", f"{k}={v}")),
                "--cmd",
                '["python3"]',
                container,
            ],
            builder="buildah",
        )
        run(["buildah", "commit", container, ref], builder="buildah", what=f"buildah commit {ref}")
    finally:
        subprocess.run(["buildah", "rm", container], capture_output=True, env=builder_env("buildah"))


def main(job) -> None:
    params = job.params
    started = time.monotonic()
    builder = detect_builder(params.builder)
    # input `venv` makes run_stage re-run this (stdlib-only) script in that venv; `serve_venv` does not
    marker = getattr(job.input, "serve_venv", None) or job.input.venv
    site = venv_site_packages(marker)
    out = Path(job.output.image)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="base-rootfs-", dir=out.parent))
    rootfs = work / "rootfs"
    try:
        bootstrap_rootfs(rootfs, params.suite, params.mirror, list(params.packages))
        print(f"mmdebstrap {params.suite}: {time.monotonic() - started:.0f} s", flush=True)
        py = site.parent.name  # python3.X: the venv's C extensions are built for this minor version
        if not (rootfs / "usr" / "lib" / py).is_dir():
            found = sorted(p.name for p in (rootfs / "usr" / "lib").glob("python3.*"))
            raise StageError(
                f"the venv is {py} but Debian {params.suite} ships {found}: "
                "make the serve-cpu venv with that Python or pick a matching suite"
            )
        t = time.monotonic()
        copy_site_packages(site, rootfs / SITE.lstrip("/"), SITE_EXCLUDE + CUDA_STAND_INS)
        shutil.copy2(marker, rootfs / "opt" / "venv" / "pip-freeze.txt")
        print(f"copied {site}: {time.monotonic() - t:.0f} s", flush=True)
        stood_in = stand_in_libraries(site, rootfs / SITE.lstrip("/"))
        print(f"{len(stood_in)} CUDA libraries stood in for, {sum(stood_in.values()) / 1e9:.2f} GB less", flush=True)
        version = chroot_python(rootfs, "import platform; print(platform.python_version())")
        smoke = chroot_python(rootfs, SMOKE_TEST)  # fail here, not in a container
        print(f"smoke test in rootfs: {smoke}", flush=True)
        t = time.monotonic()
        import_rootfs(rootfs, params.tag, builder, work)
        print(f"{builder} import {params.tag}: {time.monotonic() - t:.0f} s", flush=True)
    finally:
        remove_rootfs(work)
    base_id = image_id(params.tag, builder)
    buildah_copy = None
    if builder == "docker" and params.reproducible and buildah_works():
        t = time.monotonic()
        buildah_copy = base_into_buildah({"ref": params.tag, "id": base_id})
        print(f"copied into buildah's store for build_image: {time.monotonic() - t:.0f} s", flush=True)
    size = image_size(params.tag, builder)
    write_json(
        out,
        {
            "ref": params.tag,
            "id": base_id,
            "builder": builder,
            "buildah_copy": buildah_copy,
            "python": version,
            "site_packages": SITE,
            "stand_ins": sorted(stood_in),
            "size_bytes": size,
        },
    )
    print(f"base image {params.tag} ({size} bytes) in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    from lib.stage import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
