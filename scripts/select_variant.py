"""Pick the variant image.tar.gz is made of (select.mode fastest): the fastest candidate that passes the lossless
check and the quality gate, checked fastest first (results/ranking.json) so that no slower one is ever gated.

The `select` checkpoint's inputs are the records of the candidates its walk visited (rules/select.smk): each one's
lossless.json and, where that passed, its quality.json, up to the first that passed both. This stage walks the same
records again (lib.dag.selection.choose) and writes the choice, every candidate's rank, speed and outcome, and the
reason into results/selection.json (schemas/selection.schema.yaml); with no candidate passing it fails naming each
one and why. The ranking is by the competition's prompt set; the reason also gives the fresh-prompt speed and says
when another candidate would be the fastest on it.
"""

import json
from pathlib import Path

from lib.dag.selection import choose
from lib.stage import StageError, validate_json, write_json


def load(path) -> dict:
    return json.loads(Path(path).read_text())


def main(job) -> None:
    visited = list(job.params.visited)  # [variant, gated] in the walk's order; the inputs follow it
    lossless = dict(zip([variant for variant, _ in visited], map(load, job.input.lossless), strict=True))
    for variant, record in lossless.items():
        if record["variant"] != variant:
            raise StageError(f"select was given {record['variant']}'s lossless record for {variant}")
    gated = [variant for variant, was_gated in visited if was_gated]
    quality = dict(zip(gated, map(load, job.input.quality), strict=True))
    selection = choose(load(job.input.ranking), lossless, quality)
    validate_json(selection, job.input.schema)
    write_json(job.output.selection, selection)
    print(f"selected {selection['variant']}: {selection['reason']}")


if __name__ == "__main__":
    from lib.stage import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
