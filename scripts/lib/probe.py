"""Timing a served model the way the competition does: exact-length prompts, one streamed request at a time,
MTP acceptance and prefix-cache hits from /metrics. The latency probe measures with it; the bake warms the same
shapes up.

Three prompt sets (probe.sets), each timed over every category:

- repeated: the competition's prompts, one sentence repeated; what select ranks by. A speculator that copies
  from the prompt (and a prefix cache, since the same prompt comes back every run) gains more here than it will
  on real traffic.
- varied: natural text of varied paragraphs (probe.varied_text), one prompt per category reused by its warm-ups and
  runs: copying the prompt stops paying, reuse across requests still can.
- fresh: the same text, but every warm-up and every timed run gets a prompt of its own, starting at a different
  paragraph, and no two prompts of the whole probe share their first FRESH_LEAD_TOKENS tokens, so no cached KV
  block (vLLM's blocks are at least 16 tokens) can serve a later request: what a new user sees.

Every prompt is exactly prompt_tokens tokens as the server tokenizes it (exact_prompt); each record keeps the count
the server reported (prompt_tokens_served).
"""

import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lib.openai_client import get_text, post_json, stream_post
from lib.progress import Heartbeat, elapsed
from lib.stage import StageError

PROMPT_SETS = ("repeated", "varied", "fresh")
COMPETITION_SET = "repeated"  # the competition's prompts: what select ranks by
FRESH_SEED = 0
FRESH_LEAD_TOKENS = 16  # vLLM's smallest KV block: prompts differing in these share no cached block

SET_DESCRIPTIONS = {
    "repeated": "the competition's style: probe.sentence repeated to prompt_tokens; one prompt per category, "
    "reused by its warm-ups and timed runs",
    "varied": "probe.varied_text paragraphs in file order, cycled to prompt_tokens; one prompt per category, "
    "reused by its warm-ups and timed runs",
    "fresh": f"a prompt of its own for every warm-up and timed run: probe.varied_text paragraphs from a start "
    f"paragraph drawn without replacement (random.Random({FRESH_SEED}) shuffle of the paragraphs), then in "
    f"file order, cycled to prompt_tokens; no two prompts of the probe (any set) share their first "
    f"{FRESH_LEAD_TOKENS} tokens, so no prefix-cache block can be reused (prompt_starts: the start "
    f"paragraphs, warm-ups first)",
}


def prompt_tokens(
    base_url: str, model: str, pieces: list[str], n_tokens: int, cache: dict[str, list[int]] | None = None
) -> list[int]:
    """Exactly n_tokens of the served tokenizer's tokens, from `pieces` in turn (cycled when too few).

    Each piece is tokenized on its own (once per `cache`), so no request ever exceeds the server's max_model_len."""
    tokens: list[int] = []
    cache = {} if cache is None else cache
    while len(tokens) < n_tokens:
        for piece in pieces:
            if piece not in cache:
                cache[piece] = post_json(
                    base_url, "/tokenize", {"model": model, "prompt": piece, "add_special_tokens": False}
                )["tokens"]
            if not cache[piece]:
                raise StageError(f"prompt text {piece[:40]!r} has no tokens")
            tokens += cache[piece]
            if len(tokens) >= n_tokens:
                break
    return tokens[:n_tokens]


def detokenize(base_url: str, model: str, tokens: list[int]) -> str:
    return post_json(base_url, "/detokenize", {"model": model, "tokens": tokens})["prompt"]


def tokenize(base_url: str, model: str, text: str) -> list[int]:
    return post_json(base_url, "/tokenize", {"model": model, "prompt": text, "add_special_tokens": False})["tokens"]


def exact_prompt(base_url: str, model: str, tokens_of, n_tokens: int, tries: int = 6) -> tuple[str, list[int]]:
    """(text, its tokens): a text the server tokenizes to exactly n_tokens tokens, from tokens_of(k) (k source
    tokens). Pieces tokenized one by one join differently in one text (". " + "The" is ". The": the repeated sentence
    lost a token a repetition), so the server's own tokens of the joined text are cut to n_tokens, from more source
    tokens when the join came out short."""
    k = n_tokens
    for _ in range(tries):
        ids = tokenize(base_url, model, detokenize(base_url, model, tokens_of(k)))
        for _ in range(3):
            if len(ids) < n_tokens:
                break
            text = detokenize(base_url, model, ids[:n_tokens])
            again = tokenize(base_url, model, text)
            if len(again) == n_tokens:
                return text, again
            ids = again
        k += max(n_tokens - len(ids), 0) + 8
    raise StageError(f"found no prompt text of exactly {n_tokens} tokens in {tries} tries")


def build_prompt(
    base_url: str, model: str, pieces: list[str], n_tokens: int, cache: dict[str, list[int]] | None = None
) -> str:
    """A text of exactly n_tokens tokens as the server counts them, made of `pieces` in turn (see prompt_tokens)."""
    return exact_prompt(base_url, model, lambda k: prompt_tokens(base_url, model, pieces, k, cache), n_tokens)[0]


# The lossless reference's most likely ids per position: enough to tell a near tie (lib/lossless.py) from a flip.
REFERENCE_TOP_LOGPROBS = 2


def timed_completion(
    base_url: str,
    model: str,
    prompt: str | list[int],
    max_tokens: int,
    ignore_eos: bool,
    top_logprobs: int | None = None,
) -> dict:
    """One streamed /v1/completions request: end-to-end latency, time to first token, tokens produced, and the
    generated token ids (vLLM's return_token_ids: each chunk carries its own ids, the first one the prompt's too;
    a few bytes a chunk, so every request asks for them and the timed runs stay alike). With `top_logprobs` (the
    lossless check's reference only, never a timed probe run) also each position's most likely ids and logprobs.
    `prompt` is a text or a list of token ids."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": ignore_eos,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if top_logprobs:
        body.update(logprobs=top_logprobs, return_tokens_as_token_ids=True)
    tops: list[list[list]] = []
    start = time.perf_counter()
    first = None
    usage = None
    token_ids: list[int] = []
    prompt_ids = None
    for chunk in stream_post(base_url, "/v1/completions", body):
        for choice in chunk.get("choices", []):
            prompt_ids = prompt_ids or choice.get("prompt_token_ids")
            ids = choice.get("token_ids")
            if ids:
                token_ids += ids
            for position in (choice.get("logprobs") or {}).get("top_logprobs") or []:
                ranked = sorted((position or {}).items(), key=lambda item: -item[1])
                tops.append([[int(token.rsplit(":", 1)[1]), logprob] for token, logprob in ranked])
            if first is None and (choice.get("text") or ids):
                first = time.perf_counter()
        usage = chunk.get("usage") or usage
    end = time.perf_counter()
    output_tokens = (usage or {}).get("completion_tokens", 0)
    if first is None or output_tokens == 0:
        raise StageError("the server streamed no tokens for a /v1/completions request")
    if token_ids and len(token_ids) != output_tokens:
        raise StageError(f"the server streamed {len(token_ids)} token ids for {output_tokens} completion tokens")
    itl = (end - first) / (output_tokens - 1) if output_tokens > 1 else 0.0
    return {
        "latency_ms": (end - start) * 1e3,
        "ttft_ms": (first - start) * 1e3,
        "itl_ms": itl * 1e3,
        "output_tokens": output_tokens,
        "prompt_tokens": (usage or {}).get("prompt_tokens"),
        "token_ids": token_ids or None,
        "top_logprobs": tops or None,
        "prompt_token_ids": prompt_ids,
    }


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
        "name": category["name"],
        "prompt_tokens": category["prompt_tokens"],
        "output_tokens_requested": category["output_tokens"],
        "output_tokens_mean": statistics.mean(run["output_tokens"] for run in runs),
        "runs": len(runs),
        "median_ms": median,
        "p90_ms": percentile(latencies, 0.9),
        "p99_ms": percentile(latencies, 0.99),
        "ttft_median_ms": statistics.median(run["ttft_ms"] for run in runs),
        "itl_median_ms": statistics.median(run["itl_ms"] for run in runs),
        "baseline_ms": baseline,
        "speedup": baseline / median if baseline else None,
        "latencies_ms": latencies,
    }


SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")
PREFIX_COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")  # in tokens


def counters(base_url: str, names=SPEC_COUNTERS + PREFIX_COUNTERS) -> dict[str, float]:
    """vLLM counters from /metrics, summed over label sets (0 when absent: no speculation, no prefix caching)."""
    totals = dict.fromkeys(names, 0.0)
    for line in get_text(base_url, "/metrics").splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0].removesuffix("_total")
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def spec_counters(base_url: str) -> dict[str, float]:
    """vLLM's speculative-decoding counters from /metrics, summed over label sets (absent without speculation)."""
    return counters(base_url, SPEC_COUNTERS)


def mean_acceptance_length(before: dict, after: dict) -> float | None:
    """Tokens a verify step yields on average: 1 + accepted drafts per draft round (None if nothing drafted)."""
    drafts = after["vllm:spec_decode_num_drafts"] - before["vllm:spec_decode_num_drafts"]
    accepted = after["vllm:spec_decode_num_accepted_tokens"] - before["vllm:spec_decode_num_accepted_tokens"]
    return 1 + accepted / drafts if drafts > 0 else None


def spec_decode_delta(before: dict, after: dict) -> dict:
    return {
        "drafts": after["vllm:spec_decode_num_drafts"] - before["vllm:spec_decode_num_drafts"],
        "accepted_tokens": (
            after["vllm:spec_decode_num_accepted_tokens"] - before["vllm:spec_decode_num_accepted_tokens"]
        ),
    }


def prefix_cache_delta(before: dict, after: dict) -> dict:
    """Prompt tokens looked up in vLLM's prefix cache and found there; hit_rate None when nothing was looked up
    (prefix caching off)."""
    queries = after["vllm:prefix_cache_queries"] - before["vllm:prefix_cache_queries"]
    hits = after["vllm:prefix_cache_hits"] - before["vllm:prefix_cache_hits"]
    return {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries > 0 else None}


def varied_paragraphs(path: str) -> list[str]:
    """Natural text of varied paragraphs, so a speculator that copies from the prompt gains nothing special."""
    paragraphs = [line.strip() + " " for line in Path(path).read_text().splitlines() if line.strip()]
    if not paragraphs:
        raise StageError(f"{path} has no text for the varied prompt set")
    return paragraphs


class FreshPrompts:
    """Prompts that never repeat: each starts at a paragraph no other prompt started at, and its first
    FRESH_LEAD_TOKENS tokens differ from every other prompt's (those of `reserved`, the other sets', too)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        paragraphs: list[str],
        reserved: list[list[int]],
        cache: dict[str, list[int]] | None = None,
    ):
        self.base_url, self.model, self.paragraphs = base_url, model, paragraphs
        self.cache = {} if cache is None else cache
        self.starts = list(range(len(paragraphs)))
        random.Random(FRESH_SEED).shuffle(self.starts)
        self.leads = {tuple(tokens[:FRESH_LEAD_TOKENS]) for tokens in reserved if tokens}

    def take(self, n_tokens: int) -> tuple[int, str]:
        """(start paragraph, text of exactly n_tokens tokens) of the next prompt."""
        while self.starts:
            start = self.starts.pop(0)
            pieces = self.paragraphs[start:] + self.paragraphs[:start]
            text, tokens = exact_prompt(
                self.base_url,
                self.model,
                lambda k, pieces=pieces: prompt_tokens(self.base_url, self.model, pieces, k, self.cache),
                n_tokens,
            )
            lead = tuple(tokens[:FRESH_LEAD_TOKENS])
            # a shorter lead (a prompt under FRESH_LEAD_TOKENS) clashes with any lead it begins
            if not any(other[: len(lead)] == lead[: len(other)] for other in self.leads):
                self.leads.add(lead)
                return start, text
        raise StageError(
            f"the fresh prompt set ran out of start paragraphs ({len(self.paragraphs)} in "
            f"probe.varied_text, fewer with distinct first {FRESH_LEAD_TOKENS} tokens): it needs one per "
            f"warm-up and timed run of every category; give probe.varied_text more paragraphs"
        )

    def prompts(self, n_tokens: int, count: int) -> tuple[list[int], list[str]]:
        taken = [self.take(n_tokens) for _ in range(count)]
        return [start for start, _ in taken], [text for _, text in taken]


class RunProgress:
    """Requests done in the current category, for the probe's progress lines (lib/progress.py)."""

    def __init__(self, names: list[str], clock=time.monotonic):
        self.names, self.clock = names, clock
        self.start(None, 0, 0)

    def start(self, name: str | None, warmups: int, runs: int) -> None:
        self.category, self.warmups, self.runs = name, warmups, runs
        self.warmups_done = self.runs_done = 0
        self.category_started = self.clock()

    def line(self, seconds: float) -> str:
        index = self.names.index(self.category) + 1 if self.category in self.names else 0
        return (
            f"[probe] category {self.category} ({index}/{len(self.names)}): {self.warmups_done}/{self.warmups} "
            f"warm-ups and {self.runs_done}/{self.runs} timed runs done in "
            f"{elapsed(self.clock() - self.category_started)}; {elapsed(seconds)} on this prompt set"
        )


def run_set(base_url: str, model: str, probe_settings: dict, prompts_of, description: str, log=print) -> dict:
    """Every category, timed one request at a time. prompts_of(category) -> (extra fields for the category record,
    one prompt per warm-up then per timed run). A line every PROGRESS_INTERVAL_S (lib/progress.py) says how many
    requests of the current category are done."""
    categories = []
    totals = []
    progress = RunProgress([c["name"] for c in probe_settings["categories"]])
    with Heartbeat(progress.line, log=log):
        for category in probe_settings["categories"]:
            extra, prompts = prompts_of(category)
            warmup, max_tokens = probe_settings["warmup"], category["output_tokens"]
            reference_only = probe_settings.get("first_run_only")
            if reference_only:
                # the lossless check's reference (scripts/lossless_reference.py): the same prompts drawn the same way
                # (a fresh set's draws depend on the warm-up count), but only the first timed run's is sent
                prompts, warmup = prompts[warmup : warmup + 1], 0
            progress.start(category["name"], warmup, len(prompts) - warmup)
            for prompt in prompts[:warmup]:
                timed_completion(base_url, model, prompt, max_tokens, probe_settings["ignore_eos"])
                progress.warmups_done += 1
            before = counters(base_url)
            runs = []
            for prompt in prompts[warmup:]:
                runs.append(
                    timed_completion(
                        base_url,
                        model,
                        prompt,
                        max_tokens,
                        probe_settings["ignore_eos"],
                        top_logprobs=REFERENCE_TOP_LOGPROBS if reference_only else None,
                    )
                )
                progress.runs_done += 1
            after = counters(base_url)
            totals.append((before, after))
            categories.append(
                dict(
                    summarize(category, runs),
                    **extra,
                    prompt_tokens_served=[r["prompt_tokens"] for r in runs],
                    mean_acceptance_length=mean_acceptance_length(before, after),
                    spec_decode=spec_decode_delta(before, after),
                    prefix_cache=prefix_cache_delta(before, after),
                    first_run_token_ids=runs[0]["token_ids"],
                    # the reference's logprobs tell a near tie from a flip; its prompt ids, as the server tokenized
                    # them, start the continuations past a near tie (lib/lossless.py)
                    **(
                        {
                            "first_run_top_logprobs": runs[0]["top_logprobs"],
                            "first_run_prompt_ids": runs[0]["prompt_token_ids"],
                        }
                        if reference_only
                        else {}
                    ),
                )
            )
            c = categories[-1]
            log(
                f"{category['name']}: median {c['median_ms']:.0f} ms over {len(runs)} runs, mean acceptance length "
                f"{c['mean_acceptance_length']}, prefix-cache hit rate {c['prefix_cache']['hit_rate']}"
            )
    speedups = [c["speedup"] for c in categories if c["speedup"] is not None]
    drafts = sum(c["spec_decode"]["drafts"] for c in categories)
    accepted = sum(c["spec_decode"]["accepted_tokens"] for c in categories)
    queries = sum(c["prefix_cache"]["queries"] for c in categories)
    hits = sum(c["prefix_cache"]["hits"] for c in categories)
    return {
        "prompts": description,
        "categories": categories,
        "mean_speedup": statistics.mean(speedups) if speedups else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts > 0 else None,
        "prefix_cache": {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries > 0 else None},
    }


def same_prompt(base_url: str, model: str, probe_settings: dict, pieces: list[str], cache=None):
    """prompts_of for a set whose warm-ups and runs of a category all send one prompt made of `pieces`."""
    count = probe_settings["warmup"] + probe_settings["runs"]
    return lambda category: ({}, [build_prompt(base_url, model, pieces, category["prompt_tokens"], cache)] * count)


def probe_set(
    base_url: str, model: str, probe_settings: dict, pieces: list[str], log=print, description: str | None = None
) -> dict:
    """Every category, with one prompt per category made of `pieces` (see build_prompt)."""
    return run_set(
        base_url,
        model,
        probe_settings,
        same_prompt(base_url, model, probe_settings, pieces),
        description or "one prompt per category from the given text, reused by its warm-ups and runs",
        log,
    )


def fresh_set(base_url: str, model: str, probe_settings: dict, paragraphs: list[str], log=print) -> dict:
    cache: dict[str, list[int]] = {}
    longest = max(c["prompt_tokens"] for c in probe_settings["categories"])
    lead = min(FRESH_LEAD_TOKENS, longest)
    # the repeated and varied sets' prompts begin with these (the server's tokens of their first 2 x lead tokens)
    reserved = [
        tokenize(base_url, model, build_prompt(base_url, model, pieces, min(2 * lead, longest), cache))[:lead]
        for pieces in ([probe_settings["sentence"]], paragraphs)
    ]
    fresh = FreshPrompts(base_url, model, paragraphs, reserved, cache)
    count = probe_settings["warmup"] + probe_settings["runs"]

    def prompts_of(category):
        starts, prompts = fresh.prompts(category["prompt_tokens"], count)
        return {"prompt_starts": starts}, prompts

    return run_set(base_url, model, probe_settings, prompts_of, SET_DESCRIPTIONS["fresh"], log)


def prompt_sets(result: dict) -> dict[str, dict]:
    """The prompt sets a latency record (or a probe result) holds, by name, in PROMPT_SETS order: the competition's
    set is the record's top level (`categories`, `mean_speedup`, ...), the others are `varied` and `fresh`
    (null or absent when not probed)."""
    out = {COMPETITION_SET: result}
    for name in PROMPT_SETS[1:]:
        if result.get(name):
            out[name] = result[name]
    return out


def probe(base_url: str, model: str, probe_settings: dict, varied_path: str, log=print) -> dict:
    """Every set of probe.sets (default all three, see the module's docstring). The competition's set is the top
    level of the result; `varied` and `fresh` are None when not probed."""
    sets = list(probe_settings.get("sets") or PROMPT_SETS)
    unknown = sorted(set(sets) - set(PROMPT_SETS))
    if unknown or COMPETITION_SET not in sets:
        raise StageError(
            f"probe.sets {sets}: must name '{COMPETITION_SET}' (what select ranks by) and only {', '.join(PROMPT_SETS)}"
        )
    log("prompt set: repeated sentence (competition style)")
    result = run_set(
        base_url,
        model,
        probe_settings,
        same_prompt(base_url, model, probe_settings, [probe_settings["sentence"]]),
        SET_DESCRIPTIONS["repeated"],
        log,
    )
    paragraphs = varied_paragraphs(varied_path) if len(sets) > 1 else []
    result["varied"] = result["fresh"] = None
    if "varied" in sets:
        log(f"prompt set: varied text ({varied_path})")
        result["varied"] = run_set(
            base_url,
            model,
            probe_settings,
            same_prompt(base_url, model, probe_settings, paragraphs),
            SET_DESCRIPTIONS["varied"],
            log,
        )
    if "fresh" in sets:
        log(f"prompt set: fresh prompts, one per request ({varied_path})")
        result["fresh"] = fresh_set(base_url, model, probe_settings, paragraphs, log)
    result["prompt_sets"] = [name for name in PROMPT_SETS if name in sets]
    return result


BATCH_SIZE = 4  # concurrent requests of the lossless check's batched case


def batch_requests(probe_settings: dict) -> list[dict]:
    """The concurrent batch's requests: the repeated and the varied prompt (made as those sets make them) of the two
    categories with the fewest prompt tokens (short and medium), two with their category's output_tokens and two with
    half of it, so requests end at different steps and the batch shrinks while it decodes."""
    by_length = sorted(probe_settings["categories"], key=lambda c: c["prompt_tokens"])
    short, medium = (by_length * 2)[:2]
    plan = [("repeated", short, 1), ("varied", short, 2), ("repeated", medium, 2), ("varied", medium, 1)]
    requests = []
    for set_name, category, divisor in plan[:BATCH_SIZE]:
        max_tokens = max(1, category["output_tokens"] // divisor)
        requests.append(
            {
                "name": f"{set_name}-{category['name']}-{max_tokens}",
                "set": set_name,
                "category": category["name"],
                "prompt_tokens": category["prompt_tokens"],
                "max_tokens": max_tokens,
            }
        )
    return requests


def concurrent_batch(
    base_url: str,
    model: str,
    probe_settings: dict,
    varied_path: str,
    top_logprobs: int | None = None,
) -> dict:
    """The requests of batch_requests sent at once (greedy, not timed), each one's output ids recorded. The latency
    probe sends them after its timed runs, the lossless reference sends the same batch with `top_logprobs`, and
    lib/lossless.py compares the two: speculation at batch size > 1 runs code the one-at-a-time probe never does
    (drafts of several requests verified together, requests joining and leaving the batch). With top_logprobs each
    request also keeps its logprobs and its prompt ids as the server tokenized them (as run_set's reference does)."""
    import threading

    requests = batch_requests(probe_settings)
    pieces = {"repeated": [probe_settings["sentence"]], "varied": varied_paragraphs(varied_path)}
    cache: dict[str, list[int]] = {}
    prompts = [build_prompt(base_url, model, pieces[r["set"]], r["prompt_tokens"], cache) for r in requests]
    gate = threading.Barrier(len(requests))

    def send(request: dict, prompt: str) -> tuple[float, float, dict]:
        gate.wait(timeout=60)  # every request leaves together
        started = time.perf_counter()
        answer = timed_completion(
            base_url, model, prompt, request["max_tokens"], probe_settings["ignore_eos"], top_logprobs
        )
        return started, time.perf_counter(), answer

    with ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(send, requests, prompts))
    out = []
    for request, (_, _, answer) in zip(requests, answers, strict=True):
        out.append(
            dict(
                request,
                prompt_tokens_served=answer["prompt_tokens"],
                output_tokens=answer["output_tokens"],
                token_ids=answer["token_ids"],
                **(
                    {"top_logprobs": answer["top_logprobs"], "prompt_token_ids": answer["prompt_token_ids"]}
                    if top_logprobs
                    else {}
                ),
            )
        )
    return {
        "prompts": "the repeated and the varied set's prompts of the two shortest categories, sent at once, greedy; "
        "max_tokens the category's output_tokens or half of it; not timed",
        # every request was sent before any had its answer (the client's view; max_num_seqs decides the server's)
        "in_flight_together": max(start for start, _, _ in answers) < min(end for _, end, _ in answers),
        "requests": out,
    }


def warm_up(base_url: str, model: str, categories: list[dict], sentence: str, log=print) -> None:
    """One request per probe size (compiled graphs and kernels are specialised by shape), plus chat both ways.
    A line every PROGRESS_INTERVAL_S (lib/progress.py) names the warm-up under way (the first ones compile)."""
    steps = [c["name"] for c in categories] + ["chat (thinking off)", "chat (thinking on)"]
    state = {"done": 0}

    def progress(seconds: float) -> str:
        current = steps[min(state["done"], len(steps) - 1)]
        return f"[warm-up] {state['done']}/{len(steps)} warm-ups done, now {current}: {elapsed(seconds)} in all"

    with Heartbeat(progress, log=log):
        for category in categories:
            prompt = build_prompt(base_url, model, [sentence], category["prompt_tokens"])
            result = timed_completion(base_url, model, prompt, category["output_tokens"], ignore_eos=True)
            state["done"] += 1
            log(f"warm-up {category['name']}: {result['latency_ms']:.0f} ms")
        for thinking in (False, True):
            post_json(
                base_url,
                "/v1/chat/completions",
                {
                    "model": model,
                    "messages": [{"role": "user", "content": "Say hello."}],
                    "max_tokens": 16,
                    "temperature": 0.0,
                    "chat_template_kwargs": {"enable_thinking": thinking},
                },
            )
            state["done"] += 1
