"""rule submit against a local stand-in of the submission API (lib/submission.py's ENDPOINTS): single and multipart
uploads, connections cut mid-part and resumed without re-sending finished parts, expired presigned URLs, a missing
key, and the key in no log, state file, record or output."""

import hashlib
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

import submit
from conftest import ROOT, TINY, snakemake
from lib.stage import StageError
from lib.submission import ENDPOINTS, ENV, state_path

KEY = "sk-test-" + "7f3a9c1e5b2d4a6f8e0c" * 2
TEAM = "team-42"
MIB = 1024 * 1024


class QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # a connection the stand-in drops on purpose


class StandIn:
    """The submission API and its object store on 127.0.0.1, with faults on request.

    single_max: largest upload answered `single`. part_size: the multipart part size it answers (None = the
    client's proposal). cut: {(part, attempt)} whose PUT is read halfway and then the connection dropped.
    expire: {part: n} the first n URLs issued for the part are already expired. echo_key: the submit answer
    repeats the Authorization header (a careless API), which must reach no record."""

    def __init__(
        self, payload: bytes, single_max: int, part_size: int | None = None, cut=(), expire=None, echo_key: bool = False
    ):
        self.payload, self.single_max, self.part_size = payload, single_max, part_size
        self.cut, self.expire, self.echo_key = set(cut), dict(expire or {}), echo_key
        self.api_calls: list[tuple[str, str]] = []  # (step, path) of every authorised API call
        self.requests = 0  # every request, authorised or not
        self.puts: dict[int, int] = {}  # part -> PUT attempts
        self.url_requests: list[list[int]] = []  # the parts of each URL request
        self.tokens: dict[str, tuple[str, int, bool]] = {}  # token -> (upload id, part, expired)
        self.issued: dict[int, int] = {}
        self.uploads: dict[str, dict] = {}
        self.completions: list[dict] = []
        self.submissions: dict[str, str] = {}
        self.forgotten: set[str] = set()  # upload ids the API no longer knows
        self.submit_status: int | None = None  # submit answers this error status when set
        self.storage_auth_headers: list[str] = []  # Authorization headers sent to presigned URLs
        self.lock = threading.Lock()
        self.server = QuietServer(("127.0.0.1", 0), self.handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/api"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

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

    def handler(self):
        stand_in = self

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

            def body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length", 0)))

            def do_POST(self):
                with stand_in.lock:
                    stand_in.requests += 1
                data = self.body()
                if self.headers.get("Authorization") != f"Bearer {KEY}":
                    return self.reply(401, {"error": "bad key"})
                path = urllib.parse.urlsplit(self.path).path.removeprefix("/api")
                step = next(
                    (
                        name
                        for name, (_, template) in ENDPOINTS.items()
                        if re.fullmatch(re.sub(r"\\\{\w+\\\}", "[^/]+", re.escape(template)), path)
                    ),
                    None,
                )
                if step is None or path.split("/")[2] != TEAM:
                    return self.reply(404, {"error": f"no such endpoint {path}"})
                with stand_in.lock:
                    stand_in.api_calls.append((step, path))
                body = json.loads(data)
                return getattr(self, f"api_{step}")(body, path)

            def api_register(self, body, path):
                self.reply(200, {"team": TEAM})

            def api_upload(self, body, path):
                assert body["size"] == len(stand_in.payload)
                assert body["sha256"] == hashlib.sha256(stand_in.payload).hexdigest()
                upload_id = f"up-{len(stand_in.uploads) + 1}"
                single = body["size"] <= stand_in.single_max
                part_size = body["size"] if single else (stand_in.part_size or body["part_size"])
                stand_in.uploads[upload_id] = {
                    "part_size": part_size,
                    "mode": "single" if single else "multipart",
                    "parts": {},
                    "completed": False,
                }
                self.reply(
                    200,
                    {
                        "upload_id": upload_id,
                        "mode": stand_in.uploads[upload_id]["mode"],
                        **({} if single else {"part_size": part_size}),
                    },
                )

            def upload(self, path):
                upload_id = path.split("/")[4]
                return upload_id, None if upload_id in stand_in.forgotten else stand_in.uploads.get(upload_id)

            def api_urls(self, body, path):
                upload_id, upload = self.upload(path)
                if upload is None:
                    return self.reply(404, {"error": "no such upload"})
                urls = {}
                with stand_in.lock:
                    stand_in.url_requests.append(list(body["parts"]))
                    for part in body["parts"]:
                        stand_in.issued[part] = stand_in.issued.get(part, 0) + 1
                        token = secrets.token_hex(8)
                        expired = stand_in.issued[part] <= stand_in.expire.get(part, 0)
                        stand_in.tokens[token] = (upload_id, part, expired)
                        host = stand_in.server.server_address
                        urls[str(part)] = f"http://{host[0]}:{host[1]}/bucket/{upload_id}/{part}?X-Signature={token}"
                self.reply(200, {"urls": urls})

            def api_complete(self, body, path):
                upload_id, upload = self.upload(path)
                payload = stand_in.payload
                count = max(1, -(-len(payload) // upload["part_size"]))
                problems = []
                if [p["part"] for p in body["parts"]] != list(range(1, count + 1)):
                    problems.append(f"parts {[p['part'] for p in body['parts']]} are not 1..{count}")
                for entry in body["parts"]:
                    got = upload["parts"].get(entry["part"])
                    if got is None or got != (entry["size"], entry["etag"], entry["sha256"]):
                        problems.append(f"part {entry['part']}: {entry} is not what was received ({got})")
                if body["size"] != len(payload) or body["sha256"] != hashlib.sha256(payload).hexdigest():
                    problems.append("size or sha256 of the whole file is wrong")
                stand_in.completions.append(body)
                if problems:
                    return self.reply(400, {"error": "; ".join(problems)})
                upload["completed"] = True
                self.reply(200, {"upload_id": upload_id, "size": body["size"]})

            def api_submit(self, body, path):
                if stand_in.submit_status:
                    return self.reply(stand_in.submit_status, {"error": "try later"})
                upload = stand_in.uploads.get(body["upload_id"])
                if upload is None or not upload["completed"]:
                    return self.reply(409, {"error": "upload not completed"})
                submission = stand_in.submissions.setdefault(body["upload_id"], f"sub-{len(stand_in.submissions) + 1}")
                answer = {"submission_id": submission, "status": "queued"}
                if stand_in.echo_key:
                    answer["received_authorization"] = self.headers.get("Authorization")
                self.reply(200, answer)

            def do_PUT(self):
                with stand_in.lock:
                    stand_in.requests += 1
                    if self.headers.get("Authorization"):
                        stand_in.storage_auth_headers.append(self.headers["Authorization"])
                parts = urllib.parse.urlsplit(self.path)
                _, _, upload_id, part = parts.path.split("/")
                part = int(part)
                token = urllib.parse.parse_qs(parts.query).get("X-Signature", [""])[0]
                length = int(self.headers["Content-Length"])
                with stand_in.lock:
                    stand_in.puts[part] = attempt = stand_in.puts.get(part, 0) + 1
                if stand_in.tokens.get(token, (None, None, True))[:2] != (upload_id, part):
                    self.rfile.read(length)
                    return self.reply(403, "<Error><Code>AccessDenied</Code><Message>bad signature</Message></Error>")
                if stand_in.tokens[token][2]:
                    self.rfile.read(length)
                    return self.reply(
                        403, "<Error><Code>AccessDenied</Code><Message>Request has expired</Message></Error>"
                    )
                if (part, attempt) in stand_in.cut:  # take half of it, then drop the connection
                    self.rfile.read(length // 2)
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    self.connection.close()
                    self.close_connection = True
                    return
                data = self.rfile.read(length)
                upload = stand_in.uploads[upload_id]
                offset = (part - 1) * upload["part_size"]
                expected = stand_in.payload[offset : offset + upload["part_size"]]
                if hashlib.sha256(data).digest() != hashlib.sha256(expected).digest():
                    return self.reply(400, {"error": f"part {part}: bytes differ from the file's"})
                md5 = hashlib.md5(data).hexdigest()
                upload["parts"][part] = (len(data), md5, hashlib.sha256(data).hexdigest())
                self.reply(200, "", {"ETag": f'"{md5}"'})

        return Handler


def archive(tmp_path: Path, size: int) -> tuple[Path, bytes]:
    payload = hashlib.shake_256(b"image").digest(size)  # seeded bytes, no repeats at any part boundary
    tarball = tmp_path / "image.tar.gz"
    tarball.write_bytes(payload)
    (tmp_path / "image.tar.gz.sha256").write_text(f"{hashlib.sha256(payload).hexdigest()}  image.tar.gz\n")
    return tarball, payload


def job(tmp_path: Path, part_size_mb: float = 0.5, retries: int = 0) -> NS:
    return NS(
        rule="submit",
        input=NS(
            tarball=str(tmp_path / "image.tar.gz"),
            sha256=str(tmp_path / "image.tar.gz.sha256"),
            schema=str(ROOT / "schemas" / "submission.schema.yaml"),
        ),
        output=NS(record=str(tmp_path / "results" / "submission.json")),
        params=NS(part_size_mb=part_size_mb, retries=retries, retry_wait_s=0, timeout_s=30),
        log=[],
        threads=1,
        wildcards=NS(),
    )


def run_in_process(stand_in: StandIn, the_job: NS, monkeypatch, **env):
    for name in ENV.values():
        monkeypatch.delenv(name, raising=False)
    for name, value in stand_in.env(**env).items():
        monkeypatch.setenv(name, value)
    submit.main(the_job)


def run_as_program(stand_in: StandIn, the_job: NS, tmp_path: Path, **env) -> subprocess.CompletedProcess:
    """The script as the rule runs it in a venv (`--job`), its output appended to the rule's log."""
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps({k: vars(v) if isinstance(v, NS) else v for k, v in vars(the_job).items()}))
    clean = {k: v for k, v in os.environ.items() if k not in ENV.values()}
    log = tmp_path / "submit.log"
    with open(log, "a") as handle:
        result = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "submit.py"), "--job", str(job_file)],
            env={**clean, **stand_in.env(**env), "PYTHONPATH": str(ROOT / "scripts")},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=120,
        )
        handle.write(result.stdout)
    return result


def test_single_upload(tmp_path, monkeypatch, capsys):
    tarball, payload = archive(tmp_path, 300_000)
    with StandIn(payload, single_max=1 * MIB) as api:
        run_in_process(api, job(tmp_path), monkeypatch)
    record = json.loads((tmp_path / "results" / "submission.json").read_text())
    assert record["mode"] == "single" and record["parts"] == 1 and record["submission_id"] == "sub-1"
    assert record["sha256"] == hashlib.sha256(payload).hexdigest() and record["size"] == len(payload)
    assert api.puts == {1: 1} and len(api.completions) == 1
    assert [step for step, _ in api.api_calls] == ["register", "upload", "urls", "complete", "submit"]
    assert not state_path(tarball).exists()
    assert "submission sub-1 recorded" in capsys.readouterr().out


def test_multipart_interrupted_twice_resumes_without_resending_finished_parts(tmp_path, monkeypatch, capsys):
    tarball, payload = archive(tmp_path, 3 * MIB + 12345)  # 7 parts of 0.5 MiB, the last one short
    the_job = job(tmp_path, part_size_mb=0.5, retries=0)
    with StandIn(payload, single_max=1 * MIB, cut={(2, 1), (5, 1)}) as api:
        with pytest.raises(
            StageError,
            match=r"PUT part 2/7 .*connection failed.*1 of 7 part\(s\) are recorded in "
            rf"{re.escape(str(state_path(tarball)))}: rerun to resume",
        ):
            run_in_process(api, the_job, monkeypatch)
        state = json.loads(state_path(tarball).read_text())  # left, valid, and only what the server took
        assert state["mode"] == "multipart" and sorted(state["parts"]) == ["1"] and not state["completed"]
        assert state["sha256"] == hashlib.sha256(payload).hexdigest() and state["part_size"] == MIB // 2
        assert state["parts"]["1"]["sha256"] == hashlib.sha256(payload[: MIB // 2]).hexdigest()
        assert not (tmp_path / "results" / "submission.json").exists()

        with pytest.raises(StageError, match=r"PUT part 5/7 .*4 of 7 part\(s\) are recorded"):
            run_in_process(api, the_job, monkeypatch)
        assert sorted(json.loads(state_path(tarball).read_text())["parts"]) == ["1", "2", "3", "4"]
        assert "resuming upload up-1 (multipart)" in capsys.readouterr().out

        run_in_process(api, the_job, monkeypatch)
    out = capsys.readouterr().out
    assert "4 part(s) already uploaded, not sent again" in out
    assert re.search(
        r"^part 7/7: 12345 bytes in [\d.]+ s \([\d.]+ MB/s\); 3158073/3158073 bytes \(100\.0%\)$", out, re.M
    )
    # each finished part went up once; the two cut parts twice (the cut attempt and the good one)
    assert api.puts == {1: 1, 2: 2, 3: 1, 4: 1, 5: 2, 6: 1, 7: 1}
    # every run asked for URLs of its missing parts only, and registered and created the upload only once
    assert api.url_requests == [[1, 2, 3, 4, 5, 6, 7], [2, 3, 4, 5, 6, 7], [5, 6, 7]]
    assert [step for step, _ in api.api_calls].count("upload") == 1
    assert len(api.completions) == 1 and [p["part"] for p in api.completions[0]["parts"]] == list(range(1, 8))
    record = json.loads((tmp_path / "results" / "submission.json").read_text())
    assert record["mode"] == "multipart" and record["parts"] == 7 and record["upload_id"] == "up-1"
    assert not state_path(tarball).exists()


def test_a_dropped_part_is_retried_within_the_run(tmp_path, monkeypatch, capsys):
    tarball, payload = archive(tmp_path, 2 * MIB + 1)
    with StandIn(payload, single_max=MIB, part_size=MIB, cut={(2, 1), (2, 2)}) as api:
        run_in_process(api, job(tmp_path, part_size_mb=0.25, retries=2), monkeypatch)
    assert api.puts == {1: 1, 2: 3, 3: 1}  # the API's part size (1 MiB), not the proposed 0.25 MiB
    assert "retry 2 of 2" in capsys.readouterr().out
    assert json.loads((tmp_path / "results" / "submission.json").read_text())["part_size"] == MIB


def test_an_expired_url_is_requested_again(tmp_path, monkeypatch, capsys):
    tarball, payload = archive(tmp_path, 2 * MIB)
    with StandIn(payload, single_max=MIB, expire={3: 1}) as api:
        run_in_process(api, job(tmp_path, part_size_mb=0.5, retries=0), monkeypatch)
    assert api.puts == {1: 1, 2: 1, 3: 2, 4: 1}
    assert api.url_requests == [[1, 2, 3, 4], [3]]
    assert "presigned URL has expired or was refused (403); requesting a new one" in capsys.readouterr().out
    assert not state_path(tarball).exists()


def test_a_url_that_stays_expired_stops_with_the_state_kept(tmp_path, monkeypatch):
    tarball, payload = archive(tmp_path, 2 * MIB)
    with StandIn(payload, single_max=MIB, expire={2: 99}) as api:
        with pytest.raises(
            StageError,
            match=r"PUT part 2/4 .*refused \(403\) again after 1 fresh URL.*Request has "
            r"expired.*keeps the 1 finished part\(s\): rerun to resume",
        ):
            run_in_process(api, job(tmp_path, retries=0), monkeypatch)
        assert sorted(json.loads(state_path(tarball).read_text())["parts"]) == ["1"]
        api.expire = {}  # the store is fixed: the rerun resumes
        run_in_process(api, job(tmp_path, retries=0), monkeypatch)
    assert api.puts == {1: 1, 2: 3, 3: 1, 4: 1}


def test_an_upload_the_api_forgot_starts_over(tmp_path, monkeypatch, capsys):
    tarball, payload = archive(tmp_path, 2 * MIB)
    with StandIn(payload, single_max=MIB, cut={(3, 1)}) as api:
        with pytest.raises(StageError, match="rerun to resume"):
            run_in_process(api, job(tmp_path), monkeypatch)
        api.forgotten.add("up-1")  # the upload session expired on the API's side
        run_in_process(api, job(tmp_path), monkeypatch)
    assert "upload up-1 is no longer known to the API" in capsys.readouterr().out
    assert api.puts == {1: 2, 2: 2, 3: 2, 4: 1}
    assert json.loads((tmp_path / "results" / "submission.json").read_text())["upload_id"] == "up-2"


def test_a_completed_upload_whose_submit_failed_is_submitted_on_rerun(tmp_path, monkeypatch):
    tarball, payload = archive(tmp_path, 2 * MIB)
    with StandIn(payload, single_max=MIB) as api:
        api.submit_status = 503
        with pytest.raises(
            StageError,
            match=r"submissions answered 503.*the upload is complete \(.*upload.json "
            r"keeps it\): rerun to submit it without uploading again",
        ):
            run_in_process(api, job(tmp_path), monkeypatch)
        assert json.loads(state_path(tarball).read_text())["completed"] is True
        assert not (tmp_path / "results" / "submission.json").exists()
        api.submit_status = None
        run_in_process(api, job(tmp_path), monkeypatch)
    assert api.puts == {1: 1, 2: 1, 3: 1, 4: 1} and len(api.completions) == 1
    assert not state_path(tarball).exists()


def test_a_missing_key_fails_before_any_request(tmp_path):
    tarball, payload = archive(tmp_path, 100_000)
    with StandIn(payload, single_max=MIB) as api:
        result = run_as_program(api, job(tmp_path), tmp_path, **{ENV["key"]: None})
    assert result.returncode != 0
    assert "ERROR [submit]: environment variable QWEN_SUBMIT_KEY not set" in result.stdout
    assert "read from the environment only, never from config; nothing was sent" in result.stdout
    assert api.requests == 0
    assert not state_path(tarball).exists() and not (tmp_path / "results").exists()


def test_a_wrong_key_names_the_variable_and_the_call(tmp_path, monkeypatch):
    tarball, payload = archive(tmp_path, 100_000)
    with StandIn(payload, single_max=MIB) as api:
        with pytest.raises(
            StageError,
            match=r"POST \$QWEN_SUBMIT_URL/teams/\$QWEN_SUBMIT_TEAM/register answered "
            r"401.*is QWEN_SUBMIT_KEY the team's current upload key",
        ):
            run_in_process(api, job(tmp_path), monkeypatch, **{ENV["key"]: "sk-wrong"})
    assert not state_path(tarball).exists() and not (tmp_path / "results").exists()


def test_a_changed_archive_is_not_sent(tmp_path, monkeypatch):
    tarball, payload = archive(tmp_path, 100_000)
    tarball.write_bytes(payload[:-1] + b"x")
    with StandIn(payload, single_max=MIB) as api:
        with pytest.raises(StageError, match=r"image.tar.gz has sha256 .* not the .* of .*image.tar.gz.sha256"):
            run_in_process(api, job(tmp_path), monkeypatch)
    assert api.requests == 0


def test_a_state_of_another_file_is_not_trusted(tmp_path, monkeypatch, capsys):
    tarball, payload = archive(tmp_path, 2 * MIB)
    state_path(tarball).write_text(
        json.dumps(
            {
                "version": 1,
                "size": len(payload),
                "sha256": "0" * 64,
                "upload_id": "up-old",
                "mode": "multipart",
                "part_size": MIB,
                "parts": {"1": {"size": MIB, "etag": "x", "sha256": "y"}},
            }
        )
    )
    with StandIn(payload, single_max=MIB) as api:
        run_in_process(api, job(tmp_path), monkeypatch)
    assert "describes another file" in capsys.readouterr().out
    assert api.puts == {1: 1, 2: 1, 3: 1, 4: 1} and not state_path(tarball).exists()


def test_the_key_is_in_no_log_state_record_or_output(tmp_path):
    tarball, payload = archive(tmp_path, 2 * MIB + 7)
    the_job = job(tmp_path, part_size_mb=0.5, retries=0)
    with StandIn(payload, single_max=MIB, cut={(3, 1)}, expire={2: 1}, echo_key=True) as api:
        interrupted = run_as_program(api, the_job, tmp_path)
        assert interrupted.returncode != 0 and "rerun to resume" in interrupted.stdout
        state_after_cut = state_path(tarball).read_text()
        assert json.loads(state_after_cut)["parts"].keys() == {"1", "2"}
        finished = run_as_program(api, the_job, tmp_path)
    assert finished.returncode == 0, finished.stdout
    assert not api.storage_auth_headers  # presigned URLs never get the key
    record_text = (tmp_path / "results" / "submission.json").read_text()
    assert json.loads(record_text)["response"]["received_authorization"] == "Bearer ***"
    log = (tmp_path / "submit.log").read_text()
    assert "submission sub-1 recorded" in log
    for name, text in {
        "log": log,
        "stdout": interrupted.stdout + finished.stdout,
        "state file": state_after_cut,
        "record": record_text,
        "archive": tarball.read_bytes().decode("latin-1"),
    }.items():
        assert KEY not in text, name
        assert KEY[8:24] not in text, name
        assert api.url not in text and TEAM not in text, name  # the URL and the team stay in the environment too


def test_submit_is_optional_and_reads_no_secret_from_config():
    """`snakemake submit` plans only submit (given the tarball); the default target never includes it; its rule
    passes no URL, team or key as params (Snakemake records params)."""
    default = snakemake("-n", *TINY).stdout
    assert not re.search(r"^submit\s+\d+$", default, re.M)
    planned = snakemake("-n", "submit", *TINY).stdout
    assert re.search(r"^submit\s+1$", planned, re.M)
    rule = (ROOT / "rules" / "submit.smk").read_text()
    assert "QWEN_SUBMIT_KEY" in rule and "os.environ" not in rule and "getenv" not in rule
