"""Rank the select candidates by their latency probes (select.mode fastest): results/ranking.json, the order the
`select` checkpoint checks them in (scripts/lib/dag/selection.py, schemas/ranking.schema.yaml). Fastest first by
select.by on the competition's prompt set; each one's fresh-prompt speed and place beside it. A mean speedup is against
the run's same-host bf16 variant (its latency record an input of the rule) when it has one, else against baseline_ms."""

import json
from pathlib import Path

from lib.dag.selection import rank, speed_text
from lib.stage import StageError, validate_json, write_json


def main(job) -> None:
    paths = zip(job.params.candidates, job.input.latency, strict=True)  # the rule lists them in one order
    latencies = {name: json.loads(Path(path).read_text()) for name, path in paths}
    bf16 = None
    if job.params.bf16_reference:
        if len(job.input.bf16_reference) != 1:
            raise StageError(
                f"rank_candidates: bf16_reference {job.params.bf16_reference} needs its one latency record"
            )
        bf16 = (job.params.bf16_reference, json.loads(Path(job.input.bf16_reference[0]).read_text()))
    ranking = rank(latencies, job.params.by, bf16)
    validate_json(ranking, job.input.schema)
    write_json(job.output.ranking, ranking)
    print(f"mean speedups: {ranking['baseline']['text']}")
    for row in ranking["candidates"]:
        print(f"{row['rank']}. {row['variant']}: {speed_text(row, ranking['by'], ranking['baseline'])}")


if __name__ == "__main__":
    from lib.stage import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
