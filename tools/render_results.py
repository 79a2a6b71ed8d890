"""Render docs/results.md and the README's results table from the GPU proof's records (records/gpu-proof/).

    python3 tools/render_results.py           # write both
    python3 tools/render_results.py --check   # exit 1, naming the file, when a committed one differs

Every number in both comes from a record; a speedup is always over bf16 measured on the same host (same GPU, same
lease), and never across hosts. docs/results.md holds every engine's runs; the README's table only the engine the
release profile ships (config.yaml's engine.vllm). tests/unit/test_results_docs.py runs --check.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # serving.patches: the registry's defaults, to name what a run changed
RECORDS = ROOT / "records" / "gpu-proof"
RESULTS_MD = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
# the release profile: the README's table shows its engine only (engine.vllm, else the schema's default)
CONFIG = ROOT / "config.yaml"
CONFIG_SCHEMA = ROOT / "schemas" / "config.schema.yaml"
START, END = "<!-- results-table:start -->", "<!-- results-table:end -->"
COMMAND = "python3 tools/render_results.py"
SETS = ("repeated", "varied", "fresh")
REFERENCE = "bf16"  # config.yaml's unquantized variant without speculation
# options a run gives every server of a group (gpu_proof/driver.py --together): a variant is compared with the bf16 of
# its host that ran with the same KV cache; gpu_memory_utilization only passes vLLM's start-up check when a fixed KV
# cache size is given (vLLM then sizes nothing by it), so it sets no difference
# (patches: "off" is how an engine the patches were not tested on runs: its bf16 ran so too)
RUN_OPTIONS = ("gpu_memory_utilization", "kv_cache_memory_bytes", "patches")
COMPARED_RUN_OPTIONS = ("kv_cache_memory_bytes", "patches")
# what a GPU run cannot do otherwise: the README's table shows such a row, named with it
INHERENT_OPTIONS = ("drafter",)


# Sweep points as their records name them, measured before every variant name gave K as `<method><K>` (the catalog's
# scheme: scripts/lib/dag/sweeps.py k_label), and as users build them now: the tables give today's names, so that a row
# names a variant one can ask for; the records stay as measured (tests/unit/test_gpu_proof.py checks their settings are
# the renamed variants').
RENAMED = {
    "awq-w4a16-g32-dflash-k7": "awq-w4a16-g32-dflash7",
    "awq-w4a16-g32-head4-vocab131k-suffix-k32-f3": "awq-w4a16-g32-head4-vocab131k-suffix32-d64-f3",
    "awq-w4a16-g32-head4-vocab131k-suffix-k32-f4": "awq-w4a16-g32-head4-vocab131k-suffix32-d64-f4",
}


def load(root: Path = RECORDS) -> list[dict]:
    records = [json.loads(path.read_text()) for path in sorted(root.glob("*/*.json"))]
    for named in (part for record in records for part in (record, *record.get("checks", []))):
        for key in ("variant", "reference_variant"):
            if key in named:
                named[key] = RENAMED.get(named[key], named[key])
    return records


def medians(record: dict, set_name: str) -> dict[str, float]:
    probed = record["sets"].get(set_name)
    return {c["name"]: c["median_ms"] for c in probed["categories"]} if probed else {}


def speedup(record: dict, reference: dict | None, set_name: str) -> float | None:
    """Mean over categories of the reference's median over the variant's, on one prompt set."""
    if reference is None:
        return None
    mine, theirs = medians(record, set_name), medians(reference, set_name)
    shared = [name for name in mine if name in theirs]
    return statistics.mean(theirs[name] / mine[name] for name in shared) if shared else None


def per_set(record: dict, field: str) -> dict[str, float | None]:
    """A category field's mean over categories, per prompt set (None where not measured)."""
    out = {}
    for set_name in SETS:
        values = [c[field] for c in (record["sets"].get(set_name) or {"categories": []})["categories"]]
        values = [v for v in values if v is not None]
        out[set_name] = statistics.mean(values) if values else None
    return out


def long_ttft(record: dict, set_name: str) -> float | None:
    probed = record["sets"].get(set_name)
    return next((c["ttft_median_ms"] for c in probed["categories"] if c["name"] == "long"), None) if probed else None


def fmt(value, digits: int = 2, suffix: str = "") -> str:
    return "—" if value is None else f"{value:.{digits}f}{suffix}"


def triple(values, digits: int = 2, suffix: str = "") -> str:
    return " / ".join(fmt(v, digits, suffix) for v in values)


def patch_changes(patches: dict, engine: str | None = None, resolved: bool = False, method: str | None = None) -> str:
    """A run's serve.patches as what it changed from the registry's defaults ("draft_padding off"), among those that
    apply on a GPU (a CPU patch switched there changes nothing), to the run's speculative `method` where given, and,
    given the run's `engine`, can run on it (the release each is written for). `resolved`: the whole table a run
    served, where a patch it lacks did not exist yet, so the run went without it (a row measured before a default
    changed says so); else a --serve-set table, the rest at their defaults."""
    from serving.patches import PATCHES

    changed = []
    for name, patch in PATCHES.items():
        on = patches.get(name, False if resolved else patch.default)
        acts = method is None or patch.methods is None or method in patch.methods
        if patch.platform != "cpu" and acts and engine in (None, patch.vllm) and on != patch.default:
            changed.append(f"{name} {'on' if on else 'off'}")
    return ", ".join(changed)


def option_text(key: str, value) -> str:
    if key == "serve_set":
        return ", ".join(
            f"patches: {patch_changes(v) or 'the defaults'}"
            if k == "patches" and isinstance(v, dict)
            else f"{k}: {json.dumps(v)}"
            for k, v in sorted(value.items())
        )
    return f"{key}: {json.dumps(value)}"


def label(record: dict) -> str:
    options = dict(record["options"])
    served = (record.get("serve") or {}).get("patches")
    patch_part = []
    if isinstance(served, dict) and options.get("patches") != "off":
        # what the run served, not what it asked for: a default that changed since shows on the rows measured before
        asked = dict(options.pop("serve_set", None) or {})
        partial = isinstance(asked.pop("patches", None), dict)
        if asked:
            options["serve_set"] = asked
        method = (record.get("speculative") or {}).get("method")
        changes = patch_changes(served, record.get("engine"), resolved=not partial, method=method)
        patch_part = [f"patches: {changes}"] if changes else []
    changed = ", ".join([*(option_text(key, value) for key, value in sorted(options.items())), *patch_part])
    return f"`{record['variant']}`" + (f" ({changed})" if changed else "")


def gpus(records: list[dict]) -> list[str]:
    return sorted({r["gpu"] for r in records}, key=lambda gpu: max(r["date"] for r in records if r["gpu"] == gpu))[::-1]


def run_options(record: dict) -> dict:
    return {key: value for key, value in record["options"].items() if key in COMPARED_RUN_OPTIONS}


def own_options(record: dict) -> dict:
    """What a record's run changed from its catalog variant beyond what every server of its group shared."""
    return {key: value for key, value in record["options"].items() if key not in RUN_OPTIONS}


def reference_of(records: list[dict], record: dict) -> dict | None:
    """bf16 served on the same host by the same engine with the same run options and nothing else changed."""
    return next(
        (
            r
            for r in records
            if r["kind"] == "variant"
            and r["host"] == record["host"]
            and r.get("engine") == record.get("engine")
            and r.get("weights", "random") == record.get("weights", "random")
            and r["variant"] == REFERENCE
            and not own_options(r)
            and run_options(r) == run_options(record)
        ),
        None,
    )


def resident_cell(record: dict) -> str:
    """How many other servers were resident on the host during the probe; records from before it was counted lack it."""
    return str(record["resident_servers"]) if "resident_servers" in record else "unknown"


def start_cell(record: dict) -> str:
    """The first start's seconds and cache; with --restart, the second start's on the cache the first one filled."""
    cold = f"{fmt(record['cold_start'].get('seconds'), 0)} ({record['cold_start'].get('cache')})"
    warm = record.get("warm_start")
    return f"{cold}, then {fmt(warm['seconds'], 0)} (its own cache)" if warm else cold


def measured(records: list[dict], kind: str, gpu: str, weights: str) -> list[dict]:
    return [r for r in records if r["kind"] == kind and r["gpu"] == gpu and r["weights"] == weights]


def note_mark(record: dict, notes: list[str]) -> str:
    """A record's note as a footnote marker, its text kept once in `notes` (listed under the table)."""
    if not record.get("note"):
        return ""
    if record["note"] not in notes:
        notes.append(record["note"])
    return f" [{notes.index(record['note']) + 1}]"


def footnotes(notes: list[str]) -> list[str]:
    return ["", *(f"[{n}] {note}." for n, note in enumerate(notes, 1))] if notes else []


def variant_rows(records: list[dict], gpu: str) -> list[str]:
    variants = measured(records, "variant", gpu, "random")
    if not variants:
        return []
    rows = [
        "",
        "Cost (full-size random-weight checkpoint):",
        "",
        "| variant | vLLM | host, date | × bf16 same host: repeated / varied / fresh | ITL ms | TTFT long ms: repeated "
        "/ fresh | tokens a step | GB a step | start s | others resident |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes: list[str] = []
    for record in sorted(variants, key=lambda r: (r["date"], r["host"], r["engine"], r["variant"], len(r["options"]))):
        reference = reference_of(records, record)
        mark = note_mark(record, notes)
        rows.append(
            f"| {label(record)}{mark} | {record['engine']} | {record['host']}, {record['date']} "
            f"| {triple(speedup(record, reference, s) for s in SETS)} "
            f"| {triple(per_set(record, 'itl_median_ms').values())} "
            f"| {triple((long_ttft(record, 'repeated'), long_ttft(record, 'fresh')), 0)} "
            f"| {triple(per_set(record, 'mean_acceptance_length').values())} "
            f"| {fmt(record['bytes_per_step'] and record['bytes_per_step'] / 1e9)} "
            f"| {start_cell(record)} | {resident_cell(record)} |"
        )
    return rows + footnotes(notes)


def trained_rows(records: list[dict], gpu: str) -> list[str]:
    """Acceptance and plain-step cost of the trained tiny checkpoint on the GPU's kernels."""
    variants = measured(records, "variant", gpu, "trained")
    if not variants:
        return []
    rows = [
        "",
        "Acceptance and step cost (the tiny profile's trained checkpoint):",
        "",
        "| variant | vLLM | host, date | tokens a step: repeated / varied / fresh | ITL ms | engine step ms "
        "| TTFT short ms | start s | others resident |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    floors = {(r["host"], r["engine"], r["variant"]): r for r in measured(records, "floor", gpu, "trained")}
    notes: list[str] = []
    for record in sorted(variants, key=lambda r: (r["date"], r["host"], r["engine"], r["variant"], len(r["options"]))):
        short = next(c for c in record["sets"]["repeated"]["categories"] if c["name"] == "short")
        rows.append(
            f"| {label(record)}{note_mark(record, notes)} | {record['engine']} | {record['host']}, {record['date']} "
            f"| {triple(per_set(record, 'mean_acceptance_length').values())} "
            f"| {triple(per_set(record, 'itl_median_ms').values())} "
            f"| {fmt((floors.get((record['host'], record['engine'], record['variant'])) or {}).get('step_median_ms'))} "
            f"| {fmt(short['ttft_median_ms'], 1)} "
            f"| {start_cell(record)} | {resident_cell(record)} |"
        )
    return rows + footnotes(notes)


def profiled_host_ms(profile: dict) -> str:
    """What the patch acts on in the profiled step, off → on: the GDN attention op's host time a call where the
    step ran it, else the model runner's draft scope (the proposer's host time)."""
    off, on = profile.get("off") or {}, profile.get("on") or {}
    if off.get("gdn_calls") and on.get("gdn_calls"):
        return f"GDN op a call {fmt(off['gdn_host_ms_per_call'])} → {fmt(on['gdn_host_ms_per_call'])}"
    scopes = off.get("runner_scopes_ms") or {}, on.get("runner_scopes_ms") or {}
    if all("draft" in scope for scope in scopes):
        return f"draft {fmt(scopes[0]['draft'], 1)} → {fmt(scopes[1]['draft'], 1)}"
    return "—"


def prefill_rows(records: list[dict], gpu: str) -> list[str]:
    """A vLLM patch measured off, then on, in one engine (gpu_proof/floor.py --ab): each prompt length's first step
    (prefill and first token) both ways, whether every token's id and logprob stayed equal (a verdict only on
    trained weights), and the profiled step's host time in what the patch acts on (profiled_host_ms)."""
    floors = [r for r in records if r["kind"] == "floor" and r["gpu"] == gpu and "prefill_ms" in r]
    if not floors:
        return []
    rows = [
        "",
        "Prefill in vLLM's engine alone (gpu_proof/floor.py --ab: one engine, the patch off then on; ms from a",
        "request's arrival to its first token, median of 5 after 2 warm-ups, by prompt length in tokens):",
        "",
        "| variant | patch | weights | vLLM | host, date | off → on, ms a prompt length | ids and logprobs equal "
        "| profiled step's host ms, off → on |",
        "|---|---|---|---|---|---|---|---|",
    ]
    notes: list[str] = []
    for record in sorted(
        floors, key=lambda r: (r["date"], r["host"], r["weights"], r["variant"], str(r.get("options")))
    ):
        off, on = record["prefill_ms"]["off"], record["prefill_ms"]["on"]
        lengths = sorted(off, key=int)
        times = "; ".join(f"{n}: {fmt(off[n], 0)} → {fmt(on[n], 0)}" for n in lengths)
        differ = [n for n in lengths if not record["same"][n]]
        equal = "all" if not differ else f"{', '.join(differ)} differ"
        if record["weights"] != "trained":
            equal += " (random weights: no verdict)"
        host_ms = profiled_host_ms(record.get("profile") or {})
        checked = {"variant": record["variant"], "options": record.get("options") or {}}
        rows.append(
            f"| {label(checked)}{note_mark(record, notes)} | `{record['ab']}` | {record['weights']} "
            f"| {record['engine']} | {record['host']}, {record['date']} | {times} | {equal} | {host_ms} |"
        )
    return rows + footnotes(notes)


def verdict(check: dict) -> str:
    """passed or FAILED; a canary (checked against another variant's reference on purpose) says what it shows."""
    if "canary" in check:
        return "FAILED, as a canary must" if not check["passed"] else "passed: a canary that should fail (no teeth)"
    return "passed" if check["passed"] else "FAILED"


def resident_rows(records: list[dict], gpu: str) -> list[str]:
    """A variant probed beside its group's resident servers, then alone on the same server (gpu_proof/driver.py
    --alone): each prompt set's mean TTFT and ITL both ways, what --max-resident is decided from."""
    probed = [r for r in records if r["kind"] == "variant" and r["gpu"] == gpu and r.get("alone")]
    if not probed:
        return []
    rows = [
        "",
        "Resident servers beside a probe (gpu_proof/driver.py --alone: one server probed beside its group, then",
        "again once the others were stopped; means over the categories, repeated / varied / fresh):",
        "",
        "| variant | vLLM | host, date | others resident → alone | TTFT ms | ITL ms |",
        "|---|---|---|---|---|---|",
    ]
    for record in sorted(probed, key=lambda r: (r["date"], r["host"], r["variant"])):
        alone = {"sets": record["alone"]["sets"]}
        cells = []
        for field, digits in (("ttft_median_ms", 0), ("itl_median_ms", 2)):
            beside, by_itself = per_set(record, field), per_set(alone, field)
            cells.append(" / ".join(f"{fmt(beside[n], digits)} → {fmt(by_itself[n], digits)}" for n in SETS))
        resident = f"{record.get('resident_servers', 'unknown')} → {record['alone']['resident_servers']}"
        rows.append(
            f"| {label(record)} | {record['engine']} | {record['host']}, {record['date']} | {resident} "
            f"| {cells[0]} | {cells[1]} |"
        )
    return rows


def lossless_rows(records: list[dict], gpu: str) -> list[str]:
    """Only trained weights decide losslessness: random logits part at near ties two correct kernels break apart."""
    checks = [(r, c) for r in measured(records, "lossless", gpu, "trained") for c in r["checks"]]
    if not checks:
        return []
    rows = [
        "",
        "Lossless check (trained tiny checkpoint; greedy ids with speculation against the same recipe without):",
    ]
    rows += [
        "",
        "| variant | against | vLLM | host, date | verdict | rows passed | near ties | first differences |",
        "|---|---|---|---|---|---|---|---|",
    ]
    notes: list[str] = []
    for record, check in checks:
        equal = sum(1 for row in check["rows"] if row["passed"])
        ties = sum(1 for row in check["rows"] if row["near_tie_nats"] is not None)
        firsts = sorted({row["first_difference"] for row in check["rows"] if row["first_difference"] is not None})
        checked = {"variant": check["variant"], "options": check.get("options") or {}}
        rows.append(
            f"| {label(checked)}{note_mark(record, notes)} "
            f"| `{check['reference_variant']}` | {record['engine']} "
            f"| {record['host']}, {record['date']} | {verdict(check)} "
            f"| {equal} of {len(check['rows'])} | {ties} | {', '.join(map(str, firsts)) or '—'} |"
        )
    return rows + footnotes(notes)


def results_md(records: list[dict]) -> str:
    lines = [
        f"<!-- Generated by `{COMMAND}` from records/gpu-proof/*/*.json: edit the records, not this file. -->",
        "# Results",
        "",
        "Catalog variants measured by the GPU proof ([gpu-proof.md](gpu-proof.md)) on lent GPU hosts, in two kinds of",
        "table. **Cost**: a full-size **random-weight** checkpoint of the real shapes: what a step costs, never",
        "quality, and no acceptance that real text would give (random weights accept almost nothing on fresh text and",
        "copy-style drafts only on repeated output), and no lossless verdict (their flat logits part at near ties).",
        "**Acceptance and the lossless check**: the tiny profile's **trained** checkpoint (made on a CPU by the",
        "pipeline) on the GPU's kernels, through the tiny catalog's variants; `engine step ms` is vLLM's engine alone",
        "(gpu_proof/floor.py: no API server, HTTP, streaming or middleware), beside the server's ITL.",
        "`× bf16` is the mean over the three categories of bf16's median latency over the variant's, bf16 served on",
        "the same host by the same vLLM.",
        "`repeated` is the competition's prompt (one sentence repeated), `varied` real paragraphs, `fresh` a new",
        "prompt every run (nothing cached). ITL is the mean over categories of each category's median inter-token",
        "latency; tokens a step is the mean acceptance length with speculation. `options` say what the run changed",
        "from the catalog variant. `others resident` is how many other servers were resident on the host while the",
        "variant was probed (`unknown`: probed before the driver counted them).",
    ]
    for gpu in gpus(records):
        lines += [
            "",
            f"## {gpu}",
            *variant_rows(records, gpu),
            *trained_rows(records, gpu),
            *lossless_rows(records, gpu),
            *prefill_rows(records, gpu),
            *resident_rows(records, gpu),
        ]
        environments = [r for r in records if r["kind"] == "environment" and r["gpu"] == gpu]
        hosts = ", ".join(
            f"{r['host']} ({r['date']}, vLLM {r['vllm']}, copy {fmt(r['copy_gbps'], 0)} GB/s)" for r in environments
        )
        lines += ["", f"Hosts: {hosts}."]
    return "\n".join(lines) + "\n"


def clean_rank(record: dict) -> tuple:
    """The README's pick of a variant's runs: the latest one probed on a quiet host; one that carries a caveat (a
    note) only where no other exists."""
    return (not record.get("host_busy"), not record.get("note"), record["date"])


def shipped_engine(config_path: Path | None = None) -> str:
    """The vLLM release the release profile ships: its engine.vllm, else the schema's default."""
    config = yaml.safe_load((config_path or CONFIG).read_text()) or {}
    given = (config.get("engine") or {}).get("vllm")
    if given:
        return given
    schema = yaml.safe_load(CONFIG_SCHEMA.read_text())
    return schema["properties"]["engine"]["properties"]["vllm"]["default"]


README_LEAD = [
    "Speed on vLLM {engine}, the release `engine.vllm` names and the image ships, as the GPU proof measured it on",
    "full-size random-weight checkpoints of Qwen3.5-4B's shapes. [docs/results.md](docs/results.md) has every run,",
    "older engines' included.",
]
README_TERMS = [
    "- **× bf16**: bf16's median latency over the variant's, averaged over the short, medium and long categories,",
    "  with bf16 served on the same host by the same vLLM. The competition prompt repeats one sentence; fresh",
    "  prompts are new on every run, so nothing is cached and nothing repeats.",
    "- **GB a step**: the weights one decode step reads from GPU memory (decoder and head, plus MTP's draft passes or",
    "  the drafter's pass), in GB.",
    "",
    "Random weights show what a step costs, never quality or acceptance: an MTP or DFlash row below 1× means their",
    "drafts were not accepted, not that the method is slow on real text.",
]


def readme_table(records: list[dict], engine: str) -> str:
    """Per GPU model, each variant's latest same-host comparison with bf16, on the shipped engine only."""
    records = [r for r in records if r.get("engine") == engine]
    rows = []
    for gpu in gpus(records):
        latest: dict[str, dict] = {}
        for record in records:
            if (
                record["kind"] != "variant"
                or record["gpu"] != gpu
                or record["weights"] != "random"
                or set(own_options(record)) - set(INHERENT_OPTIONS)
                or record["variant"] == REFERENCE
            ):
                continue
            held = latest.get(record["variant"])
            if reference_of(records, record) and (held is None or clean_rank(record) >= clean_rank(held)):
                latest[record["variant"]] = record
        for name, record in sorted(
            latest.items(), key=lambda item: -speedup(item[1], reference_of(records, item[1]), "repeated")
        ):
            reference = reference_of(records, record)
            drafted = " (random drafter)" if "drafter" in record["options"] else ""
            rows.append(
                f"| {gpu.removeprefix('NVIDIA ')} | `{name}`{drafted} "
                f"| {fmt(speedup(record, reference, 'repeated'), 2, '×')} "
                f"| {fmt(speedup(record, reference, 'fresh'), 2, '×')} "
                f"| {fmt(record['bytes_per_step'] and record['bytes_per_step'] / 1e9)} |"
            )
    if not rows:
        return f"No GPU record of vLLM {engine} yet: [docs/results.md](docs/results.md) has older engines' runs."
    header = [
        "| GPU | variant | × bf16, competition prompt | × bf16, fresh prompts | GB a step |",
        "|---|---|---|---|---|",
    ]
    return "\n".join([*(line.format(engine=engine) for line in README_LEAD), "", *header, *rows, "", *README_TERMS])


def with_readme_table(readme: str, table: str) -> str:
    if readme.count(START) != 1 or readme.count(END) != 1:
        raise SystemExit(f"README.md needs one {START} line and one {END} line around the results table")
    head, rest = readme.split(START)
    _, tail = rest.split(END)
    return f"{head}{START}\n{table}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    records = load()
    wanted = {
        RESULTS_MD: results_md(records),
        README: with_readme_table(README.read_text(), readme_table(records, shipped_engine())),
    }
    stale = [path for path, text in wanted.items() if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is not what the records give: run `{COMMAND}`", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(wanted[path])
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
