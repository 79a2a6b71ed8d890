"""Where a decode step's time goes: a torch-profiler trace of vLLM's engine core, by kernel family.

vLLM writes the trace when the server was started with `--profiler-config '{"profiler": "torch", ...}'` and a
client brackets requests with POST /start_profile and /stop_profile (the GPU proof's `profile` variants). The trace
is Chrome's JSON (`traceEvents`): GPU kernels (`cat` "kernel", also for kernels replayed from a CUDA graph: CUPTI
records each graph node), copies and sets, and the engine's CPU side (runtime calls, `user_annotation` ranges).

What it reports, for the window from the first to the last GPU event:
  busy      the union of GPU intervals; idle = window - busy (the GPU waiting on the host: scheduling, drafting,
            sampling on the CPU, Python between steps)
  families  kernel time by family (FAMILIES: first pattern that matches the kernel's name), also per step
  gaps      idle intervals by size (a step boundary shows as one gap per step)
  annotations / runtime  the host ranges and CUDA runtime calls that took the most time

    python3 gpu_proof/profile_breakdown.py TRACE_DIR_OR_FILE OUT.json STEPS
"""

from __future__ import annotations

import gzip
import json
import re
import sys
from pathlib import Path

# (family, pattern on the lower-cased kernel name), first match wins. Inductor's fused Triton kernels
# (triton_{poi,red,per}_fused_<ops>) are named after the ops they fuse: a mean + rsqrt is an RMSNorm.
FAMILIES = [
    ("marlin_gemm", r"marlin"),
    # vLLM's int4 kernel for groups 64/128 on Hopper (CUTLASS-built: it would otherwise count as dense)
    ("machete_gemm", r"machete"),
    # GemLite's Triton int4 kernels (gemv_INT_revsplitK_kernel, gemm_splitK_INT_kernel, gemm_INT_kernel)
    ("gemlite_gemm", r"^gem[mv]_(splitk_)?int_"),
    # delta_rule: the speculative verify path's fused_sigmoid_gating_delta_rule_update_kernel (not an activation)
    (
        "gdn_recurrence",
        r"gated_delta|delta_rule|fused_recurrent|recurrent_gated|chunk_gated|chunk_scaled_dot|chunk_fwd|fla_|gdn",
    ),
    ("causal_conv1d", r"causal_conv1d|conv1d"),
    ("attention", r"flash|fmha|attention|attn|paged|mha_|xqa"),
    ("sampler", r"argmax|topk|top_k|gumbel|sampl|rejection|log_softmax|_softmax|sort"),
    ("norm", r"rms_?norm|layer_?norm|rsqrt|l2norm|norm_fwd"),
    ("rope", r"rotary|rope"),
    ("dense_gemm", r"gemm|gemv|cutlass|nvjet|xmma|cublas|splitk|sm90_|sm80_|matmul|mm_"),
    (
        "activation_elementwise",
        r"silu|gelu|sigmoid|act_and_mul|elementwise|vectorized|triton_poi|triton_per|triton_red",
    ),
    ("copy_index", r"copy|cat_|index|gather|scatter|fill|reduce_kernel|where|embedding"),
]
GAP_BUCKETS_US = (10, 50, 200, 1000)
GEMM_FAMILIES = {"marlin_gemm", "machete_gemm", "gemlite_gemm", "dense_gemm"}
# Inductor names a fused kernel after every op in it, the GEMM custom op its inputs come from included
# (triton_red_fused_..._rms_norm_marlin_gemm_3): such a kernel is the norm or activation after the GEMM, never the GEMM
INDUCTOR_FUSED = re.compile(r"triton_(poi|red|per)_fused")


def kernel_family(name: str) -> str:
    lowered = name.lower()
    fused = INDUCTOR_FUSED.match(lowered)
    for family, pattern in FAMILIES:
        if not (fused and family in GEMM_FAMILIES) and re.search(pattern, lowered):
            return family
    return "other"


def load_trace(path: Path) -> dict:
    """A trace file (.json or .json.gz), or the newest one in a directory."""
    if path.is_dir():
        candidates = sorted(
            [p for p in path.rglob("*") if p.is_file() and (p.name.endswith(".json") or p.name.endswith(".json.gz"))],
            key=lambda p: p.stat().st_mtime,
        )
        if not candidates:
            raise FileNotFoundError(f"no trace (*.json, *.json.gz) under {path}")
        path = candidates[-1]
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as handle:
        return json.load(handle)


def _union_us(intervals: list[tuple[float, float]]) -> tuple[float, list[float]]:
    """Total covered time and the idle gaps between covered stretches (both in microseconds)."""
    busy, gaps, end = 0.0, [], None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            if end is not None:
                gaps.append(start - end)
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy, gaps


def _top(events: list[dict], limit: int) -> list[dict]:
    totals: dict[str, list[float]] = {}
    for event in events:
        entry = totals.setdefault(event["name"], [0.0, 0])
        entry[0] += float(event.get("dur", 0.0))
        entry[1] += 1
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:limit]
    return [{"name": name[:160], "total_ms": round(total / 1000, 3), "count": count} for name, (total, count) in ranked]


def breakdown(trace: dict, steps: int, top: int = 15) -> dict:
    """The trace's GPU window split into busy (by kernel family) and idle time, totals and per decode step."""
    if steps < 1:
        raise ValueError("steps must be at least 1")
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        raise ValueError("the trace holds no GPU events (was the profiler started before the request?)")
    intervals = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu]
    window_us = max(stop for _, stop in intervals) - min(start for start, _ in intervals)
    busy_us, gaps = _union_us(intervals)
    families: dict[str, dict] = {}
    for event in gpu:
        family = kernel_family(event["name"]) if event["cat"] == "kernel" else event["cat"]
        entry = families.setdefault(family, {"total_ms": 0.0, "count": 0})
        entry["total_ms"] += float(event["dur"]) / 1000
        entry["count"] += 1
    kernel_ms = sum(f["total_ms"] for f in families.values())
    for entry in families.values():
        entry["per_step_ms"] = round(entry["total_ms"] / steps, 4)
        entry["share_of_busy"] = round(entry["total_ms"] / kernel_ms, 4) if kernel_ms else 0.0
        entry["total_ms"] = round(entry["total_ms"], 3)
    buckets = {}
    for low, high in zip((0, *GAP_BUCKETS_US), (*GAP_BUCKETS_US, float("inf")), strict=True):
        inside = [g for g in gaps if low <= g < high]
        label = f"{low}-{high}us" if high != float("inf") else f">={low}us"
        buckets[label] = {"count": len(inside), "total_ms": round(sum(inside) / 1000, 3)}
    return {
        "steps": steps,
        "window_ms": round(window_us / 1000, 3),
        "busy_ms": round(busy_us / 1000, 3),
        "idle_ms": round((window_us - busy_us) / 1000, 3),
        "per_step": {
            "window_ms": round(window_us / 1000 / steps, 4),
            "busy_ms": round(busy_us / 1000 / steps, 4),
            "idle_ms": round((window_us - busy_us) / 1000 / steps, 4),
            "kernels": round(sum(f["count"] for f in families.values()) / steps, 1),
        },
        "families": dict(sorted(families.items(), key=lambda item: -item[1]["total_ms"])),
        "idle_gaps": buckets,
        "top_kernels": _top([e for e in gpu if e.get("cat") == "kernel"], top),
        "top_annotations": _top([e for e in events if e.get("cat") == "user_annotation"], top),
        "top_runtime": _top([e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")], top),
    }


def main(argv: list[str]) -> None:
    source, out, steps = Path(argv[1]), Path(argv[2]), int(argv[3])
    result = breakdown(load_trace(source), steps)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("window_ms", "busy_ms", "idle_ms", "per_step")}, indent=1))


if __name__ == "__main__":
    main(sys.argv)
