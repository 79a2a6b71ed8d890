"""Greedy outputs with speculation equal those without it: the check, on the latency probe's own records.

Speculative decoding is lossless by construction (the target model verifies every draft token, so a bad draft
only costs acceptance), but an implementation can still break it: on Qwen3.5 a rejected or short draft can leave
the Gated DeltaNet recurrent state advanced past the accepted tokens (vLLM issue #39273), and from there every
token is the model's answer to a different history. Greedy ids (temperature 0) make that visible at the first token
it changes: the probe keeps each category's first timed run's ids (`first_run_token_ids`), and the same prompts
served with speculation off must give the same ids.

Stdlib only: scripts/lossless.py (the check), scripts/lossless_reference.py (the reference run) and the tests
import it.
"""

from __future__ import annotations

from lib.probe import prompt_sets

# A first difference where the reference's own choice beat the speculative run's token by at most this many nats
# (both among its top logprobs there) is a near tie, not a broken state: the speculative run scores K+1 positions
# in one forward pass and the reference one at a time, and in bf16 (about 3 significant digits; logits of the
# tiny model reach ~20) that alone moves a logit by ~0.05. Past that position the two texts are different histories
# and are not compared further. Broken state (vLLM #39273) picks tokens the reference does not rank near the top.
NEAR_TIE_NATS = 0.1


def near_tie(difference: dict, reference_tops: list | None) -> dict | None:
    """{position, margin} when the first difference is a near tie in the reference's own logprobs, else None."""
    if not reference_tops or difference["position"] >= len(reference_tops):
        return None
    ranked = dict((token, logprob) for token, logprob in reference_tops[difference["position"]])
    chosen, other = ranked.get(difference["reference"]), ranked.get(difference["speculative"])
    if chosen is None or other is None or chosen - other > NEAR_TIE_NATS:
        return None
    return {"position": difference["position"], "margin": round(chosen - other, 4)}


def first_difference(speculative: list[int], reference: list[int]) -> dict | None:
    """The first position where the two id lists differ (a missing id is None), or None when they are equal."""
    for position in range(max(len(speculative), len(reference))):
        got = speculative[position] if position < len(speculative) else None
        want = reference[position] if position < len(reference) else None
        if got != want:
            return {"position": position, "speculative": got, "reference": want}
    return None


def compare(record: dict, reference: dict) -> list[dict]:
    """One row per prompt set and category of `record` (a latency.json): its greedy ids against `reference`'s
    (a latency.json, or lossless_reference's record of the same layout) for the same set and category.

    A set or category the reference lacks, or ids either side did not record, cannot be proven equal: the row
    fails with `problem` saying why rather than passing unchecked."""
    rows = []
    reference_sets = prompt_sets(reference)
    for set_name, prompt_set in prompt_sets(record).items():
        reference_set = reference_sets.get(set_name)
        reference_categories = {c["name"]: c for c in (reference_set["categories"] if reference_set else [])}
        for category in prompt_set["categories"]:
            row = {
                "set": set_name,
                "category": category["name"],
                "tokens": None,
                "passed": False,
                "first_difference": None,
                "near_tie": None,
                "problem": None,
            }
            want = reference_categories.get(category["name"])
            got_ids = category.get("first_run_token_ids")
            if want is None:
                row["problem"] = f"the reference has no {set_name}/{category['name']} record"
            elif got_ids is None or want.get("first_run_token_ids") is None:
                side = "speculative" if got_ids is None else "reference"
                row["problem"] = f"the {side} run recorded no token ids (the server sent none)"
            else:
                difference = first_difference(got_ids, want["first_run_token_ids"])
                tie = near_tie(difference, want.get("first_run_top_logprobs")) if difference else None
                row.update(tokens=len(got_ids), passed=difference is None or tie is not None)
                row.update(first_difference=difference, near_tie=tie)
            rows.append(row)
    return rows


def describe(row: dict) -> str:
    """One failing row in words: the set, the category, the first differing position and the two ids."""
    where = f"{row['set']} prompts, category {row['category']}"
    if row["problem"]:
        return f"{where}: {row['problem']}"
    d = row["first_difference"]
    return (
        f"{where}: greedy output differs first at output token {d['position']} "
        f"(speculative {d['speculative']}, without speculation {d['reference']})"
    )


def failures(rows: list[dict]) -> list[str]:
    return [describe(row) for row in rows if not row["passed"]]
