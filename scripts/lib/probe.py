"""Timing a served model the way the competition does: exact-length prompts, one streamed request at a time,
MTP acceptance from /metrics. The latency probe measures with it; the bake warms the same shapes up."""

import statistics
import time
from pathlib import Path

from lib.openai_client import get_text, post_json, stream_post
from lib.stage import StageError


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
    start = time.perf_counter()
    first = None
    usage = None
    for chunk in stream_post(base_url, "/v1/completions", body):
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
    totals = dict.fromkeys(SPEC_COUNTERS, 0.0)
    for line in get_text(base_url, "/metrics").splitlines():
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


def warm_up(base_url: str, model: str, categories: list[dict], sentence: str, log=print) -> None:
    """One request per probe size (compiled graphs and kernels are specialised by shape), plus chat both ways."""
    for category in categories:
        prompt = build_prompt(base_url, model, [sentence], category["prompt_tokens"])
        result = timed_completion(base_url, model, prompt, category["output_tokens"], ignore_eos=True)
        log(f"warm-up {category['name']}: {result['latency_ms']:.0f} ms")
    for thinking in (False, True):
        post_json(base_url, "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16,
            "temperature": 0.0, "chat_template_kwargs": {"enable_thinking": thinking}})
