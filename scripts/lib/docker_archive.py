"""Reading a gzipped docker-archive (image.tar.gz) without a daemon: stdlib only, one streaming pass.

A docker-archive is a tar of: manifest.json ([{Config, RepoTags, Layers}]), the config JSON (env,
entrypoint, labels, rootfs.diff_ids) and one uncompressed tar per layer, named by path in manifest.json (Docker
20.10 writes <id>/layer.tar before manifest.json; newer Docker writes blobs/sha256/<hex>). Because the
manifest may come last, every member is hashed as it streams by and every tar-looking member is listed, and
the checks run once the pass is over: the 3 GB layer is never held in memory or written to disk.

tarball checks the archive it has just written with verify_archive (before its .sha256 exists); the
verify_image stage checks it again as it lies on disk.
"""

import hashlib
import json
import re
import tarfile
import time
from pathlib import Path

from lib.stage import StageError

ENTRYPOINT = ["python3", "-m", "serving"]
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
PORT = "8080/tcp"
REQUIRED_FILES = ["opt/ml/model/config.json", "opt/ml/serve.json", "opt/ml/code/serving/__main__.py"]
CACHE_DIR = "opt/ml/cache/"
MODEL_DIR = "opt/ml/model/"
DRAFT_CONFIG = "opt/ml/draft/config.json"  # a drafted variant's drafter (build_image's draft label names it)
DRAFT_LABEL = "io.qwen35-serve.draft.manifest.sha256"
READ_ONLY_DIRS = (MODEL_DIR, "opt/ml/draft/")
ROOT_USERS = ("", "0", "root")  # an empty config User is root too
# What a leaked credential looks like in an env entry ("KEY=value") or a label; messages name the key only.
SECRET_PATTERNS = {
    "Hugging Face token": re.compile(r"\bhf_[A-Za-z0-9]{20,}"),
    "GitHub token": re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}"),
    "AWS access key id": re.compile(r"\bAKIA[0-9A-Z]{16}\b"),
    "'token='": re.compile(r"token\s*=", re.I),
    "'password'": re.compile(r"passw(or)?d", re.I),
}
_SMALL = 64 << 20  # non-tar members up to this size are kept (manifest, config); bigger ones only hashed
_BUF = 1 << 20


class _Hashing:
    """A read-only stream that hashes (and counts) every byte read from `raw`, each once."""

    def __init__(self, raw):
        self.raw, self.head, self.sha, self.size = raw, b"", hashlib.sha256(), 0

    def _raw(self, n: int) -> bytes:
        data = self.raw.read(n)
        self.sha.update(data)
        self.size += len(data)
        return data

    def peek(self, n: int) -> bytes:
        """The next n bytes, which the following reads serve again."""
        if n > len(self.head):
            self.head += self._raw(n - len(self.head))
        return self.head[:n]

    def read(self, n: int = -1) -> bytes:
        if not self.head:
            return self._raw(n)
        if 0 <= n <= len(self.head):
            data, self.head = self.head[:n], self.head[n:]
            return data
        data, self.head = self.head, b""
        return data + self._raw(-1 if n < 0 else n - len(data))

    def drain(self) -> None:
        while self.read(_BUF):
            pass


def _norm(name: str) -> str:
    while name.startswith("./"):
        name = name[2:]
    return name.lstrip("/")


def _scan_layer(stream: _Hashing) -> dict:
    """Paths of interest in one layer tar (streamed, hashed as it goes)."""
    found = {"files": [], "cache_files": 0, "entries": 0, "model_writable": []}
    with tarfile.open(fileobj=stream, mode="r|", bufsize=_BUF) as layer:
        for entry in layer:
            found["entries"] += 1
            name = _norm(entry.name)
            if (name in REQUIRED_FILES or name == DRAFT_CONFIG) and entry.isfile():
                found["files"].append(name)
            elif name.startswith(CACHE_DIR) and entry.isfile():
                found["cache_files"] += 1
            # the model and drafter are root's and written by nobody else: no unprivileged server user can change them
            if name.startswith(READ_ONLY_DIRS) and not entry.issym() and (entry.uid != 0 or entry.mode & 0o022):
                found["model_writable"].append(f"/{name} (uid {entry.uid}, mode {entry.mode:o})")
    return found


def read_archive(path: str | Path) -> tuple[dict, dict, dict]:
    """One pass over the gzip: (sha256/size of every member, contents of small non-tar members, layer scans),
    plus the archive's own sha256 and sizes under the key None of the first dict."""
    members, small, layers = {}, {}, {}
    with open(path, "rb") as raw_file:
        raw = _Hashing(raw_file)
        try:
            with tarfile.open(fileobj=raw, mode="r|gz", bufsize=_BUF) as archive:
                for member in archive:
                    if not member.isfile():
                        continue
                    name = _norm(member.name)
                    stream = _Hashing(archive.extractfile(member))
                    head = stream.peek(512)
                    if len(head) == 512 and head[257:262] == b"ustar":
                        try:
                            layers[name] = _scan_layer(stream)
                        except tarfile.TarError as error:
                            layers[name] = {"error": str(error)}
                        stream.drain()  # end-of-archive blocks the layer parser stops before
                    elif member.size <= _SMALL:
                        small[name] = stream.read()
                    else:
                        stream.drain()
                    members[name] = {"sha256": stream.sha.hexdigest(), "bytes": stream.size}
        except (tarfile.TarError, OSError, EOFError) as error:  # zlib errors are OSError subclasses here
            raise StageError(f"{path} is not a readable gzipped tar archive: {error}") from error
        raw.drain()
    members[None] = {"sha256": raw.sha.hexdigest(), "bytes": raw.size}
    return members, small, layers


def short_ref(ref: str) -> str:
    """Docker writes RepoTags in their short form (docker.io/library/x:t -> x:t)."""
    for prefix in ("docker.io/library/", "docker.io/"):
        if ref.startswith(prefix):
            return ref[len(prefix) :]
    return ref


def find_secrets(env: list[str], labels: dict[str, str]) -> list[str]:
    """Where something credential-like sits, naming the env variable or label key, never the value."""
    places = [(f"env {entry.partition('=')[0]}", entry) for entry in env]
    places += [(f"label {key}", f"{key}={value}") for key, value in labels.items()]
    return [
        f"{where} looks like it holds a secret ({kind})"
        for where, text in places
        for kind, pattern in SECRET_PATTERNS.items()
        if pattern.search(text)
    ]


def _json(small: dict, name: str, what: str, errors: list[str]):
    if name not in small:
        errors.append(f"{what} {name!r} is not in the archive")
        return None
    try:
        return json.loads(small[name])
    except ValueError as error:
        errors.append(f"{what} {name!r} is not JSON: {error}")
        return None


def _config_problems(settings: dict, expected_labels: dict[str, str], record: dict) -> list[str]:
    """The image config's checks: entrypoint, offline env, port, labels, no secrets, not root. Fills `record`."""
    errors = []
    env = settings.get("Env") or []
    labels = settings.get("Labels") or {}
    record.update(
        entrypoint=settings.get("Entrypoint"),
        env=env,
        labels=labels,
        exposed_ports=sorted(settings.get("ExposedPorts") or {}),
    )
    if settings.get("Entrypoint") != ENTRYPOINT:
        errors.append(f"Entrypoint is {settings.get('Entrypoint')}, expected {ENTRYPOINT}")
    env_map = dict(e.partition("=")[::2] for e in env)
    for key, value in OFFLINE_ENV.items():
        if env_map.get(key) != value:
            errors.append(f"env {key} is {env_map.get(key)!r}, expected {value!r} (the image must run offline)")
    if PORT not in (settings.get("ExposedPorts") or {}):
        errors.append(f"ExposedPorts {record['exposed_ports']} lacks {PORT}")
    for key, value in expected_labels.items():
        if key not in labels:
            errors.append(f"label {key} is missing (expected {value!r})")
        elif labels[key] != value:
            errors.append(f"label {key} is {labels[key]!r}, expected {value!r}")
    errors += find_secrets(env, labels)
    record["user"] = settings.get("User") or ""
    if record["user"].partition(":")[0] in ROOT_USERS:
        errors.append(
            f"the server runs as root (config User {record['user']!r}); the Dockerfile's USER names the unprivileged "
            "server user"
        )
    return errors


def _layer_problems(image: dict, entry: dict, members: dict, layers: dict, record: dict) -> list[str]:
    """Each layer the manifest lists: present, its digest the config's diff_id, a readable tar whose model files the
    server user cannot change; then the files the image must hold. Fills `record`."""
    errors = []
    diff_ids = (image.get("rootfs") or {}).get("diff_ids") or []
    layer_paths = [_norm(p) for p in entry.get("Layers") or []]
    if image and len(diff_ids) != len(layer_paths):
        errors.append(f"manifest lists {len(layer_paths)} layers but the config has {len(diff_ids)} diff_ids")
    record["layers"], files, cache_files = [], {}, 0
    for index, (layer, diff_id) in enumerate(zip(layer_paths, diff_ids, strict=False)):
        if layer not in members:
            errors.append(f"layer {index} ({layer}) is not in the archive")
            continue
        digest = f"sha256:{members[layer]['sha256']}"
        record["layers"].append({"path": layer, "diff_id": diff_id, "bytes": members[layer]["bytes"]})
        if digest != diff_id:
            errors.append(
                f"layer {index} ({layer}) has digest {digest}, but the config's diff_id is {diff_id} "
                "(corrupted, or not an uncompressed layer tar)"
            )
        scan = layers.get(layer, {"error": "not a tar"})
        if "error" in scan:
            errors.append(f"layer {index} ({layer}) is not a readable tar: {scan['error']}")
            continue
        files.update({name: index for name in scan["files"]})
        cache_files += scan["cache_files"]
        if scan["model_writable"]:
            shown = scan["model_writable"][:5]
            errors.append(
                f"layer {index} ({layer}) has {len(scan['model_writable'])} entries under /{MODEL_DIR} that the "
                f"server user could change, e.g. {', '.join(shown)} (the model must be root's and not group- or "
                "other-writable)"
            )
    record["files"], record["cache_files"] = files, cache_files
    for name in REQUIRED_FILES:
        if name not in files:
            errors.append(f"/{name} is in no layer")
    if record["labels"].get(DRAFT_LABEL, "none") != "none" and DRAFT_CONFIG not in files:
        errors.append(f"the image is labelled with a drafter ({DRAFT_LABEL}) but /{DRAFT_CONFIG} is in no layer")
    if cache_files == 0:
        errors.append(f"no file under /{CACHE_DIR} in any layer (the compile cache was not baked in)")
    return errors


def verify_archive(
    path: str | Path, expected_ref: str, expected_labels: dict[str, str], image_id: str | None = None
) -> dict:
    """Check the archive; return its record, or raise StageError listing every check that failed."""
    started = time.monotonic()
    members, small, layers = read_archive(path)
    errors: list[str] = []
    record = {"archive": str(path), "archive_sha256": members[None]["sha256"], "archive_bytes": members[None]["bytes"]}
    manifest = _json(small, "manifest.json", "manifest", errors)
    if manifest is not None:
        if not isinstance(manifest, list) or len(manifest) != 1:
            errors.append(f"manifest.json should describe exactly one image, not {len(manifest or [])}")
            manifest = None
    if manifest is None:
        raise StageError(f"{path} failed verification:\n  - " + "\n  - ".join(errors))
    entry = manifest[0]
    tags = entry.get("RepoTags") or []
    record["repo_tags"] = tags
    if [short_ref(t) for t in tags] != [short_ref(expected_ref)]:
        errors.append(f"RepoTags are {tags}, expected exactly [{short_ref(expected_ref)!r}]")
    config_name = _norm(entry.get("Config", ""))
    image = _json(small, config_name, "image config", errors) or {}
    if config_name in members:
        record["image_id"] = f"sha256:{members[config_name]['sha256']}"
        if image_id and record["image_id"] != image_id:
            errors.append(f"image config digest {record['image_id']} is not the built image's id {image_id}")
    errors += _config_problems(image.get("config") or {}, expected_labels, record)
    errors += _layer_problems(image, entry, members, layers, record)
    record["seconds"] = round(time.monotonic() - started, 1)
    if errors:
        raise StageError(f"{path} failed verification:\n  - " + "\n  - ".join(errors))
    return record


GPU_ARCH_LABEL = "io.qwen35-serve.gpu_arch"


def gpu_arch_problems(labels: dict[str, str], gpu_arch: str | None, allow_mismatch: bool) -> list[str]:
    """The image's GPU-architecture label (what its compile cache was baked for) against the config's
    image.gpu_arch: missing is an error; another architecture is one unless image.allow_arch_mismatch."""
    found = labels.get(GPU_ARCH_LABEL)
    if not found:
        return [
            f"label {GPU_ARCH_LABEL} is missing (an image built before it was labelled; rerun with `-R build_image`)"
        ]
    if gpu_arch is not None and found != gpu_arch and not allow_mismatch:
        return [
            f"label {GPU_ARCH_LABEL} is {found!r} but image.gpu_arch is {gpu_arch!r}: its compile cache is for "
            "another GPU (rebuild on the right one, or set image.allow_arch_mismatch: true to accept it)"
        ]
    return []


def load_image_record(path: str) -> dict:
    """build_image's record of the image, which every archive check compares against."""
    image = json.loads(Path(path).read_text())
    if not image.get("labels"):
        raise StageError(f"{path} records no labels (built before labels existed); rerun with `-R build_image`")
    return image
