"""vLLM general plugin (entry point in _dist/): ngram_gpu's per-step tensor work replayed from CUDA graphs, one per
batch shape (off by default; the ngram_gpu variant turns on serve.patches.drafter_graphs).

Why it exists: vLLM 0.26 builds NgramProposerGPU with cudagraph_mode=NONE. Each decode step runs its bookkeeping
(update_token_ids_ngram: the sampled tokens, their counts, the next token), its matcher (propose: scatter into the
token buffer, then the inductor-compiled n-gram kernel) and, padded, draft_padding's fill as dozens of separate
eager kernel launches and copies. On an H100 a padded step's inter-token latency was well above its GPU work: the
host could not keep up, async scheduling or not. Captured, each of the two calls is one graph launch plus copies of
its inputs in and its outputs out.

How: the first call of a key runs eagerly (lazy initialisation, Triton autotuning, dynamo compiling a new shape all
happen there, none of it capturable); the second captures; later ones copy the step's tensors into the graph's own
inputs and replay. A key holds everything the graph bakes in: the batch shape, the host values read during capture
(num_reqs, vocab size, K) and the addresses of the runner's persistent buffers the graph reads and writes in place
(token_ids_gpu_tensor, num_tokens_no_spec_gpu, the discard mask). Outputs are copied out, because the next replay
overwrites the graph's own. A capture that fails leaves that key eager for good and says so in the log.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

from serving.patches import draft_padding, guarded

_WRAPPED = "_serving_drafter_graphs"
_LOGGER = "vllm.plugins.serving_drafter_graphs"
_WARM, _EAGER = "warm", "eager"


def cuda_capture(fn, inputs):
    """(graph inputs, replay) for fn(*inputs) on the current CUDA device: replay() runs the captured kernels and
    returns fn's outputs, which live in the graph's memory pool."""
    import torch

    static = [x.clone() for x in inputs]
    graph = torch.cuda.CUDAGraph()
    # thread_local: vLLM's async-output thread may copy on another stream while this thread captures
    with torch.cuda.graph(graph, pool=_pool(), capture_error_mode="thread_local"):
        outputs = fn(*static)

    def replay():
        graph.replay()
        return outputs

    return static, replay


@functools.cache
def _pool():
    """One memory pool for every drafter graph: they replay one after another on one stream."""
    import torch

    return torch.cuda.graph_pool_handle()


class StepGraphs:
    """fn(*inputs) per key: eager once, captured the second time, replayed after that (see the module's doc)."""

    def __init__(self, capture=cuda_capture, log=print):
        self.capture, self.log = capture, log
        self.entries: dict = {}

    def run(self, key, fn, inputs):
        entry = self.entries.get(key)
        if entry is None:
            self.entries[key] = _WARM
            return fn(*inputs)
        if entry == _WARM:
            try:
                entry = self.entries[key] = self.capture(fn, inputs)
            except Exception as error:  # noqa: BLE001 - any capture failure: stay correct, eager, and say it
                self.entries[key] = _EAGER
                self.log(f"drafter graphs: capture of {key[0]} failed, eager for this shape: {error!r}")
                return fn(*inputs)
            self.log(f"drafter graphs: captured {key[0]} for {key[1:3]}")
        if entry == _EAGER:
            return fn(*inputs)
        static, replay = entry
        for graph_input, value in zip(static, inputs, strict=True):
            graph_input.copy_(value)
        return tuple(output.clone() for output in replay())


def _layout(tensor):
    return (tuple(tensor.shape), str(tensor.dtype), tensor.data_ptr())


def _shape(tensor):
    return (tuple(tensor.shape), str(tensor.dtype))


def _update(original, graphs: StepGraphs):
    def wrapper(self, sampled_token_ids, gpu_input_batch, token_ids_gpu, num_tokens_no_spec, discard_request_mask):
        if isinstance(sampled_token_ids, list):  # disable_padded_drafter_batch: ragged lists, built on the host
            return original(
                self, sampled_token_ids, gpu_input_batch, token_ids_gpu, num_tokens_no_spec, discard_request_mask
            )
        # the two host values update_token_ids_ngram reads, frozen into the key as the graph freezes them
        batch = SimpleNamespace(num_reqs=gpu_input_batch.num_reqs, vocab_size=gpu_input_batch.vocab_size)
        key = (
            "update_token_ids_ngram",
            batch.num_reqs,
            _shape(sampled_token_ids),
            batch.vocab_size,
            _layout(token_ids_gpu),
            _layout(num_tokens_no_spec),
            _layout(discard_request_mask),
        )

        def step(sampled):
            return original(self, sampled, batch, token_ids_gpu, num_tokens_no_spec, discard_request_mask)

        return graphs.run(key, step, (sampled_token_ids,))

    setattr(wrapper, _WRAPPED, original)
    return wrapper


def _propose(original, graphs: StepGraphs):
    def wrapper(self, num_speculative_tokens, num_tokens_no_spec, token_ids_gpu, sampled_ids, sampled_counts):
        key = (
            "propose",
            num_tokens_no_spec.shape[0],
            _shape(sampled_ids),
            num_speculative_tokens,
            _layout(num_tokens_no_spec),
            _layout(token_ids_gpu),
            _shape(sampled_counts),
        )

        def step(ids, counts):
            return original(self, num_speculative_tokens, num_tokens_no_spec, token_ids_gpu, ids, counts)

        return graphs.run(key, step, (sampled_ids, sampled_counts))

    setattr(wrapper, _WRAPPED, original)
    if hasattr(original, draft_padding._WRAPPED):  # the padding is inside: draft_padding must not wrap it again
        setattr(wrapper, draft_padding._WRAPPED, original)
    return wrapper


def _no_count_copy(*args, **kwargs) -> None:
    """copy_num_valid_draft_tokens once every draft is K long: its one reader, the host trim, is gone
    (draft_padding._no_trim), so the side-stream copy and its event are skipped."""


def wrap(cls, graphs: StepGraphs) -> None:
    """NgramProposerGPU's two per-step calls replayed through `graphs` (idempotent)."""
    for name, wrapper in (("update_token_ids_ngram", _update), ("propose", _propose)):
        method = getattr(cls, name)
        if not hasattr(method, _WRAPPED):
            setattr(cls, name, wrapper(method, graphs))


@guarded("drafter_graphs")
def register() -> None:
    from vllm.logger import init_logger
    from vllm.v1.spec_decode import ngram_proposer_gpu

    logger = init_logger(_LOGGER)
    # padding first (where serve.patches has it on, and once only), so its fill runs inside the captured propose
    draft_padding.register()
    wrap(ngram_proposer_gpu.NgramProposerGPU, StepGraphs(log=logger.info))
    if hasattr(ngram_proposer_gpu.NgramProposerGPU.propose, draft_padding._WRAPPED):  # the padding is inside
        draft_padding.replace_in_runner(ngram_proposer_gpu, "copy_num_valid_draft_tokens", _no_count_copy)
    # the tests read this line to know the graphs are in the engine
    logger.info("drafter graphs: ngram_gpu's bookkeeping and matcher replayed from CUDA graphs per batch shape")
