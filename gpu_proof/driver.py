"""The GPU proof of the real profile (issue #7), run on an offline H100 host without Docker.

Runs the project's own code, in priority order, one step after another, and writes one JSON per step to
STATE/results (then re-packs STATE/results.tar.gz, so whatever is done survives a machine taken back):

  environment   GPU, driver, package versions
  checkpoint    full-size random Qwen3.5-4B-shaped checkpoint, made on the GPU (gpu_proof/build_checkpoint.py)
  bandwidth     torch device-to-device copy bandwidth (gpu_proof/bandwidth.py)
  quantize-*    scripts/quantize.py with llmcompressor on CUDA (gpu_proof/quantize_variant.py)
  serve-*       `python3 -m serving` (serving/launch.py -> vLLM's OpenAI server) with config.yaml's real serve
                settings; cold start to /ping; lib.probe.warm_up + lib.cache_tar.deterministic_tar; a second start
                from the baked cache; lib.probe.probe; decode time per token against the
                bandwidth bound

A step that succeeded leaves STATE/done/<step>; a relaunch skips those (fix, resend, relaunch).

    python3 gpu_proof/driver.py [--state /tmp/gp] [--only step,step] [--warmup 2] [--runs 5]
"""

import argparse
import gzip
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from lib.cache_tar import deterministic_tar  # noqa: E402
from lib.containers import free_port, wait_for_ping  # noqa: E402
from lib.decode_bytes import draft_passes, part_bytes, step_bytes  # noqa: E402
from lib.probe import probe, prompt_sets, warm_up  # noqa: E402
from lib.schema import section_defaults  # noqa: E402
from lib.vllm_logs import cache_evidence  # noqa: E402
from serving.draft_input_ids import ENV as DRAFT_INPUT_IDS_OFF  # noqa: E402
from serving.gdn_spec_metadata import ENV as GDN_SLICES_OFF  # noqa: E402
from serving.greedy_rejection import ENV as GREEDY_REJECTION_OFF  # noqa: E402
from serving.marlin_reduce import ENV as MARLIN_REDUCE  # noqa: E402
from serving.ngram_token_counts import ENV as NGRAM_TOKEN_COUNTS_OFF  # noqa: E402
from serving.spec_decode_indices import ENV as KEPT_INDICES_OFF  # noqa: E402

SITE_VLLM = os.environ.get("SITE_VLLM", "/tmp/site-vllm")
SITE_LLMC = os.environ.get("SITE_LLMC", "/tmp/site-llmcompressor")
SITE_EXTRA = os.environ.get("SITE_EXTRA", "/tmp/site-extra")  # jsonschema & co. for quantize's report check
REAL_VARIANT = "awq-w4a16-g32-mtp2"  # config.yaml's saved variant: its serve settings are the real profile's
KERNEL_CACHES = ("triton", "inductor", "flashinfer")  # shared by variants; vllm/ (torch.compile) is not
GEMLITE_ENABLE = "VLLM_GEMLITE_ENABLE"  # GemLite's vLLM backend, carried beside vLLM but off unless set

NO_SPECULATION = {"method": "none", "k": 0}
SUFFIX48_D64 = {
    "method": "suffix",
    "k": 48,
    "pad_drafts": True,
    "suffix_decoding_max_spec_factor": 4.0,
    "suffix_decoding_max_tree_depth": 64,
}
SUFFIX32_D48 = dict(SUFFIX48_D64, k=32, suffix_decoding_max_tree_depth=48)
NGRAM_GPU4 = {"method": "ngram_gpu", "k": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# padded and replayed from CUDA graphs (serving/drafter_graphs.py), at K=4 and at K=16
NGRAM_GPU4_GRAPH = {**NGRAM_GPU4, "pad_drafts": True, "graph_drafter": True}
NGRAM_GPU16_GRAPH = {**NGRAM_GPU4_GRAPH, "k": 16, "prompt_lookup_max": 8}
BROAD = "recipes/awq-w4a16-g32-broad.yaml"
HEAD4, HEAD8 = "recipes/awq-w4a16-g32-broad-head4.yaml", "recipes/awq-w4a16-g32-broad-head8.yaml"
VOCAB131K = "recipes/awq-w4a16-g32-broad-head4-vocab131k.yaml"
G128 = "recipes/awq-w4a16-g128-broad.yaml"


def ngramgpu4_traced(**env_by_name: dict[str, str]) -> dict[str, dict]:
    """The captured padded ngram_gpu K=4 on AWQ broad, profiled, once per plugin switch setting (the server env):
    awq-broad-ngramgpu4-<name>-traced."""
    return {
        f"awq-broad-ngramgpu4-{name}-traced": {
            "recipe": BROAD,
            "speculative": NGRAM_GPU4_GRAPH,
            "first": "from:awq-broad",
            "profile": True,
            "env": env,
        }
        for name, env in env_by_name.items()
    }


# name -> recipe (None: serve the source checkpoint, which is what recipes/bf16.yaml copies), the speculative
# section (config.yaml's layout), how the first start finds its cache (empty, seeded with bf16's baked kernel
# caches, or from:<variant>, that variant's whole baked cache), whether to bake it (then restart from the baked
# cache and probe there, unless restart is False), which prompt sets to probe ("all": config.yaml's probe.sets;
# "repeated": the competition's only), and whether to also record the lossless check's reference
# (scripts/lossless_reference.py's run: each category's first timed request again, with top logprobs) that the
# `lossless` step compares the same recipe's speculative variants with.
VARIANTS = {
    "bf16": {"recipe": None, "speculative": NO_SPECULATION, "first": "empty", "bake": True},
    "awq-w4a16-g32-broad": {"recipe": BROAD, "speculative": NO_SPECULATION, "first": "seeded", "bake": True},
    "bf16-mtp2": {"recipe": None, "speculative": {"method": "mtp", "k": 2}, "sets": "repeated"},
    "bf16-mtp1": {"recipe": None, "speculative": {"method": "mtp", "k": 1}, "sets": "repeated"},
    "bf16-mtp4": {"recipe": None, "speculative": {"method": "mtp", "k": 4}, "sets": "repeated"},
    "awq-w4a16-g32-mlp": {"recipe": "recipes/awq-w4a16-g32-mlp.yaml", "speculative": NO_SPECULATION},
    # issue 14: one run, back to back - bf16 (no restart), AWQ broad with the reference, then its speculative forms
    "bf16-base": {"recipe": None, "speculative": NO_SPECULATION, "first": "empty", "bake": True, "restart": False},
    "awq-broad": {"recipe": BROAD, "speculative": NO_SPECULATION, "bake": True, "restart": False, "reference": True},
    "awq-broad-suffix24": {"recipe": BROAD, "speculative": {"method": "suffix", "k": 24}, "first": "from:awq-broad"},
    "awq-broad-mtp2": {"recipe": BROAD, "speculative": {"method": "mtp", "k": 2}, "first": "from:awq-broad"},
    # second lease: suffix on bf16, served with CUDA-graph sizes 1..K+1 added (tried against the padding of a
    # draft-less step to K+1; it did not help and was not kept: results/gpu-proof/h100-spec/session.json)
    "bf16-suffix24": {
        "recipe": None,
        "speculative": {"method": "suffix", "k": 24},
        "first": "empty",
        "bake": True,
        "restart": False,
    },
    "bf16-plain": {"recipe": None, "speculative": NO_SPECULATION},
    # issues 15 and 14: one decode step of AWQ broad as served (CUDA graphs on), then of AWQ + suffix K=24, under
    # vLLM's torch profiler (gpu_proof/profile_breakdown.py): one short request of the repeated and of the fresh set
    "awq-broad-profile": {
        "recipe": BROAD,
        "speculative": NO_SPECULATION,
        "bake": True,
        "restart": False,
        "sets": "repeated",
        "profile": True,
    },
    # issue 15: the LM head quantized too (int4 g32, int8 channel-wise), kernel caches seeded from AWQ broad's bake
    "awq-broad-head4": {
        "recipe": HEAD4,
        "speculative": NO_SPECULATION,
        "first": "seeded:awq-broad-profile",
        "sets": "repeated",
        "profile": True,
    },
    "awq-broad-head8": {
        "recipe": HEAD8,
        "speculative": NO_SPECULATION,
        "first": "seeded:awq-broad-profile",
        "sets": "repeated",
        "profile": True,
    },
    "awq-broad-suffix24-profile": {
        "recipe": BROAD,
        "speculative": {"method": "suffix", "k": 24},
        "first": "from:awq-broad-profile",
        "sets": "repeated",
        "profile": True,
    },
    # fourth lease (issues 14 and 15), on the tied random checkpoint: AWQ broad on every prompt set with the lossless
    # reference, then suffix with every draft padded to K (one FULL graph a step?) and unpadded on the same host, the
    # int4 head on the vocabulary pruned to 131,072 ids, the int8 head, and the int4 head untied from the tied source
    "awq-broad-all-profile": {
        "recipe": BROAD,
        "speculative": NO_SPECULATION,
        "first": "empty",
        "bake": True,
        "restart": False,
        "reference": True,
        "profile": True,
    },
    "awq-broad-suffix24-pad-profile": {
        "recipe": BROAD,
        "speculative": {"method": "suffix", "k": 24, "pad_drafts": True},
        "first": "from:awq-broad-all-profile",
        "profile": True,
    },
    "awq-broad-suffix24-nopad-profile": {
        "recipe": BROAD,
        "speculative": {"method": "suffix", "k": 24},
        "first": "from:awq-broad-all-profile",
        "profile": True,
    },
    "awq-broad-head4-vocab131k": {
        "recipe": VOCAB131K,
        "speculative": NO_SPECULATION,
        "first": "seeded:awq-broad-all-profile",
        "profile": True,
    },
    "awq-broad-head8-tied": {
        "recipe": HEAD8,
        "speculative": NO_SPECULATION,
        "first": "seeded:awq-broad-all-profile",
        "sets": "repeated",
        "profile": True,
    },
    "awq-broad-head4-tied": {
        "recipe": HEAD4,
        "speculative": NO_SPECULATION,
        "first": "seeded:awq-broad-all-profile",
        "sets": "repeated",
        "profile": True,
    },
    # fifth lease (issue 14, item 7): bf16 on every set, then padded suffix drafting up to 4x the matched length
    # (vLLM's suffix_decoding_max_spec_factor, 1.0 by default), both on one host: --only environment,checkpoint,
    # bandwidth,serve-bf16-all,quantize-awq-w4a16-g32-broad,serve-awq-broad-suffix24-pad-f4
    "bf16-all": {"recipe": None, "speculative": NO_SPECULATION, "first": "empty", "bake": True, "restart": False},
    "awq-broad-suffix24-pad-f4": {
        "recipe": BROAD,
        "speculative": {"method": "suffix", "k": 24, "pad_drafts": True, "suffix_decoding_max_spec_factor": 4.0},
    },
    # sixth lease (issues 14 and 15): suffix's tree depth (vLLM's default 24) caps match + draft, so K=24 drafted
    # ~19 at best; depth 64 lets K=48 draft whole repeated runs (arctic's cache, simulated: 9 -> 5 verify steps for
    # 127 repeated tokens). Then the same with prefix caching on (the long prompt's prefill), and group 128, which
    # vLLM 0.26 hands to Machete instead of Marlin on Hopper: --only environment,checkpoint,bandwidth,
    # quantize-awq-w4a16-g32-broad,serve-bf16-all,serve-awq-broad-suffix48-d64-pad-f4,
    # serve-awq-broad-suffix48-d64-pad-f4-prefix,quantize-awq-w4a16-g128-broad,serve-awq-w4a16-g128-broad,
    # serve-awq-broad,lossless
    "awq-broad-suffix48-d64-pad-f4": {"recipe": BROAD, "speculative": SUFFIX48_D64},
    "awq-broad-suffix48-d64-pad-f4-prefix": {
        "recipe": BROAD,
        "speculative": SUFFIX48_D64,
        "serve": {"enable_prefix_caching": True},
    },
    "awq-w4a16-g128-broad": {"recipe": G128, "speculative": NO_SPECULATION, "sets": "repeated", "profile": True},
    # seventh lease: the depth-64 run again on another host, a middle point (K=32, depth 48), and group 128 on
    # Marlin (vLLM picks Machete unless it is disabled): --only environment,checkpoint,bandwidth,
    # quantize-awq-w4a16-g32-broad,serve-bf16-all,serve-awq-broad-suffix48-d64-pad-f4,
    # serve-awq-broad-suffix32-d48-pad-f4,quantize-awq-w4a16-g128-broad,serve-awq-w4a16-g128-marlin
    "awq-broad-suffix32-d48-pad-f4": {"recipe": BROAD, "speculative": SUFFIX32_D48},
    "awq-w4a16-g128-marlin": {
        "recipe": G128,
        "speculative": NO_SPECULATION,
        "sets": "repeated",
        "profile": True,
        "env": {"VLLM_DISABLED_KERNELS": "MacheteLinearKernel"},
    },
    # eighth lease (issue 14, item 3): K=32 depth 48 with silent drafts (serving/silent_drafts.py: padded to K when
    # anyone drafted, no draft at all otherwise, and the no-draft step replays a FULL graph of 1 token per request),
    # beside AWQ broad (the plain step and the lossless reference) and the padded form on the same host:
    # --only environment,checkpoint,bandwidth,quantize-awq-w4a16-g32-broad,serve-awq-broad,
    # serve-awq-broad-silent32-d48-f4,lossless,serve-awq-broad-suffix32-d48-pad-f4,serve-bf16-all
    "awq-broad-silent32-d48-f4": {
        "recipe": BROAD,
        "speculative": {**SUFFIX32_D48, "pad_drafts": None, "silent_drafts": True},
        "first": "from:awq-broad",
        "profile": True,
    },
    # ninth lease (issue 14, item 3): vLLM's n-gram matcher on the GPU, the copy-style method 0.26 keeps async
    # scheduling on for, as vLLM ships it (a step's missing draft tokens trimmed on the host after an event sync) and
    # with every draft padded to K on the GPU (serving/draft_padding.pad_gpu; no trim, no sync), beside AWQ broad:
    # --only environment,checkpoint,bandwidth,quantize-awq-w4a16-g32-broad,serve-awq-broad,
    # serve-awq-broad-ngramgpu4-pad,serve-awq-broad-ngramgpu4,lossless,serve-awq-broad-ngramgpu16-pad,serve-bf16-all
    "awq-broad-ngramgpu4": {"recipe": BROAD, "speculative": NGRAM_GPU4, "first": "from:awq-broad", "profile": True},
    "awq-broad-ngramgpu4-pad": {
        "recipe": BROAD,
        "speculative": {**NGRAM_GPU4, "pad_drafts": True},
        "first": "from:awq-broad",
        "profile": True,
    },
    "awq-broad-ngramgpu16-pad": {
        "recipe": BROAD,
        "speculative": {**NGRAM_GPU4, "k": 16, "prompt_lookup_max": 8, "pad_drafts": True},
        "first": "from:awq-broad",
    },
    # tenth lease (issue 14, item 3): the padded ngram_gpu step was host-bound (3.6 ms of GPU work, 5.5-6.4 ms a
    # token); serving/drafter_graphs.py replays its bookkeeping, matcher and padding from CUDA graphs. Beside the
    # uncaptured padded form and AWQ broad on the same host: --only environment,checkpoint,bandwidth,
    # quantize-awq-w4a16-g32-broad,serve-awq-broad,serve-awq-broad-ngramgpu4-pad-graph,
    # serve-awq-broad-ngramgpu4-pad,lossless,serve-bf16-all,serve-awq-broad-ngramgpu16-pad-graph
    "awq-broad-ngramgpu4-pad-graph": {
        "recipe": BROAD,
        "speculative": NGRAM_GPU4_GRAPH,
        "first": "from:awq-broad",
        "profile": True,
    },
    "awq-broad-ngramgpu16-pad-graph": {"recipe": BROAD, "speculative": NGRAM_GPU16_GRAPH, "first": "from:awq-broad"},
    # eleventh lease (issue 14, item 3): where the captured step's remaining host time goes, operator by operator
    # (gpu_proof/trace_ops.py over the traces `device.sh traces` brings back), against a plain AWQ step; and K=16:
    # --only environment,checkpoint,quantize-awq-w4a16-g32-broad,serve-awq-broad-all-profile,
    # serve-awq-broad-ngramgpu4-pad-graph-traced,serve-awq-broad-ngramgpu16-pad-graph-traced
    **{
        f"awq-broad-ngramgpu{k}-pad-graph-traced": {
            "recipe": BROAD,
            "speculative": speculative,
            "first": "from:awq-broad-all-profile",
            "profile": True,
        }
        for k, speculative in ((4, NGRAM_GPU4_GRAPH), (16, NGRAM_GPU16_GRAPH))
    },
    # twelfth lease (issue 14, item 3): the GDN metadata of an all-speculative step built from slices
    # (serving/gdn_spec_metadata.py, on by default) against vLLM's own build (SERVING_GDN_SPEC_METADATA=0; both
    # without spec_decode_indices, which came after), on the
    # captured padded ngram_gpu step, beside AWQ broad; then padded suffix K=32 d48 with it, and bf16:
    # --only environment,checkpoint,bandwidth,quantize-awq-w4a16-g32-broad,serve-awq-broad,
    # serve-awq-broad-ngramgpu4-gdn-traced,serve-awq-broad-ngramgpu4-vllmgdn-traced,lossless,
    # serve-awq-broad-suffix32-d48-pad-f4,serve-bf16-all
    **ngramgpu4_traced(
        gdn={KEPT_INDICES_OFF: "0"},
        vllmgdn={GDN_SLICES_OFF: "0", KEPT_INDICES_OFF: "0"},
    ),
    # thirteenth lease (issue 14, item 3): the verify step's indices kept per batch shape as well
    # (serving/spec_decode_indices.py, on by default) against the GDN slices alone, beside AWQ broad:
    # --only environment,checkpoint,bandwidth,quantize-awq-w4a16-g32-broad,serve-awq-broad,
    # serve-awq-broad-ngramgpu4-idx-traced,serve-awq-broad-ngramgpu4-gdn-traced,lossless,serve-bf16-all
    **ngramgpu4_traced(idx={}),
    # fourteenth lease (issue 14, item 3): the all-greedy rejection sampler as argmaxes of the raw logits
    # (serving/greedy_rejection.py, on by default) against vLLM's general path (SERVING_GREEDY_REJECTION=0), both
    # with the GDN slices and the kept indices, beside AWQ broad:
    # --only environment,checkpoint,bandwidth,quantize-awq-w4a16-g32-broad,serve-awq-broad,
    # serve-awq-broad-ngramgpu4-greedy-traced,serve-awq-broad-ngramgpu4-vllmsampler-traced,lossless,serve-bf16-all
    **ngramgpu4_traced(greedy={}, vllmsampler={GREEDY_REJECTION_OFF: "0"}),
    # fifteenth lease (issue 14, items 3 and 7): the copy drafter that wins the competition set, padded suffix K=32
    # depth 48, and its silent form, now with every plugin on (GDN slices, kept indices, greedy argmaxes: each acts
    # on a step whose every request carries a padded draft), beside AWQ broad and bf16 on one host:
    # --only environment,checkpoint,bandwidth,quantize-awq-w4a16-g32-broad,serve-awq-broad,
    # serve-awq-broad-suffix32-d48-pad-f4,serve-awq-broad-silent32-d48-f4,lossless,serve-bf16-all
    # sixteenth lease (issue 14, item 7): the real profile's default, MTP on AWQ broad, never yet probed on a GPU: K=2
    # (config.yaml's variant) with every plugin on (their default; each acts on a step whose every request carries a
    # draft, as MTP's always do) and with vLLM's own paths (the three switches off), and K=4 with the plugins, beside
    # AWQ broad (the plain step and the lossless reference) and bf16 on one host. Random weights accept nothing, so
    # each row is what a draft+verify step costs: --only environment,checkpoint,bandwidth,
    # quantize-awq-w4a16-g32-broad,serve-awq-broad,serve-awq-broad-mtp2-plugins,serve-awq-broad-mtp2-vllm,lossless,
    # serve-awq-broad-mtp4-plugins,serve-bf16-all
    **{
        f"awq-broad-mtp{k}-{paths}": {
            "recipe": BROAD,
            "speculative": {"method": "mtp", "k": k},
            "first": "from:awq-broad",
            "profile": True,
            "env": env,
        }
        for k, paths, env in (
            (2, "plugins", {}),
            (2, "vllm", {GDN_SLICES_OFF: "0", KEPT_INDICES_OFF: "0", GREEDY_REJECTION_OFF: "0"}),
            (4, "plugins", {}),
        )
    },
    # seventeenth lease (issues 14 and 15): on machine20 an MTP step's dense GEMMs went 0.58 -> 1.67 ms at K=2 (2.76 at
    # K=4): vLLM shares the target's LM head with the MTP drafter, so each draft pass reads the 1.27 GB bf16 head
    # again. With the int4 head on the pruned vocabulary (0.19 GB) a draft pass reads a seventh of that (vLLM 0.26
    # shares that head too: "Sharing target model lm_head weights with the draft model", the tiny profile's pruned
    # checkpoint, all 32 draft tokens accepted): --only environment,checkpoint,bandwidth,
    # quantize-awq-broad-head4-vocab131k,serve-awq-broad-vocab131k-mtp2,serve-awq-broad-vocab131k-plain
    "awq-broad-vocab131k-mtp2": {
        "recipe": VOCAB131K,
        "speculative": {"method": "mtp", "k": 2},
        "first": "empty",
        "bake": True,
        "restart": False,
        "profile": True,
    },
    "awq-broad-vocab131k-plain": {
        "recipe": VOCAB131K,
        "speculative": NO_SPECULATION,
        "first": "seeded:awq-broad-vocab131k-mtp2",
        "sets": "repeated",
    },
    # eighteenth lease (issue 15, item 4): Marlin is the largest item of a decode step. Its reduction modes
    # (serving/marlin_reduce.py) on the fastest recipe without speculation, the pruned vocabulary's int4 head: the
    # checkpoint's GEMMs alone in every mode (gpu_proof/marlin_bench.py), then served in vLLM's mode, with atomics and
    # with bf16 partial sums, on one host: --only environment,checkpoint,bandwidth,quantize-awq-broad-head4-vocab131k,
    # marlinbench-vocab131k-plain-vllm,serve-vocab131k-plain-vllm,serve-vocab131k-plain-atomic,
    # serve-vocab131k-plain-bf16
    **{
        f"vocab131k-plain-{mode}": {
            "recipe": VOCAB131K,
            "speculative": NO_SPECULATION,
            # the mode is traced into the compiled graphs: each start compiles its own, on the first's kernel caches
            "first": "empty" if mode == "vllm" else "seeded:vocab131k-plain-vllm",
            "bake": mode == "vllm",
            "restart": False,
            "profile": True,
            "env": {MARLIN_REDUCE: mode},
        }
        for mode in ("vllm", "atomic", "bf16")
    },
    # nineteenth lease (issues 15 and 14): what is left of a plain token beyond its GPU work, and most of a speculative
    # token's extra cost, is vLLM's host side. vLLM 0.26 ships a second model runner (VLLM_USE_V2_MODEL_RUNNER: inputs
    # prepared on the GPU, asynchronous by design) that it leaves off for hybrid models such as Qwen3.5 though it
    # carries their GDN state (v1/worker/gpu/model_states/mamba_hybrid.py) and MTP (not ngram or suffix). The
    # pruned int4 head without speculation and with MTP K=2, on each runner, one host: --only environment,checkpoint,
    # bandwidth,quantize-awq-broad-head4-vocab131k,serve-vocab131k-plain-runner1,serve-vocab131k-plain-runner2,
    # serve-vocab131k-mtp2-runner2,serve-vocab131k-mtp2-runner1
    **{
        f"vocab131k-{form}-runner{runner}": {
            "recipe": VOCAB131K,
            "speculative": speculative,
            "first": "empty" if (form, runner) == ("plain", 1) else "seeded:vocab131k-plain-runner1",
            "bake": (form, runner) == ("plain", 1),
            "restart": False,
            "profile": True,
            # the project's key (serving/settings.py: VLLM_USE_V2_MODEL_RUNNER 0 or 1); machine26 set that variable
            # through this spec's `env` instead, which the key now writes
            "serve": {"model_runner": f"v{runner}"},
        }
        for form, speculative in (("plain", NO_SPECULATION), ("mtp2", {"method": "mtp", "k": 2}))
        for runner in (1, 2)
    },
    # twentieth lease (issue 14, item 4): MTP K=2 on the second runner, set by the project's key, against the
    # greedy reference of its recipe; bf16 (no quantization to wait for): --only environment,checkpoint,bandwidth,
    # serve-bf16-reference,serve-bf16-mtp2-runner2,lossless
    "bf16-reference": {
        "recipe": None,
        "speculative": NO_SPECULATION,
        "first": "empty",
        "bake": True,
        "restart": False,
        "reference": True,
    },
    "bf16-mtp2-runner2": {
        "recipe": None,
        "speculative": {"method": "mtp", "k": 2},
        "first": "seeded:bf16-reference",
        "serve": {"model_runner": "v2"},
    },
    # twenty-first lease (issue 15, item 5): Marlin's one-token GEMMs run at about 1.3 TB/s with a ~10 us floor each.
    # Two other int4 kernels built for one token, each used as it ships: PyTorch's own (tinygemm) and GemLite's
    # Triton GEMVs (PyPI `gemlite`, carried as .device-stage/gemlite/c0), first the step's GEMMs alone (shapes from
    # machine22's checkpoint, no quantization to wait for), then the pruned int4 head served by vLLM's Marlin and
    # through GemLite's own vLLM backend (its `vllm.general_plugins` entry point, inert unless VLLM_GEMLITE_ENABLE),
    # each from an empty cache: --only environment,checkpoint,bandwidth,marlinbench-kernels,
    # quantize-awq-broad-head4-vocab131k,serve-vocab131k-plain-marlin,serve-vocab131k-plain-gemlite
    "kernels": {
        "recipe": VOCAB131K,
        "speculative": NO_SPECULATION,
        "bench": {
            "gemms_from": "results/gpu-proof/h100-marlin/marlinbench-vocab131k-plain-vllm.json",
            "modes": "marlin,tinygemm,gemlite,bf16",
        },
    },
    "vocab131k-plain-marlin": {
        "recipe": VOCAB131K,
        "speculative": NO_SPECULATION,
        "first": "empty",
        "restart": False,
        "profile": True,
        "env": {GEMLITE_ENABLE: "0"},
    },
    "vocab131k-plain-gemlite": {
        "recipe": VOCAB131K,
        "speculative": NO_SPECULATION,
        "first": "empty",  # GemLite's ops are traced into the compiled graphs: nothing of Marlin's cache applies
        "restart": False,
        "profile": True,
        # every int4 layer but the head (GemLite's default skip list), as its backend routes compressed-tensors
        "env": {GEMLITE_ENABLE: "1", "VLLM_GEMLITE_ENABLE_LIST": "A16W4_HQQ_INT"},
    },
    # twenty-second lease (issue 14, item 3; issue 15): the silent copy-drafter step is host-bound (GPU 3.6 ms, a
    # token 4.7-4.8 ms on machine18) and the plain step's token is ~0.4 ms longer than its GPU work. py-spy samples
    # the engine core's Python during one long request (run_spy) of the plain step, the captured padded ngram_gpu
    # K=4 with every plugin, and MTP K=2 on the second runner: --only environment,checkpoint,bandwidth,
    # quantize-awq-w4a16-g32-broad,serve-awq-broad-spied,serve-awq-broad-ngramgpu4-spied,
    # serve-awq-broad-mtp2-runner2-spied
    "awq-broad-spied": {"recipe": BROAD, "speculative": NO_SPECULATION, "bake": True, "restart": False, "spy": True},
    "awq-broad-ngramgpu4-spied": {
        "recipe": BROAD,
        "speculative": NGRAM_GPU4_GRAPH,
        "first": "from:awq-broad-spied",
        "spy": True,
    },
    "awq-broad-mtp2-runner2-spied": {
        "recipe": BROAD,
        "speculative": {"method": "mtp", "k": 2},
        "first": "from:awq-broad-spied",
        "serve": {"model_runner": "v2"},
        "spy": True,
    },
    # twenty-third lease (issue 14, item 3; machine30, results/gpu-proof/h100-silent-k): machine29 found the silent
    # K=4 step no longer host-bound, so a shorter verify looked like the lever: the same captured padded ngram_gpu at
    # K=2 and K=1 beside the plain step (K=4 was lost with the machine). Both were host-bound again and no cheaper:
    # --only environment,checkpoint,bandwidth,quantize-awq-w4a16-g32-broad,serve-awq-broad-spied,
    # serve-awq-broad-ngramgpu2-spied,serve-awq-broad-ngramgpu1-spied,serve-awq-broad-ngramgpu4-spied
    **{
        f"awq-broad-ngramgpu{k}-spied": {
            "recipe": BROAD,
            "speculative": {**NGRAM_GPU4_GRAPH, "k": k},
            "first": "from:awq-broad-spied",
            "spy": True,
        }
        for k in (2, 1)
    },
    # twenty-fourth lease (issue 14, item 3): machine30's K=2 step was host-bound, and two of its largest host costs
    # beyond a plain step were vLLM writing the verify step's input ids (four index lists pinned and scattered) and
    # ngram_gpu's token counts (gathered and scattered by slot) every step. serving/draft_input_ids.py and
    # serving/ngram_token_counts.py (on by default) write both as slices when the batch is steady. K=2 with them and
    # without (machine30's form), then K=4 with them, beside the plain step on one host (machine31,
    # results/gpu-proof/h100-input-slices: the two costs fell from 0.48 to 0.21 ms a step, the step did not measurably
    # shorten): --only environment,
    # checkpoint,bandwidth,quantize-awq-w4a16-g32-broad,serve-awq-broad-spied,serve-awq-broad-ngramgpu2-slices-spied,
    # serve-awq-broad-ngramgpu2-scatter-spied,serve-awq-broad-ngramgpu4-slices-spied
    **{
        f"awq-broad-ngramgpu{k}-{form}-spied": {
            "recipe": BROAD,
            "speculative": {**NGRAM_GPU4_GRAPH, "k": k},
            "first": "from:awq-broad-spied",
            "spy": True,
            "env": env,
        }
        for k, form, env in (
            (2, "slices", {}),
            (2, "scatter", {DRAFT_INPUT_IDS_OFF: "0", NGRAM_TOKEN_COUNTS_OFF: "0"}),
            (4, "slices", {}),
        )
    },
    # twenty-fifth lease (machine32; issue 14, items 3 and 4): on machine31 two starts of one code path parted at a
    # prefill's first token, and Triton re-times its autotuned kernels (vLLM's GDN prefill among them) at every
    # start; serving/launch.KEEP_AUTOTUNING now keeps the picks in the shared cache. Each form started twice from one
    # cache, their ids compared start to start (TRITON_PRINT_AUTOTUNING=1 logs the picks; K=2's second start was
    # lost with the lease's budget, and the twenty-sixth lease below takes it up): --only environment,
    # checkpoint,bandwidth,quantize-awq-w4a16-g32-broad,serve-awq-broad-spied,serve-awq-broad-again,
    # serve-awq-broad-ngramgpu2-slices-spied,serve-awq-broad-ngramgpu2-slices-again
    # --serve-env VLLM_USE_FLASHINFER_SAMPLER=0 --serve-env TRITON_PRINT_AUTOTUNING=1
    "awq-broad-again": {"recipe": BROAD, "speculative": NO_SPECULATION, "first": "from:awq-broad-spied"},
    "awq-broad-ngramgpu2-slices-again": {
        "recipe": BROAD,
        "speculative": {**NGRAM_GPU4_GRAPH, "k": 2},
        "first": "from:awq-broad-spied",
    },
    # twenty-sixth lease, the first on an H200 (HBM3e at 4.8 TB/s against the H100's 3.35, and another host CPU, which
    # the environment record now names). The plain AWQ token was host-bound on every H100 host (2.8-3.2 ms of host
    # work a step): spied and profiled (GPU busy a step) here, it says whether faster memory or this host reaches issue
    # 15's 2.2 ms. Then issue 14, item 3's silent K=2 step on this host, baked from the plain start's cache; bf16 on
    # the same host; and K=2 started again on its own baked cache. machine32's K=2 start reused the plain start's
    # Triton picks and still parted from it at a prefill's near tie; the candidate is inductor, which tunes the kernels
    # of each compile hash in that hash's own cache (kernel_picks records them), so under it a start on its own baked
    # cache gives the same ids on every pair. machine33 probed the plain start and went back idle before its profile
    # (results/gpu-proof/h200: bf16 ran on machine34 with the time left); the rest waits for the next lease:
    # --only environment,checkpoint,bandwidth,quantize-awq-w4a16-g32-broad,
    # serve-awq-broad-spied-profile,serve-awq-broad-ngramgpu2-baked,serve-bf16-base,serve-awq-broad-ngramgpu2-rebaked
    # --serve-env VLLM_USE_FLASHINFER_SAMPLER=0 --serve-env TRITON_PRINT_AUTOTUNING=1
    "awq-broad-spied-profile": {
        "recipe": BROAD,
        "speculative": NO_SPECULATION,
        "bake": True,
        "restart": False,
        "spy": True,
        "profile": True,
    },
    "awq-broad-ngramgpu2-baked": {
        "recipe": BROAD,
        "speculative": {**NGRAM_GPU4_GRAPH, "k": 2},
        "first": "from:awq-broad-spied-profile",
        "bake": True,
        "restart": False,
        "spy": True,
    },
    "awq-broad-ngramgpu2-rebaked": {
        "recipe": BROAD,
        "speculative": {**NGRAM_GPU4_GRAPH, "k": 2},
        "first": "from:awq-broad-ngramgpu2-baked",
    },
}
SPEC_DEFAULTS = {
    "serve": {},  # over config.yaml's real serve section
    "env": {},  # the server's environment, over --serve-env
    "first": "seeded",
    "bake": False,
    "restart": True,
    "sets": "all",
    "reference": False,
    "profile": False,
    "bench": None,  # marlinbench: {"gemms_from": an earlier bench's JSON (no checkpoint needed), "modes": "a,b"}
    "spy": False,  # after the probe, py-spy samples the engine core during one long request (run_spy)
}
for _name, _spec in VARIANTS.items():
    VARIANTS[_name] = {**SPEC_DEFAULTS, **_spec}
# which quantize step makes a recipe's checkpoint (the issue-14 variants reuse the broad one)
QUANTIZED_BY = {
    BROAD: "awq-w4a16-g32-broad",
    "recipes/awq-w4a16-g32-mlp.yaml": "awq-w4a16-g32-mlp",
    HEAD4: "awq-broad-head4",
    HEAD8: "awq-broad-head8",
    VOCAB131K: "awq-broad-head4-vocab131k",
    G128: "awq-w4a16-g128-broad",
}
# bf16 is served before the first quantization: it proves the serving path early and does not wait on AWQ.
STEPS = [
    "environment",
    "checkpoint",
    "bandwidth",
    "serve-bf16",
    "quantize-awq-w4a16-g32-broad",
    "serve-awq-w4a16-g32-broad",
    "serve-bf16-mtp2",
    "serve-bf16-mtp1",
    "serve-bf16-mtp4",
    "quantize-awq-w4a16-g32-mlp",
    "serve-awq-w4a16-g32-mlp",
    "coldstart-empty-awq-w4a16-g32-broad",
    # issue 14 (results/gpu-proof/h100-spec): --only environment,checkpoint,bandwidth,serve-bf16-base,
    # quantize-awq-w4a16-g32-broad,serve-awq-broad,serve-awq-broad-suffix24,serve-awq-broad-mtp2,lossless
    "serve-bf16-base",
    "serve-awq-broad",
    "serve-awq-broad-suffix24",
    "serve-awq-broad-mtp2",
    "lossless",
    # issue 14, second lease: --only environment,checkpoint,bandwidth,serve-bf16-suffix24,serve-bf16-plain
    "serve-bf16-suffix24",
    "serve-bf16-plain",
    # issues 15 and 14, profiles and the quantized head: --only environment,checkpoint,bandwidth,
    # quantize-awq-w4a16-g32-broad,serve-awq-broad-profile,quantize-awq-broad-head4,serve-awq-broad-head4,
    # serve-awq-broad-suffix24-profile,quantize-awq-broad-head8,serve-awq-broad-head8
    "serve-awq-broad-profile",
    "quantize-awq-broad-head4",
    "serve-awq-broad-head4",
    "serve-awq-broad-suffix24-profile",
    "quantize-awq-broad-head8",
    "serve-awq-broad-head8",
    # fourth lease (--only runs its steps in the order given): --only environment,checkpoint,bandwidth,
    # quantize-awq-w4a16-g32-broad,serve-awq-broad-all-profile,serve-awq-broad-suffix24-pad-profile,lossless-pad,
    # quantize-awq-broad-head4-vocab131k,serve-awq-broad-head4-vocab131k,quantize-awq-broad-head8,
    # serve-awq-broad-head8-tied,serve-awq-broad-suffix24-nopad-profile,quantize-awq-broad-head4,
    # serve-awq-broad-head4-tied  (with --serve-env VLLM_USE_FLASHINFER_SAMPLER=0, see Driver.serve_env)
    "serve-awq-broad-all-profile",
    "serve-awq-broad-suffix24-pad-profile",
    "lossless-pad",
    "quantize-awq-broad-head4-vocab131k",
    "serve-awq-broad-head4-vocab131k",
    "serve-awq-broad-head8-tied",
    "serve-awq-broad-suffix24-nopad-profile",
    "serve-awq-broad-head4-tied",
    "serve-bf16-all",
    "serve-awq-broad-suffix24-pad-f4",
    "serve-awq-broad-suffix48-d64-pad-f4",
    "serve-awq-broad-suffix48-d64-pad-f4-prefix",
    "quantize-awq-w4a16-g128-broad",
    "serve-awq-w4a16-g128-broad",
    "serve-awq-broad-suffix32-d48-pad-f4",
    "serve-awq-w4a16-g128-marlin",
    "serve-awq-broad-silent32-d48-f4",
    "serve-awq-broad-ngramgpu4-pad",
    "serve-awq-broad-ngramgpu4",
    "serve-awq-broad-ngramgpu16-pad",
    "serve-awq-broad-ngramgpu4-pad-graph",
    "serve-awq-broad-ngramgpu16-pad-graph",
    "serve-awq-broad-ngramgpu4-pad-graph-traced",
    "serve-awq-broad-ngramgpu16-pad-graph-traced",
    "serve-awq-broad-ngramgpu4-gdn-traced",
    "serve-awq-broad-ngramgpu4-vllmgdn-traced",
    "serve-awq-broad-ngramgpu4-idx-traced",
    "serve-awq-broad-ngramgpu4-greedy-traced",
    "serve-awq-broad-ngramgpu4-vllmsampler-traced",
    "serve-awq-broad-mtp2-plugins",
    "serve-awq-broad-mtp2-vllm",
    "serve-awq-broad-mtp4-plugins",
    "serve-awq-broad-vocab131k-mtp2",
    "serve-awq-broad-vocab131k-plain",
    "marlinbench-vocab131k-plain-vllm",
    "serve-vocab131k-plain-vllm",
    "serve-vocab131k-plain-atomic",
    "serve-vocab131k-plain-bf16",
    "serve-vocab131k-plain-runner1",
    "serve-vocab131k-plain-runner2",
    "serve-vocab131k-mtp2-runner2",
    "serve-vocab131k-mtp2-runner1",
    "serve-bf16-reference",
    "serve-bf16-mtp2-runner2",
    "marlinbench-kernels",
    "serve-vocab131k-plain-marlin",
    "serve-vocab131k-plain-gemlite",
    "serve-awq-broad-spied",
    "serve-awq-broad-ngramgpu4-spied",
    "serve-awq-broad-mtp2-runner2-spied",
    "serve-awq-broad-ngramgpu2-spied",
    "serve-awq-broad-ngramgpu1-spied",
    "serve-awq-broad-ngramgpu2-slices-spied",
    "serve-awq-broad-ngramgpu2-scatter-spied",
    "serve-awq-broad-ngramgpu4-slices-spied",
    "serve-awq-broad-again",
    "serve-awq-broad-ngramgpu2-slices-again",
    "serve-awq-broad-spied-profile",
    "serve-awq-broad-ngramgpu2-baked",
    "serve-awq-broad-ngramgpu2-rebaked",
]
# vLLM's torch profiler (its ProfilerConfig): kernels and host ranges, no Python stacks (they slow the host side
# that the profile is partly about)
PROFILER = {"profiler": "torch", "torch_profiler_with_stack": False, "torch_profiler_record_shapes": False}
# py-spy (its wheel carried as .device-stage/pyspy/c0, installed by device.sh): two windows of one long request,
# wall clock (--idle) then on-CPU. output_tokens None sizes the request from the variant's probe (spy_output_tokens):
# machine30's plain AWQ request of a fixed 6,144 tokens (3.35 ms each) ended inside the second window, because each
# py-spy run took 3-5 s more than its --duration (attaching, reading symbols) on top of it
PY_SPY = os.environ.get("PY_SPY", "/tmp/pyspy/bin/py-spy")
ENGINE_CORE_TITLE = "VLLM::EngineCore"  # vLLM's setproctitle of the engine core process
SHORT_SPY_REQUEST = "the spied request ended before py-spy's windows"  # how such a record's spy error begins
SPY = {
    "rate_hz": 1000,
    "window_s": 6,
    "lead_s": 2.0,
    "pyspy_start_s": 6.0,  # a margin over the 3-5 s that machine30's py-spy runs took beyond their --duration
    "prompt_tokens": 64,
    "output_tokens": None,  # an int fixes the count (the tests do)
}


def spy_output_tokens(spy: dict, probe: dict, max_model_len: int) -> int:
    """Tokens for the spied request: spy["output_tokens"] where fixed, else enough to outlast the lead and every
    window (each with py-spy's own start) at the fastest inter-token latency the variant's probe measured, within
    the context the prompt leaves."""
    if spy["output_tokens"] is not None:
        return spy["output_tokens"]
    from gpu_proof.spy_breakdown import WINDOWS

    itls = [c["itl_median_ms"] for probed in prompt_sets(probe).values() for c in probed["categories"]]
    fastest_ms = min(itl for itl in itls if itl)
    needed_s = spy["lead_s"] + len(WINDOWS) * (spy["window_s"] + spy["pyspy_start_s"])
    return min(max_model_len - 2 * spy["prompt_tokens"], math.ceil(needed_s * 1000 / fastest_ms))


def host_cpu(cpuinfo: str, governor: str | None) -> dict:
    """The host CPU from /proc/cpuinfo's text: its model and its cores' clocks when read, and the frequency governor
    (None where the host exposes none). A host-bound step follows them: machine32's silent K=2 step did 5.30 ms of host
    work where machine31's did 4.03 ms with the same code, and the environment record did not say why."""
    fields = [line.split(":", 1) for line in cpuinfo.splitlines() if ":" in line]
    models = {value.strip() for key, value in fields if key.strip() == "model name"}
    clocks = [float(value) for key, value in fields if key.strip() == "cpu MHz"]
    return {
        "model": " / ".join(sorted(models)) or None,
        "mhz_min_max": [min(clocks), max(clocks)] if clocks else None,
        "governor": governor,
    }


class Driver:
    def __init__(self, state: Path, warmup: int, runs: int, serve_env: dict[str, str] | None = None):
        self.state = state
        self.results = state / "results"
        self.logs = self.results / "logs"
        self.done = state / "done"
        for d in (self.results, self.logs, self.done, state / "serve", state / "cache", state / "quant"):
            d.mkdir(parents=True, exist_ok=True)
        self.model_dir = state / "weights" / "Qwen3.5-4B-random"
        self.warmup, self.runs = warmup, runs
        # extra environment for every server of the run, recorded in each variant's record. The fourth lease set
        # VLLM_USE_FLASHINFER_SAMPLER=0: FlashInfer's top-k/top-p sampler is JIT-built with nvcc at every start whose
        # cache was seeded from another variant (~130 s, machine7's logs), and a greedy request never calls it
        self.serve_env = dict(serve_env or {})
        self.config = _load_config()
        self.serve_cmd = [sys.executable, "-m", "serving"]  # the image's entrypoint (tests swap in fake_server.py)
        self.spy_cmd, self.engine_core_title, self.spy = [PY_SPY], ENGINE_CORE_TITLE, dict(SPY)  # tests swap them

    # ---- bookkeeping ----
    def log(self, message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)

    def record(self, name: str, data: dict) -> None:
        path = self.results / f"{name}.json"
        tmp = path.with_name(path.name + ".partial")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        tmp.replace(path)
        self.snapshot()

    def snapshot(self) -> None:
        tmp = self.state / "results.tar.gz.partial"
        with tarfile.open(tmp, "w:gz") as archive:
            archive.add(self.results, arcname="results")
        tmp.replace(self.state / "results.tar.gz")

    def run_steps(self, only: list[str] | None) -> None:
        unknown = sorted(set(only or ()) - set(STEPS))
        if unknown:
            raise SystemExit(f"unknown steps {unknown}; known: {STEPS}")
        for step in only or STEPS:  # --only's order: a lease runs what matters most first
            if (self.done / step).exists():
                self.log(f"{step}: done before, skipped")
                continue
            self.log(f"=== {step}")
            started = time.monotonic()
            try:
                getattr(self, "step_" + step.split("-", 1)[0])(step)
                (self.done / step).write_text(f"{time.monotonic() - started:.1f}\n")
                self.log(f"{step}: ok in {time.monotonic() - started:.0f} s")
            except Exception as error:  # noqa: BLE001  recorded; later steps go on where they can
                self.log(f"{step}: FAILED after {time.monotonic() - started:.0f} s: {error}")
                traceback.print_exc()
                self.record(
                    f"failed-{step}",
                    {
                        "kind": "failure",
                        "status": "failed",
                        "step": step,
                        "error": str(error)[-4000:],
                        "seconds": time.monotonic() - started,
                    },
                )
        self.log("all steps finished")

    # ---- steps ----
    def step_environment(self, step: str) -> None:
        smi = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total,pci.bus_id,clocks.max.memory",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
        ).stdout.strip()
        name, driver, memory, bus, mem_clock = [part.strip() for part in smi.split(",")]
        versions = {}
        for label, site, names in (
            ("host", None, ["torch", "transformers", "triton", "tokenizers", "safetensors", "accelerate", "numpy"]),
            (
                "vllm_bundle",
                SITE_VLLM,
                ["vllm", "flashinfer-python", "compressed-tensors", "xgrammar", "torch", "transformers", "triton"],
            ),
            (
                "llmcompressor_bundle",
                SITE_LLMC,
                ["llmcompressor", "compressed-tensors", "datasets", "torch", "transformers"],
            ),
        ):
            env = dict(os.environ, PYTHONPATH=site or "")
            code = (
                "import json, importlib.metadata as m\nout = {}\nfor n in %r:\n    try: out[n] = m.version(n)\n"
                "    except m.PackageNotFoundError: out[n] = 'absent'\nprint(json.dumps(out))" % names
            )
            versions[label] = json.loads(
                subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
            )
        cuda = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.version.cuda)"], capture_output=True, text=True
        ).stdout.strip()
        governor_file = Path("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor")
        governor = governor_file.read_text().strip() if governor_file.exists() else None
        self.record(
            "environment",
            {
                "kind": "environment",
                "status": "ok",
                "gpu": {
                    "name": name,
                    "driver": driver,
                    "memory_total": memory,
                    "pci_bus_id": bus,
                    "max_memory_clock": mem_clock,
                },
                "gpu_count": len(smi.splitlines()),
                "cpu_count": os.cpu_count(),
                "cpu": host_cpu(Path("/proc/cpuinfo").read_text(), governor),
                "python": sys.version.split()[0],
                "torch_cuda": cuda,
                "versions": versions,
                "docker": shutil.which("docker") is not None,
                "driver_command": " ".join(["python3", *sys.argv]),
            },
        )

    def step_checkpoint(self, step: str) -> None:
        shutil.rmtree(self.model_dir, ignore_errors=True)
        result = self.state / "checkpoint.json"
        self._python(
            [str(ROOT / "gpu_proof" / "build_checkpoint.py"), str(self.model_dir), str(result)],
            env={},
            log_name="checkpoint",
        )
        data = json.loads(result.read_text())
        data["command"] = f"python3 gpu_proof/build_checkpoint.py {self.model_dir} {result}"
        self.record("checkpoint", data)

    def step_bandwidth(self, step: str) -> None:
        result = self.state / "bandwidth.json"
        self._python([str(ROOT / "gpu_proof" / "bandwidth.py"), str(result)], env={}, log_name="bandwidth")
        data = json.loads(result.read_text())
        data["command"] = f"python3 gpu_proof/bandwidth.py {result}"
        self.record("bandwidth", data)

    def step_marlinbench(self, step: str) -> None:
        """gpu_proof/marlin_bench.py on the int4 GEMMs of a variant's checkpoint."""
        spec = VARIANTS[step.removeprefix("marlinbench-")]
        result = self.state / f"{step}.json"
        if spec["bench"]:
            args = ["--gemms-from", str(ROOT / spec["bench"]["gemms_from"]), "--modes", spec["bench"]["modes"]]
        else:
            args = [str(self.model_for(spec))]
        bench = ROOT / "gpu_proof" / "marlin_bench.py"
        self._python([str(bench), *args, str(result)], env={"PYTHONPATH": SITE_VLLM}, log_name=step, timeout=900)
        data = json.loads(result.read_text())
        data["command"] = f"PYTHONPATH={SITE_VLLM} python3 gpu_proof/marlin_bench.py {' '.join(args)} {result}"
        self.record(step, data)

    def step_quantize(self, step: str) -> None:
        variant = step.removeprefix("quantize-")
        recipe = ROOT / VARIANTS[variant]["recipe"]
        out = self.state / "quant" / variant
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        result = self.state / f"quantize-{variant}.json"
        env = {
            "PYTHONPATH": os.pathsep.join([SITE_LLMC, SITE_EXTRA, str(ROOT / "scripts")]),
            "TOKENIZERS_PARALLELISM": "false",
        }
        try:
            self._python(
                [
                    str(ROOT / "gpu_proof" / "quantize_variant.py"),
                    str(self.model_dir),
                    str(recipe),
                    str(out),
                    str(result),
                ],
                env=env,
                log_name=step,
                timeout=1200,
            )
        finally:
            if result.exists():
                data = json.loads(result.read_text())
                data["command"] = (
                    f"PYTHONPATH={env['PYTHONPATH']} python3 gpu_proof/quantize_variant.py "
                    f"{self.model_dir} {VARIANTS[variant]['recipe']} {out} {result}"
                )
                data["variant"] = variant
                self.record(step, data)

    def step_serve(self, step: str) -> None:
        variant = step.removeprefix("serve-")
        self.serve_variant(variant, VARIANTS[variant])

    def step_coldstart(self, step: str) -> None:
        variant = step.removeprefix("coldstart-empty-")
        spec = dict(VARIANTS[variant], first="empty", bake=False)
        self.serve_variant(variant, spec, name=f"coldstart-empty-{variant}", probe_it=False, kind="coldstart")

    # ---- serving ----
    def serve_settings(self, speculative: dict, profile_dir: Path | None = None, serve: dict | None = None) -> dict:
        """serve.json as the pipeline's serve_config rule writes it, through the same table (serving/settings.py),
        from the real serve section with a variant's `serve` overrides; with `profile_dir`, vLLM's profiler is
        configured to write there (extra_args, as a user would add it)."""
        from serving.settings import serve_json

        settings = serve_json({**self.config["variants"][REAL_VARIANT]["serve"], **(serve or {})}, speculative)
        if profile_dir is not None:
            profiler = dict(PROFILER, torch_profiler_dir=str(profile_dir))
            settings["extra_args"] = [*settings["extra_args"], "--profiler-config", json.dumps(profiler)]
        return settings

    def probe_settings(self) -> dict:
        return {
            **section_defaults("probe"),
            **(self.config.get("probe") or {}),
            "warmup": self.warmup,
            "runs": self.runs,
        }

    def model_for(self, spec: dict) -> Path:
        if spec["recipe"] is None:
            return self.model_dir
        variant = QUANTIZED_BY[spec["recipe"]]
        model = self.state / "quant" / variant / "model"
        if not (model / "config.json").is_file():
            raise RuntimeError(f"{model} is missing: quantize-{variant} did not finish")
        return model

    def prepare_cache(self, variant: str, how: str) -> tuple[Path, str]:
        # one path for both starts, as in the image (/opt/ml/cache for the bake and for serving)
        cache = self.state / "cache" / f"{variant}-live"
        shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir(parents=True)
        # "seeded": bf16's kernel caches; "seeded:<variant>": that variant's (another checkpoint's graphs never fit)
        seed_tar = self.state / "cache" / f"{how.partition(':')[2] or 'bf16'}.tar"
        if how.startswith("seeded") and not seed_tar.exists():
            how = "empty"  # nothing to seed from yet
        if how.startswith("seeded"):
            how = "seeded"
            with tarfile.open(seed_tar) as archive:
                members = [m for m in archive.getmembers() if m.name.split("/", 1)[0] in KERNEL_CACHES]
                archive.extractall(cache, members=members, filter="fully_trusted")
        elif how.startswith("from:"):  # another variant's whole baked cache (same weights: its kernels, its graphs)
            with tarfile.open(self.state / "cache" / f"{how.removeprefix('from:')}.tar") as archive:
                archive.extractall(cache, filter="fully_trusted")
            how = "seeded"
        elif how.startswith("baked:"):
            with tarfile.open(how.split(":", 1)[1]) as archive:
                archive.extractall(cache, filter="fully_trusted")
            how = "baked"
        return cache, how

    def serve_variant(
        self, variant: str, spec: dict, name: str | None = None, probe_it: bool = True, kind: str = "variant"
    ) -> None:
        name = name or f"variant-{variant}"
        model = self.model_for(spec)
        settings = self.serve_settings(
            spec["speculative"], self.profile_dir(variant) if spec["profile"] else None, spec["serve"]
        )
        serve_json = self.state / "serve" / f"{variant}.json"
        serve_json.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
        from serving.settings import vllm_args  # the exact flags the entrypoint will exec

        record = {
            "kind": kind,
            "status": "running",
            "variant": variant,
            "recipe": spec["recipe"],
            "speculative": spec["speculative"],
            "model_dir": str(model),
            "serve_settings": settings,
            "serve_env": {**self.serve_env, **spec["env"]},
            "command": (
                f"cd <repo> && SERVE_CONFIG={serve_json} MODEL_DIR={model} HOST=127.0.0.1 PORT=<port> "
                f"CACHE_DIR=<cache> PYTHONPATH={SITE_VLLM} python3 -m serving"
            ),
            "vllm_args": planned_args(vllm_args, settings, model),
            "weights": part_bytes(model),
            "cold_start": {},
            "probe": None,
            "decode": None,
        }
        self.record(name, record)
        first_cache, how = self.prepare_cache(variant, spec["first"])
        proc, base, log_path = self.start(variant, serve_json, model, first_cache, "first")
        try:
            seconds = self.wait_ready(proc, base, log_path)
            record["cold_start"][f"{how}_cache_s"] = round(seconds, 1)
            record["vllm_command"] = served_command(log_path)
            record["cold_start"]["first_start_cache"] = how
            record["gpu_memory_used_mib"] = gpu_memory_used()
            self.log(f"{variant}: ready after {seconds:.1f} s ({how} cache)")
            self.record(name, record)
            if spec["bake"]:
                bake_start = time.monotonic()
                warm_up(
                    base,
                    settings["served_model_name"],
                    self.probe_settings()["categories"],
                    self.probe_settings()["sentence"],
                    log=self.log,
                )
                record["cold_start"]["warm_up_s"] = round(time.monotonic() - bake_start, 1)
            if probe_it and not (spec["bake"] and spec["restart"]):
                self.run_probe(record, name, base, settings, spec)
        finally:
            self.stop(proc, log_path)
        record["kernel_picks"] = kernel_picks(first_cache)
        self.record(name, record)
        if spec["bake"]:
            # bf16's archive seeds the kernel caches of every later variant (prepare_cache)
            tar_path = self.state / "cache" / f"{'bf16' if spec['recipe'] is None else variant}.tar"
            packed = deterministic_tar(first_cache, tar_path)
            record["cold_start"].update(
                cache_files=packed["files"], cache_bytes=packed["bytes"], cache_by_dir=cache_by_dir(first_cache)
            )
            self.record(name, record)
        if spec["bake"] and spec["restart"]:
            cache, how = self.prepare_cache(variant, f"baked:{tar_path}")
            proc, base, log_path = self.start(variant, serve_json, model, cache, "baked")
            try:
                seconds = self.wait_ready(proc, base, log_path)
                record["cold_start"]["baked_cache_s"] = round(seconds, 1)
                record["cold_start"]["baked_start_log"] = compile_cache_evidence(log_path)
                record["gpu_memory_used_mib"] = gpu_memory_used()
                self.log(f"{variant}: ready after {seconds:.1f} s (baked cache)")
                self.record(name, record)
                if probe_it:
                    self.run_probe(record, name, base, settings, spec)
            finally:
                self.stop(proc, log_path)
        shutil.rmtree(self.state / "cache" / f"{variant}-live", ignore_errors=True)
        record["status"] = "ok"
        self.record(name, record)

    def run_probe(self, record: dict, name: str, base: str, settings: dict, spec: dict) -> None:
        settings_probe = self.probe_settings()
        model_name = settings["served_model_name"]
        started = time.monotonic()
        if spec["sets"] != "all":  # the competition's set only
            settings_probe = dict(settings_probe, sets=["repeated"])
        varied = str(ROOT / settings_probe["varied_text"])
        result = probe(base, model_name, settings_probe, varied, log=self.log)
        result.update(
            warmup=settings_probe["warmup"],
            runs=settings_probe["runs"],
            ignore_eos=settings_probe["ignore_eos"],
            seconds=round(time.monotonic() - started, 1),
            prompt_sets=", ".join(result["prompt_sets"]),
        )  # a string, as in the committed records
        record["probe"] = result
        record["decode"] = self.decode_analysis(record, spec)
        self.record(name, record)
        if spec["profile"]:
            self.run_profile(record, name, base, settings, varied)
        if spec["spy"]:
            try:
                self.run_spy(record, name, base, settings, varied)
            except Exception as error:  # noqa: BLE001  recorded; the bake and later variants go on
                self.log(f"spy FAILED: {error}")
                record["spy"] = {**(record.get("spy") or {}), "error": str(error)[-2000:]}
                self.record(name, record)
        if spec["reference"]:  # what scripts/lossless_reference.py records, on the same server
            started = time.monotonic()
            record["reference"] = probe(base, model_name, dict(settings_probe, first_run_only=True), varied, self.log)
            record["reference"]["seconds"] = round(time.monotonic() - started, 1)
            self.record(name, record)

    def run_profile(self, record: dict, name: str, base: str, settings: dict, varied: str) -> None:
        """One short request of the repeated set and one of the fresh set, each between /start_profile and
        /stop_profile; the trace of each, broken down by profile_breakdown (decode steps = output tokens over
        the mean acceptance length), and kept when small."""
        from gpu_proof.profile_breakdown import breakdown, load_trace
        from lib.openai_client import request
        from lib.probe import fresh_set, probe_set, varied_paragraphs

        trace_root = self.profile_dir(record["variant"])
        short = next(c for c in self.probe_settings()["categories"] if c["name"] == "short")
        probe_settings = dict(self.probe_settings(), warmup=0, runs=1, categories=[short])
        model_name = settings["served_model_name"]
        record["profile"] = {"profiler": PROFILER, "sets": {}}
        for set_name in ("repeated", "fresh"):
            before = {p for p in trace_root.rglob("*") if p.is_file()} if trace_root.exists() else set()
            status, text, _ = request(base, "/start_profile", {}, timeout_s=120)
            if status != 200:
                raise RuntimeError(f"/start_profile answered {status}: {text[:300]}")
            if set_name == "repeated":
                result = probe_set(base, model_name, probe_settings, [probe_settings["sentence"]], self.log)
            else:
                result = fresh_set(base, model_name, probe_settings, varied_paragraphs(varied), self.log)
            status, text, seconds = request(base, "/stop_profile", {}, timeout_s=600)
            if status != 200:
                raise RuntimeError(f"/stop_profile answered {status}: {text[:300]}")
            trace = self.new_trace(trace_root, before)
            category = result["categories"][0]
            steps = max(1, round(category["output_tokens_mean"] / (category.get("mean_acceptance_length") or 1.0)))
            entry = {
                "request": {k: category.get(k) for k in ("median_ms", "ttft_median_ms", "itl_median_ms")}
                | {
                    "mean_acceptance_length": category.get("mean_acceptance_length"),
                    "output_tokens": category["output_tokens_mean"],
                },
                "stop_profile_s": round(seconds, 1),
                "trace": trace.name,
                "trace_bytes": trace.stat().st_size,
                "breakdown": breakdown(load_trace(trace), steps),
            }
            if trace.stat().st_size < 40 * 2**20:  # kept for whoever opens it in Perfetto
                kept = self.results / "profiles" / f"{record['variant']}-{set_name}{''.join(trace.suffixes[-2:])}"
                kept.parent.mkdir(exist_ok=True)
                shutil.copy(trace, kept)
                entry["kept_as"] = str(kept.relative_to(self.results))
            record["profile"]["sets"][set_name] = entry
            self.log(f"profile {set_name}: {json.dumps(entry['breakdown']['per_step'])}")
            self.record(name, record)

    def run_spy(self, record: dict, name: str, base: str, settings: dict, varied: str) -> None:
        """py-spy on the engine core during one long greedy request of varied text (on random weights nothing is
        accepted, so every step is the method's cost of drafting nothing): a wall-clock window, then an on-CPU one,
        each broken down by spy_breakdown with the request's own time a step (ITL x mean acceptance length)."""
        from concurrent.futures import ThreadPoolExecutor

        from gpu_proof.spy_breakdown import WINDOW_FLAGS, window_breakdowns
        from lib.probe import build_prompt, mean_acceptance_length, spec_counters, timed_completion, varied_paragraphs

        model_name = settings["served_model_name"]
        prompt = build_prompt(base, model_name, varied_paragraphs(varied), self.spy["prompt_tokens"])
        engine = engine_core_pid(int((self.state / "server.pid").read_text()), self.engine_core_title)
        raw_dir = self.results / "spy"
        raw_dir.mkdir(exist_ok=True)
        before = spec_counters(base)
        windows: dict[str, Path] = {}
        with ThreadPoolExecutor(1) as pool:
            tokens = spy_output_tokens(self.spy, record["probe"], settings["max_model_len"])
            request = pool.submit(timed_completion, base, model_name, prompt, tokens, ignore_eos=True)
            time.sleep(self.spy["lead_s"])
            for window, flags in WINDOW_FLAGS.items():
                raw = raw_dir / f"{record['variant']}-{window}.txt"
                command = [*self.spy_cmd, "record", "--pid", str(engine), "--rate", str(self.spy["rate_hz"])]
                command += ["--duration", str(self.spy["window_s"]), "--format", "raw", "--threads", "--nonblocking"]
                spied = subprocess.run([*command, *flags, "-o", str(raw)], capture_output=True, text=True, timeout=120)
                if spied.returncode != 0:
                    raise RuntimeError(f"py-spy exited {spied.returncode}: {(spied.stderr or spied.stdout)[-1500:]}")
                windows[window] = raw
            outlasted = not request.done()
            done = request.result()
        if not outlasted:  # a window that spans the request's end is no step's picture: nothing is kept
            for raw in windows.values():
                raw.unlink()
            raise RuntimeError(
                f"{SHORT_SPY_REQUEST} ({done['output_tokens']} tokens in {done['latency_ms']:.0f} ms): raise SPY's "
                "pyspy_start_s or output_tokens"
            )
        raws = {}
        for window, raw in windows.items():  # kept gzipped whatever follows (collect.py can break them down again)
            raws[window] = raw.with_name(raw.name + ".gz")
            raws[window].write_bytes(gzip.compress(raw.read_bytes(), mtime=0))
            raw.unlink()
        acceptance = mean_acceptance_length(before, spec_counters(base)) or 1.0
        step_ms = round(done["itl_ms"] * acceptance, 3)  # one value for the record and its windows' ms a step
        record["spy"] = {
            "settings": dict(self.spy),
            "raw": {window: str(raw.relative_to(self.results)) for window, raw in raws.items()},
            "request": {k: round(done[k], 3) for k in ("latency_ms", "ttft_ms", "itl_ms")}
            | {"output_tokens": done["output_tokens"], "mean_acceptance_length": acceptance},
            "step_ms": step_ms,
            "step_ms_source": "the spied request's ITL x its mean acceptance length",
        }
        self.record(name, record)
        record["spy"].update(window_breakdowns(raws, self.spy["rate_hz"], step_ms))
        self.log(f"spy: {step_ms:.2f} ms a step, main thread {record['spy']['wall']['main_thread']}")
        self.record(name, record)

    def profile_dir(self, variant: str) -> Path:
        return self.state / "profile" / variant

    def new_trace(self, trace_root: Path, before: set, timeout_s: float = 300) -> Path:
        """The trace file /stop_profile wrote (the engine core writes it after answering), once its size holds."""
        deadline, last = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            fresh = [
                p
                for p in (trace_root.rglob("*") if trace_root.exists() else [])
                if p.is_file() and p not in before and (p.name.endswith(".json.gz") or p.name.endswith(".json"))
            ]
            if fresh:
                newest = max(fresh, key=lambda p: p.stat().st_mtime)
                size = newest.stat().st_size
                if last == (newest, size) and size > 0:
                    return newest
                last = (newest, size)
            time.sleep(2)
        raise RuntimeError(f"no trace appeared under {trace_root} within {timeout_s:.0f} s of /stop_profile")

    def step_lossless(self, step: str) -> None:
        """Every probed speculative variant's greedy ids against its recipe's reference (lib/lossless.py)."""
        from lib.lossless import compare, failures

        records = {
            path.stem.removeprefix("variant-"): json.loads(path.read_text())
            for path in sorted(self.results.glob("variant-*.json"))
        }
        references = {r["recipe"]: (v, r["reference"]) for v, r in records.items() if r.get("reference")}
        checks = []
        for variant, record in records.items():
            if record["speculative"]["method"] == "none" or not record.get("probe"):
                continue
            if record["recipe"] not in references:
                continue
            reference_variant, reference = references[record["recipe"]]
            rows = compare(record["probe"], reference)
            failed = failures(rows)
            checks.append(
                {
                    "variant": variant,
                    "speculative": record["speculative"],
                    "reference_variant": reference_variant,
                    "passed": not failed,
                    "failures": failed,
                    "rows": rows,
                }
            )
        if not checks:
            raise RuntimeError("no speculative variant with a reference of the same recipe was probed")
        self.record("lossless", {"kind": "lossless", "status": "ok", "checks": checks})

    def decode_analysis(self, record: dict, spec: dict) -> dict | None:
        bandwidth_file = self.results / "bandwidth.json"
        checkpoint_file = self.results / "checkpoint.json"
        if not bandwidth_file.exists() or not checkpoint_file.exists():
            return None
        bandwidth = json.loads(bandwidth_file.read_text())
        text = json.loads(checkpoint_file.read_text())["text_config"]
        categories = record["probe"]["categories"]
        return decode_bound(
            record["weights"], draft_passes(spec["speculative"]), bandwidth["copy_gbps"], text, categories
        )

    def start(self, variant: str, serve_json: Path, model: Path, cache: Path, tag: str):
        port = free_port()
        log_path = self.logs / f"{variant}-{tag}.log"
        env = dict(
            os.environ,
            SERVE_CONFIG=str(serve_json),
            MODEL_DIR=str(model),
            HOST="127.0.0.1",
            PORT=str(port),
            CACHE_DIR=str(cache),
            PYTHONPATH=SITE_VLLM,
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            PYTHONUNBUFFERED="1",
            **self.serve_env,
            **VARIANTS[variant]["env"],
        )
        from serving.launch import CACHE_DIRS

        for key in CACHE_DIRS:
            env.pop(key, None)  # serving/launch.py derives them from CACHE_DIR
        handle = open(log_path, "w")
        self.log(f"{variant}: starting `python3 -m serving` on port {port}, cache {cache}")
        proc = subprocess.Popen(
            self.serve_cmd, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )
        handle.close()
        (self.state / "server.pid").write_text(f"{proc.pid}\n")  # its own session: device.sh restart stops it
        return proc, f"http://127.0.0.1:{port}", log_path

    def wait_ready(self, proc, base: str, log_path: Path) -> float:
        return wait_for_ping(
            base, 900, alive=lambda: proc.poll() is None, logs=lambda: error_summary(log_path), interval_s=0.25
        )

    def stop(self, proc, log_path: Path) -> None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        (self.state / "server.pid").unlink(missing_ok=True)
        for _ in range(60):  # the engine core is a child: wait until its memory is back
            used = gpu_memory_used()
            if used is None or used < 2048:
                break
            time.sleep(1)
        shrink_log(log_path)
        self.snapshot()

    def _python(self, args: list[str], env: dict, log_name: str, timeout: float | None = None) -> None:
        log_path = self.logs / f"{log_name}.log"
        with open(log_path, "w") as handle:
            result = subprocess.run(
                [sys.executable, "-u", *args],
                cwd=ROOT,
                env=dict(os.environ, **env),
                stdout=handle,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
        shrink_log(log_path)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(args[:1])} exited {result.returncode}:\n{error_summary(log_path)}")


# ---- pure helpers (tested without a GPU) ----


def _load_config():
    import yaml

    return yaml.safe_load((ROOT / "config.yaml").read_text())


def decode_bound(weights: dict, k: int, copy_gbps: float, text: dict, categories: list[dict]) -> dict:
    """Each category's measured time per output token against the memory-bandwidth bound.

    Weights read per decode step: every decoder layer + the final norm + lm_head (embed_tokens: one row).
    With MTP depth k a step also runs the MTP layer k times, each with the shared lm_head, and yields
    `mean_acceptance_length` tokens. Context adds the full-attention KV cache (8 layers) and the gated
    DeltaNet state (read and written, fp32), taken at the mean context of the category."""
    step_weights = step_bytes(weights, k)["total"]
    full_layers = text["full_attention_layers"]
    kv_per_token = full_layers * 2 * text["num_key_value_heads"] * text["head_dim"] * 2
    state = (
        2
        * text["linear_attention_layers"]
        * text["linear_num_value_heads"]
        * text["linear_key_head_dim"]
        * text["linear_value_head_dim"]
        * 4
    )
    bytes_per_s = copy_gbps * 1e9
    rows = []
    for category in categories:
        context = category["prompt_tokens"] + category["output_tokens_requested"] / 2
        accepted = category.get("mean_acceptance_length") or 1.0
        read = step_weights + kv_per_token * context + state
        weights_ms = step_weights / bytes_per_s * 1e3 / accepted
        total_ms = read / bytes_per_s * 1e3 / accepted
        itl = category["itl_median_ms"]
        rows.append(
            {
                "category": category["name"],
                "itl_median_ms": round(itl, 3),
                "mean_context_tokens": context,
                "tokens_per_step": round(accepted, 4),
                "weights_bound_ms": round(weights_ms, 3),
                "bound_with_kv_state_ms": round(total_ms, 3),
                "fraction_of_bound": round(total_ms / itl, 3) if itl else None,
            }
        )
    return {
        "bandwidth_gbps": copy_gbps,
        "bandwidth_source": "bandwidth.json copy_gbps",
        "weights_bytes_per_step": step_weights,
        "kv_bytes_per_context_token": kv_per_token,
        "state_bytes_per_step": state,
        "categories": rows,
    }


def planned_args(vllm_args, settings: dict, model: Path) -> list[str]:
    """serving/launch.py's flags for these settings on a CUDA host (port as a placeholder)."""
    try:
        return vllm_args(settings, str(model), host="127.0.0.1", port=8000, cuda=True)
    except TypeError:  # a launch.py without the cuda keyword
        return vllm_args(settings, str(model), host="127.0.0.1", port=8000)


def served_command(log_path: Path) -> str | None:
    """The command line serving/launch.py printed before exec'ing vLLM."""
    for line in Path(log_path).read_text(errors="replace").splitlines():
        if line.startswith("serving: "):
            return line.removeprefix("serving: ")
    return None


def compile_cache_evidence(log_path: Path) -> dict:
    """What vLLM's log says about loading its compile cache (the bake's own reading)."""
    return cache_evidence(Path(log_path).read_text(errors="replace"))


def cache_by_dir(cache: Path) -> dict:
    out = {}
    for sub in sorted(p for p in cache.iterdir() if p.is_dir()):
        files = [p for p in sub.rglob("*") if p.is_file()]
        out[sub.name] = {"files": len(files), "bytes": sum(p.stat().st_size for p in files)}
    return out


# what a best_config file records beside the pick itself: the time it measured and the compiled binary's hash
INDUCTOR_NOT_PICKS = ("time_taken_ms", "triton_cache_hash")


def kernel_picks(cache: Path) -> dict:
    """What the kernels autotuned at a start picked, read from its cache dir: Triton's kept results (one
    `<kernel>.autotune.json` a kernel and tuning key, in a dir named by their hash; the pick is the fastest config),
    and inductor's `.best_config` of every kernel it generated with several configs, by path (vLLM keeps an inductor
    cache a compile hash, so each variant tunes its own, beside those a seeded cache brought). Another pick sums in
    another order: machine32's K=2 start timed no Triton kernel on the plain start's picks and still parted from it
    at a prefill's near tie. Unreadable files (a start killed mid-write) are counted, not read."""
    picks: dict = {"triton": {}, "inductor": {}, "unreadable": 0}
    for path in sorted(cache.rglob("*.autotune.json")):
        try:
            data = json.loads(path.read_text())
            config, _ = min(data["configs_timings"], key=lambda pair: pair[1])
        except (OSError, ValueError, KeyError, TypeError):
            picks["unreadable"] += 1
            continue
        picks["triton"][f"{path.parent.name}/{path.name}"] = {"key": data["key"], "config": config}
    for path in sorted(cache.rglob("*.best_config")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            picks["unreadable"] += 1
            continue
        picks["inductor"][str(path.relative_to(cache))] = {k: v for k, v in data.items() if k not in INDUCTOR_NOT_PICKS}
    return picks


def differing_picks(a: dict, b: dict) -> dict:
    """Two starts' kernel_picks side by side, per kind: the kernels both tuned, and those among them that one start
    picked differently. A Triton kernel is its dir hash and name; an inductor kernel is its file name (its source
    hash) under any compile hash, with the set of picks found for it."""

    def by_kernel(picks: dict, kind: str) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for path, pick in picks[kind].items():
            kernel = path if kind == "triton" else Path(path).name
            out.setdefault(kernel, set()).add(json.dumps(pick, sort_keys=True))
        return out

    result = {}
    for kind in ("triton", "inductor"):
        left, right = by_kernel(a, kind), by_kernel(b, kind)
        shared = sorted(set(left) & set(right))
        result[kind] = {"shared": len(shared), "differ": [kernel for kernel in shared if left[kernel] != right[kernel]]}
    return result


def engine_core_pid(server_session: int, title: str) -> int:
    """The engine core process of the server started in its own session `server_session` (by its title)."""
    found = subprocess.run(["pgrep", "-s", str(server_session), "-f", title], capture_output=True, text=True)
    pids = [int(pid) for pid in found.stdout.split()]
    if len(pids) != 1:
        raise RuntimeError(f"expected one process titled {title!r} in session {server_session}, found {pids}")
    return pids[0]


def gpu_memory_used() -> int | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        return int(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def error_summary(log_path: Path, tail: int = 30) -> str:
    lines = Path(log_path).read_text(errors="replace").splitlines() if Path(log_path).exists() else []
    errors = list(dict.fromkeys(line for line in lines if "Error" in line or "error:" in line))[-10:]
    return "\n".join(["error lines:", *errors, "last lines:", *lines[-tail:]])


def shrink_log(log_path: Path, keep: int = 400) -> None:
    """Keep a log's first and last lines (the results travel back in a small archive)."""
    lines = Path(log_path).read_text(errors="replace").splitlines()
    if len(lines) > 2 * keep:
        lines = lines[:keep] + [f"... {len(lines) - 2 * keep} lines left out ..."] + lines[-keep:]
        Path(log_path).write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--state", default="/tmp/gp")
    parser.add_argument("--only", default="")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--serve-env", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    serve_env = dict(item.split("=", 1) for item in args.serve_env)
    driver = Driver(Path(args.state), args.warmup, args.runs, serve_env)
    driver.run_steps([s for s in args.only.split(",") if s] or None)


if __name__ == "__main__":
    main()
