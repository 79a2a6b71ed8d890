"""Turn what a lease brought back (the driver's results.tar.gz) into the committed records: small, schema-checked,
one folder per GPU model (records/gpu-proof/<gpu>/), one file per host and variant.

    python3 gpu_proof/collect.py RESULTS_TAR_GZ HOST [--out records/gpu-proof] [--floor FLOOR_JSON ...]
    python3 gpu_proof/collect.py - HOST --floor FLOOR_JSON ... [--gpu NAME --cpu NAME --date YYYY-MM-DD]
        (a lease that ran floor.py alone: the floors' own GPU, CPU and date, or the ones given)

The driver's records keep every token id and every run's latency (the lossless step needs them on the host); what
the generated tables cite is each category's summary per prompt set, the lossless verdict per row, and the host.
Logs, token ids, logprobs, profiler traces and unfinished variants stay out.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tarfile
from pathlib import Path

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "schemas" / "gpu-proof.schema.yaml"
RECORDS = ROOT / "records" / "gpu-proof"  # committed, apart from results/ (a run's outputs, ignored)
SETS = ("repeated", "varied", "fresh")
CATEGORY_FIELDS = ("name", "prompt_tokens", "output_tokens_mean", "median_ms", "p90_ms", "ttft_median_ms")
CATEGORY_FIELDS += ("itl_median_ms", "mean_acceptance_length")
CONTEXT = ("date", "gpu", "engine", "weights")  # what every record but the environment's takes from its run


def compact_floor(record: dict) -> dict:
    """What the tables cite of a gpu_proof/floor.py record: its decode step and, with --ab, each pass's median first
    step a prompt length, whether every token's id and logprob was equal, and the profiled step's summary."""
    kept = {key: record[key] for key in ("variant", "step_median_ms", "tokens", "runs")}
    kept |= {"config": record.get("config", "config.yaml")} | (
        {"options": record["options"]} if record.get("options") else {}
    )
    if "ab" in record:
        passes = record["passes"]
        kept |= {"ab": record["ab"], "same": {n: all(same.values()) for n, same in record["same"].items()}}
        kept["prefill_ms"] = {
            label: {n: entry["first_step_median_ms"] for n, entry in result["lengths"].items()}
            for label, result in passes.items()
        }
        if all("profile" in result for result in passes.values()):
            kept["profile"] = {label: result["profile"] for label, result in passes.items()}
    return kept


def gpu_model(name: str) -> str:
    """The folder a GPU's records go to: 'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA A10G' -> 'a10g'."""
    model = re.search(r"\b[A-Z]+[0-9]+[A-Z]?\b", name)
    return (model.group(0) if model else name.split()[-1]).lower()


def compact_sets(probe: dict) -> dict:
    """Each probed prompt set's summary: the competition-style set is the probe's top level, the others nested."""
    sets = {}
    for set_name in SETS:
        probed = probe if set_name == "repeated" else probe.get(set_name)
        if probed and probed.get("categories"):
            categories = [{key: category.get(key) for key in CATEGORY_FIELDS} for category in probed["categories"]]
            sets[set_name] = {"mean_speedup": probed.get("mean_speedup"), "categories": categories}
    return sets


def compact_variant(record: dict, host: str, environment: dict) -> dict:
    """What the tables cite of a probed variant; `resident_servers` only where its driver counted them."""
    kept = {key: record[key] for key in ("variant", "recipe", "speculative", "serve", "cold_start")}
    kept |= {key: record[key] for key in ("warm_start", "host_busy", "resident_servers") if key in record}
    kept |= {"config": record.get("config", "config.yaml"), "options": record.get("options") or {}}
    # an older tree's driver kept the bytes in its decode analysis
    kept["bytes_per_step"] = record.get("bytes_per_step") or (record.get("decode") or {}).get("weights_bytes_per_step")
    probe = record["probe"]
    kept |= {"warmup": probe["warmup"], "runs": probe["runs"], "sets": compact_sets(probe)}
    if record.get("alone"):  # --alone: probed again with its group stopped
        alone = record["alone"]
        kept["alone"] = {"resident_servers": alone["resident_servers"], "sets": compact_sets(alone["probe"])}
    return {"kind": "variant", "host": host, **{key: environment[key] for key in CONTEXT}, **kept}


# what a run may change that bears on a lossless verdict (not a shared GPU's memory split)
CHECKED = ("serve_set", "patches", "drafter")


def compact_lossless(record: dict, host: str, environment: dict, options: dict | None = None) -> dict:
    """The checks, each with what its variant's run changed from the catalog (`options`: by variant)."""
    keep = ("set", "category", "tokens", "passed", "problem")
    checks = []
    for check in record["checks"]:
        if check.get("reference_variant") is None:  # nothing was compared (the driver's failures say why): no verdict
            why = "; ".join(check.get("failures", []))
            print(f"collect: {check['variant']} left out of the lossless record: {why}")
            continue
        rows = []
        for row in check["rows"]:
            where = {"first_difference": (row["first_difference"] or {}).get("position")}
            where["near_tie_nats"] = (row["near_tie"] or {}).get("margin")
            rows.append({key: row[key] for key in keep} | where)
        kept = {key: check[key] for key in ("variant", "reference_variant", "passed", "canary") if key in check}
        changed = {key: value for key, value in (options or {}).get(check["variant"], {}).items() if key in CHECKED}
        checks.append(kept | ({"options": changed} if changed else {}) | {"rows": rows})
    return {"kind": "lossless", "host": host, **{key: environment[key] for key in CONTEXT}, "checks": checks}


def collect(
    tarball: Path,
    host: str,
    out_root: Path,
    note: str | None = None,
    run: str | None = None,
    host_busy: bool = False,
    floors: list[str] = (),
    given: dict | None = None,
) -> list[Path]:
    """The lease's records; `run` names one of several drivers on the host (its file names carry it, so two drivers'
    records of one variant, e.g. with and without a setting, both stay); `host_busy` marks variants probed while
    other servers started on the host; `floors` are floor.py records made on the same host."""
    if tarball is None:  # floor.py alone on the host: no driver's records, the floors' own environment
        return collect_floors(host, out_root, note, floors, given or {})
    with tarfile.open(tarball) as archive:
        raw = {
            Path(member.name).stem: json.load(archive.extractfile(member))
            for member in archive.getmembers()
            if member.isfile() and member.name.count("/") == 1 and member.name.endswith(".json")
        }
    environment, bandwidth = raw["environment"], raw.get("bandwidth") or {}
    summary = {"kind": "environment", "host": host, "date": environment["date"], "gpu": environment["gpu"]["name"]}
    summary |= {"cpu": environment["cpu"], "vllm": environment["versions"]["vllm_bundle"]["vllm"]}
    summary["copy_gbps"] = bandwidth.get("copy_gbps")
    # what the variants were measured with: the vLLM release, and a trained checkpoint (--checkpoint) or random weights
    context = {
        "engine": summary["vllm"].split("+", 1)[0],
        "weights": "trained" if (raw.get("checkpoint") or {}).get("builder", "").startswith("given") else "random",
    }
    records = {"environment": summary}
    for name, record in raw.items():
        if name.startswith("variant-") and record.get("status") == "ok":
            records[record["variant"]] = compact_variant(record, host, summary | context)
        elif name == "lossless":
            options = {r["variant"]: r.get("options") or {} for n, r in raw.items() if n.startswith("variant-")}
            lossless = compact_lossless(record, host, summary | context, options)
            if lossless["checks"]:
                records["lossless"] = lossless
        elif name.startswith("floor-") and record.get("status") == "ok":  # gpu_proof/floor.py's
            variant = name.removeprefix("floor-")
            floor = {"kind": "floor", "host": host, **{key: (summary | context)[key] for key in CONTEXT}}
            config = (raw.get(f"variant-{variant}") or {}).get("config", "config.yaml")
            runs = {"runs": len(record["runs"])} if isinstance(record["runs"], list) else {}  # an older floor.py's
            records[name] = floor | compact_floor({"variant": variant, "config": config} | record | runs)
    for path in floors:  # floor.py run beside the driver on this host: its own variant, catalog and weights
        record = json.loads(Path(path).read_text())
        if record.get("status") == "ok":
            floor = {"kind": "floor", "host": host, **{key: (summary | context)[key] for key in CONTEXT}}
            records[f"floor-{Path(path).stem}"] = floor | {"weights": record["weights"]} | compact_floor(record)
    for record in records.values():
        if note and record["kind"] in ("variant", "lossless", "floor"):  # the run's conditions (the tables show it)
            record["note"] = note
        if host_busy and record["kind"] == "variant":
            record["host_busy"] = True
    return write(
        records, out_root / gpu_model(summary["gpu"]), f"{host}-vllm{context['engine']}-{f'{run}-' if run else ''}"
    )


def write(records: dict, out: Path, prefix: str) -> list[Path]:
    """Each record schema-checked, then written as <prefix><name>.json."""
    schema = yaml.safe_load(SCHEMA.read_text())
    for record in records.values():
        jsonschema.validate(record, schema)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, record in records.items():
        path = out / f"{prefix}{name}.json"
        path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        written.append(path)
    return written


def collect_floors(host: str, out_root: Path, note: str | None, floors: list[str], given: dict) -> list[Path]:
    """floor.py's records of a lease that ran no driver: each one's GPU, CPU and date from its own `environment`
    (given: --gpu, --cpu, --date, for a floor.py that did not record it), its engine from its vLLM."""
    if not floors:
        raise SystemExit("no driver results (-) and no --floor: nothing to collect")
    records, engines = {}, set()
    for path in floors:
        record = json.loads(Path(path).read_text())
        if record.get("status") != "ok":
            continue
        environment = given | (record.get("environment") or {})
        missing = [key for key in ("gpu", "cpu", "date") if not environment.get(key)]
        if missing:
            raise SystemExit(f"{path}: no {missing} in its record: give --{' --'.join(missing)}")
        vllm = record["vllm"]
        context = {"host": host, "date": environment["date"], "gpu": environment["gpu"]}
        context["engine"] = vllm.split("+", 1)[0]
        engines.add(context["engine"])
        records[f"floor-{Path(path).stem}"] = (
            {"kind": "floor", **context, "weights": record["weights"]}
            | compact_floor(record)
            | ({"note": note} if note else {})
        )
    if len(engines) != 1:
        raise SystemExit(f"floors of {sorted(engines) or 'no'} engines: collect one engine's floors at a time")
    records["environment"] = {"kind": "environment", "host": host, "date": environment["date"], "vllm": vllm}
    records["environment"] |= {"gpu": environment["gpu"], "cpu": environment["cpu"]}
    records["environment"]["copy_gbps"] = None  # no driver: no bandwidth step
    return write(records, out_root / gpu_model(environment["gpu"]), f"{host}-vllm{context['engine']}-")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tarball", help="the driver's results.tar.gz; - where floor.py ran alone (--floor only)")
    parser.add_argument("host", help="a name for the lease's machine, unique among the committed records")
    parser.add_argument("--out", type=Path, default=RECORDS)
    parser.add_argument("--note", help="a sentence on the run's conditions, kept in its variant and lossless records")
    parser.add_argument("--run", help="a name for this driver, where several ran on the host")
    parser.add_argument("--host-busy", action="store_true", help="its probes ran while other servers started there")
    parser.add_argument("--floor", action="append", default=[], help="floor.py's record of this host")
    for key in ("gpu", "cpu", "date"):
        parser.add_argument(f"--{key}", help=f"the host's {key}, for a floor.py record without it (tarball -)")
    args = parser.parse_args(argv)
    tarball = None if args.tarball == "-" else Path(args.tarball)
    given = {key: getattr(args, key) for key in ("gpu", "cpu", "date") if getattr(args, key)}
    written = collect(tarball, args.host, args.out, args.note, args.run, args.host_busy, args.floor, given)
    for path in written:
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


if __name__ == "__main__":
    sys.exit(main())
