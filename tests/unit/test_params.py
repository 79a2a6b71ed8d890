"""Defaults live in one place: the config schema (and serving/settings.py for serve keys). A stage script reads
only params its rule sets, and never falls back to a default of its own for a config key."""

import ast
import re
from pathlib import Path

import yaml

from conftest import ROOT

SCRIPTS = ROOT / "scripts"


def schema_keys() -> set[str]:
    keys = set()

    def walk(node):
        if isinstance(node, dict):
            keys.update(node.get("properties", {}))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(yaml.safe_load((ROOT / "schemas" / "config.schema.yaml").read_text()))
    return keys


def rule_params() -> dict[str, set[str]]:
    """script file name -> the params its rule sets, read from rules/*.smk (one rule or checkpoint per file)."""
    found = {}
    for smk in (ROOT / "rules").glob("*.smk"):
        # A rule may sit inside an `if` (indented): match at any indentation.
        for block in re.split(r"^\s*(?:rule|checkpoint) ", smk.read_text(), flags=re.M)[1:]:
            script = re.search(r'^\s+script:\n\s+"\.\./scripts/(\w+\.py)"', block, re.M)
            if not script:
                continue
            params = re.search(r"^( +)params:\n((?:\1    .*\n|\s*\n)+)", block, re.M)
            names = set(re.findall(r"^ +(\w+)=", params.group(2), re.M)) if params else set()
            found[script.group(1)] = names
    return found


def params_aliases(tree: ast.AST) -> set[str]:
    """`params` and every local bound to `<job>.params`."""
    aliases = {"params"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute) and node.value.attr == "params":
            aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return aliases


def params_read(tree: ast.AST) -> set[str]:
    """Names read as `<anything>.params.<name>` or through a local bound to `job.params`."""
    aliases = params_aliases(tree)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Attribute) and owner.attr == "params") or (
                isinstance(owner, ast.Name) and owner.id in aliases
            ):
                names.add(node.attr)
    return names


def fallback_defaults(tree: ast.AST, keys: set[str]) -> list[str]:
    """`getattr(params, "x", default)`, `<dict>.get("<config key>", <non-None default>)` and `*DEFAULTS*` tables of
    config keys: each a second home for a default."""
    aliases = params_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            targets = [t.id for t in node.targets if isinstance(t, ast.Name) and "DEFAULT" in t.id.upper()]
            restated = [k.value for k in node.value.keys if isinstance(k, ast.Constant) and k.value in keys]
            if targets and restated:
                found.append(f"line {node.lineno}: {targets[0]} restates the defaults of {restated}")
        if not isinstance(node, ast.Call) or len(node.args) < 2:
            continue
        name = node.args[0] if isinstance(node.func, ast.Attribute) else node.args[1]
        default = (
            node.args[1] if isinstance(node.func, ast.Attribute) else (node.args[2] if len(node.args) > 2 else None)
        )
        if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
            continue
        is_get = isinstance(node.func, ast.Attribute) and node.func.attr == "get" and name.value in keys
        is_getattr = (
            isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and (ast.unparse(node.args[0]).endswith("params") or ast.unparse(node.args[0]) in aliases)
            and default is not None
        )
        if is_getattr or (is_get and not (isinstance(default, ast.Constant) and default.value is None)):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def stage_scripts() -> list[Path]:
    return sorted(SCRIPTS.glob("*.py"))


def test_every_param_a_script_reads_is_set_by_its_rule():
    declared = rule_params()
    problems = []
    for script in stage_scripts():
        if script.name not in declared:
            problems.append(f"{script.name}: no rule runs it")
            continue
        missing = params_read(ast.parse(script.read_text())) - declared[script.name]
        problems += [f"{script.name}: reads params.{name}, which its rule does not set" for name in sorted(missing)]
    assert not problems, "\n".join(problems)


def test_no_script_falls_back_to_a_default_of_its_own():
    keys = schema_keys()
    problems = []
    for script in stage_scripts() + sorted((SCRIPTS / "lib").rglob("*.py")):
        if script.name == "config.py":  # the schema's reader
            continue
        problems += [
            f"{script.relative_to(ROOT)} {line}" for line in fallback_defaults(ast.parse(script.read_text()), keys)
        ]
    assert not problems, "\n".join(problems)


def test_the_checkers_catch_what_they_look_for():
    tree = ast.parse(
        "def main(job):\n"
        "    params = job.params\n"
        "    level = getattr(job.params, 'compress_level', 1)\n"
        "    stop = getattr(params, 'stop_on_fail', True)\n"
        "    seed = job.params.calibration.get('seed', 0)\n"
        "    return params.tag, job.params.unset\n"
    )
    assert params_read(tree) >= {"tag", "unset", "calibration"}
    found = sorted(fallback_defaults(tree, {"seed", "compress_level", "stop_on_fail"}))
    assert len(found) == 3 and "compress_level" in found[0] and "stop_on_fail" in found[1] and "seed" in found[2]
    table = fallback_defaults(ast.parse("TASK_DEFAULTS = {'max_tokens': 256, 'other': 1}"), {"max_tokens"})
    assert table and "max_tokens" in table[0]
