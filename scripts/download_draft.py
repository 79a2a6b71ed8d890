"""download_draft: put a dflash variant's drafter in place, check it fits the target, record its manifest.

source hub (the model's source): a snapshot of the pinned commit, every file checked against the hashes the hub lists
for it (lib/hub.fetch_hub, as download does for the model). source synthetic (the tiny profile): seeded random
weights of model.tiny.drafter's shape for the tiny target (lib/tiny/drafter.py). Either way the drafter must fit the
target (lib/dflash.fit_problems: hidden size, tapped layers, vocabulary, mask token) before it is kept: a drafter
that cannot serve stops the run here, before anything is quantized, baked or built.
"""

from pathlib import Path

from lib.checkpoint import write_checkpoint
from lib.dflash import fit_problems, read_config
from lib.hub import check_revision, fetch_hub
from lib.stage import StageError

SCHEMA = Path(__file__).resolve().parent.parent / "schemas" / "download.schema.yaml"


def build_synthetic(target: str, drafter: dict, dest: Path) -> None:
    import torch

    from lib.tiny.drafter import build_random_drafter

    dims = {key: value for key, value in drafter.items() if key != "seed"}
    with torch.device("cpu"):
        build_random_drafter(dest, target, dims, seed=int(drafter["seed"]))


def checked(fill, target: str, what: str):
    """fill(tmp), then refuse a drafter that does not fit the target (nothing is kept)."""

    def run(tmp: Path) -> dict | None:
        filled = fill(tmp)
        problems = fit_problems(read_config(tmp), read_config(target), what)
        if problems:
            raise StageError("the drafter cannot draft for this target:\n  " + "\n  ".join(problems))
        return filled

    return run


def main(job) -> None:
    params, target = job.params, job.input.target
    repo, revision = params.draft["repo"], params.draft.get("revision")
    if params.source == "hub":
        check_revision(repo, revision)  # fail before touching anything
        fill = lambda tmp: fetch_hub(repo, revision, tmp)  # noqa: E731
    elif params.source == "synthetic":
        fill = lambda tmp: build_synthetic(target, dict(params.tiny), tmp)  # noqa: E731
    else:
        raise StageError(f"params.source must be 'hub' or 'synthetic', got {params.source!r}")
    record = write_checkpoint(
        job.output, checked(fill, target, f"{repo}"), {"source": params.source, "training": None}, SCHEMA
    )
    print(f"download_draft: {repo}: {record['files']} files in {job.output.checkpoint}, fits {target}")


if __name__ == "__main__":
    from lib.stage import run_stage

    run_stage(main, globals().get("snakemake"), __file__, online=True)
