"""Gather every compared variant's latency, quality and quantize records into results/summary.{json,csv,md}
and draw the comparison: speedup vs each quality score (Pareto front marked), latency per category, K sweeps.

Two speedups per category: against the config's baseline_ms (the competition's A10G numbers: the summary's
`baseline` says so, where the probe ran, and any category sized unlike the contract's) and against a BF16 variant
measured on this host by the same probe (the reference), when one is compared. Both come for every prompt set the
probe timed (lib.probe.PROMPT_SETS: the competition's repeated sentence, varied text, fresh prompts), side by side:
the competition's set is what select ranks by, the fresh set what a new user sees. What the plots and the Pareto fronts
call speed (`speed_axis`, `speed_baseline`) is against a compared same-host bf16 variant without speculation when
there is one, as select's ranking is (lib.baseline).
"""

import csv
import json
import math
import statistics
import textwrap
from pathlib import Path

from lib.baseline import SAME_HOST_BF16, is_bf16, mean_ratio, same_host
from lib.decode_bytes import A10G_GBPS, bound_ms, draft_passes, step_total
from lib.gate import failed_tasks
from lib.probe import COMPETITION_SET, PROMPT_SETS, prompt_sets
from lib.stage import StageError, validate_json, write_json


def load(path) -> dict:
    return json.loads(Path(path).read_text())


def weight_bits(quantize_report: dict) -> int:
    """Fewest weight bits of any quantized group; 16 for a checkpoint left unquantized."""
    if not quantize_report["quantized"]:
        return 16
    bits = [group["weights"]["num_bits"] for group in quantize_report["recipe"]["groups"]]
    return min(bits) if bits else 16


def same_serving(a: dict, b: dict) -> bool:
    return a["serve"] == b["serve"] and a["speculative"] == b["speculative"]


def references(variants: list[dict], quantized: dict[str, bool], explicit: str | None) -> dict[str, str | None]:
    """variant -> the unquantized variant its same-host speedup is against.

    explicit (compare.reference) wins; otherwise the unquantized variant served the same way (so the ratio is the
    cost or gain of the bits alone), else the first unquantized one by name, else none."""
    if explicit:
        return {v["name"]: explicit for v in variants}
    unquantized = sorted((v for v in variants if not quantized[v["name"]]), key=lambda v: v["name"])
    out = {}
    for variant in variants:
        twin = next((u["name"] for u in unquantized if same_serving(u, variant)), None)
        out[variant["name"]] = twin or (unquantized[0]["name"] if unquantized else None)
    return out


def mean_or_none(values):
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def pareto_front(points: dict[str, tuple[float | None, float | None]]) -> set[str]:
    """Names whose (quality, speed) no other point matches or beats in both with one strictly better."""
    valid = {n: p for n, p in points.items() if p[0] is not None and p[1] is not None}
    front = set()
    for name, (q, s) in valid.items():
        dominated = any(
            q2 >= q and s2 >= s and (q2 > q or s2 > s) for other, (q2, s2) in valid.items() if other != name
        )
        if not dominated:
            front.add(name)
    return front


def category_row(category: dict, reference_median: float | None) -> dict:
    return {
        "median_ms": category["median_ms"],
        "p90_ms": category["p90_ms"],
        "ttft_median_ms": category["ttft_median_ms"],
        "itl_median_ms": category["itl_median_ms"],
        "speedup_vs_baseline": category["speedup"],
        "speedup_vs_reference": reference_median / category["median_ms"] if reference_median else None,
        "mean_acceptance_length": category["mean_acceptance_length"],
        "prefix_cache_hit_rate": (category.get("prefix_cache") or {}).get("hit_rate"),
    }


def decode_step(
    report: dict, speculative: dict, categories: dict[str, dict], device: dict, drafter_bytes: int = 0
) -> dict | None:
    """The variant's bytes per decode step (its checkpoint's, from the quantize report, with K MTP passes, or a
    drafter model's one pass through its own weights and the target's head) and the
    floor they put on its inter-token latency at the contract's A10G and at the probing device's measured bandwidth
    (`device`: the latency record's device_bandwidth), beside the measured ITL per category (the competition's set).
    None for a report written before quantize recorded it."""
    step = report.get("decode_step")
    if step is None:
        return None
    passes = draft_passes(speculative)
    total = step_total(step, passes, drafter_bytes)

    def floors(gbps: float) -> tuple[float, dict]:
        floor = bound_ms(total, gbps)
        return round(floor, 4), {
            name: round(floor / (c["mean_acceptance_length"] or 1.0), 4) for name, c in categories.items()
        }

    a10g, a10g_per_token = floors(A10G_GBPS)
    probe, probe_per_token = floors(device["gbps"])
    return {
        "bytes": total,
        "draft_passes": passes,
        "a10g_gbps": A10G_GBPS,
        "a10g_bound_ms": a10g,
        "a10g_bound_ms_per_token": a10g_per_token,
        "probe_device": device["device"],
        "probe_gbps": device["gbps"],
        "probe_bound_ms": probe,
        "probe_bound_ms_per_token": probe_per_token,
        "itl_median_ms": {name: c["itl_median_ms"] for name, c in categories.items()},
    }


def geomean(values) -> float:
    return math.exp(statistics.mean(math.log(v) for v in values))


def set_rows(latency: dict, reference_latency: dict | None) -> dict[str, dict | None]:
    """Per prompt set (None where not probed): its categories' rows and the set's means."""
    sets = prompt_sets(latency)
    reference_sets = prompt_sets(reference_latency) if reference_latency else {}
    out: dict[str, dict | None] = {}
    for name in PROMPT_SETS:
        if name not in sets:
            out[name] = None
            continue
        ref = {c["name"]: c["median_ms"] for c in reference_sets[name]["categories"]} if name in reference_sets else {}
        categories = {c["name"]: category_row(c, ref.get(c["name"])) for c in sets[name]["categories"]}
        hit_rates = [c["prefix_cache_hit_rate"] for c in categories.values()]
        out[name] = {
            "categories": categories,
            "summary": {
                "mean_speedup_vs_baseline": sets[name]["mean_speedup"],
                "mean_speedup_vs_reference": mean_or_none(c["speedup_vs_reference"] for c in categories.values()),
                "geomean_latency_ms": geomean(c["median_ms"] for c in categories.values()),
                "mean_acceptance_length": mean_or_none(c["mean_acceptance_length"] for c in categories.values()),
                "prefix_cache_hit_rate": mean_or_none(hit_rates),
            },
        }
    return out


def build_summary(
    variants: list[dict],
    latencies: list[dict],
    qualities: list[dict],
    quantize_reports: dict[str, dict],
    explicit_reference: str | None,
    drafter_bytes: dict[str, int] | None = None,
) -> dict:
    """The summary record (schemas/summary.schema.yaml); variants, latencies and qualities are in one order."""
    names = [v["name"] for v in variants]
    latency_of = dict(zip(names, latencies, strict=True))
    quantized = {v["name"]: quantize_reports[v["recipe_key"]]["quantized"] for v in variants}
    reference_of = references(variants, quantized, explicit_reference)
    categories = [c["name"] for c in latencies[0]["categories"]]
    tasks = [t["name"] for t in qualities[0]["tasks"]]
    rows = []
    for variant, latency, quality in zip(variants, latencies, qualities, strict=True):
        name, reference = variant["name"], reference_of[variant["name"]]
        sets = set_rows(latency, latency_of[reference] if reference else None)
        competition = sets[COMPETITION_SET]
        report = quantize_reports[variant["recipe_key"]]
        rows.append(
            {
                "variant": name,
                "recipe": variant["recipe"],
                "recipe_key": variant["recipe_key"],
                "quantized": report["quantized"],
                "weight_bits": weight_bits(report),
                "model_bytes": report["output_bytes"],
                "decode_step": decode_step(
                    report,
                    variant["speculative"],
                    competition["categories"],
                    latency["device_bandwidth"],
                    (drafter_bytes or {}).get(variant.get("draft_folder"), 0),
                ),
                "speculative": variant["speculative"],
                "max_num_seqs": variant["serve"]["max_num_seqs"],
                "reference": reference,
                "latency": competition["categories"],
                "varied_latency": sets["varied"]["categories"] if sets["varied"] else None,
                "fresh_latency": sets["fresh"]["categories"] if sets["fresh"] else None,
                **competition["summary"],
                "prompt_sets": {
                    set_name: rows_of["summary"] if rows_of else None for set_name, rows_of in sets.items()
                },
                "fresh_vs_competition": (
                    competition["summary"]["geomean_latency_ms"] / sets["fresh"]["summary"]["geomean_latency_ms"]
                    if sets["fresh"]
                    else None
                ),
                "quality": {t["name"]: t["score"] for t in quality["tasks"]},
                "gate_passed": bool(quality["passed"]),
                "gate_failures": failed_tasks(quality["tasks"]),
            }
        )
    bf16 = next(
        (v["name"] for v in variants if is_bf16(quantized[v["name"]], v["speculative"]["method"])),
        None,
    )
    label, speed_baseline = speed_axis(rows, bf16, latencies[0]["baseline"])
    probed = [name for name in PROMPT_SETS if any(row["prompt_sets"][name] for row in rows)]
    summary = {
        "categories": categories,
        "tasks": tasks,
        "reference": explicit_reference,
        "baseline": latencies[0]["baseline"],
        "speed_axis": label,
        "speed_baseline": speed_baseline,
        "competition_set": COMPETITION_SET,
        "prompt_sets": probed,
        "variants": rows,
    }
    speed = [set_speed(summary, row, COMPETITION_SET) for row in rows]
    for row in rows:
        row["pareto"] = {}
    for task in tasks:
        front = pareto_front({r["variant"]: (r["quality"].get(task), s) for r, s in zip(rows, speed, strict=True)})
        for row in rows:
            row["pareto"][task] = row["variant"] in front
    return summary


REFERENCE_AXIS = "mean speedup vs BF16 (same host, each variant's reference)"
LATENCY_AXIS = "1000 / geomean latency (1/s)"


def speed_axis(rows: list[dict], bf16: str | None, baseline: dict) -> tuple[str, dict | None]:
    """What 'faster' is plotted as (on the competition's prompt set), and the one baseline it divides by: a compared
    same-host bf16 variant without speculation (`bf16`), else the probes' baseline_ms (`baseline`: the latency
    records' own, saying what they are), else each variant's BF16 reference (no one baseline), else 1/latency."""
    if bf16:
        same = same_host(bf16)
        return f"mean speedup {same['label']}", same
    if all(r["mean_speedup_vs_baseline"] is not None for r in rows):
        return f"mean speedup {baseline['label']}", baseline
    if all(r["mean_speedup_vs_reference"] is not None for r in rows):
        return REFERENCE_AXIS, None
    return LATENCY_AXIS, None


def set_categories(row: dict, set_name: str) -> dict | None:
    """A summary row's categories on one prompt set, as a latency record's set holds them (for lib.baseline)."""
    categories = row["latency"] if set_name == COMPETITION_SET else row[f"{set_name}_latency"]
    if not categories:
        return None
    return {"categories": [{"name": name, "median_ms": c["median_ms"]} for name, c in categories.items()]}


def set_speed(summary: dict, row: dict, set_name: str) -> float | None:
    """The row's speed on one prompt set, on the summary's speed axis (None where that set was not probed)."""
    values = row["prompt_sets"][set_name]
    if values is None:
        return None
    speed_baseline = summary["speed_baseline"]
    if speed_baseline and speed_baseline["kind"] == SAME_HOST_BF16:
        reference = next(r for r in summary["variants"] if r["variant"] == speed_baseline["variant"])
        return mean_ratio(set_categories(row, set_name), set_categories(reference, set_name))
    if speed_baseline:
        return values["mean_speedup_vs_baseline"]
    if summary["speed_axis"] == REFERENCE_AXIS:
        return values["mean_speedup_vs_reference"]
    return 1000 / values["geomean_latency_ms"]


def fmt(value, spec=".2f") -> str:
    if value is None:
        return "-"
    return format(value, spec) if isinstance(value, float) else str(value)


def per_set(row: dict, sets: list[str], key: str, spec=".2f") -> str:
    """'1.20 / 1.05 / 0.98': one value per prompt set, in `sets` order."""
    return " / ".join(fmt((row["prompt_sets"][name] or {}).get(key), spec) for name in sets)


CATEGORY_KEYS = (
    "median_ms",
    "p90_ms",
    "speedup_vs_baseline",
    "speedup_vs_reference",
    "mean_acceptance_length",
    "prefix_cache_hit_rate",
)
SET_KEYS = (
    "mean_speedup_vs_baseline",
    "mean_speedup_vs_reference",
    "geomean_latency_ms",
    "mean_acceptance_length",
    "prefix_cache_hit_rate",
)


def csv_rows(summary: dict) -> list[dict]:
    """One row per variant; the competition's set's columns unprefixed (as before), every set's with its name."""
    out = []
    for row in summary["variants"]:
        flat = {
            k: row[k]
            for k in (
                "variant",
                "recipe_key",
                "weight_bits",
                "model_bytes",
                "max_num_seqs",
                "reference",
                "mean_speedup_vs_baseline",
                "mean_speedup_vs_reference",
                "geomean_latency_ms",
                "mean_acceptance_length",
                "prefix_cache_hit_rate",
                "fresh_vs_competition",
                "gate_passed",
            )
        }
        flat["speculative_method"], flat["speculative_k"] = row["speculative"]["method"], row["speculative"]["k"]
        for category in summary["categories"]:
            for key in CATEGORY_KEYS:
                flat[f"{category}_{key}"] = row["latency"][category][key]
        for set_name in PROMPT_SETS:
            values = row["prompt_sets"][set_name] or {}
            for key in SET_KEYS:
                flat[f"{set_name}_{key}"] = values.get(key)
            if set_name == COMPETITION_SET:
                continue
            categories = row[f"{set_name}_latency"] or {}
            for category in summary["categories"]:
                for key in CATEGORY_KEYS:
                    flat[f"{set_name}_{category}_{key}"] = (categories.get(category) or {}).get(key)
        for task in summary["tasks"]:
            flat[f"{task}_score"] = row["quality"][task]
            flat[f"{task}_pareto"] = row["pareto"][task]
        out.append(flat)
    return out


SET_NOTES = {
    "repeated": "the competition's prompts, one sentence repeated (select ranks by it)",
    "varied": "varied natural text, one prompt per category reused by its runs",
    "fresh": "a new prompt for every request, so no reuse across requests can help: what a new user sees",
}


def ratio_lines(summary: dict) -> list[str]:
    """What each ratio of the tables and plots is against, said before them."""
    speed_baseline = summary["speed_baseline"]
    return [
        f"Speedup vs baseline: {summary['baseline']['text']}.",
        "Speedup vs BF16: against each variant's `reference`, measured on this host by the same probe.",
        f"Speed (plots, Pareto fronts): {speed_baseline['text'] if speed_baseline else summary['speed_axis']}.",
    ]


def markdown(summary: dict) -> str:
    cats, tasks, sets = summary["categories"], summary["tasks"], summary["prompt_sets"]
    names = " / ".join(sets)
    baseline_label = summary["baseline"]["label"]
    header = (
        [
            "variant",
            "recipe",
            "bits",
            "weights MB",
            "GB/step (floor ms: A10G, probe)",
            "spec",
            "seqs",
            f"speedup {baseline_label} ({names})",
            f"speedup vs BF16 ({names})",
        ]
        + [f"{c} median ms" for c in cats]
        + [f"accept len ({names})"]
        + tasks
        + ["gate"]
    )
    lines = [*(line + "  " for line in ratio_lines(summary)), ""]  # two spaces: a line break in Markdown
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in summary["variants"]:
        spec = row["speculative"]
        cells = [
            row["variant"],
            row["recipe_key"],
            str(row["weight_bits"]),
            f"{row['model_bytes'] / 1e6:.1f}",
            (
                f"{row['decode_step']['bytes'] / 1e9:.3g} ({row['decode_step']['a10g_bound_ms']:.3g}, "
                f"{row['decode_step']['probe_bound_ms']:.3g})"
                if row["decode_step"]
                else "-"
            ),
            "none" if spec["method"] == "none" else f"{spec['method']} K={spec['k']}",
            str(row["max_num_seqs"]),
            per_set(row, sets, "mean_speedup_vs_baseline"),
            per_set(row, sets, "mean_speedup_vs_reference"),
        ]
        cells += [fmt(row["latency"][c]["median_ms"], ".0f") for c in cats]
        cells.append(per_set(row, sets, "mean_acceptance_length"))
        cells += [fmt(row["quality"][t], ".3f") + (" *" if row["pareto"][t] else "") for t in tasks]
        cells.append("pass" if row["gate_passed"] else "FAIL: " + "; ".join(row["gate_failures"]))
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Speedup vs baseline: mean over categories of the config's baseline_ms / median ("
        + summary["baseline"]["label"]
        + "). Speedup vs BF16: against the unquantized variant measured here (`reference` in summary.json). Both "
        "per prompt set: "
        + "; ".join(f"{name}: {SET_NOTES[name]}" for name in sets)
        + ". Medians: the competition's set. * = on the Pareto front of speed (competition's set) and that "
        "score.",
        "",
        "Per prompt set (prefix-cache hit rate: vllm:prefix_cache_hits / queries over the timed "
        "runs, - when prefix caching is off):",
        "",
    ]
    header = (
        ["variant", "prompt set"]
        + [f"{c} median ms" for c in cats]
        + [f"speedup {baseline_label}", "speedup vs BF16", "accept len", "prefix-cache hits"]
    )
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in summary["variants"]:
        for set_name in sets:
            values = row["prompt_sets"][set_name]
            if values is None:
                continue
            categories = row["latency"] if set_name == COMPETITION_SET else row[f"{set_name}_latency"]
            cells = [row["variant"], set_name] + [fmt(categories[c]["median_ms"], ".0f") for c in cats]
            cells += [
                fmt(values["mean_speedup_vs_baseline"]),
                fmt(values["mean_speedup_vs_reference"]),
                fmt(values["mean_acceptance_length"]),
                fmt(values["prefix_cache_hit_rate"], ".0%"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display on a build host
    import matplotlib.pyplot as plt

    return plt


def plot_title(title: str, summary: dict) -> str:
    """A plot's title and, under it, what its speed is against (wrapped to the figure)."""
    speed_baseline = summary["speed_baseline"]
    against = speed_baseline["text"] if speed_baseline else summary["speed_axis"]
    return title + "\n" + "\n".join(textwrap.wrap(f"speed: {against}", 110))


def axis_label(label: str) -> str:
    return "\n".join(textwrap.wrap(label, 40))


def plot_speedup_vs_quality(summary: dict, path) -> None:
    plt = pyplot()
    label = summary["speed_axis"]
    speed = [set_speed(summary, row, COMPETITION_SET) for row in summary["variants"]]
    tasks = summary["tasks"]
    # constrained: room for the title's lines on what the speed is against
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4.2), squeeze=False, layout="constrained")
    for ax, task in zip(axes[0], tasks, strict=False):
        points = [
            (r["quality"][task], s, r)
            for r, s in zip(summary["variants"], speed, strict=True)
            if r["quality"][task] is not None and s is not None
        ]
        for score, s, row in points:
            on_front = row["pareto"][task]
            ax.scatter(
                score,
                s,
                s=80 if on_front else 40,
                marker="*" if on_front else ("o" if row["gate_passed"] else "x"),
                color="tab:red" if on_front else "tab:blue",
                zorder=3,
            )
            ax.annotate(row["variant"], (score, s), textcoords="offset points", xytext=(4, 4), fontsize=7)
        front = sorted((p for p in points if p[2]["pareto"][task]), key=lambda p: p[0])
        if len(front) > 1:
            ax.plot([p[0] for p in front], [p[1] for p in front], color="tab:red", lw=1, ls="--", zorder=2)
        ax.set_xlabel(f"{task} score")
        ax.set_ylabel(axis_label(label), fontsize=8)
        ax.set_title(task)
        ax.grid(alpha=0.3)
    fig.suptitle(plot_title("Speed vs quality (red stars: Pareto front; x: failed the gate)", summary), fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency_per_category(summary: dict, path) -> None:
    """One panel per prompt set (median per category and variant, whisker p90; one y scale) and one with every
    variant's speed on each set side by side: the gap between the competition's prompts and fresh ones."""
    plt = pyplot()
    rows, cats, sets = summary["variants"], summary["categories"], summary["prompt_sets"]
    panel_width = max(7.0, 1.6 * len(cats) * max(1, len(rows)) / 2)
    fig, axes = plt.subplots(
        len(sets) + 1, 1, figsize=(panel_width, 3.6 * (len(sets) + 1)), squeeze=False, layout="constrained"
    )
    axes = axes[:, 0]
    width = 0.8 / max(1, len(rows))
    top = 0.0
    for ax, set_name in zip(axes, sets, strict=False):  # the last axis is the gap panel
        for i, row in enumerate(rows):
            categories = row["latency"] if set_name == COMPETITION_SET else row[f"{set_name}_latency"]
            if not categories:
                continue
            xs = [c + (i - (len(rows) - 1) / 2) * width for c in range(len(cats))]
            medians = [categories[c]["median_ms"] for c in cats]
            upper = [categories[c]["p90_ms"] - m for c, m in zip(cats, medians, strict=True)]
            top = max(top, max(m + u for m, u in zip(medians, upper, strict=True)))
            ax.bar(xs, medians, width, yerr=[[0] * len(cats), upper], capsize=2, label=row["variant"], color=f"C{i}")
        ax.set_xticks(range(len(cats)), cats)
        ax.set_title(
            f"{set_name} prompts"
            + (" (the competition's; select ranks by them)" if set_name == COMPETITION_SET else ""),
            fontsize=10,
        )
        ax.grid(axis="y", alpha=0.3)
    for ax in axes[: len(sets)]:
        ax.set_ylim(0, top * 1.08 if top else 1)
    for ax in axes[: len(sets)]:
        ax.set_ylabel("median ms (whisker: p90)")
    axes[0].legend(fontsize=7, ncol=2)
    gap = axes[-1]
    label = summary["speed_axis"]
    set_width = 0.8 / len(sets)
    for j, set_name in enumerate(sets):
        xs = [i + (j - (len(sets) - 1) / 2) * set_width for i in range(len(rows))]
        values = [set_speed(summary, row, set_name) for row in rows]
        shown = [(x, v) for x, v in zip(xs, values, strict=True) if v is not None]
        gap.bar(
            [x for x, _ in shown],
            [v for _, v in shown],
            set_width,
            label=set_name,
            hatch=["", "//", ".."][j % 3],
            color=f"C{len(rows) + j}",
        )
    gap.set_xticks(range(len(rows)), [row["variant"] for row in rows], rotation=20, ha="right", fontsize=7)
    gap.set_ylabel(axis_label(label), fontsize=8)
    gap.set_title("speed per prompt set: the gap between the competition's prompts and fresh ones", fontsize=10)
    gap.legend(fontsize=7)
    gap.grid(axis="y", alpha=0.3)
    fig.suptitle(plot_title("Latency per category and prompt set", summary), fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def k_groups(summary: dict) -> dict[str, list[dict]]:
    """Variants that differ only in K (same recipe, method and serving), for groups with two K or more."""
    groups: dict[str, list[dict]] = {}
    for row in summary["variants"]:
        if row["speculative"]["method"] == "none":
            continue
        key = f"{row['recipe_key']} {row['speculative']['method']} seqs{row['max_num_seqs']}"
        groups.setdefault(key, []).append(row)
    return {
        k: sorted(v, key=lambda r: r["speculative"]["k"])
        for k, v in groups.items()
        if len({r["speculative"]["k"] for r in v}) > 1
    }


def plot_k_sweep(summary: dict, path) -> None:
    plt = pyplot()
    groups = k_groups(summary)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    if not groups:
        for ax in (left, right):
            ax.axis("off")
        left.text(0.5, 0.5, "no K sweep among the compared variants", ha="center", va="center")
    for key, rows in groups.items():
        ks = [r["speculative"]["k"] for r in rows]
        for set_name, style in zip(PROMPT_SETS, ("-", "--", ":"), strict=True):
            values = [(r["prompt_sets"][set_name] or {}).get("mean_acceptance_length") for r in rows]
            if any(v is not None for v in values):
                left.plot(ks, values, marker="o", ls=style, label=f"{key}: {set_name}")
        for category in summary["categories"]:
            right.plot(ks, [r["latency"][category]["median_ms"] for r in rows], marker="o", label=f"{key}: {category}")
    if groups:
        left.set(xlabel="K (speculative tokens per step)", ylabel="mean acceptance length", title="Acceptance vs K")
        right.set(xlabel="K (speculative tokens per step)", ylabel="median latency, ms", title="Latency vs K")
        all_k = sorted({r["speculative"]["k"] for rows in groups.values() for r in rows})
        for ax in (left, right):
            ax.set_xticks(all_k)  # K is an integer
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(job) -> None:
    variants = job.params.variants
    latencies = [load(p) for p in job.input.latency]
    qualities = [load(p) for p in job.input.quality]
    if not (len(variants) == len(latencies) == len(qualities)):
        raise StageError("compare: the variant list and the latency/quality inputs differ in length")
    reports = {Path(p).parent.name: load(p) for p in job.input.quantize}
    drafters = {Path(p).parent.name: load(p)["bytes"] for p in job.input.drafts}  # weights/drafts/<folder>/
    summary = build_summary(variants, latencies, qualities, reports, job.params.reference, drafters)
    validate_json(summary, job.input.schema)
    write_json(job.output.json, summary)
    rows = csv_rows(summary)
    with open(job.output.csv, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    Path(job.output.md).write_text(markdown(summary))
    plot_speedup_vs_quality(summary, job.output.speedup_vs_quality)
    plot_latency_per_category(summary, job.output.latency_per_category)
    plot_k_sweep(summary, job.output.k_sweep)
    print(markdown(summary))


if __name__ == "__main__":
    from lib.stage import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
