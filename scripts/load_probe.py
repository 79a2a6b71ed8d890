"""The shipped image under concurrent load: load.requests requests, load.concurrency at a time, valid and invalid
ones over the contract's four endpoints (lib/load_probe/load.py: the mix and the verdict). Fails, naming each request
that failed, when a valid request is not answered correctly, an invalid one is not answered 4xx, anything is answered
5xx or not at all, or the server does not answer /ping and one more request afterwards; the record
(schemas/load.schema.yaml) keeps p50/p99 latency per endpoint and the error counts."""

import dataclasses
import json
from pathlib import Path

from lib.load_probe.load import Server, alone, kinds_summary, ping, plan, request_kinds, run_load, send, verdict
from lib.stage import StageError, validate_json, write_json


def load_probe(base_url: str, model: str, settings: dict, serve: dict, alive, log=print) -> dict:
    """The probe against a running server; the record (passed or not). alive(): whether the server still runs."""
    server = Server.of(serve)
    kinds = request_kinds(model, settings["max_tokens"], server)
    planned = plan(kinds, settings["requests"])
    timeout_s = settings["client_timeout_s"]
    references = alone(base_url, kinds, model, timeout_s)
    log(f"{len(references)} greedy kinds of request answered alone; now {len(planned)} at {settings['concurrency']}")
    answers, load = run_load(base_url, planned, settings["concurrency"], timeout_s)
    log(f"{len(answers)} requests answered in {load['wall_s']} s, at most {load['max_in_flight']} in flight")
    again = next(kind for kind in kinds if kind.valid and kind.greedy and not kind.stream)
    after = {"alive": alive(), "ping_status": ping(base_url), "kind": again, "answer": send(base_url, again, timeout_s)}
    return {
        "model": model,
        "settings": dict(settings),
        "server": dataclasses.asdict(server),
        "wall_s": load["wall_s"],
        "max_in_flight": load["max_in_flight"],
        "kinds": kinds_summary(kinds, planned),
        **verdict(planned, answers, references, after, model),
    }


def main(job) -> None:
    from lib.containers import recorded_image, run_container
    from lib.load_probe.load import failure_message

    image = json.loads(Path(job.input.image).read_text())
    serve = json.loads(Path(job.input.serve).read_text())
    run = job.params.run
    image_id = recorded_image(image)
    with run_container(image_id, gpus=run["gpus"], shm_size=run["shm_size"], name_prefix="load-probe") as container:
        cold_start_s = container.wait_ready(run["ping_timeout_s"])
        record = load_probe(container.base_url, job.params.model_name, job.params.load, serve, container.alive)
    record.update(
        variant=job.wildcards.variant,
        image=image["ref"],
        image_id=image_id,
        network=container.network,
        cold_start_s=cold_start_s,
    )
    latency = record["latency_ms"]
    for name, stats in latency.items():
        if stats["count"]:
            print(f"{name}: {stats['count']} requests, p50 {stats['p50_ms']} ms, p99 {stats['p99_ms']} ms")
    print(f"statuses: {record['statuses']}; counts: {record['counts']}")
    if not record["passed"]:
        print(json.dumps(record, indent=1, sort_keys=True))  # the whole record, for the log
        raise StageError(failure_message(record))
    validate_json(record, job.input.schema)
    write_json(job.output.load, record)


if __name__ == "__main__":
    from lib.stage import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
