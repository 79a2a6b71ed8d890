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


def build_prompt(base_url: str, model: str, sentence: str, n_tokens: int) -> str:
    """`sentence` repeated until the served tokenizer counts exactly n_tokens (cut on a token boundary)."""
    per_sentence = len(post_json(base_url, "/tokenize", {"model": model, "prompt": sentence,
                                                         "add_special_tokens": False})["tokens"])
    text = sentence * (n_tokens // max(per_sentence, 1) + 2)
    tokens = post_json(base_url, "/tokenize", {"model": model, "prompt": text, "add_special_tokens": False})["tokens"]
    prompt = post_json(base_url, "/detokenize", {"model": model, "tokens": tokens[:n_tokens]})["prompt"]
    return prompt


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


def probe(base_url: str, model: str, probe_settings: dict, log=print) -> dict:
    categories = []
    for category in probe_settings["categories"]:
        prompt = build_prompt(base_url, model, probe_settings["sentence"], category["prompt_tokens"])
        run = lambda: timed_completion(base_url, model, prompt, category["output_tokens"], probe_settings["ignore_eos"])
        for _ in range(probe_settings["warmup"]):
            run()
        runs = [run() for _ in range(probe_settings["runs"])]
        categories.append(summarize(category, runs))
        log(f"{category['name']}: median {categories[-1]['median_ms']:.0f} ms over {len(runs)} runs")
    speedups = [c["speedup"] for c in categories if c["speedup"] is not None]
    return {"categories": categories, "mean_speedup": statistics.mean(speedups) if speedups else None}


def main(job) -> None:
    from containers import run_container

    image = json.loads(Path(job.input.image).read_text())
    run = job.params.run
    with run_container(image["ref"], gpus=run["gpus"], shm_size=run["shm_size"], name_prefix="latency-probe") as container:
        cold_start_s = container.wait_ready(run["ping_timeout_s"])
        result = probe(container.base_url, job.params.model_name, job.params.probe)
    result.update(image=image["ref"], image_id=image["id"], cold_start_s=cold_start_s,
                  warmup=job.params.probe["warmup"], ignore_eos=job.params.probe["ignore_eos"])
    validate_json(result, job.input.schema)
    write_json(job.output.latency, result)


if __name__ == "__main__":
    from common import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
