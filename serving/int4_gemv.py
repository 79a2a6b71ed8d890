"""vLLM general plugin (entry point in _dist/): a one-token int4 decode GEMV in Triton beside Marlin.

Why it exists: Marlin is the largest item of an AWQ decode step on the H100 (1.89 of 2.55 ms of GPU work on the pruned
int4 head, results/gpu-proof/h100-marlin), and gpu_proof/marlin_bench.py shows where: every Marlin GEMM of one token
costs at least ~10 us whatever its size (a 5.9 MB out_proj 10.3 us, 0.57 TB/s; the 189 MB head 83 us, 2.3 TB/s), and
its reduction mode changes nothing (fp32, bf16 or atomic partial sums: 1.70-1.71 ms a step). A token runs 129 such
GEMMs. Marlin is built for tensor-core tiles of 16 rows; a single row needs only a dot product per output: read the
packed int4 weights once, scale each group of 32, add. This kernel does that, one program per few output rows, over
the checkpoint's own layout (compressed-tensors: [N, K/8] int32, eight consecutive k to a word at 4-bit steps, stored
as value + 8; scales [N, K/group]).

How it plugs in: a kernel class ahead of vLLM's own in the mixed-precision list, for exactly what it handles (symmetric
int4, group 32/64/128, no act-order, no zero points, a CUDA GPU); everything else goes to vLLM's choice as before. It
is Marlin for every batch of more than one token (prefill, verify steps, several requests): Marlin prepares its
weights as always, and the layer keeps the checkpoint's packed weights too (one more copy of the int4 weights in GPU
memory: 2.2 GB for Qwen3.5-4B with the pruned int4 head). Which kernel runs is decided inside one custom op at run
time, so torch.compile sees one opaque call and no branch on the batch size; the switch joins vLLM's compile-cache key
(serving/compile_key.py). At load, for every weight shape, the
kernel's launch configuration is timed on the GPU (CONFIGS, the fastest kept) and its output checked against Marlin's
on a random input: a mismatch stops the server with the layer named.

SERVING_INT4_GEMV=1 turns it on (off by default until measured on the hardware it serves on).
"""

import functools
import os

ENV = "SERVING_INT4_GEMV"
GROUP_SIZES = (32, 64, 128)
# (rows a program, packed words a loop step (8 k each), warps, pipeline stages): timed at load for each weight shape
CONFIGS = (
    (2, 64, 4, 3),
    (4, 32, 4, 4),
    (4, 64, 4, 3),
    (4, 128, 4, 3),
    (8, 32, 4, 4),
    (8, 64, 4, 3),
    (8, 64, 8, 3),
    (16, 32, 4, 3),
    (16, 64, 8, 3),
)
CHECK_TOLERANCE = 2e-2  # max |GEMV - Marlin| / max |Marlin| on a random input; both accumulate in fp32
OP_NAME = "serving_int4_gemv_or_marlin"


def enabled(environ: dict | None = None) -> bool:
    return (environ if environ is not None else os.environ).get(ENV) == "1"


def unsupported(weight_type: str, group_size: int, zero_points: bool, has_g_idx: bool, k: int, act: str) -> str | None:
    """Why the GEMV cannot take a layer (None: it can)."""
    if weight_type != "uint4b8":
        return f"weight type {weight_type} (the GEMV reads symmetric int4, uint4b8)"
    if zero_points or has_g_idx:
        return "zero points or act-order"
    if group_size not in GROUP_SIZES:
        return f"group size {group_size} (GEMV: {GROUP_SIZES})"
    if not configs_for(k):
        return f"input size {k} is not a multiple of any k step of CONFIGS"
    if act not in ("bfloat16", "float16"):
        return f"activation dtype {act}"
    return None


def configs_for(k: int) -> list[int]:
    """The CONFIGS whose k step (8 per packed word) divides the input size (the kernel has no tail loop)."""
    return [index for index, config in enumerate(CONFIGS) if k % (8 * config[1]) == 0]


def unpack_int4(packed):
    """compressed-tensors' int4 packing undone: [N, K/8] int32 -> [N, K] int32 values in -8..7."""
    import torch

    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    return (((packed.unsqueeze(-1) >> shifts) & 0xF) - 8).reshape(packed.shape[0], -1)


def dequantize(packed, scales):
    """The dense [N, K] float32 weight a packed int4 layer stands for (the reference the kernel is tested against)."""
    values = unpack_int4(packed).float()
    group = values.shape[1] // scales.shape[1]
    return values * scales.float().repeat_interleave(group, dim=1)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def w4a16_gemv(
        x_ptr, w_ptr, s_ptr, out_ptr, N, K, stride_w, stride_s,
        GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
    ):  # fmt: skip
        # one program: BLOCK_N output rows; a loop step: BLOCK_W packed words of each (k = word * 8 + nibble)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        live = rows < N
        words = tl.arange(0, BLOCK_W)
        acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
        for w0 in range(0, K // 8, BLOCK_W):
            packed = tl.load(w_ptr + rows[:, None] * stride_w + (w0 + words)[None, :], mask=live[:, None], other=0)
            groups = (w0 + words) // (GROUP // 8)
            scale = tl.load(s_ptr + rows[:, None] * stride_s + groups[None, :], mask=live[:, None], other=0.0)
            scale = scale.to(tl.float32)
            part = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
            for nibble in tl.static_range(8):
                q = ((packed >> (4 * nibble)) & 0xF).to(tl.float32) - 8.0
                x = tl.load(x_ptr + (w0 + words) * 8 + nibble).to(tl.float32)
                part += q * x[None, :]
            acc += part * scale
        tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=live)

    return w4a16_gemv


def gemv(x, packed, scales, config: int):
    """x [1, K] @ the packed int4 weight [N, K/8] (scales [N, K/group]) -> [1, N], with CONFIGS[config]."""
    import torch

    block_n, block_w, warps, stages = CONFIGS[config]
    n, k = packed.shape[0], packed.shape[1] * 8
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    grid = ((n + block_n - 1) // block_n,)
    _kernel()[grid](
        x, packed, scales, out, n, k, packed.stride(0), scales.stride(0),
        GROUP=k // scales.shape[1], BLOCK_N=block_n, BLOCK_W=block_w, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def fastest_config(x, packed, scales, repeats: int = 20) -> tuple[int, dict[int, float]]:
    """The CONFIGS index that runs this shape fastest on this GPU, and each one's microseconds."""
    import torch

    times = {}
    for index in configs_for(packed.shape[1] * 8):
        for _ in range(3):
            gemv(x, packed, scales, index)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            gemv(x, packed, scales, index)
        end.record()
        torch.cuda.synchronize()
        times[index] = start.elapsed_time(end) * 1e3 / repeats
    return min(times, key=times.get), times


def gemv_or_marlin(
    x, gemv_weight, gemv_scales, weight, weight_scale, weight_zp, g_idx, g_idx_sort_indices, workspace,
    wtype_id: int, size_k: int, size_n: int, is_k_full: bool, config: int,
):  # fmt: skip
    """One token: the GEMV; more: vLLM's Marlin call, as MarlinLinearKernel.apply_weights makes it."""
    if x.numel() == x.shape[-1]:
        return gemv(x.reshape(1, -1).contiguous(), gemv_weight, gemv_scales, config).reshape(*x.shape[:-1], size_n)
    from vllm.model_executor.layers.quantization.utils.marlin_utils import apply_gptq_marlin_linear
    from vllm.scalar_type import ScalarType

    return apply_gptq_marlin_linear(
        input=x, weight=weight, weight_scale=weight_scale, weight_zp=weight_zp, g_idx=g_idx,
        g_idx_sort_indices=g_idx_sort_indices, workspace=workspace, wtype=ScalarType.from_id(wtype_id),
        output_size_per_partition=size_n, input_size_per_partition=size_k, is_k_full=is_k_full,
    )  # fmt: skip


def _gemv_or_marlin_fake(x, gemv_weight, *args):
    return x.new_empty((*x.shape[:-1], gemv_weight.shape[0]))


def _op_function():
    """gemv_or_marlin with the annotations torch's schema inference reads."""
    import torch

    def serving_int4_gemv_or_marlin(
        x: torch.Tensor, gemv_weight: torch.Tensor, gemv_scales: torch.Tensor, weight: torch.Tensor,
        weight_scale: torch.Tensor, weight_zp: torch.Tensor, g_idx: torch.Tensor, g_idx_sort_indices: torch.Tensor,
        workspace: torch.Tensor, wtype_id: int, size_k: int, size_n: int, is_k_full: bool, config: int,
    ) -> torch.Tensor:  # fmt: skip
        return gemv_or_marlin(
            x, gemv_weight, gemv_scales, weight, weight_scale, weight_zp, g_idx, g_idx_sort_indices, workspace,
            wtype_id, size_k, size_n, is_k_full, config,
        )  # fmt: skip

    return serving_int4_gemv_or_marlin


@functools.cache
def _register_op():
    import torch
    from vllm.utils.torch_utils import direct_register_custom_op

    direct_register_custom_op(OP_NAME, _op_function(), mutates_args=[], fake_impl=_gemv_or_marlin_fake)
    return getattr(torch.ops.vllm, OP_NAME)


@functools.cache
def kernel_class():
    """MarlinLinearKernel with the one-token GEMV beside it (built on first use: vLLM is imported only on a server)."""
    import torch
    from vllm.logger import init_logger
    from vllm.model_executor.kernels.linear.mixed_precision.marlin import MarlinLinearKernel
    from vllm.platforms import current_platform

    logger = init_logger(__name__)
    tuned: dict[tuple[int, int, int], int] = {}  # (N, K, group) -> CONFIGS index, shared by the layers of a shape

    class Int4GemvMarlinKernel(MarlinLinearKernel):
        @classmethod
        def can_implement(cls, c):
            if not current_platform.is_cuda():
                return False, "the int4 GEMV runs on CUDA only"
            why = unsupported(
                str(c.weight_type), c.group_size, c.zero_points, c.has_g_idx, c.partition_weight_shape[0],
                str(c.act_type).removeprefix("torch."),
            )  # fmt: skip
            if why:
                return False, f"int4 GEMV: {why}"
            return super().can_implement(c)

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            packed, scales = getattr(layer, self.w_q_name), getattr(layer, self.w_s_name)
            if (packed.output_dim, packed.packed_dim, scales.output_dim) != (0, 1, 0):
                raise RuntimeError(f"int4 GEMV: {self.w_q_name} is not compressed-tensors' [N, K/8] layout")
            layer.gemv_weight = packed.data.contiguous().clone()
            layer.gemv_scales = scales.data.contiguous().clone()
            super().process_weights_after_loading(layer)
            n, k = layer.gemv_weight.shape[0], layer.gemv_weight.shape[1] * 8
            shape = (n, k, k // layer.gemv_scales.shape[1])
            x = torch.randn(1, k, dtype=self.config.act_type, device=layer.gemv_weight.device)
            if shape not in tuned:
                tuned[shape], times = fastest_config(x, layer.gemv_weight, layer.gemv_scales)
                logger.info("int4 GEMV for N=%d K=%d group %d: %s, us per config %s", *shape,
                            CONFIGS[tuned[shape]], {CONFIGS[i]: round(t, 1) for i, t in times.items()})  # fmt: skip
                self._check(layer, x, tuned[shape])  # once a shape: the first layer's weights
            layer.gemv_config = tuned[shape]

        def _check(self, layer, x, config):
            marlin = super().apply_weights(layer, x).float()
            ours = gemv(x, layer.gemv_weight, layer.gemv_scales, config).float()
            error = ((ours - marlin).abs().max() / marlin.abs().max().clamp_min(1e-6)).item()
            if not error <= CHECK_TOLERANCE:
                raise RuntimeError(
                    f"int4 GEMV disagrees with Marlin on a {tuple(layer.gemv_weight.shape)} layer: relative error "
                    f"{error:.3g} > {CHECK_TOLERANCE} ({ENV}=0 serves with Marlin alone)"
                )

        def apply_weights(self, layer, x, bias=None):
            w_q, w_s, w_zp, w_gidx = self._get_weight_params(layer)
            c = self.config
            out = getattr(torch.ops.vllm, OP_NAME)(
                x, layer.gemv_weight, layer.gemv_scales, w_q, w_s, w_zp, w_gidx, layer.g_idx_sort_indices,
                self.workspace, c.weight_type.id, c.partition_weight_shape[0], c.partition_weight_shape[1],
                self.is_k_full, layer.gemv_config,
            )  # fmt: skip
            return out if bias is None else out + bias

    return Int4GemvMarlinKernel


def register() -> None:
    if not enabled():
        return
    from vllm.model_executor.kernels import linear
    from vllm.platforms import PlatformEnum, current_platform

    if not current_platform.is_cuda():
        return
    import vllm.envs as envs

    from serving.compile_key import join_compile_key

    join_compile_key(envs, ENV, "1")  # the op replaces Marlin's in the traced graphs
    _register_op()
    kernels = linear._POSSIBLE_KERNELS.setdefault(PlatformEnum.CUDA, [])
    if kernel_class() not in kernels:
        kernels.insert(0, kernel_class())
