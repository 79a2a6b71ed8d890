"""Rank the select candidates by their latency probes (select.mode fastest): results/ranking.json, the order the
`select` checkpoint checks them in (scripts/lib/selection.py, schemas/ranking.schema.yaml). Fastest first by select.by
on the competition's prompt set; each one's fresh-prompt speed and place beside it."""

import json
from pathlib import Path

from lib.selection import rank, speed_text
from lib.stage import validate_json, write_json


def main(job) -> None:
    paths = zip(job.params.candidates, job.input.latency, strict=True)  # the rule lists them in one order
    latencies = {name: json.loads(Path(path).read_text()) for name, path in paths}
    ranking = rank(latencies, job.params.by)
    validate_json(ranking, job.input.schema)
    write_json(job.output.ranking, ranking)
    for row in ranking["candidates"]:
        print(f"{row['rank']}. {row['variant']}: {speed_text(row, ranking['by'])}")


if __name__ == "__main__":
    from lib.stage import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
