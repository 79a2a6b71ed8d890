"""A local stand-in of the Hugging Face Hub's download endpoints, for huggingface_hub pointed at it by HF_ENDPOINT.

It answers what huggingface_hub (1.x: snapshot_download, hf_hub_download, HfApi.list_repo_tree) asks the hub, the way
huggingface.co answers:

- `GET /api/{models|datasets}/<repo>/tree/<revision>[/<path>]?recursive=...`: the tree listing, one JSON object per
  file (`type: file`, `path`, `size`, `oid` = git blob sha1, and for an LFS file `lfs: {oid: sha256, size,
  pointerSize}` with `oid` then the pointer file's blob sha1) and per folder (`type: directory`).
- `HEAD|GET /<repo>/resolve/<revision>/<path>` (`/datasets/<repo>/...` for a dataset), with `X-Repo-Commit`: a small
  file answers 200 with `ETag` = its blob sha1 and its bytes; an LFS file answers 302 to the storage host (`Location`),
  with `X-Linked-Etag` = its sha256 and `X-Linked-Size`, as the hub redirects LFS downloads to its CDN.
- `HEAD|GET /lfs/<sha256>` on the storage host: the bytes. The storage host is `localhost`, the hub `127.0.0.1` (the
  same server): huggingface_hub follows a redirect on the hub's own host but reads the file's metadata from the
  redirect itself when it leads elsewhere, as it does for the real CDN.
- Unknown repository, revision or file: 404 with the hub's `X-Error-Code` (RepoNotFound, RevisionNotFound,
  EntryNotFound), which huggingface_hub turns into its own errors.

What is listed is computed from each file's true bytes; `serve_instead` makes the server send other bytes for a file
than the listing's hashes describe (a corrupted download). Every request is kept in `requests`; any other path is
answered 404 and kept in `unexpected`.
"""

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import PurePosixPath
from urllib.parse import parse_qs, unquote, urlsplit

LFS_POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n"


def git_blob_sha1(data: bytes) -> str:
    """`git hash-object` of these bytes: sha1 of "blob <size>\\0" + bytes."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class Repo:
    def __init__(self, repo_type: str, repo_id: str, commit: str, files: dict[str, bytes], lfs: set[str]):
        self.repo_type, self.repo_id, self.commit = repo_type, repo_id, commit
        self.files, self.lfs = dict(files), set(lfs)
        self.served: dict[str, bytes] = {}  # path -> bytes sent instead of the listed ones

    def entry(self, path: str) -> dict:
        data = self.files[path]
        if path not in self.lfs:
            return {"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": path}
        sha256 = hashlib.sha256(data).hexdigest()
        pointer = LFS_POINTER.format(sha256=sha256, size=len(data)).encode()
        return {
            "type": "file",
            "oid": git_blob_sha1(pointer),
            "size": len(data),
            "path": path,
            "lfs": {"oid": sha256, "size": len(data), "pointerSize": len(pointer)},
        }

    def tree(self, under: str, recursive: bool) -> list[dict]:
        folders: set[str] = set()
        for path in self.files:
            folders.update(str(parent) for parent in PurePosixPath(path).parents if str(parent) != ".")
        entries = [self.entry(path) for path in sorted(self.files)]
        entries += [{"type": "directory", "oid": git_blob_sha1(f.encode()), "size": 0, "path": f} for f in folders]
        inside = [e for e in entries if not under or e["path"].startswith(under + "/")]
        depth = under.count("/") + 1 if under else 0
        return inside if recursive else [e for e in inside if e["path"].count("/") == depth]

    def info(self) -> dict:
        """What `HfApi.repo_info` / `dataset_info` reads at a revision: the commit and the file names."""
        return {
            "id": self.repo_id,
            "sha": self.commit,
            "private": False,
            "disabled": False,
            "gated": False,
            "siblings": [{"rfilename": path} for path in sorted(self.files)],
            "tags": [],
        }

    def body(self, path: str) -> bytes:
        return self.served.get(path, self.files[path])


class StandinHub:
    """`with StandinHub() as hub: hub.add(...)`; `hub.endpoint` is what HF_ENDPOINT should say."""

    def __init__(self):
        self.repos: dict[tuple[str, str], Repo] = {}
        self.requests: list[tuple[str, str, str]] = []  # (method, host, path with query)
        self.unexpected: list[str] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        port = self._server.server_address[1]
        self.endpoint, self.storage = f"http://127.0.0.1:{port}", f"http://localhost:{port}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def add(self, repo_id: str, commit: str, files: dict[str, bytes], lfs=(), repo_type: str = "model") -> Repo:
        repo = Repo(repo_type, repo_id, commit, files, set(lfs))
        self.repos[(repo_type, repo_id)] = repo
        return repo

    def serve_instead(self, repo_id: str, path: str, data: bytes, repo_type: str = "model") -> None:
        self.repos[(repo_type, repo_id)].served[path] = data

    # --- routing ------------------------------------------------------------------------------------------

    def _lookup(self, repo_type: str, parts: list[str], marker: str):
        """For <owner>/<name>/<marker>/<revision>/<rest...>: (repo, rest, None), or (None, None, a 404 answer) for an
        unknown repository or revision; None when the path is not of that form."""
        if len(parts) < 4 or parts[2] != marker:
            return None
        repo = self.repos.get((repo_type, "/".join(parts[:2])))
        if repo is None:
            return None, None, self._not_found("RepoNotFound", None)
        if parts[3] not in (repo.commit, "main"):
            return None, None, self._not_found("RevisionNotFound", None)
        return repo, "/".join(parts[4:]), None

    def route(self, method: str, host: str, target: str):
        """(status, headers, body) for one request."""
        url = urlsplit(target)
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        if parts[0] == "lfs" and len(parts) == 2 and method in ("GET", "HEAD"):  # the storage host
            for repo in self.repos.values():
                for path in repo.lfs:
                    if hashlib.sha256(repo.files[path]).hexdigest() == parts[1]:
                        data = repo.body(path)
                        return 200, {"Content-Length": str(len(data)), "ETag": f'"{parts[1]}"'}, data
        elif parts[0] == "api" and len(parts) > 1 and parts[1] in ("models", "datasets") and method == "GET":
            info = self._lookup(parts[1][:-1], parts[2:], "revision")
            if info:
                repo, _, error = info
                return error or self._json(repo.info())
            found = self._lookup(parts[1][:-1], parts[2:], "tree")
            if found:
                repo, under, error = found
                if error:
                    return error
                recursive = parse_qs(url.query).get("recursive", ["false"])[0].lower() in ("true", "1")
                return self._json(repo.tree(under, recursive))
        elif method in ("GET", "HEAD"):
            repo_type, rest = ("dataset", parts[1:]) if parts[0] == "datasets" else ("model", parts)
            found = self._lookup(repo_type, rest, "resolve")
            if found:
                repo, path, error = found
                if error:
                    return error
                if path not in repo.files:
                    return self._not_found("EntryNotFound", repo.commit)
                return self._resolve(repo, path)
        self.unexpected.append(f"{method} {host}{target}")
        return self._not_found(None, None)

    def _resolve(self, repo: Repo, path: str):
        entry = repo.entry(path)
        headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{entry["oid"]}"'}
        if "lfs" in entry:  # redirected to the storage host, the file's own hash and size on the redirect
            sha256 = entry["lfs"]["oid"]
            headers.update(
                {
                    "Location": f"{self.storage}/lfs/{sha256}",
                    "X-Linked-Etag": f'"{sha256}"',
                    "X-Linked-Size": str(entry["size"]),
                    "Content-Length": "0",
                }
            )
            return 302, headers, b""
        data = repo.body(path)
        return 200, {**headers, "Content-Length": str(len(data))}, data

    @staticmethod
    def _json(data) -> tuple[int, dict, bytes]:
        body = json.dumps(data).encode()
        return 200, {"Content-Type": "application/json", "Content-Length": str(len(body))}, body

    @staticmethod
    def _not_found(code, commit):
        headers = {"Content-Length": "0"}
        if code:
            headers["X-Error-Code"] = code
        if commit:
            headers["X-Repo-Commit"] = commit
        return 404, headers, b""

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, send_body: bool):
                host = self.headers.get("Host", "")
                hub.requests.append((self.command, host.split(":")[0], self.path))
                status, headers, body = hub.route(self.command, host, self.path)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                if send_body and body:
                    self.wfile.write(body)

            def do_GET(self):
                self._answer(True)

            def do_HEAD(self):
                self._answer(False)

            def log_message(self, *args):
                pass

        return Handler


def run_stage_script(python, script, job: dict, hub: StandinHub, workdir, extra_env=None, timeout=300):
    """A stage script as run_stage re-runs it in its venv (`--job`), with huggingface_hub pointed at the stand-in:
    no token, not offline, its own HF_HOME under workdir."""
    import os
    import subprocess
    from pathlib import Path

    workdir = Path(workdir)
    scripts = Path(script).resolve().parent
    job_file = workdir / f"{Path(script).stem}-{len(list(workdir.glob('*.job.json')))}.job.json"
    job_file.write_text(json.dumps(job))
    env = {key: value for key, value in os.environ.items() if not key.startswith("HF_")}
    env.update(
        PYTHONPATH=str(scripts),
        HF_ENDPOINT=hub.endpoint,
        HF_HOME=str(workdir / "hf-home"),
        HF_HUB_DISABLE_TELEMETRY="1",
        NO_PROXY="127.0.0.1,localhost",
        **(extra_env or {}),
    )
    return subprocess.run(
        [str(python), str(script), "--job", str(job_file)],
        env=env,
        cwd=scripts.parent,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
