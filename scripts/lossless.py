"""Refuse a speculative variant whose greedy outputs differ from the same settings without speculation.

For every prompt set and category the latency probe recorded, the first timed run's greedy ids (temperature 0)
must equal the reference's for the same prompt: the variant's own image served again with speculation off
(scripts/lossless_reference.py), up to a near tie of the reference's own logprobs (lib/lossless.py). A variant
without speculation passes with nothing to compare.

The result is recorded in results/<variant>/lossless/lossless.json (schemas/lossless.schema.yaml). A refused
variant that select may choose among (one of select.candidates) is recorded with passed: false, in either select
mode, so a sweep goes on without it (select skips it and says why; tarball refuses it); any other refused variant
fails this stage with the set, category, first differing position and both ids.
"""

import json
from pathlib import Path

from lib.lossless import compare, failures
from lib.stage import StageError, validate_json, write_json


def check(record: dict | None, reference: dict | None, speculative: dict, reference_kind: str | None) -> dict:
    """The lossless.json record for one variant (passed, the rows compared, what the reference was)."""
    method = speculative["method"]
    if method == "none":
        return {
            "passed": True,
            "method": method,
            "k": 0,
            "reference": None,
            "reason": "no speculation: nothing to compare",
            "rows": [],
            "failures": [],
        }
    rows = compare(record, reference)
    lost = failures(rows)
    compared = sum(row["tokens"] or 0 for row in rows)
    ties = [row for row in rows if row["near_tie"]]
    reason = (
        f"greedy ids equal without speculation for all {len(rows)} set/category pairs ({compared} tokens)"
        + (
            f", {len(ties)} of them up to a near tie (first: {ties[0]['set']}/{ties[0]['category']} at output "
            f"token {ties[0]['near_tie']['position']}, margin {ties[0]['near_tie']['margin']} nats)"
            if ties
            else ""
        )
        if not lost
        else f"{len(lost)} of {len(rows)} set/category pairs differ; first: {lost[0]}"
    )
    return {
        "passed": not lost,
        "method": method,
        "k": int(speculative.get("k") or 0),
        "reference": reference_kind,
        "reason": reason,
        "rows": rows,
        "failures": lost,
    }


def main(job) -> None:
    speculative = job.params.speculative
    reference_path = getattr(job.input, "reference", None)
    record = json.loads(Path(job.input.latency).read_text()) if getattr(job.input, "latency", None) else None
    reference = json.loads(Path(reference_path).read_text()) if reference_path else None
    result = check(record, reference, speculative, job.params.reference_kind)
    result["variant"] = job.wildcards.variant
    validate_json(result, job.input.schema)
    if not result["passed"]:
        message = (
            f"variant {job.wildcards.variant} ({speculative['method']}, K={speculative.get('k')}) is not "
            f"lossless against {job.params.reference_kind}:\n  " + "\n  ".join(result["failures"])
        )
        if job.params.fatal:
            raise StageError(message)
        print(f"[lossless] {message}\nrecorded as passed: false (select skips it, tarball refuses it)", flush=True)
    else:
        print(f"[lossless] {job.wildcards.variant}: {result['reason']}", flush=True)
    write_json(job.output.lossless, result)


if __name__ == "__main__":
    from lib.stage import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
