"""Submit image.tar.gz through the competition's own API (its contract's "Submission API").

Standard library only. JSON over HTTPS under a base URL (ending in /prod); every API call carries `x-api-key`:
  1. POST {base}/register         {team_id}                  -> registration record
  2. (local) the file is named image.tar.gz and is at most 20 GB: refused here otherwise (submittable_archive)
  3. POST {base}/upload-url       {team_id, file_size_bytes} -> upload_type single | multipart, s3_key;
                                                                 single: upload_url; multipart: upload_id, num_parts,
                                                                 part_size, part_urls [{part_number, upload_url}]
  4A single: PUT upload_url with the whole file -> 200
  4B multipart: PUT part n's upload_url with bytes [(n-1)·part_size, n·part_size) -> 200 + ETag; then
     POST {base}/complete-upload  {team_id, s3_key, upload_id, parts: [{part_number, etag}]} -> completion record
  5. POST {base}/submit           {team_id, s3_key}          -> submission_id
Single or multipart is the API's answer, never a local size rule. Presigned URLs carry their own signature: the key
goes to the API's calls only, never to a URL.

The base URL, the team id and the key come from the environment only (ENV). None of them is printed or written:
every message goes through Credentials.mask, and what is written (the state file, the record) names the team and
the base URL as `$QWEN_SUBMIT_TEAM` / `$QWEN_SUBMIT_URL` (an s3_key or a presigned URL holding the team id too).

Resuming. The state file beside the archive (`image.tar.gz.upload.json`, written atomically after every finished
part) is tied to the archive's name, size and sha256 and holds the upload-url answer (upload_id, s3_key, part size,
every part's URL and when they were issued) and each finished part's ETag, keyed to that upload. A rerun:
  - with the URLs still inside their 2-hour life (less URL_MARGIN_S) PUTs the missing parts only, to the URLs it
    kept, and completes with the kept ETags: nothing finished is sent again;
  - with the URLs past their life, or on a 403 from a PUT (an expired URL), asks upload-url again, the only way the
    contract gives to get URLs. The contract does not say that a second upload-url call continues the first
    upload, so the conservative reading is that it starts a new one: when the answer has another upload_id or
    s3_key (or part layout), the kept ETags belong to an upload that can no longer be completed, and every part is
    sent again to the new one (said in the log; the old multipart upload is left for the store to expire, as the
    contract has no abort call). When the API answers the same upload_id, s3_key and layout, only the URLs are
    replaced and the finished parts are kept.
A dropped connection or a 502/503/504 (a gateway's "busy" or "away") is retried with doubling waits, a bounded number
of times, for every request but submit: a submit whose answer was lost may still have counted. The state file holds
presigned URLs, each a credential for two hours, so it is readable by its owner only.
An upload that the API refuses to complete (a wrong or missing ETag: 4xx) removes the state file, so the next run
starts over. After submit answers, its submission_id goes into the state file before the record is written, so a
rerun after a crash there never submits a second time (one submission per team per day); the caller removes the
state file once the record is written.
"""

import http.client
import json
import os
import re
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from lib.stage import StageError, sha256_file, write_json

# Environment variables (never config: Snakemake records params, and a config file is easily committed).
ENV = {"url": "QWEN_SUBMIT_URL", "team": "QWEN_SUBMIT_TEAM", "key": "QWEN_SUBMIT_KEY"}
TEAM_ID = re.compile(r"AFM-[A-Za-z0-9]+")  # the contract's `AFM-xxxxxxxx`: catches a key or URL in the team's place

# The API's calls (all POST, JSON, under the base URL).
ENDPOINTS = {"register": "/register", "upload_url": "/upload-url", "complete": "/complete-upload", "submit": "/submit"}

# The contract's limits.
ARCHIVE_NAME = "image.tar.gz"
MAX_ARCHIVE_BYTES = 20 * 10**9  # "≤ 20 GB", read as decimal GB: the stricter of the two readings
URL_LIFETIME_S = 2 * 3600  # presigned upload URLs expire after 2 hours
URL_MARGIN_S = 300  # a kept URL this close to its end is not worth a part's bytes: ask for fresh ones

# A gateway's answers for an API or a store busy or briefly away: the request did not take, so it is sent again.
TRANSIENT = (502, 503, 504)

STATE_VERSION = 2
BLOCK = 1 << 20  # bytes read and sent at a time: a part is streamed, never held in memory


@dataclass(frozen=True)
class Settings:
    retries: int  # further attempts of one request after a dropped connection or a 502/503/504; also fresh URLs
    retry_wait_s: float  # before the first retry of a request; doubled for each further one
    timeout_s: float  # socket timeout of each request


@dataclass(frozen=True)
class Credentials:
    url: str
    team: str
    key: str

    def mask(self, text: str) -> str:
        """The text with the key, the base URL and the team id replaced (an API may echo any of them)."""
        for secret, shown in ((self.key, "***"), (self.url, f"${ENV['url']}"), (self.team, f"${ENV['team']}")):
            text = text.replace(secret, shown)
        return text

    def reveal(self, text: str) -> str:
        """A masked s3_key or URL from the state file with the base URL and the team id back in."""
        return text.replace(f"${ENV['url']}", self.url).replace(f"${ENV['team']}", self.team)


@dataclass(frozen=True)
class Archive:
    path: Path
    size: int
    sha256: str
    variant: str


def credentials_from_env(environ: dict[str, str] | None = None) -> Credentials:
    """Read URL, team and key; a missing one fails before any work, naming every missing variable."""
    environ = os.environ if environ is None else environ
    missing = [name for name in ENV.values() if not environ.get(name, "").strip()]
    if missing:
        raise StageError(
            f"environment variable{'s' if len(missing) > 1 else ''} {', '.join(missing)} not set: "
            f"the submission API's base URL ({ENV['url']}), team id ({ENV['team']}) and key "
            f"({ENV['key']}) are read from the environment only, never from config; nothing was sent"
        )
    url = environ[ENV["url"]].strip().rstrip("/")
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        raise StageError(f"{ENV['url']} must be an http(s) URL (the API's base, ending in /prod); nothing was sent")
    team = environ[ENV["team"]].strip()
    if not TEAM_ID.fullmatch(team):
        raise StageError(f"{ENV['team']} is not a team id of the form AFM-xxxxxxxx; nothing was sent")
    return Credentials(url=url, team=team, key=environ[ENV["key"]].strip())


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


# --- what may be sent -------------------------------------------------------------------------------------------


def _read_record(path: str | Path, problems: list[str]) -> dict:
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        problems.append(f"{path} cannot be read as JSON ({error})")
        return {}
    if not isinstance(record, dict):
        problems.append(f"{path} is not a JSON object")
        return {}
    return record


def _variant_of(path: str | Path) -> str:
    """results/<variant>/<stage>/<file>.json -> <variant>."""
    return Path(path).parent.parent.name


def submittable_archive(
    tarball: str | Path,
    sha256_path: str | Path,
    verify_path: str | Path,
    quality_path: str | Path,
    lossless_path: str | Path,
    log: Callable[[str], None] = print,
) -> Archive:
    """The archive, once every rule for sending it holds; otherwise StageError naming each reason, before any request.
    The cheap checks run first; the archive is hashed only when they pass (a changed archive is never sent)."""
    tarball = Path(tarball)
    problems = []
    if tarball.name != ARCHIVE_NAME:
        problems.append(f"the file is named {tarball.name!r}: the API takes only a file named {ARCHIVE_NAME!r}")
    size = tarball.stat().st_size
    if size > MAX_ARCHIVE_BYTES:
        problems.append(f"it is {size} bytes, over the API's limit of 20 GB ({MAX_ARCHIVE_BYTES} bytes)")
    variant = _variant_of(verify_path)
    verify = _read_record(verify_path, problems)
    quality = _read_record(quality_path, problems)
    lossless = _read_record(lossless_path, problems)
    others = {str(p) for p in (quality_path, lossless_path) if _variant_of(p) != variant}
    if others or (lossless and lossless.get("variant") != variant):
        problems.append(f"{verify_path}, {quality_path} and {lossless_path} are not all records of variant {variant}")
    if verify:
        smoke = verify.get("smoke") or {}
        if verify.get("archive_bytes") != size:
            problems.append(
                f"{verify_path} verified an archive of {verify.get('archive_bytes')} bytes, not this one's {size}: "
                "rerun verify_image"
            )
        if not smoke.get("ran"):
            problems.append(
                f"{verify_path}: the image was never run (smoke test skipped: {smoke.get('reason', 'no reason')}); "
                "run verify_image with a Docker daemon (image.verify_run: always)"
            )
        elif not all(entry.get("ok") for entry in (smoke.get("endpoints") or {}).values()):
            failed = [name for name, entry in smoke["endpoints"].items() if not entry.get("ok")]
            problems.append(f"{verify_path}: the smoke test failed on {', '.join(failed)}")
        elif not smoke.get("endpoints"):
            problems.append(f"{verify_path}: the smoke test recorded no endpoint")
    if quality:
        if quality.get("limited") is not False:
            problems.append(
                f"{quality_path}: the quality gate ran on a sample (limited: {quality.get('limited')}, limit "
                f"{quality.get('limit')}), not the full task sets: rerun quality_gate with quality.limit null"
            )
        if quality.get("passed") is not True:
            problems.append(f"{quality_path}: the quality gate did not pass")
    if lossless and lossless.get("passed") is not True:
        problems.append(
            f"{lossless_path}: the lossless check failed (greedy ids differ without speculation): "
            f"{'; '.join(lossless.get('failures') or []) or 'no failure listed'}"
        )
    if not problems:
        expected = read_sha256_file(sha256_path)
        started = time.monotonic()
        actual = sha256_file(tarball)
        log(f"{tarball}: sha256 {actual} ({time.monotonic() - started:.0f} s)")
        if actual != expected:
            problems.append(
                f"it has sha256 {actual}, not the {expected} of {sha256_path}: the archive changed after `tarball` "
                "wrote it; rerun `snakemake image.tar.gz`"
            )
        if verify.get("archive_sha256") != actual:
            problems.append(f"{verify_path} verified an archive of sha256 {verify.get('archive_sha256')}, not this one")
    if problems:
        raise StageError(f"{tarball} is not submitted (nothing was sent):\n  - " + "\n  - ".join(problems))
    return Archive(path=tarball, size=size, sha256=actual, variant=variant)


# --- the wire -----------------------------------------------------------------------------------------------------


class ApiError(StageError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


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
    """A file-like view of bytes [offset, offset + length): http.client reads it BLOCK bytes at a time."""

    def __init__(self, path: Path, offset: int, length: int):
        self.handle = open(path, "rb")
        self.handle.seek(offset)
        self.left, self.sent = length, 0

    def read(self, size: int = -1) -> bytes:
        size = self.left if size is None or size < 0 else min(size, self.left)
        block = self.handle.read(size)
        self.left -= len(block)
        self.sent += len(block)
        return block

    def close(self) -> None:
        self.handle.close()


def _scrub(value: Any, mask: Callable[[str], str]) -> Any:
    """The value with every string in it masked."""
    if isinstance(value, str):
        return mask(value)
    if isinstance(value, list):
        return [_scrub(v, mask) for v in value]
    if isinstance(value, dict):
        return {mask(str(k)): _scrub(v, mask) for k, v in value.items()}
    return value


def _expired(status: int, text: str) -> bool:
    """A presigned URL past its time: S3 answers 403 AccessDenied "Request has expired"."""
    return status == 403 or (status == 400 and "expired" in text.lower())


def part_ranges(size: int, part_size: int, num_parts: int) -> list[tuple[int, int, int]]:
    """(part number from 1, offset, length): part n is bytes [(n-1)·part_size, n·part_size) of the file."""
    return [(n, (n - 1) * part_size, min(part_size, size - (n - 1) * part_size)) for n in range(1, num_parts + 1)]


# --- the flow -----------------------------------------------------------------------------------------------------


class Uploader:
    """One run of the flow for one archive: the API's calls, the PUTs and the state file."""

    def __init__(self, archive: Archive, credentials: Credentials, settings: Settings, log: Callable[[str], None]):
        self.archive, self.credentials, self.settings = archive, credentials, settings
        self.log = lambda message: log(credentials.mask(message))
        self.state_file = state_path(archive.path)
        self.registered = False

    def backoff(self, attempt: int) -> float:
        """Seconds before retry `attempt` (from 1) of one request: doubled each time, as a busy API asks."""
        return self.settings.retry_wait_s * 2 ** (attempt - 1)

    # the API

    def call(self, step: str, body: dict, retry: bool = True) -> Any:
        """The JSON answer of one API call; an error status raises ApiError. A dropped connection or a gateway's
        502/503/504 is retried with backoff unless retry is False (submit: a second submit of a request that did
        arrive would be a second submission, and a gateway may answer 504 for a request the API went on to take)."""
        what = f"POST ${ENV['url']}{ENDPOINTS[step]}"
        data = json.dumps(body).encode()
        headers = {
            "x-api-key": self.credentials.key,
            "Content-Type": "application/json",
            "Accept": "application/json",
            "Content-Length": str(len(data)),
        }
        url = self.credentials.url + ENDPOINTS[step]
        attempts = self.settings.retries + 1 if retry else 1
        for attempt in range(1, attempts + 1):
            try:
                status, _, text = _send("POST", url, data, headers, self.settings.timeout_s)
                if status not in TRANSIENT or not retry:
                    break
                reason = f"answered {status}"
            except (OSError, http.client.HTTPException) as error:
                reason = f"connection failed ({self.credentials.mask(_reason(error))})"
                if not retry:
                    raise StageError(f"{what}: {reason}; the API may or may not have received it") from None
            if attempt == attempts:
                raise StageError(f"{what}: {reason} after {attempt} attempt(s); rerun to try again")
            self.log(f"{what}: {reason}; retry {attempt} of {self.settings.retries}")
            time.sleep(self.backoff(attempt))
        shown = self.credentials.mask(text[:300]).strip()
        if not 200 <= status < 300:
            hint = (
                f" (is {ENV['key']} the team's current key, and {ENV['team']} its id?)" if status in (401, 403) else ""
            )
            raise ApiError(status, f"{what} answered {status}: {shown}{hint}")
        try:
            return json.loads(text) if text.strip() else None
        except ValueError:
            raise ApiError(status, f"{what} answered {status} with a body that is no JSON: {shown!r}") from None

    def register(self) -> None:
        """Step 1, once per run that asks for an upload. A refusal other than the key's is only noted: a team that
        registered before may be refused a second registration, and upload-url would fail on a team it lacks."""
        if self.registered:
            return
        try:
            self.call("register", {"team_id": self.credentials.team})
            self.log("registered the team")
        except ApiError as error:
            if error.status in (401, 403):
                raise
            self.log(f"{error}; continuing (a team registered before may be refused registering again)")
        self.registered = True

    def upload_answer(self) -> dict:
        """Step 3: a state holding the API's upload (no part finished yet), its URLs issued now."""
        self.register()
        size = self.archive.size
        answer = self.call("upload_url", {"team_id": self.credentials.team, "file_size_bytes": size})
        problem = None
        kind = answer.get("upload_type") if isinstance(answer, dict) else None
        if kind not in ("single", "multipart") or not isinstance(answer.get("s3_key"), str) or not answer["s3_key"]:
            problem = "no upload_type (single or multipart) and s3_key"
        elif kind == "single" and not isinstance(answer.get("upload_url"), str):
            problem = "single without an upload_url"
        elif kind == "single":
            urls, part_size, num_parts, upload_id = {"1": answer["upload_url"]}, size, 1, None
        else:
            part_size, num_parts, upload_id = answer.get("part_size"), answer.get("num_parts"), answer.get("upload_id")
            entries = answer.get("part_urls") if isinstance(answer.get("part_urls"), list) else []
            urls = {
                str(e.get("part_number")): e.get("upload_url")
                for e in entries
                if isinstance(e, dict) and isinstance(e.get("upload_url"), str)
            }
            if not isinstance(upload_id, str) or not upload_id:
                problem = "multipart without an upload_id"
            elif not (isinstance(part_size, int) and isinstance(num_parts, int) and part_size > 0 and num_parts > 0):
                problem = f"multipart without a positive part_size and num_parts ({part_size!r}, {num_parts!r})"
            elif (num_parts - 1) * part_size >= max(size, 1) or num_parts * part_size < size:
                problem = f"{num_parts} part(s) of {part_size} bytes, which do not tile a file of {size} bytes"
            elif set(urls) != {str(n) for n in range(1, num_parts + 1)}:
                problem = f"part_urls for parts {sorted(urls, key=int)}, not 1..{num_parts}"
        if problem:
            shown = self.credentials.mask(json.dumps(_scrub(answer, lambda s: public_url(s) if "?" in s else s)))
            raise StageError(f"POST ${ENV['url']}{ENDPOINTS['upload_url']} answered {problem}: {shown[:300]}")
        return {
            "version": STATE_VERSION,
            "archive": {"name": self.archive.path.name, "size": size, "sha256": self.archive.sha256},
            "upload_type": kind,
            "s3_key": answer["s3_key"],
            "upload_id": upload_id,
            "part_size": part_size,
            "num_parts": num_parts,
            "urls": urls,
            "urls_issued_at": time.time(),
            "etags": {},
            "uploaded": False,
            "submission_id": None,
            "response": None,
        }

    # the state file

    def save(self, state: dict) -> None:
        # the presigned URLs in it are credentials for two hours: created readable by this user only
        write_json(self.state_file, _scrub(state, self.credentials.mask), mode=0o600)

    def load(self) -> dict | None:
        """The state of an earlier unfinished run on this very archive; None (and a note why) otherwise."""
        if not self.state_file.exists():
            return None
        self.state_file.chmod(0o600)  # an earlier client left it readable by all
        try:
            state = json.loads(self.state_file.read_text())
            valid = (
                state.get("version") == STATE_VERSION
                and state.get("upload_type") in ("single", "multipart")
                and isinstance(state.get("s3_key"), str)
                and isinstance(state.get("urls"), dict)
                and isinstance(state.get("etags"), dict)
                and isinstance(state.get("num_parts"), int)
                and isinstance(state.get("part_size"), int)
                and isinstance(state.get("urls_issued_at"), (int, float))
            )
        except (OSError, ValueError, AttributeError):
            valid = False
        if not valid:
            self.log(f"{self.state_file}: not a state file this client wrote; starting a new upload")
            return None
        mine = {"name": self.archive.path.name, "size": self.archive.size, "sha256": self.archive.sha256}
        if state.get("archive") != mine:
            self.log(f"{self.state_file}: describes another archive; starting a new upload")
            return None
        return _scrub(state, self.credentials.reveal)

    # the flow

    def fresh_urls(self, state: dict | None, why: str) -> dict:
        """Ask upload-url again; keep the finished parts only when the answer is the same upload (module docstring)."""
        self.log(f"{why}: asking {ENV['url']}{ENDPOINTS['upload_url']} for upload URLs")
        fresh = self.upload_answer()
        layout = ("upload_type", "s3_key", "upload_id", "part_size", "num_parts")
        if state is not None and all(state[k] == fresh[k] for k in layout):
            state.update(urls=fresh["urls"], urls_issued_at=fresh["urls_issued_at"])
            if state["etags"]:
                self.log(f"the same upload answered with fresh URLs: the {len(state['etags'])} finished part(s) kept")
            self.save(state)
            return state
        if state is not None and state["etags"]:
            self.log(
                f"the API answered a new upload ({fresh['upload_type']}, s3_key {fresh['s3_key']}, upload_id "
                f"{fresh['upload_id']}): the {len(state['etags'])} part(s) sent to upload {state['upload_id']} "
                "cannot be completed in it, so every part is sent again"
            )
        count = f" in {fresh['num_parts']} parts of {fresh['part_size']} bytes" if fresh["num_parts"] > 1 else ""
        self.log(f"upload: {fresh['upload_type']}, {self.archive.size} bytes{count}, s3_key {fresh['s3_key']}")
        self.save(fresh)
        return fresh

    def urls_stale(self, state: dict) -> bool:
        return time.time() - state["urls_issued_at"] > URL_LIFETIME_S - URL_MARGIN_S

    def put(self, url: str, offset: int, length: int) -> tuple[int, str, str]:
        """PUT bytes [offset, offset + length) to a presigned URL, streamed: (status, ETag, answer text)."""
        reader = _PartReader(self.archive.path, offset, length)
        try:
            status, headers, text = _send("PUT", url, reader, {"Content-Length": str(length)}, self.settings.timeout_s)
        finally:
            reader.close()
        if 200 <= status < 300 and reader.sent != length:  # a success for less than the part is none
            raise ConnectionError(f"the server answered {status} after {reader.sent} of {length} bytes")
        return status, headers.get("etag", ""), text

    def send_parts(self, state: dict) -> dict:
        """PUT every part the state lacks; returns the state (a new one when fresh URLs came with a new upload)."""
        size, failures, refreshes = self.archive.size, 0, 0
        while True:
            missing = [
                r for r in part_ranges(size, state["part_size"], state["num_parts"]) if str(r[0]) not in state["etags"]
            ]
            if not missing:
                return state
            if self.urls_stale(state):
                state = self.fresh_urls(
                    state, f"the upload URLs are near or past their {URL_LIFETIME_S // 3600}-hour life"
                )
                continue
            number, offset, length = missing[0]
            kept = f"{self.state_file} keeps the {len(state['etags'])} finished part(s) of {state['num_parts']}"
            what = (
                f"PUT part {number}/{state['num_parts']} ({length} bytes) to {public_url(state['urls'][str(number)])}"
            )
            begun = time.monotonic()
            try:
                status, etag, text = self.put(state["urls"][str(number)], offset, length)
            except (OSError, http.client.HTTPException) as error:
                status, etag, text = None, "", self.credentials.mask(_reason(error))
            if status is None or status >= 500:
                failures += 1
                reason = f"connection failed ({text})" if status is None else f"answered {status}"
                if failures > self.settings.retries:
                    raise StageError(
                        f"{what}: {reason} after {failures} attempt(s); {kept}: rerun to resume without sending "
                        "them again"
                    )
                self.log(f"{what}: {reason}; retry {failures} of {self.settings.retries}")
                time.sleep(self.backoff(failures))
                continue
            if _expired(status, text):
                refreshes += 1
                if refreshes > self.settings.retries + 1:
                    raise StageError(
                        f"{what}: refused ({status}) again after {refreshes - 1} fresh URL(s): "
                        f"{self.credentials.mask(text[:200]).strip()}; {kept}: rerun to resume"
                    )
                state = self.fresh_urls(state, f"{what}: refused ({status}), the URL has expired")
                continue
            if not 200 <= status < 300:
                raise StageError(f"{what}: answered {status}: {self.credentials.mask(text[:300]).strip()}; {kept}")
            if state["upload_type"] == "multipart" and not etag:
                raise StageError(
                    f"{what}: answered {status} without an ETag header, which complete-upload needs; {kept}"
                )
            failures = refreshes = 0
            state["etags"][str(number)] = etag
            self.save(state)  # atomic: a part is recorded only once the store took all of it
            done = sum(
                length
                for n, _, length in part_ranges(size, state["part_size"], state["num_parts"])
                if str(n) in state["etags"]
            )
            seconds = time.monotonic() - begun
            self.log(
                f"part {number}/{state['num_parts']}: {length} bytes in {seconds:.1f} s "
                f"({length / max(seconds, 1e-6) / 1e6:.1f} MB/s); {done}/{size} bytes "
                f"({100 * done / max(size, 1):.1f}%)"
            )

    def complete(self, state: dict) -> None:
        """Step 4B's completion; a refusal of the parts (4xx other than the key's) leaves no state to trust."""
        parts = [{"part_number": n, "etag": state["etags"][str(n)]} for n in range(1, state["num_parts"] + 1)]
        body = {
            "team_id": self.credentials.team,
            "s3_key": state["s3_key"],
            "upload_id": state["upload_id"],
            "parts": parts,
        }
        try:
            self.call("complete", body)
        except ApiError as error:
            if 400 <= error.status < 500 and error.status not in (401, 403):
                self.state_file.unlink(missing_ok=True)
                raise StageError(f"{error}; {self.state_file} is removed: the next run starts a new upload") from None
            raise StageError(f"{error}; {self.state_file} keeps the upload: rerun to complete it") from None
        self.log(f"upload {state['upload_id']} completed: {len(parts)} part(s), {self.archive.size} bytes")

    def submit(self, state: dict) -> dict:
        keeps = f"the upload is complete ({self.state_file} keeps it): rerun to submit it without uploading again"
        try:
            answer = self.call("submit", {"team_id": self.credentials.team, "s3_key": state["s3_key"]}, retry=False)
        except StageError as error:
            raise StageError(f"{error}; {keeps}") from None
        if not isinstance(answer, dict) or not isinstance(answer.get("submission_id"), (str, int)):
            shown = self.credentials.mask(json.dumps(answer))[:300]
            raise StageError(
                f"POST ${ENV['url']}{ENDPOINTS['submit']} answered without a submission_id: {shown}; {keeps}"
            )
        state.update(submission_id=str(answer["submission_id"]), response=answer)
        self.save(state)  # before the record: a rerun after a crash here never submits twice
        self.log(f"submitted: submission id {state['submission_id']}")
        return state

    def run(self) -> dict:
        started = time.monotonic()
        state = self.load()
        if state is None:
            state = self.fresh_urls(None, "a new upload")
        elif state["submission_id"]:
            self.log(f"{self.state_file}: already submitted as {state['submission_id']}; not submitting again")
        else:
            step = (
                "uploaded, not submitted"
                if state["uploaded"]
                else f"{len(state['etags'])} of {state['num_parts']} part(s) finished"
            )
            self.log(
                f"resuming the {state['upload_type']} upload from {self.state_file}: {step}; finished parts "
                "are not sent again"
            )
        if not state["uploaded"]:
            state = self.send_parts(state)
            if state["upload_type"] == "multipart":
                self.complete(state)
            state["uploaded"] = True
            self.save(state)
        if not state["submission_id"]:
            state = self.submit(state)
        record = {
            "submission_id": state["submission_id"],
            "s3_key": state["s3_key"],
            "upload_type": state["upload_type"],
            "upload_id": state["upload_id"],
            "part_size": state["part_size"],
            "parts": state["num_parts"],
            "file": self.archive.path.name,
            "size": self.archive.size,
            "sha256": self.archive.sha256,
            "seconds": round(time.monotonic() - started, 3),
            "response": state["response"],
        }
        return _scrub(record, self.credentials.mask)  # the s3_key holds the team id; an answer may echo anything


def upload_and_submit(
    archive: Archive, credentials: Credentials, settings: Settings, log: Callable[[str], None] = print
) -> dict:
    """Steps 1 and 3-5 for an archive submittable_archive let through, resuming from the state file; returns the
    record's fields (no variant). The caller removes the state file once the record is written."""
    return Uploader(archive, credentials, settings, log).run()
