"""The one request rewrite vLLM lacks, as raw ASGI middleware (vLLM's --middleware; needs no
starlette): a top-level "thinking" on /invocations and /v1/chat/completions becomes
chat_template_kwargs.enable_thinking.

Everything else is vLLM's own: /invocations already dispatches chat (messages) and completion
(prompt) bodies, and /ping is vLLM's health check. vLLM binds the port before the engine starts
but only listens once the engine is up, so /ping cannot answer before the model can generate.
"""

from __future__ import annotations

import json

PATHS = {"/invocations", "/v1/chat/completions"}


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


class ThinkingMiddleware:
    def __init__(self, app):
        self.app = app

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
        body = rewrite_body(scope["path"], raw)
        if body is not None:
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
            scope = dict(scope, headers=headers + [(b"content-length", str(len(body)).encode())])
            raw = body
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": raw, "more_body": False}

        await self.app(scope, replay, send)
