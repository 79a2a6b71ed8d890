"""Pick the variant image.tar.gz is made of: the fastest compared variant that passes every gate.

Gates: the quality gate (quality.json `passed`); the quantize guards and the probe already stopped a broken
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
            raise StageError(f"select.by mean_speedup needs every probe category's baseline_ms (config probe."
                             f"categories); {row['variant']} has none. Set select.by: geomean_latency_ms")
        return row["mean_speedup_vs_baseline"]
    return -row["geomean_latency_ms"]


def choose(summary: dict, by: str) -> dict:
    rows = summary["variants"]
    passing = [row for row in rows if row["gate_passed"]]
    candidates = [{"variant": row["variant"], "gate_passed": row["gate_passed"],
                   "gate_failures": row["gate_failures"], "mean_speedup_vs_baseline": row["mean_speedup_vs_baseline"],
                   "geomean_latency_ms": row["geomean_latency_ms"]} for row in rows]
    if not passing:
        failures = "; ".join(f"{row['variant']}: {', '.join(row['gate_failures'])}" for row in rows)
        raise StageError(f"no compared variant passes the quality gate ({failures}); nothing to ship")
    # ties: the earlier variant in compare.variants order
    ranked = sorted(passing, key=lambda row: -speed(row, by))
    best = ranked[0]
    value = ("mean speedup {:.3f}".format(best["mean_speedup_vs_baseline"]) if by == "mean_speedup"
             else "geomean latency {:.0f} ms".format(best["geomean_latency_ms"]))
    reason = f"fastest by {by} ({value}) of {len(passing)} variants passing every gate"
    if len(ranked) > 1:
        runner = ranked[1]
        other = (f"{runner['mean_speedup_vs_baseline']:.3f}" if by == "mean_speedup"
                 else f"{runner['geomean_latency_ms']:.0f} ms")
        reason += f"; next: {runner['variant']} ({other})"
    failed = [row["variant"] for row in rows if not row["gate_passed"]]
    if failed:
        reason += f"; failed the gate: {', '.join(failed)}"
    return {"mode": "fastest", "by": by, "variant": best["variant"], "reason": reason, "candidates": candidates}


def main(job) -> None:
    summary = json.loads(Path(job.input.summary).read_text())
    selection = choose(summary, job.params.by)
    validate_json(selection, job.input.schema)
    write_json(job.output.selection, selection)
    print(f"selected {selection['variant']}: {selection['reason']}")


if __name__ == "__main__":
    from lib.stage import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
