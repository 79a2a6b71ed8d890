"""The request handling vLLM lacks, as raw ASGI middleware (vLLM's --middleware; needs no starlette).

1. A top-level "thinking" on /invocations and /v1/chat/completions becomes chat_template_kwargs.enable_thinking.
2. Thinking budget: a thinking chat request whose max_tokens runs out inside <think> would return a thought
   and no answer. With THINKING_RESERVE_TOKENS > 0 such a request first runs with max_tokens minus a
   reserve; if it stops on length, the think block is closed (when still open) and the same text is
   continued for the reserve through vLLM's own tokenizer and /v1/completions, so a capped thought still
   ends in an answer and the total never exceeds the client's max_tokens.

Everything else is vLLM's own: /invocations already dispatches chat (messages) and completion
(prompt) bodies, and /ping is vLLM's health check. vLLM binds the port before the engine starts
but only listens once the engine is up, so /ping cannot answer before the model can generate.
"""

from __future__ import annotations

import asyncio
import json
import os

PATHS = {"/invocations", "/v1/chat/completions"}
CLOSE_THINK = "\n</think>\n\n"
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
    except ValueError:
        return None  # vLLM answers malformed JSON itself
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


def answer_reserve(body, default_thinking: bool, reserve_tokens: int) -> int:
    """Tokens held back for the answer of this (already rewritten) request; 0 = no budget handling."""
    if reserve_tokens <= 0 or not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        return 0
    if body.get("n", 1) != 1 or body.get("tools") or body.get("echo"):
        return 0  # one plain answer only: merging n choices or tool calls is not worth the risk
    kwargs = body.get("chat_template_kwargs")
    thinking = kwargs.get("enable_thinking", default_thinking) if isinstance(kwargs, dict) else default_thinking
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    if not thinking or type(limit) is not int or limit < 2:
        return 0  # no cap (vLLM fills the context) or a bad one (vLLM answers it with a 4xx)
    return min(reserve_tokens, limit // 2)  # the thought keeps at least half


def capped_body(body: dict, reserve: int) -> dict:
    key = "max_completion_tokens" if body.get("max_completion_tokens") else "max_tokens"
    return dict(body, **{key: body[key] - reserve})


def closing_text(generated: str) -> str:
    """What goes between the capped text and its continuation: close the thought if it is still open."""
    return "" if "</think>" in generated else CLOSE_THINK


def continuation_body(body: dict, prompt_ids: list[int], reserve: int, stream: bool) -> dict:
    out = {key: body[key] for key in SAMPLING_KEYS if key in body}
    out.update(model=body.get("model"), prompt=prompt_ids, max_tokens=reserve, stream=stream)
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


class ThinkingMiddleware:
    def __init__(self, app):
        self.app = app
        self.default_thinking = os.environ.get("DEFAULT_THINKING", "0") == "1"
        self.reserve_tokens = int(os.environ.get("THINKING_RESERVE_TOKENS", "0"))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope["path"] not in PATHS:
            return await self.app(scope, receive, send)
        chunks = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # client went away
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        raw = b"".join(chunks)
        rewritten = rewrite_body(scope["path"], raw)
        raw = raw if rewritten is None else rewritten
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        reserve = answer_reserve(body, self.default_thinking, self.reserve_tokens)
        if reserve:
            raw = json.dumps(capped_body(body, reserve)).encode()
        if reserve or rewritten is not None:
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
            scope = dict(scope, headers=headers + [(b"content-length", str(len(raw)).encode())])
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": raw, "more_body": False}

        if not reserve:
            return await self.app(scope, replay, send)
        if body.get("stream"):
            return await self._stream_with_budget(scope, replay, send, body, reserve)
        return await self._with_budget(scope, replay, send, body, reserve)

    # ----- internal calls into vLLM's own endpoints -----

    async def _call(self, scope, path: str, body: dict, on_body=None) -> tuple[int, bytes]:
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
        sent, status, collected = False, 500, []

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": data, "more_body": False}
            await asyncio.Event().wait()  # nobody disconnects from an internal call

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

        await self.app(inner, receive, capture)
        return status, b"".join(collected)

    async def _continuation_prompt(self, scope, body: dict, generated: str) -> list[int] | None:
        chat = {"model": body.get("model"), "messages": body["messages"], "add_generation_prompt": True}
        for key in ("chat_template_kwargs", "chat_template", "add_special_tokens"):
            if key in body:
                chat[key] = body[key]
        status, prompt = await self._call(scope, "/tokenize", chat)
        if status != 200:
            return None
        status, text = await self._call(
            scope, "/tokenize", {"model": body.get("model"), "prompt": generated, "add_special_tokens": False}
        )
        if status != 200:
            return None
        return json.loads(prompt)["tokens"] + json.loads(text)["tokens"]

    # ----- the two response shapes -----

    async def _with_budget(self, scope, receive, send, body, reserve):
        start, parts = None, []

        async def hold(message):
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
            else:
                parts.append(message.get("body", b""))

        await self.app(scope, receive, hold)
        out = b"".join(parts)
        if start["status"] == 200:
            first = json.loads(out)
            choice = first["choices"][0]
            content = (choice.get("message") or {}).get("content")
            if choice.get("finish_reason") == "length" and isinstance(content, str):
                closing = closing_text(content)
                ids = await self._continuation_prompt(scope, body, content + closing)
                if ids is not None:
                    status, more = await self._call(
                        scope, "/v1/completions", continuation_body(body, ids, reserve, stream=False)
                    )
                    if status == 200:
                        out = json.dumps(merge_response(first, closing, json.loads(more))).encode()
        headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
        await send(dict(start, headers=headers + [(b"content-length", str(len(out)).encode())]))
        await send({"type": "http.response.body", "body": out, "more_body": False})

    async def _stream_with_budget(self, scope, receive, send, body, reserve):
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
        if stream.truncated and stream.template is not None:
            closing = closing_text(stream.text)
            ids = await self._continuation_prompt(scope, body, stream.text + closing)
            if ids is not None:
                if closing:
                    await send({"type": "http.response.body", "body": stream.chunk(closing, None), "more_body": True})
                rest = b""

                async def relay(data: bytes):
                    nonlocal rest, more_usage
                    events, rest = sse_events(rest + data)
                    for event in events:
                        payload = sse_data(event)
                        if not isinstance(payload, dict):
                            continue
                        if payload.get("usage") and not payload.get("choices"):
                            more_usage = payload["usage"]
                        for choice in payload.get("choices") or []:
                            await send(
                                {
                                    "type": "http.response.body",
                                    "more_body": True,
                                    "body": stream.chunk(choice.get("text") or "", choice.get("finish_reason")),
                                }
                            )

                await self._call(scope, "/v1/completions", continuation_body(body, ids, reserve, stream=True), relay)
            else:
                await send({"type": "http.response.body", "body": stream.chunk("", "length"), "more_body": True})
        await send({"type": "http.response.body", "body": stream.tail(more_usage), "more_body": False})
