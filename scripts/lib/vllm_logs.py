"""What vLLM's log says about its compile cache (latency_probe proves the image's hit with it) and about where its CPU
worker's threads run (lossless_reference records it)."""

import re

# vLLM's own words when it skips compiling: the AOT artifact (torch >= 2.10) or the per-graph Inductor cache.
CACHE_HIT = re.compile(r"Directly load (AOT compilation|the compiled graph)[^\n]*")
CACHE_MISS = re.compile(r"Compiling model again due to a load failure[^\n]*")


def cache_evidence(log_text: str) -> dict:
    """What vLLM said about its compile cache on a start: hit lines and reload failures."""
    return {
        "hits": [m.group(0) for m in CACHE_HIT.finditer(log_text)][:8],
        "misses": [m.group(0) for m in CACHE_MISS.finditer(log_text)][:8],
    }


# ompmultiprocessing.py's "OpenMP thread binding info" block, one value a line.
OMP_BINDING = re.compile(r"VLLM_CPU_OMP_THREADS_BIND=.*|core ids=.*|reserved_cpus=.*")


def omp_binding_lines(log_text: str) -> list[str]:
    """vLLM's own account of where its CPU worker's OpenMP threads run."""
    return OMP_BINDING.findall(log_text)
