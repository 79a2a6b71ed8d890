"""A change to shared code reruns exactly the stages that import it: each rule's inputs include the project modules
its script imports (scripts/lib/dag/imports.py, rules/common.smk's code_of), read from the import graph, and the data
files those modules declare they read (DATA_FILES)."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FROM_BAKE_ON, ROOT, TINY, snakemake
from lib.dag.imports import DataFilesError, code_inputs, project_modules


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_imports_are_followed_through_the_package_lazily_and_relatively(tmp_path):
    write(
        tmp_path,
        {
            "stage.py": "import os\n\n\ndef main():\n    from pkg.a import helper\n",
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg import b\n\n\ndef helper():\n    pass\n",
            "pkg/b.py": """
import json


class Later:
    def run(self):
        try:
            from .c import x
        finally:
            pass
""",
            "pkg/c.py": "from . import a  # a cycle back\nimport other.thing\n\nx = 1\n",
            "pkg/unused.py": "",
            "other/thing.py": "",
        },
    )
    found = project_modules(tmp_path / "stage.py", {"pkg": tmp_path / "pkg"})
    assert found == [tmp_path / "pkg" / name for name in ("__init__.py", "a.py", "b.py", "c.py")]


def test_subpackages_and_a_second_package_count_their_init_files(tmp_path):
    write(
        tmp_path,
        {
            "stage.py": "from lib.tiny import synthesis\nfrom lib import ROOT\nimport serving.settings\n",
            "scripts/lib/__init__.py": "ROOT = None\n",
            "scripts/lib/tiny/__init__.py": "",
            "scripts/lib/tiny/synthesis.py": "from ..tiny.tokenizer import words\n",
            "scripts/lib/tiny/tokenizer.py": "words = []\n",
            "serving/__init__.py": "",
            "serving/settings.py": "",
        },
    )
    packages = {"lib": tmp_path / "scripts" / "lib", "serving": tmp_path / "serving"}
    found = [str(path.relative_to(tmp_path)) for path in project_modules(tmp_path / "stage.py", packages)]
    assert found == [
        "scripts/lib/__init__.py",
        "scripts/lib/tiny/__init__.py",
        "scripts/lib/tiny/synthesis.py",
        "scripts/lib/tiny/tokenizer.py",
        "serving/__init__.py",
        "serving/settings.py",
    ]


def test_the_data_files_a_module_declares_are_inputs_beside_its_imports(tmp_path):
    write(
        tmp_path,
        {
            "stage.py": "from pkg import reader\n",
            "pkg/__init__.py": "",
            "pkg/reader.py": "from pkg.sub import template\n\nDATA_FILES = ('words.txt', '../shared/table.yaml')\n",
            "pkg/words.txt": "",
            "pkg/sub/__init__.py": "",
            "pkg/sub/template.py": "DATA_FILES = ('page.jinja',)\n\n\ndef f():\n    DATA_FILES = ('local.txt',)\n",
            "pkg/sub/page.jinja": "",
            "pkg/unused.py": "DATA_FILES = ('unread.txt',)\n",
            "pkg/unread.txt": "",
            "shared/table.yaml": "",
        },
    )
    found = [str(path.relative_to(tmp_path)) for path in code_inputs(tmp_path / "stage.py", {"pkg": tmp_path / "pkg"})]
    assert found == [
        "pkg/__init__.py",
        "pkg/reader.py",
        "pkg/sub/__init__.py",
        "pkg/sub/page.jinja",
        "pkg/sub/template.py",
        "pkg/words.txt",
        "shared/table.yaml",
    ]


@pytest.mark.parametrize(
    "declaration, words",
    [("DATA_FILES = ('gone.txt',)", "gone.txt, which is no file"), ("DATA_FILES = (NAME,)", "string literals")],
)
def test_a_data_file_declaration_that_names_no_file_is_refused_naming_the_module(tmp_path, declaration, words):
    write(tmp_path, {"stage.py": "import pkg.reader\n", "pkg/__init__.py": "", "pkg/reader.py": declaration + "\n"})
    with pytest.raises(DataFilesError, match=r"pkg/reader\.py:1: DATA_FILES .*" + re.escape(words)):
        code_inputs(tmp_path / "stage.py", {"pkg": tmp_path / "pkg"})


# Each rule's script and `code` input as Snakemake parsed them (its API, in a fresh interpreter, as test_dag does).
RULE_CODE = """
import json, sys
from pathlib import Path
from snakemake.api import SnakemakeApi
from snakemake.settings.types import ConfigSettings, OutputSettings, ResourceSettings

with SnakemakeApi(OutputSettings()) as api:
    workflow = api.workflow(resource_settings=ResourceSettings(), snakefile=Path("Snakefile"), workdir=Path("."),
                            config_settings=ConfigSettings(configfiles=[Path(f) for f in sys.argv[1:]]))._workflow
    print(json.dumps({r.name: {"script": r.script, "code": [str(f) for f in r.input.get("code", [])]}
                      for r in workflow.rules}))
"""


def test_every_rule_that_runs_a_script_lists_what_its_script_imports():
    result = subprocess.run(
        [sys.executable, "-c", RULE_CODE, *TINY[1:]], cwd=ROOT, capture_output=True, text=True, check=True
    )
    rules = json.loads(result.stdout.strip().splitlines()[-1])
    running = {name: rule for name, rule in rules.items() if rule["script"]}
    assert len(running) >= 15
    packages = {"lib": ROOT / "scripts" / "lib", "serving": ROOT / "serving"}
    for name, rule in running.items():
        script = (ROOT / "rules" / rule["script"]).resolve()
        expected = [str(path.relative_to(ROOT)) for path in code_inputs(script, packages)]
        assert "scripts/lib/stage.py" in expected, name  # every stage runs through lib.stage.run_stage
        assert rule["code"] == expected, name
    # the tiny tokenizer's chat template, read beside lib/tiny/tokenizer.py by the stages that make the model
    assert "scripts/lib/tiny/chat_template.jinja" in running["train_tiny"]["code"]


def dry_run_reasons(project: Path) -> dict[str, list[str]]:
    """{rule: [reason of each of its planned jobs]} from a dry run of image.tar.gz in `project`."""
    out = snakemake("-n", "image.tar.gz", *TINY, cwd=project).stdout
    reasons, rule = {}, None
    for line in out.splitlines():
        if header := re.match(r"^(?:local)?(?:rule|checkpoint) (\w+):$", line):
            rule = header.group(1)
        elif (reason := re.match(r"^\s+reason: (.*)$", line)) and rule:
            reasons.setdefault(rule, []).append(reason.group(1))
    return reasons


@pytest.fixture(scope="module")
def built_copy(tmp_path_factory) -> Path:
    """A copy of the project's sources in which the tiny DAG looks built: every output a dry run plans exists (empty),
    newer than every source file, so a dry run has nothing to do until a source's mtime moves."""
    copy = tmp_path_factory.mktemp("project")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():  # a tracked file another change deleted is not there
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, copy / name)
    planned = snakemake("-n", "image.tar.gz", *TINY, cwd=copy).stdout
    outputs = [path.strip() for line in re.findall(r"^\s+output: (.+)$", planned, re.M) for path in line.split(",")]
    assert len(outputs) > 20, planned
    now = time.time()
    for path in copy.rglob("*"):
        os.utime(path, (now - 7200, now - 7200), follow_symlinks=False)
    for name in outputs:
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        (copy / name).touch()
        os.utime(copy / name, (now - 3600, now - 3600))
    assert dry_run_reasons(copy) == {}  # the control: untouched sources rerun nothing
    return copy


# (module edited, the stages whose own reason names it, all that reruns for image.tar.gz)
EDITS = [
    # the probe's prompts warm the server up before the compile cache is baked (bake_compile_cache imports it)
    ("scripts/lib/probe.py", {"bake_compile_cache"}, set(FROM_BAKE_ON)),
    # read by the latency probe and the lossless reference's server only
    (
        "scripts/lib/vllm_logs.py",
        {"latency_probe"},
        {"latency_probe", "lossless_reference", "quality_gate", "lossless", "tarball"},
    ),
    # imported by quantize alone
    ("scripts/lib/quantize/checks.py", {"quantize"}, {"quantize", *FROM_BAKE_ON}),
    # a data file, read by the tiny tokenizer (its DATA_FILES): download makes the model with it (train_tiny also
    # lists it, but reruns first for download's new checkpoint, the reason Snakemake gives)
    (
        "scripts/lib/tiny/chat_template.jinja",
        {"download"},
        {"download", "train_tiny", "quantize", *FROM_BAKE_ON},
    ),
]


@pytest.mark.parametrize(
    "module, named, reruns",
    EDITS,
    ids=[str(Path(edit[0]).relative_to("scripts/lib").with_suffix("")) for edit in EDITS],
)
def test_an_edited_module_reruns_the_stages_that_import_it_and_what_follows(built_copy, module, named, reruns):
    path = built_copy / module
    before = path.stat().st_mtime
    os.utime(path, (time.time(), time.time()))
    try:
        reasons = dry_run_reasons(built_copy)
    finally:
        os.utime(path, (before, before))
    assert set(reasons) == reruns, reasons
    assert {rule for rule, said in reasons.items() if any(module in reason for reason in said)} == named, reasons
    for rule in named:
        assert reasons[rule] == [f"Updated input files: {module}"], reasons
