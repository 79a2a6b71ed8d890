import hashlib
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

import tarball
from lib.containers import recorded_image
from lib.stage import StageError


def fake_job(tmp_path, monkeypatch, payload: bytes, max_size_gb: float):
    image = tmp_path / "image.json"
    image.write_text(
        json.dumps(
            {
                "ref": "docker.io/library/x:1",
                "id": "sha256:ab",
                "builder": "docker",
                "labels": {"io.qwen35-serve.variant": "1"},
            }
        )
    )
    store = {"docker.io/library/x:1": "sha256:ab", "sha256:ab": "sha256:ab"}  # the builder's store: ref -> ID
    monkeypatch.setattr(tarball, "recorded_image", lambda image: recorded_image(image, inspect=store.get))
    monkeypatch.setattr(tarball, "save_image", lambda ref, out, builder, level: Path(out).write_bytes(payload))
    # the payload is no docker-archive: verify_image's own tests cover the check; here only its outcome counts
    monkeypatch.setattr(
        tarball,
        "verify_archive",
        lambda path, ref, labels, image_id: {
            "seconds": 0.0,
            "archive_sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest(),
        },
    )
    quality = tmp_path / "quality.json"
    quality.write_text(json.dumps({"passed": True, "image": "docker.io/library/x:1", "tasks": []}))
    lossless = tmp_path / "lossless.json"
    lossless.write_text(
        json.dumps(
            {
                "variant": "1",
                "passed": True,
                "method": "none",
                "k": 0,
                "reference": None,
                "reason": "no speculation",
                "rows": [],
                "failures": [],
            }
        )
    )
    out = tmp_path / "out"
    out.mkdir()
    return NS(
        input=NS(image=str(image), quality=str(quality), lossless=str(lossless)),
        params=NS(max_size_gb=max_size_gb, compress_level=1),
        output=NS(tarball=str(out / "image.tar.gz"), sha256=str(out / "image.tar.gz.sha256")),
    ), out


def test_refuses_an_oversized_tarball_and_leaves_nothing(tmp_path, monkeypatch):
    job, out = fake_job(tmp_path, monkeypatch, b"x" * 5000, max_size_gb=1e-6)  # limit: 1000 bytes
    with pytest.raises(StageError, match="over the limit of 1e-06 GB"):
        tarball.main(job)
    assert list(out.iterdir()) == []


def test_writes_a_checkable_sha256(tmp_path, monkeypatch):
    job, out = fake_job(tmp_path, monkeypatch, b"x" * 500, max_size_gb=1e-6)
    tarball.main(job)
    assert sorted(p.name for p in out.iterdir()) == ["image.tar.gz", "image.tar.gz.sha256"]
    check = subprocess.run(["sha256sum", "-c", "image.tar.gz.sha256"], cwd=out, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_refuses_an_image_that_is_gone(tmp_path, monkeypatch):
    job, out = fake_job(tmp_path, monkeypatch, b"x", max_size_gb=1)
    monkeypatch.setattr(tarball, "recorded_image", lambda image: recorded_image(image, inspect=lambda ref: None))
    with pytest.raises(StageError, match="sha256:ab .*no longer holds it.*-R build_image"):
        tarball.main(job)
    assert list(out.iterdir()) == []


def test_an_archive_that_fails_verification_is_deleted_without_a_sha256(tmp_path, monkeypatch):
    job, out = fake_job(tmp_path, monkeypatch, b"x" * 500, max_size_gb=1)
    seen = {}

    def refuse(path, ref, labels, image_id):
        seen.update(ref=ref, labels=labels, image_id=image_id)
        raise StageError(f"{path} failed verification:\n  - label io.qwen35-serve.variant is missing")

    monkeypatch.setattr(tarball, "verify_archive", refuse)
    with pytest.raises(StageError, match="failed verification"):
        tarball.main(job)
    assert list(out.iterdir()) == []
    assert seen == {"ref": "docker.io/library/x:1", "labels": {"io.qwen35-serve.variant": "1"}, "image_id": "sha256:ab"}


def test_an_image_json_without_labels_asks_for_a_rebuild(tmp_path, monkeypatch):
    job, out = fake_job(tmp_path, monkeypatch, b"x", max_size_gb=1)
    image = json.loads(Path(job.input.image).read_text())
    del image["labels"]
    Path(job.input.image).write_text(json.dumps(image))
    with pytest.raises(StageError, match="records no labels.*-R build_image"):
        tarball.main(job)
    assert list(out.iterdir()) == []
