"""vLLM general plugin (entry point in _dist/): how Marlin adds the partial sums of a decode-sized int4 GEMM.

Why it exists: at batch 1 Marlin splits each output tile's k range over several thread blocks, and vLLM 0.26 has it
add their partial sums one block after another through an fp32 workspace, each block waiting on a lock for the one
before. It can add them with atomics instead (`use_atomic_add`), but vLLM turns that on only with
VLLM_MARLIN_USE_ATOMIC_ADD=1 and only for GEMMs narrower than 2,048 outputs, and every int4 GEMM of Qwen3.5-4B is
wider, so vLLM's switch does nothing for this model. Marlin is the largest item of an AWQ decode step on the H100
(1.81 of 2.9 ms of GPU work, results/gpu-proof/h100-profile); gpu_proof/marlin_bench.py times each mode on the
checkpoint's own GEMM shapes.

Measured on an H100 (results/gpu-proof/h100-marlin): neither mode changes a step's GPU work (the step's int4 GEMMs
1.70-1.72 ms in every mode, served 2.54-2.55 ms a step, Marlin 1.89-1.90 ms), so it stays off; it is kept so that
measurement can be repeated.

SERVING_MARLIN_REDUCE selects the mode (unset or "vllm": vLLM's code untouched):
  atomic  use_atomic_add for every Marlin GEMM of at most ATOMIC_MAX_M tokens on a GPU with native bf16 atomics
          (compute capability 9 and up, vLLM's own condition); the partial sums then land in any order, so the last
          bits of an output may differ run to run
  bf16    use_fp32_reduce=False: the serial reduction kept, its partial sums in the activation dtype

The mode is traced into torch.compile's graphs (a Python bool at trace time), so it joins vLLM's compile-cache key
(join_compile_key): a cache baked in one mode is never loaded by a server in another.
"""

from __future__ import annotations

import functools
import os

ENV = "SERVING_MARLIN_REDUCE"
MODES = ("vllm", "atomic", "bf16")
ATOMIC_MAX_M = 16  # one Marlin row block: decode and verify steps of a few requests; a prefill keeps vLLM's reduce
_WRAPPED = "_serving_marlin_reduce"


def mode_from_env(environ: dict | None = None) -> str:
    mode = (environ if environ is not None else os.environ).get(ENV) or "vllm"
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r}: unknown Marlin reduction mode; known: {list(MODES)}")
    return mode


def atomic_for_decode(original, capability):
    """vLLM's should_use_atomic_add_reduce, widened to every width for decode-sized batches. `capability`:
    device -> (major, minor)."""

    @functools.wraps(original)
    def should_use_atomic_add_reduce(m, n, k, device, dtype):
        if device.type == "cuda" and m <= ATOMIC_MAX_M and capability(device)[0] >= 9:
            return True
        return original(m=m, n=n, k=k, device=device, dtype=dtype)

    setattr(should_use_atomic_add_reduce, _WRAPPED, True)
    return should_use_atomic_add_reduce


def bf16_reduce(original):
    """vLLM's apply_gptq_marlin_linear with its partial sums in the activation dtype."""

    @functools.wraps(original)
    def apply_gptq_marlin_linear(*args, **kwargs):
        kwargs["use_fp32_reduce"] = False
        return original(*args, **kwargs)

    setattr(apply_gptq_marlin_linear, _WRAPPED, True)
    return apply_gptq_marlin_linear


def join_compile_key(envs_module, name: str, value: str) -> None:
    """Make `name`=`value` one of the environment values vLLM hashes into its torch.compile cache key
    (vllm.envs.compile_factors hashes every entry of environment_variables); the first value a process sets stays."""
    envs_module.environment_variables.setdefault(name, lambda: value)


def register() -> None:
    mode = mode_from_env()
    if mode == "vllm":
        return
    import torch
    import vllm.envs as envs

    join_compile_key(envs, ENV, mode)
    if mode == "atomic":
        from vllm.model_executor.layers.quantization.utils import marlin_utils

        if not hasattr(marlin_utils.should_use_atomic_add_reduce, _WRAPPED):
            marlin_utils.should_use_atomic_add_reduce = atomic_for_decode(
                marlin_utils.should_use_atomic_add_reduce, torch.cuda.get_device_capability
            )
    else:
        from vllm.model_executor.kernels.linear.mixed_precision import marlin

        if not hasattr(marlin.apply_gptq_marlin_linear, _WRAPPED):
            marlin.apply_gptq_marlin_linear = bf16_reduce(marlin.apply_gptq_marlin_linear)
