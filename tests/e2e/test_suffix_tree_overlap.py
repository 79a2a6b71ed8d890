"""serving.patches.suffix_tree_overlap against vLLM 0.32's own SuffixDecodingProposer.propose and arctic-inference's
cache, in the serve venv: the same scripted steps (a chunked prefill, requests arriving, finishing and evicted from a
small cross-request cache) through vLLM's propose as it is and through the patch, which builds the prompt trees
when execute_model has queued the forward, before propose. The model runner around them is a stand-in that keeps
the input batch as vLLM's does; the GPU proof times the real one (gpu_proof/floor.py --ab suffix_tree_overlap)."""

from __future__ import annotations

import pytest

from conftest import ROOT, serve_venv_json

CHECK = r"""
import json, sys
from types import SimpleNamespace
import numpy as np
sys.path.insert(0, sys.argv[1])
from arctic_inference.suffix_decoding import SuffixDecodingCache
from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer
from serving.patches import suffix_tree_overlap as patch

K, ROWS, WIDTH = 4, 4, 1024
PATTERN = [11, 12, 13, 14, 15, 16, 17]


def prompt(n, shift):
    return [PATTERN[(i + shift) % len(PATTERN)] + 100 * (i % 3 == 0) for i in range(n)]


# requests: prompt, the step they arrive, their prefill chunks (tokens a step), how many tokens they generate
REQUESTS = {
    "a": (prompt(300, 0), 0, [200, 100], 6),
    "b": (prompt(40, 2), 1, [40], 3),
    "c": (prompt(120, 1), 3, [120], 4),
    "d": (prompt(90, 0), 5, [60, 30], 3),
}


def sampled_token(req, position):  # what the "model" samples: a continuation of the pattern, drafts must match it
    return PATTERN[(position + len(req)) % len(PATTERN)]


class Runner:
    # the model runner as the proposer sees it: requests, an input batch, execute_model's bookkeeping
    def __init__(self, drafter):
        self.drafter, self.requests, self.built_on = drafter, {}, {}
        self.input_batch = SimpleNamespace(
            req_ids=[], req_id_to_index={}, num_tokens_no_spec=np.zeros(ROWS, dtype=np.int64),
            num_prompt_tokens=np.zeros(ROWS, dtype=np.int64), token_ids_cpu=np.zeros((ROWS, WIDTH), dtype=np.int32))

    def execute_model(self, scheduler_output):
        return None


def scheduled(step, progress):
    plan = {}
    for req, (tokens, arrives, chunks, generate) in REQUESTS.items():
        done_chunks, generated = progress.get(req, (0, 0))
        if step < arrives or generated >= generate:
            continue
        plan[req] = chunks[done_chunks] if done_chunks < len(chunks) else 1
    return plan


def run(proposer_class, runner_class):
    drafter = object.__new__(proposer_class)
    drafter.num_speculative_tokens, drafter.max_tree_depth, drafter.max_spec_factor = K, 64, 3.0
    drafter.min_token_prob, drafter.max_model_len = 0.1, WIDTH
    drafter.suffix_cache = SuffixDecodingCache(max_tree_depth=64, max_cached_requests=2)  # evicts in the run
    runner, progress, steps = runner_class(drafter), {}, []
    batch = runner.input_batch
    for step in range(14):
        plan = scheduled(step, progress)
        if not plan:
            break
        # vLLM's _update_states: finished requests leave the batch, new ones take a row with their whole prompt
        for req in [r for r in batch.req_ids if r not in plan]:
            batch.req_ids.remove(req)
            runner.requests.pop(req)
        for req in plan:
            if req not in runner.requests:
                tokens = REQUESTS[req][0]
                runner.requests[req] = SimpleNamespace(num_computed_tokens=0, num_tokens=len(tokens))
                batch.req_ids.append(req)
        batch.req_id_to_index = {req: index for index, req in enumerate(batch.req_ids)}
        for req, index in batch.req_id_to_index.items():
            tokens = REQUESTS[req][0]
            state = runner.requests[req]
            generated = state.num_tokens - len(tokens)
            batch.num_prompt_tokens[index] = len(tokens)
            row = tokens + [sampled_token(req, p) for p in range(generated)]
            batch.token_ids_cpu[index, : len(row)] = row
            batch.num_tokens_no_spec[index] = len(row)
        output = SimpleNamespace(num_scheduled_tokens=dict(plan))
        before = set(drafter.suffix_cache.active_requests)
        runner.execute_model(output)
        steps.append({"started_early": sorted(set(drafter.suffix_cache.active_requests) - before)})
        # the sample: a token for each request whose scheduled tokens reach its end
        sampled = []
        for req in batch.req_ids:
            state = runner.requests[req]
            done = state.num_computed_tokens + plan[req] >= state.num_tokens
            sampled.append([sampled_token(req, state.num_tokens - len(REQUESTS[req][0]))] if done else [])
        drafts = drafter.propose(K, batch, sampled)
        cache = drafter.suffix_cache
        steps[-1] |= {"drafts": [list(d) for d in drafts], "active": sorted(cache.active_requests),
                      "cached": sorted(cache.cached_requests)}
        # each prompt tree's size: a tree of other tokens than vLLM's drafts the same here yet differs there
        steps[-1]["trees"] = {req: tree.estimate_memory() for req, tree in cache._local_trees.items()}
        for req, ids in zip(batch.req_ids, sampled):
            state = runner.requests[req]
            chunks_done, generated = progress.get(req, (0, 0))
            state.num_computed_tokens += plan[req]
            if ids:
                state.num_tokens += 1
                generated += 1
            progress[req] = (chunks_done + 1, generated)
    return steps


class Patched(SuffixDecodingProposer):
    pass


class PatchedRunner(Runner):
    pass


patch.apply(PatchedRunner, Patched)
plain, patched = run(SuffixDecodingProposer, Runner), run(Patched, PatchedRunner)


class Failing(SuffixDecodingProposer):
    pass


class FailingRunner(Runner):
    pass


patch.apply(FailingRunner, Failing)
failing = object.__new__(Failing)
failing.max_model_len, failing.suffix_cache = WIDTH, SuffixDecodingCache(max_tree_depth=64)
failing.suffix_cache.start_request = lambda req_id, prompt: (_ for _ in ()).throw(ValueError("build failed: " + req_id))
runner = FailingRunner(failing)
runner.requests["z"] = SimpleNamespace(num_computed_tokens=0, num_tokens=3)
runner.input_batch.req_ids, runner.input_batch.num_prompt_tokens[0] = ["z"], 3
runner.input_batch.num_tokens_no_spec[0] = 3
try:
    runner.execute_model(SimpleNamespace(num_scheduled_tokens={"z": 3}))
    error = None
except ValueError as raised:
    error = str(raised)

from vllm.v1.worker.gpu_model_runner import GPUModelRunner
patch.register.__wrapped__()
real = {"runner": hasattr(GPUModelRunner.execute_model, patch._WRAPPED)}
print(json.dumps({"plain": plain, "patched": patched, "error": error, "real": real}))
"""


@pytest.fixture(scope="module")
def overlap(tiny_venvs):
    return serve_venv_json(tiny_venvs, CHECK, str(ROOT))


@pytest.mark.e2e
def test_the_patched_proposer_drafts_what_vllms_drafts_step_after_step(overlap):
    """Every step's drafts and the cache's active and cached requests equal vLLM's own propose's, through a chunked
    prefill, arrivals, finished requests and evictions; and the drafts are not all empty (the copy matches)."""
    plain, patched = overlap["plain"], overlap["patched"]
    assert len(plain) == len(patched) >= 8
    for step, (mine, theirs) in enumerate(zip(patched, plain, strict=True)):
        assert mine["drafts"] == theirs["drafts"], f"step {step}"
        assert (mine["active"], mine["cached"]) == (theirs["active"], theirs["cached"]), f"step {step}"
        assert mine["trees"] == theirs["trees"], f"step {step}"
    assert sum(len(draft) for step in plain for draft in step["drafts"]) > 10
    assert {"a", "b", "c", "d"} - {r for step in plain for r in step["cached"]} == set()


@pytest.mark.e2e
def test_the_trees_are_built_before_propose_for_the_requests_it_would_start(overlap):
    """A chunked prefill's first chunk starts no tree; its last one does, with the request arriving beside it; vLLM's
    own propose never finds one to start."""
    pending = [step["started_early"] for step in overlap["patched"]]
    assert pending[0] == [], pending
    assert pending[1] == ["a", "b"], pending
    assert ["c"] in pending and ["d"] in pending
    assert pending.index(["d"]) > pending.index(["c"]) + 1  # d's first chunk started nothing
    assert all(step["started_early"] == [] for step in overlap["plain"])


@pytest.mark.e2e
def test_a_failed_build_fails_the_step_and_the_patch_wraps_vllms_runner(overlap):
    assert overlap["error"] == "build failed: z"
    assert overlap["real"] == {"runner": True}
