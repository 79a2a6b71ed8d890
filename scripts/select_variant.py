"""Pick the variant image.tar.gz is made of: the fastest compared variant that passes every gate.

Ranked on the competition's prompt set (the repeated sentence); the reason also gives the fresh-prompt speed,
which is what a new user sees, and says when another variant would win on it.

Gates: the quality gate (quality.json `passed`) and the lossless check (lossless.json `passed`: greedy outputs
equal without speculation); the quantize guards and the probe already stopped a broken
variant before it got here, and tarball checks size and the archive. The choice and its reason are recorded
in results/selection.json (schemas/selection.schema.yaml).
"""

import json
from pathlib import Path

from lib.stage import StageError, validate_json, write_json


def speed(row: dict, by: str) -> float:
    """Larger is faster."""
    if by == "mean_speedup":
        if row["mean_speedup_vs_baseline"] is None:
            raise StageError(
                f"select.by mean_speedup needs every probe category's baseline_ms (config probe."
                f"categories); {row['variant']} has none. Set select.by: geomean_latency_ms"
            )
        return row["mean_speedup_vs_baseline"]
    return -row["geomean_latency_ms"]


def fresh(row: dict) -> dict:
    return row.get("prompt_sets", {}).get("fresh") or {}


def speed_text(row: dict, by: str) -> str:
    """The row's speed on the competition's prompts, and on fresh prompts beside it (the gap select does not rank)."""
    if by == "mean_speedup":
        text = "mean speedup {:.3f}".format(row["mean_speedup_vs_baseline"])
        fresh_value = fresh(row).get("mean_speedup_vs_baseline")
        other = f"{fresh_value:.3f}" if fresh_value is not None else None
    else:
        text = "geomean latency {:.0f} ms".format(row["geomean_latency_ms"])
        fresh_value = fresh(row).get("geomean_latency_ms")
        other = f"{fresh_value:.0f} ms" if fresh_value is not None else None
    if other is None:
        return text + " on the competition's repeated prompts; fresh prompts not probed"
    return f"{text} on the competition's repeated prompts, {other} on fresh prompts"


def lossless_refusal(record: dict | None) -> str | None:
    """Why the lossless check refused a variant (its first failure), or None when it passed (or was not given)."""
    if record is None or record["passed"]:
        return None
    return f"not lossless against {record['reference']}: {record['failures'][0]}"


def choose(summary: dict, by: str, lossless: dict[str, dict] | None = None) -> dict:
    """Ranks by the competition's prompt set (the top-level speed fields); the reason names the fresh-prompt speed.
    `lossless`: each variant's lossless.json; a variant whose greedy outputs change with speculation is skipped."""
    lossless = lossless or {}
    rows = summary["variants"]
    refused = {row["variant"]: lossless_refusal(lossless.get(row["variant"])) for row in rows}
    refused = {name: why for name, why in refused.items() if why}
    passing = [row for row in rows if row["gate_passed"] and row["variant"] not in refused]
    candidates = [
        {
            "variant": row["variant"],
            "gate_passed": row["gate_passed"],
            "gate_failures": row["gate_failures"],
            "lossless_refusal": refused.get(row["variant"]),
            "mean_speedup_vs_baseline": row["mean_speedup_vs_baseline"],
            "geomean_latency_ms": row["geomean_latency_ms"],
            "fresh_mean_speedup_vs_baseline": fresh(row).get("mean_speedup_vs_baseline"),
            "fresh_geomean_latency_ms": fresh(row).get("geomean_latency_ms"),
        }
        for row in rows
    ]
    if not passing:
        failures = "; ".join(
            f"{row['variant']}: {refused.get(row['variant']) or ', '.join(row['gate_failures'])}" for row in rows
        )
        raise StageError(
            f"no compared variant passes the quality gate and the lossless check ({failures}); nothing to ship"
        )
    # ties: the earlier variant in compare.variants order
    ranked = sorted(passing, key=lambda row: -speed(row, by))
    best = ranked[0]
    reason = f"fastest by {by} ({speed_text(best, by)}) of {len(passing)} variants passing every gate"
    if len(ranked) > 1:
        runner = ranked[1]
        reason += f"; next: {runner['variant']} ({speed_text(runner, by)})"
        if all(fresh(row) for row in passing):
            on_fresh = max(
                passing,
                key=lambda row: (
                    fresh(row)["mean_speedup_vs_baseline"]
                    if by == "mean_speedup"
                    else -fresh(row)["geomean_latency_ms"]
                ),
            )  # ties: the earlier
            if on_fresh["variant"] != best["variant"]:
                reason += f"; on fresh prompts {on_fresh['variant']} would be the fastest"
    failed = [row["variant"] for row in rows if not row["gate_passed"]]
    if failed:
        reason += f"; failed the gate: {', '.join(failed)}"
    if refused:
        reason += "; refused by the lossless check: " + "; ".join(f"{name} ({why})" for name, why in refused.items())
    return {"mode": "fastest", "by": by, "variant": best["variant"], "reason": reason, "candidates": candidates}


def main(job) -> None:
    summary = json.loads(Path(job.input.summary).read_text())
    records = [json.loads(Path(path).read_text()) for path in job.input.lossless]
    selection = choose(summary, job.params.by, {record["variant"]: record for record in records})
    validate_json(selection, job.input.schema)
    write_json(job.output.selection, selection)
    print(f"selected {selection['variant']}: {selection['reason']}")


if __name__ == "__main__":
    from lib.stage import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
