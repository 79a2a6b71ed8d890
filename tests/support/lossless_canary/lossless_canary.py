"""A vLLM general plugin for tests only (never in the image): make speculation lossy on purpose.

Two modes, switched by the server's environment; a server without speculation never calls the rejection sampler and
is unaffected by either.

LOSSLESS_CANARY_FLIP=1: every verify step in which a draft token was accepted emits that accepted token with its
lowest bit flipped (id ^ 1) instead. The model itself goes on from the right token (its KV cache and GDN state saw
it), so only the output stream is wrong, and only where speculation accepted a draft.

LOSSLESS_CANARY_AFTER_TIE=<nats>: lossy only after a near tie. Where a step's token won by at most <nats> over the
runner-up in this server's own logits, it emits the runner-up instead and rejects the rest of the step, as if the
target had picked the runner-up there (what a rounding difference between a K+1-token verify pass and one-token steps
can do), so the model goes on from it; the next step that accepts a draft then flips that draft's output id (id ^ 1,
as above), once, and the canary looks for the next tie. A check that stops comparing at the first near tie passes such
a server; one that continues the reference from the speculative prefix past the tie names the flipped token. One
request at a time: the state is the process's, not a request's.

What it simulates: the realistic way speculation loses on Qwen3.5 (vLLM issue #39273: a rejected or short draft
leaves the Gated DeltaNet recurrent state advanced, and the tokens from there are a different model's) is a bug
inside the verify step; a corrupted *draft* would not do (the target verifies every draft, so a bad one only lowers
acceptance). Flipping an accepted token is the smallest change with the same symptom: greedy output ids that differ
from the non-speculative server's, at a position the lossless check must name.

It wraps RejectionSampler.__call__ (nn.Module's, which the model runner calls), not forward, so it sees every step
whatever serving.patches.greedy_rejection does to forward, in whichever order the plugins load.
"""

from __future__ import annotations

import os


def corrupt(output_token_ids):
    """output_token_ids [batch, K+1] (-1: rejected): flip the first token of every row that accepted a draft. A step
    that drafted nothing has one column (vLLM 0.32 sizes it by the step's longest draft): nothing was accepted."""
    if output_token_ids.shape[1] < 2:
        return output_token_ids
    accepted = output_token_ids[:, 1] >= 0  # a second token means the first was an accepted draft
    output_token_ids[accepted, 0] ^= 1
    return output_token_ids


class AfterTie:
    """LOSSLESS_CANARY_AFTER_TIE's state: a near tie taken the other way, then one flipped accepted draft."""

    def __init__(self, nats: float):
        self.nats = nats
        self.armed = False  # a tie was taken the other way: flip the next accepted draft
        self.ties = self.flips = 0

    def __call__(self, metadata, top, output_token_ids) -> None:
        """top: (values, indices) of the two largest logits of every row of the step's logits, taken before the
        sampler ran (it may change logits in place)."""
        if self.armed:
            if output_token_ids.shape[1] < 2:  # no draft this step: nothing accepted to flip
                return
            accepted = (output_token_ids[:, 1] >= 0).nonzero()
            if len(accepted):
                output_token_ids[int(accepted[0]), 0] ^= 1
                self.armed, self.flips = False, self.flips + 1
            return
        if not bool((metadata.draft_token_ids != 0).any()):
            return  # vLLM's dummy sampler run at start (drafts all id 0, random logits): no request's step
        values, indices = top
        draft_end = metadata.cu_num_draft_tokens.tolist()
        for row, drafts in enumerate(metadata.num_draft_tokens):
            emitted = int((output_token_ids[row] >= 0).sum())  # accepted drafts, then the recovered or bonus token
            for position in range(emitted):
                if position < drafts:
                    logits_row = int(metadata.target_logits_indices[draft_end[row] - drafts + position])
                else:
                    logits_row = int(metadata.bonus_logits_indices[row])
                margin = float(values[logits_row, 0] - values[logits_row, 1])
                if margin <= self.nats and int(output_token_ids[row, position]) == int(indices[logits_row, 0]):
                    # the runner-up as this step's recovered token: the drafts after it rejected
                    output_token_ids[row, position] = indices[logits_row, 1]
                    output_token_ids[row, position + 1 :] = -1
                    self.armed, self.ties = True, self.ties + 1
                    print(f"[lossless-canary] near tie ({margin:.4f} nats) taken the other way", flush=True)
                    return


def register() -> None:
    flip = os.environ.get("LOSSLESS_CANARY_FLIP") == "1"
    tie_nats = os.environ.get("LOSSLESS_CANARY_AFTER_TIE")
    if not flip and not tie_nats:
        return
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    call = RejectionSampler.__call__
    if getattr(call, "_lossless_canary", False):
        return
    after_tie = AfterTie(float(tie_nats)) if tie_nats else None

    def lossy(self, metadata, draft_probs, logits, sampling_metadata):
        top = logits.float().topk(2, dim=-1) if after_tie else None
        result = call(self, metadata, draft_probs, logits, sampling_metadata)
        if after_tie:
            after_tie(metadata, top, result.sampled_token_ids)
        else:
            corrupt(result.sampled_token_ids)
        return result

    lossy._lossless_canary = True
    RejectionSampler.__call__ = lossy
