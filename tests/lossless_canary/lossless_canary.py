"""A vLLM general plugin for tests only (never in the image): make speculation lossy on purpose.

With LOSSLESS_CANARY_FLIP=1 in the server's environment, every verify step in which a draft token was accepted
emits that accepted token with its lowest bit flipped (id ^ 1) instead. The model itself goes on from the right
token (its KV cache and GDN state saw it), so only the output stream is wrong, and only where speculation
accepted a draft: a server without speculation never calls the rejection sampler and is unaffected.

What it simulates: the realistic way speculation loses on Qwen3.5 (vLLM issue #39273: a rejected or short draft
leaves the Gated DeltaNet recurrent state advanced, and the tokens from there are a different model's) is a bug
inside the verify step; a corrupted *draft* would not do (the target verifies every draft, so a bad one only lowers
acceptance). Flipping an accepted token is the smallest change with the same symptom: greedy output ids that differ
from the non-speculative server's, at a position the lossless check must name.
"""

from __future__ import annotations

import os


def corrupt(output_token_ids):
    """output_token_ids [batch, K+1] (-1: rejected): flip the first token of every row that accepted a draft."""
    accepted = output_token_ids[:, 1] >= 0  # a second token means the first was an accepted draft
    output_token_ids[accepted, 0] ^= 1
    return output_token_ids


def register() -> None:
    if os.environ.get("LOSSLESS_CANARY_FLIP") != "1":
        return
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    forward = RejectionSampler.forward
    if getattr(forward, "_lossless_canary", False):
        return

    def flipped(self, *args, **kwargs):
        result = forward(self, *args, **kwargs)
        corrupt(result.sampled_token_ids)
        return result

    flipped._lossless_canary = True
    RejectionSampler.forward = flipped
