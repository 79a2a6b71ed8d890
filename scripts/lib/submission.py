"""Upload image.tar.gz to the competition's submission API and submit it: standard library only.

The contract (../shared/spec/contract.md) does not describe the submission API, so this is a small client of the
flow it had (register, request an upload, single PUT or multipart with per-part presigned URLs, complete, submit,
keyed by an API key). Every endpoint it calls is one row of ENDPOINTS: adapting it to the real API is an edit there
(and, if the answers' field names differ, in the few lines that read them).

Where the API is, who the team is and the key come from the environment only (ENV); none of them is ever printed,
written to the state file or the record. The key goes only into the Authorization header of the API's own calls,
never to a presigned URL (the signature is in the URL), and any message is masked before it is shown.

Multipart uploads resume: a state file beside the tarball (`<tarball>.upload.json`, written atomically after every
finished part) holds the upload id and each finished part's size, ETag and sha256. A rerun re-requests presigned URLs
for the missing parts only; the state file is removed once the submission is recorded.
"""

import hashlib
import http.client
import json
import os
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from lib.stage import StageError, write_json

# Environment variables (never config: Snakemake records params, and a config file is easily committed).
ENV = {"url": "QWEN_SUBMIT_URL", "team": "QWEN_SUBMIT_TEAM", "key": "QWEN_SUBMIT_KEY"}

# The API, one row per call: (method, path under $QWEN_SUBMIT_URL). The body each takes and what it answers:
#   register  {}                                                   -> anything (2xx or 409 = registered)
#   upload    {filename, size, sha256, part_size}                  -> {upload_id, mode: single|multipart,
#                                                                      part_size (multipart)}
#   urls      {parts: [n, ...]}                                    -> {urls: {"n": presigned PUT URL}}
#   (PUT to each presigned URL: the part's bytes                   -> 200 with an ETag header)
#   complete  {size, sha256, parts: [{part, size, etag, sha256}]}  -> anything
#   submit    {upload_id, size, sha256}                            -> {submission_id, ...}; the same upload_id
#                                                                      answers the same submission (idempotent)
# A single upload is part 1 covering the whole file: same URL request, same completion.
ENDPOINTS = {
    "register": ("POST", "/teams/{team}/register"),
    "upload": ("POST", "/teams/{team}/uploads"),
    "urls": ("POST", "/teams/{team}/uploads/{upload_id}/urls"),
    "complete": ("POST", "/teams/{team}/uploads/{upload_id}/complete"),
    "submit": ("POST", "/teams/{team}/submissions"),
}

STATE_VERSION = 1
BLOCK = 1 << 20  # bytes read and sent at a time: a part is streamed, never held in memory


@dataclass(frozen=True)
class Settings:
    part_size: int  # bytes per part proposed to the API (the API's answer decides)
    retries: int  # further attempts of one request (a part PUT, an API call) after a dropped connection
    retry_wait_s: float
    timeout_s: float  # socket timeout of each request


@dataclass(frozen=True)
class Credentials:
    url: str
    team: str
    key: str

    def mask(self, text: str) -> str:
        """The text with the key replaced (an API that echoes it must not get it into a log)."""
        return text.replace(self.key, "***") if self.key else text


def credentials_from_env(environ: dict[str, str] | None = None) -> Credentials:
    """Read URL, team and key; a missing one fails before any request, naming the variable."""
    environ = os.environ if environ is None else environ
    missing = [name for name in ENV.values() if not environ.get(name, "").strip()]
    if missing:
        raise StageError(
            f"environment variable{'s' if len(missing) > 1 else ''} {', '.join(missing)} not set: "
            f"the submission API's base URL ({ENV['url']}), team id ({ENV['team']}) and upload key "
            f"({ENV['key']}) are read from the environment only, never from config; nothing was sent"
        )
    url = environ[ENV["url"]].strip().rstrip("/")
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        raise StageError(f"{ENV['url']} must be an http(s) URL; nothing was sent")
    return Credentials(url=url, team=environ[ENV["team"]].strip(), key=environ[ENV["key"]].strip())


def state_path(tarball: str | Path) -> Path:
    """The resume state lives beside the tarball it describes."""
    tarball = Path(tarball)
    return tarball.with_name(tarball.name + ".upload.json")


def read_sha256_file(path: str | Path) -> str:
    words = Path(path).read_text().split()
    digest = words[0] if words else ""
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise StageError(f"{path}: no sha256 digest in it (expected `<sha256>  image.tar.gz`)")
    return digest


def part_ranges(size: int, part_size: int) -> list[tuple[int, int, int]]:
    """(part number from 1, offset, length) of every part; a single upload is one part."""
    if size == 0:
        return [(1, 0, 0)]
    return [(n + 1, offset, min(part_size, size - offset)) for n, offset in enumerate(range(0, size, part_size))]


def load_state(path: Path, size: int, sha256: str, log: Callable[[str], None]) -> dict | None:
    """The state of an earlier, unfinished upload of this very file; None (and a note why) otherwise."""
    if not path.exists():
        return None
    try:
        state = json.loads(path.read_text())
        valid = (
            state.get("version") == STATE_VERSION
            and isinstance(state.get("upload_id"), str)
            and state.get("mode") in ("single", "multipart")
            and isinstance(state.get("parts"), dict)
            and isinstance(state.get("part_size"), int)
            and state["part_size"] > 0
        )
    except (OSError, ValueError, AttributeError):
        valid = False
    if not valid:
        log(f"{path}: not a state file this client wrote; starting a new upload")
        return None
    if state.get("size") != size or state.get("sha256") != sha256:
        log(f"{path}: describes another file (sha256 {str(state.get('sha256'))[:12]}...); starting a new upload")
        return None
    return state


class Client:
    """The API's calls, with the key in the header of each and retries on dropped connections."""

    def __init__(self, credentials: Credentials, settings: Settings, log: Callable[[str], None]):
        self.credentials, self.settings, self.log = credentials, settings, log

    def where(self, step: str, **fields) -> str:
        """The call, named without the base URL's value or the team's:
        `POST $QWEN_SUBMIT_URL/teams/$QWEN_SUBMIT_TEAM/...`."""
        method, path = ENDPOINTS[step]
        return f"{method} ${ENV['url']}" + path.format(team=f"${ENV['team']}", **fields)

    def call(self, step: str, body: dict, ok_statuses: tuple[int, ...] = (), **fields) -> tuple[int, Any]:
        """(status, JSON answer or None) of one API call; an error status raises ApiError."""
        method, path = ENDPOINTS[step]
        url = self.credentials.url + path.format(
            team=urllib.parse.quote(self.credentials.team, safe=""),
            **{k: urllib.parse.quote(str(v), safe="") for k, v in fields.items()},
        )
        data = json.dumps(body).encode()
        headers = {
            "Authorization": f"Bearer {self.credentials.key}",
            "Content-Type": "application/json",
            "Accept": "application/json",
            "Content-Length": str(len(data)),
        }
        status, reply_headers, text = self._with_retries(
            self.where(step, **fields), lambda: _send(method, url, data, headers, self.settings.timeout_s)
        )
        if 200 <= status < 300 or status in ok_statuses:
            try:
                return status, json.loads(text) if text.strip() else None
            except ValueError:
                raise ApiError(
                    status,
                    f"{self.where(step, **fields)} answered {status} with a body that is no "
                    f"JSON: {self.credentials.mask(text[:200])!r}",
                ) from None
        raise ApiError(
            status,
            f"{self.where(step, **fields)} answered {status}: "
            f"{self.credentials.mask(text[:300]).strip()}{_hint(status)}",
        )

    def put(self, url: str, path: Path, offset: int, length: int) -> tuple[int, str, str, str, str]:
        """PUT bytes [offset, offset + length) of the file to a presigned URL, streamed and hashed on the way:
        (status, ETag, md5, sha256, answer text). No Authorization header: the URL carries the signature."""
        reader = _PartReader(path, offset, length)
        try:
            status, headers, text = _send("PUT", url, reader, {"Content-Length": str(length)}, self.settings.timeout_s)
        finally:
            reader.close()
        if 200 <= status < 300 and reader.sent != length:  # a success for less than the part is none
            raise ConnectionError(f"the server answered {status} after {reader.sent} of {length} bytes")
        return status, headers.get("etag", "").strip('"'), reader.md5.hexdigest(), reader.sha256.hexdigest(), text

    def _with_retries(self, what: str, send: Callable[[], tuple]) -> tuple:
        for attempt in range(self.settings.retries + 1):
            try:
                return send()
            except (OSError, http.client.HTTPException) as error:
                reason = _reason(error)
                if attempt == self.settings.retries:
                    raise StageError(
                        f"{what}: connection failed ({self.credentials.mask(reason)}) after "
                        f"{attempt + 1} attempt(s); rerun to try again"
                    ) from None
                self.log(
                    f"{what}: connection failed ({self.credentials.mask(reason)}); retry {attempt + 1} of "
                    f"{self.settings.retries} in {self.settings.retry_wait_s:g} s"
                )
                time.sleep(self.settings.retry_wait_s)
        raise AssertionError("unreachable")


class ApiError(StageError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _hint(status: int) -> str:
    if status in (401, 403):
        return f" (is {ENV['key']} the team's current upload key, and {ENV['team']} its id?)"
    return ""


def _reason(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _send(method: str, url: str, body, headers: dict[str, str], timeout_s: float) -> tuple[int, dict, str]:
    """One request on a fresh connection: (status, lower-cased headers, body text)."""
    parts = urllib.parse.urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = kind(parts.netloc, timeout=timeout_s, blocksize=BLOCK)
    try:
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        connection.request(method, target, body=body, headers=headers)
        reply = connection.getresponse()
        text = reply.read().decode(errors="replace")
        return reply.status, {k.lower(): v for k, v in reply.getheaders()}, text
    finally:
        connection.close()


def public_url(url: str) -> str:
    """A presigned URL without its query (the query is the credential)."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}{parts.path}"


class _PartReader:
    """A file-like view of one part: http.client reads it BLOCK bytes at a time; md5 and sha256 follow."""

    def __init__(self, path: Path, offset: int, length: int):
        self.handle = open(path, "rb")
        self.handle.seek(offset)
        self.left, self.sent = length, 0
        self.md5, self.sha256 = hashlib.md5(usedforsecurity=False), hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        size = self.left if size is None or size < 0 else min(size, self.left)
        block = self.handle.read(size)
        self.left -= len(block)
        self.sent += len(block)
        self.md5.update(block)
        self.sha256.update(block)
        return block

    def close(self) -> None:
        self.handle.close()


def _expired(status: int, text: str) -> bool:
    """A presigned URL past its time: S3 answers 403 AccessDenied "Request has expired"."""
    return status == 403 or (status == 400 and "expired" in text.lower())


def upload_and_submit(
    tarball: str | Path, sha256: str, credentials: Credentials, settings: Settings, log: Callable[[str], None] = print
) -> dict:
    """Upload the tarball (resuming an earlier unfinished upload of the same file) and submit it.
    Returns the record: ids, mode, parts, seconds and the API's submit answer. The state file is removed at the end."""
    tarball = Path(tarball)
    size = tarball.stat().st_size
    client = Client(credentials, settings, log)
    state_file = state_path(tarball)
    started = time.monotonic()
    state = load_state(state_file, size, sha256, log)
    resent_note = None
    if state is None:
        state = _new_upload(client, tarball, size, sha256, settings, state_file, log)
    else:
        done = sorted(int(n) for n in state["parts"])
        resent_note = f"resuming upload {state['upload_id']} ({state['mode']}) from {state_file}: " + (
            f"{len(done)} part(s) already uploaded, not sent again" if done else "no part finished yet"
        )
        log(resent_note)
    if not state.get("completed"):
        try:
            _upload_parts(client, tarball, size, state, state_file, log)
        except ApiError as error:
            if error.status != 404 or resent_note is None:
                raise
            # the API forgot the upload (expired session): the resumed parts are worthless, start over once
            log(f"upload {state['upload_id']} is no longer known to the API ({error}); starting a new upload")
            state_file.unlink(missing_ok=True)
            state = _new_upload(client, tarball, size, sha256, settings, state_file, log)
            _upload_parts(client, tarball, size, state, state_file, log)
        parts = [{"part": int(n), **state["parts"][n]} for n in sorted(state["parts"], key=int)]
        client.call("complete", {"size": size, "sha256": sha256, "parts": parts}, upload_id=state["upload_id"])
        state["completed"] = True
        write_json(state_file, state)
        log(f"upload {state['upload_id']} completed: {len(parts)} part(s), {size} bytes")
    try:
        _, answer = client.call("submit", {"upload_id": state["upload_id"], "size": size, "sha256": sha256})
    except StageError as error:
        raise StageError(
            f"{error}; the upload is complete ({state_file} keeps it): rerun to submit it without uploading again"
        ) from None
    if not isinstance(answer, dict) or not isinstance(answer.get("submission_id"), (str, int)):
        raise StageError(
            f"{client.where('submit')} answered without a submission_id: "
            f"{credentials.mask(json.dumps(answer))[:300]}; the upload is complete ({state_file} "
            "keeps it): rerun to submit it without uploading again"
        )
    log(f"submitted: submission id {answer['submission_id']}")
    record = {
        "submission_id": str(answer["submission_id"]),
        "upload_id": state["upload_id"],
        "mode": state["mode"],
        "file": tarball.name,
        "size": size,
        "sha256": sha256,
        "part_size": state["part_size"],
        "parts": len(state["parts"]),
        "seconds": round(time.monotonic() - started, 3),
        "response": _scrub(answer, credentials.key),
    }
    return record


def _new_upload(
    client: Client,
    tarball: Path,
    size: int,
    sha256: str,
    settings: Settings,
    state_file: Path,
    log: Callable[[str], None],
) -> dict:
    client.call("register", {}, ok_statuses=(409,))
    _, answer = client.call(
        "upload", {"filename": tarball.name, "size": size, "sha256": sha256, "part_size": settings.part_size}
    )
    mode = answer.get("mode") if isinstance(answer, dict) else None
    if mode not in ("single", "multipart") or not isinstance(answer.get("upload_id"), str):
        raise StageError(
            f"{client.where('upload')} answered no upload_id and mode (single or multipart): "
            f"{client.credentials.mask(json.dumps(answer))[:300]}"
        )
    part_size = answer["part_size"] if mode == "multipart" else max(size, 1)
    if not isinstance(part_size, int) or part_size <= 0:
        raise StageError(f"{client.where('upload')} answered multipart without a positive part_size: {part_size!r}")
    state = {
        "version": STATE_VERSION,
        "file": tarball.name,
        "size": size,
        "sha256": sha256,
        "upload_id": answer["upload_id"],
        "mode": mode,
        "part_size": part_size,
        "parts": {},
        "completed": False,
    }
    write_json(state_file, state)
    count = len(part_ranges(size, part_size))
    log(
        f"upload {state['upload_id']}: {mode}, {size} bytes"
        + (f" in {count} parts of {part_size} bytes" if mode == "multipart" else "")
    )
    return state


def _upload_parts(
    client: Client, tarball: Path, size: int, state: dict, state_file: Path, log: Callable[[str], None]
) -> None:
    ranges = part_ranges(size, state["part_size"])
    missing = [r for r in ranges if str(r[0]) not in state["parts"]]
    done_bytes = sum(p["size"] for p in state["parts"].values())
    urls = _request_urls(client, state, [n for n, _, _ in missing])
    for number, offset, length in missing:
        attempts = expired = 0
        while True:
            begun = time.monotonic()
            what = f"PUT part {number}/{len(ranges)} ({length} bytes) to {public_url(urls[number])}"
            try:
                status, etag, md5, digest, text = client.put(urls[number], tarball, offset, length)
            except (OSError, http.client.HTTPException) as error:
                attempts += 1
                reason = client.credentials.mask(_reason(error))
                if attempts > client.settings.retries:
                    raise StageError(
                        f"{what}: connection failed ({reason}) after {attempts} attempt(s); "
                        f"{len(state['parts'])} of {len(ranges)} part(s) are recorded in {state_file}: "
                        "rerun to resume without sending them again"
                    ) from None
                log(
                    f"{what}: connection failed ({reason}); retry {attempts} of {client.settings.retries} "
                    f"in {client.settings.retry_wait_s:g} s"
                )
                time.sleep(client.settings.retry_wait_s)
                continue
            if _expired(status, text):
                expired += 1
                if expired > client.settings.retries + 1:
                    raise StageError(
                        f"{what}: refused ({status}) again after {expired - 1} fresh URL(s): "
                        f"{client.credentials.mask(text[:200]).strip()}; {state_file} keeps the "
                        f"{len(state['parts'])} finished part(s): rerun to resume"
                    )
                log(f"{what}: the presigned URL has expired or was refused ({status}); requesting a new one")
                urls.update(_request_urls(client, state, [number]))
                continue
            if not 200 <= status < 300:
                raise StageError(
                    f"{what}: answered {status}: {client.credentials.mask(text[:300]).strip()}; "
                    f"{state_file} keeps the {len(state['parts'])} finished part(s): rerun to resume"
                )
            if etag and len(etag) == 32 and etag.lower() != md5:  # an S3-style ETag is the part's md5
                attempts += 1
                if attempts > client.settings.retries:
                    raise StageError(
                        f"{what}: the server's ETag {etag} is not the md5 of the bytes sent ({md5}); "
                        f"rerun to resume from {state_file}"
                    )
                log(f"{what}: ETag {etag} does not match the bytes sent ({md5}); sending the part again")
                continue
            break
        state["parts"][str(number)] = {"size": length, "etag": etag or md5, "sha256": digest}
        write_json(state_file, state)  # atomic: a part is recorded only once the server took all of it
        done_bytes += length
        seconds = time.monotonic() - begun
        log(
            f"part {number}/{len(ranges)}: {length} bytes in {seconds:.1f} s "
            f"({length / max(seconds, 1e-6) / 1e6:.1f} MB/s); {done_bytes}/{size} bytes "
            f"({100 * done_bytes / max(size, 1):.1f}%)"
        )


def _request_urls(client: Client, state: dict, parts: list[int]) -> dict[int, str]:
    if not parts:
        return {}
    _, answer = client.call("urls", {"parts": parts}, upload_id=state["upload_id"])
    urls = (answer or {}).get("urls") if isinstance(answer, dict) else None
    try:
        found = {int(n): url for n, url in (urls or {}).items() if isinstance(url, str)}
    except ValueError:
        found = {}
    if set(parts) - set(found):
        raise StageError(
            f"{client.where('urls', upload_id=state['upload_id'])} answered no URL for part(s) "
            f"{sorted(set(parts) - set(found))}"
        )
    return found


def _scrub(value: Any, secret: str) -> Any:
    """The value with the secret removed from every string in it."""
    if isinstance(value, str):
        return value.replace(secret, "***") if secret else value
    if isinstance(value, list):
        return [_scrub(v, secret) for v in value]
    if isinstance(value, dict):
        return {_scrub(k, secret): _scrub(v, secret) for k, v in value.items()}
    return value
