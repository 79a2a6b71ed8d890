"""Gather what the device calls brought back (results.tar.gz of each machine) into results/gpu-proof/h100/.

    python3 gpu_proof/collect.py OUT_DIR MACHINE=TARBALL [MACHINE=TARBALL ...]

Each record gets `machine` (the lease it ran on). A later machine's record of a name replaces an earlier
one only when the earlier is not finished (status running); the environment, checkpoint and bandwidth
records of later machines are kept beside the first as <name>-<machine>.json. Logs go to OUT_DIR/logs/
(prefixed with the machine).

A variant probed while its machine had no checkpoint or bandwidth record yet gets its decode analysis here,
from that machine's own records, by the driver's decode_bound (the record says so in decode.filled_by).
"""

import json
import sys
import tarfile
from pathlib import Path

PER_MACHINE = ("environment", "checkpoint", "bandwidth")
ROOT = Path(__file__).resolve().parents[1]


def machine_record(out: Path, stem: str, machine: str) -> dict | None:
    for path in (out / f"{stem}.json", out / f"{stem}-{machine}.json"):
        if path.exists() and json.loads(path.read_text()).get("machine") == machine:
            return json.loads(path.read_text())
    return None


def fill_missing_decode(out: Path) -> list[str]:
    """Decode analysis for probed variants that lack it, from the same machine's checkpoint and bandwidth."""
    sys.path.insert(0, str(ROOT / "gpu_proof"))
    from driver import decode_bound, draft_passes

    filled = []
    for path in sorted(out.glob("variant-*.json")):
        record = json.loads(path.read_text())
        if record.get("decode") is not None or not record.get("probe"):
            continue
        checkpoint = machine_record(out, "checkpoint", record["machine"])
        bandwidth = machine_record(out, "bandwidth", record["machine"])
        if checkpoint is None or bandwidth is None:
            continue
        decode = decode_bound(
            record["weights"],
            draft_passes(record["speculative"]),
            bandwidth["copy_gbps"],
            checkpoint["text_config"],
            record["probe"]["categories"],
        )
        decode["bandwidth_source"] = f"{record['machine']}'s bandwidth record, copy_gbps"
        decode["filled_by"] = (
            f"gpu_proof/collect.py: driver.decode_bound with {record['machine']}'s checkpoint and bandwidth records"
        )
        record["decode"] = decode
        path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        filled.append(path.stem)
    return filled


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
                if (
                    name.stem in PER_MACHINE
                    and target.exists()
                    and json.loads(target.read_text())["machine"] != machine
                ):
                    target = out / f"{name.stem}-{machine}.json"
                elif target.exists():
                    old = json.loads(target.read_text())
                    if old["machine"] != machine and old["status"] != "running":
                        continue
                target.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    for stem in fill_missing_decode(out):
        print(f"{stem}: decode analysis filled from its machine's records")


if __name__ == "__main__":
    main()
