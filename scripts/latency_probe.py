"""Time the competition's prompt/output categories against the built image, one request at a time."""

import json
import statistics
import time
import urllib.request
from pathlib import Path

from common import StageError, validate_json, write_json


def post_json(base_url: str, path: str, body: dict, timeout: float = 600) -> dict:
    request = urllib.request.Request(base_url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)


def build_prompt(base_url: str, model: str, pieces: list[str], n_tokens: int) -> str:
    """Exactly n_tokens of the served tokenizer's tokens, from `pieces` in turn (cycled when too few).

    Each piece is tokenized on its own, so no request ever exceeds the server's max_model_len."""
    tokens: list[int] = []
    cache: dict[str, list[int]] = {}
    while len(tokens) < n_tokens:
        for piece in pieces:
            if piece not in cache:
                cache[piece] = post_json(base_url, "/tokenize", {"model": model, "prompt": piece,
                                                                 "add_special_tokens": False})["tokens"]
            if not cache[piece]:
                raise StageError(f"prompt text {piece[:40]!r} has no tokens")
            tokens += cache[piece]
            if len(tokens) >= n_tokens:
                break
    return post_json(base_url, "/detokenize", {"model": model, "tokens": tokens[:n_tokens]})["prompt"]


def timed_completion(base_url: str, model: str, prompt: str, max_tokens: int, ignore_eos: bool) -> dict:
    """One streamed /v1/completions request: end-to-end latency, time to first token, tokens produced."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": ignore_eos, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(base_url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    first = None
    usage = None
    with urllib.request.urlopen(request, timeout=1800) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if first is None and any(choice.get("text") for choice in chunk.get("choices", [])):
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    output_tokens = (usage or {}).get("completion_tokens", 0)
    if first is None or output_tokens == 0:
        raise StageError("the server streamed no tokens for a /v1/completions request")
    itl = (end - first) / (output_tokens - 1) if output_tokens > 1 else 0.0
    return {"latency_ms": (end - start) * 1e3, "ttft_ms": (first - start) * 1e3, "itl_ms": itl * 1e3,
            "output_tokens": output_tokens}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = (len(ordered) - 1) * q
    low, high = int(index), min(int(index) + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (index - low)


def summarize(category: dict, runs: list[dict]) -> dict:
    latencies = [run["latency_ms"] for run in runs]
    median = statistics.median(latencies)
    baseline = category.get("baseline_ms")
    return {
        "name": category["name"], "prompt_tokens": category["prompt_tokens"],
        "output_tokens_requested": category["output_tokens"],
        "output_tokens_mean": statistics.mean(run["output_tokens"] for run in runs),
        "runs": len(runs), "median_ms": median, "p90_ms": percentile(latencies, 0.9),
        "p99_ms": percentile(latencies, 0.99),
        "ttft_median_ms": statistics.median(run["ttft_ms"] for run in runs),
        "itl_median_ms": statistics.median(run["itl_ms"] for run in runs),
        "baseline_ms": baseline, "speedup": baseline / median if baseline else None,
        "latencies_ms": latencies,
    }


SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")


def spec_counters(base_url: str) -> dict[str, float]:
    """vLLM's speculative-decoding counters from /metrics, summed over label sets (absent without speculation)."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=60) as response:
        text = response.read().decode()
    totals = dict.fromkeys(SPEC_COUNTERS, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0].removesuffix("_total")
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def mean_acceptance_length(before: dict, after: dict) -> float | None:
    """Tokens a verify step yields on average: 1 + accepted drafts per draft round (None if nothing drafted)."""
    drafts = after["vllm:spec_decode_num_drafts"] - before["vllm:spec_decode_num_drafts"]
    accepted = after["vllm:spec_decode_num_accepted_tokens"] - before["vllm:spec_decode_num_accepted_tokens"]
    return 1 + accepted / drafts if drafts > 0 else None


def varied_paragraphs(path: str) -> list[str]:
    """Natural text of varied paragraphs, so a speculator that copies from the prompt gains nothing special."""
    paragraphs = [line.strip() + " " for line in Path(path).read_text().splitlines() if line.strip()]
    if not paragraphs:
        raise StageError(f"{path} has no text for the varied prompt set")
    return paragraphs


def probe_set(base_url: str, model: str, probe_settings: dict, pieces: list[str], log=print) -> dict:
    """Every category, with prompts made of `pieces` (see build_prompt)."""
    categories = []
    for category in probe_settings["categories"]:
        prompt = build_prompt(base_url, model, pieces, category["prompt_tokens"])
        run = lambda: timed_completion(base_url, model, prompt, category["output_tokens"], probe_settings["ignore_eos"])
        for _ in range(probe_settings["warmup"]):
            run()
        before = spec_counters(base_url)
        runs = [run() for _ in range(probe_settings["runs"])]
        categories.append(dict(summarize(category, runs),
                               mean_acceptance_length=mean_acceptance_length(before, spec_counters(base_url))))
        log(f"{category['name']}: median {categories[-1]['median_ms']:.0f} ms over {len(runs)} runs, "
            f"mean acceptance length {categories[-1]['mean_acceptance_length']}")
    speedups = [c["speedup"] for c in categories if c["speedup"] is not None]
    return {"categories": categories, "mean_speedup": statistics.mean(speedups) if speedups else None}


def probe(base_url: str, model: str, probe_settings: dict, varied_path: str, log=print) -> dict:
    """The competition's prompts (one sentence repeated) and varied text: a large gap means prompt copying."""
    log("prompt set: repeated sentence (competition style)")
    result = probe_set(base_url, model, probe_settings, [probe_settings["sentence"]], log)
    log(f"prompt set: varied text ({varied_path})")
    result["varied"] = probe_set(base_url, model, probe_settings, varied_paragraphs(varied_path), log)
    return result


def plot(result: dict, title: str, path) -> None:
    """Median latency per category for both prompt sets (whisker: p90), the config baseline and the speedup."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a build host
    import matplotlib.pyplot as plt

    names = [c["name"] for c in result["categories"]]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for offset, (label, categories) in zip((-0.2, 0.2), [("repeated sentence", result["categories"]),
                                                         ("varied text", result["varied"]["categories"])]):
        medians = [c["median_ms"] for c in categories]
        upper = [c["p90_ms"] - c["median_ms"] for c in categories]
        xs = [i + offset for i in range(len(names))]
        ax.bar(xs, medians, 0.4, yerr=[[0] * len(xs), upper], capsize=3, label=label)
        for x, c in zip(xs, categories):
            note = f"{c['speedup']:.2f}x" if c["speedup"] else ""
            if c["mean_acceptance_length"]:
                note += f"\nacc {c['mean_acceptance_length']:.2f}"
            ax.annotate(note, (x, c["median_ms"]), ha="center", va="bottom", fontsize=7,
                        textcoords="offset points", xytext=(0, 2))
    baselines = [c["baseline_ms"] for c in result["categories"]]
    if all(baselines):
        ax.scatter(range(len(names)), baselines, marker="_", s=600, color="black", zorder=3, label="baseline_ms")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("median latency, ms (whisker: p90)")
    ax.set_title(f"{title}: speedup vs baseline_ms, MTP acceptance length")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(job) -> None:
    from bake_compile_cache import cache_evidence
    from containers import run_container

    image = json.loads(Path(job.input.image).read_text())
    run = job.params.run
    with run_container(image["ref"], gpus=run["gpus"], shm_size=run["shm_size"], name_prefix="latency-probe") as container:
        cold_start_s = container.wait_ready(run["ping_timeout_s"])
        evidence = cache_evidence(container.logs(tail=100000))
        result = probe(container.base_url, job.params.model_name, job.params.probe, job.input.varied_text)
    compile_cache = {"hit": bool(evidence["hits"]) and not evidence["misses"], "evidence": evidence["hits"],
                     "load_failures": evidence["misses"]}
    result.update(image=image["ref"], image_id=image["id"], cold_start_s=cold_start_s, compile_cache=compile_cache,
                  warmup=job.params.probe["warmup"], ignore_eos=job.params.probe["ignore_eos"])
    validate_json(result, job.input.schema)
    write_json(job.output.latency, result)
    plot(result, job.wildcards.variant, job.output.plot)


if __name__ == "__main__":
    from common import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
