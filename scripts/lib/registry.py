"""A registry image pulled into Docker's store, and the digest the registry answered for it (pull_base, tools/lock.py).
Kept out of lib/dag/lock.py: a stage that only reads the lock (download_datasets) does not import Docker's plumbing."""

import re

from lib.containers import run
from lib.dag import lock
from lib.stage import StageError


def pull_image(ref: str) -> str:
    """`docker pull ref`; the digest the registry answered (its `Digest:` line, else the image's one RepoDigest of that
    repository)."""
    out = run(["docker", "pull", ref], what=f"docker pull {ref}")
    answered = re.findall(r"^Digest: (sha256:[0-9a-f]{64})\s*$", out, re.M)
    if answered:
        return answered[-1]
    repository, _, _ = lock.parse_image(ref)
    listed = run(["docker", "image", "inspect", "-f", "{{range .RepoDigests}}{{println .}}{{end}}", ref])
    digests = {d.split("@", 1)[1] for d in listed.split() if "@" in d and lock.parse_image(d)[0] == repository}
    if len(digests) != 1:
        raise StageError(
            f"docker pull {ref} named no digest, and the image's RepoDigests for {repository} are "
            f"{sorted(digests) or 'none'}: cannot tell which one the registry answered"
        )
    return digests.pop()
