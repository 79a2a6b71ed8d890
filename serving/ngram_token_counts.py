"""vLLM general plugin (entry point in _dist/): ngram_gpu's per-step token counts copied to the GPU as one slice.

Why it exists: every step, vLLM 0.26 refreshes the GPU copy of each request's token count for ngram_gpu from the
host's (`update_ngram_gpu_tensors_incremental`, then `_sync_num_tokens`): it turns the batch's slots into a new
tensor, copies it into pinned memory and to the GPU, gathers the counts on the host by those slots, stages them in
pinned memory, copies them to the GPU and scatters them by slot. That is 0.30 ms of host time a step at K=2 (py-spy
on the H100, results/gpu-proof/h100-silent-k), in a silent copy drafter's step that is host-bound.

When the batch holds the same requests in the same slots as the previous step, none of them new, and those slots are
0..n-1, vLLM copies nothing but the counts, and its gather and scatter by slot are the identity: the counts of slots
0..n-1 staged in the same pinned buffer and copied to the GPU as one slice are the same values in the same places.
Any other step (a new, resumed, finished or moved request, the first step) goes to vLLM's code.
tests/test_lossless.py compares both with vLLM's code step by step.

SERVING_NGRAM_TOKEN_COUNTS=0 leaves vLLM's code alone.
"""

from __future__ import annotations

import os

ENV = "SERVING_NGRAM_TOKEN_COUNTS"
_WRAPPED = "_serving_ngram_token_counts"


def steady_slots(input_batch, new_reqs) -> int | None:
    """n when the batch's requests are last step's, in the same slots 0..n-1, and none is new; else None."""
    slots = input_batch.req_id_to_index
    if new_reqs or not slots or input_batch.prev_req_id_to_index != slots:
        return None
    n = len(slots)
    return n if sorted(slots.values()) == list(range(n)) else None


def counts_as_slice(original):
    def update(
        input_batch,
        token_ids_gpu_tensor,
        num_tokens_no_spec_gpu,
        new_reqs,
        device,
        _pinned_idx_buf,
        _pinned_val_buf,
    ):
        n = steady_slots(input_batch, new_reqs)
        if n is None:
            return original(
                input_batch,
                token_ids_gpu_tensor,
                num_tokens_no_spec_gpu,
                new_reqs,
                device,
                _pinned_idx_buf=_pinned_idx_buf,
                _pinned_val_buf=_pinned_val_buf,
            )
        staged = _pinned_val_buf[:n]
        staged.copy_(input_batch.num_tokens_no_spec_cpu_tensor[:n])
        num_tokens_no_spec_gpu[:n].copy_(staged, non_blocking=True)
        return None

    setattr(update, _WRAPPED, original)
    return update


def register() -> None:
    if os.environ.get(ENV) == "0":
        return
    from vllm.v1.worker import gpu_model_runner

    # the runner calls the name it imported from ngram_proposer_gpu: patch that name
    if not hasattr(gpu_model_runner.update_ngram_gpu_tensors_incremental, _WRAPPED):
        gpu_model_runner.update_ngram_gpu_tensors_incremental = counts_as_slice(
            gpu_model_runner.update_ngram_gpu_tensors_incremental
        )
