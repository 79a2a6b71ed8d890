"""A one-token int4 GEMV in Triton, tried against Marlin on the H100 (issue 15, item 4) and slower there.

Why it was tried: Marlin is the largest item of an AWQ decode step (1.89 of 2.55 ms of GPU work on the pruned int4
head, results/gpu-proof/h100-marlin), and gpu_proof/marlin_bench.py shows every Marlin GEMM of one token costing at
least ~10 us whatever its size (a 5.9 MB out_proj 10.3 us; the 189 MB head 83 us), with no reduction mode faster. A
single row needs only a dot product per output: read the packed int4 weights once, scale each group, add. This kernel
does that over the checkpoint's own layout (compressed-tensors: [N, K/8] int32, eight consecutive k to a word at 4-bit
steps, stored as value + 8; scales [N, K/group]), one program per few output rows, nibble by nibble.

What it measured (results/gpu-proof/h100-int4-gemv): 3.07 ms for one token's GEMMs against Marlin's 1.71 ms on the
same H100 (a first form that reshaped each step's words to 3-D took 4.37 ms; a third that made each nibble a float by
its bits, 3.50 ms), about what dense bf16 takes for four times the bytes (3.16 ms). Even the 189 MB head runs at
0.9 TB/s: too few loads in flight, where Marlin streams its weights into tensor-core tiles. So it is not served;
gpu_proof/marlin_bench.py's int4-gemv mode times it. tests/test_gpu_proof.py checks the reference unpacking below
against compressed-tensors' own packing; the kernel was checked against that reference with Triton's interpreter
(TRITON_INTERPRET=1 on the CPU, relative error 0.003-0.005 at bf16 output), by hand: no CI venv carries Triton.
"""

import functools

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
    from bandwidth import timed  # gpu_proof/ is on the path of whoever imports experiments/

    times = {
        index: timed(lambda index=index: gemv(x, packed, scales, index), repeats) * 1e6
        for index in configs_for(packed.shape[1] * 8)
    }
    return min(times, key=times.get), times
