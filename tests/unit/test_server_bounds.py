"""serving/middleware.py bounds every request: body size (413), the body's arrival (408), time (408 or a stream ended
with finish_reason and an error event, the engine request aborted), requests in flight (503), the thinking budget
without max_tokens, a failed continuation, and max_model_len. Driven with stand-in ASGI apps that behave as vLLM's
routes do; the real server is test_serving's."""

import asyncio
import json
import sys
from types import SimpleNamespace

import pytest

from conftest import ROOT
from unit.test_serving import MSG, FakeVllm

sys.path.insert(0, str(ROOT))

from serving import middleware  # noqa: E402
from serving.launch import child_env  # noqa: E402
from serving.middleware import Prompt, ThinkingMiddleware, continuation_room  # noqa: E402
from serving.settings import SERVE  # noqa: E402


def serve(app, body, *, path="/v1/chat/completions", chunks=None, headers=None, probe=None, more=False, pace_s=0):
    """Run one request through the middleware in front of `app`. Returns what reached the client (status, body,
    sent), how many body messages the middleware read, and probe() taken the moment the middleware returned.
    more: the last chunk says more_body (a client that stopped sending); pace_s: each chunk after the first comes
    that long after the one before."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    pieces = chunks or [raw]
    messages = [
        {"type": "http.request", "body": c, "more_body": more or i < len(pieces) - 1} for i, c in enumerate(pieces)
    ]
    out = SimpleNamespace(sent=[], read=0, probe=None)

    async def receive():
        if out.read < len(messages):
            if out.read:
                await asyncio.sleep(pace_s)
            out.read += 1
            return messages[out.read - 1]
        await asyncio.Event().wait()  # the client stays until the response is done

    async def send(message):
        out.sent.append(message)

    if headers is None:
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}

    async def run():
        await asyncio.wait_for(ThinkingMiddleware(app)(scope, receive, send), 20)  # a missing bound fails, not hangs
        if probe:
            out.probe = probe()  # before asyncio.run cancels whatever is left

    asyncio.run(run())
    starts = [m for m in out.sent if m["type"] == "http.response.start"]
    assert len(starts) == 1, out.sent  # one answer, whatever happened
    out.status, out.body = starts[0]["status"], b"".join(m.get("body", b"") for m in out.sent[1:])
    return out


def events(raw: bytes) -> list:
    out = []
    for event in raw.decode().split("\n\n"):
        if event:
            payload = event[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def stream_result(raw: bytes):
    """(text, finish reasons, error events) of a chat stream; it must end with [DONE]."""
    payloads = events(raw)
    assert payloads[-1] == "[DONE]", payloads
    choices = [c for p in payloads[:-1] if "choices" in p for c in p["choices"]]
    text = "".join((c.get("delta") or {}).get("content") or c.get("text") or "" for c in choices)
    finishes = [c["finish_reason"] for c in choices if c["finish_reason"]]
    return text, finishes, [p["error"] for p in payloads[:-1] if "error" in p]


@pytest.fixture
def bounds(monkeypatch):
    """Small bounds for a test: bounds(timeout, max_bytes, reserve, body_timeout, in_flight)."""

    def set_bounds(timeout=30.0, max_bytes=4096, reserve=20, body_timeout=30.0, in_flight=64):
        monkeypatch.setenv("REQUEST_TIMEOUT_S", str(timeout))
        monkeypatch.setenv("MAX_REQUEST_BYTES", str(max_bytes))
        monkeypatch.setenv("BODY_TIMEOUT_S", str(body_timeout))
        monkeypatch.setenv("MAX_REQUESTS_IN_FLIGHT", str(in_flight))
        monkeypatch.setenv("THINKING_RESERVE_TOKENS", str(reserve))
        monkeypatch.setenv("DEFAULT_THINKING", "0")

    set_bounds()
    return set_bounds


class Echo:
    """A route that answers with the length of the body it got, and counts its calls."""

    def __init__(self):
        self.calls = 0

    async def __call__(self, scope, receive, send):
        self.calls += 1
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await FakeVllm.reply(send, {"length": len(body)})


# ---------- settings reach the middleware ----------


BOUNDS = {
    "request_timeout_s": 12.5,
    "max_request_bytes": 2048,
    "body_timeout_s": 7.5,
    "max_requests_in_flight": 3,
}


def test_bounds_are_serve_settings_that_reach_the_middleware_through_its_environment(monkeypatch):
    env = child_env({}, BOUNDS)
    assert [env[SERVE[key].flag] for key in BOUNDS] == ["12.5", "2048", "7.5", "3"]
    defaults = child_env({})
    for key in (*BOUNDS, "thinking_reserve_tokens"):
        assert defaults[SERVE[key].flag] == str(SERVE[key].default), key
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    bounded = ThinkingMiddleware(Echo())
    assert {key: getattr(bounded, key) for key in BOUNDS} == BOUNDS
    for key in BOUNDS:
        monkeypatch.delenv(SERVE[key].flag)
    unset = ThinkingMiddleware(Echo())  # outside serving.launch: the table's defaults
    assert {key: getattr(unset, key) for key in BOUNDS} == {key: SERVE[key].default for key in BOUNDS}


# ---------- body size: 413, never buffered past the limit ----------


def test_a_declared_length_over_the_limit_is_answered_413_before_any_of_the_body_is_read(bounds):
    app = Echo()
    out = serve(app, b"x" * 5000, chunks=[b"x" * 100] * 50)
    assert out.status == 413 and out.read == 0 and app.calls == 0
    error = json.loads(out.body)["error"]
    assert error["code"] == 413 and "max_request_bytes (4096 bytes)" in error["message"]


def test_a_streamed_body_is_answered_413_once_its_bytes_pass_the_limit_and_read_no_further(bounds):
    app = Echo()
    chunked = [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")]  # no Content-Length
    out = serve(app, b"", chunks=[b"x" * 1000] * 50, headers=chunked)
    assert out.status == 413 and out.read == 5 and app.calls == 0  # 5000 bytes > 4096: the other 45 chunks stay unread
    # a declared length that lies low is caught by the count as well
    lying = [(b"content-type", b"application/json"), (b"content-length", b"10")]
    out = serve(app, b"", chunks=[b"x" * 3000] * 3, headers=lying)
    assert out.status == 413 and out.read == 2 and app.calls == 0


def test_a_body_at_the_limit_passes_on_every_path(bounds):
    app = Echo()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        out = serve(app, b"x" * 4096, path=path, chunks=[b"x" * 4000, b"x" * 96])
        assert out.status == 200 and json.loads(out.body) == {"length": 4096}, path
        assert serve(app, b"x" * 4097, path=path).status == 413, path
    assert app.calls == 3


# ---------- the body's arrival: 408, never handed to the engine ----------


def test_a_body_that_stops_arriving_is_answered_408_and_never_reaches_the_engine(bounds):
    bounds(body_timeout=0.3)
    app = Echo()
    out = serve(app, b"", chunks=[b'{"model": "m", '], more=True)
    error = json.loads(out.body)["error"]
    assert out.status == 408 and error["code"] == 408 and app.calls == 0
    assert "body_timeout_s (0.3 s); 15 bytes came" in error["message"], error
    assert (b"connection", b"close") in out.sent[0]["headers"]  # the rest of the body is never read
    # a client that never sends a byte of its body is let go alike
    out = serve(app, b"", more=True)
    assert out.status == 408 and "0 bytes came" in json.loads(out.body)["error"]["message"] and app.calls == 0


def test_a_body_trickled_in_is_answered_408_though_no_pause_is_long(bounds):
    """A byte at a time, each soon after the last: the deadline is the whole body's, not each chunk's."""
    bounds(body_timeout=0.3)
    app = Echo()
    out = serve(app, b"", chunks=[b"x"] * 1000, pace_s=0.02)
    assert out.status == 408 and out.read < 1000 and app.calls == 0


def test_a_body_that_arrives_in_time_passes_in_many_chunks(bounds):
    app = Echo()
    out = serve(app, b"", chunks=[b"x"] * 50, pace_s=0.001)
    assert out.status == 200 and json.loads(out.body) == {"length": 50} and app.calls == 1


# ---------- requests in flight: 503 past the bound, health checks aside ----------


class Held:
    """A route that answers only once released, and counts the requests it holds."""

    def __init__(self):
        self.release, self.held = asyncio.Event(), 0

    async def __call__(self, scope, receive, send):
        await receive()
        self.held += 1
        await self.release.wait()
        await FakeVllm.reply(send, {"path": scope["path"]})


async def request(middleware, path="/v1/completions", chunks=(b"{}",), more=False) -> SimpleNamespace:
    """One request through a shared middleware instance: its status and headers once answered."""
    messages = [
        {"type": "http.request", "body": c, "more_body": more or i < len(chunks) - 1} for i, c in enumerate(chunks)
    ]
    out = SimpleNamespace(status=None, headers={})

    async def receive():
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()

    async def send(message):
        if message["type"] == "http.response.start":
            out.status, out.headers = message["status"], dict(message.get("headers", []))

    scope = {"type": "http", "method": "POST", "path": path, "headers": []}
    await asyncio.wait_for(middleware(scope, receive, send), 20)
    return out


def test_past_max_requests_in_flight_a_request_is_answered_503_with_retry_after(bounds):
    bounds(in_flight=2)

    async def run():
        app = Held()
        middleware = ThinkingMiddleware(app)
        held = [asyncio.ensure_future(request(middleware)) for _ in range(2)]
        while app.held < 2:
            await asyncio.sleep(0.01)
        turned_away = await request(middleware)
        app.release.set()  # /ping answers at once from here on
        ping = await request(middleware, path="/ping")  # a health check takes no slot
        first = [(await h).status for h in held]
        after = await request(middleware)  # the slots are free again
        return turned_away, ping, first, after

    turned_away, ping, first, after = asyncio.run(run())
    assert turned_away.status == 503 and turned_away.headers[b"retry-after"] == b"1"
    assert turned_away.headers[b"connection"] == b"close"  # its body is never read
    assert ping.status == 200 and first == [200, 200] and after.status == 200


def test_a_health_check_answers_while_every_slot_is_held(bounds):
    bounds(in_flight=1)

    async def run():
        app = Held()
        middleware = ThinkingMiddleware(app)
        held = asyncio.ensure_future(request(middleware))
        while app.held < 1:
            await asyncio.sleep(0.01)
        ping = asyncio.ensure_future(request(middleware, path="/ping"))
        while app.held < 2:  # /ping reached the app although the one slot is taken
            await asyncio.sleep(0.01)
        app.release.set()
        return (await held).status, (await ping).status

    assert asyncio.run(run()) == (200, 200)


def test_a_slow_body_holds_its_slot_only_until_its_408(bounds):
    bounds(in_flight=1, body_timeout=0.3)

    async def run():
        app = Echo()
        middleware = ThinkingMiddleware(app)
        stalled = asyncio.ensure_future(request(middleware, chunks=(b'{"pro',), more=True))
        await asyncio.sleep(0)  # it has taken the slot and waits for the rest of its body
        turned_away = await request(middleware)
        return turned_away.status, (await stalled).status, (await request(middleware)).status, app.calls

    assert asyncio.run(run()) == (503, 408, 200, 1)


def test_json_nested_past_pythons_recursion_limit_is_left_to_vllm_not_a_500(bounds):
    bounds(max_bytes=1 << 20)
    app = Echo()
    for body in (b"[" * 200_000 + b"]" * 200_000, b'{"messages": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"):
        assert serve(app, body).status == 200  # what vLLM makes of it, untouched
    assert app.calls == 2


# ---------- time: 408, or a started stream ended; the engine request aborted ----------


class Engine:
    """Stands in for vLLM's engine: a request generates until it is done or aborted (cancelled)."""

    def __init__(self, tokens=None, pace_s=0.02):
        self.tokens, self.pace_s, self.aborted, self.running = tokens, pace_s, 0, 0

    def state(self) -> dict:
        return {"aborted": self.aborted, "running": self.running}

    async def generate(self):
        self.running += 1
        try:
            produced = 0
            while self.tokens is None or produced < self.tokens:
                await asyncio.sleep(self.pace_s)
                produced += 1
                yield f" t{produced}"
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted += 1
            raise
        finally:
            self.running -= 1


async def until_disconnect(receive):
    while (await receive())["type"] != "http.disconnect":
        pass


class SlowVllm:
    """vLLM's two ways of hearing a client leave: a non-streamed route runs its handler in a task beside a
    disconnect listener (with_cancellation) and answers null when the listener wins; a stream runs beside one
    (starlette's StreamingResponse), which cancels the stream. Neither reacts to anything else."""

    def __init__(self, engine: Engine):
        self.engine = engine

    async def __call__(self, scope, receive, send):
        body = json.loads((await receive())["body"])
        if body.get("stream"):
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            )

            async def stream():
                async for piece in self.engine.generate():
                    if scope["path"] == "/v1/completions":
                        chunk = {"id": "c1", "object": "text_completion", "model": "m"}
                        chunk["choices"] = [{"index": 0, "text": piece, "finish_reason": None}]
                    else:
                        chunk = {"id": "s1", "object": "chat.completion.chunk", "model": "m"}
                        chunk["choices"] = [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]
                    await send(
                        {
                            "type": "http.response.body",
                            "body": b"data: " + json.dumps(chunk).encode() + b"\n\n",
                            "more_body": True,
                        }
                    )
                await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

            tasks = [asyncio.ensure_future(stream()), asyncio.ensure_future(until_disconnect(receive))]
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:  # a task group: cancelled, it cancels both
                for task in tasks:
                    task.cancel()
            return

        async def handler():
            return "".join([piece async for piece in self.engine.generate()])

        tasks = [asyncio.ensure_future(handler()), asyncio.ensure_future(until_disconnect(receive))]
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        text = tasks[0].result() if tasks[0] in done else None
        await FakeVllm.reply(send, None if text is None else {"choices": [{"index": 0, "text": text}]})


def test_a_request_past_the_timeout_is_answered_408_and_its_engine_request_aborted(bounds):
    bounds(timeout=0.3)
    engine = Engine()
    out = serve(SlowVllm(engine), {"model": "m", "messages": MSG}, probe=engine.state)
    error = json.loads(out.body)["error"]
    assert out.status == 408 and error["code"] == 408 and "request_timeout_s (0.3 s)" in error["message"], error
    assert out.probe == {"aborted": 1, "running": 0}  # aborted by vLLM's own handler, before the 408 went out
    assert len(out.sent) == 2  # vLLM's late null answer to the "disconnect" never reaches the client
    # in time: answered as usual
    bounds(timeout=30)
    out = serve(SlowVllm(Engine(tokens=3)), {"model": "m", "messages": MSG})
    assert out.status == 200 and json.loads(out.body)["choices"][0]["text"] == " t1 t2 t3"


def test_a_route_that_ignores_the_disconnect_is_cancelled_after_the_grace(bounds, monkeypatch):
    bounds(timeout=0.2)
    monkeypatch.setattr(middleware, "ABORT_GRACE_S", 0.2)
    engine = Engine()

    async def deaf(scope, receive, send):
        await receive()
        async for _ in engine.generate():
            pass

    out = serve(deaf, {"prompt": "x"}, path="/v1/completions", probe=engine.state)
    assert out.status == 408 and out.probe == {"aborted": 1, "running": 0}


def test_a_stream_past_the_timeout_ends_with_a_finish_reason_and_an_error_event(bounds):
    bounds(timeout=0.3)
    engine = Engine(pace_s=0.05)
    body = {"model": "m", "messages": MSG, "stream": True}
    out = serve(SlowVllm(engine), body, probe=engine.state)
    assert out.status == 200  # the stream had started: the status was sent
    text, finishes, errors = stream_result(out.body)
    assert text.startswith(" t1 t2") and finishes == ["abort"]
    assert [e["code"] for e in errors] == [408]
    last = [p for p in events(out.body) if isinstance(p, dict) and "choices" in p][-1]
    assert last["id"] == "s1" and last["object"] == "chat.completion.chunk" and last["choices"][0]["delta"] == {}
    assert out.probe == {"aborted": 1, "running": 0}


def test_the_timeout_covers_the_thinking_budgets_continuation(bounds):
    """The budget's internal calls run inside the request's time: a continuation still going at the timeout is
    aborted, and the client's stream ends as any other."""
    bounds(timeout=0.4)
    engine = Engine(pace_s=0.05)

    class SlowContinuation(FakeVllm):
        async def __call__(self, scope, receive, send):
            if scope["path"] == "/v1/completions":
                return await SlowVllm(engine)(scope, receive, send)
            return await super().__call__(scope, receive, send)

    app = SlowContinuation("I am still|thinking")
    body = {"model": "m", "messages": MSG, "max_tokens": 64, "thinking": True, "stream": True}
    out = serve(app, body, probe=engine.state)
    text, finishes, errors = stream_result(out.body)
    assert text.startswith("I am stillthinking\n</think>\n\n t1") and finishes == ["abort"]
    assert [e["code"] for e in errors] == [408] and out.probe == {"aborted": 1, "running": 0}


def test_a_client_that_leaves_aborts_the_continuation_too(bounds):
    """The budget's own call into vLLM hears the client leave as the client's request does (it used to run on)."""
    engine = Engine()

    class Continuation(FakeVllm):
        async def __call__(self, scope, receive, send):
            if scope["path"] == "/v1/completions":
                return await SlowVllm(engine)(scope, receive, send)
            return await super().__call__(scope, receive, send)

    async def run():
        raw = json.dumps({"model": "m", "messages": MSG, "max_tokens": 64, "thinking": True}).encode()
        messages = [{"type": "http.request", "body": raw, "more_body": False}]
        leave = asyncio.Event()

        async def receive():
            if messages:
                return messages.pop()
            await leave.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            pass

        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
        request = asyncio.ensure_future(ThinkingMiddleware(Continuation("a|b"))(scope, receive, send))
        while not engine.running:
            await asyncio.sleep(0.01)
        leave.set()
        await asyncio.wait_for(request, 5)
        return engine.state()

    assert asyncio.run(run()) == {"aborted": 1, "running": 0}


# ---------- the thinking budget: no max_tokens, max_model_len, a failed continuation ----------


class BudgetVllm(FakeVllm):
    """FakeVllm whose /tokenize also tells max_model_len, as vLLM's does, and whose continuation can fail."""

    def __init__(self, first_text, max_model_len, continuation="ok", finish="length"):
        super().__init__(first_text, finish)
        self.max_model_len, self.continuation = max_model_len, continuation

    async def __call__(self, scope, receive, send):
        if scope["path"] == "/tokenize":
            body = json.loads((await receive())["body"])
            self.calls.append((scope["path"], body))
            tokens = [1, 2, 3] if "messages" in body else [len(w) for w in body["prompt"].split()]
            return await self.reply(send, {"tokens": tokens, "count": len(tokens), "max_model_len": self.max_model_len})
        if scope["path"] == "/v1/completions" and self.continuation != "ok":
            body = json.loads((await receive())["body"])
            self.calls.append((scope["path"], body))
            if self.continuation == "refused":
                error = {"error": {"message": "This model's maximum context length is ...", "code": 400}}
                data = json.dumps(error).encode()
                await send({"type": "http.response.start", "status": 400, "headers": []})
                return await send({"type": "http.response.body", "body": data, "more_body": False})
            chunk = {"choices": [{"index": 0, "text": " The", "finish_reason": None}]}
            if self.continuation == "error event":  # vLLM's own mid-stream failure: an error event, no finish
                return await self.stream(send, [chunk, {"error": {"message": "engine dead", "code": 500}}])
            if self.continuation == "no finish":
                return await self.stream(send, [chunk])
            await self.stream(send, [chunk])  # "raises": the route dies after a chunk
            raise RuntimeError("engine core died")
        return await super().__call__(scope, receive, send)


def test_continuation_room_keeps_prompt_thought_and_answer_inside_max_model_len():
    prompt = Prompt(list(range(500)), 13568)
    assert continuation_room(prompt, 12288 - 256, 256) == 256  # GPQA: room to spare
    assert continuation_room(prompt, 13568 - 500 - 100, 256) == 100  # near the end: what is left
    assert continuation_room(prompt, 13568 - 500, 256) == 0
    assert continuation_room(Prompt([1], None), 10**6, 256) == 256  # max_model_len unknown: the reserve


def test_without_max_tokens_the_budget_reserves_from_max_model_len_minus_the_prompt(bounds):
    app = BudgetVllm("I am still thin|king about", max_model_len=100)
    body = {"model": "m", "messages": MSG, "thinking": True}
    out = serve(app, body)
    content = json.loads(out.body)["choices"][0]["message"]["content"]
    assert out.status == 200 and content.endswith("\n</think>\n\n The answer is (B).")
    (_, chat_tok), (_, first), (_, text_tok), (_, cont) = app.calls  # the prompt is tokenized once
    assert chat_tok["messages"] == MSG and first["max_tokens"] == 100 - 3 - 20 and "max_tokens" not in body
    assert cont["prompt"][:3] == [1, 2, 3] and cont["max_tokens"] == 20
    # a prompt that leaves less than twice the reserve: the thought still keeps half
    app = BudgetVllm("thin|king", max_model_len=33)
    serve(app, body)
    assert app.calls[1][1]["max_tokens"] == 30 - 15
    # a prompt that fills the context: no budget, vLLM answers the request as sent (with its own 4xx)
    app = BudgetVllm("x", max_model_len=3)
    serve(app, body)
    assert [path for path, _ in app.calls] == ["/tokenize", "/v1/chat/completions"]
    assert "max_tokens" not in app.calls[1][1]
    # thinking off, or a max_tokens given: no extra tokenize call
    for other in ({**body, "thinking": False}, {**body, "max_tokens": 64}):
        app = BudgetVllm("x|y", max_model_len=100, finish="stop")
        serve(app, other)
        assert [path for path, _ in app.calls] == ["/v1/chat/completions"], other


@pytest.mark.parametrize("stream", [False, True])
def test_a_continuation_never_passes_max_model_len(bounds, stream):
    """A client may ask for all the context (prompt + max_tokens = max_model_len); the thought re-tokenized with
    its closing can come out longer than generated, and the continuation gets only what is left."""
    body = {"model": "m", "messages": MSG, "max_tokens": 17, "thinking": True, "stream": stream}
    thought = "a b c d e f g h i|j"  # 9 words, the closing's </think> a 10th: the fake's tokens are words
    app = BudgetVllm(thought, max_model_len=100)
    serve(app, body)
    assert app.calls[0][1]["max_tokens"] == 17 - 8  # the reserve: half the cap
    assert app.calls[-1][0] == "/v1/completions" and app.calls[-1][1]["max_tokens"] == 8  # room to spare
    app = BudgetVllm(thought, max_model_len=20)
    serve(app, body)
    cont = app.calls[-1][1]
    assert len(cont["prompt"]) == 3 + 10 and cont["max_tokens"] == 20 - 13  # not the reserve of 8
    # no room at all: no continuation, the capped thought ends on length
    app = BudgetVllm(thought, max_model_len=13)
    out = serve(app, {**body, "max_tokens": 10})
    assert out.status == 200 and [path for path, _ in app.calls][-1] == "/tokenize"
    if stream:
        text, finishes, errors = stream_result(out.body)
        assert text == "a b c d e f g h ij" and finishes == ["length"] and errors == []
    else:
        assert json.loads(out.body)["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("failure", ["refused", "error event", "no finish", "raises"])
def test_a_failed_continuation_ends_the_stream_with_a_finish_reason_and_an_error_event(bounds, failure):
    app = BudgetVllm("I am still|thinking", max_model_len=1000, continuation=failure)
    body = {"model": "m", "messages": MSG, "max_tokens": 64, "thinking": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    out = serve(app, body)
    text, finishes, errors = stream_result(out.body)
    assert out.status == 200 and text.startswith("I am stillthinking\n</think>\n\n") and finishes == ["length"]
    assert len(errors) == 1 and "the answer after the capped thought failed" in errors[0]["message"], errors
    payloads = events(out.body)
    finish_at = next(
        i
        for i, p in enumerate(payloads)
        if isinstance(p, dict) and p.get("choices") and p["choices"][0]["finish_reason"]
    )
    error_at = next(i for i, p in enumerate(payloads) if isinstance(p, dict) and "error" in p)
    assert finish_at < error_at and payloads[-2]["usage"]["completion_tokens"] >= 6  # finish, error, usage, [DONE]


def test_a_continuation_whose_prompt_cannot_be_tokenized_ends_the_stream_too(bounds):
    class NoTokenize(FakeVllm):
        async def __call__(self, scope, receive, send):
            if scope["path"] == "/tokenize":
                await receive()
                await send({"type": "http.response.start", "status": 404, "headers": []})
                return await send({"type": "http.response.body", "body": b"{}", "more_body": False})
            return await super().__call__(scope, receive, send)

    body = {"model": "m", "messages": MSG, "max_tokens": 64, "thinking": True, "stream": True}
    text, finishes, errors = stream_result(serve(NoTokenize("I am still|thinking"), body).body)
    assert text == "I am stillthinking" and finishes == ["length"] and "/tokenize" in errors[0]["message"]
