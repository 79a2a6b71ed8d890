"""Quality gate: run lm-eval against the serving image's chat endpoint and fail below the thresholds.

Each task runs through lm-eval's `local-chat-completions` exactly as the competition did (chat template
applied by the server, few-shot as multi-turn, concurrency 8), one `simple_evaluate` per task because
every task has its own generation settings: max tokens, temperature 0 and `chat_template_kwargs:
{"enable_thinking": ...}`, which lm-eval copies verbatim from gen_kwargs into the request body.
"""

import copy
import json
import math
import os
import re
import sys
import threading
import time
from pathlib import Path

from lib.dag.schema import defaults_of as schema_defaults
from lib.gate import failed_tasks
from lib.gate_tasks import task_manager
from lib.hub import use_fetched_datasets
from lib.openai_client import get_json, sse_events
from lib.progress import Heartbeat, elapsed
from lib.stage import StageError, validate_json, write_json

SCHEMA = Path(__file__).resolve().parent.parent / "schemas" / "quality.schema.yaml"
# A task as the config schema completes it (tests and callers may pass only the required keys).
TASK_DEFAULTS = schema_defaults("task")
# Per request; GPQA with thinking streams up to 12,288 tokens.
REQUEST_TIMEOUT_S = 3600


def normalize_tasks(tasks: list[dict]) -> list[dict]:
    out = []
    for task in tasks:
        task = {**TASK_DEFAULTS, **task}
        missing = [k for k in ("name", "task", "metric", "threshold") if task.get(k) is None]
        if missing:
            raise StageError(f"quality task {task!r} lacks {', '.join(missing)}")
        out.append(task)
    names = [t["name"] for t in out]
    if len(set(names)) != len(names):
        raise StageError(f"quality task names must be unique, got {names}")
    return out


def lm_eval_limit(limit: float | int | None) -> float | int | None:
    # lm-eval reads a float < 1 as a fraction but 1.0 as "one doc"; our config means "all of it" by 1.
    if limit is None or limit == 1:
        return None
    return limit if limit < 1 else int(limit)


def gen_kwargs_for(task: dict) -> dict:
    """Per-task generation settings, merged by lm-eval over the task YAML's generation_kwargs."""
    return {
        "max_gen_toks": int(task["max_tokens"]),
        "temperature": 0.0,
        "do_sample": False,
        # passed through into the request body: the server's chat template reads it (thinking off by default)
        "chat_template_kwargs": {"enable_thinking": bool(task["thinking"])},
    }


def build_task_requests(
    tasks: list[dict],
    *,
    base_url: str,
    model_name: str,
    num_concurrent: int,
    limit: float | int | None,
    timeout_s: int = 3600,
) -> list[dict]:
    """One lm-eval invocation per task: its model args, simple_evaluate kwargs and result keys."""
    requests = []
    for task in normalize_tasks(tasks):
        requests.append(
            {
                "name": task["name"],
                "task": task["task"],
                "stream": bool(task["stream"]),
                "model_args": {
                    "model": model_name,
                    "base_url": base_url.rstrip("/") + "/v1/chat/completions",
                    "num_concurrent": int(num_concurrent),
                    "tokenized_requests": False,
                    "tokenizer_backend": None,  # no tokenizer download: the server applies the chat template
                    "max_retries": 3,
                    "timeout": int(timeout_s),  # per request; a 12k-token thinking answer takes minutes
                },
                "evaluate_kwargs": {
                    "num_fewshot": task["num_fewshot"],
                    "limit": lm_eval_limit(limit),
                    "gen_kwargs": gen_kwargs_for(task),
                    "apply_chat_template": True,
                    "fewshot_as_multiturn": True,
                },
                "metric_key": f"{task['metric']},{task['filter']}",
                "stderr_key": f"{task['metric']}_stderr,{task['filter']}",
            }
        )
    return requests


def sse_to_completion(lines) -> dict:
    """Join an OpenAI chat stream (SSE `data:` lines) into the shape of a non-streamed response."""
    parts: dict[int, list[str]] = {}
    for event in sse_events(lines):
        for choice in event.get("choices", []):
            # content only: a reasoning parser's `reasoning_content` is not the answer, as in non-streamed mode
            parts.setdefault(choice.get("index", 0), []).append((choice.get("delta") or {}).get("content") or "")
    return {"choices": [{"index": i, "message": {"content": "".join(p)}} for i, p in sorted(parts.items())]}


def _streaming_chat_class():
    """local-chat-completions with `stream: true` (lm-eval 0.4.11 cannot read a stream by itself)."""
    from lm_eval.models.openai_completions import LocalChatCompletion

    class StreamingChatCompletion(LocalChatCompletion):
        def _create_payload(self, *args, **kwargs) -> dict:
            return {**super()._create_payload(*args, **kwargs), "stream": True}

        def model_call(self, messages, *, generate=True, gen_kwargs=None, **kwargs):
            import requests

            payload = self._create_payload(
                self.create_message(messages),
                generate=generate,
                gen_kwargs=copy.deepcopy(gen_kwargs),
                seed=self._seed,
                **kwargs,
            )
            with requests.post(
                self.base_url, json=payload, headers=self.header, stream=True, timeout=self.timeout
            ) as response:
                response.raise_for_status()
                return sse_to_completion(response.iter_lines())

        async def amodel_call(
            self, session, sem, messages, *, generate=True, cache_keys=None, ctxlens=None, gen_kwargs=None, **kwargs
        ):
            payload = self._create_payload(
                self.create_message(messages),
                generate=generate,
                gen_kwargs=copy.deepcopy(gen_kwargs),
                seed=self._seed,
                **kwargs,
            )
            async with sem:
                async with session.post(self.base_url, json=payload, headers=self.header) as response:
                    if not response.ok:
                        print(
                            f"request failed ({response.status}): {(await response.text())[:500]}; retrying",
                            file=sys.stderr,
                        )
                    response.raise_for_status()
                    lines = [line async for line in response.content]
            answers = self.parse_generations(outputs=sse_to_completion(lines))
            for answer, cache in zip(answers, cache_keys or [], strict=False):
                self.cache_hook.add_partial("generate_until", cache, answer)
            return answers

    return StreamingChatCompletion


class GateProgress:
    """What the gate has done, for its progress lines: tasks finished and requests answered in the current one."""

    def __init__(self, names: list[str], clock=time.monotonic):
        self.names, self.clock = names, clock
        self.done, self.requests, self.current = 0, 0, None
        self.task_started = clock()
        self.lock = threading.Lock()

    def start(self, name: str) -> None:
        with self.lock:
            self.current, self.requests, self.task_started = name, 0, self.clock()

    def answered(self) -> None:
        with self.lock:
            self.requests += 1

    def finish(self) -> None:
        with self.lock:
            self.done += 1

    def line(self, seconds: float) -> str:
        with self.lock:
            return (
                f"[quality_gate] {self.done}/{len(self.names)} tasks done; task {self.current}: {self.requests} "
                f"requests answered in {elapsed(self.clock() - self.task_started)}; {elapsed(seconds)} in all"
            )


def counting(model_class, progress: GateProgress):
    """model_class whose every answered request (sync or async, streamed or not) is counted in `progress`."""

    class Counting(model_class):
        def model_call(self, *args, **kwargs):
            answer = super().model_call(*args, **kwargs)
            progress.answered()
            return answer

        async def amodel_call(self, *args, **kwargs):
            answer = await super().amodel_call(*args, **kwargs)
            progress.answered()
            return answer

    Counting.__name__ = Counting.__qualname__ = f"Counting{model_class.__name__}"
    return Counting


def _dataset_error(name: str, error: BaseException) -> str:
    found = re.search(r"Couldn't reach '([^']+)'", str(error))
    what = f"dataset {found.group(1)}" if found else "its dataset"
    return (
        f"task {name}: cannot load {what} ({type(error).__name__}: {str(error)[:300]}). The gate reads hub datasets "
        "only from the cache download_datasets fetched (datasets/gate), with the hub off: was this task's dataset "
        "fetched (its rule reruns when quality.tasks or quality.datasets change)?"
    )


def check_datasets(requests: list[dict], manager) -> None:
    """Load every task's data before a server is started, and name every dataset that is missing."""
    from lm_eval.tasks import get_task_dict

    problems = []
    for request in requests:
        if request["task"] not in manager.all_tasks:
            problems.append(f"task {request['name']}: lm-eval knows no task {request['task']!r}")
            continue
        try:
            get_task_dict([request["task"]], manager)
        except Exception as error:  # datasets raises ConnectionError, FileNotFoundError, hub errors...
            problems.append(_dataset_error(request["name"], error))
    if problems:
        raise StageError("\n".join(problems))


def check_server(base_url: str, tasks: list[dict], model_name: str) -> int | None:
    """Fail before any request when the server cannot honour the tasks; return its max_model_len.

    vLLM answers every request with 400 when max_tokens exceeds max_model_len, and with 404 for an
    unknown model name; lm-eval would retry each request and die deep in asyncio instead.
    """
    models = get_json(base_url.rstrip("/"), "/v1/models", timeout_s=30).get("data", [])
    ids = [m.get("id") for m in models]
    if model_name not in ids:
        raise StageError(f"the server serves {ids}, not the model name {model_name!r} the quality tasks send")
    max_len = next((m.get("max_model_len") for m in models if m.get("id") == model_name), None)
    if isinstance(max_len, int):
        too_long = [
            f"{t['name']} (max_tokens {t['max_tokens']})" for t in normalize_tasks(tasks) if t["max_tokens"] >= max_len
        ]
        if too_long:
            raise StageError(
                f"the server's max_model_len is {max_len}, too short for {', '.join(too_long)}: "
                "raise the variant's serve.max_model_len above max_tokens plus the prompt"
            )
    return max_len


def _stderr_from_samples(samples: list[dict], metric: str) -> float | None:
    """Binomial stderr over the flattened per-doc values (IFEval's instruction-level metric gets none)."""
    values = []
    for sample in samples:
        value = sample.get(metric)
        values.extend(value if isinstance(value, list) else [value])
    values = [float(v) for v in values if isinstance(v, (bool, int, float))]
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def run_lm_eval(
    base_url: str,
    tasks: list[dict],
    *,
    model_name: str,
    num_concurrent: int = 8,
    limit: float | int | None = None,
    tasks_dir: str | None = None,
    timeout_s: int = 3600,
    samples_dir: str | Path | None = None,
    manager=None,
) -> dict[str, dict]:
    """Run every task against an OpenAI-compatible server; return {name: {score, stderr, n, seconds, ...}}.
    While it runs, a line every PROGRESS_INTERVAL_S (lib/progress.py) says how many tasks are done and how many
    requests the current one has had answered."""
    manager = manager or task_manager(tasks_dir)
    scores = {}
    requests = build_task_requests(
        tasks, base_url=base_url, model_name=model_name, num_concurrent=num_concurrent, limit=limit, timeout_s=timeout_s
    )
    progress = GateProgress([r["name"] for r in requests])
    with Heartbeat(progress.line):
        for request in requests:
            progress.start(request["name"])
            scores[request["name"]] = _run_task(request, manager, progress, samples_dir)
            progress.finish()
    return scores


def _run_task(request: dict, manager, progress: GateProgress, samples_dir: str | Path | None) -> dict:
    """One task through lm_eval.simple_evaluate; its score record."""
    import lm_eval
    from lm_eval.models.openai_completions import LocalChatCompletion

    print(
        f"[quality_gate] {request['name']}: lm_eval.simple_evaluate(model=local-chat-completions"
        f"{' (streaming)' if request['stream'] else ''}, model_args={request['model_args']}, "
        f"tasks=[{request['task']!r}], {request['evaluate_kwargs']})",
        flush=True,
    )
    model_class = counting(_streaming_chat_class() if request["stream"] else LocalChatCompletion, progress)
    start = time.monotonic()
    output = lm_eval.simple_evaluate(
        model=model_class(**request["model_args"]),
        tasks=[request["task"]],
        task_manager=manager,
        log_samples=True,
        **request["evaluate_kwargs"],
    )
    seconds = time.monotonic() - start
    result = (output or {}).get("results", {}).get(request["task"], {})
    samples = (output or {}).get("samples", {})
    metric = request["metric_key"].split(",")[0]
    stderr = _number(result.get(request["stderr_key"]))
    stderr_source = "lm-eval"
    if stderr is None and request["task"] in samples:
        stderr, stderr_source = _stderr_from_samples(samples[request["task"]], metric), "samples"
    n = output.get("n-samples", {}) if output else {}
    score = {
        "score": _number(result.get(request["metric_key"])),
        "stderr": stderr,
        "stderr_source": stderr_source if stderr is not None else None,
        "n_docs": sum(v.get("effective", 0) for k, v in n.items()) if n else None,
        "seconds": round(seconds, 1),
        "requests": progress.requests,
        "available_metrics": sorted(k for k in result if "_stderr" not in k and k != "alias"),
    }
    print(
        f"[quality_gate] {request['name']}: {request['metric_key']} = {score['score']} (stderr {stderr}), "
        f"{progress.requests} requests in {seconds:.0f} s",
        flush=True,
    )
    if samples_dir:
        _write_samples(Path(samples_dir) / f"{request['name']}.jsonl", samples)
    return score


def _write_samples(path: Path, samples: dict[str, list[dict]]) -> None:
    # what the model answered and how it was scored: the first thing to read when a gate fails
    path.parent.mkdir(parents=True, exist_ok=True)
    keep = ("doc_id", "target", "resps", "filtered_resps", "filter")
    with open(path, "w") as handle:
        for task, rows in samples.items():
            for row in rows:
                extra = {
                    k: v
                    for k, v in row.items()
                    if k not in keep and k not in ("doc", "arguments", "doc_hash", "prompt_hash", "target_hash")
                }
                handle.write(json.dumps({"task": task, **{k: row.get(k) for k in keep}, **extra}, default=str) + "\n")


def evaluate_gate(
    scores: dict[str, dict], tasks: list[dict], reference: dict[str, float] | None = None, margin_stderr: float = 0.0
) -> tuple[bool, list[dict]]:
    """Compare each task's score with its threshold; a missing score fails. A task passes when
    gated_score = score - margin_stderr x stderr >= threshold (a task without a stderr: the score alone).
    `reference` ({task name: score} of the reference variant, e.g. BF16) adds recovery = score / reference score;
    it never changes the verdict."""
    if not isinstance(margin_stderr, (int, float)) or isinstance(margin_stderr, bool) or margin_stderr < 0:
        raise StageError(f"quality.margin_stderr must be a number >= 0, not {margin_stderr!r}")
    rows = []
    for task in normalize_tasks(tasks):
        got = scores.get(task["name"], {})
        score, stderr = got.get("score"), got.get("stderr")
        margin = None if score is None else score - task["threshold"]
        gated = None if score is None else score - margin_stderr * (stderr or 0.0)
        passed = gated is not None and gated >= task["threshold"]
        close = margin is not None and stderr is not None and abs(margin) < 2 * stderr
        ref = (reference or {}).get(task["name"])
        recovery = score / ref if score is not None and isinstance(ref, (int, float)) and ref > 0 else None
        rows.append(
            {
                "name": task["name"],
                "task": task["task"],
                "metric": task["metric"],
                "filter": task["filter"],
                "score": score,
                "stderr": stderr,
                "threshold": task["threshold"],
                "margin": margin,
                "margin_stderr": float(margin_stderr),
                "gated_score": gated,
                "passed": passed,
                "within_2_stderr": close,
                "reference_score": ref,
                "recovery": recovery,
            }
        )
    return all(row["passed"] for row in rows), rows


def limit_note(limit: float | int | None) -> str | None:
    """How a limited gate names itself (table and stderr); None for the full task sets."""
    if lm_eval_limit(limit) is None:
        return None
    part = f"{limit:g} of each task's docs" if limit < 1 else f"the first {int(limit)} docs of each task"
    return (
        f"LIMITED RUN: quality.limit {limit:g} ({part}), a quick check, not the full gate; "
        "set quality.limit: null to gate on every doc"
    )


def format_table(rows: list[dict], reference_name: str | None = None, limit: float | int | None = None) -> str:
    """The gate's table; under it the rule a task passed by (with the margin used) and, for a limited run, a note.
    With quality.margin_stderr > 0 a column shows score - margin x stderr, the number compared with the threshold."""

    def num(value):
        return "-" if value is None else f"{value:.4f}"

    margin_stderr = max((row.get("margin_stderr") or 0.0 for row in rows), default=0.0)
    recovery_header = f"recovery vs {reference_name}" if reference_name else "recovery"
    header = ["task", "metric", "score", "stderr", "threshold", "margin", recovery_header, "result"]
    if margin_stderr:
        header.insert(6, f"score-{margin_stderr:g}xse")
    body = []
    for row in rows:
        margin = "-" if row["margin"] is None else f"{row['margin']:+.4f}"
        recovery = "-" if row.get("recovery") is None else f"{100 * row['recovery']:.1f}%"
        result = "PASS" if row["passed"] else "FAIL"
        if row["within_2_stderr"]:
            result += " (WARN: |margin| < 2 stderr)"
        if row["score"] is None:
            result += " (no score)"
        cells = [
            row["name"],
            f"{row['metric']},{row['filter']}",
            num(row["score"]),
            num(row["stderr"]),
            num(float(row["threshold"])),
            margin,
            recovery,
            result,
        ]
        if margin_stderr:
            cells.insert(6, num(row.get("gated_score")))
        body.append(cells)
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"pass: score - {margin_stderr:g} x stderr >= threshold (quality.margin_stderr {margin_stderr:g})")
    note = limit_note(limit)
    if note:
        lines.append(note)
    return "\n".join(lines)


def warnings_for(rows: list[dict]) -> list[str]:
    """One line per task whose verdict is within two standard errors of flipping."""
    return [
        f"WARNING: {r['name']} margin {r['margin']:+.4f} is under two standard errors (2 x {r['stderr']:.4f}): "
        "another sample of the same size could flip its verdict"
        for r in rows
        if r["within_2_stderr"]
    ]


def limit_warnings(rows: list[dict], limit: float | int | None) -> list[str]:
    """A limited run: one line per task whose standard error is larger than its distance to the threshold, i.e.
    whose verdict the limited sample cannot settle."""
    if lm_eval_limit(limit) is None:
        return []
    return [
        f"WARNING: quality.limit {limit:g}: task {r['name']}'s standard error {r['stderr']:.4f} is larger than "
        f"its margin {r['margin']:+.4f} to the threshold {float(r['threshold']):.4f}: this limited sample cannot "
        "tell pass from fail; rerun with quality.limit: null (every doc) before trusting the verdict"
        for r in rows
        if r["margin"] is not None and r["stderr"] is not None and r["stderr"] > abs(r["margin"])
    ]


def load_reference(path: str | Path | None, variant: str | None) -> dict | None:
    """{task name: score} from the reference variant's quality.json, or None when it is not in the run."""
    if not path or not Path(path).is_file():
        return None
    report = json.loads(Path(path).read_text())
    validate_json(report, SCHEMA)
    return {
        "variant": variant,
        "path": str(path),
        "image": report["image"],
        "scores": {t["name"]: t["score"] for t in report["tasks"]},
    }


def scores_copy_path(log_path: str) -> Path:
    """logs/quality_gate/<variant>.log -> logs/quality_gate/<variant>.scores.json (kept when the job fails)."""
    return Path(log_path).with_suffix(".scores.json")


def scored_in_container(built: dict, tasks: list[dict], p, manager, samples_dir: Path | None) -> dict:
    """Every task's lm-eval scores against the image served in a container: the scores, the image (its tag and the
    ID that ran), its network and the seconds until it answered /ping."""
    from lib.containers import recorded_image, run_container, wait_for_ping  # container plumbing, host-side

    image, image_id = built["ref"], recorded_image(built)
    with run_container(image_id, gpus=bool(p.gpus), shm_size=p.shm_size, name_prefix="quality-gate") as container:
        ping_s = wait_for_ping(
            container.base_url,
            p.ping_timeout_s,
            alive=container.alive,
            logs=container.logs,
            what=f"the quality gate's container of {image}",
        )
        print(f"[quality_gate] {image} answered /ping after {ping_s:.0f} s", flush=True)
        check_server(container.base_url, tasks, p.model_name)
        try:
            scores = run_lm_eval(
                container.base_url,
                tasks,
                model_name=p.model_name,
                num_concurrent=p.num_concurrent,
                limit=p.limit,
                tasks_dir=p.tasks_dir,
                timeout_s=REQUEST_TIMEOUT_S,
                samples_dir=samples_dir,
                manager=manager,
            )
        except StageError:
            raise
        except Exception as error:
            raise StageError(
                f"lm-eval failed against {image}: {type(error).__name__}: {error}\n"
                f"last container log lines:\n{container.logs()}"
            ) from error
    return {"scores": scores, "image": image, "image_id": image_id, "network": container.network, "ping_s": ping_s}


def gate_report(served: dict, tasks: list[dict], p, passed: bool, rows: list[dict], reference, start: float) -> dict:
    """The stage's record (schemas/quality.schema.yaml): the verdict, each task's row and how it was measured."""
    import lm_eval

    scores = served["scores"]
    return {
        "image": served["image"],
        "image_id": served["image_id"],
        "network": served["network"],
        "model_name": p.model_name,
        "lm_eval_version": getattr(lm_eval, "__version__", "unknown"),
        "limit": p.limit,
        "limited": lm_eval_limit(p.limit) is not None,
        "margin_stderr": float(p.margin_stderr),
        "num_concurrent": p.num_concurrent,
        "passed": passed,
        "seconds": round(time.monotonic() - start, 1),
        "server_ready_s": round(served["ping_s"], 1),
        "reference": {k: reference[k] for k in ("variant", "path", "image")} if reference else None,
        "tasks": [
            {
                **row,
                **{k: scores.get(row["name"], {}).get(k) for k in ("n_docs", "seconds", "stderr_source")},
                **{k: t[k] for k in ("num_fewshot", "thinking", "max_tokens", "stream")},
            }
            for row, t in zip(rows, tasks, strict=True)
        ],
    }


def main(job) -> None:
    p = job.params
    tasks = normalize_tasks(p.tasks)
    built = json.loads(Path(job.input.image).read_text())
    log_dir = scores_copy_path(job.log[0]).parent if job.log else None
    samples_dir = Path(job.log[0]).with_suffix(".samples") if job.log else None
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    note = limit_note(p.limit)
    if note:
        print(f"[quality_gate] {note}", file=sys.stderr, flush=True)

    use_fetched_datasets(job.input.datasets_cache, job.input.datasets_manifest)  # the hub is off (run_stage)
    manager = task_manager(p.tasks_dir)
    requests = build_task_requests(
        tasks, base_url="http://unused", model_name=p.model_name, num_concurrent=p.num_concurrent, limit=p.limit
    )
    start = time.monotonic()
    check_datasets(requests, manager)  # before a slow server start: an offline host fails in seconds
    served = scored_in_container(built, tasks, p, manager, samples_dir)

    reference = load_reference(p.reference_scores or None, p.reference_variant)
    passed, rows = evaluate_gate(served["scores"], tasks, reference["scores"] if reference else None, p.margin_stderr)
    print(format_table(rows, reference["variant"] if reference else None, p.limit), flush=True)
    for line in ([note] if note else []) + warnings_for(rows) + limit_warnings(rows, p.limit):
        print(line, file=sys.stderr, flush=True)
    report = gate_report(served, tasks, p, passed, rows, reference, start)
    validate_json(report, SCHEMA)
    if log_dir:  # the user's copy, kept whether or not the gate passes
        write_json(scores_copy_path(job.log[0]), report)
    if not passed:  # recorded, not fatal: a sweep goes on without it, select skips it and tarball refuses it
        print(f"[quality_gate] the gate failed: {'; '.join(failed_tasks(rows))}; recorded as passed: false", flush=True)
    write_json(job.output.scores, report)


if __name__ == "__main__":
    from lib.stage import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
