"""Time the competition's prompt/output categories against the built image, one request at a time; then, untimed,
record one concurrent batch's greedy ids for the lossless check (lib.probe.concurrent_batch)."""

import json
import textwrap
from pathlib import Path

from lib.baseline import CONFIG, CONTRACT_A10G, probe_baseline
from lib.probe import concurrent_batch, probe, prompt_sets
from lib.stage import StageError, validate_json, write_json
from lib.vllm_logs import cache_evidence

SET_LABELS = {"repeated": "repeated sentence (competition)", "varied": "varied text", "fresh": "fresh prompts"}
# what a ratio on the plot is against, next to each number (the title says it in full)
RATIO_TAGS = {CONTRACT_A10G: "× A10G baseline", CONFIG: "× config baseline"}
BASELINE_MARKS = {CONTRACT_A10G: "the contract's A10G baseline_ms", CONFIG: "the config's baseline_ms"}


def plot_labels(result: dict, variant: str) -> dict:
    """The plot's words, from the record's `baseline`: the title says what every ratio is against (and where the probe
    ran, and any category sized unlike the contract's), each ratio carries a short tag."""
    baseline = result["baseline"]
    return {
        "title": f"{variant}: median latency, MTP acceptance, prefix-cache hits\n"
        + "\n".join(textwrap.wrap(f"ratios: {baseline['text']}", 100)),
        "ratio_tag": RATIO_TAGS.get(baseline["kind"], ""),
        "baseline_mark": BASELINE_MARKS.get(baseline["kind"], "baseline_ms"),
    }


def plot(result: dict, variant: str, path) -> None:
    """Median latency per category for every prompt set probed (whisker: p90), the config baseline, and per bar the
    speedup (against what, plot_labels says), MTP acceptance length and prefix-cache hit rate."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a build host
    import matplotlib.pyplot as plt

    labels = plot_labels(result, variant)
    sets = prompt_sets(result)
    names = [c["name"] for c in result["categories"]]
    width = 0.8 / len(sets)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (name, prompt_set) in enumerate(sets.items()):
        categories = prompt_set["categories"]
        medians = [c["median_ms"] for c in categories]
        upper = [c["p90_ms"] - c["median_ms"] for c in categories]
        xs = [x + (i - (len(sets) - 1) / 2) * width for x in range(len(names))]
        speedup = f", {prompt_set['mean_speedup']:.2f}{labels['ratio_tag']}" if prompt_set.get("mean_speedup") else ""
        ax.bar(xs, medians, width, yerr=[[0] * len(xs), upper], capsize=3, label=SET_LABELS[name] + speedup)
        for x, c in zip(xs, categories, strict=True):
            note = f"{c['speedup']:.2f}×" if c["speedup"] else ""
            if c["mean_acceptance_length"]:
                note += f"\nacc {c['mean_acceptance_length']:.2f}"
            hit_rate = (c.get("prefix_cache") or {}).get("hit_rate")
            if hit_rate is not None:
                note += f"\nhit {hit_rate:.0%}"
            ax.annotate(
                note,
                (x, c["median_ms"]),
                ha="center",
                va="bottom",
                fontsize=6,
                textcoords="offset points",
                xytext=(0, 2),
            )
    baselines = [c["baseline_ms"] for c in result["categories"]]
    if all(baselines):
        ax.scatter(
            range(len(names)), baselines, marker="_", s=600, color="black", zorder=3, label=labels["baseline_mark"]
        )
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("median latency, ms (whisker: p90)")
    ax.set_title(labels["title"], fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compile_cache_verdict(start_log: str, require_hit: bool) -> dict:
    """What the built image's vLLM said about its baked compile cache on this start. With require_hit, no
    "Directly load" line, or a reload failure, fails the stage: the cache bake_compile_cache baked is dead weight."""
    evidence = cache_evidence(start_log)
    verdict = {
        "hit": bool(evidence["hits"]) and not evidence["misses"],
        "evidence": evidence["hits"],
        "load_failures": evidence["misses"],
    }
    if require_hit and not verdict["hit"]:
        raise StageError(
            "the image did not load the compile cache bake_compile_cache baked into it "
            f"(vLLM said: {evidence['misses'] or 'no Directly load line'}): every start compiles again and the "
            "cache is dead weight. Set image.require_cache_hit: false to ship it anyway."
        )
    return verdict


def main(job) -> None:
    from lib.containers import container_bandwidth, recorded_image, run_container

    image = json.loads(Path(job.input.image).read_text())
    run = job.params.run
    image_id = recorded_image(image)
    with run_container(image_id, gpus=run["gpus"], shm_size=run["shm_size"], name_prefix="latency-probe") as container:
        cold_start_s = container.wait_ready(run["ping_timeout_s"])
        compile_cache = compile_cache_verdict(container.logs(tail=100000), job.params.require_cache_hit)
        result = probe(container.base_url, job.params.model_name, job.params.probe, job.input.varied_text)
        # after the timed runs, which it leaves unchanged: the lossless check's batched case (scripts/lossless.py)
        result["batch"] = concurrent_batch(
            container.base_url, job.params.model_name, job.params.probe, job.input.varied_text
        )
        bandwidth = container_bandwidth(container)  # after the probe: it must not share the device with a request
    result.update(
        image=image["ref"],
        image_id=image_id,
        network=container.network,
        cold_start_s=cold_start_s,
        compile_cache=compile_cache,
        device_bandwidth=bandwidth,
        warmup=job.params.probe["warmup"],
        ignore_eos=job.params.probe["ignore_eos"],
        baseline=probe_baseline(job.params.probe["categories"], job.params.contract, bandwidth["device"]),
    )
    validate_json(result, job.input.schema)
    write_json(job.output.latency, result)
    plot(result, job.wildcards.variant, job.output.plot)


if __name__ == "__main__":
    from lib.stage import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
