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
