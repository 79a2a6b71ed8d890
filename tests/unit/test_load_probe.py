"""The load probe (scripts/load_probe.py, scripts/lib/load_probe/load.py): its request mix, and its verdict against a
stand-in server that answers as vLLM behind serving/ does (then breaks in one way at a time). The tiny image's record:
tests/e2e/test_load_probe.py."""

import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import ROOT
from lib.load_probe import load
from lib.stage import StageError, validate_json
from load_probe import load_probe

MODEL = "Qwen/Qwen3.5-4B"
LIMITS = {"max_request_bytes": 4096, "max_model_len": 256}
SETTINGS = {"requests": 64, "concurrency": 8, "max_tokens": 8, "client_timeout_s": 30}
SERVE = {**LIMITS, "served_model_name": MODEL, "default_thinking": False, "thinking_reserve_tokens": 256}


class FakeVllm(BaseHTTPRequestHandler):
    """vLLM's OpenAI server behind serving/'s middleware, as the probe sees it: 413 past max_request_bytes, 400/404
    for what vLLM refuses, greedy answers that depend on the request alone (a word per token, ids from the prompt),
    logprobs as vLLM spells them with return_tokens_as_token_ids, and a thinking answer's thought closed. `server.mode`
    breaks one thing."""

    protocol_version = "HTTP/1.0"  # a stream ends when the connection closes

    def log_message(self, *args):
        pass

    def reply(self, status: int, payload) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def refuse(self, status: int, message: str) -> None:
        self.reply(status, {"error": {"message": message, "type": "BadRequestError", "param": None, "code": status}})

    def do_GET(self):
        if self.path == "/ping":
            self.reply(503 if self.server.mode == "dies" else 200, {})
        else:
            self.refuse(404, "not found")

    def do_POST(self):
        server = self.server
        length = int(self.headers["Content-Length"])
        raw = self.rfile.read(length)
        with server.lock:
            server.posts += 1
            number = server.posts
            server.seen[raw] = server.seen.get(raw, 0) + 1
            repeat = server.seen[raw] > 1  # the probe sends each greedy request alone first
        if server.mode == "one_500" and number == server.fail_at:
            return self.refuse(500, "EngineCore died")
        if length > LIMITS["max_request_bytes"]:
            return self.refuse(413, "over max_request_bytes")
        try:
            body = json.loads(raw)
        except ValueError:
            return self.refuse(400, "JSON decode error")
        if not isinstance(body, dict):
            return self.refuse(400, "not an object")
        chat = self.path == "/v1/chat/completions" or (self.path == "/invocations" and "messages" in body)
        if self.path == "/invocations" and not ("prompt" in body or "messages" in body):
            return self.refuse(400, "Cannot find suitable handler")
        if body.get("model") not in (None, MODEL):
            return self.refuse(404, f"The model `{body['model']}` does not exist.")
        max_tokens = body.get("max_tokens")
        if type(max_tokens) is not int:
            return self.refuse(400, "max_tokens: Input should be a valid integer")
        if max_tokens < 1 and server.mode != "accepts_invalid":
            return self.refuse(400, f"max_tokens must be at least 1, got {max_tokens}")
        if not isinstance(body.get("stream", False), bool):
            return self.refuse(400, "stream: Input should be a valid boolean")
        kwargs = body.get("chat_template_kwargs", {})
        if not isinstance(kwargs, dict):
            return self.refuse(400, "chat_template_kwargs: Input should be a valid dictionary")
        if chat and not (isinstance(body.get("messages"), list) and body["messages"]):
            return self.refuse(400, "messages: Input should be a non-empty list")
        text = json.dumps(body["messages"]) if chat else body["prompt"]
        if len(text.split()) + max_tokens > LIMITS["max_model_len"]:
            return self.refuse(400, "This model's maximum context length is 256 tokens")
        thinking = chat and bool(body.get("thinking", kwargs.get("enable_thinking", False)))
        self.answer(body, chat, text, max(max_tokens, 1), thinking, repeat)

    def answer(self, body, chat, text, max_tokens, thinking, repeat):
        mode = self.server.mode
        seed = sum(text.encode()) + (7 if mode == "crosstalk" and repeat else 0)  # another request's answer
        ids = [100 + (seed + i) % 50 for i in range(max_tokens)]
        tops = [[token, -0.1, token + 1, -2.0] for token in ids]
        if max_tokens > 3:  # a near tie: batched arithmetic may take the other one
            tops[3] = [ids[3], -0.10, ids[3] + 1, -0.15]
            if mode == "near_tie" and repeat:
                ids[3] = ids[3] + 1
        words = [f" w{token}" for token in ids]
        budgeted = thinking and self.server.budget
        logged = max_tokens // 2 if budgeted else max_tokens  # the budget's answer comes without logprobs
        if budgeted and mode != "open_thought":
            words.insert(logged, "\n</think>\n\n")
        finish = None if mode == "no_finish" else "length"
        created = {"id": "cmpl-1", "created": 1, "model": MODEL}
        usage = {"prompt_tokens": len(text.split()), "completion_tokens": max_tokens}

        def logprobs(positions):
            if not body.get("logprobs"):
                return None
            if chat:
                return {
                    "content": [
                        {
                            "token": f"token_id:{ids[i]}",
                            "logprob": tops[i][1],
                            "top_logprobs": [
                                {"token": f"token_id:{tops[i][0]}", "logprob": tops[i][1]},
                                {"token": f"token_id:{tops[i][2]}", "logprob": tops[i][3]},
                            ],
                        }
                        for i in positions
                    ]
                }
            return {
                "tokens": [f"token_id:{ids[i]}" for i in positions],
                "top_logprobs": [
                    {f"token_id:{tops[i][0]}": tops[i][1], f"token_id:{tops[i][2]}": tops[i][3]} for i in positions
                ],
            }

        def choice(content, positions, finish_reason, delta=False):
            out = {"index": 0, "logprobs": logprobs(positions), "finish_reason": finish_reason}
            if chat:
                out["delta" if delta else "message"] = {"role": "assistant", "content": content}
            else:
                out["text"] = content
            return out

        if not body.get("stream"):
            if mode == "not_json":
                return self.reply(200, "ok")
            kind = "chat.completion" if chat else "text_completion"
            reply = dict(created, object=kind, choices=[choice("".join(words), range(logged), finish)], usage=usage)
            return self.reply(200, reply)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        kind = "chat.completion.chunk" if chat else "text_completion"
        for i, word in enumerate(words):
            last = i == len(words) - 1
            positions = [i] if i < logged else []
            event = dict(created, object=kind, choices=[choice(word, positions, finish if last else None, True)])
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        if body.get("stream_options", {}).get("include_usage"):
            self.wfile.write(f"data: {json.dumps(dict(created, object=kind, choices=[], usage=usage))}\n\n".encode())
        if mode != "no_done":
            self.wfile.write(b"data: [DONE]\n\n")


class Server(ThreadingHTTPServer):
    request_queue_size = 64  # every concurrent request connects at once


@contextmanager
def fake_server(mode: str | None = None, budget: bool = True, fail_at: int = 30):
    """The stand-in on a free port; budget: it has a thinking budget; fail_at: the POST answered 500 in mode one_500
    (after the lone runs)."""
    server = Server(("127.0.0.1", 0), FakeVllm)
    server.budget = budget
    server.mode, server.fail_at, server.lock, server.posts, server.seen = mode, fail_at, threading.Lock(), 0, {}
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def probe(mode: str | None = None, serve: dict | None = None) -> dict:
    serve = serve or SERVE
    with fake_server(mode, budget=serve["thinking_reserve_tokens"] > 0) as base_url:
        return load_probe(base_url, MODEL, SETTINGS, serve, alive=lambda: mode != "dies", log=print)


def failed_kinds(record: dict) -> set[str]:
    return {row["kind"] for row in record["requests"] if not row["ok"]}


# ----- the mix -----


def kinds(**serve) -> list[load.Kind]:
    return load.request_kinds(MODEL, 8, load.Server.of({**SERVE, **serve}))


def test_the_mix_covers_every_endpoint_streamed_and_not_thinking_on_and_off():
    valid = [kind for kind in kinds() if kind.valid]
    for endpoint in load.ENDPOINTS:
        mine = [kind for kind in valid if kind.endpoint == endpoint]
        assert {kind.stream for kind in mine} == {True, False}, endpoint
    chats = [kind for kind in valid if kind.chat]
    assert {kind.thinking for kind in chats} == {True, False}
    assert {kind.stream for kind in chats if kind.thinking} == {True, False}
    assert any(not kind.greedy for kind in valid)  # a sampled request too
    assert all(kind.body["max_tokens"] == 8 for kind in valid)
    assert all("model" not in kind.body for kind in kinds() if kind.path == "/invocations" and kind.valid)


def test_which_chat_requests_think_follows_the_request_then_the_server():
    by_name = {kind.name: kind for kind in kinds(default_thinking=True)}
    assert by_name["chat"].thinking and by_name["chat_thinking"].thinking and not by_name["completions"].thinking
    assert not any(kind.budgeted for kind in kinds(thinking_reserve_tokens=0))
    assert {kind.name for kind in kinds() if kind.budgeted and kind.valid} == {
        "chat_thinking",
        "chat_thinking_stream",
        "chat_thinking_kwargs",
        "invocations_messages_thinking_stream",
    }


def test_the_invalid_requests_cross_what_they_name():
    invalid = {kind.name: kind for kind in kinds() if not kind.valid}
    for name in ("malformed_json_completions", "malformed_json_invocations"):
        with pytest.raises(ValueError):
            json.loads(invalid[name].body)
    assert len(json.dumps(invalid["body_over_size_limit"].body)) > LIMITS["max_request_bytes"]
    assert invalid["body_over_size_limit"].expect_status == 413
    assert invalid["max_tokens_negative"].body["max_tokens"] < 0
    assert invalid["max_tokens_over_context"].body["max_tokens"] > LIMITS["max_model_len"]
    assert len(invalid["prompt_over_context"].body["prompt"].split()) > LIMITS["max_model_len"]
    assert invalid["unknown_model"].body["model"] != MODEL
    assert isinstance(invalid["max_tokens_wrong_type"].body["max_tokens"], str)


def test_the_plan_sends_every_kind_then_the_valid_ones_in_a_fixed_shuffle():
    mix = kinds()
    planned = load.plan(mix, 64)
    assert len(planned) == 64 and {kind.name for kind in planned} == {kind.name for kind in mix}
    assert sum(not kind.valid for kind in planned) == sum(not kind.valid for kind in mix)  # each invalid once
    assert planned == load.plan(mix, 64) and planned[: len(mix)] != mix  # seeded, and shuffled
    with pytest.raises(StageError, match="load.requests"):
        load.plan(mix, len(mix) - 1)


# ----- the verdict against a stand-in server -----


def test_a_server_that_answers_everything_right_passes_and_the_record_validates():
    record = probe()
    assert record["passed"], record["failures"]
    counts = record["counts"]
    assert counts["requests"] == 64 and counts["failed"] == counts["server_errors"] == counts["no_answer"] == 0
    assert counts["invalid"] == sum(not kind.valid for kind in kinds())
    assert record["statuses"]["413"] == 1 and record["statuses"]["404"] == 2 and record["statuses"]["200"] == 64 - 14
    assert counts["compared_with_alone"] > 0 and counts["near_ties"] == 0
    assert record["max_in_flight"] <= 8
    for name in ("overall", *load.ENDPOINTS):
        stats = record["latency_ms"][name]
        assert stats["count"] > 0 and 0 < stats["p50_ms"] <= stats["p99_ms"] <= stats["max_ms"], name
    record.update(variant="tiny", image="x:y", image_id="sha256:" + "0" * 64, network="offline", cold_start_s=1.0)
    validate_json(record, ROOT / "schemas" / "load.schema.yaml")


def test_one_500_fails_naming_the_request():
    record = probe("one_500")
    assert not record["passed"] and record["counts"]["server_errors"] == 1
    failing = [row for row in record["requests"] if not row["ok"]]
    assert len(failing) == 1 and failing[0]["status"] == 500
    assert len(record["failures"]) == 1
    assert f"request {failing[0]['index']} ({failing[0]['kind']}" in record["failures"][0]
    assert "HTTP 500" in record["failures"][0]


def test_an_invalid_request_answered_200_fails_naming_it():
    record = probe("accepts_invalid")
    assert not record["passed"]
    assert failed_kinds(record) == {"max_tokens_negative", "max_tokens_negative_thinking_stream"}
    assert any("max_tokens_negative," in failure and "not 4xx" in failure for failure in record["failures"])
    assert record["counts"]["invalid_not_4xx"] == 2 and record["counts"]["server_errors"] == 0


def test_an_answer_that_is_another_requests_fails():
    record = probe("crosstalk")
    assert not record["passed"]
    assert failed_kinds(record) == {kind.name for kind in kinds() if kind.greedy}
    assert all("differs from the same request alone at output token 0" in f for f in record["failures"][:-1])
    assert record["failures"][-1].startswith("after the load: differs from its answer before the load")


def test_a_difference_at_a_near_tie_passes_and_is_recorded():
    record = probe("near_tie")
    assert record["passed"], record["failures"]
    compared = [row for row in record["requests"] if row["same_ids_as_alone"] is not None]
    assert compared and all(row["near_tie"] == {"position": 3, "margin": 0.05} for row in compared)
    assert record["counts"]["near_ties"] == len(compared) == record["counts"]["text_differs_from_alone"]


@pytest.mark.parametrize(
    "mode, failing, says",
    [
        ("no_done", lambda kind: kind.valid and kind.stream, "did not end with data: [DONE]"),
        ("no_finish", lambda kind: kind.valid, "finish_reason"),
        ("open_thought", lambda kind: kind.thinking and kind.valid, "holds no closed thought"),
        ("not_json", lambda kind: kind.valid and not kind.stream, "not an OpenAI-style answer"),
        ("dies", lambda kind: False, "after the load: the server's container is no longer running; /ping answered 503"),
    ],
)
def test_a_broken_answer_or_a_dead_server_fails_naming_the_requests(mode, failing, says):
    record = probe(mode)
    assert not record["passed"]
    assert failed_kinds(record) == {kind.name for kind in kinds() if failing(kind)}
    assert any(says in failure for failure in record["failures"]), record["failures"]


def test_an_open_thought_passes_where_the_server_has_no_thinking_budget():
    record = probe("open_thought", serve=dict(SERVE, thinking_reserve_tokens=0))
    assert record["passed"], record["failures"]


def test_a_failing_probe_says_what_failed_in_one_message():
    record = probe("one_500")
    message = load.failure_message(record)
    assert "1 5xx" in message and record["failures"][0] in message
