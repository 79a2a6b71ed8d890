"""The lossless check's reference: the variant's own image, speculation off, greedy ids of the probe's prompts.

Why this reference (rules/lossless.smk): it is the cheapest one that differs from the probed server in speculation
alone, and it records its top logprobs (a near tie is told from a flip). The same image means the same weights, vLLM
build, kernels and serve settings; only /opt/ml/serve.json is replaced by the variant's own with `speculative:
{method: none}`. lib.probe makes the same prompts the same way (the fresh set's prompts drawn as the probe drew
them) and sends one request a category, the one whose ids the probe recorded (first_run_only), so a reference costs
one server start and a category's request per set, not a second probe. The baked compile cache was made with
speculation on, so this start compiles: slower, not different.
"""

import json
import tempfile
from pathlib import Path

from lib.probe import probe
from lib.stage import write_json

IMAGE_SERVE_JSON = "/opt/ml/serve.json"  # where the image's entrypoint reads its settings (serving/launch.py)


def reference_serve(serve: dict) -> dict:
    """The variant's serve.json with speculation off, nothing else changed."""
    return dict(serve, speculative={"method": "none"})


def main(job) -> None:
    from lib.containers import run_container

    image = json.loads(Path(job.input.image).read_text())
    serve = reference_serve(json.loads(Path(job.input.serve).read_text()))
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
            gpus=run["gpus"],
            shm_size=run["shm_size"],
            name_prefix="lossless-reference",
        ) as container:
            container.wait_ready(run["ping_timeout_s"])
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
