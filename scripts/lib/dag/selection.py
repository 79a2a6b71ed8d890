"""Which candidate image.tar.gz is made of (select.mode fastest): the fastest candidate that passes every check, found
by checking them fastest first and stopping at the first that passes.

Every candidate is probed (cheap); `rank` orders them by speed on the competition's prompt set (`select.by`), with
the fresh-prompt speed beside it; a mean speedup is against a same-host bf16 variant's medians when the run measures
one, else against the probe's baseline_ms (the contract's A10G numbers), and the ranking's `baseline` says which
(lib.baseline). `walk` then visits them in that order: a candidate's lossless check first (a
comparison of ids the probe already recorded, against one short reference run), its quality gate (hours on the real
model) only when that passed, and it stops at the first candidate that passes both. So the gate's cost is paid for
the winner and for faster candidates that failed; slower ones are never checked. rules/select.smk walks with
Snakemake's checkpoints (each record read through `.get()`, which makes Snakemake run that check first), the `select`
stage walks the same records again to write results/selection.json (`choose`). Stdlib only.
"""

from __future__ import annotations

import math
import statistics
from typing import Callable

from lib.baseline import mean_ratio, same_host
from lib.gate import failed_tasks
from lib.probe import COMPETITION_SET, prompt_sets
from lib.stage import StageError

BY = ("mean_speedup", "geomean_latency_ms")
FRESH = "fresh"


def set_speed(prompt_set: dict | None, reference_set: dict | None = None, same_host_bf16: bool = False) -> dict:
    """A prompt set's two speed figures (None where the set was not probed, or a category has no baseline_ms). With
    same_host_bf16 the mean speedup is against `reference_set`, the bf16 variant's same set (None where none)."""
    if not prompt_set:
        return {"mean_speedup_vs_baseline": None, "geomean_latency_ms": None}
    medians = [category["median_ms"] for category in prompt_set["categories"]]
    return {
        "mean_speedup_vs_baseline": (
            mean_ratio(prompt_set, reference_set) if same_host_bf16 else prompt_set["mean_speedup"]
        ),
        "geomean_latency_ms": math.exp(statistics.mean(math.log(m) for m in medians)),
    }


def faster_key(speed: dict, by: str) -> float:
    """Larger is faster."""
    return speed["mean_speedup_vs_baseline"] if by == "mean_speedup" else -speed["geomean_latency_ms"]


def fresh_speed(row: dict) -> dict:
    return {
        "mean_speedup_vs_baseline": row["fresh_mean_speedup_vs_baseline"],
        "geomean_latency_ms": row["fresh_geomean_latency_ms"],
    }


def rank(latencies: dict[str, dict], by: str, bf16: tuple[str, dict] | None = None) -> dict:
    """The ranking record (results/ranking.json) of the candidates' latency records, fastest first on the
    competition's prompt set; ties keep the candidates' order. `fresh_rank` orders them on fresh prompts (what a new
    user sees; reported, not ranked by), null for a candidate whose probe had no fresh set. `bf16`: (name, latency
    record) of the run's same-host bf16 variant: mean speedups are against its medians instead of baseline_ms."""
    if by not in BY:
        raise StageError(f"select.by must be one of {', '.join(BY)}, not {by!r}")
    if bf16:
        baseline, reference_sets = same_host(bf16[0]), prompt_sets(bf16[1])
    else:
        baseline, reference_sets = next(iter(latencies.values()))["baseline"], {}
    rows = []
    for variant, latency in latencies.items():
        sets = prompt_sets(latency)
        competition, fresh = (
            set_speed(sets.get(name), reference_sets.get(name), bf16 is not None) for name in (COMPETITION_SET, FRESH)
        )
        if by == "mean_speedup" and competition["mean_speedup_vs_baseline"] is None:
            if bf16:
                raise StageError(
                    f"select.by mean_speedup against the same-host bf16 variant {bf16[0]}: its probe lacks a category "
                    f"{variant}'s has. Probe both with the same probe.categories, or set select.by: geomean_latency_ms"
                )
            raise StageError(
                f"select.by mean_speedup needs every probe category's baseline_ms (config probe.categories); "
                f"{variant}'s probe has none. Set select.by: geomean_latency_ms"
            )
        rows.append(
            {
                "variant": variant,
                **competition,
                "fresh_mean_speedup_vs_baseline": fresh["mean_speedup_vs_baseline"],
                "fresh_geomean_latency_ms": fresh["geomean_latency_ms"],
            }
        )
    ordered = sorted(rows, key=lambda row: -faster_key(row, by))  # stable: ties keep the candidates' order
    on_fresh = [row for row in rows if None not in fresh_speed(row).values()]
    fresh_order = [row["variant"] for row in sorted(on_fresh, key=lambda row: -faster_key(fresh_speed(row), by))]
    return {
        "by": by,
        "competition_set": COMPETITION_SET,
        "baseline": baseline,
        "candidates": [
            {
                "variant": row["variant"],
                "rank": position + 1,
                "fresh_rank": fresh_order.index(row["variant"]) + 1 if row["variant"] in fresh_order else None,
                **{key: value for key, value in row.items() if key != "variant"},
            }
            for position, row in enumerate(ordered)
        ],
    }


def order(ranking: dict) -> list[str]:
    """The candidates fastest first, as `walk` visits them."""
    return [row["variant"] for row in sorted(ranking["candidates"], key=lambda row: row["rank"])]


def walk(
    candidates: list[str], lossless_of: Callable[[str], dict], gate_of: Callable[[str], dict]
) -> list[tuple[str, dict, dict | None]]:
    """Visit `candidates` in order: the lossless check, then (only if it passed) the quality gate, until one passes
    both. Returns (variant, lossless record, quality record or None where the gate was not run) per visited
    candidate; the last one visited is the winner if it passed both. The record functions are called only for what
    the walk needs, in this order: under Snakemake each raises until that check has run."""
    visited = []
    for variant in candidates:
        lossless = lossless_of(variant)
        if not lossless["passed"]:
            visited.append((variant, lossless, None))
            continue
        quality = gate_of(variant)
        visited.append((variant, lossless, quality))
        if quality["passed"]:
            break
    return visited


def failure(lossless: dict, quality: dict | None) -> tuple[str | None, list[str]]:
    """(the check a visited candidate failed: lossless or quality_gate, or None; what it failed on)."""
    if not lossless["passed"]:
        return "lossless", [f"not lossless against {lossless['reference']}: {lossless['failures'][0]}"]
    if quality is not None and not quality["passed"]:
        return "quality_gate", failed_tasks(quality["tasks"])
    return None, []


def speed_text(row: dict, by: str, baseline: dict) -> str:
    """The speed on the competition's prompts, and on fresh prompts beside it (the gap select does not rank); a mean
    speedup names what it is against (the ranking's `baseline`)."""
    if by == "mean_speedup":
        text = f"mean speedup {row['mean_speedup_vs_baseline']:.3f} {baseline['label']}"
        fresh = row["fresh_mean_speedup_vs_baseline"]
        other = f"{fresh:.3f}" if fresh is not None else None
    else:
        text = f"geomean latency {row['geomean_latency_ms']:.0f} ms"
        fresh = row["fresh_geomean_latency_ms"]
        other = f"{fresh:.0f} ms" if fresh is not None else None
    if other is None:
        return text + " on the competition's repeated prompts; fresh prompts not probed"
    return f"{text} on the competition's repeated prompts, {other} on fresh prompts"


def outcome_text(candidate: dict) -> str:
    if candidate["outcome"] == "not_gated":
        return "not gated: slower than the winner"
    if candidate["outcome"] == "won":
        return "won"
    check = "the lossless check" if candidate["failed_check"] == "lossless" else "the quality gate"
    return f"failed {check}: {'; '.join(candidate['failures'])}"


def choose(ranking: dict, lossless: dict[str, dict], quality: dict[str, dict]) -> dict:
    """results/selection.json from the ranking and the records the walk visited (`lossless`, `quality`: by variant).
    Raises StageError naming every candidate and why when none passes."""

    def record(records: dict[str, dict], kind: str) -> Callable[[str], dict]:
        def get(variant: str) -> dict:
            if variant not in records:
                raise StageError(f"select needs {variant}'s {kind} record to go on, and was not given it")
            return records[variant]

        return get

    by = ranking["by"]
    rows = sorted(ranking["candidates"], key=lambda row: row["rank"])
    visited = walk([row["variant"] for row in rows], record(lossless, "lossless"), record(quality, "quality gate"))
    checked = {
        variant: failure(lossless_record, quality_record) for variant, lossless_record, quality_record in visited
    }
    winner = visited[-1][0] if visited and visited[-1][2] is not None and visited[-1][2]["passed"] else None
    candidates = []
    for row in rows:
        check, failures = checked.get(row["variant"], (None, []))
        outcome = "won" if row["variant"] == winner else "failed" if row["variant"] in checked else "not_gated"
        candidates.append({**row, "outcome": outcome, "failed_check": check, "failures": failures})
    if winner is None:
        raise StageError(
            "no candidate passes the lossless check and the quality gate; nothing to ship (select.candidates, "
            f"fastest by {by} first):\n  "
            + "\n  ".join(f"{c['variant']} (rank {c['rank']}): {outcome_text(c)}" for c in candidates)
        )
    return {
        "mode": "fastest",
        "by": by,
        "baseline": ranking["baseline"],
        "variant": winner,
        "reason": reason(candidates, by, ranking["baseline"]),
        "candidates": candidates,
    }


def reason(candidates: list[dict], by: str, baseline: dict) -> str:
    """Why the winner: its speed, the faster candidates it was checked after and why they failed, the slower ones
    left unchecked, and (honestly) which candidate would be the fastest on fresh prompts when that is another."""
    won = next(c for c in candidates if c["outcome"] == "won")
    text = (
        f"fastest by {by} of the {len(candidates)} candidates to pass the lossless check and the quality gate "
        f"({speed_text(won, by, baseline)}; rank {won['rank']})"
    )
    failed = [c for c in candidates if c["outcome"] == "failed"]
    if failed:
        text += "; faster but failed: " + "; ".join(f"{c['variant']} ({outcome_text(c)})" for c in failed)
    slower = [c for c in candidates if c["outcome"] == "not_gated"]
    if slower:
        text += "; slower, never gated: " + "; ".join(f"{c['variant']} ({speed_text(c, by, baseline)})" for c in slower)
    if all(c["fresh_rank"] is not None for c in candidates):
        fresh_first = min(candidates, key=lambda c: c["fresh_rank"])
        if fresh_first["variant"] != won["variant"]:
            text += (
                f"; on fresh prompts {fresh_first['variant']} would be the fastest "
                f"({'not gated' if fresh_first['outcome'] == 'not_gated' else outcome_text(fresh_first)})"
            )
    return text
