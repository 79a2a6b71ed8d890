"""The engine's own floor a decode step: a serve.json's model in vLLM's engine without the API server, HTTP,
streaming or the project's middleware, one greedy request at a time, each step timed.

    CACHE_DIR=DIR python3 gpu_proof/floor.py SERVE_JSON MODEL_DIR OUT_JSON [--tokens 256] [--repeats 3]

The serve.json is turned into vLLM's flags exactly as the image does (serving.settings.vllm_args); the flags only
the API server reads are dropped, the rest build vLLM's EngineArgs, so the engine is configured as the server's,
with its environment (serving.launch.child_env: the enabled patches, the caches under CACHE_DIR, which a server of
the same variant filled, so the engine starts from them).
Beside the probe's inter-token latency of the same variant on the same host, the difference is what the front end
(API server, streaming, middleware) adds a token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# flags of the API server, not of the engine
FRONT_END_FLAGS = {"--host", "--port", "--middleware", "--served-model-name", "--default-chat-template-kwargs"}


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


def timed_runs(engine, tokens: int, repeats: int) -> list[dict]:
    """`repeats` greedy requests of a 64-token prompt, one at a time after a warm-up, each engine step timed."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    runs = []
    for repeat in range(repeats + 1):  # the first is a warm-up
        engine.add_request(f"floor-{repeat}", {"prompt_token_ids": list(range(100, 164))}, params)
        steps, produced = [], 0
        while engine.has_unfinished_requests():
            began = time.perf_counter()
            outputs = engine.step()
            steps.append(time.perf_counter() - began)
            produced = next((len(output.outputs[0].token_ids) for output in outputs), produced)
        decode = steps[1:]  # the first step is the prefill (and first token)
        run = {"first_step_ms": round(steps[0] * 1e3, 3), "step_median_ms": round(statistics.median(decode) * 1e3, 4)}
        run |= {"step_mean_ms": round(statistics.mean(decode) * 1e3, 4), "steps": len(steps), "tokens": produced}
        runs += [run] if repeat else []
    return runs


def main() -> None:
    parser = argparse.ArgumentParser()
    for positional in ("serve_json", "model_dir", "out"):
        parser.add_argument(positional)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import os

    from serving.launch import DIST_DIR, child_env
    from serving.settings import vllm_args

    settings = json.loads(Path(args.serve_json).read_text())
    flags = engine_flags(vllm_args(settings, args.model_dir, host="127.0.0.1", port=0, cuda=True))
    os.environ.update(child_env(dict(os.environ), settings))  # the engine core process inherits it
    sys.path.insert(0, str(DIST_DIR))  # the patches' plugin entry points, for this process too

    import vllm
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
    runs = timed_runs(engine, args.tokens, args.repeats)
    median = statistics.median(r["step_median_ms"] for r in runs)
    record = {"kind": "floor", "status": "ok", "vllm": vllm.__version__, "flags": flags, "start_s": round(start_s, 1)}
    record |= {"tokens": args.tokens, "runs": runs, "step_median_ms": median}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
