"""A serve setting's effect inside the serve venv's vLLM: ngram_gpu drafts padded on the device
(tests/unit/test_settings.py: the settings table, its flags and the schema kept equal)."""

import sys

import pytest

from conftest import ROOT, serve_venv_json

sys.path.insert(0, str(ROOT))
from serving import patches  # noqa: E402

NGRAM_GPU_PLUGINS = """
import json, torch
import vllm.v1.worker.gpu_model_runner as runner
from vllm.v1.spec_decode.ngram_proposer_gpu import NgramProposerGPU
from serving.patches import draft_padding

# pad_gpu: a row's draft is its first num_valid tokens; the rest is -1
drafts = torch.tensor([[5, 6, -1, -1], [-1, -1, -1, -1], [1, 2, 3, 4]], dtype=torch.int32)
padded, counts = draft_padding.pad_gpu(drafts, torch.tensor([2, 0, 4], dtype=torch.int32), torch.tensor([9, 8, 7]), 4)

# the wrapper: propose scatters this step's sampled tokens into token_ids, then drafts nothing for anyone
def fake_propose(self, k, num_tokens, token_ids, sampled_ids, sampled_counts):
    token_ids[0, 3], token_ids[1, 5], token_ids[1, 6] = 31, 51, 61
    return torch.full((2, k), -1, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)

token_ids = torch.zeros((2, 8), dtype=torch.int32)
wrapped, wrapped_counts = draft_padding._ngram_gpu(fake_propose)(
    None, 3, torch.tensor([3, 5]), token_ids, None, torch.tensor([1, 2], dtype=torch.int32))

trim_before = runner.update_scheduler_for_invalid_drafts
draft_padding.register()  # switched on (SERVING_PATCHES): after the runner's import, as in a worker
print(json.dumps({
    "padded": padded.tolist(), "counts": counts.tolist(), "dtype": str(padded.dtype),
    "wrapped": wrapped.tolist(), "wrapped_counts": wrapped_counts.tolist(),
    "trim_replaced": runner.update_scheduler_for_invalid_drafts is draft_padding._no_trim
    and trim_before is not draft_padding._no_trim,
    "propose_wrapped": hasattr(NgramProposerGPU.propose, draft_padding._WRAPPED),
}))
"""


@pytest.fixture(scope="module")
def ngram_gpu_plugins(tiny_venvs):
    """NGRAM_GPU_PLUGINS run in the serve venv's vLLM, with the padding asked for; its JSON."""
    return serve_venv_json(tiny_venvs, NGRAM_GPU_PLUGINS, env={patches.ENV: "draft_padding"})


@pytest.mark.e2e
def test_ngram_gpu_drafts_are_padded_on_the_device_and_the_host_trim_is_gone(ngram_gpu_plugins):
    """ngram_gpu with draft_padding, in the serve venv's vLLM: -1 slots filled with the draft's last token (the
    request's last token where it drafted nothing), every count K, and the runner's per-step trim (an event sync)
    replaced by a no-op, even though the runner module was imported first."""
    seen = ngram_gpu_plugins
    assert seen["padded"] == [[5, 6, 6, 6], [8, 8, 8, 8], [1, 2, 3, 4]]
    assert seen["counts"] == [4, 4, 4] and seen["dtype"] == "torch.int32"
    assert seen["wrapped"] == [[31, 31, 31], [61, 61, 61]] and seen["wrapped_counts"] == [3, 3]
    assert seen["trim_replaced"] and seen["propose_wrapped"]
