"""The engine's own floor: a serve.json's model in vLLM's engine without the API server, HTTP, streaming or the
project's middleware, one greedy request at a time, each step timed.

    CACHE_DIR=DIR python3 gpu_proof/floor.py SERVE_JSON|VARIANT MODEL_DIR OUT_JSON [--config config.yaml]
        [--tokens 256] [--repeats 3] [--lengths 64,2048] [--set KEY=JSON] [--ab PATCH] [--profile DIR]

A catalog variant's name instead of a serve.json takes its settings from --config as rule serve_config writes them.
The serve.json is turned into vLLM's flags exactly as the image does (serving.settings.vllm_args); the flags only
the API server reads are dropped, the rest build vLLM's EngineArgs, so the engine is configured as the server's,
with its environment (serving.launch.child_env: the enabled patches, the caches under CACHE_DIR, which a server of
the same variant filled, so the engine starts from them).
Beside the probe's inter-token latency of the same variant on the same host, the difference is what the front end
(API server, streaming, middleware) adds a token; the first step of each prompt length (its prefill and first
token) is the time to first token the engine alone allows.

--ab PATCH runs the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the patch on for the run) and measures
every length twice, first with the patch's wrapper taken off vLLM's class, then with it back: one engine, one
host, the same caches; each token's logprob is compared between the two (equal floats: the same computation).
--profile DIR adds, per pass, one first step (--profile-length tokens, 64) under torch.profiler (CPU and CUDA,
Python stacks): the trace stays in DIR, the record keeps its summary (host time in the GDN attention op a call, the
GPU's busy time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# flags of the API server, not of the engine
FRONT_END_FLAGS = {"--host", "--port", "--middleware", "--served-model-name", "--default-chat-template-kwargs"}
# the class each --ab patch wraps, and the attribute its wrapper keeps vLLM's original under
AB_TARGETS = {
    "gdn_prefill_graphs": (
        "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn",
        "QwenGatedDeltaNetAttention",
        "_forward_core",
        "_serving_gdn_prefill_graphs",
    ),
}
GDN_OP = "vllm::qwen_gdn_attention_core"
PROFILED_LENGTH = 64
WARMUPS = 2  # a length's graphs are captured at its second sighting: two warm-ups leave every timed run a replay


def engine_flags(args: list[str]) -> list[str]:
    """vllm_args' command line less the API server's own flags (each with its value)."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in FRONT_END_FLAGS:
            skip = "=" not in arg
            continue
        kept.append(arg)
    return kept


def prompt_of(length: int) -> dict:
    """A token-id prompt of `length` tokens (ids in every vocabulary the catalog serves, the tiny one's included)."""
    return {"prompt_token_ids": [100 + (i * 7) % 150 for i in range(length)]}


def summarize_profile(events, steps: int = 1) -> dict:
    """What a profiled first step spent: host time in the GDN attention op (calls, per call), the busiest host ops,
    and the GPU's kernel time (summed, and the union of kernel intervals: the time the GPU was busy)."""
    ops, gdn, kernels = {}, [], []
    for event in events:
        device = str(getattr(event, "device_type", "")).rsplit(".", 1)[-1]
        if device == "CUDA":
            kernels.append((event.time_range.start, event.time_range.end))
            continue
        self_us = getattr(event, "self_cpu_time_total", 0) or 0
        ops[event.name] = ops.get(event.name, 0) + self_us
        if event.name == GDN_OP:
            gdn.append(event.time_range.end - event.time_range.start)
    busy, end = 0.0, None
    for start, stop in sorted(kernels):
        if end is None or start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    top = sorted(ops.items(), key=lambda item: -item[1])[:15]
    return {
        "steps": steps,
        "gdn_calls": len(gdn),
        "gdn_host_ms_per_call": round(statistics.mean(gdn) / 1e3, 4) if gdn else None,
        "gdn_host_ms_total": round(sum(gdn) / 1e3, 3),
        "gpu_kernel_ms": round(sum(stop - start for start, stop in kernels) / 1e3, 3),
        "gpu_busy_ms": round(busy / 1e3, 3),
        "top_self_cpu_ms": [[name, round(us / 1e3, 3)] for name, us in top],
    }


def run_request(engine, request_id: str, length: int, params) -> tuple[list[float], list, list]:
    """One request to completion: the time from its arrival to its first token (prefill and first token, whatever
    the engine's step batching), then each later step's wall time; its token ids and each token's logprob."""
    began = time.perf_counter()
    engine.add_request(request_id, prompt_of(length), params)
    steps, ids, logprobs = [], [], []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        for output in outputs:
            completion = output.outputs[0]
            ids = list(completion.token_ids)
            logprobs = [
                None if entry is None else round(float(entry[token].logprob), 6) if token in entry else None
                for token, entry in zip(completion.token_ids, completion.logprobs or [], strict=False)
            ]
        if ids:
            now = time.perf_counter()
            steps.append(now - began)
            began = now
    return steps, ids, logprobs


def measure(
    engine, label: str, lengths: list[int], tokens: int, repeats: int, params_for, profile_dir=None, profiled=64
) -> dict:
    """Each length: WARMUPS untimed requests, then `repeats` timed ones (first step = prefill and first token); the
    first length also times its decode steps."""
    result = {"lengths": {}}
    for index, length in enumerate(lengths):
        max_tokens = tokens if index == 0 else 2
        params = params_for(max_tokens)
        first, decode, ids, logprobs = [], [], None, None
        for repeat in range(WARMUPS + repeats):
            steps, ids, logprobs = run_request(engine, f"{label}-{length}-{repeat}", length, params)
            if repeat >= WARMUPS:
                first.append(steps[0])
                decode.extend(steps[1:])
        entry = {
            "first_step_ms": [round(s * 1e3, 3) for s in first],
            "first_step_median_ms": round(statistics.median(first) * 1e3, 3),
            "ids": ids,
            "logprobs": logprobs,
        }
        if index == 0 and decode:
            entry["step_median_ms"] = round(statistics.median(decode) * 1e3, 4)
        result["lengths"][str(length)] = entry
    if profile_dir is not None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        params = params_for(1)
        run_request(engine, f"{label}-profile-warm", profiled, params)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            run_request(engine, f"{label}-profile", profiled, params)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        Path(profile_dir).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(profile_dir) / f"{label}-{profiled}.json"))
        result["profile"] = summarize_profile(prof.events())
    return result


def compare(off: dict, on: dict) -> dict:
    """Per length, whether the two passes gave the same ids and the same logprobs."""
    same = {}
    for length, entry in off["lengths"].items():
        other = on["lengths"][length]
        same[length] = {
            "ids_equal": entry["ids"] == other["ids"],
            "logprobs_equal": entry["logprobs"] == other["logprobs"],
        }
    return same


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("serve_json", help="a serve.json, or a variant of --config")
    parser.add_argument("--config", default=str(ROOT / "config.yaml"), help="the catalog a variant name is read from")
    parser.add_argument("model_dir")
    parser.add_argument("out")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lengths", default=str(PROFILED_LENGTH), help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="a serve setting overridden")
    parser.add_argument("--ab", default=None, choices=sorted(AB_TARGETS), metavar="PATCH")
    parser.add_argument("--profile", default=None, metavar="DIR")
    parser.add_argument("--profile-length", type=int, default=PROFILED_LENGTH, metavar="TOKENS")
    args = parser.parse_args()

    import importlib

    from serving.launch import DIST_DIR, child_env
    from serving.settings import vllm_args

    if Path(args.serve_json).is_file():
        settings = json.loads(Path(args.serve_json).read_text())
    else:
        import yaml

        sys.path.insert(0, str(ROOT / "scripts"))
        from lib.dag import config as pipeline_config

        catalog = pipeline_config.load(yaml.safe_load(Path(args.config).read_text()), ROOT)
        settings = catalog.serve_json(args.serve_json)
    for item in args.set:
        key, value = item.split("=", 1)
        settings[key] = json.loads(value)
    if args.ab:
        settings["patches"] = dict(settings.get("patches") or {}, **{args.ab: True})
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: its classes are ours
    lengths = [int(n) for n in args.lengths.split(",")]
    import torch

    flags = engine_flags(vllm_args(settings, args.model_dir, host="127.0.0.1", port=0, cuda=torch.cuda.is_available()))
    os.environ.update(child_env(dict(os.environ), settings))  # the engine core process inherits it
    sys.path.insert(0, str(DIST_DIR))  # the patches' plugin entry points, for this process too

    import vllm
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older layouts
        from vllm.utils import FlexibleArgumentParser
    from vllm.v1.engine.llm_engine import LLMEngine

    namespace = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(flags)
    started = time.monotonic()
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(namespace))
    start_s = time.monotonic() - started

    def params_for(max_tokens: int):
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1 if args.ab else None)

    record = {"kind": "floor", "status": "ok", "vllm": vllm.__version__, "flags": flags, "start_s": round(start_s, 1)}
    record["tokens"] = args.tokens
    if args.ab:
        module, cls_name, method, wrapped_attr = AB_TARGETS[args.ab]
        cls = getattr(importlib.import_module(module), cls_name)
        wrapper = getattr(cls, method)
        original = getattr(wrapper, wrapped_attr, None)
        if original is None:
            raise SystemExit(f"--ab {args.ab}: the patch did not load in this process ({cls_name}.{method} unwrapped)")
        passes = {}
        for label, implementation in (("off", original), ("on", wrapper)):
            setattr(cls, method, implementation)
            passes[label] = measure(
                engine, label, lengths, args.tokens, args.repeats, params_for, args.profile, args.profile_length
            )
        setattr(cls, method, wrapper)
        record.update(ab=args.ab, passes=passes, same=compare(passes["off"], passes["on"]))
        first = passes["on"]["lengths"][str(lengths[0])]
    else:
        result = measure(
            engine, "run", lengths, args.tokens, args.repeats, params_for, args.profile, args.profile_length
        )
        record.update(result)
        first = result["lengths"][str(lengths[0])]
    record["step_median_ms"] = first.get("step_median_ms")
    record["runs"] = [{"first_step_ms": ms} for ms in first["first_step_ms"]]  # what collect.py counts
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({key: value for key, value in record.items() if key != "passes"}))
    for label, result in record.get("passes", {"run": record}).items():
        for length, entry in result["lengths"].items():
            print(label, length, "first step", entry["first_step_median_ms"], "ms", entry.get("step_median_ms", ""))
        if "profile" in result:
            print(label, "profile", json.dumps(result["profile"]))


if __name__ == "__main__":
    main()
