"""quality_gate: gate logic (plain python3) and lm-eval wiring against a fake chat server (e2e, eval venv)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from fractions import Fraction
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import ROOT
from lib.stage import StageError, validate_json
from lib.tiny import tasks as tiny_tasks
from quality_gate import (
    build_task_requests,
    check_server,
    evaluate_gate,
    format_table,
    limit_note,
    limit_warnings,
    lm_eval_limit,
    normalize_tasks,
    scores_copy_path,
    sse_to_completion,
    warnings_for,
)

TASKS_DIR = ROOT / "data" / "tiny" / "tasks"
EVAL_PYTHON = ROOT / ".venvs" / "eval" / "bin" / "python"
ANSWER = "The answer is (A)."

TINY_TASKS = [
    {
        "name": "tiny_mc",
        "task": "tiny_mc",
        "num_fewshot": 0,
        "thinking": False,
        "max_tokens": 32,
        "metric": "exact_match",
        "filter": "custom-extract",
        "threshold": 0.0,
    },
    {
        "name": "tiny_ifeval",
        "task": "tiny_ifeval",
        "num_fewshot": 0,
        "thinking": False,
        "max_tokens": 64,
        "metric": "inst_level_strict_acc",
        "filter": "none",
        "threshold": 0.0,
    },
    {
        "name": "tiny_mc_think",
        "task": "tiny_mc_think",
        "num_fewshot": 0,
        "thinking": True,
        "stream": True,
        "max_tokens": 64,
        "metric": "exact_match",
        "filter": "flexible-extract",
        "threshold": 0.0,
    },
]


def _task(name="mmlu_pro", threshold=0.621, **kw):
    return {
        "name": name,
        "task": name,
        "metric": "exact_match",
        "filter": "custom-extract",
        "threshold": threshold,
        **kw,
    }


# ---- gate logic -------------------------------------------------------------------------------------


def test_below_threshold_fails_and_table_says_so():
    tasks = [_task("mmlu_pro", 0.621), _task("ifeval", 0.814)]
    passed, rows = evaluate_gate(
        {"mmlu_pro": {"score": 0.70, "stderr": 0.01}, "ifeval": {"score": 0.80, "stderr": 0.001}}, tasks
    )
    assert passed is False
    assert [r["passed"] for r in rows] == [True, False]
    assert rows[1]["margin"] == pytest.approx(-0.014)
    table = format_table(rows)
    lines = table.splitlines()
    assert lines[0].split()[:8] == ["task", "metric", "score", "stderr", "threshold", "margin", "recovery", "result"]
    mmlu = next(line for line in lines if line.startswith("mmlu_pro"))
    ifeval = next(line for line in lines if line.startswith("ifeval"))
    assert "0.7000" in mmlu and "0.6210" in mmlu and "+0.0790" in mmlu and mmlu.rstrip().endswith("PASS")
    assert "0.8000" in ifeval and "-0.0140" in ifeval and "FAIL" in ifeval and "WARN" not in ifeval


def test_recovery_against_the_reference_variant_is_reported_not_gated():
    tasks = [_task("a", 0.5), _task("b", 0.5), _task("c", 0.5)]
    reference = {"a": 0.8, "b": 0.0}  # b: a zero reference gives no ratio; c: not in the reference
    passed, rows = evaluate_gate(
        {"a": {"score": 0.6, "stderr": 0.01}, "b": {"score": 0.6, "stderr": 0.01}, "c": {"score": 0.4, "stderr": 0.01}},
        tasks,
        reference,
    )
    assert not passed and [r["passed"] for r in rows] == [True, True, False]
    assert rows[0]["recovery"] == pytest.approx(0.75) and rows[0]["reference_score"] == 0.8
    assert rows[1]["recovery"] is None and rows[2]["recovery"] is None
    lines = format_table(rows, "tiny-bf16-mtp1").splitlines()
    assert "recovery vs tiny-bf16-mtp1" in lines[0] and "75.0%" in lines[2]
    assert evaluate_gate({"a": {"score": 0.6, "stderr": 0.01}}, tasks[:1])[1][0]["recovery"] is None


def test_margin_under_two_stderr_prints_a_warning_line():
    _, rows = evaluate_gate(
        {"a": {"score": 0.66, "stderr": 0.02}, "b": {"score": 0.9, "stderr": 0.02}},
        [_task("a", 0.63), _task("b", 0.63)],
    )
    warnings = warnings_for(rows)
    assert len(warnings) == 1 and warnings[0].startswith("WARNING: a margin +0.0300") and "two standard" in warnings[0]


def test_all_at_or_above_threshold_passes():
    passed, rows = evaluate_gate({"a": {"score": 0.621, "stderr": None}}, [_task("a", 0.621)])
    assert passed and rows[0]["passed"] and rows[0]["margin"] == 0
    assert "-" in format_table(rows).splitlines()[2].split()  # no stderr printed as "-"


def test_margin_within_two_stderr_warns_both_ways():
    tasks = [_task("close_pass", 0.63), _task("close_fail", 0.63), _task("clear", 0.63)]
    _, rows = evaluate_gate(
        {
            "close_pass": {"score": 0.66, "stderr": 0.02},  # +0.03 < 0.04
            "close_fail": {"score": 0.61, "stderr": 0.02},  # -0.02
            "clear": {"score": 0.70, "stderr": 0.02},
        },
        tasks,
    )  # +0.07 > 0.04
    assert [r["within_2_stderr"] for r in rows] == [True, True, False]
    assert [r["passed"] for r in rows] == [True, False, True]
    lines = format_table(rows).splitlines()
    assert "PASS (WARN" in lines[2] and "FAIL (WARN" in lines[3] and "WARN" not in lines[4]


def test_margin_in_stderr_decides_and_the_table_shows_it():
    tasks = [_task("close", 0.63), _task("clear", 0.63), _task("no_stderr", 0.63)]
    scores = {
        "close": {"score": 0.66, "stderr": 0.02},
        "clear": {"score": 0.70, "stderr": 0.02},
        "no_stderr": {"score": 0.64, "stderr": None},
    }
    passed, rows = evaluate_gate(scores, tasks)  # default 0: the score alone
    assert passed and [r["gated_score"] for r in rows] == [0.66, 0.70, 0.64]
    assert format_table(rows).splitlines()[-1] == "pass: score - 0 x stderr >= threshold (quality.margin_stderr 0)"
    passed, rows = evaluate_gate(scores, tasks, margin_stderr=2)  # 0.66 - 0.04 = 0.62 < 0.63
    assert not passed and [r["passed"] for r in rows] == [False, True, True]
    assert rows[0]["gated_score"] == pytest.approx(0.62) and rows[0]["margin_stderr"] == 2.0
    lines = format_table(rows).splitlines()
    assert lines[0].split()[6] == "score-2xse" and "0.6200" in lines[2] and "FAIL" in lines[2]
    assert lines[-1] == "pass: score - 2 x stderr >= threshold (quality.margin_stderr 2)"
    assert evaluate_gate(scores, tasks, margin_stderr=1)[1][0]["passed"]  # 0.64 >= 0.63
    with pytest.raises(StageError, match="quality.margin_stderr must be a number >= 0"):
        evaluate_gate(scores, tasks, margin_stderr=-1)


def test_a_limited_run_says_so_and_warns_where_the_sample_cannot_decide():
    tasks = [_task("mmlu_pro", 0.621), _task("gpqa", 0.63)]
    _, rows = evaluate_gate(
        {
            "mmlu_pro": {"score": 0.70, "stderr": 0.01},  # +0.079 > 0.01: decided
            "gpqa": {"score": 0.65, "stderr": 0.034},
        },
        tasks,
    )  # +0.02 < 0.034: not
    table = format_table(rows, limit=0.1).splitlines()
    assert table[-1].startswith(
        "LIMITED RUN: quality.limit 0.1 (0.1 of each task's docs), a quick check, not the full gate"
    )
    assert "LIMITED" not in format_table(rows, limit=None) and "LIMITED" not in format_table(rows, limit=1)
    assert "the first 50 docs of each task" in limit_note(50) and limit_note(None) is None
    warnings = limit_warnings(rows, 0.1)
    assert len(warnings) == 1 and warnings[0].startswith(
        "WARNING: quality.limit 0.1: task gpqa's standard error 0.0340 is larger than its margin +0.0200"
    )
    assert "quality.limit: null" in warnings[0]
    assert limit_warnings(rows, None) == []  # the full set: the sample is what it is


def test_the_real_profile_gates_on_every_doc_by_default():
    import yaml

    schema = yaml.safe_load((ROOT / "schemas" / "config.schema.yaml").read_text())
    quality = schema["properties"]["quality"]["properties"]
    assert quality["limit"]["default"] is None and quality["margin_stderr"]["default"] == 0
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    assert config["quality"]["limit"] is None


# The contract's generation settings (the competition's contract, "Quality benchmarks"): MMLU-Pro 5-shot thinking
# off; IFEval 0-shot thinking off, max 512 tokens; GPQA-Diamond 0-shot CoT, thinking on, streaming, max 12,288.
CONTRACT = {
    "mmlu_pro": {"num_fewshot": 5, "thinking": False, "stream": False},
    "ifeval": {"num_fewshot": 0, "thinking": False, "stream": False, "max_tokens": 512},
    "gpqa_diamond": {"num_fewshot": 0, "thinking": True, "stream": True, "max_tokens": 12288},
}


def real_profile_tasks() -> list[dict]:
    """config.yaml's quality tasks as the pipeline resolves them (schema defaults filled in)."""
    import yaml

    from lib.dag.config import with_defaults

    return normalize_tasks(with_defaults(yaml.safe_load((ROOT / "config.yaml").read_text()))["quality"]["tasks"])


def test_the_real_profiles_tasks_ask_for_the_contracts_settings():
    tasks = {t["name"]: t for t in real_profile_tasks()}
    assert set(tasks) == set(CONTRACT)
    for name, wanted in CONTRACT.items():
        assert {k: tasks[name][k] for k in wanted} == wanted, name


def test_missing_score_fails():
    passed, rows = evaluate_gate({}, [_task("gpqa", 0.63)])
    assert not passed and rows[0]["score"] is None and "no score" in format_table(rows)


def test_requests_carry_thinking_tokens_and_stream_per_task():
    reqs = build_task_requests(TINY_TASKS, base_url="http://127.0.0.1:9/", model_name="m", num_concurrent=8, limit=0.1)
    by_name = {r["name"]: r for r in reqs}
    assert by_name["tiny_mc"]["evaluate_kwargs"]["gen_kwargs"] == {
        "max_gen_toks": 32,
        "temperature": 0.0,
        "do_sample": False,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    assert by_name["tiny_mc_think"]["evaluate_kwargs"]["gen_kwargs"]["chat_template_kwargs"] == {
        "enable_thinking": True
    }
    assert [r["stream"] for r in reqs] == [False, False, True]
    args = by_name["tiny_ifeval"]["model_args"]
    assert args["base_url"] == "http://127.0.0.1:9/v1/chat/completions"
    assert args["tokenized_requests"] is False and args["tokenizer_backend"] is None
    assert args["num_concurrent"] == 8 and args["model"] == "m"
    assert by_name["tiny_ifeval"]["metric_key"] == "inst_level_strict_acc,none"
    assert by_name["tiny_mc"]["stderr_key"] == "exact_match_stderr,custom-extract"
    assert by_name["tiny_mc"]["evaluate_kwargs"]["limit"] == 0.1


def test_limit_and_task_validation():
    assert lm_eval_limit(None) is None and lm_eval_limit(1) is None and lm_eval_limit(1.0) is None
    assert lm_eval_limit(0.1) == 0.1 and lm_eval_limit(50) == 50
    with pytest.raises(StageError, match="threshold"):
        normalize_tasks([{"name": "x", "task": "x", "metric": "m"}])
    with pytest.raises(StageError, match="unique"):
        normalize_tasks([_task("x"), _task("x")])


def test_sse_stream_is_joined_like_a_plain_response():
    lines = [
        b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}',
        b"",
        b'data: {"choices":[{"index":0,"delta":{"reasoning_content":"hmm"}}]}',
        b'data: {"choices":[{"index":0,"delta":{"content":"The answer"}}]}',
        b'data: {"choices":[{"index":0,"delta":{"content":" is (B)."},"finish_reason":"stop"}]}',
        b"data: [DONE]",
    ]
    assert sse_to_completion(lines) == {"choices": [{"index": 0, "message": {"content": "The answer is (B)."}}]}


def test_scores_copy_sits_beside_the_log():
    assert scores_copy_path("logs/quality_gate/tiny-awq-mtp1.log") == Path(
        "logs/quality_gate/tiny-awq-mtp1.scores.json"
    )


def test_report_schema_accepts_a_report_and_rejects_a_bad_one():
    _, rows = evaluate_gate({"a": {"score": 0.5, "stderr": 0.1}}, [_task("a", 0.4)])
    _, rows = evaluate_gate({"a": {"score": 0.5, "stderr": 0.1}}, [_task("a", 0.4)], {"a": 0.6})
    report = {
        "image": "docker.io/library/x:y",
        "image_id": "sha256:" + "a" * 64,
        "network": "pipeline-offline",
        "model_name": "m",
        "lm_eval_version": "0.4.11",
        "limit": 0.1,
        "limited": True,
        "margin_stderr": 0.0,
        "num_concurrent": 8,
        "passed": True,
        "seconds": 1.0,
        "server_ready_s": 2.0,
        "reference": {"variant": "bf16", "path": "results/bf16/quality_gate/quality.json", "image": "x:bf16"},
        "tasks": [
            {
                **rows[0],
                "n_docs": 3,
                "seconds": 0.5,
                "stderr_source": "lm-eval",
                "num_fewshot": 5,
                "thinking": False,
                "max_tokens": 10,
                "stream": False,
            }
        ],
    }
    schema = ROOT / "schemas" / "quality.schema.yaml"
    validate_json(report, schema)
    with pytest.raises(StageError, match="score"):
        validate_json({**report, "tasks": [{**report["tasks"][0], "score": 1.5}]}, schema)
    for key in ("limited", "margin_stderr"):  # a record that does not say whether it was limited is refused
        with pytest.raises(StageError, match=key):
            validate_json({k: v for k, v in report.items() if k != key}, schema)


def test_tiny_task_data_is_what_the_generator_writes(tmp_path):
    # the committed data must be reproducible from the generator (scripts/lib/tiny/tasks.py)
    assert len(tiny_tasks.mc_docs(1, 32)) == 32
    before = {p.name: p.read_bytes() for p in TASKS_DIR.glob("*.jsonl")}
    subprocess.run([sys.executable, "-B", tiny_tasks.__file__], check=True)
    after = {p.name: p.read_bytes() for p in TASKS_DIR.glob("*.jsonl")}
    assert before == after and len(before) == 4


# ---- e2e: real lm-eval against a fake OpenAI-compatible chat server -----------------------------------


class _FakeChat(BaseHTTPRequestHandler):
    bodies: list = []
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": "fake-model", "max_model_len": 100}]})
        else:
            self._send(200, {"status": "ok"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            self.bodies.append({"path": self.path, **body})
        if body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for piece in (ANSWER[:7], ANSWER[7:]):
                chunk = {"choices": [{"index": 0, "delta": {"content": piece}}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            return
        self._send(
            200,
            {
                "id": "x",
                "object": "chat.completion",
                "model": body.get("model"),
                "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": ANSWER}}],
            },
        )

    def _send(self, status, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def fake_server():
    _FakeChat.bodies = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeChat)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _FakeChat.bodies
    server.shutdown()
    server.server_close()


def test_check_server_names_model_and_context_problems(fake_server):
    base_url, _ = fake_server
    assert check_server(base_url, TINY_TASKS, "fake-model") == 100
    with pytest.raises(StageError, match="not the model name 'Qwen/Qwen3.5-4B'"):
        check_server(base_url, TINY_TASKS, "Qwen/Qwen3.5-4B")
    with pytest.raises(StageError, match=r"max_model_len is 100, too short for tiny_mc \(max_tokens 100\)"):
        check_server(base_url, [dict(TINY_TASKS[0], max_tokens=100), TINY_TASKS[1]], "fake-model")


def _gold(name):
    return [json.loads(line)["answer"] for line in (TASKS_DIR / name).read_text().splitlines()]


def _ifeval_expected():
    """IFEval's instruction-level strict accuracy of ANSWER on every tiny_ifeval doc, computed directly."""
    code = (
        "import json, sys\nfrom lm_eval.tasks.ifeval.utils import process_results\n"
        f"docs = [json.loads(l) for l in open({str(TASKS_DIR / 'tiny_ifeval.test.jsonl')!r})]\n"
        f"flat = [x for d in docs for x in process_results(d, [{ANSWER!r}])['inst_level_strict_acc']]\n"
        "print(json.dumps([sum(flat), len(flat)]))"
    )
    out = subprocess.run([str(EVAL_PYTHON), "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.e2e
@pytest.mark.usefixtures("tiny_venvs")
def test_lm_eval_scores_fixed_answer_exactly(fake_server, tmp_path):
    base_url, bodies = fake_server
    driver = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'scripts')!r})\n"
        "from quality_gate import run_lm_eval\n"
        f"scores = run_lm_eval({base_url!r}, json.loads(sys.argv[1]), model_name='fake-model', num_concurrent=4,\n"
        f"                     limit=None, tasks_dir={str(TASKS_DIR)!r}, samples_dir={str(tmp_path)!r})\n"
        "print('SCORES ' + json.dumps(scores))\n"
    )
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    run = subprocess.run(
        [str(EVAL_PYTHON), "-c", driver, json.dumps(TINY_TASKS)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    scores = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("SCORES "))[7:])

    mc_gold = _gold("tiny_mc.test.jsonl")
    think_gold = _gold("tiny_mc_think.test.jsonl")
    assert 0 < mc_gold.count("A") < len(mc_gold)  # otherwise the check below proves little
    assert scores["tiny_mc"]["score"] == pytest.approx(float(Fraction(mc_gold.count("A"), len(mc_gold))))
    assert scores["tiny_mc_think"]["score"] == pytest.approx(think_gold.count("(A)") / len(think_gold))
    followed, total = _ifeval_expected()
    assert scores["tiny_ifeval"]["score"] == pytest.approx(followed / total)
    assert scores["tiny_ifeval"]["stderr"] is not None and scores["tiny_mc"]["stderr"] > 0
    assert scores["tiny_mc"]["n_docs"] == len(mc_gold)

    def sent(prompt_part):
        return [b for b in bodies if prompt_part in json.dumps(b["messages"])]

    mc = sent("Options:\\nA. ")
    think = sent("What is the correct answer to this question:")
    ifeval = [b for b in bodies if b not in mc and b not in think]
    assert (len(mc), len(think), len(ifeval)) == (len(mc_gold), len(think_gold), 24)
    assert all(b["path"] == "/v1/chat/completions" and b["model"] == "fake-model" for b in bodies)
    assert all(b["chat_template_kwargs"] == {"enable_thinking": False} for b in mc + ifeval)
    assert all(b["chat_template_kwargs"] == {"enable_thinking": True} for b in think)
    assert all(b.get("stream") is True for b in think) and not any(b.get("stream") for b in mc + ifeval)
    assert {b["max_tokens"] for b in mc} == {32} and {b["max_tokens"] for b in think} == {64}
    assert all(b["temperature"] == 0 for b in bodies)
    assert (tmp_path / "tiny_mc.jsonl").read_text().count("\n") == len(mc_gold)

    # the tiny model is trained on conversations rendered by the generator: they must be what lm-eval sends
    tests = tiny_tasks.test_docs()
    ours = [
        [
            {"role": "system", "content": tiny_tasks.MC_DESCRIPTION},
            {"role": "user", "content": tiny_tasks.mmlu_pro_text(d)},
        ]
        for d in tests["tiny_mc"]
    ]
    ours += [[{"role": "user", "content": tiny_tasks.GPQA_TEMPLATE.format(**d)}] for d in tests["tiny_mc_think"]]
    ours += [[{"role": "user", "content": d["prompt"]}] for d in tests["tiny_ifeval"]]
    sent = [[{k: v for k, v in m.items() if k != "type"} for m in b["messages"]] for b in bodies]
    assert sorted(map(json.dumps, ours)) == sorted(map(json.dumps, sent))


_MAIN_DRIVER = """
import contextlib, json, sys, types
from pathlib import Path
from types import SimpleNamespace
sys.path.insert(0, {scripts!r})
from lib.stage import StageError
import quality_gate

# an offline host must name the dataset it lacks, before any server is started
manager = quality_gate.task_manager(None)
reqs = quality_gate.build_task_requests(
    [{{"name": "ifeval", "task": "ifeval", "metric": "inst_level_strict_acc", "threshold": 0.8}},
     {{"name": "typo", "task": "no_such_task", "metric": "x", "threshold": 0.8}}],
    base_url="http://unused", model_name="m", num_concurrent=1, limit=None)
try:
    quality_gate.check_datasets(reqs, manager)
    print("OFFLINE-CHECK no error")
except StageError as error:
    print("OFFLINE-CHECK " + json.dumps(str(error)))

# main() with the container plumbing replaced by the fake server already listening
@contextlib.contextmanager
def run_container(image, **kwargs):
    print("RUN-CONTAINER " + json.dumps([image, kwargs]))
    yield SimpleNamespace(base_url={base_url!r}, alive=lambda: True, logs=lambda: "(fake)", network="fake-net")
sys.modules["lib.containers"] = types.SimpleNamespace(
    run_container=run_container, recorded_image=lambda image: image["id"],
    wait_for_ping=lambda url, timeout, **kw: 0.5)
tmp = Path({tmp!r})
(tmp / "image.json").write_text(json.dumps({{"ref": "docker.io/library/fake:1", "id": "sha256:{fake_id}"}}))
(tmp / "datasets").mkdir()  # what download_datasets fetches for tasks that load no hub dataset: nothing
(tmp / "datasets.json").write_text("{{}}")
job = SimpleNamespace(
    input=SimpleNamespace(image=str(tmp / "image.json"), venv="unused", datasets_cache=str(tmp / "datasets"),
                          datasets_manifest=str(tmp / "datasets.json")),
    output=SimpleNamespace(scores=str(tmp / "results" / "quality.json")),
    params=SimpleNamespace(model_name="fake-model", tasks=json.loads(sys.argv[1]), limit=None, margin_stderr=0,
                           num_concurrent=4, reference_scores="", reference_variant=None,
                           ping_timeout_s=5, gpus=False, shm_size="1g", tasks_dir={tasks_dir!r}),
    log=[str(tmp / "logs" / "v1.log")], threads=1)
try:
    quality_gate.main(job)
    print("MAIN passed")
except StageError as error:
    print("MAIN " + json.dumps(str(error)))
"""


FAKE_ID = "f" * 64


@pytest.mark.e2e
@pytest.mark.usefixtures("tiny_venvs")
def test_main_fails_below_threshold_keeps_scores_and_names_missing_datasets(fake_server, tmp_path):
    base_url, _ = fake_server
    tasks = [
        dict(TINY_TASKS[0], threshold=0.5),
        TINY_TASKS[1],
    ]  # the fixed answer "(A)" scores 8/32 on tiny_mc (letters balanced)
    driver = _MAIN_DRIVER.format(
        scripts=str(ROOT / "scripts"), base_url=base_url, tmp=str(tmp_path), tasks_dir=str(TASKS_DIR), fake_id=FAKE_ID
    )
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    run = subprocess.run(
        [str(EVAL_PYTHON), "-c", driver, json.dumps(tasks)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = {
        line.split(" ", 1)[0]: line.split(" ", 1)[1]
        for line in run.stdout.splitlines()
        if line.split(" ", 1)[0] in ("OFFLINE-CHECK", "RUN-CONTAINER", "MAIN")
    }
    offline = json.loads(lines["OFFLINE-CHECK"])
    assert "google/IFEval" in offline and "no_such_task" in offline

    image, kwargs = json.loads(lines["RUN-CONTAINER"])
    # the recorded ID runs, not the tag
    assert image == f"sha256:{FAKE_ID}" and kwargs["gpus"] is False and kwargs["shm_size"] == "1g"
    assert lines["MAIN"] == "passed"  # a failing gate is recorded (passed: false), not raised: select and tarball act
    assert "the gate failed: tiny_mc" in run.stdout and "tiny_ifeval 0" not in run.stdout.split("the gate failed")[1]
    out = run.stdout.splitlines()  # the table goes to stdout, i.e. the rule's log
    header = next(i for i, line in enumerate(out) if line.split()[:4] == ["task", "metric", "score", "stderr"])
    assert out[header + 2].startswith("tiny_mc ") and "FAIL" in out[header + 2]
    assert out[header + 3].startswith("tiny_ifeval ") and "PASS" in out[header + 3]
    recorded = json.loads((tmp_path / "results" / "quality.json").read_text())
    assert recorded["passed"] is False and recorded["limited"] is False and recorded["margin_stderr"] == 0
    assert recorded["image_id"] == f"sha256:{FAKE_ID}" and recorded["network"] == "fake-net"
    report = json.loads((tmp_path / "logs" / "v1.scores.json").read_text())
    assert report["passed"] is False and [t["passed"] for t in report["tasks"]] == [False, True]
    assert report["tasks"][0]["score"] == pytest.approx(_gold("tiny_mc.test.jsonl").count("A") / 32)
    validate_json(report, ROOT / "schemas" / "quality.schema.yaml")
    assert (tmp_path / "logs" / "v1.samples" / "tiny_ifeval.jsonl").exists()


# The real profile's tasks, pointed at the tiny local task files of the same shape (MMLU-Pro, IFEval and GPQA-Diamond
# are not available offline): every generation setting stays config.yaml's, only the lm-eval task name changes.
TINY_STAND_IN = {"mmlu_pro": "tiny_mc", "ifeval": "tiny_ifeval", "gpqa_diamond_cot_zeroshot": "tiny_mc_think"}
DOCS_PER_TASK = 4


def _which_task(body: dict) -> str:
    """The configured task a recorded request belongs to, from its last user message."""
    last = [m for m in body["messages"] if m["role"] == "user"][-1]["content"]
    if "What is the correct answer to this question:" in last:
        return "gpqa_diamond"
    return "mmlu_pro" if "Options:\nA. " in last else "ifeval"


@pytest.mark.e2e
@pytest.mark.usefixtures("tiny_venvs")
def test_every_request_carries_the_real_profiles_settings(fake_server, tmp_path):
    """A recording server: each request's body (few-shot turns, thinking flag, stream, max_tokens) is checked
    against its configured task, for config.yaml's three tasks (which the contract's settings test above pins)."""
    base_url, bodies = fake_server
    tasks = [dict(t, task=TINY_STAND_IN[t["task"]]) for t in real_profile_tasks()]
    driver = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'scripts')!r})\n"
        "from quality_gate import run_lm_eval\n"
        f"scores = run_lm_eval({base_url!r}, json.loads(sys.argv[1]), model_name='fake-model', num_concurrent=4,\n"
        f"                     limit={DOCS_PER_TASK}, tasks_dir={str(TASKS_DIR)!r})\n"
        "print('SCORES ' + json.dumps(scores))\n"
    )
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    run = subprocess.run(
        [str(EVAL_PYTHON), "-c", driver, json.dumps(tasks)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    scores = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("SCORES "))[7:])
    assert {name: s["requests"] for name, s in scores.items()} == dict.fromkeys(CONTRACT, DOCS_PER_TASK)

    by_name = {t["name"]: t for t in tasks}
    seen = {name: 0 for name in by_name}
    for body in bodies:
        name = _which_task(body)
        task, seen[name] = by_name[name], seen[name] + 1
        where = f"request {seen[name]} of {name}: {json.dumps(body)[:300]}"
        assert body["path"] == "/v1/chat/completions" and body["model"] == "fake-model", where
        assert body["chat_template_kwargs"] == {"enable_thinking": task["thinking"]}, where
        assert bool(body.get("stream")) is task["stream"], where
        assert body["max_tokens"] == task["max_tokens"], where
        assert body["temperature"] == 0, where
        roles = [m["role"] for m in body["messages"]]
        # few-shot as multi-turn: one user turn per example, then the question. MMLU-Pro's few-shot examples carry
        # their worked answer in the example text (lm-eval's mmlu_pro, like tiny_mc: fewshot doc_to_target ""), so
        # lm-eval sends no assistant turns between them.
        assert roles.count("user") == task["num_fewshot"] + 1, where
        assert roles.count("assistant") == 0 and set(roles) <= {"system", "user"}, where
    assert seen == dict.fromkeys(CONTRACT, DOCS_PER_TASK)
    assert by_name["gpqa_diamond"]["max_tokens"] == 12288 and by_name["mmlu_pro"]["num_fewshot"] == 5
