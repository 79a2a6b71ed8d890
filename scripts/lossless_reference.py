"""The lossless check's reference: the variant's own image, speculation off (lib/reference_server.py), greedy ids of
the probe's prompts, and its continuations past the variant's near ties.

Why this reference (rules/lossless.smk): it is the cheapest one that differs from the probed server in speculation
alone, and it records its top logprobs (a near tie is told from a flip). lib.probe makes the same prompts the same way
(the fresh set's prompts drawn as the probe drew them) and sends one request a category, the one whose ids the probe
recorded (first_run_only), then the probe's concurrent batch (lib.probe.concurrent_batch), so a reference costs one
server start and a category's request per set, not a second probe. It records each request's prompt ids as the
server tokenized them, its output ids and its top logprobs.

Past a near tie the check compares the speculative output with the reference's greedy continuation from that output's
own prefix (lib/lossless.py): on the same server, after the reference run, this stage asks for those of the variant
whose probe it read (`continuations`). A variant that reads this reference without being its variant (compared
variants with one recipe and serve settings share one) gets its own from scripts/lossless_continuations.py.
"""

import json
from pathlib import Path

from lib.lossless import request_continuations
from lib.probe import REFERENCE_TOP_LOGPROBS, concurrent_batch, probe
from lib.reference_server import reference_serve, reference_server
from lib.stage import write_json


def reference_run(base_url: str, model: str, settings: dict, varied_text: str, log=print) -> dict:
    """The reference record from a server with speculation off: the probe's first runs and its concurrent batch,
    with their top logprobs and prompt ids."""
    result = probe(base_url, model, dict(settings, first_run_only=True), varied_text, log)
    result["batch"] = concurrent_batch(base_url, model, settings, varied_text, REFERENCE_TOP_LOGPROBS)
    return result


def main(job) -> None:
    image = json.loads(Path(job.input.image).read_text())
    variant_serve = json.loads(Path(job.input.serve).read_text())
    record = json.loads(Path(job.input.latency).read_text())  # the variant's probe: continued past its near ties
    model, settings, variant = job.params.model_name, job.params.probe, job.wildcards.variant
    with reference_server(image, variant_serve, job.params.run) as server:
        result = reference_run(server.base_url, model, settings, job.input.varied_text)
        made = request_continuations(
            server.base_url, model, record, result, settings["ignore_eos"], lambda line: print(f"[{variant}] {line}")
        )
    result.update(
        image=image["ref"],
        image_id=server.image,
        network=server.network,
        speculative=reference_serve(variant_serve)["speculative"],
        note="reference for the lossless check: the variant's image with speculation off, one request per category "
        "(the probe's first timed run's prompt) and the probe's concurrent batch; `continuations`: its greedy "
        "continuations from the variant's own output past that output's near ties; latencies are not comparable",
        continuations={variant: made},
    )
    write_json(job.output.reference, result)


if __name__ == "__main__":
    from lib.stage import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
