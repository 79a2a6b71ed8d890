"""vLLM general plugin (entry point in _dist/): key compile caches by GPU architecture, not marketing name.

Why it exists: Inductor's cache key (and vLLM's, which hashes Inductor's factors) includes
`CacheBase.get_system()["device"]["name"]`, e.g. "NVIDIA H100 80GB HBM3". A cache baked on one H100
board then misses on an "NVIDIA H100 PCIe" or an H200 host, although the kernels are the same for the
same compute capability (Triton and FlashInfer already key by architecture). The name is replaced by
"sm_<major><minor>" in every vLLM process (plugins load in the API server and the engine core before
anything compiles), so one baked cache serves every GPU of an architecture. serve.patches.gpu_name: false
keeps the board name.
"""

from __future__ import annotations

import functools
import hashlib
import json

from serving.patches import guarded


def json_key(data: dict) -> str:
    """Inductor's system hash as torch <= 2.11 spells it out (2.13, vLLM 0.32's, calls SYSTEM_CACHE_KEY_STRATEGY)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode("utf-8")).hexdigest()


def normalised_system(system: dict, capability: tuple[int, int] | None, key=json_key) -> dict:
    """get_system() with the device name replaced by its architecture and the hash recomputed over it
    (unchanged without a CUDA device)."""
    device = system.get("device") or {}
    if capability is None or not device.get("name"):
        return system
    device = {**device, "name": f"sm_{capability[0]}{capability[1]}"}
    out = {**system, "device": device}
    if "hash" in system:
        out["hash"] = key({"device": device, "version": system.get("version")})
    return out


@guarded("gpu_name")
def register() -> None:
    import torch
    from torch._inductor import codecache
    from torch._inductor.codecache import CacheBase

    strategy = getattr(codecache, "SYSTEM_CACHE_KEY_STRATEGY", None)
    key = strategy.key_from_json if strategy is not None else json_key
    original = CacheBase.get_system
    if getattr(original, "_serving_normalised", False):
        return

    @functools.cache
    def get_system() -> dict:
        system = original()
        # no device name: no CUDA device (torch 2.13 then returns only the hash), nothing to normalise
        if not (system.get("device") or {}).get("name"):
            return system
        return normalised_system(system, torch.cuda.get_device_capability(), key)

    get_system._serving_normalised = True
    CacheBase.get_system = staticmethod(get_system)
