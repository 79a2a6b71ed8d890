"""vLLM general plugin (entry point in _dist/): the GDN metadata of a verify step in which every request carries
drafts, built with slices instead of the general path's masks, syncs and index gathers.

Why it exists: on an H100 a captured speculative step (padded ngram_gpu) spent several times a plain step's profiled
host time; the largest block after the drafter was vLLM 0.26's GDN metadata builder in its speculative branch, run
once per GDN KV-cache group (three on Qwen3.5-4B) with the same inputs but the block table. vLLM 0.32's build
(vllm/v1/attention/backends/gdn_attn.py GDNAttentionMetadataBuilder.build) slices the block table and the accepted
counts of an all-speculative batch now, and its model runner V2 builds once a step and re-gathers the other groups'
block tables (update_block_table); but every build still pins the draft-count mask and copies it to the GPU, makes
`.item()`s and a uniform-length check on CPU tensors, builds a fresh arange and an empty index, and copies and fills
all of it into the builder's persistent CUDA-graph buffers; the V1 runner (suffix) still builds three times a step.

When every request of the batch is a speculative decode (each draft count >= 0, some > 0; what padded drafts give at
every step) and the batch fits the FULL graph, the general path's mask is all True, so every masked gather is a
slice and the token index is 0..T-1. This path writes the same persistent buffers with three copies (block table
columns, query starts, accepted counts) and refills the all-True mask and the token index only when the batch shape
changed or the general path wrote them since; the host copy of the mask (what update_block_table reads) is kept per
batch size. Any other batch (prefills, plain decodes, padded requests, no drafts,
no FULL graphs) goes to vLLM's own build unchanged. tests/unit/test_lossless.py compares the two field by field on
vLLM's own builder.

serve.patches.gdn_spec_metadata: false leaves vLLM's build alone (the GPU proof measures the step both ways).
"""

from __future__ import annotations

from serving.patches import guarded

_WRAPPED = "_serving_gdn_spec_metadata"
_FILLED = "_serving_gdn_filled"  # (requests, tokens) whose mask and token index the persistent buffers hold
_MASK_CPU = "_serving_gdn_mask_cpu"  # the all-True host mask of the last batch size


def all_spec_batch(builder, metadata, num_accepted_tokens, num_decode_draft_tokens_cpu):
    """(requests, tokens) when the batch takes the fast path, else None (see the module's doc)."""
    if not (builder.use_spec_decode and builder.use_full_cuda_graph):
        return None
    if num_decode_draft_tokens_cpu is None or num_accepted_tokens is None:
        return None
    drafts = num_decode_draft_tokens_cpu.tolist()
    requests = metadata.num_reqs
    if len(drafts) != requests or not drafts or min(drafts) < 0:
        return None
    drafted = sum(drafts)
    tokens = int(metadata.query_start_loc_cpu[requests])
    # a request with d drafts verifies d + 1 tokens, at most K + 1
    if drafted == 0 or tokens != requests + drafted or max(drafts) > builder.num_spec:
        return None
    if requests > builder.decode_cudagraph_max_bs or tokens > builder.decode_cudagraph_max_bs:
        return None
    return requests, tokens


def build_all_spec(builder, metadata, num_accepted_tokens, requests: int, tokens: int, metadata_cls, block_table):
    """The metadata vLLM's build returns for an all-speculative batch on FULL graphs, in its persistent buffers."""
    import torch  # already imported by vLLM: a dictionary look-up

    width = builder.num_spec + 1
    state_indices = builder.spec_state_indices_tensor[:requests]
    state_indices.copy_(block_table[:requests, :width], non_blocking=True)
    query_start_loc = builder.spec_query_start_loc[: requests + 1]
    query_start_loc.copy_(metadata.query_start_loc[: requests + 1], non_blocking=True)
    accepted = builder.num_accepted_tokens[:requests]
    accepted.copy_(num_accepted_tokens[:requests], non_blocking=True)
    if getattr(builder, _FILLED, None) != (requests, tokens):
        builder.spec_sequence_masks[:requests].fill_(True)
        builder.spec_token_indx[:tokens].copy_(
            torch.arange(tokens, dtype=builder.spec_token_indx.dtype, device=builder.spec_token_indx.device)
        )
        setattr(builder, _FILLED, (requests, tokens))
    mask_cpu = getattr(builder, _MASK_CPU, None)
    if mask_cpu is None or mask_cpu.shape[0] != requests:
        mask_cpu = torch.ones(requests, dtype=torch.bool)
        setattr(builder, _MASK_CPU, mask_cpu)
    # vLLM's uniform_spec_sequence_length: every request verifies the same number of tokens
    uniform = tokens // requests if tokens % requests == 0 and _uniform(metadata, requests) else None
    return metadata_cls(
        num_prefills=0,
        num_prefill_tokens=0,
        num_decodes=0,
        num_decode_tokens=0,
        num_spec_decodes=requests,
        num_spec_decode_tokens=tokens,
        num_actual_tokens=metadata.num_actual_tokens,
        spec_query_start_loc=query_start_loc,
        spec_state_indices_tensor=state_indices,
        spec_sequence_masks=builder.spec_sequence_masks[:requests],
        spec_sequence_masks_cpu=mask_cpu,
        spec_token_indx=builder.spec_token_indx[:tokens],
        non_spec_token_indx=builder.non_spec_token_indx[:0],
        num_accepted_tokens=accepted,
        uniform_spec_sequence_length=uniform,
    )


def _uniform(metadata, requests: int) -> bool:
    """Whether every request's query (drafts + 1) has the same length, read from the host query starts."""
    starts = metadata.query_start_loc_cpu[: requests + 1].tolist()
    first = starts[1] - starts[0]
    return all(b - a == first for a, b in zip(starts, starts[1:], strict=False))


def fast_build(original, metadata_cls, block_table_for, log=None):
    def build(
        self,
        common_prefix_len,
        common_attn_metadata,
        num_accepted_tokens=None,
        num_decode_draft_tokens_cpu=None,
        fast_build=False,
    ):
        batch = all_spec_batch(self, common_attn_metadata, num_accepted_tokens, num_decode_draft_tokens_cpu)
        if batch is None:
            setattr(self, _FILLED, None)  # the general path may rewrite the mask and token index buffers
            return original(
                self, common_prefix_len, common_attn_metadata, num_accepted_tokens, num_decode_draft_tokens_cpu,
                fast_build,
            )  # fmt: skip
        block_table = block_table_for(self, common_attn_metadata)
        if log is not None and not getattr(build, "_logged", False):
            build._logged = True  # the tests and the GPU proof read this line to know the path is taken
            log(f"gdn spec metadata: all-speculative batch of {batch[0]} built from slices")
        return build_all_spec(self, common_attn_metadata, num_accepted_tokens, *batch, metadata_cls, block_table)

    setattr(build, _WRAPPED, original)
    return build


@guarded("gdn_spec_metadata")
def register() -> None:
    from vllm.logger import init_logger
    from vllm.v1.attention.backends import gdn_attn
    from vllm.v1.attention.backends.utils import mamba_get_block_table_tensor

    def block_table_for(builder, metadata):
        # as vLLM's build reads it: the runner V2's precomputed indices where it set them, else a gather of the last
        # blocks in mamba_cache_mode "align"
        aligned = getattr(builder, "mamba_aligned_state_indices", None)
        if aligned is not None:
            return aligned[: metadata.num_reqs]
        return mamba_get_block_table_tensor(
            metadata.block_table_tensor,
            metadata.seq_lens,
            builder.kv_cache_spec,
            builder.vllm_config.cache_config.mamba_cache_mode,
        )

    cls = gdn_attn.GDNAttentionMetadataBuilder
    if not hasattr(cls.build, _WRAPPED):
        logger = init_logger("vllm.plugins.serving_gdn_spec_metadata")
        cls.build = fast_build(cls.build, gdn_attn.GDNAttentionMetadata, block_table_for, logger.info)
