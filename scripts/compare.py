"""Gather every compared variant's latency, quality and quantize records into results/summary.{json,csv,md}
and draw the comparison: speedup vs each quality score (Pareto front marked), latency per category, K sweeps.

Two speedups per category: against the config's baseline_ms (the competition's A10G numbers) and against a BF16
variant measured on this host by the same probe (the reference), when one is compared.
"""

import csv
import json
import math
import statistics
from pathlib import Path

from lib.gate import failed_tasks
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
        dominated = any(q2 >= q and s2 >= s and (q2 > q or s2 > s) for other, (q2, s2) in valid.items() if other != name)
        if not dominated:
            front.add(name)
    return front


def build_summary(variants: list[dict], latencies: list[dict], qualities: list[dict],
                  quantize_reports: dict[str, dict], explicit_reference: str | None) -> dict:
    """The summary record (schemas/summary.schema.yaml); variants, latencies and qualities are in one order."""
    names = [v["name"] for v in variants]
    latency_of = dict(zip(names, latencies))
    quantized = {v["name"]: quantize_reports[v["recipe_key"]]["quantized"] for v in variants}
    reference_of = references(variants, quantized, explicit_reference)
    categories = [c["name"] for c in latencies[0]["categories"]]
    tasks = [t["name"] for t in qualities[0]["tasks"]]
    rows = []
    for variant, latency, quality in zip(variants, latencies, qualities):
        name, reference = variant["name"], reference_of[variant["name"]]
        ref_medians = {c["name"]: c["median_ms"] for c in latency_of[reference]["categories"]} if reference else {}
        ref_varied = ({c["name"]: c["median_ms"] for c in latency_of[reference]["varied"]["categories"]}
                      if reference else {})
        per_category = {}
        for category in latency["categories"]:
            ref = ref_medians.get(category["name"])
            per_category[category["name"]] = {
                "median_ms": category["median_ms"], "p90_ms": category["p90_ms"],
                "ttft_median_ms": category["ttft_median_ms"], "itl_median_ms": category["itl_median_ms"],
                "speedup_vs_baseline": category["speedup"],
                "speedup_vs_reference": ref / category["median_ms"] if ref else None,
                "mean_acceptance_length": category["mean_acceptance_length"],
            }
        varied = {}
        for category in latency["varied"]["categories"]:
            ref = ref_varied.get(category["name"])
            varied[category["name"]] = {"median_ms": category["median_ms"],
                                        "speedup_vs_reference": ref / category["median_ms"] if ref else None,
                                        "mean_acceptance_length": category["mean_acceptance_length"]}
        report = quantize_reports[variant["recipe_key"]]
        medians = [c["median_ms"] for c in per_category.values()]
        rows.append({
            "variant": name,
            "recipe": variant["recipe"],
            "recipe_key": variant["recipe_key"],
            "quantized": report["quantized"],
            "weight_bits": weight_bits(report),
            "model_bytes": report["output_bytes"],
            "speculative": variant["speculative"],
            "max_num_seqs": variant["serve"]["max_num_seqs"],
            "reference": reference,
            "latency": per_category,
            "varied_latency": varied,
            "mean_speedup_vs_baseline": latency["mean_speedup"],
            "mean_speedup_vs_reference": mean_or_none(c["speedup_vs_reference"] for c in per_category.values()),
            "geomean_latency_ms": math.exp(statistics.mean(math.log(m) for m in medians)),
            "mean_acceptance_length": mean_or_none(c["mean_acceptance_length"] for c in per_category.values()),
            "quality": {t["name"]: t["score"] for t in quality["tasks"]},
            "gate_passed": bool(quality["passed"]),
            "gate_failures": failed_tasks(quality["tasks"]),
        })
    label, speed = speed_axis(rows)
    for row in rows:
        row["pareto"] = {}
    for task in tasks:
        front = pareto_front({r["variant"]: (r["quality"].get(task), s) for r, s in zip(rows, speed)})
        for row in rows:
            row["pareto"][task] = row["variant"] in front
    return {"categories": categories, "tasks": tasks, "reference": explicit_reference, "speed_axis": label,
            "variants": rows}


def speed_axis(rows: list[dict]) -> tuple[str, list[float]]:
    """What 'faster' is plotted as: speedup vs the config baselines, else vs the BF16 reference, else 1/latency."""
    if all(r["mean_speedup_vs_baseline"] is not None for r in rows):
        return "mean speedup vs baseline_ms", [r["mean_speedup_vs_baseline"] for r in rows]
    if all(r["mean_speedup_vs_reference"] is not None for r in rows):
        return "mean speedup vs BF16 (same host)", [r["mean_speedup_vs_reference"] for r in rows]
    return "1000 / geomean latency (1/s)", [1000 / r["geomean_latency_ms"] for r in rows]


def fmt(value, spec=".2f") -> str:
    if value is None:
        return "-"
    return format(value, spec) if isinstance(value, float) else str(value)


def csv_rows(summary: dict) -> list[dict]:
    out = []
    for row in summary["variants"]:
        flat = {k: row[k] for k in ("variant", "recipe_key", "weight_bits", "model_bytes", "max_num_seqs", "reference",
                                    "mean_speedup_vs_baseline", "mean_speedup_vs_reference", "geomean_latency_ms",
                                    "mean_acceptance_length", "gate_passed")}
        flat["speculative_method"], flat["speculative_k"] = row["speculative"]["method"], row["speculative"]["k"]
        for category in summary["categories"]:
            values = row["latency"][category]
            for key in ("median_ms", "p90_ms", "speedup_vs_baseline", "speedup_vs_reference", "mean_acceptance_length"):
                flat[f"{category}_{key}"] = values[key]
            flat[f"varied_{category}_median_ms"] = row["varied_latency"][category]["median_ms"]
        for task in summary["tasks"]:
            flat[f"{task}_score"] = row["quality"][task]
            flat[f"{task}_pareto"] = row["pareto"][task]
        out.append(flat)
    return out


def markdown(summary: dict) -> str:
    cats, tasks = summary["categories"], summary["tasks"]
    header = (["variant", "recipe", "bits", "weights MB", "spec", "seqs", "speedup vs baseline", "speedup vs BF16"]
              + [f"{c} median ms" for c in cats] + ["accept len"] + tasks + ["gate"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in summary["variants"]:
        spec = row["speculative"]
        cells = [row["variant"], row["recipe_key"], str(row["weight_bits"]), f"{row['model_bytes'] / 1e6:.1f}",
                 "none" if spec["method"] == "none" else f"{spec['method']} K={spec['k']}", str(row["max_num_seqs"]),
                 fmt(row["mean_speedup_vs_baseline"]), fmt(row["mean_speedup_vs_reference"])]
        cells += [fmt(row["latency"][c]["median_ms"], ".0f") for c in cats]
        cells.append(fmt(row["mean_acceptance_length"]))
        cells += [fmt(row["quality"][t], ".3f") + (" *" if row["pareto"][t] else "") for t in tasks]
        cells.append("pass" if row["gate_passed"] else "FAIL: " + "; ".join(row["gate_failures"]))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Speedup vs baseline: mean over categories of the config's baseline_ms / median (competition-style "
              "prompts). Speedup vs BF16: against the unquantized variant measured here (`reference` in "
              "summary.json). * = on the Pareto front of speed and that score."]
    return "\n".join(lines) + "\n"


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display on a build host
    import matplotlib.pyplot as plt

    return plt


def plot_speedup_vs_quality(summary: dict, path) -> None:
    plt = pyplot()
    label, speed = speed_axis(summary["variants"])
    tasks = summary["tasks"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4.2), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        points = [(r["quality"][task], s, r) for r, s in zip(summary["variants"], speed) if r["quality"][task] is not None]
        for score, s, row in points:
            on_front = row["pareto"][task]
            ax.scatter(score, s, s=80 if on_front else 40, marker="*" if on_front else ("o" if row["gate_passed"] else "x"),
                       color="tab:red" if on_front else "tab:blue", zorder=3)
            ax.annotate(row["variant"], (score, s), textcoords="offset points", xytext=(4, 4), fontsize=7)
        front = sorted((p for p in points if p[2]["pareto"][task]), key=lambda p: p[0])
        if len(front) > 1:
            ax.plot([p[0] for p in front], [p[1] for p in front], color="tab:red", lw=1, ls="--", zorder=2)
        ax.set_xlabel(f"{task} score")
        ax.set_ylabel(label)
        ax.set_title(task)
        ax.grid(alpha=0.3)
    fig.suptitle("Speed vs quality (red stars: Pareto front; x: failed the gate)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency_per_category(summary: dict, path) -> None:
    plt = pyplot()
    rows, cats = summary["variants"], summary["categories"]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cats) * max(1, len(rows)) / 2), 4.5))
    width = 0.8 / max(1, len(rows))
    for i, row in enumerate(rows):
        xs = [c + (i - (len(rows) - 1) / 2) * width for c in range(len(cats))]
        medians = [row["latency"][c]["median_ms"] for c in cats]
        upper = [row["latency"][c]["p90_ms"] - m for c, m in zip(cats, medians)]
        ax.bar(xs, medians, width, yerr=[[0] * len(cats), upper], capsize=2, label=row["variant"])
    ax.set_xticks(range(len(cats)), cats)
    ax.set_ylabel("median latency, ms (whisker: p90)")
    ax.set_title("Latency per category (competition-style prompts)")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
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
    return {k: sorted(v, key=lambda r: r["speculative"]["k"]) for k, v in groups.items()
            if len({r["speculative"]["k"] for r in v}) > 1}


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
        left.plot(ks, [r["mean_acceptance_length"] for r in rows], marker="o", label=key)
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
    summary = build_summary(variants, latencies, qualities, reports, job.params.reference)
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
