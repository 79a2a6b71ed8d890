"""Write a variant's serve.json: the variant's serve and speculative settings resolved through serving/settings.py,
the table the image's entrypoint uses, so a file the image would refuse is never written."""

from lib.dflash import depth_problems, read_config
from lib.stage import StageError, write_json
from serving.settings import SettingsError, serve_json


def main(job) -> None:
    try:
        checked = serve_json(dict(job.params.serve), dict(job.params.speculative))
    except SettingsError as error:
        raise StageError(f"variant {job.wildcards.variant}: {error}") from None
    draft = getattr(job.input, "draft", None)
    if draft:
        problems = depth_problems(read_config(draft), checked["speculative"]["k"])
        if problems:
            raise StageError(f"variant {job.wildcards.variant}: " + "; ".join(problems))
    write_json(job.output.serve, checked)
    print(f"{job.output.serve}: speculative {checked['speculative']}")


if __name__ == "__main__":
    from lib.stage import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
