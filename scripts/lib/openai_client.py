"""The HTTP side of talking to a served model (vLLM's OpenAI server behind serving/): stdlib only, so the
main interpreter, every venv and the GPU proof can use it."""

import json
import time
import urllib.error
import urllib.request
from typing import Iterable, Iterator


def _open(base_url: str, path: str, body: dict | None, timeout_s: float):
    """POST when there is a JSON body, GET otherwise; an HTTP error status raises urllib's HTTPError."""
    data = json.dumps(body).encode() if body is not None else None
    message = urllib.request.Request(
        base_url + path, data=data, headers={"Content-Type": "application/json"} if data else {}
    )
    return urllib.request.urlopen(message, timeout=timeout_s)


def request(base_url: str, path: str, body: dict | None = None, timeout_s: float = 600) -> tuple[int, str, float]:
    """(HTTP status, body text, seconds), never raising: a refused, dropped or timed-out connection is status 0
    with the reason as the text, so a caller can keep polling or report every endpoint."""
    started = time.monotonic()
    try:
        with _open(base_url, path, body, timeout_s) as reply:
            return reply.status, reply.read().decode(errors="replace"), time.monotonic() - started
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace"), time.monotonic() - started
    except (OSError, ValueError) as error:
        return 0, f"no answer: {getattr(error, 'reason', error)}", time.monotonic() - started


def post_json(base_url: str, path: str, body: dict, timeout_s: float = 600) -> dict:
    """POST a JSON body, return the JSON reply; an HTTP error raises (urllib's HTTPError)."""
    with _open(base_url, path, body, timeout_s) as reply:
        return json.load(reply)


def get_json(base_url: str, path: str, timeout_s: float = 60) -> dict:
    with _open(base_url, path, None, timeout_s) as reply:
        return json.load(reply)


def get_text(base_url: str, path: str, timeout_s: float = 60) -> str:
    with _open(base_url, path, None, timeout_s) as reply:
        return reply.read().decode()


def sse_events(lines: Iterable[bytes | str]) -> Iterator[dict]:
    """The JSON payloads of a server-sent event stream's `data:` lines, up to `data: [DONE]`."""
    for raw in lines:
        line = (raw.decode() if isinstance(raw, bytes) else raw).strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def stream_post(base_url: str, path: str, body: dict, timeout_s: float = 1800) -> Iterator[dict]:
    """POST a streaming request and yield its events as they arrive."""
    with _open(base_url, path, body, timeout_s) as reply:
        yield from sse_events(reply)
