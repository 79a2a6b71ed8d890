"""Gather what the device calls brought back (results.tar.gz of each machine) into results/gpu-proof/h100/.

    python3 gpu_proof/collect.py OUT_DIR MACHINE=TARBALL [MACHINE=TARBALL ...]

Each record gets `machine` (the lease it ran on). A later machine's record of a name replaces an earlier
one only when the earlier is not finished (status running); the environment, checkpoint and bandwidth
records of later machines are kept beside the first as <name>-<machine>.json. Logs go to OUT_DIR/logs/
(prefixed with the machine).
"""

import json
import sys
import tarfile
from pathlib import Path

PER_MACHINE = ("environment", "checkpoint", "bandwidth")


def main() -> None:
    out = Path(sys.argv[1])
    (out / "logs").mkdir(parents=True, exist_ok=True)
    for spec in sys.argv[2:]:
        machine, tarball = spec.split("=", 1)
        with tarfile.open(tarball) as archive:
            for member in archive.getmembers():
                if not member.isfile():
                    continue
                name = Path(member.name)
                data = archive.extractfile(member).read()
                if name.parent.name == "logs":
                    (out / "logs" / f"{machine}-{name.name}").write_bytes(data)
                    continue
                record = json.loads(data)
                record["machine"] = machine
                target = out / name.name
                if name.stem in PER_MACHINE and target.exists() and json.loads(target.read_text())["machine"] != machine:
                    target = out / f"{name.stem}-{machine}.json"
                elif target.exists():
                    old = json.loads(target.read_text())
                    if old["machine"] != machine and old["status"] != "running":
                        continue
                target.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
