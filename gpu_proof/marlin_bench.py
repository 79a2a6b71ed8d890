"""One decode step's int4 GEMMs, timed per kernel mode on the GPU (issue 15, item 4).

The profile of a served AWQ step (results/gpu-proof/h100-profile) puts 1.81 ms of its 2.9 ms of GPU work in Marlin:
2.02 GB of int4 weights and scales at about 1.1 TB/s, a third of the copy bandwidth. At batch 1 Marlin splits each
output tile's k range over several thread blocks and, by default, adds their partial sums one block after another
through an fp32 workspace (each block waits on a lock for the one before). vLLM 0.26 can add them with atomics instead,
but only for GEMMs narrower than 2,048 outputs and only with VLLM_MARLIN_USE_ATOMIC_ADD=1; no int4 GEMM of Qwen3.5-4B
is that narrow, so the switch does nothing for this model. This script times, for every int4 GEMM of a quantized
checkpoint (from its safetensors headers, merged as vLLM's Qwen3.5 model merges them), the whole step's GEMMs replayed
from one CUDA graph per mode, on random int4 weights of those shapes, one buffer per layer so nothing stays in L2:

  marlin              vLLM's call (fp32 reduce through the workspace, no atomics)
  marlin-bf16-reduce  the same with use_fp32_reduce=False (partial sums kept in bf16)
  marlin-atomic       use_atomic_add=True on every shape (partial sums added with atomics, in any order)
  triton-w4a16        vLLM 0.26's Triton W4A16 kernel (the one it prefers on ROCm)
  int4-gemv           a one-token GEMV in Triton (gpu_proof/experiments/int4_gemv.py), its fastest launch
                      configuration per shape; one token only (m=1)
  tinygemm            PyTorch's own int4 kernel (aten._weight_int4pack_mm, gpt-fast's "tinygemm"), in its tiled layout
  gemlite             GemLite's Triton kernels (A16W4_HQQ_INT, what its vLLM backend serves compressed-tensors int4
                      with): GEMV_REVSPLITK at up to 4 tokens, its "fast" autotune per shape
  bf16                the same GEMMs dense in bf16 (cuBLAS): what the bytes would cost unquantized

Each Marlin mode and GemLite are also checked against the dequantized weights (x @ w_ref in fp32) on one layer of
every shape.

    PYTHONPATH=<vllm site> python3 gpu_proof/marlin_bench.py QUANTIZED_MODEL_DIR RESULT_JSON [--m 1,3] [--replays 30]
    PYTHONPATH=<vllm site> python3 gpu_proof/marlin_bench.py --gemms-from EARLIER_RESULT_JSON RESULT_JSON
      (the shapes an earlier run read from its checkpoint: no checkpoint needed)
"""

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "gpu_proof"))  # bandwidth.timed, experiments/int4_gemv.py

from bandwidth import timed  # noqa: E402
from lib.safetensors import checkpoint_header  # noqa: E402

# vLLM 0.26's Qwen3_5ForCausalLM.packed_modules_mapping: the checkpoint's modules each fused GEMM is made of
FUSED = {
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "in_proj_qkv": "in_proj_qkvz",
    "in_proj_z": "in_proj_qkvz",
}
MODES = ("marlin", "marlin-bf16-reduce", "marlin-atomic", "triton-w4a16", "int4-gemv", "tinygemm", "gemlite", "bf16")
ONE_TOKEN_MODES = {"int4-gemv"}
TINYGEMM_INNER_K_TILES = 8  # gpt-fast's choice; k must then be a multiple of 8 x 16
LAYER = re.compile(r"layers\.(\d+)\.")


def decode_gemms(header: dict[str, dict]) -> list[dict]:
    """The int4 GEMMs one decode step runs, as vLLM runs them: one entry per distinct (module, k, n, group) with the
    number of layers that have it. `header`: tensor name -> {shape, bytes} (compressed-tensors' `weight_packed`
    [n, k/8] int32 and `weight_scale` [n, k/group]); the MTP layer is left out (a plain step does not run it)."""
    fused: dict[tuple[str, str], dict] = {}
    for name, info in header.items():
        if not name.endswith(".weight_packed") or name.startswith("mtp."):
            continue
        module = name.removesuffix(".weight_packed")
        n, packed_k = info["shape"]
        k = packed_k * 8
        scale = header[f"{module}.weight_scale"]
        groups = scale["shape"][1]
        layer = LAYER.search(module)
        leaf = module.rsplit(".", 1)[-1]
        kind = FUSED.get(leaf, leaf)
        parent = module.rsplit(".", 2)[-2] if layer else ""
        key = (layer.group(1) if layer else module, f"{parent}.{kind}" if parent else kind)
        entry = fused.setdefault(key, {"module": key[1], "k": k, "n": 0, "group_size": k // groups, "bytes": 0})
        if entry["k"] != k or entry["group_size"] != k // groups:
            raise ValueError(f"{module}: k={k}, group {k // groups} do not fuse with {key[1]} (k={entry['k']})")
        entry["n"] += n
        entry["bytes"] += info["bytes"] + scale["bytes"]
    gemms: dict[tuple, dict] = {}
    for entry in fused.values():
        shape = (entry["module"], entry["k"], entry["n"], entry["group_size"])
        gemm = gemms.setdefault(shape, dict(entry, layers=0, bytes=0))
        gemm["layers"] += 1
        gemm["bytes"] += entry["bytes"]
    return sorted(gemms.values(), key=lambda g: (-g["bytes"], g["module"]))


def gbps(nbytes: int, ms: float) -> float:
    return round(nbytes / (ms / 1e3) / 1e9, 1)


def summarize(gemms: list[dict], timings: dict[str, dict[int, dict]]) -> dict:
    """Per mode and batch size: the step's GEMM time, its bandwidth over the int4 bytes, and the change against
    vLLM's Marlin call."""
    total = sum(g["bytes"] for g in gemms)
    out: dict[str, dict] = {}
    for mode, by_m in timings.items():
        out[mode] = {}
        for m, result in by_m.items():
            base = timings["marlin"][m]["step_ms"]
            out[mode][str(m)] = {
                "step_ms": round(result["step_ms"], 4),
                "int4_gbps": gbps(total, result["step_ms"]),
                "against_marlin": round(result["step_ms"] / base, 3),
                "by_gemm_us": {name: round(us, 2) for name, us in result["by_gemm_us"].items()},
            }
    return out


# ---- on the GPU ----


def _operands(mode: str, gemm: dict, device):
    """Random weights of one GEMM in the layout the mode's kernel reads."""
    import torch

    k, n, g = gemm["k"], gemm["n"], gemm["group_size"]
    if mode == "bf16":
        return (torch.randn(n, k, dtype=torch.bfloat16, device=device) * 0.02,)
    scales = torch.rand(k // g, n, dtype=torch.bfloat16, device=device) * 0.01 + 0.001
    if mode == "triton-w4a16":
        return torch.randint(-(2**31), 2**31 - 1, (k, n // 8), dtype=torch.int32, device=device), scales
    if mode == "int4-gemv":  # the checkpoint's own layout: [n, k / 8] int32 and [n, k / group]
        return torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device=device), scales.T.contiguous()
    if mode == "tinygemm":  # two nibbles a byte, tiled by the kernel's own converter; scales and zeros interleaved
        nibbles = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
        scales_and_zeros = torch.stack([scales, torch.zeros_like(scales)], dim=-1).contiguous()
        return torch.ops.aten._convert_weight_to_int4pack(nibbles, TINYGEMM_INNER_K_TILES), scales_and_zeros
    if mode == "gemlite":  # one unpacked value a byte and [n, k / group] scales; GemLite packs them itself
        return torch.randint(0, 16, (n, k), dtype=torch.uint8, device=device), scales.T.contiguous()
    # Marlin's repacked layout: (k / 16) rows of 16 x n int4 values, 8 to an int32
    return torch.randint(-(2**31), 2**31 - 1, (k // 16, n * 2), dtype=torch.int32, device=device), scales


def _gemm_fn(mode: str, gemm: dict, device):
    """x -> x @ W for one GEMM in `mode`, on random weights of its own."""
    import torch.nn.functional as F

    if mode == "bf16":
        (weight,) = _operands(mode, gemm, device)
        return lambda x: F.linear(x, weight)
    qweight, scales = _operands(mode, gemm, device)
    if mode == "triton-w4a16":
        from vllm.model_executor.kernels.linear.mixed_precision.triton_w4a16 import triton_w4a16_gemm

        return lambda x: triton_w4a16_gemm(x, qweight, scales, None, gemm["group_size"])
    if mode == "int4-gemv":
        import torch

        from experiments.int4_gemv import fastest_config, gemv

        if "int4_gemv_config" not in gemm:  # once a shape: its layers share the launch configuration
            x = torch.randn(1, gemm["k"], dtype=torch.bfloat16, device=device)
            gemm["int4_gemv_config"], _ = fastest_config(x, qweight, scales)
        config = gemm["int4_gemv_config"]
        return lambda x: gemv(x, qweight, scales, config)
    if mode == "tinygemm":
        import torch

        return lambda x: torch.ops.aten._weight_int4pack_mm(x, qweight, gemm["group_size"], scales)
    if mode == "gemlite":
        return gemlite_call(qweight, scales, device)
    return marlin_call(mode, qweight, scales, gemm["k"], gemm["n"], device)


def marlin_call(mode: str, qweight, scales, k: int, n: int, device):
    """vLLM's marlin_gemm as apply_gptq_marlin_linear calls it for a symmetric int4 layer, in one reduction mode."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.utils.marlin_utils import (
        marlin_make_empty_g_idx,
        marlin_make_workspace_new,
    )
    from vllm.scalar_type import scalar_types

    workspace, none_idx = marlin_make_workspace_new(device), marlin_make_empty_g_idx(device)
    atomic, fp32 = mode == "marlin-atomic", mode != "marlin-bf16-reduce"

    def call(x):
        return ops.marlin_gemm(
            x, None, qweight, None, scales, None, None, none_idx, none_idx, none_idx, workspace,
            scalar_types.uint4b8, size_m=x.shape[0], size_n=n, size_k=k, is_k_full=True,
            use_atomic_add=atomic, use_fp32_reduce=fp32, is_zp_float=False,
        )  # fmt: skip

    return call


def gemlite_call(values, scales, device):
    """GemLite's linear for symmetric int4 ([n, k] values 0..15, zero point 8), as its vLLM backend builds it."""
    import torch
    from gemlite.helper import A16W4_HQQ_INT

    zeros = torch.full_like(scales, 8)
    return A16W4_HQQ_INT(device=device, dtype=torch.bfloat16).from_weights(W_q=values, scales=scales, zeros=zeros)


def graph_ms(thunks: list, replays: int) -> float:
    """Mean time of one replay of a CUDA graph that runs every thunk once, in order."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # Triton's first call compiles; Marlin's allocates
            for thunk in thunks:
                thunk()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for thunk in thunks:
            thunk()
    return timed(graph.replay, replays) * 1e3


def time_modes(gemms: list[dict], ms: list[int], replays: int, modes: tuple[str, ...]) -> tuple[dict, dict]:
    """{mode: {m: {step_ms, by_gemm_us}}}, and why a mode could not run."""
    import functools

    import torch

    device = torch.device("cuda")
    timings: dict[str, dict[int, dict]] = {}
    failed: dict[str, str] = {}
    for mode in modes:
        try:
            calls = {g["module"]: [_gemm_fn(mode, g, device) for _ in range(g["layers"])] for g in gemms}
            timings[mode] = {}
            for m in [1] if mode in ONE_TOKEN_MODES else ms:
                inputs = {g["k"]: torch.randn(m, g["k"], dtype=torch.bfloat16, device=device) for g in gemms}
                thunks = {
                    g["module"]: [functools.partial(call, inputs[g["k"]]) for call in calls[g["module"]]] for g in gemms
                }
                by_gemm = {name: graph_ms(t, replays) * 1e3 / len(t) for name, t in thunks.items()}
                step = graph_ms([t for g in gemms for t in thunks[g["module"]]], replays)
                timings[mode][m] = {"step_ms": step, "by_gemm_us": by_gemm}
                print(f"{mode} m={m}: {step:.3f} ms a step", flush=True)
            del calls
        except Exception as error:  # noqa: BLE001  recorded: a mode the kernels refuse is a finding
            failed[mode] = f"{type(error).__name__}: {error}"[:600]
            timings.pop(mode, None)
            print(f"{mode}: failed: {failed[mode]}", flush=True)
        torch.cuda.empty_cache()
    return timings, failed


def relative_error(out, reference) -> float:
    """max |out - reference| / max |reference|, rounded as recorded."""
    return round((out.float() - reference).abs().max().item() / reference.abs().max().item(), 5)


def check_errors(gemms: list[dict], ms: list[int], modes: tuple[str, ...]) -> dict:
    """Each Marlin mode (and GemLite, where timed) against the dequantized weights, on one layer of every shape:
    max |error| / max |reference|."""
    import torch
    from vllm.model_executor.layers.quantization.utils.marlin_utils_test import marlin_quantize
    from vllm.scalar_type import scalar_types

    device = torch.device("cuda")
    errors: dict[str, dict] = {}
    for g in gemms:
        weight = torch.randn(g["k"], g["n"], dtype=torch.bfloat16, device=device) * 0.02
        w_ref, qweight, scales, *_ = marlin_quantize(weight, scalar_types.uint4b8, g["group_size"], False)
        del weight
        for m in ms:
            x = torch.randn(m, g["k"], dtype=torch.bfloat16, device=device)
            reference = x.float() @ w_ref.float()
            for mode in ("marlin", "marlin-bf16-reduce", "marlin-atomic"):
                out = marlin_call(mode, qweight, scales, g["k"], g["n"], device)(x)
                errors.setdefault(mode, {})[f"{g['module']} m={m}"] = relative_error(out, reference)
        del w_ref, qweight, scales
        if "gemlite" in modes:  # its own layout, against its own dequantized weights
            values = torch.randint(0, 16, (g["n"], g["k"]), dtype=torch.uint8, device=device)
            group_scales = torch.rand(g["n"], g["k"] // g["group_size"], dtype=torch.bfloat16, device=device) * 0.01
            w_ref = (values.float() - 8) * group_scales.float().repeat_interleave(g["group_size"], dim=1)
            linear = gemlite_call(values, group_scales, device)
            for m in ms:
                x = torch.randn(m, g["k"], dtype=torch.bfloat16, device=device)
                error = relative_error(linear(x), x.float() @ w_ref.T)
                errors.setdefault("gemlite", {})[f"{g['module']} m={m}"] = error
            del values, group_scales, w_ref, linear
        torch.cuda.empty_cache()
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", nargs="?")
    parser.add_argument("result")
    parser.add_argument("--gemms-from", help="an earlier result whose GEMM shapes to time (instead of a checkpoint)")
    parser.add_argument("--m", default="1,3", help="batch sizes in tokens (1: a plain decode; 3: MTP K=2's verify)")
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--modes", default=",".join(MODES), help=f"which of {', '.join(MODES)} (marlin always)")
    args = parser.parse_args()
    modes = ("marlin", *(m for m in args.modes.split(",") if m != "marlin"))
    if unknown := set(modes) - set(MODES):
        raise SystemExit(f"--modes: unknown {sorted(unknown)}; known: {', '.join(MODES)}")
    import torch

    started = time.monotonic()
    if args.gemms_from:
        keep = ("module", "k", "n", "group_size", "layers", "bytes")
        gemms = [{key: g[key] for key in keep} for g in json.loads(Path(args.gemms_from).read_text())["gemms"]]
    else:
        gemms = decode_gemms(checkpoint_header(args.model_dir))
    if not gemms:
        raise SystemExit(f"{args.model_dir}: no int4 weight_packed tensors (not a compressed-tensors W4A16 checkpoint)")
    ms = [int(m) for m in args.m.split(",")]
    timings, failed = time_modes(gemms, ms, args.replays, modes)
    if "marlin" not in timings:
        raise SystemExit(f"vLLM's Marlin call failed: {failed.get('marlin')}")
    result = {
        "kind": "marlin_bench",
        "status": "ok",
        "device": torch.cuda.get_device_name(0),
        "model_dir": args.model_dir,
        "gemms_from": args.gemms_from,
        "method": "random int4 weights of every int4 GEMM of the checkpoint (one buffer per layer), each mode's whole "
        f"step replayed from one CUDA graph, CUDA-event timed over {args.replays} replays after 3; by_gemm_us: one "
        "GEMM of that module, from a graph of all its layers",
        "gemms": gemms,
        "int4_bytes": sum(g["bytes"] for g in gemms),
        "modes": summarize(gemms, timings),
        "failed": failed,
        "relative_error": check_errors(gemms, ms, tuple(timings)),
        "wall_s": round(time.monotonic() - started, 1),
    }
    Path(args.result).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    steps = {mode: {m: r["step_ms"] for m, r in by_m.items()} for mode, by_m in result["modes"].items()}
    print(json.dumps(steps), flush=True)


if __name__ == "__main__":
    main()
