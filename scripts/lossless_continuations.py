"""The reference's greedy continuations past a variant's near ties, for a variant whose lossless check reads another
variant's reference (compared variants with one recipe and serve settings share one: Pipeline.reference_source).

The shared reference (scripts/lossless_reference.py) continued its own variant's output only. This stage walks this
variant's ids against it as the check does (lib/lossless.py) without a server; only when that walk meets a near tie
with output after it does it start the reference's image with speculation off (lib/reference_server.py) and ask for
the continuations from this variant's own prefix. Most runs of a lossless variant meet none: no server start.
"""

import json
from pathlib import Path

from lib.lossless import needs_continuations, request_continuations
from lib.reference_server import reference_server
from lib.stage import write_json


def main(job) -> None:
    record = json.loads(Path(job.input.latency).read_text())
    reference = json.loads(Path(job.input.reference).read_text())
    variant = job.wildcards.variant
    made, started = {}, needs_continuations(record, reference)
    ran = {"image_id": None, "network": None}  # what served the continuations, when a server started
    if started:
        image = json.loads(Path(job.input.image).read_text())
        serve = json.loads(Path(job.input.serve).read_text())
        with reference_server(image, serve, job.params.run) as server:
            ran = {"image_id": server.image, "network": server.network}
            made = request_continuations(
                server.base_url,
                job.params.model_name,
                record,
                reference,
                job.params.ignore_eos,
                lambda line: print(f"[{variant}] {line}", flush=True),
            )
    else:
        print(f"[{variant}] no near tie with output after it: nothing to continue, no server started", flush=True)
    write_json(
        job.output.continuations,
        {"reference": job.input.reference, "server_started": started, **ran, "continuations": {variant: made}},
    )


if __name__ == "__main__":
    from lib.stage import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
