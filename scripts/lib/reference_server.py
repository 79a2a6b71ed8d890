"""The lossless check's reference server: a variant's own built image, speculation off (scripts/lossless_reference.py
runs the reference on it, scripts/lossless_continuations.py the continuations a shared reference lacks).

Only /opt/ml/serve.json is replaced, by the variant's own with `speculative: {method: none}`: the same weights, vLLM
build, kernels and serve settings. The baked compile cache was made with speculation on, so a start compiles: slower,
not different.

On a CPU host vLLM's worker binds its OpenMP threads automatically to every allowed CPU but the last, which it
leaves to the server's own processes, so two servers started alike compute on the same CPUs while the last one
idles. The reference runs beside the quality gate, so its worker is bound to that last CPU instead
(reference_cpu_env): on 2 cores the pair then finishes sooner, with the same greedy ids. Only because this start
compiles anyway: the binding is part of vLLM's compile-cache key, and the gate's server, which loads the baked
cache, keeps the automatic binding.
"""

import contextlib
import json
import os
import tempfile
from pathlib import Path

from lib.vllm_logs import omp_binding_lines

IMAGE_SERVE_JSON = "/opt/ml/serve.json"  # where the image's entrypoint reads its settings (serving/launch.py)
OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"  # vLLM's CPU worker: "auto", or the CPU ids its OpenMP threads run on


def reference_serve(serve: dict) -> dict:
    """The variant's serve.json with speculation off, nothing else changed."""
    return dict(serve, speculative={"method": "none"})


def reference_cpu_env(speculative: dict, gpus: bool, cpus: set[int] | None = None) -> dict[str, str]:
    """The container env that binds the reference's CPU worker to the last of `cpus` (this process's allowed CPUs),
    the one the gate's automatic binding leaves free. Nothing on a GPU, on a one-CPU host, or for a variant that does
    not speculate: its reference is the baked configuration, and a binding would cost it the cache hit."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if gpus or speculative["method"] == "none" or len(cpus) < 2:
        return {}
    return {OMP_BIND_ENV: str(cpus[-1])}


@contextlib.contextmanager
def reference_server(image: dict, variant_serve: dict, run: dict):
    """The running container (lib.containers.RunningContainer: base_url, network) of the built `image`
    (build_image's image.json, run by its recorded ID) served with `variant_serve`'s settings but speculation off;
    `run`: Pipeline.run_settings()."""
    from lib.containers import recorded_image, run_container

    with tempfile.TemporaryDirectory(prefix="lossless-") as tmp:
        serve_path = Path(tmp) / "serve.json"
        serve_path.write_text(json.dumps(reference_serve(variant_serve), indent=2))
        serve_path.chmod(0o644)
        Path(tmp).chmod(0o755)
        with run_container(
            recorded_image(image),
            volumes=[f"{serve_path}:{IMAGE_SERVE_JSON}:ro"],
            env=reference_cpu_env(variant_serve["speculative"], run["gpus"]),
            gpus=run["gpus"],
            shm_size=run["shm_size"],
            name_prefix="lossless-reference",
        ) as container:
            container.wait_ready(run["ping_timeout_s"])
            print("\n".join(["vLLM's CPU thread binding:", *omp_binding_lines(container.logs(tail=100000))]))
            yield container
