"""Submit image.tar.gz through the competition's API (rule submit, not in the default target).

The API's base URL, the team id and the key come from the environment only (lib/submit/submission.py ENV): a missing one
fails before any work. The archive is refused, before any request, unless it is named image.tar.gz, is at most
20 GB, still has its .sha256, and its variant's records say the image ran (verify.json), passed the full quality
gate (quality.json, not limited to a sample) and the lossless check (lossless.json). The flow, its resume from
`image.tar.gz.upload.json` and what is never written are in lib/submit/submission.py.
"""

from lib.stage import StageError, validate_json, write_json
from lib.submit.submission import Settings, credentials_from_env, state_path, submittable_archive, upload_and_submit


def main(job) -> None:
    credentials = credentials_from_env()  # before anything else: a missing variable fails before any work

    def log(message: str) -> None:
        print(credentials.mask(message), flush=True)

    settings = Settings(
        retries=int(job.params.retries),
        retry_wait_s=float(job.params.retry_wait_s),
        timeout_s=float(job.params.timeout_s),
    )
    try:
        archive = submittable_archive(
            job.input.tarball, job.input.sha256, job.input.verify, job.input.quality, job.input.lossless, log
        )
        record = {"variant": archive.variant, **upload_and_submit(archive, credentials, settings, log)}
        validate_json(record, job.input.schema)
        write_json(job.output.record, record)
    except StageError as error:
        raise StageError(credentials.mask(str(error))) from None
    state_path(archive.path).unlink(missing_ok=True)  # the submission is recorded: nothing is left to resume
    log(f"{job.output.record}: submission {record['submission_id']} of variant {archive.variant} recorded")


if __name__ == "__main__":
    from lib.stage import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
