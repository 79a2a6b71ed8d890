"""The lossless check: greedy ids with speculation equal those without it, or the variant is refused.

Unit tests on crafted records (a flipped id must be caught, named by set, category, position and both ids; a near
tie is passed and the comparison continues from the speculative prefix, so a later flip is caught too; the concurrent
batch is compared the same way), the wiring (select skips a refused variant ungated and says why, tarball refuses it,
the DAG puts the check before it). tests/e2e/test_lossless.py makes speculation lossy for real and shows the check
failing on a real server's ids.
"""

import contextlib
import copy
import json
from types import SimpleNamespace

import pytest

import lossless
import tarball
from conftest import ROOT, TINY, snakemake
from lib import lossless as check_lib
from lib.dag import selection
from lib.stage import StageError, validate_json
from unit.test_sweeps import latency

SCHEMA = ROOT / "schemas" / "lossless.schema.yaml"
MTP = {"method": "mtp", "k": 2}


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
