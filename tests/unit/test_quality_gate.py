"""quality_gate's logic, under plain python3 (tests/e2e/test_quality_gate.py: lm-eval's wiring, in the eval venv)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from chat_standin import chat_standin
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


# ---- check_server against a stand-in chat server -------------------------------------------------------------------


def test_check_server_names_model_and_context_problems():
    with chat_standin() as (base_url, _):
        assert check_server(base_url, TINY_TASKS, "fake-model") == 100
        with pytest.raises(StageError, match="not the model name 'Qwen/Qwen3.5-4B'"):
            check_server(base_url, TINY_TASKS, "Qwen/Qwen3.5-4B")
        with pytest.raises(StageError, match=r"max_model_len is 100, too short for tiny_mc \(max_tokens 100\)"):
            check_server(base_url, [dict(TINY_TASKS[0], max_tokens=100), TINY_TASKS[1]], "fake-model")
