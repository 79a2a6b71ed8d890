"""The probe (lib/probe.py, latency_probe's plot) against fake servers: prompt building, the three prompt sets (fresh
prompts distinct, exact-length, sharing no cached block), acceptance and prefix-cache hits from /metrics, statistics,
the first timed run's token ids."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

import latency_probe
from conftest import ROOT
from lib import probe
from lib.baseline import probe_baseline
from lib.dag.config import contract_categories
from lib.stage import StageError, validate_json

METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} %(drafts)s
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} %(accepted)s
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 99.0
"""


@pytest.fixture
def fake_server():
    """/tokenize splits on spaces (one token per word, ids = word lengths), /detokenize echoes, /metrics counts."""
    state = {"drafts": 0.0, "accepted": 0.0, "tokenized": []}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, payload, content_type="application/json"):
            data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.reply(METRICS % state, "text/plain")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/tokenize":
                state["tokenized"].append(body["prompt"])
                self.reply({"tokens": [len(word) for word in body["prompt"].split()]})
            else:
                self.reply({"prompt": " ".join("x" * t for t in body["tokens"])})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", state
    server.shutdown()


def test_build_prompt_gives_exactly_n_tokens_from_cycled_pieces(fake_server):
    base_url, state = fake_server
    prompt = probe.build_prompt(base_url, "m", ["a bb ccc ", "dddd "], 7)
    assert [len(word) for word in prompt.split()] == [1, 2, 3, 4, 1, 2, 3]
    # each distinct piece tokenized once; then the joined text, to count its tokens as the server will
    assert state["tokenized"][:2] == ["a bb ccc ", "dddd "] and set(state["tokenized"][2:]) == {prompt}


def test_build_prompt_refuses_text_without_tokens(fake_server):
    base_url, _ = fake_server
    with pytest.raises(StageError, match="no tokens"):
        probe.build_prompt(base_url, "m", ["   "], 3)


def test_acceptance_length_from_counter_deltas(fake_server):
    base_url, state = fake_server
    state.update(drafts=10.0, accepted=4.0)
    before = probe.spec_counters(base_url)
    assert before == {"vllm:spec_decode_num_drafts": 10.0, "vllm:spec_decode_num_accepted_tokens": 4.0}
    state.update(drafts=30.0, accepted=34.0)
    assert probe.mean_acceptance_length(before, probe.spec_counters(base_url)) == pytest.approx(2.5)
    assert probe.mean_acceptance_length(before, before) is None  # no speculation, no number


def test_summary_statistics_and_speedup():
    runs = [{"latency_ms": ms, "ttft_ms": 10.0, "itl_ms": 2.0, "output_tokens": 8} for ms in (100, 200, 300, 400)]
    summary = probe.summarize({"name": "short", "prompt_tokens": 64, "output_tokens": 8, "baseline_ms": 500.0}, runs)
    assert summary["median_ms"] == 250 and summary["speedup"] == pytest.approx(2.0)
    assert summary["p90_ms"] == pytest.approx(370.0) and summary["p99_ms"] == pytest.approx(397.0)
    no_baseline = probe.summarize({"name": "s", "prompt_tokens": 1, "output_tokens": 8}, runs)
    assert no_baseline["speedup"] is None


def test_varied_paragraphs_refuse_an_empty_file(tmp_path):
    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(StageError, match="no text"):
        probe.varied_paragraphs(str(tmp_path / "empty.txt"))
    (tmp_path / "two.txt").write_text("One.\n\nTwo.\n")
    assert probe.varied_paragraphs(str(tmp_path / "two.txt")) == ["One. ", "Two. "]


def test_plot_draws_every_prompt_set(tmp_path):
    runs = [{"latency_ms": ms, "ttft_ms": 10.0, "itl_ms": 2.0, "output_tokens": 8} for ms in (100, 200, 300)]
    categories = [
        dict(
            probe.summarize({"name": name, "prompt_tokens": 64, "output_tokens": 8, "baseline_ms": 500.0}, runs),
            mean_acceptance_length=1.5,
            prefix_cache={"queries": 64, "hits": 48, "hit_rate": 0.75},
        )
        for name in ("short", "long")
    ]
    prompt_set = {"categories": categories, "mean_speedup": 2.5}
    result = {
        "categories": categories,
        "mean_speedup": 2.5,
        "varied": prompt_set,
        "fresh": prompt_set,
        "baseline": probe_baseline(CATEGORIES, contract_categories(), "cpu"),
    }
    assert list(probe.prompt_sets(result)) == ["repeated", "varied", "fresh"]
    latency_probe.plot(result, "tiny-awq-mtp1", tmp_path / "latency.png")
    assert (tmp_path / "latency.png").read_bytes()[:4] == b"\x89PNG"
    latency_probe.plot(dict(result, varied=None, fresh=None), "tiny-awq-mtp1", tmp_path / "one.png")
    assert (tmp_path / "one.png").read_bytes()[:4] == b"\x89PNG"


def tiny_probe_categories() -> list[dict]:
    return yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())["probe"]["categories"]


def test_the_record_says_its_ratios_are_against_the_contracts_a10g_baseline_and_how_the_sizes_differ():
    """The tiny profile probes a tiny model on a CPU against the contract's A10G baseline_ms, with a 4,096-token long
    category: its record says what its speedups are against, where it ran, and the size that is not the contract's."""
    tiny = probe_baseline(tiny_probe_categories(), contract_categories(), "cpu")
    assert tiny["kind"] == "contract_a10g"
    assert tiny["label"] == "× the contract's A10G baseline (meaningful on an A10G only)"
    assert tiny["sizes_differ"] == [
        {
            "name": "long",
            "prompt_tokens": 4096,
            "output_tokens": 256,
            "contract_prompt_tokens": 8192,
            "contract_output_tokens": 256,
        }
    ]
    assert "probed on cpu" in tiny["text"]
    assert "the long category sends 4,096 prompt tokens, not the contract's 8,192" in tiny["text"]
    # the real profile's categories are the contract's: nothing differs
    real = probe_baseline(contract_categories(), contract_categories(), "NVIDIA A10G")
    assert (real["kind"], real["sizes_differ"]) == ("contract_a10g", [])
    assert real["text"] == "× the contract's A10G baseline (meaningful on an A10G only); probed on NVIDIA A10G"
    # baseline_ms of the config's own are not called the contract's; no baseline_ms: no ratio
    own = [dict(c, baseline_ms=c["baseline_ms"] / 2) for c in contract_categories()]
    assert probe_baseline(own, contract_categories(), "cpu")["kind"] == "config"
    none = [dict(c, baseline_ms=None) for c in contract_categories()]
    assert probe_baseline(none, contract_categories(), "cpu")["kind"] == "none"


def test_the_plot_title_and_ratios_name_the_baseline():
    record = {"baseline": probe_baseline(tiny_probe_categories(), contract_categories(), "cpu")}
    labels = latency_probe.plot_labels(record, "tiny-awq-mtp2")
    title = " ".join(labels["title"].split())  # wrapped over lines
    assert title.startswith("tiny-awq-mtp2: ")
    assert "ratios: × the contract's A10G baseline (meaningful on an A10G only); probed on cpu" in title
    assert "not the contract's 8,192" in title
    assert labels["ratio_tag"] == "× A10G baseline" and labels["baseline_mark"] == "the contract's A10G baseline_ms"


# ---- the whole probe against a fake vLLM: a word tokenizer, a prefix cache of 16-token blocks, token ids ----

BLOCK = 16


@pytest.fixture
def fake_vllm():
    """/tokenize gives each distinct word an id (ids from 1000 up), /detokenize joins the words; /v1/completions
    streams two tokens a chunk with vLLM's return_token_ids (prompt ids in the first chunk), counts prompt tokens
    found in its prefix cache (16-token blocks, chained from the start, as vLLM hashes them) and drafts 1 token a
    step, accepting every other one; /metrics exposes the counters. Every completion request is logged."""
    state = {
        "vocab": {},
        "words": {},
        "blocks": set(),
        "hits": 0.0,
        "queries": 0.0,
        "drafts": 0.0,
        "accepted": 0.0,
        "requests": [],
        "broken_ids": False,
    }

    def tokenize(text):
        ids = []
        words = text.split()
        # "dog." then "the" is one token, as ". " + "The" is one in a real BPE tokenizer: the repeated sentence
        # loses a token at every join unless the prompt is counted as a whole
        for i in range(len(words) - 1, 0, -1):
            if words[i - 1] == "dog." and words[i] == "the":
                words[i - 1 : i + 1] = ["dog.the"]
        for word in words:
            if word not in state["vocab"]:
                state["vocab"][word] = 1000 + len(state["vocab"])
                state["words"][state["vocab"][word]] = word
            ids.append(state["vocab"][word])
        return ids

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *args):
            pass

        def reply(self, payload, content_type="application/json"):
            data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.reply(
                f'vllm:spec_decode_num_drafts_total{{engine="0"}} {state["drafts"]}\n'
                f'vllm:spec_decode_num_accepted_tokens_total{{engine="0"}} {state["accepted"]}\n'
                f'vllm:prefix_cache_queries_total{{engine="0"}} {state["queries"]}\n'
                f'vllm:prefix_cache_hits_total{{engine="0"}} {state["hits"]}\n',
                "text/plain",
            )

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/tokenize":
                self.reply({"tokens": tokenize(body["prompt"])})
            elif self.path == "/detokenize":
                text = " ".join(state["words"][t] for t in body["tokens"])
                self.reply({"prompt": text.replace("dog.the", "dog. the")})
            else:
                self.complete(body)

        def complete(self, body):
            prompt = tokenize(body["prompt"])
            blocks = [tuple(prompt[: BLOCK * (i + 1)]) for i in range(len(prompt) // BLOCK)]
            cached = next((i for i, block in enumerate(blocks) if block not in state["blocks"]), len(blocks))
            state["queries"] += len(prompt)
            state["hits"] += cached * BLOCK
            state["blocks"].update(blocks)
            n = body["max_tokens"]
            output = [(sum(prompt) * 31 + i * 7) % 50000 for i in range(n)]  # greedy: a function of the prompt
            state["drafts"] += n // 2
            state["accepted"] += n // 4
            state["requests"].append({"prompt": prompt, "output": output, "body": body})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(0, n, 2):
                choice = {"index": 0, "text": " t" * len(output[i : i + 2])}
                if body.get("return_token_ids"):
                    choice["token_ids"] = output[i : i + 2][:1] if state["broken_ids"] else output[i : i + 2]
                    if i == 0:
                        choice["prompt_token_ids"] = prompt
                self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            usage = {"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": n}}
            self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", state
    server.shutdown()


CATEGORIES = [
    {"name": "short", "prompt_tokens": 24, "output_tokens": 8, "baseline_ms": 1000.0},
    {"name": "long", "prompt_tokens": 100, "output_tokens": 6, "baseline_ms": 2000.0},
]


def corpus(tmp_path, paragraphs: int = 40):
    """Paragraphs in groups of four that share their first 20 words (so prompts starting in one group would share
    their first cached block), then words of their own."""
    lines = [
        " ".join([f"g{i // 4}w{j}" for j in range(20)] + [f"p{i}w{j}" for j in range(12)]) + "."
        for i in range(paragraphs)
    ]
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def settings(**overrides):
    return dict(
        {
            "warmup": 1,
            "runs": 2,
            "ignore_eos": True,
            "categories": CATEGORIES,
            "sentence": "the quick brown fox jumps over the lazy dog.",
        },
        **overrides,
    )


def per_set_requests(state, sets):
    """The logged requests, split by prompt set and category (warm-ups then timed runs)."""
    count = 3  # warmup + runs
    requests = iter(state["requests"])
    return {name: {c["name"]: [next(requests) for _ in range(count)] for c in CATEGORIES} for name in sets}


def test_probe_times_three_prompt_sets_and_fresh_prompts_never_repeat(fake_vllm, tmp_path):
    base_url, state = fake_vllm
    result = probe.probe(base_url, "m", settings(), corpus(tmp_path), log=lambda *a: None)
    assert result["prompt_sets"] == ["repeated", "varied", "fresh"]
    assert list(probe.prompt_sets(result)) == ["repeated", "varied", "fresh"]
    requests = per_set_requests(state, result["prompt_sets"])
    assert len(state["requests"]) == 3 * 2 * 3  # nothing else was sent
    fresh = [r["prompt"] for by_category in requests["fresh"].values() for r in by_category]
    others = [r["prompt"] for name in ("repeated", "varied") for rs in requests[name].values() for r in rs]
    for category, rs in requests["fresh"].items():  # exactly prompt_tokens tokens, as the server counted them
        assert {len(r["prompt"]) for r in rs} == {next(c["prompt_tokens"] for c in CATEGORIES if c["name"] == category)}
    assert len({tuple(p) for p in fresh}) == len(fresh) == 6  # every warm-up and run: its own prompt
    leads = [tuple(p[:BLOCK]) for p in fresh]
    assert len(set(leads)) == len(leads) and not set(leads) & {tuple(p[:BLOCK]) for p in others}
    for name in ("repeated", "varied"):  # the other sets reuse one prompt per category
        assert all(len({tuple(r["prompt"]) for r in rs}) == 1 for rs in requests[name].values())
    # the prefix cache: the reused prompts hit after their warm-up, fresh ones never
    assert result["prefix_cache"]["hit_rate"] > 0.5 and result["varied"]["prefix_cache"]["hit_rate"] > 0.5
    assert result["fresh"]["prefix_cache"] == {"queries": 2 * (24 + 100), "hits": 0, "hit_rate": 0.0}
    for category in result["fresh"]["categories"]:
        assert category["prefix_cache"]["hits"] == 0
        assert category["prompt_tokens_served"] == [category["prompt_tokens"]] * 2
        assert len(set(category["prompt_starts"])) == 3
    assert "prompt_starts" not in result["categories"][0]
    for prompt_set in probe.prompt_sets(result).values():  # exact lengths as served, the joins in the sentence too
        assert all(c["prompt_tokens_served"] == [c["prompt_tokens"]] * 2 for c in prompt_set["categories"])
    short = result["categories"][0]  # 24-token prompt: one full block, cached by the warm-up
    assert short["prefix_cache"] == {"queries": 48, "hits": 32, "hit_rate": pytest.approx(2 / 3)}


def test_probe_records_acceptance_and_first_run_token_ids_per_set(fake_vllm, tmp_path):
    base_url, state = fake_vllm
    result = probe.probe(base_url, "m", settings(), corpus(tmp_path), log=lambda *a: None)
    requests = per_set_requests(state, result["prompt_sets"])
    for name, prompt_set in probe.prompt_sets(result).items():
        for category in prompt_set["categories"]:
            # drafts: 4 and 3 a request (8 and 6 tokens), accepted 2 and 1: over the two timed runs only
            assert category["spec_decode"] == (
                {"drafts": 8, "accepted_tokens": 4}
                if category["name"] == "short"
                else {"drafts": 6, "accepted_tokens": 2}
            )
            first_timed = requests[name][category["name"]][1]  # after the one warm-up
            assert category["first_run_token_ids"] == first_timed["output"]
            assert len(category["first_run_token_ids"]) == category["output_tokens_requested"]
            assert first_timed["body"]["return_token_ids"] is True and first_timed["body"]["temperature"] == 0.0
        assert prompt_set["categories"][0]["mean_acceptance_length"] == pytest.approx(1.5)
        assert prompt_set["mean_acceptance_length"] == pytest.approx(1 + 6 / 14)
        assert prompt_set["prompts"] == probe.SET_DESCRIPTIONS[name]
    fresh_ids = [c["first_run_token_ids"] for c in result["fresh"]["categories"]]
    assert fresh_ids != [c["first_run_token_ids"] for c in result["varied"]["categories"]]
    record = dict(result, image="x", image_id="sha256:x", network="n", cold_start_s=1.0, warmup=1, ignore_eos=True)
    with pytest.raises(StageError, match="device_bandwidth"):  # what the summary's probe floor is read against
        validate_json(record, ROOT / "schemas" / "latency.schema.yaml")
    record["device_bandwidth"] = {"device": "cpu", "gbps": 12.5, "buffer_bytes": 1 << 28, "repeats": 5}
    with pytest.raises(StageError, match="baseline"):  # what its speedups are against
        validate_json(record, ROOT / "schemas" / "latency.schema.yaml")
    record["baseline"] = probe_baseline(CATEGORIES, contract_categories(), "cpu")
    assert record["baseline"]["kind"] == "config"  # this test's own baseline_ms
    validate_json(record, ROOT / "schemas" / "latency.schema.yaml")
    latency_probe.plot(record, "v", tmp_path / "latency.png")


def test_the_concurrent_batch_sends_the_sets_prompts_at_once_and_records_their_ids(fake_vllm, tmp_path):
    """After the timed runs, latency_probe records one concurrent batch (the lossless check's batched case): the
    repeated and the varied prompt of the two shortest categories, as those sets make them, with mixed max_tokens, and
    each request's ids. The lossless reference sends the same batch with top logprobs and keeps each request's prompt
    ids, as its first runs do, to continue from them past a near tie."""
    import jsonschema
    import yaml

    base_url, state = fake_vllm
    varied = corpus(tmp_path)
    reference = probe.probe(
        base_url, "m", settings(sets=["repeated", "varied"], first_run_only=True), varied, lambda *a: None
    )
    first_prompts = {
        name: {c["name"]: c["first_run_prompt_ids"] for c in prompt_set["categories"]}
        for name, prompt_set in probe.prompt_sets(reference).items()
    }
    assert first_prompts["varied"]["short"] == state["requests"][-2]["prompt"]  # what the server tokenized
    probed = len(state["requests"])
    batch = probe.concurrent_batch(base_url, "m", settings(), varied)
    sent = state["requests"][probed:]
    assert [(r["name"], r["set"], r["category"], r["max_tokens"]) for r in batch["requests"]] == [
        ("repeated-short-8", "repeated", "short", 8),
        ("varied-short-4", "varied", "short", 4),
        ("repeated-long-3", "repeated", "long", 3),
        ("varied-long-6", "varied", "long", 6),
    ]
    assert len(sent) == probe.BATCH_SIZE and all("logprobs" not in r["body"] for r in sent)
    by_prompt = {tuple(r["prompt"]): r for r in sent}
    for request in batch["requests"]:
        prompt = first_prompts[request["set"]][request["category"]]  # the set's own prompt for the category
        assert request["token_ids"] == by_prompt[tuple(prompt)]["output"]
        assert request["output_tokens"] == request["max_tokens"] and request["prompt_tokens_served"] == len(prompt)
        assert "prompt_token_ids" not in request and "top_logprobs" not in request
    schema = yaml.safe_load((ROOT / "schemas" / "latency.schema.yaml").read_text())
    jsonschema.validate(batch, schema["properties"]["batch"])
    # the lossless reference's batch: the same requests, with their top logprobs asked and their prompt ids kept
    again = probe.concurrent_batch(base_url, "m", settings(), varied, top_logprobs=probe.REFERENCE_TOP_LOGPROBS)
    assert [r["token_ids"] for r in again["requests"]] == [r["token_ids"] for r in batch["requests"]]
    assert all(r["body"]["logprobs"] == probe.REFERENCE_TOP_LOGPROBS for r in state["requests"][-probe.BATCH_SIZE :])
    assert [r["prompt_token_ids"] for r in again["requests"]] == [
        first_prompts[r["set"]][r["category"]] for r in again["requests"]
    ]


def test_probe_sets_choose_what_runs(fake_vllm, tmp_path):
    base_url, state = fake_vllm
    result = probe.probe(base_url, "m", settings(sets=["fresh", "repeated"]), corpus(tmp_path), log=lambda *a: None)
    assert result["prompt_sets"] == ["repeated", "fresh"] and result["varied"] is None and result["fresh"]
    assert len(state["requests"]) == 2 * 2 * 3
    with pytest.raises(StageError, match="must name 'repeated'"):
        probe.probe(base_url, "m", settings(sets=["varied", "fresh"]), corpus(tmp_path), log=lambda *a: None)


def test_fresh_prompts_refuse_to_repeat_when_the_text_runs_out(fake_vllm, tmp_path):
    base_url, _ = fake_vllm
    with pytest.raises(StageError, match="ran out of start paragraphs"):
        probe.probe(
            base_url, "m", settings(sets=["repeated", "fresh"]), corpus(tmp_path, paragraphs=5), log=lambda *a: None
        )


def test_token_ids_must_cover_every_completion_token(fake_vllm):
    base_url, state = fake_vllm
    state["broken_ids"] = True  # one id a chunk of two tokens
    with pytest.raises(StageError, match="token ids for 8 completion tokens"):
        probe.timed_completion(base_url, "m", "a b c", 8, True)
    state["broken_ids"] = False
    run = probe.timed_completion(base_url, "m", "a b c", 8, True)
    assert run["token_ids"] == state["requests"][-1]["output"] and run["prompt_tokens"] == 3


def test_the_probe_and_the_warm_ups_report_progress_every_interval(fake_vllm, tmp_path, monkeypatch):
    import time

    from lib import progress

    base_url, _ = fake_vllm
    slow = probe.timed_completion

    def timed_completion(*args, **kwargs):  # a slow server: each request takes longer than the interval
        time.sleep(0.12)
        return slow(*args, **kwargs)

    monkeypatch.setattr(probe, "timed_completion", timed_completion)
    monkeypatch.setattr(progress, "PROGRESS_INTERVAL_S", 0.05)
    lines = []
    probe.probe(base_url, "m", settings(sets=["repeated"]), corpus(tmp_path), log=lines.append)
    ticks = [line for line in lines if line.startswith("[probe] category ")]
    assert any(line.startswith("[probe] category short (1/2): 1/1 warm-ups and 1/2 timed runs done") for line in ticks)
    assert any(line.startswith("[probe] category long (2/2): ") for line in ticks)
    assert all("on this prompt set" in line for line in ticks)

    lines.clear()
    post_json = probe.post_json
    monkeypatch.setattr(
        probe, "post_json", lambda url, path, body: {} if path == "/v1/chat/completions" else post_json(url, path, body)
    )  # the fake vLLM has no chat endpoint
    probe.warm_up(base_url, "m", CATEGORIES, "the quick brown fox.", log=lines.append)
    ticks = [line for line in lines if line.startswith("[warm-up] ")]
    assert ticks and ticks[0].startswith("[warm-up] 0/4 warm-ups done, now short:")
