"""rule submit against a local stand-in of the competition's submission API (contract.md, "Submission API"): single
and multipart uploads, a connection cut mid-part and the resume that sends no finished part again, expired URLs asked
for again, ETags checked at complete-upload, every refusal made before any request, and the key, URL and team id in
no log, state file or record."""

import hashlib
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

import submit
from conftest import ROOT, TINY, snakemake
from lib.stage import StageError
from lib.submit.submission import ENV, MAX_ARCHIVE_BYTES, state_path

KEY = "sk-test-" + "7f3a9c1e5b2d4a6f8e0c" * 2
TEAM = "AFM-1a2b3c4d"
VARIANT = "awq-mtp2"
KIB = 1024


class QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # a connection the stand-in drops on purpose


class StandIn:
    """The submission API (under /prod) and its object store (under /bucket) on 127.0.0.1, as the contract has it.

    single_max: the largest file_size_bytes upload-url answers `single` (the real API: 5 GB). part_size: the part size
    of a multipart answer. same_upload: upload-url answers the unfinished upload of the same team and size again with
    fresh URLs; the contract does not promise that, so by default every upload-url call starts a new upload.
    cut: {(part, attempt)} whose PUT is read halfway, then the connection is reset (once: a later upload's part
    goes through). expire: {part: n} the first n
    URLs issued for that part are already expired (403 "Request has expired"). no_etag: parts whose PUT answers 200
    without an ETag. echo_key: register and submit answers repeat the x-api-key header (a careless API).
    busy: {step or "put": [status, ...]} answered before that API call (or PUT) is served, one per request (a
    gateway's 502/503/504)."""

    def __init__(
        self,
        payload: bytes,
        single_max: int,
        part_size: int = 64 * KIB,
        same_upload: bool = False,
        cut=(),
        expire=None,
        no_etag=(),
        echo_key: bool = False,
        busy=None,
    ):
        self.payload, self.single_max, self.part_size, self.same_upload = payload, single_max, part_size, same_upload
        self.cut, self.expire, self.no_etag, self.echo_key = set(cut), dict(expire or {}), set(no_etag), echo_key
        self.busy = {step: list(statuses) for step, statuses in (busy or {}).items()}
        self.busy_answered: list[tuple[str, int]] = []  # (step or "put", status) of every transient answer
        self.requests = 0  # every request, authorised or not
        self.calls: list[tuple[str, dict]] = []  # (path, body) of every authorised API call
        self.api_keys: list[str | None] = []  # x-api-key of every API call
        self.put_keys: list[str | None] = []  # x-api-key of every PUT (must be none: the URL is signed)
        self.received: dict[tuple[str, int], list[int]] = {}  # (upload, part) -> bytes read, one entry per PUT
        self.refused: dict[tuple[str, int], int] = {}  # (upload, part) -> PUTs answered 403
        self.issued: dict[int, int] = {}  # part -> URLs issued
        self.tokens: dict[str, tuple[str, str, int, bool]] = {}  # token -> (s3_key, upload, part, expired)
        self.uploads: dict[str, dict] = {}  # upload id (single: the s3_key) -> its parts and state
        self.etags_returned: dict[tuple[str, int], str] = {}
        self.objects: dict[str, bytes] = {}  # s3_key -> the object complete-upload (or a single PUT) made
        self.submissions: list[dict] = []
        self.submit_status: int | None = None  # submit answers this error status when set
        self.lock = threading.Lock()
        self.server = QuietServer(("127.0.0.1", 0), self.handler())
        host, port = self.server.server_address
        self.url = f"http://{host}:{port}/prod"
        self.bucket = f"http://{host}:{port}/bucket"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def env(self, **overrides) -> dict[str, str]:
        env = {ENV["url"]: self.url, ENV["team"]: TEAM, ENV["key"]: KEY}
        env.update(overrides)
        return {k: v for k, v in env.items() if v is not None}

    def steps(self) -> list[str]:
        return [path for path, _ in self.calls]

    def url_for(self, s3_key: str, upload_id: str | None, part: int) -> str:
        self.issued[part] = self.issued.get(part, 0) + 1
        token = secrets.token_hex(8)
        self.tokens[token] = (s3_key, upload_id or s3_key, part, self.issued[part] <= self.expire.get(part, 0))
        query = {"partNumber": part, "uploadId": upload_id} if upload_id else {}
        return f"{self.bucket}/{s3_key}?" + urllib.parse.urlencode({**query, "X-Amz-Signature": token})

    def handler(self):
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def reply(self, status: int, body, headers: dict | None = None):
                data = (body if isinstance(body, str) else json.dumps(body)).encode()
                self.send_response(status)
                for name, value in {"Content-Length": str(len(data)), "Connection": "close", **(headers or {})}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)
                self.close_connection = True

            def do_POST(self):
                with api.lock:
                    api.requests += 1
                    api.api_keys.append(self.headers.get("x-api-key"))
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if self.headers.get("x-api-key") is None:
                    return self.reply(401, {"message": "Unauthorized"})
                if self.headers["x-api-key"] != KEY:
                    return self.reply(403, {"message": "Forbidden"})
                path = urllib.parse.urlsplit(self.path).path
                step = {"/prod/register": "register", "/prod/upload-url": "upload_url"}.get(path)
                step = step or {"/prod/complete-upload": "complete", "/prod/submit": "submit"}.get(path)
                if step is None:
                    return self.reply(404, {"message": f"no route {path}"})
                if body.get("team_id") != TEAM:
                    return self.reply(400, {"message": "unknown team_id"})
                with api.lock:
                    if api.busy.get(step):
                        status = api.busy[step].pop(0)
                        api.busy_answered.append((step, status))
                        return self.reply(status, {"message": "Service Unavailable"})
                    api.calls.append((path.removeprefix("/prod/"), body))
                    return getattr(self, step)(body)

            def register(self, body):
                answer = {"team_id": TEAM, "status": "registered"}
                self.reply(200, {**answer, **({"api_key": self.headers["x-api-key"]} if api.echo_key else {})})

            def upload_url(self, body):
                size = body["file_size_bytes"]
                if size != len(api.payload):
                    return self.reply(400, {"message": f"file_size_bytes {size} is not the archive's"})
                if size <= api.single_max:
                    s3_key = f"submissions/{TEAM}/{len(api.uploads) + 1}/image.tar.gz"
                    api.uploads[s3_key] = {"s3_key": s3_key, "single": True, "parts": {}, "completed": False}
                    return self.reply(
                        200, {"upload_type": "single", "s3_key": s3_key, "upload_url": api.url_for(s3_key, None, 1)}
                    )
                count = -(-size // api.part_size)
                reused = [
                    (upload_id, upload)
                    for upload_id, upload in api.uploads.items()
                    if api.same_upload and not upload["single"] and not upload["completed"]
                ]
                if reused:
                    upload_id, upload = reused[-1]
                else:
                    upload_id = f"up-{len(api.uploads) + 1}"
                    s3_key = f"submissions/{TEAM}/{len(api.uploads) + 1}/image.tar.gz"
                    upload = {"s3_key": s3_key, "single": False, "parts": {}, "completed": False}
                    api.uploads[upload_id] = upload
                part_urls = [
                    {"part_number": n, "upload_url": api.url_for(upload["s3_key"], upload_id, n)}
                    for n in range(1, count + 1)
                ]
                self.reply(
                    200,
                    {
                        "upload_type": "multipart",
                        "s3_key": upload["s3_key"],
                        "upload_id": upload_id,
                        "num_parts": count,
                        "part_size": api.part_size,
                        "part_urls": part_urls,
                    },
                )

            def complete(self, body):
                upload = api.uploads.get(body.get("upload_id"))
                if upload is None or upload["s3_key"] != body.get("s3_key") or upload["single"]:
                    return self.reply(404, {"message": "NoSuchUpload"})
                numbers = [p.get("part_number") for p in body["parts"]]
                if numbers != list(range(1, len(numbers) + 1)) or set(numbers) != set(upload["parts"]):
                    return self.reply(400, {"message": f"InvalidPartOrder: parts {numbers}"})
                for entry in body["parts"]:
                    if str(entry.get("etag", "")).strip('"') != upload["parts"][entry["part_number"]][0]:
                        return self.reply(400, {"message": f"InvalidPart: part {entry['part_number']}'s ETag"})
                upload["completed"] = True
                api.objects[upload["s3_key"]] = b"".join(upload["parts"][n][1] for n in numbers)
                self.reply(200, {"s3_key": upload["s3_key"], "status": "completed"})

            def submit(self, body):
                if api.submit_status:
                    return self.reply(api.submit_status, {"message": "try later"})
                if body.get("s3_key") not in api.objects:
                    return self.reply(404, {"message": "no such object"})
                submission = {"submission_id": f"sub-{len(api.submissions) + 1}", "status": "queued"}
                api.submissions.append({**submission, "s3_key": body["s3_key"]})
                self.reply(200, {**submission, **({"api_key": self.headers["x-api-key"]} if api.echo_key else {})})

            def do_PUT(self):
                parts = urllib.parse.urlsplit(self.path)
                query = urllib.parse.parse_qs(parts.query)
                token = query.get("X-Amz-Signature", [""])[0]
                length = int(self.headers["Content-Length"])
                with api.lock:
                    api.requests += 1
                    api.put_keys.append(self.headers.get("x-api-key"))
                    s3_key, upload_id, part, expired = api.tokens.get(token, (None, None, None, True))
                    if s3_key is None or parts.path != f"/bucket/{s3_key}":
                        self.rfile.read(length)
                        return self.reply(403, "<Error><Code>SignatureDoesNotMatch</Code></Error>")
                    received = api.received.setdefault((upload_id, part), [])
                    attempt = len(received) + api.refused.get((upload_id, part), 0) + 1
                with api.lock:
                    status = api.busy["put"].pop(0) if api.busy.get("put") else None
                    if status:
                        api.busy_answered.append(("put", status))
                if status:
                    self.rfile.read(length)
                    return self.reply(status, "<Error><Code>SlowDown</Code></Error>")
                if expired:
                    self.rfile.read(length)
                    with api.lock:
                        api.refused[(upload_id, part)] = api.refused.get((upload_id, part), 0) + 1
                    return self.reply(
                        403, "<Error><Code>AccessDenied</Code><Message>Request has expired</Message></Error>"
                    )
                if (part, attempt) in api.cut:  # take half of it, then reset the connection (once)
                    api.cut.discard((part, attempt))
                    received.append(len(self.rfile.read(length // 2)))
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    self.connection.close()
                    self.close_connection = True
                    return
                data = self.rfile.read(length)
                received.append(len(data))
                etag = secrets.token_hex(16)  # opaque, as with SSE-KMS: never the client's to compute
                with api.lock:
                    upload = api.uploads[upload_id]
                    upload["parts"][part] = (etag, data)
                    api.etags_returned[(upload_id, part)] = etag
                    if upload["single"]:
                        upload["completed"] = True
                        api.objects[s3_key] = data
                self.reply(200, "", {} if part in api.no_etag else {"ETag": f'"{etag}"'})

        return Handler


def archive(tmp_path: Path, size: int, name: str = "image.tar.gz", **records) -> tuple[Path, bytes]:
    """A fake archive, its .sha256 and its variant's passing verify, quality and lossless records (`records`
    updates them: {"verify": {...}, ...})."""
    payload = hashlib.shake_256(b"image").digest(size)  # seeded bytes, no repeats at any part boundary
    tarball = tmp_path / name
    tarball.write_bytes(payload)
    digest = hashlib.sha256(payload).hexdigest()
    (tmp_path / f"{name}.sha256").write_text(f"{digest}  {name}\n")
    ok = {"status": 200, "seconds": 0.1, "ok": True}
    endpoints = ("ping", "invocations_prompt", "invocations_messages", "completions", "chat_completions", "metrics")
    passing = {
        "verify": {
            "archive": name,
            "archive_sha256": digest,
            "archive_bytes": size,
            "smoke": {"ran": True, "endpoints": {e: dict(ok) for e in endpoints}},
        },
        "quality": {"limit": None, "limited": False, "passed": True},
        "lossless": {"variant": VARIANT, "passed": True, "failures": []},
    }
    for kind, changes in records.items():
        passing[kind].update(changes)
    for kind, path in record_paths(tmp_path).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(passing[kind]))
    return tarball, payload


def record_paths(tmp_path: Path) -> dict[str, Path]:
    results = tmp_path / "results" / VARIANT
    return {
        "verify": results / "verify_image" / "verify.json",
        "quality": results / "quality_gate" / "quality.json",
        "lossless": results / "lossless" / "lossless.json",
    }


def job(tmp_path: Path, retries: int = 0, name: str = "image.tar.gz") -> NS:
    paths = record_paths(tmp_path)
    return NS(
        rule="submit",
        input=NS(
            tarball=str(tmp_path / name),
            sha256=str(tmp_path / f"{name}.sha256"),
            verify=str(paths["verify"]),
            quality=str(paths["quality"]),
            lossless=str(paths["lossless"]),
            schema=str(ROOT / "schemas" / "submission.schema.yaml"),
        ),
        output=NS(record=str(tmp_path / "results" / "submission.json")),
        params=NS(retries=retries, retry_wait_s=0, timeout_s=30),
        log=[],
        threads=1,
        wildcards=NS(),
    )


def run_in_process(api: StandIn, the_job: NS, monkeypatch, **env):
    for name in ENV.values():
        monkeypatch.delenv(name, raising=False)
    for name, value in api.env(**env).items():
        monkeypatch.setenv(name, value)
    submit.main(the_job)


def run_as_program(api: StandIn, the_job: NS, tmp_path: Path, **env) -> subprocess.CompletedProcess:
    """The script as the rule runs it in a venv (`--job`), its output appended to the rule's log."""
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps({k: vars(v) if isinstance(v, NS) else v for k, v in vars(the_job).items()}))
    clean = {k: v for k, v in os.environ.items() if k not in ENV.values()}
    with open(tmp_path / "submit.log", "a") as log:
        result = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "submit.py"), "--job", str(job_file)],
            env={**clean, **api.env(**env), "PYTHONPATH": str(ROOT / "scripts")},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=120,
        )
        log.write(result.stdout)
    return result


def record_of(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "results" / "submission.json").read_text())


def test_single_upload_end_to_end(tmp_path, monkeypatch, capsys):
    tarball, payload = archive(tmp_path, 100 * KIB)
    with StandIn(payload, single_max=128 * KIB) as api:
        run_in_process(api, job(tmp_path), monkeypatch)
    assert api.steps() == ["register", "upload-url", "submit"]
    assert api.calls[0][1] == {"team_id": TEAM}
    assert api.calls[1][1] == {"team_id": TEAM, "file_size_bytes": len(payload)}
    s3_key = f"submissions/{TEAM}/1/image.tar.gz"
    assert api.calls[2][1] == {"team_id": TEAM, "s3_key": s3_key}
    assert api.objects == {s3_key: payload} and api.received == {(s3_key, 1): [len(payload)]}
    assert api.api_keys == [KEY] * 3 and api.put_keys == [None]  # the key goes to the API only, never to a URL
    record = record_of(tmp_path)
    assert record["upload_type"] == "single" and record["parts"] == 1 and record["upload_id"] is None
    assert record["submission_id"] == "sub-1" and record["variant"] == VARIANT
    assert record["s3_key"] == "submissions/$QWEN_SUBMIT_TEAM/1/image.tar.gz"
    assert record["sha256"] == hashlib.sha256(payload).hexdigest() and record["size"] == len(payload)
    assert not state_path(tarball).exists()
    assert "submission sub-1 of variant awq-mtp2 recorded" in capsys.readouterr().out


def test_multipart_upload_end_to_end(tmp_path, monkeypatch):
    tarball, payload = archive(tmp_path, 4 * 64 * KIB + 5)  # 5 parts of 64 KiB, the last one 5 bytes
    with StandIn(payload, single_max=128 * KIB) as api:
        run_in_process(api, job(tmp_path), monkeypatch)
    assert api.steps() == ["register", "upload-url", "complete-upload", "submit"]
    complete = api.calls[2][1]
    assert complete["upload_id"] == "up-1" and complete["s3_key"] == f"submissions/{TEAM}/1/image.tar.gz"
    assert complete["parts"] == [
        {"part_number": n, "etag": f'"{api.etags_returned[("up-1", n)]}"'} for n in range(1, 6)
    ]  # each part's ETag as the store answered it
    assert api.received == {("up-1", n): [64 * KIB if n < 5 else 5] for n in range(1, 6)}
    assert api.objects[complete["s3_key"]] == payload
    record = record_of(tmp_path)
    assert (record["upload_type"], record["upload_id"], record["parts"], record["part_size"]) == (
        "multipart",
        "up-1",
        5,
        64 * KIB,
    )
    assert not state_path(tarball).exists()


def test_a_cut_mid_part_resumes_without_resending_finished_parts(tmp_path, monkeypatch, capsys):
    tarball, payload = archive(tmp_path, 5 * 64 * KIB)
    the_job = job(tmp_path, retries=0)
    with StandIn(payload, single_max=128 * KIB, cut={(3, 1)}) as api:
        with pytest.raises(
            StageError,
            match=r"PUT part 3/5 \(65536 bytes\) to http://127.0.0.1:\d+/bucket/submissions/\$QWEN_SUBMIT_TEAM/1/"
            r"image.tar.gz: connection failed .* after 1 attempt\(s\); .*image.tar.gz.upload.json keeps the 2 "
            r"finished part\(s\) of 5: rerun to resume without sending them again",
        ):
            run_in_process(api, the_job, monkeypatch)
        state = json.loads(state_path(tarball).read_text())  # only what the store took, tied to this archive
        assert sorted(state["etags"]) == ["1", "2"] and state["upload_id"] == "up-1" and not state["uploaded"]
        assert state["archive"] == {
            "name": "image.tar.gz",
            "size": len(payload),
            "sha256": hashlib.sha256(payload).hexdigest(),
        }
        assert not (tmp_path / "results" / "submission.json").exists()
        capsys.readouterr()

        run_in_process(api, the_job, monkeypatch)
    assert "resuming the multipart upload" in capsys.readouterr().out
    # finished parts went up once; the cut part twice (half, then whole); the kept URLs were used: one upload-url
    assert api.received == {
        ("up-1", 1): [64 * KIB],
        ("up-1", 2): [64 * KIB],
        ("up-1", 3): [32 * KIB, 64 * KIB],
        ("up-1", 4): [64 * KIB],
        ("up-1", 5): [64 * KIB],
    }
    assert api.steps() == ["register", "upload-url", "complete-upload", "submit"]
    assert api.objects[f"submissions/{TEAM}/1/image.tar.gz"] == payload
    assert record_of(tmp_path)["upload_id"] == "up-1" and not state_path(tarball).exists()


def test_a_dropped_part_is_retried_within_the_run(tmp_path, monkeypatch, capsys):
    tarball, payload = archive(tmp_path, 3 * 64 * KIB)
    with StandIn(payload, single_max=128 * KIB, cut={(2, 1), (2, 2)}) as api:
        run_in_process(api, job(tmp_path, retries=2), monkeypatch)
    assert api.received[("up-1", 2)] == [32 * KIB, 32 * KIB, 64 * KIB]
    assert api.received[("up-1", 1)] == api.received[("up-1", 3)] == [64 * KIB]
    assert "retry 2 of 2" in capsys.readouterr().out


def test_an_expired_url_is_requested_again_and_a_new_upload_gets_every_part(tmp_path, monkeypatch, capsys):
    """The contract's reading by default: a second upload-url call is a new upload, so parts sent to the first
    cannot be completed in it."""
    tarball, payload = archive(tmp_path, 4 * 64 * KIB)
    with StandIn(payload, single_max=128 * KIB, expire={3: 1}) as api:
        run_in_process(api, job(tmp_path), monkeypatch)
    assert api.steps() == ["register", "upload-url", "upload-url", "complete-upload", "submit"]
    assert api.refused == {("up-1", 3): 1}
    assert {part: sizes for (upload, part), sizes in api.received.items() if upload == "up-2"} == {
        n: [64 * KIB] for n in range(1, 5)
    }
    out = capsys.readouterr().out
    assert "refused (403), the URL has expired: asking QWEN_SUBMIT_URL/upload-url for upload URLs" in out
    assert "the 2 part(s) sent to upload up-1 cannot be completed in it, so every part is sent again" in out
    assert api.calls[3][1]["upload_id"] == "up-2" and record_of(tmp_path)["upload_id"] == "up-2"


def test_an_expired_url_of_the_same_upload_keeps_the_finished_parts(tmp_path, monkeypatch, capsys):
    tarball, payload = archive(tmp_path, 4 * 64 * KIB)
    with StandIn(payload, single_max=128 * KIB, same_upload=True, expire={3: 1}) as api:
        run_in_process(api, job(tmp_path), monkeypatch)
    assert api.steps() == ["register", "upload-url", "upload-url", "complete-upload", "submit"]
    assert api.received == {("up-1", n): [64 * KIB] for n in range(1, 5)} and api.refused == {("up-1", 3): 1}
    assert "the same upload answered with fresh URLs: the 2 finished part(s) kept" in capsys.readouterr().out


def test_kept_urls_past_their_life_are_not_tried(tmp_path, monkeypatch):
    tarball, payload = archive(tmp_path, 4 * 64 * KIB)
    with StandIn(payload, single_max=128 * KIB, same_upload=True, cut={(2, 1)}) as api:
        with pytest.raises(StageError, match="rerun to resume"):
            run_in_process(api, job(tmp_path), monkeypatch)
        state = json.loads(state_path(tarball).read_text())
        state["urls_issued_at"] -= 2 * 3600  # the run resumes two hours later
        state_path(tarball).write_text(json.dumps(state))
        puts_before = sum(len(sizes) for sizes in api.received.values())
        run_in_process(api, job(tmp_path), monkeypatch)
    assert api.steps().count("upload-url") == 2 and not api.refused  # asked again instead of spending a PUT
    assert api.received[("up-1", 1)] == [64 * KIB] and api.received[("up-1", 2)] == [32 * KIB, 64 * KIB]
    assert sum(len(sizes) for sizes in api.received.values()) == puts_before + 3


def test_a_url_that_stays_refused_stops_with_the_state_kept(tmp_path, monkeypatch):
    tarball, payload = archive(tmp_path, 4 * 64 * KIB)
    with StandIn(payload, single_max=128 * KIB, same_upload=True, expire={2: 99}) as api:
        with pytest.raises(
            StageError,
            match=r"PUT part 2/4 .*refused \(403\) again after 1 fresh URL\(s\).*Request has expired.*keeps the 1 "
            r"finished part\(s\) of 4: rerun to resume",
        ):
            run_in_process(api, job(tmp_path), monkeypatch)
        assert sorted(json.loads(state_path(tarball).read_text())["etags"]) == ["1"]
        api.expire = {}  # the store is fixed: the rerun resumes
        run_in_process(api, job(tmp_path), monkeypatch)
    assert api.received[("up-1", 1)] == [64 * KIB] and api.objects[f"submissions/{TEAM}/1/image.tar.gz"] == payload


def test_a_wrong_etag_is_refused_at_complete_and_the_next_run_starts_over(tmp_path, monkeypatch):
    tarball, payload = archive(tmp_path, 4 * 64 * KIB)
    with StandIn(payload, single_max=128 * KIB, cut={(4, 1)}) as api:
        with pytest.raises(StageError, match="rerun to resume"):
            run_in_process(api, job(tmp_path), monkeypatch)
        state = json.loads(state_path(tarball).read_text())
        state["etags"]["2"] = '"0123456789abcdef0123456789abcdef"'
        state_path(tarball).write_text(json.dumps(state))
        with pytest.raises(
            StageError,
            match=r"complete-upload answered 400: .*InvalidPart: part 2's ETag.*upload.json is removed: the next run "
            "starts a new upload",
        ):
            run_in_process(api, job(tmp_path), monkeypatch)
        assert not state_path(tarball).exists() and not api.objects
        run_in_process(api, job(tmp_path), monkeypatch)
    assert record_of(tmp_path)["upload_id"] == "up-2" and api.objects[f"submissions/{TEAM}/2/image.tar.gz"] == payload


def test_a_part_answered_without_an_etag_stops(tmp_path, monkeypatch):
    tarball, payload = archive(tmp_path, 4 * 64 * KIB)
    with StandIn(payload, single_max=128 * KIB, no_etag={2}) as api:
        with pytest.raises(StageError, match=r"PUT part 2/4 .*answered 200 without an ETag header"):
            run_in_process(api, job(tmp_path), monkeypatch)
    assert "complete-upload" not in api.steps() and sorted(json.loads(state_path(tarball).read_text())["etags"]) == [
        "1"
    ]


def test_a_failed_submit_is_submitted_on_rerun_without_uploading_again(tmp_path, monkeypatch):
    tarball, payload = archive(tmp_path, 3 * 64 * KIB)
    with StandIn(payload, single_max=128 * KIB) as api:
        api.submit_status = 503
        with pytest.raises(
            StageError,
            match=r"submit answered 503.*the upload is complete .*rerun to submit it without uploading again",
        ):
            run_in_process(api, job(tmp_path, retries=3), monkeypatch)
        assert api.steps().count("submit") == 1  # never retried: a submit that arrived would count twice
        api.submit_status = None
        run_in_process(api, job(tmp_path), monkeypatch)
    assert api.steps() == ["register", "upload-url", "complete-upload", "submit", "submit"]
    assert [len(sizes) for sizes in api.received.values()] == [1, 1, 1] and len(api.submissions) == 1


def test_502_503_504_are_retried_with_backoff_on_every_request_but_submit(tmp_path, monkeypatch, capsys):
    tarball, payload = archive(tmp_path, 3 * 64 * KIB)
    waits = []
    monkeypatch.setattr("lib.submit.submission.time.sleep", waits.append)
    busy = {"register": [502], "upload_url": [503, 504], "put": [503], "complete": [503, 502]}
    with StandIn(payload, single_max=128 * KIB, busy=busy) as api:
        the_job = job(tmp_path, retries=2)
        the_job.params.retry_wait_s = 5
        run_in_process(api, the_job, monkeypatch)
    assert api.busy_answered == [(s, status) for s, statuses in busy.items() for status in statuses]
    assert api.steps() == ["register", "upload-url", "complete-upload", "submit"]
    assert api.received == {("up-1", n): [64 * KIB] for n in (1, 2, 3)} and api.objects
    assert waits == [5, 5, 10, 5, 5, 10]  # each request's retries wait twice as long as the one before
    assert "upload-url: answered 504; retry 2 of 2" in capsys.readouterr().out


def test_a_request_still_busy_after_its_retries_stops_naming_the_status(tmp_path, monkeypatch):
    tarball, payload = archive(tmp_path, 3 * 64 * KIB)
    monkeypatch.setattr("lib.submit.submission.time.sleep", lambda s: None)
    with StandIn(payload, single_max=128 * KIB, busy={"upload_url": [503] * 3}) as api:
        with pytest.raises(StageError, match=r"POST \$QWEN_SUBMIT_URL/upload-url: answered 503 after 3 attempt\(s\)"):
            run_in_process(api, job(tmp_path, retries=2), monkeypatch)
    assert api.busy_answered == [("upload_url", 503)] * 3 and not api.received


@pytest.mark.parametrize("status", [502, 503, 504])
def test_submit_answering_a_gateway_error_is_never_retried(tmp_path, monkeypatch, status):
    tarball, payload = archive(tmp_path, 100 * KIB)
    monkeypatch.setattr("lib.submit.submission.time.sleep", lambda s: None)
    with StandIn(payload, single_max=128 * KIB, busy={"submit": [status]}) as api:
        with pytest.raises(StageError, match=rf"/submit answered {status}: .*rerun to submit it without uploading"):
            run_in_process(api, job(tmp_path, retries=3), monkeypatch)
    assert api.busy_answered == [("submit", status)] and not api.submissions


def test_the_state_file_is_readable_by_its_owner_only(tmp_path, monkeypatch):
    """It holds presigned PUT URLs, each a credential for two hours."""
    tarball, payload = archive(tmp_path, 3 * 64 * KIB)
    with StandIn(payload, single_max=128 * KIB, cut={(2, 1)}) as api:
        with pytest.raises(StageError, match="rerun to resume"):
            run_in_process(api, job(tmp_path), monkeypatch)
        assert state_path(tarball).stat().st_mode & 0o777 == 0o600
        state_path(tarball).chmod(0o644)  # as an earlier version of the client left it
        api.cut = {(3, 1)}
        with pytest.raises(StageError, match="rerun to resume"):
            run_in_process(api, job(tmp_path), monkeypatch)
    assert state_path(tarball).stat().st_mode & 0o777 == 0o600
    assert sorted(json.loads(state_path(tarball).read_text())["etags"]) == ["1", "2"]


def test_a_crash_after_submit_never_submits_twice(tmp_path, monkeypatch):
    tarball, payload = archive(tmp_path, 3 * 64 * KIB)
    real_write = submit.write_json

    def crash(path, data):
        raise OSError("disk full")

    with StandIn(payload, single_max=128 * KIB) as api:
        monkeypatch.setattr(submit, "write_json", crash)
        with pytest.raises(OSError, match="disk full"):
            run_in_process(api, job(tmp_path), monkeypatch)
        monkeypatch.setattr(submit, "write_json", real_write)
        run_in_process(api, job(tmp_path), monkeypatch)
    assert len(api.submissions) == 1 and api.steps().count("submit") == 1
    assert record_of(tmp_path)["submission_id"] == "sub-1" and not state_path(tarball).exists()


def test_a_state_file_of_another_archive_is_ignored(tmp_path, monkeypatch, capsys):
    tarball, payload = archive(tmp_path, 3 * 64 * KIB)
    with StandIn(payload, single_max=128 * KIB, cut={(3, 1)}) as api:
        with pytest.raises(StageError, match="rerun to resume"):
            run_in_process(api, job(tmp_path), monkeypatch)
        state = json.loads(state_path(tarball).read_text())
        state["archive"]["sha256"] = "0" * 64  # an earlier archive of the same size
        state_path(tarball).write_text(json.dumps(state))
        run_in_process(api, job(tmp_path), monkeypatch)
    assert "describes another archive; starting a new upload" in capsys.readouterr().out
    assert record_of(tmp_path)["upload_id"] == "up-2"
    assert [api.received[("up-2", n)] for n in (1, 2, 3)] == [[64 * KIB]] * 3


def test_a_wrong_key_names_the_variable(tmp_path, monkeypatch):
    tarball, payload = archive(tmp_path, 3 * 64 * KIB)
    with StandIn(payload, single_max=128 * KIB) as api:
        with pytest.raises(
            StageError,
            match=r"POST \$QWEN_SUBMIT_URL/register answered 403: .*is QWEN_SUBMIT_KEY the team's current key",
        ):
            run_in_process(api, job(tmp_path), monkeypatch, **{ENV["key"]: "sk-wrong"})
    assert (
        not api.calls and not state_path(tarball).exists() and not (tmp_path / "results" / "submission.json").exists()
    )


def test_missing_variables_are_named_before_any_work(tmp_path):
    tarball, payload = archive(tmp_path, 3 * 64 * KIB)
    with StandIn(payload, single_max=128 * KIB) as api:
        result = run_as_program(api, job(tmp_path), tmp_path, **{ENV["team"]: None, ENV["key"]: None})
    assert result.returncode != 0
    assert "ERROR [submit]: environment variables QWEN_SUBMIT_TEAM, QWEN_SUBMIT_KEY not set" in result.stdout
    assert "sha256" not in result.stdout  # failed before reading the archive
    assert api.requests == 0 and not state_path(tarball).exists()


def test_a_team_id_not_of_the_contract_form_is_refused(tmp_path, monkeypatch):
    tarball, payload = archive(tmp_path, 3 * 64 * KIB)
    with StandIn(payload, single_max=128 * KIB) as api:
        with pytest.raises(StageError, match="QWEN_SUBMIT_TEAM is not a team id of the form AFM-xxxxxxxx"):
            run_in_process(api, job(tmp_path), monkeypatch, **{ENV["team"]: KEY})
    assert api.requests == 0


@pytest.mark.parametrize(
    "records, reason",
    [
        (
            {"verify": {"smoke": {"ran": False, "reason": "no Docker daemon"}}},
            r"verify.json: the image was never run \(smoke test skipped: no Docker daemon\)",
        ),
        (
            {"verify": {"smoke": {"ran": True, "endpoints": {"ping": {"ok": True}, "metrics": {"ok": False}}}}},
            r"verify.json: the smoke test failed on metrics",
        ),
        ({"verify": {"archive_bytes": 7}}, r"verify.json verified an archive of 7 bytes, not this one's"),
        ({"verify": {"archive_sha256": "0" * 64}}, r"verify.json verified an archive of sha256 0{64}, not this one"),
        (
            {"quality": {"limited": True, "limit": 0.1}},
            r"quality.json: the quality gate ran on a sample \(limited: True, limit 0.1\)",
        ),
        ({"quality": {"passed": False}}, r"quality.json: the quality gate did not pass"),
        (
            {"lossless": {"passed": False, "failures": ["short: token 3 differs"]}},
            r"lossless.json: the lossless check failed .*short: token 3 differs",
        ),
        ({"lossless": {"variant": "bf16"}}, r"are not all records of variant awq-mtp2"),
    ],
)
def test_an_image_that_did_not_pass_is_refused_before_any_request(tmp_path, monkeypatch, records, reason):
    tarball, payload = archive(tmp_path, 3 * 64 * KIB, **records)
    with StandIn(payload, single_max=128 * KIB) as api:
        with pytest.raises(StageError, match=r"image.tar.gz is not submitted \(nothing was sent\):\n(.|\n)*" + reason):
            run_in_process(api, job(tmp_path), monkeypatch)
    assert api.requests == 0 and not state_path(tarball).exists()


def test_an_archive_over_20_gb_is_refused_unread(tmp_path, monkeypatch):
    tarball, payload = archive(tmp_path, 3 * 64 * KIB)
    os.truncate(tarball, MAX_ARCHIVE_BYTES + 1)  # sparse: 20 GB in name only
    started = time.monotonic()
    with StandIn(payload, single_max=128 * KIB) as api:
        with pytest.raises(StageError, match=r"it is 20000000001 bytes, over the API's limit of 20 GB"):
            run_in_process(api, job(tmp_path), monkeypatch)
    assert api.requests == 0 and time.monotonic() - started < 10  # refused without hashing 20 GB


def test_a_tarball_not_named_image_tar_gz_is_refused(tmp_path, monkeypatch):
    tarball, payload = archive(tmp_path, 3 * 64 * KIB, name="image-awq.tar.gz")
    with StandIn(payload, single_max=128 * KIB) as api:
        with pytest.raises(StageError, match=r"the file is named 'image-awq.tar.gz': the API takes only a file named"):
            run_in_process(api, job(tmp_path, name="image-awq.tar.gz"), monkeypatch)
    assert api.requests == 0


def test_a_changed_archive_is_not_sent(tmp_path, monkeypatch):
    tarball, payload = archive(tmp_path, 3 * 64 * KIB)
    tarball.write_bytes(payload[:-1] + b"x")
    with StandIn(payload, single_max=128 * KIB) as api:
        with pytest.raises(StageError, match=r"it has sha256 .* not the .* of .*image.tar.gz.sha256"):
            run_in_process(api, job(tmp_path), monkeypatch)
    assert api.requests == 0


def test_the_key_team_and_url_are_in_no_log_state_record_or_output(tmp_path):
    tarball, payload = archive(tmp_path, 4 * 64 * KIB + 7)
    with StandIn(payload, single_max=128 * KIB, cut={(3, 1)}, expire={2: 1}, same_upload=True, echo_key=True) as api:
        interrupted = run_as_program(api, job(tmp_path), tmp_path)
        assert interrupted.returncode != 0 and "rerun to resume" in interrupted.stdout
        state_after_cut = state_path(tarball).read_text()
        assert json.loads(state_after_cut)["etags"].keys() == {"1", "2"}
        finished = run_as_program(api, job(tmp_path), tmp_path)
    assert finished.returncode == 0, finished.stdout
    assert api.objects and all(TEAM in key for key in api.objects)  # the s3_key and the part URLs hold the team id
    record_text = (tmp_path / "results" / "submission.json").read_text()
    assert json.loads(record_text)["response"]["api_key"] == "***"
    log = (tmp_path / "submit.log").read_text()
    assert "submission sub-1 of variant awq-mtp2 recorded" in log
    for name, text in {
        "log": log,
        "stdout": interrupted.stdout + finished.stdout,
        "state file": state_after_cut,
        "record": record_text,
        "archive": tarball.read_bytes().decode("latin-1"),
    }.items():
        assert KEY not in text and KEY[8:24] not in text, name
        assert api.url not in text and TEAM not in text, name


def test_submit_is_optional_and_gated_on_the_selected_variants_records():
    """`snakemake submit` plans submit; the default target never includes it; its rule reads the selected variant's
    verify, quality and lossless records and passes no URL, team or key as params (Snakemake records params)."""
    default = snakemake("-n", *TINY).stdout
    assert not re.search(r"^submit\s+\d+$", default, re.M)
    planned = snakemake("-n", "submit", *TINY).stdout
    assert re.search(r"^submit\s+1$", planned, re.M)
    rule = (ROOT / "rules" / "submit.smk").read_text()
    for record in ("verify_image/verify.json", "quality_gate/quality.json", "lossless/lossless.json"):
        assert f'selected("{record}")' in rule
    assert "QWEN_SUBMIT_KEY" in rule and "os.environ" not in rule and "getenv" not in rule
