"""The probe's pure parts (lib/probe.py, latency_probe's plot) against a fake server: prompt building, acceptance from /metrics, statistics."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import latency_probe
from lib import probe
from lib.stage import StageError

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
    assert state["tokenized"] == ["a bb ccc ", "dddd "]  # each distinct piece tokenized once, never the whole


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
    summary = probe.summarize({"name": "short", "prompt_tokens": 64, "output_tokens": 8,
                                       "baseline_ms": 500.0}, runs)
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


def test_plot_draws_both_prompt_sets(tmp_path):
    runs = [{"latency_ms": ms, "ttft_ms": 10.0, "itl_ms": 2.0, "output_tokens": 8} for ms in (100, 200, 300)]
    categories = [dict(probe.summarize({"name": name, "prompt_tokens": 64, "output_tokens": 8,
                                                "baseline_ms": 500.0}, runs), mean_acceptance_length=1.5)
                  for name in ("short", "long")]
    result = {"categories": categories, "varied": {"categories": categories, "mean_speedup": 2.5}}
    latency_probe.plot(result, "tiny-awq-mtp1", tmp_path / "latency.png")
    assert (tmp_path / "latency.png").read_bytes()[:4] == b"\x89PNG"
