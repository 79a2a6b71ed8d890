"""vLLM general plugin (entry point to add in _dist/): a step in which no request carries a draft replays a FULL CUDA
graph of 1 token per request, while steps with drafts keep the padded 1 + K FULL graph (SERVING_SILENT_DRAFTS=1).

Why it exists: with copy-style drafters (suffix, ngram) and num_speculative_tokens = K, vLLM 0.26 captures FULL
graphs only for uniform batches of query length 1 + K (CudagraphDispatcher.uniform_decode_query_len). A step in which
nobody drafted is 1 token per request, not "uniform decode" in that sense, so it runs as PIECEWISE graphs with every
GDN and attention layer eager: 12.3 ms on an H100 for ~3 ms of GPU work. serving/draft_padding.py makes every step a
FULL 1 + K replay, but then pays 8-13 ms to verify K pad tokens that are rarely accepted on fresh text.

Policy, per step (drafts_for_step): if any request drafted, or any request accepted drafts in the step just verified,
pad every draft to K (draft_padding.pad); otherwise give every request an empty draft: the scheduler then schedules no
spec tokens, the runner builds no spec_decode_metadata (no rejection sampler) and the GDN builder takes its non-spec
decode branch, i.e. a plain decode step. The "accepted" clause is a correctness guard, not a speed choice: after a spec
step that accepted a >= 2 tokens, the GDN recurrent state sits in block-table column a - 1 and the conv state at offset
a - 1, but a non-spec step reads column / offset 0 (vLLM issue #39273, open in 0.26 with mamba_cache_mode="none"), so
a silent step may only follow a step that accepted nothing; the padded step in between reads the right column.

Dispatch: the dispatcher gets extra FULL keys BatchDescriptor(num_tokens=n, num_reqs=n, uniform=True) for n in vLLM's
small sizes up to max_num_seqs (1, 2, 4, 8 for max_num_seqs 8), with their own padding table (the capture sizes are
rounded to multiples of 1 + K, so 1..8 would otherwise pad to 25). They cannot collide with the 1 + K keys
(num_reqs = num_tokens / (1 + K) there). At run time, a batch with max query length 1 and num_tokens == num_reqs is
dispatched with the dispatcher's query length set to 1; at capture, those keys are warmed up and captured with the
runner's uniform_decode_query_len set to 1, so _dummy_run builds n requests of 1 token. Any other batch is untouched.

Read in the 0.26 source, NOT verified on a GPU (each marked UNVERIFIED below):
- the GDN builder captures and replays 1-token decodes through its persistent non-spec buffers
  (non_spec_state_indices_tensor, non_spec_query_start_loc), as vLLM does without speculation; FlashAttention (FA3)
  likewise captures max_query_len = 1 with its persistent scheduler_metadata;
- the #39273 guard (drafts_for_step) is enough: a non-spec step after a step that accepted nothing reads the right
  SSM column (0) and conv offset (0) - from the kernels and the open fix PRs #40738 / #52942, not from a measurement;
- nothing else in execute_model depends on uniform_decode_query_len (grep: 3 uses, all covered), and async
  scheduling is off (0.26 disables it for suffix and CPU ngram), so `sampled` is the step just verified.
"""

from __future__ import annotations

import contextlib
import os

from serving import draft_padding
from serving.draft_padding import _WRAPPED as _PAD_WRAPPED, pad

ENV = "SERVING_SILENT_DRAFTS"
_WRAPPED = "_serving_silent_drafts"
_LOGGER = "vllm.plugins.serving_silent_drafts"


def drafts_for_step(drafts: list[list[int]], sampled: list[list[int]], num_tokens, k: int, max_model_len: int):
    """Every draft padded to K (as draft_padding.pad) when any request drafted or just accepted drafts (sampled more
    than one token); otherwise every request gets an empty draft, so the next step is a plain 1-token decode."""
    # UNVERIFIED (no GPU): len(ids) is the accepted count + 1 = the runner's num_accepted_tokens for that request
    if any(drafts) or any(len(ids) > 1 for ids in sampled):
        return pad(drafts, sampled, num_tokens, k, max_model_len)
    return [[] for _ in drafts]


def one_token_sizes(max_num_seqs: int, max_capture_size: int) -> list[int]:
    """Graph sizes for 1-token decodes: vLLM's default small capture sizes (1, 2, 4, 8, 16, ...) below
    max_num_seqs, plus max_num_seqs itself, so a batch of n <= max_num_seqs pads to at most max_num_seqs requests."""
    top = min(max_num_seqs, max_capture_size)
    return sorted({s for s in (1, 2, 4, *range(8, top, 8)) if s < top} | {top})


def _log(message, *args):
    from vllm.logger import init_logger

    init_logger(_LOGGER).info(message, *args)


# --- the proposers: draft_padding's wrappers with this policy ---------------------------------------------------------
def _suffix(propose):
    return draft_padding._suffix(propose, drafts_for_step)


def _ngram(propose):
    return draft_padding._ngram(propose, drafts_for_step)


# --- the dispatcher (vllm/v1/cudagraph_dispatcher.py) --------------------------------------------------------------
def _init_keys(initialize):
    """After vLLM's keys: FULL keys (n, n, uniform) for 1-token decodes, when decode graphs are FULL and separate."""

    def wrapper(self, *args, **kwargs):
        initialize(self, *args, **kwargs)
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import BatchDescriptor

        self._silent_keys, self._silent_pad, self._silent_on = set(), {}, False
        mode = self.cudagraph_mode
        if not (
            self.uniform_decode_query_len > 1 and mode.decode_mode() == CUDAGraphMode.FULL and mode.separate_routine()
        ):
            return
        sizes = one_token_sizes(
            self.vllm_config.scheduler_config.max_num_seqs, self.compilation_config.max_cudagraph_capture_size
        )
        full = self.cudagraph_keys[CUDAGraphMode.FULL]
        for size in sizes:
            for loras in self._get_lora_cases():
                key = BatchDescriptor(
                    num_tokens=size, num_reqs=size, uniform=True, has_lora=loras > 0, num_active_loras=loras
                )
                if key not in full:  # always in 0.26 (its 1 + K keys have num_reqs = num_tokens / (1 + K))
                    self.add_cudagraph_key(CUDAGraphMode.FULL, key)
                    self._silent_keys.add(key)
        # UNVERIFIED (no GPU): FULL graphs this small capture and replay like vLLM's own non-spec decode graphs
        self._silent_pad = {n: min(s for s in sizes if s >= n) for n in range(1, sizes[-1] + 1)}
        _log("silent drafts: FULL graphs for 1-token decode batches of %s requests", sizes)

    return wrapper


def _descriptor(create):
    """While the runner says the batch is 1 token per request, a uniform batch maps to its (n, n, uniform) key."""

    def wrapper(self, num_tokens, uniform_decode, has_lora, num_active_loras=0):
        size = getattr(self, "_silent_pad", {}).get(num_tokens) if getattr(self, "_silent_on", False) else None
        if size is None or not uniform_decode:
            return create(self, num_tokens, uniform_decode, has_lora, num_active_loras)
        from vllm.forward_context import BatchDescriptor

        return BatchDescriptor(
            num_tokens=size, num_reqs=size, uniform=True, has_lora=has_lora, num_active_loras=num_active_loras
        )

    return wrapper


# --- the model runner (vllm/v1/worker/gpu_model_runner.py) ---------------------------------------------------------
@contextlib.contextmanager
def _one_token(runner):
    dispatcher, saved = runner.cudagraph_dispatcher, runner.uniform_decode_query_len
    runner.uniform_decode_query_len, dispatcher._silent_on = 1, True
    try:
        yield
    finally:
        runner.uniform_decode_query_len, dispatcher._silent_on = saved, False


def _determine(determine):
    """Run time: a batch of 1-token requests goes to its FULL key, or, if none fits, through vLLM's own path."""

    def wrapper(self, *args, **kwargs):
        keys = getattr(self.cudagraph_dispatcher, "_silent_keys", None)
        if (
            keys
            and not args  # 0.26 calls it with keywords only
            and kwargs.get("force_uniform_decode") is None  # None at run time; capture passes a bool
            and kwargs.get("max_num_scheduled_tokens") == 1
            and kwargs.get("num_tokens") == kwargs.get("num_reqs")
            and self.vllm_config.parallel_config.data_parallel_size == 1  # DP syncs inside: never call it twice
        ):
            with _one_token(self):
                result = determine(self, **{**kwargs, "force_uniform_decode": True})
            if result[1] in keys:  # dispatched FULL to a 1-token graph
                seen = self.cudagraph_dispatcher.__dict__.setdefault("_silent_seen", set())
                if result[1] not in seen:
                    seen.add(result[1])
                    _log("silent drafts: no-draft step -> %s %s", result[0], result[1])
                return result
        return determine(self, *args, **kwargs)

    return wrapper


def _capture(warmup_and_capture):
    """Capture (and the memory profile, which goes through the same method): 1-token keys get n requests of 1 token."""

    def wrapper(self, desc, *args, **kwargs):
        if desc in getattr(self.cudagraph_dispatcher, "_silent_keys", ()):
            with _one_token(self):
                return warmup_and_capture(self, desc, *args, **kwargs)
        return warmup_and_capture(self, desc, *args, **kwargs)

    return wrapper


def _patch(cls, name, wrap, also=()):
    current = getattr(cls, name)
    if hasattr(current, _WRAPPED):
        return
    original = getattr(current, _PAD_WRAPPED, current)  # draft_padding's wrapper, if it loaded first
    wrapper = wrap(original)
    for marker in (_WRAPPED, *also):  # draft_padding skips a propose that carries its marker
        setattr(wrapper, marker, original)
    setattr(cls, name, wrapper)


def register() -> None:
    if os.environ.get(ENV) != "1":
        return
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer
    from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _patch(SuffixDecodingProposer, "propose", _suffix, also=(_PAD_WRAPPED,))
    _patch(NgramProposer, "propose", _ngram, also=(_PAD_WRAPPED,))
    _patch(CudagraphDispatcher, "initialize_cudagraph_keys", _init_keys)
    _patch(CudagraphDispatcher, "_create_padded_batch_descriptor", _descriptor)
    _patch(GPUModelRunner, "_determine_batch_execution_and_padding", _determine)
    _patch(GPUModelRunner, "_warmup_and_capture", _capture)
    # the tests read this line to know the plugin is in the engine, not only asked for
    _log("silent drafts: drafts padded to K, or none at all; no-draft steps dispatched to 1-token FULL graphs")
