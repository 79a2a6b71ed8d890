"""vLLM general plugin (entry point in _dist/): a verify step's input ids written on the GPU by two strided copies.

Why it exists: under async scheduling vLLM 0.26's runner writes a step's input ids on the GPU from the previous
step's sampled tokens and drafts (`_prepare_input_ids`). For any step that is not plain one-token decodes, which is
every speculative step, it builds four index lists in Python, makes each a new pinned tensor, copies it to the GPU
and scatters twice: 0.26 ms of host time a step at K=2, against 0.07 ms for a plain step (py-spy on the H100,
results/gpu-proof/h100-silent-k). A silent copy drafter's step is host-bound, so that is latency.

When every request of the step sits in the slot it had last step and verifies the same number D of drafts, no more
than the previous step's draft tensor holds, vLLM's lists are fixed: request i's sampled token goes to i*(D+1) from
prev_sampled_token_ids[i, 0], its drafts to i*(D+1)+1.. from the draft tensor's row i. Two strided copies write
exactly that. Any other step (a new, finished or moved request, a prefill, uneven drafts, prompt embeddings) goes to
vLLM's code. tests/test_lossless.py compares both with vLLM's code step by step.

SERVING_DRAFT_INPUT_IDS=0 leaves vLLM's code alone.
"""

from __future__ import annotations

import os

ENV = "SERVING_DRAFT_INPUT_IDS"
_WRAPPED = "_serving_draft_input_ids"


def uniform_drafts(runner, scheduler_output, num_reqs: int, total_tokens: int, cu_num_tokens) -> int | None:
    """D when vLLM's index lists are the fixed ones of the module's doc (every request in its slot, D drafts each,
    within the previous step's draft tensor), else None."""
    batch = runner.input_batch
    sampled, drafts = batch.prev_sampled_token_ids, runner._draft_token_ids
    # a list of lists (a CPU drafter's) or None has no ndim
    if sampled is None or runner.enable_prompt_embeds or getattr(drafts, "ndim", 0) != 2 or num_reqs < 1:
        return None
    if drafts.shape[1] != runner.prev_num_spec_tokens or min(drafts.shape[0], sampled.shape[0]) < num_reqs:
        return None
    spec = scheduler_output.scheduled_spec_decode_tokens
    req_ids = batch.req_ids
    width = len(spec.get(req_ids[0], ()))
    if not 0 < width <= drafts.shape[1] or total_tokens != num_reqs * (width + 1):
        return None
    previous = runner.prev_positions.np
    for index in range(num_reqs):
        if previous[index] != index or cu_num_tokens[index] != (index + 1) * (width + 1):
            return None
        if len(spec.get(req_ids[index], ())) != width:
            return None
    return width


def strided_input_ids(original):
    def prepare(self, scheduler_output, num_reqs, total_num_scheduled_tokens, cu_num_tokens):
        width = uniform_drafts(self, scheduler_output, num_reqs, total_num_scheduled_tokens, cu_num_tokens)
        if width is None:
            return original(self, scheduler_output, num_reqs, total_num_scheduled_tokens, cu_num_tokens)
        ids = self.input_ids.gpu[: num_reqs * (width + 1)].view(num_reqs, width + 1)
        ids[:, 0].copy_(self.input_batch.prev_sampled_token_ids[:num_reqs, 0])
        ids[:, 1:].copy_(self._draft_token_ids[:num_reqs, :width])
        return None

    setattr(prepare, _WRAPPED, original)
    return prepare


def register() -> None:
    if os.environ.get(ENV) == "0":
        return
    from vllm.v1.worker import gpu_model_runner

    cls = gpu_model_runner.GPUModelRunner
    if not hasattr(cls._prepare_input_ids, _WRAPPED):
        cls._prepare_input_ids = strided_input_ids(cls._prepare_input_ids)
