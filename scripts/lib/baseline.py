"""What a speed ratio is against, said in every record, table and plot that shows one.

A probe's `speedup` divides the config's `probe.categories[].baseline_ms` by its median: by default the contract's
A10G bf16 numbers, which mean something only for a probe on an A10G at the contract's prompt sizes (a tiny model on a
CPU, or a 4,096-token long category, is not that). A same-host bf16 variant (a recipe that quantizes nothing, no
speculation) probed in the same run is the honest reference on any other host: the summary and the ranking divide by
its medians instead when the run has one. Stdlib only (rules/common.smk imports lib.dag.selection, which imports this).
"""

from __future__ import annotations

import statistics

CONTRACT_A10G = "contract_a10g"  # the contract's A10G bf16 baseline_ms (the schema's default probe.categories)
CONFIG = "config"  # baseline_ms of the config's own, not the contract's
SAME_HOST_BF16 = "same_host_bf16"  # a bf16 variant's medians, probed on this host in the same run
NONE = "none"  # no category has a baseline_ms: no ratio

LABELS = {
    CONTRACT_A10G: "× the contract's A10G baseline (meaningful on an A10G only)",
    CONFIG: "× the config's probe.categories baseline_ms (not the contract's A10G numbers)",
    NONE: "no ratio (no probe category has a baseline_ms)",
}


def size_differences(categories: list[dict], contract: list[dict]) -> list[dict]:
    """The probed categories whose prompt or output size is not the contract's category of that name (None where the
    contract has no category of that name)."""
    contract_of = {c["name"]: c for c in contract}
    out = []
    for category in categories:
        theirs = contract_of.get(category["name"], {})
        prompt, output = category["prompt_tokens"], category["output_tokens"]
        if (prompt, output) != (theirs.get("prompt_tokens"), theirs.get("output_tokens")):
            out.append(
                {
                    "name": category["name"],
                    "prompt_tokens": prompt,
                    "output_tokens": output,
                    "contract_prompt_tokens": theirs.get("prompt_tokens"),
                    "contract_output_tokens": theirs.get("output_tokens"),
                }
            )
    return out


def difference_text(difference: dict) -> str:
    name = difference["name"]
    if difference["contract_prompt_tokens"] is None:
        return f"the {name} category is not one of the contract's"
    parts = []
    if difference["prompt_tokens"] != difference["contract_prompt_tokens"]:
        parts.append(
            f"sends {difference['prompt_tokens']:,} prompt tokens, not the contract's "
            f"{difference['contract_prompt_tokens']:,}"
        )
    if difference["output_tokens"] != difference["contract_output_tokens"]:
        parts.append(
            f"asks {difference['output_tokens']:,} output tokens, not the contract's "
            f"{difference['contract_output_tokens']:,}"
        )
    return f"the {name} category " + " and ".join(parts)


def probe_baseline(categories: list[dict], contract: list[dict], device: str) -> dict:
    """A latency record's `baseline`: what its `speedup` (baseline_ms / median_ms) is against. `categories`: the
    config's probe.categories; `contract`: the contract's (the schema's default); `device`: what the probe ran on."""
    contract_ms = {c["name"]: c.get("baseline_ms") for c in contract}
    timed = [c for c in categories if c.get("baseline_ms")]
    if not timed:
        kind = NONE
    elif all(contract_ms.get(c["name"]) == c["baseline_ms"] for c in timed):
        kind = CONTRACT_A10G
    else:
        kind = CONFIG
    differences = size_differences(categories, contract)
    text = f"{LABELS[kind]}; probed on {device}"
    if kind == CONTRACT_A10G and differences:
        text += "; " + "; ".join(difference_text(d) for d in differences)
    return {"kind": kind, "label": LABELS[kind], "text": text, "device": device, "sizes_differ": differences}


def same_host(variant: str) -> dict:
    """`baseline` of a summary or ranking whose ratios are against a bf16 variant probed on this host."""
    label = f"× same-host bf16 ({variant})"
    return {
        "kind": SAME_HOST_BF16,
        "variant": variant,
        "label": label,
        "text": f"{label}: {variant}'s median latencies, measured in this run on this host by the same probe, "
        "category by category and prompt set by prompt set",
    }


def is_bf16(quantized: bool, speculative_method: str) -> bool:
    """A same-host bf16 reference: its recipe quantizes nothing and it does not speculate."""
    return not quantized and speculative_method == "none"


def mean_ratio(prompt_set: dict | None, reference_set: dict | None) -> float | None:
    """Mean over categories of the reference's median / this median, on one prompt set; None when either was not
    probed, or the reference lacks one of the categories."""
    if not prompt_set or not reference_set:
        return None
    reference = {c["name"]: c["median_ms"] for c in reference_set["categories"]}
    if any(c["name"] not in reference for c in prompt_set["categories"]):
        return None
    return statistics.mean(reference[c["name"]] / c["median_ms"] for c in prompt_set["categories"])
