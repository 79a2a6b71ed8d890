"""Upload image.tar.gz to the competition's submission API and submit it (rule submit, not in the default target).

The API's base URL, the team id and the upload key come from the environment only (lib/submission.py ENV); they
never reach config, params, the log, the state file or the record. The client and its endpoint table are in
lib/submission.py; this stage checks the archive against its .sha256, runs the upload (resuming an interrupted
multipart upload from `<tarball>.upload.json`) and records the submission.
"""

import time
from pathlib import Path

from lib.stage import StageError, sha256_file, validate_json, write_json
from lib.submission import Settings, credentials_from_env, read_sha256_file, state_path, upload_and_submit


def settings_from_params(params) -> Settings:
    return Settings(
        part_size=int(float(params.part_size_mb) * 1024 * 1024),
        retries=int(params.retries),
        retry_wait_s=float(params.retry_wait_s),
        timeout_s=float(params.timeout_s),
    )


def checked_digest(tarball: Path, sha256_path: str) -> str:
    """The .sha256's digest, once the archive is found to still have it (a changed archive is never sent)."""
    expected = read_sha256_file(sha256_path)
    started = time.monotonic()
    actual = sha256_file(tarball)
    if actual != expected:
        raise StageError(
            f"{tarball} has sha256 {actual}, not the {expected} of {sha256_path}: the archive changed "
            "after `tarball` wrote it; rerun `snakemake image.tar.gz` (or --forcerun tarball)"
        )
    print(f"{tarball}: sha256 {actual} matches {sha256_path} ({time.monotonic() - started:.0f} s)", flush=True)
    return actual


def main(job) -> None:
    credentials = credentials_from_env()  # before anything else: a missing key fails before any request

    def log(message: str) -> None:
        print(credentials.mask(message), flush=True)

    try:
        tarball = Path(job.input.tarball)
        digest = checked_digest(tarball, job.input.sha256)
        record = upload_and_submit(tarball, digest, credentials, settings_from_params(job.params), log)
        validate_json(record, job.input.schema)
        write_json(job.output.record, record)
    except StageError as error:
        raise StageError(credentials.mask(str(error))) from None
    state_path(tarball).unlink(missing_ok=True)  # the submission is recorded: nothing is left to resume
    log(f"{job.output.record}: submission {record['submission_id']} recorded")


if __name__ == "__main__":
    from lib.stage import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
