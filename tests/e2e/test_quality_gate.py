"""quality_gate through real lm-eval (the eval venv) against a stand-in chat server (tests/support/chat_standin.py):
the scores of a fixed answer, a failing gate's record, and the contract's settings on every request
(tests/unit/test_quality_gate.py: the gate's logic)."""

from __future__ import annotations

import json
import subprocess
from fractions import Fraction

import pytest

from chat_standin import ANSWER, chat_standin
from conftest import ROOT
from lib.stage import validate_json
from lib.tiny import tasks as tiny_tasks
from unit.test_quality_gate import CONTRACT, TASKS_DIR, TINY_TASKS, real_profile_tasks

EVAL_PYTHON = ROOT / ".venvs" / "eval" / "bin" / "python"


@pytest.fixture
def fake_server():
    """A stand-in chat server (tests/support/chat_standin.py): its base URL and the request bodies it was sent."""
    with chat_standin() as served:
        yield served


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
