"""vLLM general plugin (entry point in _dist/): the rejection sampler of an all-greedy step as argmaxes of the raw
logits.

Why it exists: at temperature 0 vLLM 0.26's RejectionSampler.forward still takes its general path every speculative
step: the bonus tokens go through the whole Sampler (a float32 copy of their logits for logprobs nobody asked for,
the logits processors, then argmax), and the target logits are gathered, copied to float32, cloned, run through the
processors and the sampling constraints, and only then argmaxed. Each is a few host-launched ops, and a speculative
step on the H100 is host-bound: after the GDN metadata and the indices (gdn_spec_metadata, spec_decode_indices) the
rejection sampler is the largest host cost left of a step in a profiler trace. A greedy batch in which nothing can
move an argmax (no penalties, bad words, allowed-token masks, active min-tokens or logit-bias processors, thinking
budget, logprobs or synthetic acceptance) samples exactly the argmax of its raw logits: bf16 to float32 is exact, so
the argmax of the raw rows is the one vLLM takes. The plugin then runs vLLM's own `rejection_sample` on the raw
target rows and takes the bonus tokens by argmax; any other batch goes to vLLM's forward. tests/unit/test_lossless.py
compares both with vLLM's forward batch by batch.

serve.patches.greedy_rejection: false leaves vLLM's code alone.
"""

from __future__ import annotations

import functools

from serving.patches import guarded

_WRAPPED = "_serving_greedy_rejection"


@functools.cache
def _builtin_state() -> dict:
    """vLLM's two built-in processors that can move an argmax, each with the attribute that holds its requests."""
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinTokensLogitsProcessor

    return {MinTokensLogitsProcessor: "min_toks", LogitBiasLogitsProcessor: "biases"}


def _idle(processor) -> bool:
    """A processor that can move an argmax, with nothing to do in this batch (only vLLM's two built-in ones are
    known; any other sends the batch to vLLM's path)."""
    state = _builtin_state().get(type(processor))
    return state is not None and not getattr(processor, state)


def argmax_is_raw(rejection_sampler, sampling_metadata) -> bool:
    """Whether vLLM's forward would sample exactly the argmax of the raw logits and return no logprobs."""
    m = sampling_metadata
    if getattr(rejection_sampler, "synthetic_mode", False) or not m.all_greedy:
        return False
    if m.max_num_logprobs is not None or m.logprob_token_ids:
        return False
    if not m.no_penalties or m.allowed_token_ids_mask is not None or m.bad_words_token_ids:
        return False
    holder = m.thinking_budget_state_holder
    if holder is not None and holder.has_tracked_requests():
        return False
    return all(_idle(p) for p in m.logitsprocs.non_argmax_invariant)


def greedy_forward(original):
    # once, at registration: not on every step
    import torch
    from vllm.v1.outputs import SamplerOutput
    from vllm.v1.sample import rejection_sampler

    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        if not argmax_is_raw(self, sampling_metadata):
            return original(self, metadata, draft_probs, logits, sampling_metadata)
        assert metadata.max_spec_len <= rejection_sampler.MAX_SPEC_LEN
        # [batch, 1] int32, as the Sampler returns them
        bonus = logits[metadata.bonus_logits_indices].argmax(dim=-1).to(torch.int32).unsqueeze(-1)
        output = rejection_sampler.rejection_sample(
            metadata.draft_token_ids,
            metadata.num_draft_tokens,
            metadata.max_spec_len,
            metadata.cu_num_draft_tokens,
            None,  # draft probabilities: a greedy batch never reads them
            logits[metadata.target_logits_indices],
            bonus,
            sampling_metadata,
        )
        return SamplerOutput(sampled_token_ids=output, logprobs_tensors=None)

    setattr(forward, _WRAPPED, original)
    return forward


@guarded("greedy_rejection")
def register() -> None:
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    if not hasattr(RejectionSampler.forward, _WRAPPED):
        RejectionSampler.forward = greedy_forward(RejectionSampler.forward)
