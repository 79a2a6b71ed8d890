"""Pull the real profile's base image from its registry, at the digest the lock holds for its tag.

image.base names the base by tag (or tag@digest: a pin). What the registry answers for it is checked against the tag's
lock entry (lib/dag/lock.py): a filled entry must hold the same digest, else the tag moved and the stage fails naming
both; an empty entry is filled with it once the image is in Docker's store and its record written. bake_compile_cache
and build_image start from the record: <registry>/<repository>:<tag>@<digest>, which any store pulls again as exactly
that image. With image.allow_unpinned_base the tag is pulled and recorded here, and no lock entry is read or written.
"""

from pathlib import Path

from lib import registry
from lib.dag import lock
from lib.progress import Heartbeat, elapsed
from lib.stage import StageError, write_json


def resolve(base: str, entry: lock.Entry | None) -> str:
    """Pull `base`; the digest the registry answered, checked against the pin `base` names and against `entry`."""
    _, _, pinned = lock.parse_image(base)
    with Heartbeat(lambda seconds: f"[pull_base] docker pull {base}: {elapsed(seconds)}"):
        digest = registry.pull_image(base)
    if pinned and digest != pinned:
        raise StageError(f"docker pull {base} answered the digest {digest}, not the one it names")
    if entry is not None:
        lock.check(entry, digest, f"docker pull {base}", pinned, "image.base")
    return digest


def main(job) -> None:
    from lib.containers import detect_builder, image_id

    detect_builder("docker")  # bake_compile_cache serves in the base: it must be in Docker's store
    entries = lock.read_entries(job.input.lock)
    entry = entries[0] if entries else None
    digest = resolve(job.params.base, entry)
    repository, tag, _ = lock.parse_image(job.params.base)
    ref = f"{repository}:{tag}@{digest}" if tag else f"{repository}@{digest}"
    record = {
        "ref": ref,
        "digest": digest,
        "id": image_id(ref, "docker"),
        "builder": "docker",
        "lock": str(entry.path) if entry else None,
    }
    write_json(job.output.image, record)
    if entry is not None:
        for written in lock.record([(entry, digest)]):
            print(f"pull_base: recorded {written.name} -> {digest} in {written.path}")
    print(f"pull_base: {ref} ({record['id']})" + (f", as {Path(entry.path)} holds" if entry else ", not locked"))


if __name__ == "__main__":
    from lib.stage import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
