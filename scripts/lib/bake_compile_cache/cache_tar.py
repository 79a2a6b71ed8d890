"""A compile cache packed so that the same files give the same bytes (the image's layer, and its ID, follow)."""

import tarfile
from pathlib import Path


def deterministic_tar(source: Path, tar_path: Path) -> dict:
    """Tar `source` sorted, with zeroed owners and times, so the same cache gives the same bytes."""
    partial = tar_path.with_name(tar_path.name + ".partial")
    files = bytes_total = 0

    def normalise(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = 0
        return info

    with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as archive:
        for path in sorted(source.rglob("*")):
            archive.add(path, arcname=str(path.relative_to(source)), recursive=False, filter=normalise)
            if path.is_file():
                files += 1
                bytes_total += path.stat().st_size
    partial.replace(tar_path)
    return {"files": files, "bytes": bytes_total}
