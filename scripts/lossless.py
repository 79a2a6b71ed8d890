"""Refuse a speculative variant whose greedy outputs differ from the same settings without speculation.

For every prompt set and category the latency probe recorded, the first timed run's greedy ids (temperature 0),
and the ids of each request of its concurrent batch, must equal the reference's for the same prompt: the variant's
own image served again with speculation off (scripts/lossless_reference.py). At a near tie of the reference's own
logprobs the comparison goes on against the reference's continuation from the speculative output's own prefix,
which rule lossless_reference (or lossless_continuations, for a shared reference) recorded for this variant
(lib/lossless.py). A variant without speculation passes with nothing to compare.

The result is recorded in results/<variant>/lossless/lossless.json (schemas/lossless.schema.yaml). A refused
variant that select may choose among (one of select.candidates) is recorded with passed: false, in either select
mode, so a sweep goes on without it (select skips it and says why; tarball refuses it); any other refused variant
fails this stage with the set, category, first differing position and both ids.
"""

import json
from pathlib import Path

from lib.lossless import compare, failures, recorded_continuations
from lib.stage import StageError, validate_json, write_json


def check(
    record: dict | None,
    reference: dict | None,
    speculative: dict,
    reference_kind: str | None,
    continue_after=None,
    require_batch: bool = False,
) -> dict:
    """The lossless.json record for one variant (passed, the rows compared, what the reference was).
    continue_after, require_batch: see lib.lossless.compare (the stage passes the reference's recorded continuations
    and requires the concurrent batch)."""
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
    rows = compare(record, reference, continue_after, require_batch)
    lost = failures(rows)
    compared = sum(row["tokens"] or 0 for row in rows)
    ties = [(row, tie) for row in rows for tie in row["near_ties"]]
    continued = sum(len(row["continuations"]) for row in rows)
    unchecked = sum(row["unchecked_after"] is not None for row in rows)
    reason = (
        f"greedy ids equal without speculation for all {len(rows)} set/category pairs ({compared} tokens)"
        + (
            f", near ties passed: {len(ties)} in {len({id(row) for row, _ in ties})} of them (first: "
            f"{ties[0][0]['set']}/{ties[0][0]['category']} at output token {ties[0][1]['position']}, margin "
            f"{ties[0][1]['margin']} nats), the reference continued from the speculative prefix {continued} times"
            if ties
            else ""
        )
        + (f"; {unchecked} compared only up to a near tie (no continuation asked)" if unchecked else "")
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
    continuations = None
    if record is not None:
        # the reference's continuations past this variant's near ties (lossless_reference's or lossless_continuations')
        made = json.loads(Path(job.input.continuations).read_text()).get("continuations") or {}
        continuations = made.get(job.wildcards.variant)
        if continuations is None:
            raise StageError(
                f"{job.input.continuations} has no continuations for {job.wildcards.variant} (made for "
                f"{sorted(made)}): rerun the rule that made it"
            )
    result = check(
        record,
        reference,
        speculative,
        job.params.reference_kind,
        continue_after=recorded_continuations(continuations) if continuations is not None else None,
        require_batch=True,
    )
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
