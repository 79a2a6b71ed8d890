"""Export the gated image as image.tar.gz (a gzipped `docker save` archive) plus its sha256.

The archive is verified (lib/docker_archive.py, no daemon) before its .sha256 is written: one that fails
is deleted, so image.tar.gz never stands as a finished output unverified.
"""

import json
import time
from pathlib import Path

from lib.containers import recorded_image, save_image
from lib.docker_archive import load_image_record, verify_archive
from lib.gate import failed_tasks
from lib.stage import StageError, sha256_file


def enforce_size_limit(path: Path, max_size_gb: float) -> int:
    """Size in bytes; deletes the file and raises when it is over the limit (GB = 1e9 bytes)."""
    size = path.stat().st_size
    if size > max_size_gb * 1e9:
        path.unlink()
        raise StageError(
            f"{path} is {size / 1e9:.2f} GB, over the limit of {max_size_gb:g} GB (max_size_gb); "
            "deleted. Shrink the image (fewer packages, pruned vocabulary) or raise the limit"
        )
    return size


def write_sha256(path: Path, sha_path: Path, digest: str | None = None) -> str:
    digest = digest or sha256_file(path)
    partial = sha_path.with_name(sha_path.name + ".partial")
    partial.write_text(f"{digest}  {path.name}\n")  # `sha256sum -c` format, run from the file's folder
    partial.replace(sha_path)
    return digest


def require_passed_gate(quality_path: str) -> None:
    """quality_gate records a failing variant (a sweep goes on without it); it must never be shipped."""
    quality = json.loads(Path(quality_path).read_text())
    if not quality["passed"]:
        raise StageError(
            f"{quality['image']} failed the quality gate ({'; '.join(failed_tasks(quality['tasks']))}): not saved"
        )


def require_lossless(lossless_path: str) -> None:
    """lossless records a variant whose greedy outputs change with speculation (a sweep goes on without it); it
    must never be shipped."""
    lossless = json.loads(Path(lossless_path).read_text())
    if not lossless["passed"]:
        raise StageError(
            f"variant {lossless['variant']} is not lossless ({lossless['method']}, K={lossless['k']}, "
            f"against {lossless['reference']}): {'; '.join(lossless['failures'])}: not saved"
        )


def main(job) -> None:
    require_passed_gate(job.input.quality)
    require_lossless(job.input.lossless)
    image = load_image_record(job.input.image)
    out = Path(job.output.tarball)
    started = time.monotonic()
    recorded_image(image)  # saved by its tag (the archive's RepoTags), which must still name the recorded ID
    save_image(image["ref"], out, image["builder"], int(job.params.compress_level))
    size = enforce_size_limit(out, float(job.params.max_size_gb))
    # the archive's config is the image's own (docker save, and buildah's docker-archive of an OCI image, keep
    # its bytes), so its digest is the built image's ID
    try:
        record = verify_archive(out, image["ref"], image["labels"], image["id"])
    except StageError:
        out.unlink(missing_ok=True)
        raise
    print(f"{out}: verified in {record['seconds']} s", flush=True)
    digest = write_sha256(out, Path(job.output.sha256), record["archive_sha256"])
    print(f"{out}: {size / 1e9:.2f} GB, sha256 {digest}, {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    from lib.stage import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
