"""Greedy outputs with speculation equal those without it: the check, on the latency probe's own records.

Speculative decoding is lossless by construction (the target model verifies every draft token, so a bad draft
only costs acceptance), but an implementation can still break it: on Qwen3.5 a rejected or short draft can leave
the Gated DeltaNet recurrent state advanced past the accepted tokens (vLLM issue #39273), and from there every
token is the model's answer to a different history. Greedy ids (temperature 0) make that visible at the first token
it changes: the probe keeps each category's first timed run's ids (`first_run_token_ids`) and the ids of one
concurrent batch (`batch`), and the same prompts served with speculation off must give the same ids.

A first difference at a near tie does not end the comparison: the reference server is asked to continue greedily
from the speculative run's own prefix (the prompt's ids as it tokenized them, then the speculative ids up to and
including the tie; request_continuations, run by scripts/lossless_reference.py) and the comparison resumes after the
tie, so a real divergence later in the same output is still seen. The server's walk and the check's
(scripts/lossless.py, on what was recorded: recorded_continuations) are the same function, compare, so the check reads
exactly the continuations the reference made.

Stdlib only: scripts/lossless.py (the check), scripts/lossless_reference.py (the reference run), the GPU proof's
driver and the tests import it.
"""

from __future__ import annotations

import hashlib
import json

from lib.probe import REFERENCE_TOP_LOGPROBS, prompt_sets, timed_completion
from lib.stage import StageError

# A difference where the reference's own choice beat the speculative run's token by at most this many nats (both
# among its top logprobs there) is a near tie, not a broken state: the speculative run scores K+1 positions in one
# forward pass and the reference one at a time, and in bf16 (about 3 significant digits; logits of the tiny model
# reach ~20) that alone moves a logit by ~0.05. Broken state (vLLM #39273) picks tokens the reference does not rank
# near the top.
NEAR_TIE_NATS = 0.1

# Near ties a row is continued past, at most. A lossless server meets few (the tiny DAG: none or one in its six rows
# of 128-256 tokens: a tie only shows where rounding actually flipped it); a speculative run that keeps landing on
# the reference's second choice is what a subtly biased verify step looks like, and each continuation is one more
# reference request of up to a whole output. Past the limit the row is not proven equal, so it fails.
MAX_CONTINUATIONS = 8

BATCH_SET = "batch"  # the rows of the concurrent batch (lib.probe.concurrent_batch), beside the prompt sets'


class MissingContinuation(Exception):
    """The reference has no usable continuation after a near tie (the row fails with this message)."""


def prefix_digest(ids: list[int]) -> str:
    """sha256 of the speculative ids a continuation starts from: the check uses a recorded continuation only if it
    was made from the same speculative output."""
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()


def near_tie(difference: dict, reference_tops: list | None, offset: int = 0) -> dict | None:
    """{position, margin} when `difference` is a near tie in the reference's own logprobs (`reference_tops` starts at
    output position `offset`), else None."""
    index = difference["position"] - offset
    if not reference_tops or index >= len(reference_tops):
        return None
    ranked = dict((token, logprob) for token, logprob in reference_tops[index])
    chosen, other = ranked.get(difference["reference"]), ranked.get(difference["speculative"])
    if chosen is None or other is None or chosen - other > NEAR_TIE_NATS:
        return None
    return {"position": difference["position"], "margin": round(chosen - other, 4)}


def first_difference(speculative: list[int], reference: list[int], offset: int = 0) -> dict | None:
    """The first position from `offset` on where `speculative` differs from `reference` (the reference's ids from
    that position on; a missing id is None), or None when they are equal."""
    for position in range(offset, max(len(speculative), offset + len(reference))):
        got = speculative[position] if position < len(speculative) else None
        want = reference[position - offset] if position - offset < len(reference) else None
        if got != want:
            return {"position": position, "speculative": got, "reference": want}
    return None


def compare_ids(speculative: list[int], reference: list[int], reference_tops: list | None, continue_after=None) -> dict:
    """One output's greedy ids against the reference's, continuing the reference past each near tie.

    continue_after(position, prefix, max_tokens) -> {"token_ids", "top_logprobs"}: the reference's greedy output
    (max_tokens, what the speculative run has left) after the prompt and the speculative `prefix` (its ids up to and
    including the tie at `position`), or raises MissingContinuation. None: no reference server is at hand (the GPU
    proof's driver), and a near tie ends the comparison, recorded as `unchecked_after`. A tie at the last output token
    needs no continuation.

    Returns {first_difference (against the reference's own run), near_ties, continuations ({after, tokens}),
    divergence (the difference that is not a near tie), unchecked_after, problem}: passed when divergence and
    problem are None."""
    result = {
        "first_difference": None,
        "near_ties": [],
        "continuations": [],
        "divergence": None,
        "unchecked_after": None,
        "problem": None,
    }
    offset, ids, tops = 0, reference, reference_tops
    while (difference := first_difference(speculative, ids, offset)) is not None:
        result["first_difference"] = result["first_difference"] or difference
        tie = near_tie(difference, tops, offset)
        if tie is None:
            result["divergence"] = difference
            break
        result["near_ties"].append(tie)
        after = difference["position"]
        if after + 1 >= len(speculative):
            break
        if continue_after is None:
            result["unchecked_after"] = after
            break
        if len(result["continuations"]) == MAX_CONTINUATIONS:
            result["problem"] = (
                f"more than {MAX_CONTINUATIONS} near ties (lib/lossless.py MAX_CONTINUATIONS): not compared past "
                f"output token {after}"
            )
            break
        try:
            continuation = continue_after(after, speculative[: after + 1], len(speculative) - after - 1)
        except MissingContinuation as missing:
            result["problem"] = str(missing)
            break
        result["continuations"].append({"after": after, "tokens": len(continuation["token_ids"])})
        offset, ids, tops = after + 1, continuation["token_ids"], continuation.get("top_logprobs")
    return result


def recorded_continuations(entries: dict[str, list[dict]]):
    """continue_after for compare(): the continuations lossless_reference recorded for one speculative variant
    ({row key: [{after, prefix_sha256, token_ids, top_logprobs}]}, row key "set/category")."""

    def continue_after(row_key: str, position: int, prefix: list[int], max_tokens: int) -> dict:
        for entry in entries.get(row_key, []):
            if entry["after"] == position:
                if entry["prefix_sha256"] != prefix_digest(prefix):
                    raise MissingContinuation(
                        f"the reference's continuation after the near tie at output token {position} was made from "
                        "another speculative output (a reference older than this latency.json: rerun "
                        "lossless_reference)"
                    )
                return entry
        raise MissingContinuation(
            f"the reference recorded no continuation after the near tie at output token {position}"
        )

    return continue_after


def row_key(set_name: str, name: str) -> str:
    return f"{set_name}/{name}"


def paired_outputs(record: dict, reference: dict, require_batch: bool = False):
    """(set, category, speculative ids, reference ids, reference tops, problem) for every prompt set and category of
    `record` and every request of its concurrent batch, paired with `reference`'s for the same prompt."""
    reference_sets = prompt_sets(reference)
    for set_name, prompt_set in prompt_sets(record).items():
        reference_set = reference_sets.get(set_name)
        reference_categories = {c["name"]: c for c in (reference_set["categories"] if reference_set else [])}
        for category in prompt_set["categories"]:
            want = reference_categories.get(category["name"])
            got_ids = category.get("first_run_token_ids")
            problem = None
            if want is None:
                problem = f"the reference has no {set_name}/{category['name']} record"
            elif got_ids is None or want.get("first_run_token_ids") is None:
                side = "speculative" if got_ids is None else "reference"
                problem = f"the {side} run recorded no token ids (the server sent none)"
            yield (
                set_name,
                category["name"],
                got_ids,
                want and want.get("first_run_token_ids"),
                want and want.get("first_run_top_logprobs"),
                problem,
            )
    batch = record.get("batch")
    if batch is None:
        if require_batch:
            yield BATCH_SET, "all", None, None, None, "the speculative run recorded no concurrent batch"
        return
    reference_requests = {r["name"]: r for r in batch_requests(reference)}
    for request in batch["requests"]:
        want = reference_requests.get(request["name"])
        problem = None
        if want is None:
            problem = f"the reference has no concurrent-batch request {request['name']}"
        elif request.get("token_ids") is None or want.get("token_ids") is None:
            side = "speculative" if request.get("token_ids") is None else "reference"
            problem = f"the {side} run recorded no token ids (the server sent none)"
        ids, tops = (want.get("token_ids"), want.get("top_logprobs")) if want else (None, None)
        yield BATCH_SET, request["name"], request.get("token_ids"), ids, tops, problem


def compare(record: dict, reference: dict, continue_after=None, require_batch: bool = False) -> list[dict]:
    """One row per prompt set and category of `record` (a latency.json), and per request of its concurrent batch:
    its greedy ids against `reference`'s (lossless_reference's record, or a latency.json) for the same prompt.

    continue_after(row key, position, prefix, max_tokens): see compare_ids (recorded_continuations reads a
    reference's). A prompt the reference lacks, ids either side did not record, or (require_batch) no concurrent batch
    cannot be proven equal: the row fails with `problem` saying why rather than passing unchecked."""
    rows = []
    for set_name, name, got_ids, want_ids, want_tops, problem in paired_outputs(record, reference, require_batch):
        row = {"set": set_name, "category": name, "tokens": None, "passed": False, "near_tie": None}
        if problem:
            row.update(
                first_difference=None,
                near_ties=[],
                continuations=[],
                divergence=None,
                unchecked_after=None,
                problem=problem,
            )
        else:
            key = row_key(set_name, name)
            resume = (lambda *at, key=key: continue_after(key, *at)) if continue_after else None
            row.update(compare_ids(got_ids, want_ids, want_tops, resume), tokens=len(got_ids))
            row["passed"] = row["divergence"] is None and row["problem"] is None
            row["near_tie"] = row["near_ties"][0] if row["near_ties"] else None
        rows.append(row)
    return rows


def describe(row: dict) -> str:
    """One failing row in words: the set, the category, the differing position and the two ids."""
    where = (
        f"concurrent batch, request {row['category']}"
        if row["set"] == BATCH_SET
        else f"{row['set']} prompts, category {row['category']}"
    )
    if row["problem"]:
        return f"{where}: {row['problem']}"
    d = row["divergence"]
    if not row["near_ties"]:
        return (
            f"{where}: greedy output differs first at output token {d['position']} "
            f"(speculative {d['speculative']}, without speculation {d['reference']})"
        )
    ties = ", ".join(str(t["position"]) for t in row["near_ties"])
    return (
        f"{where}: greedy output differs at output token {d['position']} (speculative {d['speculative']}, without "
        f"speculation {d['reference']}, continued from the speculative output after the near tie at output token "
        f"{row['near_ties'][-1]['position']}; near ties passed at {ties})"
    )


def failures(rows: list[dict]) -> list[str]:
    return [describe(row) for row in rows if not row["passed"]]


def batch_requests(record: dict) -> list[dict]:
    """The requests of a record's concurrent batch (none when it recorded no batch)."""
    batch = record.get("batch")
    return batch["requests"] if batch else []


def reference_prompt_ids(reference: dict) -> dict[str, list[int] | None]:
    """{row key: the prompt ids the reference server tokenized for that row} (its first runs and its batch)."""
    keyed = {
        row_key(set_name, category["name"]): category.get("first_run_prompt_ids")
        for set_name, prompt_set in prompt_sets(reference).items()
        for category in prompt_set["categories"]
    }
    for request in batch_requests(reference):
        keyed[row_key(BATCH_SET, request["name"])] = request.get("prompt_token_ids")
    return keyed


def request_continuations(
    base_url: str, model: str, record: dict, reference: dict, ignore_eos: bool, log=print
) -> dict[str, list[dict]]:
    """{row key: [{after, prefix_sha256, token_ids, top_logprobs}]}: the reference server's (at base_url, speculation
    off) greedy continuations past each near tie of `record` (a speculative latency.json) that the check's walk
    reaches, each from the row's prompt ids (recorded in `reference`) followed by the speculative prefix."""
    prompts = reference_prompt_ids(reference)
    made: dict[str, list[dict]] = {}

    def continue_after(key: str, position: int, prefix: list[int], max_tokens: int) -> dict:
        if not prompts.get(key):
            raise StageError(f"the reference recorded no prompt token ids for {key}: cannot continue from them")
        answer = timed_completion(
            base_url, model, prompts[key] + prefix, max_tokens, ignore_eos, top_logprobs=REFERENCE_TOP_LOGPROBS
        )
        entry = {
            "after": position,
            "prefix_sha256": prefix_digest(prefix),
            "token_ids": answer["token_ids"] or [],
            "top_logprobs": answer["top_logprobs"],
        }
        made.setdefault(key, []).append(entry)
        log(f"{key}: near tie at output token {position}; the reference continued {len(entry['token_ids'])} tokens")
        return entry

    compare(record, reference, continue_after)
    return made


def needs_continuations(record: dict, reference: dict) -> bool:
    """Whether the check's walk of `record` against `reference` meets a near tie with output after it (then a
    reference server must continue from it; else none has to start)."""
    asked = []

    def refuse(*at) -> dict:
        asked.append(at)
        raise MissingContinuation("asked")

    compare(record, reference, refuse)
    return bool(asked)
