"""vLLM general plugin (entry point in _dist/): a verify step's logit and draft indices kept on the GPU per batch
shape, instead of recomputed and copied to the GPU every step.

Why it exists: vLLM 0.26's runner builds a speculative step's indices (`_calc_spec_decode_metadata`: which logits
are the drafts' targets, which the bonus tokens', the draft-count prefix sums) on the host with numpy and copies each
of the five arrays to the GPU through pinned memory: five pins and five host-to-device copies every step, which a
profiler trace of a captured padded ngram_gpu step on an H100 counts among its remaining host costs.
Those arrays depend on the draft counts and the scheduled-token prefix sums only. With padded drafts every decode
step of a batch has the same counts, so the arrays are the same step after step; the plugin keeps them, per batch
shape, for steps in which every request verifies its drafts (no prefill, no plain decode), and gathers the step's
draft token ids from the input ids through one kept index. A step of any other shape goes to vLLM's own code.
tests/unit/test_lossless.py compares both with vLLM's code step by step.

serve.patches.spec_decode_indices: false leaves vLLM's code alone.
"""

from __future__ import annotations

from dataclasses import replace

from serving.patches import guarded

_WRAPPED = "_serving_spec_decode_indices"
_KEPT = "_serving_spec_decode_kept"
MAX_SHAPES = 64  # batch shapes kept per runner: a verify-only batch has one per (requests, draft counts)


def verify_only_key(num_draft_tokens, cu_num_scheduled_tokens):
    """The batch shape when every request schedules exactly its drafts plus one token, else None."""
    drafts = num_draft_tokens.tolist()
    scheduled = cu_num_scheduled_tokens.tolist()
    if len(drafts) != len(scheduled) or not drafts:
        return None
    previous = 0
    for draft, total in zip(drafts, scheduled, strict=True):
        if total - previous != draft + 1:
            return None
        previous = total
    return tuple(drafts)


def kept_indices(original):
    def calc(self, num_draft_tokens, cu_num_scheduled_tokens):
        key = verify_only_key(num_draft_tokens, cu_num_scheduled_tokens)
        if key is None:
            return original(self, num_draft_tokens, cu_num_scheduled_tokens)
        kept = self.__dict__.setdefault(_KEPT, {})
        entry = kept.get(key)
        if entry is None:
            metadata = original(self, num_draft_tokens, cu_num_scheduled_tokens)
            if len(kept) >= MAX_SHAPES:
                kept.clear()
            # vLLM gathers input_ids[logits_indices][target_logits_indices + 1]: one index does both
            kept[key] = (metadata, metadata.logits_indices[metadata.target_logits_indices + 1])
            return metadata
        metadata, draft_index = entry
        return replace(
            metadata,
            draft_token_ids=self.input_ids.gpu[draft_index],
            num_draft_tokens=list(metadata.num_draft_tokens),
        )

    setattr(calc, _WRAPPED, original)
    return calc


@guarded("spec_decode_indices")
def register() -> None:
    from vllm.v1.worker import gpu_model_runner

    cls = gpu_model_runner.GPUModelRunner
    if not hasattr(cls._calc_spec_decode_metadata, _WRAPPED):
        cls._calc_spec_decode_metadata = kept_indices(cls._calc_spec_decode_metadata)
