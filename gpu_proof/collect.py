"""Gather what the device calls brought back (results.tar.gz of each machine) into results/gpu-proof/h100/.

    python3 gpu_proof/collect.py OUT_DIR MACHINE=TARBALL [MACHINE=TARBALL ...]

Each record gets `machine` (the lease it ran on). A later machine's record of a name replaces an earlier
one only when the earlier is not finished (status running); the environment, checkpoint and bandwidth
records of later machines are kept beside the first as <name>-<machine>.json. Logs go to OUT_DIR/logs/
(prefixed with the machine).

A variant probed while its machine had no checkpoint or bandwidth record yet gets its decode analysis here,
from that machine's own records, by the driver's decode_bound (the record says so in decode.filled_by).
py-spy's raw stacks (results/spy/, gzipped) go to OUT_DIR/spy/; a spied variant whose breakdowns are missing (the
driver failed after keeping them) gets them here by spy_breakdown, the step time from its varied set's ITL when
the spied request's own was not recorded (spy.filled_by says so). Stacks of a spied request that ended inside the
windows are dropped: they picture no step.
"""

import gzip
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


def fill_missing_spy(out: Path) -> list[str]:
    """spy_breakdown's windows for spied variants that have the raw stacks but not the breakdowns."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "gpu_proof"))
    from driver import SHORT_SPY_REQUEST, SPY
    from gpu_proof.spy_breakdown import WINDOWS, window_breakdowns

    filled = []
    for path in sorted(out.glob("variant-*.json")):
        record = json.loads(path.read_text())
        spy = record.get("spy")
        raws = {w: out / "spy" / f"{record['variant']}-{w}.txt.gz" for w in WINDOWS}
        if spy and spy.get("error", "").startswith(SHORT_SPY_REQUEST):
            # windows that span the request's end picture no step (machine30's driver still kept them)
            for raw in raws.values():
                raw.unlink(missing_ok=True)
            continue
        if not spy or all(w in spy for w in WINDOWS) or not all(raw.exists() for raw in raws.values()):
            continue
        if "step_ms" not in spy:  # the driver failed before the request's figures were kept
            varied = record["probe"]["varied"]["categories"]
            itl = sum(c["itl_median_ms"] for c in varied) / len(varied)
            spy["step_ms"] = round(itl * (record["probe"]["varied"].get("mean_acceptance_length") or 1.0), 3)
            spy["step_ms_source"] = "the variant's varied set: mean of its categories' median ITL x mean acceptance"
        rate = (spy.setdefault("settings", dict(SPY)))["rate_hz"]
        spy.update(window_breakdowns(raws, rate, spy["step_ms"]), raw={w: f"spy/{raws[w].name}" for w in WINDOWS})
        spy["filled_by"] = "gpu_proof/collect.py: spy_breakdown over the kept raw stacks"
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
                if name.parent.name == "spy":
                    (out / "spy").mkdir(exist_ok=True)
                    if name.suffix != ".gz":
                        data, name = gzip.compress(data, mtime=0), name.with_name(name.name + ".gz")
                    (out / "spy" / name.name).write_bytes(data)
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
    for stem in fill_missing_spy(out):
        print(f"{stem}: py-spy breakdowns filled from its kept raw stacks")


if __name__ == "__main__":
    main()
