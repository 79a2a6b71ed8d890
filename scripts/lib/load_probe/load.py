"""The served image under concurrent load (rules/load_probe.smk): a mix of valid and invalid requests over the
contract's four endpoints, sent `concurrency` at a time, and the verdict on what came back.

The mix (request_kinds): every endpoint (/v1/completions, /v1/chat/completions, /invocations with a prompt and with
messages), streamed and not, chat with thinking off and on (top-level "thinking", or chat_template_kwargs), one
sampled request; and invalid requests: malformed JSON, fields of the wrong type, a body over serve.max_request_bytes,
max_tokens negative or past max_model_len, a prompt past max_model_len, an unknown model, no messages. plan() sends
every kind once, then the valid kinds in turn, in a seeded shuffle so invalid requests land among valid ones.

The verdict (verdict): a valid request must be answered 200 with a well-formed OpenAI body (a stream: JSON events
ending in [DONE], a finish_reason, no error event), at most max_tokens tokens, a thinking answer cut by the thinking
budget with its thought closed; a greedy one the same ids as the same request sent alone before the load (a first
difference at a near tie, lib/lossless.py's NEAR_TIE_NATS in the lone run's own logprobs, passes: batched
arithmetic may flip it, and nothing after it can be compared). An invalid request must be answered 4xx (the body
over the limit: 413). No request may be answered 5xx or not at all, and afterwards the server must still answer
/ping and serve one more request as it did alone.

Stdlib only (http.client: a body over the limit is answered 413 before it is all sent, which urllib reports as a
broken pipe instead of the answer).
"""

import dataclasses
import http.client
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from lib.lossless import compare_ids
from lib.probe import percentile
from lib.stage import StageError

# The latency classes of the record: one per endpoint (and body kind of /invocations), and the invalid requests.
ENDPOINTS = ("completions", "chat", "invocations_prompt", "invocations_messages")
INVALID = "invalid"
FINISH_REASONS = ("stop", "length")
PLAN_SEED = 0
TOP_LOGPROBS = 2  # enough to tell a near tie from a flip (lib/lossless.py)
UNKNOWN_MODEL = "no-such-model"
PROMPTS = ("The capital of France is", "Q: What is the smallest prime number? A:")
QUESTIONS = ("Say hello.", "Name three colours.")


@dataclass(frozen=True)
class Server:
    """What the variant's serve.json says its server does with a request (serving/settings.py)."""

    max_request_bytes: int
    max_model_len: int
    default_thinking: bool
    thinking_reserve_tokens: int

    @classmethod
    def of(cls, serve: dict) -> "Server":
        return cls(**{setting.name: serve[setting.name] for setting in dataclasses.fields(cls)})


@dataclass(frozen=True)
class Kind:
    """One kind of request of the mix. body: a JSON body, or raw bytes (malformed on purpose). What it is (endpoint
    class, streamed, thinking, greedy) is read from its path and body, and the server's settings."""

    name: str
    path: str
    body: dict | bytes
    server: Server
    valid: bool = True
    expect_status: int | None = None  # an invalid request's exact status, where the server promises one

    @property
    def fields(self) -> dict:
        return self.body if isinstance(self.body, dict) else {}

    @property
    def endpoint(self) -> str:
        """The latency class (ENDPOINTS) of the request."""
        if self.path == "/invocations":
            messages = "messages" in self.fields or b'"messages"' in (
                self.body if isinstance(self.body, bytes) else b""
            )
            return "invocations_messages" if messages else "invocations_prompt"
        return "chat" if self.path == "/v1/chat/completions" else "completions"

    @property
    def chat(self) -> bool:
        """Answered as a chat (message / delta), not a completion (text)."""
        return self.endpoint in ("chat", "invocations_messages")

    @property
    def stream(self) -> bool:
        return self.fields.get("stream") is True

    @property
    def thinking(self) -> bool:
        """Whether the model thinks before it answers: chat_template_kwargs.enable_thinking, else a top-level
        "thinking", else the server's default (serving/middleware.py's order)."""
        if not self.chat:
            return False
        kwargs = self.fields.get("chat_template_kwargs")
        if isinstance(kwargs, dict) and "enable_thinking" in kwargs:
            return bool(kwargs["enable_thinking"])
        return bool(self.fields["thinking"]) if "thinking" in self.fields else self.server.default_thinking

    @property
    def budgeted(self) -> bool:
        """A thinking answer the middleware's thinking budget cuts and finishes: its thought closed, its logprobs
        those of the thought alone."""
        return self.thinking and self.server.thinking_reserve_tokens > 0

    @property
    def greedy(self) -> bool:
        """Temperature 0 with its token ids asked for: compared with the same request sent alone."""
        return self.valid and self.fields.get("temperature") == 0 and bool(self.fields.get("logprobs"))

    @property
    def max_tokens(self):
        return self.fields.get("max_tokens")


def _completion(model, prompt, max_tokens, **sampling) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
    return dict(
        body, **(sampling or {"temperature": 0.0, "logprobs": TOP_LOGPROBS, "return_tokens_as_token_ids": True})
    )


def _chat(model, question, max_tokens) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens}
    return dict(body, temperature=0.0, logprobs=True, top_logprobs=TOP_LOGPROBS, return_tokens_as_token_ids=True)


def _streamed(body: dict) -> dict:
    return dict(body, stream=True, stream_options={"include_usage": True})


def _invocation(body: dict) -> dict:
    """An /invocations body: the contract's bodies name no model."""
    return {key: value for key, value in body.items() if key != "model"}


def request_kinds(model: str, max_tokens: int, server: Server) -> list[Kind]:
    """The mix's kinds, valid first. model: the served model name."""
    completion, other_completion = (_completion(model, prompt, max_tokens) for prompt in PROMPTS)
    chat, other_chat = (_chat(model, question, max_tokens) for question in QUESTIONS)
    thinking = dict(other_chat, thinking=True)
    completions, chats = "/v1/completions", "/v1/chat/completions"
    valid = [
        ("completions", completions, completion),
        ("completions_stream", completions, _streamed(other_completion)),
        ("completions_sampled", completions, _completion(model, PROMPTS[1], max_tokens, temperature=0.8, top_p=0.95)),
        ("chat", chats, chat),
        ("chat_stream", chats, _streamed(other_chat)),
        ("chat_thinking", chats, thinking),
        ("chat_thinking_stream", chats, _streamed(dict(chat, thinking=True))),
        ("chat_thinking_kwargs", chats, dict(chat, chat_template_kwargs={"enable_thinking": True})),
        ("invocations_prompt", "/invocations", _invocation(other_completion)),
        ("invocations_prompt_stream", "/invocations", _invocation(_streamed(completion))),
        ("invocations_messages", "/invocations", _invocation(other_chat)),
        ("invocations_messages_thinking_stream", "/invocations", _invocation(_streamed(thinking))),
    ]
    invalid = [
        ("malformed_json_completions", completions, json.dumps(completion).encode()[:-9]),
        ("malformed_json_invocations", "/invocations", json.dumps(_invocation(chat)).encode()[:-9]),
        ("max_tokens_wrong_type", chats, dict(chat, max_tokens="many")),
        ("messages_wrong_type", chats, dict(chat, messages=QUESTIONS[0])),
        ("stream_wrong_type", completions, dict(completion, stream="maybe")),
        ("chat_template_kwargs_wrong_type", chats, dict(thinking, chat_template_kwargs="on")),
        ("max_tokens_negative", completions, dict(completion, max_tokens=-1)),
        ("max_tokens_negative_thinking_stream", chats, _streamed(dict(thinking, max_tokens=-1))),
        ("max_tokens_over_context", "/invocations", _invocation(dict(completion, max_tokens=server.max_model_len + 1))),
        # every " word" is at least one token, so this is past max_model_len (or, under a small max_request_bytes,
        # over the size limit: a 4xx either way)
        ("prompt_over_context", completions, dict(completion, prompt=" word" * (server.max_model_len + 1))),
        ("unknown_model", completions, dict(completion, model=UNKNOWN_MODEL)),
        ("unknown_model_stream", chats, _streamed(dict(chat, model=UNKNOWN_MODEL))),
        ("no_messages", "/invocations", _invocation(dict(chat, messages=[]))),
    ]
    over_limit = dict(completion, prompt="x" * server.max_request_bytes)
    return (
        [Kind(name, path, body, server) for name, path, body in valid]
        + [Kind(name, path, body, server, valid=False) for name, path, body in invalid]
        + [Kind("body_over_size_limit", completions, over_limit, server, valid=False, expect_status=413)]
    )


def plan(kinds: list[Kind], requests: int, seed: int = PLAN_SEED) -> list[Kind]:
    """`requests` requests: every kind once, then the valid kinds in turn; shuffled (seeded)."""
    if requests < len(kinds):
        raise StageError(
            f"load.requests is {requests}: the mix has {len(kinds)} kinds of request "
            f"(lib/load_probe/load.py request_kinds), each sent at least once; ask for {len(kinds)} or more"
        )
    valid = [kind for kind in kinds if kind.valid]
    planned = list(kinds) + [valid[i % len(valid)] for i in range(requests - len(kinds))]
    random.Random(seed).shuffle(planned)
    return planned


# ----- sending -----


@dataclass
class Answer:
    """What came back for one request, as raw as the checks need it."""

    status: int  # 0: no answer (refused, dropped, timed out)
    latency_ms: float
    text: str = ""  # the body; for a stream, the events' payloads joined
    events: list = field(default_factory=list)  # a stream's `data:` payloads (dicts, or "[DONE]", or unparsed text)
    ttft_ms: float | None = None  # a stream's first event carrying choices
    error: str | None = None  # why there was no answer


def _body_bytes(kind: Kind) -> bytes:
    return kind.body if isinstance(kind.body, bytes) else json.dumps(kind.body).encode()


def send(base_url: str, kind: Kind, timeout_s: float) -> Answer:
    """POST one request. Headers and body go out separately and a failure to send the body is not the end: a server
    that refuses a body over its limit answers before reading it, and may close the connection while it still comes."""
    url = urlsplit(base_url)
    data = _body_bytes(kind)
    started = time.perf_counter()
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout_s)
    try:
        connection.putrequest("POST", kind.path)
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", str(len(data)))
        connection.endheaders()
        try:
            connection.send(data)
        except OSError:
            pass  # the answer may be there already (413); getresponse tells
        reply = connection.getresponse()
        answer = Answer(reply.status, 0.0)
        if reply.status == 200 and reply.getheader("Content-Type", "").startswith("text/event-stream"):
            lines = []
            for raw in reply:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:") :].strip()
                lines.append(payload)
                try:
                    event = payload if payload == "[DONE]" else json.loads(payload)
                except ValueError:
                    event = payload
                if answer.ttft_ms is None and isinstance(event, dict) and event.get("choices"):
                    answer.ttft_ms = (time.perf_counter() - started) * 1e3
                answer.events.append(event)
            answer.text = "\n".join(lines)
        else:
            answer.text = reply.read().decode(errors="replace")
    except (OSError, http.client.HTTPException) as error:
        answer = Answer(0, 0.0, error=f"no answer: {type(error).__name__}: {error}")
    finally:
        connection.close()
    answer.latency_ms = (time.perf_counter() - started) * 1e3
    return answer


def ping(base_url: str, timeout_s: float = 10) -> int:
    url = urlsplit(base_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout_s)
    try:
        connection.request("GET", "/ping")
        return connection.getresponse().status
    except (OSError, http.client.HTTPException):
        return 0
    finally:
        connection.close()


# ----- checking one answer -----


def _token_id(token: str) -> int:
    """vLLM's return_tokens_as_token_ids spelling, "token_id:<id>"."""
    return int(token.rsplit(":", 1)[1])


def _logprob_ids(choice: dict, chat: bool) -> tuple[list[int], list[list]]:
    """(ids, per position [[id, logprob], ...] best first) of a choice's (or a stream chunk's) logprobs."""
    logprobs = choice.get("logprobs") or {}
    if chat:
        entries = logprobs.get("content") or []
        ids = [_token_id(entry["token"]) for entry in entries]
        tops = [
            [[_token_id(top["token"]), top["logprob"]] for top in entry.get("top_logprobs") or []] for entry in entries
        ]
    else:
        ids = [_token_id(token) for token in logprobs.get("tokens") or []]
        tops = [
            [[_token_id(token), logprob] for token, logprob in (top or {}).items()]
            for top in logprobs.get("top_logprobs") or []
        ]
    return ids, [sorted(top, key=lambda pair: -pair[1]) for top in tops]


def _server_error(answer: Answer) -> str | None:
    """A 5xx, as a status or as a stream's error event."""
    if answer.status >= 500:
        return f"HTTP {answer.status}: {answer.text.strip()[:300]}"
    for event in answer.events:
        error = event.get("error") if isinstance(event, dict) else None
        if isinstance(error, dict) and isinstance(error.get("code"), int) and error["code"] >= 500:
            return f"a {error['code']} error event in the stream: {str(error.get('message'))[:300]}"
    return None


MALFORMED = (ValueError, KeyError, IndexError, TypeError, AttributeError)


def _parse_stream(kind: Kind, answer: Answer, parsed: dict) -> list[str]:
    problems = []
    if not answer.events or answer.events[-1] != "[DONE]":
        problems.append("the stream did not end with data: [DONE]")
    finishes = []
    for event in answer.events:
        if event == "[DONE]":
            continue
        if not isinstance(event, dict):
            problems.append(f"a stream event is not JSON: {str(event)[:120]!r}")
            continue
        if event.get("error"):
            problems.append(f"an error event in the stream: {str(event['error'])[:300]}")
        parsed["model"] = event.get("model") or parsed["model"]
        parsed["usage"] = event.get("usage") or parsed["usage"]
        for choice in event.get("choices") or []:
            if choice.get("index") != 0:
                problems.append(f"a chunk's choice has index {choice.get('index')!r}, not 0")
            part = (choice.get("delta") or {}).get("content") if kind.chat else choice.get("text")
            parsed["text"] += part if isinstance(part, str) else ""
            ids, tops = _logprob_ids(choice, kind.chat)
            parsed["ids"] += ids
            parsed["tops"] += tops
            if choice.get("finish_reason") is not None:
                finishes.append(choice["finish_reason"])
    if len(finishes) != 1:
        problems.append(f"the stream gave {len(finishes)} finish_reasons {finishes}, not one")
    parsed["finish_reason"] = finishes[-1] if finishes else None
    return problems


def _parse_json(kind: Kind, answer: Answer, parsed: dict) -> list[str]:
    problems = []
    body = json.loads(answer.text)
    choice = body["choices"][0]
    if choice.get("index") != 0:
        problems.append(f"choices[0].index is {choice.get('index')!r}, not 0")
    if kind.chat:
        message = choice["message"]
        if message.get("role") != "assistant":
            problems.append(f"choices[0].message.role is {message.get('role')!r}, not 'assistant'")
        text = message.get("content")
    else:
        text = choice["text"]
    if not isinstance(text, str):
        problems.append(f"the answer's text is {type(text).__name__}, not a string")
    parsed.update(text=text if isinstance(text, str) else "", finish_reason=choice.get("finish_reason"))
    parsed.update(usage=body.get("usage"), model=body.get("model"))
    parsed["ids"], parsed["tops"] = _logprob_ids(choice, kind.chat)
    return problems


def _parse_body(kind: Kind, answer: Answer) -> tuple[dict, list[str]]:
    """The fields the checks need from a 200 answer, and what is wrong with its shape."""
    parsed = {"text": "", "finish_reason": None, "ids": [], "tops": [], "usage": None, "model": None}
    try:
        return parsed, (_parse_stream if kind.stream else _parse_json)(kind, answer, parsed)
    except MALFORMED as error:
        return parsed, [f"not an OpenAI-style answer ({type(error).__name__}: {error}): {answer.text.strip()[:300]}"]


def check_answer(kind: Kind, answer: Answer, model: str) -> tuple[dict, list[str]]:
    """(what the answer says, its problems); no problems: the request was answered as it must be."""
    if answer.status == 0:
        return {}, [answer.error or "no answer"]
    server_error = _server_error(answer)
    if server_error:
        return {}, [server_error]
    if not kind.valid:
        if not 400 <= answer.status < 500:
            return {}, [f"an invalid request answered HTTP {answer.status}, not 4xx: {answer.text.strip()[:200]}"]
        if kind.expect_status and answer.status != kind.expect_status:
            return {}, [f"answered HTTP {answer.status}, not {kind.expect_status}: {answer.text.strip()[:200]}"]
        return {}, []
    if answer.status != 200:
        return {}, [f"HTTP {answer.status}: {answer.text.strip()[:300]}"]
    parsed, problems = _parse_body(kind, answer)
    if problems:
        return parsed, problems
    if parsed["finish_reason"] not in FINISH_REASONS:
        problems.append(f"finish_reason {parsed['finish_reason']!r}, not one of {list(FINISH_REASONS)}")
    if parsed["model"] != model:
        problems.append(f"answered as model {parsed['model']!r}, not {model!r}")
    tokens = (parsed["usage"] or {}).get("completion_tokens")
    if not isinstance(tokens, int):
        problems.append("no usage.completion_tokens")
    elif tokens > kind.max_tokens:
        problems.append(f"{tokens} completion tokens for max_tokens {kind.max_tokens}")
    if kind.greedy and not parsed["ids"]:
        problems.append("no token ids in the logprobs asked for")
    # a budgeted answer's logprobs cover the thought the budget cut, not the answer the middleware added to it
    elif kind.greedy and not kind.budgeted and isinstance(tokens, int) and len(parsed["ids"]) != tokens:
        problems.append(f"{len(parsed['ids'])} token ids in the logprobs for {tokens} completion tokens")
    # the thinking budget's promise: a thought cut short is closed, and an answer follows it
    if kind.budgeted and parsed["finish_reason"] == "length" and "</think>" not in parsed["text"]:
        problems.append(f"a thinking answer cut at max_tokens holds no closed thought: {parsed['text'][:200]!r}")
    return parsed, problems


# ----- the load -----


def run_load(base_url: str, planned: list[Kind], concurrency: int, timeout_s: float) -> tuple[list[Answer], dict]:
    """Send `planned` with `concurrency` requests in flight; the answers in plan order, and how many were in flight
    at most (seen by the client) and the seconds it all took."""
    lock, state = threading.Lock(), {"now": 0, "max": 0}

    def one(kind: Kind) -> Answer:
        with lock:
            state["now"] += 1
            state["max"] = max(state["max"], state["now"])
        try:
            return send(base_url, kind, timeout_s)
        finally:
            with lock:
                state["now"] -= 1

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(one, planned))
    return answers, {"max_in_flight": state["max"], "wall_s": round(time.perf_counter() - started, 3)}


def alone(base_url: str, kinds: list[Kind], model: str, timeout_s: float) -> dict[str, dict]:
    """Each greedy kind sent once, one at a time, before the load: what it must answer under load too."""
    references = {}
    for kind in kinds:
        if kind.valid and kind.greedy:
            answer = send(base_url, kind, timeout_s)
            parsed, problems = check_answer(kind, answer, model)
            references[kind.name] = {"answer": answer, "parsed": parsed, "problems": problems}
    return references


def compare_with_alone(parsed: dict, reference: dict) -> dict:
    """The ids under load against the lone run's (lib/lossless.compare_ids, a near tie ending the comparison)."""
    result = compare_ids(parsed["ids"], reference["parsed"]["ids"], reference["parsed"]["tops"])
    return {
        "same_ids": result["first_difference"] is None,
        "same_text": parsed["text"] == reference["parsed"]["text"],
        "near_tie": result["near_ties"][0] if result["near_ties"] else None,
        "divergence": result["divergence"],
    }


def _stats(rows: list[dict]) -> dict:
    latencies = [row["latency_ms"] for row in rows]
    ttfts = [row["ttft_ms"] for row in rows if row["ttft_ms"] is not None]
    return {
        "count": len(rows),
        "p50_ms": round(percentile(latencies, 0.5), 2) if latencies else None,
        "p99_ms": round(percentile(latencies, 0.99), 2) if latencies else None,
        "max_ms": round(max(latencies), 2) if latencies else None,
        "ttft_p50_ms": round(percentile(ttfts, 0.5), 2) if ttfts else None,
        "ttft_p99_ms": round(percentile(ttfts, 0.99), 2) if ttfts else None,
    }


def request_row(index: int, kind: Kind, answer: Answer, references: dict[str, dict], model: str) -> dict:
    """One request's row: its answer checked, and compared with the same request alone where both are sound."""
    parsed, problems = check_answer(kind, answer, model)
    row = {
        "index": index,
        "kind": kind.name,
        "endpoint": kind.endpoint,
        "valid": kind.valid,
        "status": answer.status,
        "latency_ms": round(answer.latency_ms, 2),
        "ttft_ms": round(answer.ttft_ms, 2) if answer.ttft_ms is not None else None,
        "finish_reason": parsed.get("finish_reason"),
        "same_ids_as_alone": None,
        "same_text_as_alone": None,
        "near_tie": None,
        "problems": problems,
    }
    reference = references.get(kind.name)
    if not problems and reference is not None and not reference["problems"]:
        compared = compare_with_alone(parsed, reference)
        row.update(
            same_ids_as_alone=compared["same_ids"],
            same_text_as_alone=compared["same_text"],
            near_tie=compared["near_tie"],
        )
        if compared["divergence"]:
            d = compared["divergence"]
            problems.append(
                f"differs from the same request alone at output token {d['position']} (id {d['speculative']}, "
                f"alone {d['reference']}), not at a near tie"
            )
    row["ok"] = not problems
    return row


def after_row(after: dict, references: dict[str, dict], model: str) -> dict:
    """The check once the load is over (`after`: {alive, ping_status, kind, answer}): the server still up, /ping
    200, and its answer the one it gave before the load."""
    row = {"alive": after["alive"], "ping_status": after["ping_status"], "kind": None, "status": None, "problems": []}
    if not after["alive"]:
        row["problems"].append("the server's container is no longer running")
    if after["ping_status"] != 200:
        row["problems"].append(f"/ping answered {after['ping_status'] or 'nothing'} after the load, not 200")
    if after.get("answer") is not None:
        kind = after["kind"]
        parsed, problems = check_answer(kind, after["answer"], model)
        reference = references.get(kind.name)
        if not problems and reference is not None and not reference["problems"]:
            divergence = compare_with_alone(parsed, reference)["divergence"]
            if divergence:
                problems.append(f"differs from its answer before the load at output token {divergence['position']}")
        row.update(kind=kind.name, status=after["answer"].status)
        row["problems"] += problems
    row["ok"] = not row["problems"]
    return row


def load_counts(rows: list[dict], answers: list[Answer]) -> dict:
    """The rows counted: requests, failures by class, server errors, unanswered, and the comparisons with alone."""
    valid_rows = [row for row in rows if row["valid"]]
    compared = [row for row in valid_rows if row["same_ids_as_alone"] is not None]
    return {
        "requests": len(rows),
        "valid": len(valid_rows),
        "invalid": len(rows) - len(valid_rows),
        "failed": sum(not row["ok"] for row in rows),
        "valid_failed": sum(not row["ok"] for row in valid_rows),
        "invalid_not_4xx": sum(not row["ok"] for row in rows if not row["valid"]),
        "server_errors": sum(bool(_server_error(answer)) for answer in answers),
        "no_answer": sum(answer.status == 0 for answer in answers),
        "compared_with_alone": len(compared),
        "near_ties": sum(row["near_tie"] is not None for row in compared),
        "text_differs_from_alone": sum(row["same_text_as_alone"] is False for row in compared),
    }


def verdict(planned: list[Kind], answers: list[Answer], references: dict[str, dict], after: dict, model: str) -> dict:
    """The record's verdict part: every request's row, the counts, latency per class, and the failures (each naming
    the request). `after`: {alive, ping_status, kind, answer} of the check once the load is over."""
    failures = [
        f"{name} (alone, before the load): " + "; ".join(reference["problems"])
        for name, reference in references.items()
        if reference["problems"]
    ]
    rows = [
        request_row(index, kind, answer, references, model)
        for index, (kind, answer) in enumerate(zip(planned, answers, strict=True))
    ]
    failures += [
        f"request {row['index']} ({kind.name}, {kind.path}): " + "; ".join(row["problems"])
        for kind, row in zip(planned, rows, strict=True)
        if row["problems"]
    ]
    last = after_row(after, references, model)
    if last["problems"]:
        failures.append("after the load: " + "; ".join(last["problems"]))
    statuses: dict[str, int] = {}
    for row in rows:
        statuses[str(row["status"])] = statuses.get(str(row["status"]), 0) + 1
    valid_rows = [row for row in rows if row["valid"]]
    latency = {"overall": _stats(valid_rows)}
    latency |= {endpoint: _stats([row for row in valid_rows if row["endpoint"] == endpoint]) for endpoint in ENDPOINTS}
    latency[INVALID] = _stats([row for row in rows if not row["valid"]])
    return {
        "passed": not failures,
        "failures": failures,
        "counts": load_counts(rows, answers),
        "statuses": dict(sorted(statuses.items())),
        "latency_ms": latency,
        "after": last,
        "requests": rows,
    }


def kinds_summary(kinds: list[Kind], planned: list[Kind]) -> list[dict]:
    """The mix as the record states it: each kind, where it goes and how often it was sent."""
    counts: dict[str, int] = {}
    for kind in planned:
        counts[kind.name] = counts.get(kind.name, 0) + 1
    return [
        {
            "name": kind.name,
            "path": kind.path,
            "endpoint": kind.endpoint,
            "valid": kind.valid,
            "stream": kind.stream,
            "thinking": kind.thinking,
            "budgeted": kind.budgeted,
            "greedy": kind.greedy,
            "expect_status": kind.expect_status,
            "body_bytes": len(_body_bytes(kind)),
            "sent": counts.get(kind.name, 0),
        }
        for kind in kinds
    ]


def failure_message(record: dict, limit: int = 20) -> str:
    failures = record["failures"]
    shown = "\n  - ".join(failures[:limit])
    more = f"\n  ... and {len(failures) - limit} more (the log has the record)" if len(failures) > limit else ""
    counts = record["counts"]
    return (
        f"the server failed under load ({counts['requests']} requests, {record['settings']['concurrency']} at a "
        f"time: {counts['valid_failed']} valid failed, {counts['invalid_not_4xx']} invalid not answered 4xx, "
        f"{counts['server_errors']} 5xx, {counts['no_answer']} unanswered):\n  - {shown}{more}"
    )
