"""The request handling vLLM lacks, as raw ASGI middleware (vLLM's --middleware; needs no starlette).

1. A top-level "thinking" on /invocations and /v1/chat/completions becomes chat_template_kwargs.enable_thinking.
2. Thinking budget: a thinking chat request whose max_tokens runs out inside <think> would return a thought
   and no answer. With THINKING_RESERVE_TOKENS > 0 such a request first runs with max_tokens minus a
   reserve (without max_tokens, the server's own cap: max_model_len minus the prompt); if it stops on length,
   the think block is closed (when still open) and the same text is continued for the reserve through vLLM's
   own tokenizer and /v1/completions, so a capped thought still ends in an answer, the total never exceeds the
   client's max_tokens and prompt + thought + answer never exceed max_model_len. A stream whose continuation
   fails still ends with a finish_reason, then an error event.
3. Bounds on every request: a body over MAX_REQUEST_BYTES is answered 413 as soon as its Content-Length or its
   bytes so far pass the limit (the rest is never read); a body not all arrived BODY_TIMEOUT_S after the request
   began is answered 408 before it reaches the engine (a client that trickles its body, or stops sending it, holds
   a slot that long at most); a request still running after REQUEST_TIMEOUT_S is answered 408 and its engine
   request aborted (vLLM hears a client disconnect), or, on a stream already started, ended with a finish_reason
   "abort" chunk and an error event. Beyond MAX_REQUESTS_IN_FLIGHT requests at once (health checks aside), a
   request is answered 503 with Retry-After, unread.

Everything else is vLLM's own: /invocations already dispatches chat (messages) and completion
(prompt) bodies, and /ping is vLLM's health check. vLLM binds the port before the engine starts
but only listens once the engine is up, so /ping cannot answer before the model can generate.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass

from serving.settings import SERVE

PATHS = {"/invocations", "/v1/chat/completions"}
# Health checks and metrics take no slot: an orchestrator must see a busy server as alive.
UNBOUNDED_PATHS = {"/ping", "/health", "/metrics"}
RETRY_AFTER_S = 1  # a full server's advice to the client it turns away
# On an answer given before the body was all read: the HTTP server drops the connection and the rest of the body
# with it, rather than keep reading it for the next request.
CLOSE = (b"connection", b"close")
CLOSE_THINK = "\n</think>\n\n"
# After a timeout, how long vLLM's handlers get to hear the disconnect and abort their engine request themselves:
# cancelling a non-streamed handler at once would orphan the tasks vLLM's with_cancellation runs it in, and the
# engine would go on generating for nobody.
ABORT_GRACE_S = 5.0
# Sampling fields a continuation keeps so it decodes as the first part did.
SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
)


def rewrite_body(path: str, raw: bytes) -> bytes | None:
    """The new body, or None to pass the request through unchanged."""
    if path not in PATHS:
        return None
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None  # vLLM answers malformed (or absurdly nested) JSON itself
    if not isinstance(body, dict) or "thinking" not in body:
        return None
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        return None  # vLLM rejects a malformed chat_template_kwargs with a 4xx itself
    thinking = bool(body.pop("thinking"))
    if path == "/v1/chat/completions" or "messages" in body:
        kwargs.setdefault("enable_thinking", thinking)  # an explicit chat_template_kwargs wins
        body["chat_template_kwargs"] = kwargs
    return json.dumps(body).encode()


def budgeted(body, default_thinking: bool) -> bool:
    """Whether this (already rewritten) request gets the thinking budget: one plain thinking chat answer."""
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        return False
    if body.get("n", 1) != 1 or body.get("tools") or body.get("echo"):
        return False  # one plain answer only: merging n choices or tool calls is not worth the risk
    kwargs = body.get("chat_template_kwargs")
    return bool(kwargs.get("enable_thinking", default_thinking) if isinstance(kwargs, dict) else default_thinking)


def client_limit(body: dict):
    """The client's cap on generated tokens, as vLLM reads it (None: none given)."""
    if body.get("max_completion_tokens") is not None:
        return body["max_completion_tokens"]
    return body.get("max_tokens")


def answer_reserve(body, default_thinking: bool, reserve_tokens: int, server_cap: int | None = None) -> int:
    """Tokens held back for the answer of this (already rewritten) request; 0 = no budget handling.

    server_cap: what vLLM would generate at most without a max_tokens (max_model_len minus the prompt)."""
    if reserve_tokens <= 0 or not budgeted(body, default_thinking):
        return 0
    limit = client_limit(body)
    if limit is None:
        limit = server_cap
    if type(limit) is not int or limit < 2:
        return 0  # no cap known, or a bad one (vLLM answers it with a 4xx)
    return min(reserve_tokens, limit // 2)  # the thought keeps at least half


def capped_body(body: dict, reserve: int, limit: int) -> dict:
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return dict(body, **{key: limit - reserve})


@dataclass(frozen=True)
class Prompt:
    """A chat request's prompt as vLLM tokenizes it, and the context it has to fit in."""

    tokens: list[int]
    max_model_len: int | None

    def room(self, after: int = 0) -> int | None:
        """Tokens vLLM may still generate after the prompt and `after` more (None: max_model_len unknown)."""
        return None if self.max_model_len is None else self.max_model_len - len(self.tokens) - after


def continuation_room(prompt: Prompt, generated_tokens: int, reserve: int) -> int:
    """max_tokens of the continuation: the reserve, unless prompt + thought + answer would pass max_model_len."""
    room = prompt.room(generated_tokens)
    return reserve if room is None else min(reserve, room)


def closing_text(generated: str) -> str:
    """What goes between the capped text and its continuation: close the thought if it is still open."""
    return "" if "</think>" in generated else CLOSE_THINK


def continuation_body(body: dict, prompt_ids: list[int], max_tokens: int, stream: bool) -> dict:
    out = {key: body[key] for key in SAMPLING_KEYS if key in body}
    out.update(model=body.get("model"), prompt=prompt_ids, max_tokens=max_tokens, stream=stream)
    if stream:
        out["stream_options"] = {"include_usage": True}
    return {k: v for k, v in out.items() if v is not None}


def merge_response(first: dict, closing: str, continuation: dict) -> dict:
    """A non-streamed chat response with the continuation appended, as if one generation produced it."""
    merged = json.loads(json.dumps(first))
    choice, extra = merged["choices"][0], continuation["choices"][0]
    choice["message"]["content"] += closing + extra["text"]
    choice["finish_reason"] = extra["finish_reason"]
    choice["stop_reason"] = extra.get("stop_reason")
    usage, more = merged.get("usage"), continuation.get("usage") or {}
    if usage:
        usage["completion_tokens"] += more.get("completion_tokens", 0)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return merged


def sse_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Complete server-sent events in buffer (without the blank line) and the incomplete rest."""
    *events, rest = buffer.split(b"\n\n")
    return events, rest


def sse_data(event: bytes):
    """The JSON payload of a `data:` event, "[DONE]", or None for anything else."""
    text = event.decode("utf-8", "replace").strip()
    if not text.startswith("data:"):
        return None
    payload = text[len("data:") :].strip()
    if payload == "[DONE]":
        return payload
    try:
        return json.loads(payload)
    except ValueError:
        return None


def sse(payload) -> bytes:
    return b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n"


def error_payload(status: int, error_type: str, message: str) -> dict:
    """vLLM's own error shape (ErrorResponse), for a response and for a stream's error event alike."""
    return {"error": {"message": message, "type": error_type, "param": None, "code": status}}


async def send_error(send, status: int, error_type: str, message: str, headers=()) -> None:
    data = json.dumps(error_payload(status, error_type, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data, "more_body": False})


def finish_chunk(last: bytes, chat: bool, finish_reason: str) -> bytes:
    """A stream chunk that ends choice 0 with finish_reason, shaped like the last chunk the client got."""
    template = {}
    for event in sse_events(last + b"\n\n")[0]:
        payload = sse_data(event)
        if isinstance(payload, dict) and payload.get("choices"):
            template = payload
    if template:
        chat = "delta" in template["choices"][0]
    payload = {key: template[key] for key in ("id", "object", "created", "model") if key in template}
    payload.setdefault("object", "chat.completion.chunk" if chat else "text_completion")
    choice = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
    choice.update({"delta": {}} if chat else {"text": ""})
    return sse(dict(payload, choices=[choice]))


def declared_length(headers) -> int | None:
    for key, value in headers:
        if key.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server refuses a bad Content-Length itself
    return None


def downstream_receive(body: bytes, gone: asyncio.Event):
    """receive() for a call into vLLM: the body, then a disconnect once the client left or time ran out."""
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    return receive


async def hear_disconnect(receive, gone: asyncio.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


class _Client:
    """What of a response reached the client, so that a request cut short can still end properly."""

    def __init__(self, send):
        self.to_client, self.chat = send, False
        self.started = self.streaming = self.finished = self.cut = False
        self.last = b""  # the last body message of a stream that carried choices

    async def send(self, message) -> None:
        if self.cut:
            return  # what an aborted request still sends goes nowhere
        if message["type"] == "http.response.start":
            self.started = True
            headers = {key.lower(): value for key, value in message.get("headers", [])}
            self.streaming = headers.get(b"content-type", b"").startswith(b"text/event-stream")
        elif message["type"] == "http.response.body":
            body = message.get("body", b"")
            if self.streaming and b'"choices"' in body:
                self.last = body
            self.finished = not message.get("more_body", False)
        await self.to_client(message)

    async def end(self, status: int, error_type: str, message: str) -> None:
        """Answer status if nothing was sent yet, else end the stream with finish_reason abort and an error event."""
        self.cut = True
        if self.finished:
            return
        if not self.started:
            return await send_error(self.to_client, status, error_type, message)
        data = b""  # a JSON body cut short cannot be mended: the response just ends
        if self.streaming:
            data = finish_chunk(self.last, self.chat, "abort") + sse(error_payload(status, error_type, message))
            data += sse(b"[DONE]")
        await self.to_client({"type": "http.response.body", "body": data, "more_body": False})


class _Stream:
    """Reads a chat stream as it passes: the generated text, where it stopped, the usage chunk."""

    def __init__(self):
        self.text, self.truncated, self.template, self.usage, self.rest = "", False, None, None, b""

    def feed(self, data: bytes) -> bytes:
        """Bytes to forward now; a length stop is forwarded as unfinished and usage/[DONE] are held back."""
        events, self.rest = sse_events(self.rest + data)
        out = []
        for event in events:
            payload = sse_data(event)
            if payload == "[DONE]":
                continue
            if isinstance(payload, dict) and not payload.get("choices") and payload.get("usage"):
                self.usage = payload
                continue
            if isinstance(payload, dict) and payload.get("choices"):
                choice = payload["choices"][0]
                self.template = payload
                self.text += (choice.get("delta") or {}).get("content") or ""
                if choice.get("finish_reason") == "length":
                    self.truncated = True
                    choice["finish_reason"] = None
                    event = sse(payload)[:-2]
            out.append(event + b"\n\n")
        return b"".join(out)

    def chunk(self, content: str, finish_reason) -> bytes:
        payload = json.loads(json.dumps(self.template))
        payload["choices"] = [
            {"index": 0, "delta": {"content": content}, "logprobs": None, "finish_reason": finish_reason}
        ]
        payload.pop("usage", None)
        return sse(payload)

    def tail(self, more_usage: dict | None) -> bytes:
        out = b""
        if self.usage is not None:
            usage = self.usage["usage"]
            if more_usage:
                usage["completion_tokens"] += more_usage.get("completion_tokens", 0)
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            out += sse(self.usage)
        return out + sse(b"[DONE]")


def _setting(name: str, parse):
    setting = SERVE[name]
    return parse(os.environ.get(setting.flag, setting.default))


class ThinkingMiddleware:
    def __init__(self, app):
        self.app = app
        self.default_thinking = os.environ.get("DEFAULT_THINKING", "0") == "1"
        self.reserve_tokens = _setting("thinking_reserve_tokens", int)
        self.request_timeout_s = _setting("request_timeout_s", float)
        self.max_request_bytes = _setting("max_request_bytes", int)
        self.body_timeout_s = _setting("body_timeout_s", float)
        self.max_requests_in_flight = _setting("max_requests_in_flight", int)
        self.in_flight = 0  # one instance serves every request of the API server's event loop

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["path"] in UNBOUNDED_PATHS:
            return await self._bounded(scope, receive, send)
        if self.in_flight >= self.max_requests_in_flight:
            return await send_error(
                send,
                503,
                "ServiceUnavailableError",
                f"the server is at its max_requests_in_flight ({self.max_requests_in_flight}): retry later",
                [(b"retry-after", str(RETRY_AFTER_S).encode()), CLOSE],
            )
        self.in_flight += 1
        try:
            await self._bounded(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _bounded(self, scope, receive, send):
        client, gone = _Client(send), asyncio.Event()
        work = asyncio.ensure_future(self._serve(scope, receive, client, gone))
        try:
            done, _ = await asyncio.wait({work}, timeout=self.request_timeout_s)
            if work in done:
                return work.result()
            client.cut = True
            gone.set()  # vLLM's handlers hear a disconnect and abort their engine requests
            done, _ = await asyncio.wait({work}, timeout=ABORT_GRACE_S)
            if not done:
                work.cancel()
                await asyncio.wait({work})
            if not work.cancelled():
                work.exception()  # retrieved: what a cut request raised is not news
            await client.end(
                408,
                "RequestTimeoutError",
                f"the request ran past the server's request_timeout_s ({self.request_timeout_s:g} s) and was aborted",
            )
        finally:
            if not work.done():
                work.cancel()

    async def _serve(self, scope, receive, client: _Client, gone: asyncio.Event):
        raw = await self._read_body(scope, receive, client.send)
        if raw is None:
            return
        client.chat = scope["path"] == "/v1/chat/completions" or b'"messages"' in raw
        listener = asyncio.ensure_future(hear_disconnect(receive, gone))
        try:
            await self._handle(scope, raw, gone, client.send)
        finally:
            listener.cancel()

    async def _read_body(self, scope, receive, send) -> bytes | None:
        """The whole body, or None once it is answered 413 (read no further) or 408 (not all there in time), or the
        client went away."""
        limit = self.max_request_bytes
        too_large = f"the request body is over the server's max_request_bytes ({limit} bytes)"
        declared = declared_length(scope.get("headers", []))
        if declared is not None and declared > limit:
            return await send_error(send, 413, "RequestEntityTooLargeError", too_large, [CLOSE])
        chunks, size = [], 0
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:
                return await send_error(
                    send,
                    408,
                    "RequestTimeoutError",
                    f"the request body did not all arrive within the server's body_timeout_s ({self.body_timeout_s:g} "
                    f"s); {size} bytes came",
                    [CLOSE],
                )
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await send_error(send, 413, "RequestEntityTooLargeError", too_large, [CLOSE])
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)

    async def _handle(self, scope, raw: bytes, gone: asyncio.Event, send):
        if scope.get("method") != "POST" or scope["path"] not in PATHS:
            return await self.app(scope, downstream_receive(raw, gone), send)
        rewritten = rewrite_body(scope["path"], raw)
        raw = raw if rewritten is None else rewritten
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            body = None
        reserve = answer_reserve(body, self.default_thinking, self.reserve_tokens)
        limit, prompt = (client_limit(body) if reserve else None), None
        if not reserve and budgeted(body, self.default_thinking) and client_limit(body) is None:
            # no max_tokens: vLLM would generate up to max_model_len minus the prompt, the cap the reserve comes from
            prompt = await self._chat_prompt(scope, gone, body)
            limit = None if prompt is None else prompt.room()
            reserve = answer_reserve(body, self.default_thinking, self.reserve_tokens, server_cap=limit)
        if reserve:
            raw = json.dumps(capped_body(body, reserve, limit)).encode()
        if reserve or rewritten is not None:
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
            scope = dict(scope, headers=headers + [(b"content-length", str(len(raw)).encode())])
        receive = downstream_receive(raw, gone)
        if not reserve:
            return await self.app(scope, receive, send)
        if body.get("stream"):
            return await self._stream_with_budget(scope, gone, receive, send, body, reserve, prompt)
        return await self._with_budget(scope, gone, receive, send, body, reserve, prompt)

    # ----- internal calls into vLLM's own endpoints -----

    async def _call(self, scope, gone: asyncio.Event, path: str, body: dict, on_body=None) -> tuple[int, bytes]:
        """POST body to one of vLLM's routes in-process; body chunks go to on_body if given."""
        data = json.dumps(body).encode()
        keep = [(k, v) for k, v in scope["headers"] if k.lower() == b"authorization"]
        inner = dict(
            scope,
            path=path,
            raw_path=path.encode(),
            query_string=b"",
            headers=keep + [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
        )
        status, collected = 500, []

        async def capture(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                if on_body is not None and status == 200:
                    await on_body(chunk)
                else:
                    collected.append(chunk)

        await self.app(inner, downstream_receive(data, gone), capture)
        return status, b"".join(collected)

    async def _tokens(self, scope, gone, request: dict) -> dict | None:
        status, out = await self._call(scope, gone, "/tokenize", request)
        return json.loads(out) if status == 200 else None

    async def _chat_prompt(self, scope, gone, body: dict) -> Prompt | None:
        chat = {"model": body.get("model"), "messages": body["messages"], "add_generation_prompt": True}
        for key in ("chat_template_kwargs", "chat_template", "add_special_tokens"):
            if key in body:
                chat[key] = body[key]
        out = await self._tokens(scope, gone, chat)
        return None if out is None else Prompt(out["tokens"], out.get("max_model_len"))

    async def _continuation(self, scope, gone, body: dict, prompt: Prompt | None, generated: str, reserve: int):
        """(prompt ids, max_tokens) of the continuation of `generated`, or None when they cannot be had."""
        prompt = prompt or await self._chat_prompt(scope, gone, body)
        if prompt is None:
            return None
        text = {"model": body.get("model"), "prompt": generated, "add_special_tokens": False}
        out = await self._tokens(scope, gone, text)
        if out is None:
            return None
        return prompt.tokens + out["tokens"], continuation_room(prompt, len(out["tokens"]), reserve)

    # ----- the two response shapes -----

    async def _with_budget(self, scope, gone, receive, send, body, reserve, prompt):
        start, parts = None, []

        async def hold(message):
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
            else:
                parts.append(message.get("body", b""))

        await self.app(scope, receive, hold)
        if start is None:
            return  # the client left before vLLM answered
        out = b"".join(parts)
        if start["status"] == 200 and not gone.is_set():
            first = json.loads(out)
            choice = first["choices"][0]
            content = (choice.get("message") or {}).get("content")
            if choice.get("finish_reason") == "length" and isinstance(content, str):
                closing = closing_text(content)
                continuation = await self._continuation(scope, gone, body, prompt, content + closing, reserve)
                # no room left in the context: the capped thought is the answer, finish_reason length
                if continuation is not None and continuation[1] > 0:
                    ids, max_tokens = continuation
                    status, more = await self._call(
                        scope, gone, "/v1/completions", continuation_body(body, ids, max_tokens, stream=False)
                    )
                    if status == 200 and not gone.is_set():  # else vLLM answered a disconnect with null
                        out = json.dumps(merge_response(first, closing, json.loads(more))).encode()
        headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
        await send(dict(start, headers=headers + [(b"content-length", str(len(out)).encode())]))
        await send({"type": "http.response.body", "body": out, "more_body": False})

    async def _stream_with_budget(self, scope, gone, receive, send, body, reserve, prompt):
        stream, status = _Stream(), None

        async def watch(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                return await send(message)
            if status != 200:
                return await send(message)
            data = stream.feed(message.get("body", b""))
            if data:
                await send({"type": "http.response.body", "body": data, "more_body": True})

        await self.app(scope, receive, watch)
        if status != 200:
            return
        more_usage = None
        if stream.truncated and stream.template is not None and not gone.is_set():
            more_usage = await self._stream_continuation(scope, gone, send, body, reserve, prompt, stream)
        await send({"type": "http.response.body", "body": stream.tail(more_usage), "more_body": False})

    async def _stream_continuation(self, scope, gone, send, body, reserve, prompt, stream: _Stream) -> dict | None:
        """Streams the answer after a capped thought; whatever happens, the stream gets its finish_reason (after
        which an error event says what failed). Returns the continuation's usage."""
        more_usage, finished, failure = None, False, None
        closing = closing_text(stream.text)

        async def chunk(content: str, finish_reason) -> None:
            await send({"type": "http.response.body", "body": stream.chunk(content, finish_reason), "more_body": True})

        try:
            continuation = await self._continuation(scope, gone, body, prompt, stream.text + closing, reserve)
            if continuation is None:
                failure = "vLLM's /tokenize refused the continuation's prompt"
            elif continuation[1] > 0:  # else no room left in the context: the capped thought ends it on length
                ids, max_tokens = continuation
                if closing:
                    await chunk(closing, None)
                rest = b""

                async def relay(data: bytes):
                    nonlocal rest, more_usage, finished, failure
                    events, rest = sse_events(rest + data)
                    for event in events:
                        payload = sse_data(event)
                        if not isinstance(payload, dict):
                            continue
                        if payload.get("error"):
                            failure = str(payload["error"].get("message", payload["error"]))
                        if payload.get("usage") and not payload.get("choices"):
                            more_usage = payload["usage"]
                        for choice in payload.get("choices") or []:
                            finished = finished or choice.get("finish_reason") is not None
                            await chunk(choice.get("text") or "", choice.get("finish_reason"))

                request = continuation_body(body, ids, max_tokens, stream=True)
                status, out = await self._call(scope, gone, "/v1/completions", request, relay)
                if status != 200:
                    failure = f"vLLM's /v1/completions answered {status}: {out.decode('utf-8', 'replace')[:500]}"
                elif not finished:
                    failure = failure or "vLLM's continuation stream ended without a finish_reason"
        except Exception as error:  # the client's stream must still end properly
            failure = f"{type(error).__name__}: {error}"
        if not finished and not gone.is_set():  # a client gone, or ended by the timeout, hears nothing more
            await chunk("", "length")
            if failure:
                message = f"thinking budget: the answer after the capped thought failed: {failure}"
                event = sse(error_payload(500, "InternalServerError", message))
                await send({"type": "http.response.body", "body": event, "more_body": True})
        return more_usage
