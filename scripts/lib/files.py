"""File copying for large trees that are only read afterwards."""

import os
import shutil


def link_or_copy(src: str, dst: str) -> None:
    """A hard link where the filesystem allows one (no copy of GBs of weights or site-packages), else a copy.
    Only for trees that are read, never written, afterwards: a link shares its bytes with the source."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
