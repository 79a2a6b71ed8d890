"""The lossless check's reference: the variant's own image, speculation off, greedy ids of the probe's prompts.

Why this reference (rules/lossless.smk): it is the cheapest one that differs from the probed server in speculation
alone, and it records its top logprobs (a near tie is told from a flip). The same image means the same weights, vLLM
build, kernels and serve settings; only /opt/ml/serve.json is replaced by the variant's own with `speculative:
{method: none}`. lib.probe makes the same prompts the same way (the fresh set's prompts drawn as the probe drew
them) and sends one request a category, the one whose ids the probe recorded (first_run_only), so a reference costs
one server start and a category's request per set, not a second probe. The baked compile cache was made with
speculation on, so this start compiles: slower, not different.

It runs beside the quality gate (both wait for the probe only). On a CPU host vLLM's worker binds its OpenMP threads
automatically to every allowed CPU but the last, which it leaves to the server's own processes, so two servers
started alike compute on the same CPUs while the last one idles. The reference's worker is bound to that last CPU
instead (reference_cpu_env): on 2 cores the pair took 225-229 s instead of 297 s (2026-11-26, AVX2-only EPYCs),
greedy ids unchanged. Only because this start compiles anyway: the binding is part of vLLM's compile-cache key, and
the gate's server, which loads the baked cache, keeps the automatic binding.
"""

import json
import os
import tempfile
from pathlib import Path

from lib.probe import probe
from lib.stage import write_json
from lib.vllm_logs import omp_binding_lines

IMAGE_SERVE_JSON = "/opt/ml/serve.json"  # where the image's entrypoint reads its settings (serving/launch.py)


def reference_serve(serve: dict) -> dict:
    """The variant's serve.json with speculation off, nothing else changed."""
    return dict(serve, speculative={"method": "none"})


OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"  # vLLM's CPU worker: "auto", or the CPU ids its OpenMP threads run on


def reference_cpu_env(speculative: dict, gpus: bool, cpus: set[int] | None = None) -> dict[str, str]:
    """The container env that binds the reference's CPU worker to the last of `cpus` (this process's allowed CPUs),
    the one the gate's automatic binding leaves free. Nothing on a GPU, on a one-CPU host, or for a variant that does
    not speculate: its reference is the baked configuration, and a binding would cost it the cache hit."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if gpus or speculative["method"] == "none" or len(cpus) < 2:
        return {}
    return {OMP_BIND_ENV: str(cpus[-1])}


def main(job) -> None:
    from lib.containers import run_container

    image = json.loads(Path(job.input.image).read_text())
    variant_serve = json.loads(Path(job.input.serve).read_text())
    serve = reference_serve(variant_serve)
    run = job.params.run
    settings = dict(job.params.probe, first_run_only=True)
    with tempfile.TemporaryDirectory(prefix="lossless-") as tmp:
        serve_path = Path(tmp) / "serve.json"
        serve_path.write_text(json.dumps(serve, indent=2))
        serve_path.chmod(0o644)
        Path(tmp).chmod(0o755)
        with run_container(
            image["ref"],
            volumes=[f"{serve_path}:{IMAGE_SERVE_JSON}:ro"],
            env=reference_cpu_env(variant_serve["speculative"], run["gpus"]),
            gpus=run["gpus"],
            shm_size=run["shm_size"],
            name_prefix="lossless-reference",
        ) as container:
            container.wait_ready(run["ping_timeout_s"])
            print("\n".join(["vLLM's CPU thread binding:", *omp_binding_lines(container.logs(tail=100000))]))
            result = probe(container.base_url, job.params.model_name, settings, job.input.varied_text)
    result.update(
        image=image["ref"],
        image_id=image["id"],
        speculative=serve["speculative"],
        note="reference for the lossless check: the variant's image with speculation off, one request "
        "per category (the probe's first timed run's prompt); latencies are not comparable",
    )
    write_json(job.output.reference, result)


if __name__ == "__main__":
    from lib.stage import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
