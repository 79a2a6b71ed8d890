"""The engine's own floor: a variant in vLLM's engine without the API server, HTTP, streaming or the project's
middleware, one greedy request at a time.

    CACHE_DIR=DIR python3 gpu_proof/floor.py SERVE_JSON|VARIANT MODEL_DIR OUT_JSON [--config config.yaml]
        [--tokens 256] [--repeats 3] [--lengths 64,2048] [--set KEY=JSON] [--ab PATCH] [--profile DIR]

SERVE_JSON (as the driver writes it) or a catalog VARIANT of --config becomes vLLM's flags as the image's do
(serving.settings.vllm_args, less the API server's), with the image's environment (serving.launch.child_env: the
enabled patches, the caches under CACHE_DIR, which a server of the same variant filled). Each prompt length's first
step (prefill and first token) is the time to first token the engine alone allows; the first length's decode steps,
beside the probe's inter-token latency, say what the front end adds a token.
--ab PATCH runs the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the patch enabled) and measures every
length twice, with the patch's wrapper taken off vLLM's class, then put back: one engine, the same caches, every
token's id and logprob compared, after an untimed pass over every length (neither pass pays the engine's warm-up).
--profile DIR keeps a torch profiler trace (CPU, CUDA, Python stacks) of one first step a pass in DIR, and its
summary in the record.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FRONT_END_FLAGS = {"--host", "--port", "--middleware", "--served-model-name", "--default-chat-template-kwargs"}
# the class and method each --ab patch wraps, and the attribute its wrapper keeps vLLM's original under
AB_TARGETS = {
    "gdn_prefill_graphs": (
        "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn.QwenGatedDeltaNetAttention._forward_core",
        "_serving_gdn_prefill_graphs",
    ),
    "suffix_tree_overlap": (
        "vllm.v1.worker.gpu_model_runner.GPUModelRunner.execute_model",
        "_serving_suffix_tree_overlap",
    ),
}
GDN_OP = "vllm::qwen_gdn_attention_core"
RUNNER_SCOPE = "gpu_model_runner:"  # vLLM's record_function scopes, there with VLLM_CUSTOM_SCOPES_FOR_PROFILING
WARMUPS = 2  # a length's graphs are captured at its second sighting: two warm-ups leave every timed run a replay


def engine_flags(args: list[str]) -> list[str]:
    """vllm_args' command line less the API server's own flags (each with its value)."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg.split("=", 1)[0] in FRONT_END_FLAGS:
            skip = "=" not in arg
        else:
            kept.append(arg)
    return kept


def prompt_of(length: int) -> dict:
    """A token-id prompt of `length` tokens (ids in every vocabulary the catalog serves, the tiny one's included)."""
    return {"prompt_token_ids": [100 + (i * 7) % 150 for i in range(length)]}


def summarize_profile(events) -> dict:
    """A profiled first step: host time in the GDN attention op (calls, ms a call), in each of the model runner's
    own scopes (sample, bookkeep, draft: ms) and the GPU's busy time (the union of its kernels' intervals)."""
    gdn, kernels, scopes = [], [], {}
    for event in events:
        if str(getattr(event, "device_type", "")).endswith("CUDA"):
            kernels.append((event.time_range.start, event.time_range.end))
        elif event.name == GDN_OP:
            gdn.append(event.time_range.end - event.time_range.start)
        elif event.name.startswith(RUNNER_SCOPE):
            name = event.name.removeprefix(RUNNER_SCOPE).strip()
            scopes[name] = scopes.get(name, 0.0) + (event.time_range.end - event.time_range.start) / 1e3
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(kernels):
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    mean = round(statistics.mean(gdn) / 1e3, 4) if gdn else None
    runner = {name: round(ms, 3) for name, ms in sorted(scopes.items())}
    return {"gdn_calls": len(gdn), "gdn_host_ms_per_call": mean, "gpu_busy_ms": round(busy / 1e3, 3)} | (
        {"runner_scopes_ms": runner} if runner else {}
    )


def run_request(engine, request_id: str, length: int, params) -> tuple[list[float], list, list]:
    """One request to completion: the time from its arrival to its first token (whatever the engine's step batching),
    then each later step's; its token ids and each token's logprob."""
    began = time.perf_counter()
    engine.add_request(request_id, prompt_of(length), params)
    steps, ids, logprobs = [], [], []
    while engine.has_unfinished_requests():
        for output in engine.step():
            completion = output.outputs[0]
            ids = list(completion.token_ids)
            entries = zip(completion.token_ids, completion.logprobs or [], strict=False)
            logprobs = [round(float(entry[token].logprob), 6) for token, entry in entries if entry and token in entry]
        if ids:
            now = time.perf_counter()
            steps.append(now - began)
            began = now
    return steps, ids, logprobs


def measure(engine, label: str, args, params_for) -> dict:
    """Each length: WARMUPS untimed requests, then args.repeats timed ones; the first length also times its decode."""
    lengths = {}
    for index, length in enumerate(int(n) for n in args.lengths.split(",")):
        params, first, decode = params_for(args.tokens if index == 0 else 2), [], []
        for repeat in range(WARMUPS + args.repeats):
            steps, ids, logprobs = run_request(engine, f"{label}-{length}-{repeat}", length, params)
            if repeat >= WARMUPS:
                first.append(round(steps[0] * 1e3, 3))
                decode.extend(steps[1:])
        entry = {"first_step_ms": first, "first_step_median_ms": statistics.median(first), "ids": ids}
        entry |= {"logprobs": logprobs} | (
            {"step_median_ms": round(statistics.median(decode) * 1e3, 4)} if decode else {}
        )
        lengths[str(length)] = entry
    result = {"lengths": lengths}
    if args.profile:
        import torch
        from torch.profiler import ProfilerActivity, profile

        run_request(engine, f"{label}-profile-warm", args.profile_length, params_for(1))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            run_request(engine, f"{label}-profile", args.profile_length, params_for(1))
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(args.profile) / f"{label}-{args.profile_length}.json"))
        result["profile"] = summarize_profile(prof.events())
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("serve_json", help="a serve.json, or a variant of --config")
    for name in ("model_dir", "out"):
        parser.add_argument(name)
    parser.add_argument("--config", default=str(ROOT / "config.yaml"), help="the catalog a variant name is read from")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lengths", default="64", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="a serve setting overridden")
    parser.add_argument("--ab", default=None, choices=sorted(AB_TARGETS), metavar="PATCH")
    parser.add_argument("--profile", default=None, metavar="DIR")
    parser.add_argument("--profile-length", type=int, default=64, metavar="TOKENS")
    parser.add_argument("--weights", choices=("random", "trained"), default="random", help="what MODEL_DIR holds")
    args = parser.parse_args()

    import torch

    import records  # gpu_proof/'s own (floor.py's folder is on sys.path)
    from serving.launch import DIST_DIR, child_env
    from serving.settings import vllm_args

    variant = Path(args.serve_json).stem  # the driver writes STATE/serve/<variant>.json
    if Path(args.serve_json).is_file():
        settings = json.loads(Path(args.serve_json).read_text())
    else:
        import yaml

        sys.path.insert(0, str(ROOT / "scripts"))
        from lib.dag import config as pipeline_config

        variant = args.serve_json
        settings = pipeline_config.load(yaml.safe_load(Path(args.config).read_text()), ROOT).serve_json(variant)
    options = {key: json.loads(value) for key, value in (item.split("=", 1) for item in args.set)}
    settings |= options
    if args.ab:
        settings["patches"] = dict(settings.get("patches") or {}, **{args.ab: True})
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: its classes are ours
    flags = engine_flags(vllm_args(settings, args.model_dir, host="127.0.0.1", port=0, cuda=torch.cuda.is_available()))
    os.environ.update(child_env(dict(os.environ), settings))  # the engine core process inherits it
    if args.profile:
        os.environ["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"  # the model runner's scopes in the trace
    sys.path.insert(0, str(DIST_DIR))  # the patches' plugin entry points, for this process too

    import vllm
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine.llm_engine import LLMEngine

    started = time.monotonic()
    namespace = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(flags)
    # the API server's defaults (max_num_batched_tokens: 8,192 on an H200, 2,048 on an A10G), not the bare engine's
    # 2,048, which would prefill an 8k prompt in four steps where the image's server takes one
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(namespace), UsageContext.OPENAI_API_SERVER)
    record = {"kind": "floor", "status": "ok", "vllm": vllm.__version__, "flags": flags}
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    record["environment"] = {"gpu": gpu, "cpu": records.cpu_model(), "date": time.strftime("%F")}
    record |= {"start_s": round(time.monotonic() - started, 1), "variant": variant, "weights": args.weights}
    record |= {"config": str(Path(args.config).resolve().relative_to(ROOT)), "tokens": args.tokens, "options": options}

    def params_for(max_tokens: int):
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1 if args.ab else None)

    if args.ab:
        target, wrapped_attr = AB_TARGETS[args.ab]
        path, cls_name, method = target.rsplit(".", 2)
        cls = getattr(importlib.import_module(path), cls_name)
        wrapper = getattr(cls, method)
        if not hasattr(wrapper, wrapped_attr):
            raise SystemExit(f"--ab {args.ab}: the patch did not load in this process ({cls_name}.{method} unwrapped)")
        # an untimed pass first: whatever the engine still warms on its first requests (the first pass's runs
        # fell run after run, the prefill table's note) is not charged to the patch's off side
        setattr(cls, method, getattr(wrapper, wrapped_attr))
        measure(engine, "warm", argparse.Namespace(**(vars(args) | {"profile": None})), params_for)
        passes = {}
        for label, implementation in (("off", getattr(wrapper, wrapped_attr)), ("on", wrapper)):
            setattr(cls, method, implementation)
            passes[label] = measure(engine, label, args, params_for)
        off, on = passes["off"]["lengths"], passes["on"]["lengths"]
        same = {n: {key: off[n][key] == on[n][key] for key in ("ids", "logprobs")} for n in off}
        record |= {"ab": args.ab, "passes": passes, "same": same}
    else:
        passes = {"run": measure(engine, "run", args, params_for)}
        record |= passes["run"]
    first = next(iter(passes[list(passes)[-1]]["lengths"].values()))
    record |= {"step_median_ms": first.get("step_median_ms"), "runs": len(first["first_step_ms"])}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    for label, result in passes.items():
        for length, entry in result["lengths"].items():
            print(label, length, "first step", entry["first_step_median_ms"], "ms", entry.get("step_median_ms", ""))
        print(label, "profile", json.dumps(result.get("profile")))
    print(json.dumps({key: record.get(key) for key in ("ab", "same", "start_s", "step_median_ms")}))


if __name__ == "__main__":
    main()
