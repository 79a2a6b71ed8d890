"""Building, running and saving images (base_image, build_image, bake, latency_probe, quality_gate, tarball, verify).

Stdlib only: imported by the main interpreter. Two builders are supported: a Docker daemon
(Debian's 20.10 here, driven by a newer client, hence DOCKER_BUILDKIT=0) and daemonless buildah.
Running an image needs the Docker daemon. Every container runs offline (offline_network), and a stage after
build_image runs the image by the ID build_image recorded (recorded_image).
"""

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

from lib.openai_client import request
from lib.progress import Heartbeat, elapsed
from lib.stage import StageError

START_HINT = "start one with `bash setup/start-docker.sh` (as root)"
# Defaults only: a value the user exported wins (e.g. STORAGE_DRIVER=overlay on a capable host).
_BUILDER_ENV = {
    "docker": {"DOCKER_BUILDKIT": "0"},  # the 20.10 daemon has no BuildKit API the 28.x client accepts
    "buildah": {"STORAGE_DRIVER": "vfs", "BUILDAH_ISOLATION": "chroot"},  # no daemon, works in a container
}


def builder_env(builder: str) -> dict[str, str]:
    return {**_BUILDER_ENV[builder], **os.environ}


def run(cmd: Sequence[str], *, builder: str = "docker", what: str | None = None, **kwargs) -> str:
    """Run a command, return its stdout; a failure becomes a StageError carrying stderr's tail."""
    result = subprocess.run(list(cmd), capture_output=True, text=True, env=builder_env(builder), **kwargs)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-15:])
        raise StageError(f"{what or ' '.join(cmd[:3])} failed (exit {result.returncode}):\n{tail}")
    return result.stdout


def docker_answers() -> bool:
    if not shutil.which("docker"):
        return False
    try:
        return (
            subprocess.run(
                ["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, timeout=30
            ).returncode
            == 0
        )
    except subprocess.TimeoutExpired:
        return False


def buildah_works() -> bool:
    if not shutil.which("buildah"):
        return False
    return (
        subprocess.run(
            ["buildah", "images", "-q"], capture_output=True, env=builder_env("buildah"), timeout=60
        ).returncode
        == 0
    )


def detect_builder(preference: str = "auto") -> str:
    """ "docker" or "buildah"; "auto" prefers a running Docker daemon (it can also run the image)."""
    if preference not in ("auto", "docker", "buildah"):
        raise StageError(f"builder must be auto, docker or buildah, not {preference!r}")
    if preference in ("auto", "docker") and docker_answers():
        return "docker"
    if preference == "docker":
        raise StageError(f"builder docker: no Docker daemon answers `docker info`; {START_HINT}")
    if buildah_works():
        return "buildah"
    if preference == "buildah":
        raise StageError(
            "builder buildah: `buildah images` fails (apt-get install buildah; "
            "it runs with STORAGE_DRIVER=vfs BUILDAH_ISOLATION=chroot)"
        )
    raise StageError(
        f"no image builder: no Docker daemon answers ({START_HINT}) and buildah is not usable (apt-get install buildah)"
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Every container the pipeline starts (run_container) runs on this Docker network, created --internal: nothing on it is
# forwarded off the host, so a server, or anything it imports, has no route out. Docker publishes no port of a
# container on an internal network (20.10 ignores -p there), so the host reaches the server at the container's own
# address on the bridge, whose gateway address the host holds. enable_icc=false: two servers started side by side
# (the gate's and the lossless reference's) cannot reach each other either. The host's own services stay reachable at
# the gateway address: Docker filters forwarded traffic only.
OFFLINE_NETWORK = "pipeline-offline"
ICC_OPTION = "com.docker.network.bridge.enable_icc"
OFFLINE_NETWORK_OPTIONS = ["--internal", "-o", f"{ICC_OPTION}=false"]
SERVER_PORT = 8080  # the image's entrypoint listens here (serving/launch.py's PORT default)
# Docker's embedded DNS leaves a query for an outside name on an internal network unanswered, so every such lookup
# waited out the resolver's 10 s (torch's c10d looks up its store's client at every vLLM start). A resolv.conf naming
# the container's own loopback, where nothing listens, fails them at once; /etc/hosts names still resolve.
NO_DNS = "nameserver 127.0.0.1\n"


def _inspect_network(name: str) -> dict | None:
    result = subprocess.run(["docker", "network", "inspect", name], capture_output=True, text=True)
    return json.loads(result.stdout)[0] if result.returncode == 0 else None


def host_holds(address: str) -> bool:
    """Whether `address` is one of this host's own: a socket can bind to it only then."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as sock:
            sock.bind((address, 0))
        return True
    except OSError:
        return False


def network_problems(found: dict) -> list[str]:
    """What keeps an existing network from being the offline one (OFFLINE_NETWORK_OPTIONS); [] when nothing does."""
    problems = []
    if not found.get("Internal"):
        problems.append("is not --internal: a container on it has a route out")
    # Docker parses the option as a Go bool; `docker network inspect` shows it as it was given
    if (found.get("Options") or {}).get(ICC_OPTION) not in ("false", "False", "FALSE", "f", "F", "0"):
        problems.append(f"lets its containers reach each other ({ICC_OPTION} is not false)")
    return problems


def offline_network(name: str = OFFLINE_NETWORK) -> str:
    """The name of the internal network every pipeline container runs on, created once (OFFLINE_NETWORK says why).
    A network of that name made otherwise (with a route out, or containers that reach each other) is recreated, or
    refused while containers are attached to it. Refused too when the host holds no address on its bridge (it could
    not reach the server: Docker 25.0.0-25.0.3 gave internal bridges none, rootless Docker keeps its bridge in
    another namespace)."""
    found = _inspect_network(name)
    removal = None
    if found is not None and (problems := network_problems(found)):
        attached = sorted(c.get("Name") or key for key, c in (found.get("Containers") or {}).items())
        if attached:
            raise StageError(
                f"Docker network {name} exists but {' and '.join(problems)}, and cannot be recreated while "
                f"container(s) {', '.join(attached)} are attached to it: stop them and remove it "
                f"(`docker network rm {name}`); the next stage that starts a container creates it as it must be"
            )
        print(f"Docker network {name} {' and '.join(problems)}: recreating it", flush=True)
        removal = subprocess.run(["docker", "network", "rm", name], capture_output=True, text=True)
        found = _inspect_network(name)  # gone, or already recreated by a stage started beside this one
    if found is None:
        create = subprocess.run(
            ["docker", "network", "create", *OFFLINE_NETWORK_OPTIONS, name], capture_output=True, text=True
        )
        found = _inspect_network(name)  # a stage started beside this one may have created it first
        if found is None:
            raise StageError(f"docker network create --internal {name} failed: {create.stderr.strip()[-500:]}")
    if problems := network_problems(found):
        removed = f" (`docker network rm {name}`: {removal.stderr.strip()[-300:] or 'done'})" if removal else ""
        raise StageError(
            f"Docker network {name} exists but {' and '.join(problems)}{removed}. Remove it "
            f"(`docker network rm {name}`); the next stage that starts a container creates it as it must be"
        )
    gateways = [c["Gateway"] for c in (found.get("IPAM") or {}).get("Config") or [] if c.get("Gateway")]
    if not any(host_holds(gateway) for gateway in gateways):
        raise StageError(
            f"this host holds no address on Docker network {name}'s bridge (gateway {gateways or 'none'}), so a "
            "stage cannot reach the server it starts there (Docker 25.0.0-25.0.3 leave internal bridges without "
            "one: upgrade Docker; rootless Docker cannot reach its containers by address: use the system daemon)"
        )
    return name


def container_address(name: str, network: str) -> str:
    """The container's IPv4 address on `network`; "" once it has exited (Docker releases it)."""
    result = subprocess.run(
        [
            "docker",
            "inspect",
            "-f",
            f'{{{{with index .NetworkSettings.Networks "{network}"}}}}{{{{.IPAddress}}}}{{{{end}}}}',
            name,
        ],
        capture_output=True,
        text=True,
    )
    return result.stdout.strip() if result.returncode == 0 else ""


def bypass_proxy(address: str) -> None:
    """A host with http_proxy set would send requests for the container through the proxy, which cannot reach an
    internal bridge: every client the stages use (urllib, requests, aiohttp) skips hosts listed in no_proxy."""
    for key in ("no_proxy", "NO_PROXY"):
        listed = [entry for entry in os.environ.get(key, "").split(",") if entry]
        if address not in listed:
            os.environ[key] = ",".join([*listed, address])


def stored_image_id(ref: str, builder: str = "docker") -> str | None:
    """The ID the builder's store gives `ref` (a tag or an ID), or None when it holds no such image."""
    return image_id(ref, builder) if image_exists(ref, builder) else None


RERUN_BUILD = "rerun build_image (`snakemake ... -R build_image`), which records the image its tag names then"


def recorded_image(image: dict, inspect: Callable[[str], str | None] | None = None) -> str:
    """The ID build_image recorded in `image` (its image.json), which the stages after it run and tarball saves:
    refused when the store no longer holds it, or when its tag now names another image (a later build, a
    `docker tag`), since what a stage measured or gated would not be what tarball ships. `inspect`: ref -> ID or
    None, by default the recording builder's store (stored_image_id)."""
    builder = image["builder"]  # the store build_image handed the image to
    inspect = inspect or (lambda ref: stored_image_id(ref, builder))
    recorded, ref = image["id"], image["ref"]
    if inspect(recorded) is None:
        raise StageError(
            f"build_image recorded image {recorded} for {ref}, but {builder}'s store no longer holds it (removed or "
            f"pruned; {ref} names {inspect(ref) or 'no image'} now): {RERUN_BUILD}"
        )
    now = inspect(ref)
    if now != recorded:
        raise StageError(
            f"{ref} now names image {now or '(none: the tag is gone)'}, not {recorded}, the one build_image "
            f"recorded (another build or a `docker tag` moved it): {RERUN_BUILD}"
        )
    return recorded


def last_log_line(text: str) -> str:
    """The last non-empty line of a log tail (what vLLM is busy with), shortened for a progress line."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1][:200] if lines else "(no output yet)"


def wait_for_ping(
    base_url: str,
    timeout_s: float,
    alive: Callable[[], bool] | None = None,
    logs: Callable[[], str] | None = None,
    interval_s: float = 1.0,
    last_line: Callable[[], str] | None = None,
    what: str = "the server",
) -> float:
    """Poll GET {base_url}/ping until it answers 200; return the seconds it took.

    Every PROGRESS_INTERVAL_S it prints what it waits for, how long it has, and the server's last log line
    (last_line(), else the last line of logs())."""
    start = time.monotonic()
    deadline = start + timeout_s
    last = "no answer yet"

    def progress(seconds: float) -> str:
        source = last_line() if last_line else last_log_line(logs()) if logs else "(no log)"
        return (
            f"[wait_for_ping] waiting for {what} to answer {base_url}/ping: {elapsed(seconds)} of "
            f"{timeout_s:g} s (last answer: {last}); last log line: {source}"
        )

    with Heartbeat(progress):
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            # a per-request timeout: a server that accepts but never answers must not hang us
            status, text, _ = request(base_url, "/ping", timeout_s=max(0.2, min(5.0, remaining)))
            if status == 200:
                return time.monotonic() - start
            last = f"HTTP {status}" if status else text  # status 0: refused, reset, timed out while it starts
            if alive is not None and not alive():
                raise StageError(
                    f"container exited after {time.monotonic() - start:.0f} s without answering "
                    f"/ping; last container log lines:\n{logs() if logs else '(none)'}"
                )
            time.sleep(max(0.0, min(interval_s, deadline - time.monotonic())))
    raise StageError(
        f"server never answered /ping within {timeout_s:g} s (last: {last}); last container "
        f"log lines:\n{logs() if logs else '(none)'}"
    )


class RunningContainer:
    """A container run_container started: `image` the reference it ran, `network` the network it runs on."""

    def __init__(self, name: str, address: str, port: int = SERVER_PORT, network: str | None = None, image=None):
        self.name, self.address, self.port, self.network, self.image = name, address, port, network, image
        self.base_url = f"http://{address}:{port}"

    def logs(self, tail: int = 40) -> str:
        result = subprocess.run(["docker", "logs", "--tail", str(tail), self.name], capture_output=True, text=True)
        return (result.stdout + result.stderr).strip() or "(no output)"

    def alive(self) -> bool:
        result = subprocess.run(
            ["docker", "inspect", "-f", "{{.State.Running}}", self.name], capture_output=True, text=True
        )
        return result.stdout.strip() == "true"

    def failure_summary(self, tail: int = 25) -> str:
        """The log's distinct error lines (the root cause is often far above the tail), then its tail."""
        full = self.logs(tail=100000).splitlines()
        errors = list(dict.fromkeys(line for line in full if re.search(r"\w+(Error|Exception): ", line)))[-8:]
        return "\n".join(["error lines:", *errors, "", "last lines:", *full[-tail:]] if errors else full[-tail:])

    def wait_ready(self, timeout_s: float) -> float:
        return wait_for_ping(
            self.base_url,
            timeout_s,
            alive=self.alive,
            logs=self.failure_summary,
            last_line=lambda: last_log_line(self.logs(tail=5)),
            what=f"container {self.name}",
        )

    def exec(self, cmd: Sequence[str], timeout_s: float = 60) -> subprocess.CompletedProcess:
        """`docker exec` in the running container; the completed process (never raises on a non-zero exit)."""
        return subprocess.run(["docker", "exec", self.name, *cmd], capture_output=True, text=True, timeout=timeout_s)


# What a bake records when the container has no GPU (the tiny profile's CPU build): its cache is for the CPU.
CPU_ARCH = "cpu"
GPU_QUERY = ["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"]
TORCH_QUERY = [
    "python3",
    "-c",
    "import torch; d = torch.cuda.get_device_properties(0); print(f'{d.name}, {d.major}.{d.minor}')",
]


def parse_gpu_query(text: str) -> dict:
    """{name, compute_capability, arch} from `name, X.Y` lines (nvidia-smi's csv, or TORCH_QUERY's); every GPU of
    the container must be of one architecture (a compile cache is built for one)."""
    gpus = []
    for line in text.strip().splitlines():
        name, _, cap = line.rpartition(",")
        found = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", cap)
        if not name.strip() or not found:
            raise StageError(f"cannot read a GPU name and compute capability from {line!r} (expected 'NAME, X.Y')")
        gpus.append(
            {
                "name": name.strip(),
                "compute_capability": f"{found.group(1)}.{found.group(2)}",
                "arch": f"sm_{found.group(1)}{found.group(2)}",
            }
        )
    if not gpus:
        raise StageError(f"no GPU listed in {text!r}")
    archs = sorted({g["arch"] for g in gpus})
    if len(archs) > 1:
        raise StageError(
            f"the container sees GPUs of several architectures ({', '.join(archs)}: "
            f"{[g['name'] for g in gpus]}); bake on one kind of GPU"
        )
    return gpus[0]


def container_gpu(container: "RunningContainer", gpus: bool) -> dict:
    """The GPU the container computes on: nvidia-smi inside it, else torch inside it. Without --gpus, the CPU."""
    if not gpus:
        return {"name": None, "compute_capability": None, "arch": CPU_ARCH}
    tried = []
    for cmd in (GPU_QUERY, TORCH_QUERY):
        try:
            result = container.exec(cmd)
        except (OSError, subprocess.TimeoutExpired) as error:
            tried.append(f"`{' '.join(cmd[:2])}`: {error}")
            continue
        if result.returncode == 0 and result.stdout.strip():
            return parse_gpu_query(result.stdout)
        output = (result.stderr or result.stdout).strip()[-300:]
        tried.append(f"`{' '.join(cmd[:2])}` exit {result.returncode}: {output}")
    raise StageError(
        f"container {container.name} runs with --gpus all but neither nvidia-smi nor torch in it names "
        "its GPU, so the compile cache's architecture is unknown:\n  " + "\n  ".join(tried)
    )


# The memory bandwidth of the device the server computes on, measured in the container after the probe, so the
# summary can set each variant's bytes per decode step against the probing hardware's own floor (the contract's
# A10G is the other). A torch copy between two 256 MiB buffers (bytes read + written, as gpu_proof/bandwidth.py
# counts; larger than any GPU's L2), the best of 3 timed rounds; small enough to fit beside the server's memory.
BANDWIDTH_QUERY = [
    "python3",
    "-c",
    "import json, time, torch\n"
    "cuda = torch.cuda.is_available()\n"
    "sync = torch.cuda.synchronize if cuda else (lambda: None)\n"
    "n, repeats = 256 << 20, (50 if cuda else 5)\n"
    "a = torch.ones(n, dtype=torch.uint8, device='cuda' if cuda else 'cpu'); b = torch.empty_like(a)\n"
    "b.copy_(a); sync(); best = 0.0\n"
    "for _ in range(3):\n"
    "    t = time.perf_counter()\n"
    "    for _ in range(repeats): b.copy_(a)\n"
    "    sync(); best = max(best, 2 * n * repeats / (time.perf_counter() - t) / 1e9)\n"
    "print(json.dumps({'device': torch.cuda.get_device_name(0) if cuda else 'cpu', 'gbps': round(best, 2), "
    "'buffer_bytes': n, 'repeats': repeats, 'threads': torch.get_num_threads()}))\n",
]


def container_bandwidth(container: "RunningContainer") -> dict:
    """BANDWIDTH_QUERY's measurement in the running container: {device, gbps, buffer_bytes, repeats, threads}."""
    try:
        result = container.exec(BANDWIDTH_QUERY, timeout_s=120)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise StageError(f"measuring memory bandwidth in container {container.name} failed: {error}") from error
    try:
        measured = json.loads(result.stdout.strip().splitlines()[-1]) if result.returncode == 0 else None
    except (ValueError, IndexError):
        measured = None
    if not measured or not measured.get("gbps", 0) > 0:
        output = (result.stderr or result.stdout).strip()[-500:]
        raise StageError(
            f"measuring memory bandwidth in container {container.name} (`python3 -c` with torch) gave no "
            f"result (exit {result.returncode}): {output}"
        )
    return measured


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@contextmanager
def run_container(
    image: str,
    *,
    volumes: Sequence[str] = (),
    env: dict[str, str] | None = None,
    gpus: bool = False,
    shm_size: str = "1g",
    name_prefix: str = "pipeline",
    args: Sequence[str] = (),
    docker_args: Sequence[str] = (),
) -> Iterator[RunningContainer]:
    """`docker run -d` the image on offline_network(), reached at its address there on SERVER_PORT; always
    `docker rm -f` it on exit.

    volumes are "HOST:CONTAINER[:ro]" strings. vLLM needs more /dev/shm than Docker's 64 MB default.
    """
    if not docker_answers():
        raise StageError("running the image needs a Docker daemon (buildah can build but not run it); " + START_HINT)
    network = offline_network()
    # a name known before `docker run`, so an interrupt during the run itself still finds the container
    name = f"{name_prefix}-{os.getpid()}-{secrets.token_hex(3)}"
    dns_dir = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    (dns_dir / "resolv.conf").write_text(NO_DNS)
    dns_dir.chmod(0o755)
    (dns_dir / "resolv.conf").chmod(0o644)
    cmd = ["docker", "run", "-d", "--name", name, "--network", network, "--shm-size", shm_size]
    cmd += ["-v", f"{dns_dir / 'resolv.conf'}:/etc/resolv.conf:ro"]
    if gpus:
        cmd += ["--gpus", "all"]
    for volume in volumes:
        cmd += ["-v", volume]
    for key, value in (env or {}).items():
        cmd += ["-e", f"{key}={value}"]
    cmd += [*docker_args, image, *args]
    # Snakemake stops jobs with SIGTERM, which would skip `finally` and leak a running server
    previous = None
    try:
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    except ValueError:  # not the main thread: leave signals alone
        pass
    try:
        run(cmd, what=f"docker run {image}")
        address = container_address(name, network)
        if not address:
            box = RunningContainer(name, "", network=network, image=image)
            raise StageError(
                f"container {name} of {image} exited before it had an address on {network}; last container "
                f"log lines:\n{box.failure_summary()}"
            )
        bypass_proxy(address)
        yield RunningContainer(name, address, network=network, image=image)
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)
        shutil.rmtree(dns_dir, ignore_errors=True)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def image_exists(ref: str, builder: str = "docker") -> bool:
    cmd = ["docker", "image", "inspect", ref] if builder == "docker" else ["buildah", "inspect", "--type", "image", ref]
    return subprocess.run(cmd, capture_output=True, env=builder_env(builder)).returncode == 0


def image_id(ref: str, builder: str = "docker") -> str:
    """The image's config digest, "sha256:<hex>" for both builders."""
    if builder == "docker":
        out = run(["docker", "image", "inspect", "-f", "{{.Id}}", ref], what=f"docker image inspect {ref}")
    else:
        out = run(
            ["buildah", "inspect", "--type", "image", "-f", "{{.FromImageID}}", ref],
            builder="buildah",
            what=f"buildah inspect {ref}",
        )
    out = out.strip()
    return out if out.startswith("sha256:") else f"sha256:{out}"


def image_size(ref: str, builder: str = "docker") -> int | None:
    """Unpacked size in bytes (Docker only; None for buildah)."""
    if builder != "docker":
        return None
    return int(run(["docker", "image", "inspect", "-f", "{{.Size}}", ref], what=f"docker image inspect {ref}"))


def buildah_name(ref: str) -> str:
    """The name a base is kept under in buildah's store: buildah cannot tag a digest, so the digest goes
    (the image ID is checked instead) and a digest-only ref gets the tag `pinned`."""
    name = ref.split("@", 1)[0]
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:pinned"


def base_into_buildah(base: dict) -> str:
    """Copy the Docker-store base (base["id"]) into buildah's store once; return the name to build FROM.
    base_image makes this copy (about 80 s on 2 cores), so build_image finds it there; build_image still makes it
    when it is missing.

    Copied by ID: Docker has no tag for a base pulled by digest. A stale copy under the same name (the base was
    rebuilt) is removed so that a rebuilt base does not leave a dead copy of several GB behind."""
    name = buildah_name(base["ref"])
    if image_exists(name, "buildah"):
        if image_id(name, "buildah") == base["id"]:
            return name
        subprocess.run(["buildah", "rmi", image_id(name, "buildah")], capture_output=True, env=builder_env("buildah"))
    t = time.monotonic()
    run(
        ["buildah", "pull", "-q", f"docker-daemon:{base['id']}"],
        builder="buildah",
        what=f"buildah pull docker-daemon:{base['id']} (the base {base['ref']})",
    )
    run(["buildah", "tag", base["id"].removeprefix("sha256:"), name], builder="buildah", what=f"buildah tag {name}")
    # the pull named it docker.io/library/sha256:<hex>; only our name stays
    subprocess.run(
        ["buildah", "rmi", f"docker.io/library/sha256:{base['id'].removeprefix('sha256:')}"],
        capture_output=True,
        env=builder_env("buildah"),
    )  # an image with another name is only untagged
    if image_id(name, "buildah") != base["id"]:
        raise StageError(
            f"buildah's copy of the base {name} has id {image_id(name, 'buildah')}, not Docker's {base['id']}"
        )
    print(f"copied base {base['ref']} ({base['id']}) from Docker to buildah: {time.monotonic() - t:.0f} s", flush=True)
    return name


def gzip_command(compress_level: int) -> list[str]:
    """pigz on at least two threads: it compresses fixed 128 KiB blocks, so its bytes are the same for any thread
    count from two up (one thread takes another path), on 2 cores or 64; -n leaves name and time out of the header.
    About 2.5x gzip's speed on 2 cores for the tiny image."""
    pigz = shutil.which("pigz")
    if pigz is None:
        raise StageError(
            "pigz is not installed (apt-get install pigz; setup/install.sh does): image.tar.gz is compressed with "
            "pigz so that the same image gives the same bytes on every machine"
        )
    return [pigz, "-n", f"-{int(compress_level)}", "-p", str(max(2, os.cpu_count() or 2))]


def save_image(ref: str, out_path: str | Path, builder: str = "docker", compress_level: int = 1) -> Path:
    """Write a gzipped docker-archive (loadable by `docker load`) of ref to out_path (gzip_command: identical images
    give identical bytes). Written to a .partial file first: an interrupted save never leaves a file a rerun would
    trust."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    partial = out_path.with_name(out_path.name + ".partial")
    raw = out_path.with_name(out_path.name + ".tar.partial")
    compress = gzip_command(compress_level)
    try:
        with open(partial, "wb") as sink:
            if builder == "docker":
                save = subprocess.Popen(["docker", "save", ref], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                gzip = subprocess.Popen(compress, stdin=save.stdout, stdout=sink)
                save.stdout.close()  # the compressor owns the pipe now: docker save sees EPIPE if it dies
                save_err = save.stderr.read().decode(errors="replace")
                if save.wait() != 0:
                    gzip.wait()
                    raise StageError(f"docker save {ref} failed: {save_err.strip()[-2000:]}")
                if gzip.wait() != 0:
                    raise StageError(f"compressing {ref} failed (disk full?)")
            else:
                raw.unlink(missing_ok=True)
                run(
                    ["buildah", "push", ref, f"docker-archive:{raw}:{ref}"],
                    builder="buildah",
                    what=f"buildah push {ref}",
                )
                with open(raw, "rb") as source:
                    if subprocess.run(compress, stdin=source, stdout=sink).returncode != 0:
                        raise StageError(f"compressing {ref} failed (disk full?)")
        partial.replace(out_path)
    finally:
        partial.unlink(missing_ok=True)
        raw.unlink(missing_ok=True)
    return out_path
