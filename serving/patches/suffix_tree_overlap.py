"""vLLM general plugin (entry point in _dist/): suffix decoding's prompt tree built while the GPU runs the prefill
(serve.patches.suffix_tree_overlap).

Why it exists: vLLM 0.32's SuffixDecodingProposer builds a request's prompt suffix tree (arctic-inference's
`SuffixDecodingCache.start_request`) inside its first `propose`, which the V1 model runner calls only after the
prefill's sampled token is on the host: the GPU idles while the host builds it, and the first token waits for it.
On an 8,192-token prompt with the catalog's 64-deep tree the build costs 16-35 ms of host time (natural text to a
repeated sentence, measured on a 2-core Xeon), paid by every request's time to first token.

The patch builds those trees as soon as `execute_model` has queued the step's forward, for the requests whose
prefill completes in this step (exactly the ones `propose` would start: sampled this step, not active in the cache),
in batch order, on the main thread: the host builds while the GPU runs the queued prefill, then launches the sampler
and waits as before, so a build never costs more than it did and is hidden where the prefill outlasts it. The trees
are the ones `propose` would build from the same prompt tokens, so the drafts are unchanged; only the moment of the
build moves. (A worker thread does worse: arctic-inference's extension holds the GIL while it builds, and handing
the GIL to a thread cost a 64-token first step 4 ms on the H200.)
"""

from __future__ import annotations

from serving.patches import guarded

_WRAPPED = "_serving_suffix_tree_overlap"


def prompts_to_start(runner, scheduler_output) -> list[tuple[str, object]]:
    """(request id, prompt token ids) of each request in the batch that samples this step and whose prompt tree
    the suffix cache does not hold yet, in batch order: the ones SuffixDecodingProposer.propose would start."""
    drafter = runner.drafter
    cache = drafter.suffix_cache
    batch = runner.input_batch
    scheduled = scheduler_output.num_scheduled_tokens
    starting = []
    for index, req_id in enumerate(batch.req_ids):
        state = runner.requests.get(req_id)
        if state is None or req_id in cache.active_requests or req_id not in scheduled:
            continue
        if state.num_computed_tokens + scheduled[req_id] < state.num_tokens:
            continue  # a partial prefill: propose skips it this step
        if batch.num_tokens_no_spec[index] >= drafter.max_model_len:
            continue
        starting.append((req_id, batch.token_ids_cpu[index, : batch.num_prompt_tokens[index]]))
    return starting


def start_prompts(cache, starting) -> None:
    """What SuffixDecodingProposer.propose does for a request it has not started, for each of `starting`."""
    for req_id, prompt in starting:
        if req_id in cache.cached_requests:
            cache.evict_cached_response(req_id)
        cache.start_request(req_id, prompt)


def _execute_model(execute_model, proposer_class):
    def wrapper(self, scheduler_output, *args, **kwargs):
        output = execute_model(self, scheduler_output, *args, **kwargs)
        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, proposer_class):
            start_prompts(drafter.suffix_cache, prompts_to_start(self, scheduler_output))
        return output

    setattr(wrapper, _WRAPPED, execute_model)
    return wrapper


def apply(runner_class, proposer_class) -> None:
    if hasattr(runner_class.execute_model, _WRAPPED):
        return
    runner_class.execute_model = _execute_model(runner_class.execute_model, proposer_class)
    from vllm.logger import init_logger

    init_logger("vllm.plugins.serving_suffix_tree_overlap").info("suffix tree overlap: prompt trees built early")


@guarded("suffix_tree_overlap")
def register() -> None:
    from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    apply(GPUModelRunner, SuffixDecodingProposer)
