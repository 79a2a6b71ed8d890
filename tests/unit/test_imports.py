"""Stage scripts never import each other; gpu_proof imports only lib (and serving); lib has no import cycle; a
stage's own package (scripts/lib/<stage>/) is imported by that stage alone.

A stage script is a file of scripts/ that a rule runs (`script: "../scripts/<name>.py"`). What stages share
lives in scripts/lib; a stage that needs another stage's work runs it as a program."""

import ast
import re
from pathlib import Path

from conftest import ROOT

SCRIPT_LINE = re.compile(r"""^\s*["']\.\./scripts/(\w+)\.py["']""", re.M)


def stage_names(rules_dir: Path) -> set[str]:
    """Module names of the scripts the rules run."""
    return {name for smk in rules_dir.glob("*.smk") for name in SCRIPT_LINE.findall(smk.read_text())}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in the file, at any depth (inside functions too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            # `from lib import probe` imports the module lib.probe
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def import_problems(root: Path) -> list[str]:
    """Every forbidden import under root/scripts and root/gpu_proof, and every import cycle in root/scripts/lib."""
    stages = stage_names(root / "rules")
    lib_dir = root / "scripts" / "lib"
    owned = {stage for stage in stages if (lib_dir / stage).is_dir()}  # lib/<stage>/: that stage's own modules
    problems = []
    for path in sorted([*(root / "scripts").rglob("*.py"), *(root / "gpu_proof").rglob("*.py")]):
        where = path.relative_to(root)
        in_lib = lib_dir in path.parents
        told = set()  # (line, owner): `from lib.x.y import z` names lib.x.y and lib.x.y.z
        for line, module in imported_modules(path):
            parts = module.split(".")
            top = parts[0]
            if top in stages and module == top:
                who = "lib" if in_lib else "gpu_proof" if where.parts[0] == "gpu_proof" else "stage script"
                problems.append(
                    f"{where}:{line}: {who} imports stage script {module!r} (move what it needs to "
                    f"scripts/lib, or run the stage as a program)"
                )
            owner = parts[1] if top == "lib" and len(parts) > 1 and parts[1] in owned else None
            mine = path == root / "scripts" / f"{owner}.py" or lib_dir / str(owner) in path.parents
            if owner and not mine and (line, owner) not in told:
                told.add((line, owner))
                problems.append(
                    f"{where}:{line}: imports {module!r}, stage {owner}'s own (scripts/lib/{owner}/): move what "
                    f"it shares up into scripts/lib"
                )
    graph = {
        f"lib.{'.'.join(p.relative_to(lib_dir).with_suffix('').parts)}".removesuffix(".__init__"): p
        for p in lib_dir.rglob("*.py")
    }
    edges = {
        name: sorted({m for _, m in imported_modules(path) if m in graph and m != name}) for name, path in graph.items()
    }
    problems += [f"import cycle in scripts/lib: {' -> '.join(cycle)}" for cycle in cycles(edges)]
    return problems


def cycles(edges: dict[str, list[str]]) -> list[list[str]]:
    """One cycle (as a closed path) per strongly connected group of modules that import each other."""
    found, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in edges.get(node, []):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return found


def test_no_stage_script_imports_another_and_lib_has_no_cycle():
    assert import_problems(ROOT) == []


def test_the_rules_name_the_stage_scripts():
    assert {"download", "quantize", "tarball", "verify_image", "train_tiny"} <= stage_names(ROOT / "rules")


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_check_names_each_offending_file_and_import(tmp_path):
    write(
        tmp_path,
        {
            "rules/a.smk": 'rule a:\n    script:\n        "../scripts/alpha.py"\n',
            "rules/b.smk": 'rule b:\n    script:\n        "../scripts/beta.py"\n',
            "scripts/alpha.py": "import json\nfrom lib.one import x\n",
            "scripts/beta.py": "def main():\n    from alpha import helper\n",
            "scripts/lib/__init__.py": "",
            "scripts/lib/one.py": "from lib.two import y\n",
            "scripts/lib/two.py": "import lib.one\n",
            "scripts/lib/three.py": "from lib import one\n",
            "scripts/lib/uses_stage.py": "import beta\n",
            "scripts/lib/alpha/own.py": "from lib.alpha import more\n",
            "scripts/lib/alpha/more.py": "",
            "scripts/lib/uses_alphas.py": "from lib.alpha.own import z\n",
            "gpu_proof/driver.py": "import sys\nimport alpha\nfrom lib.one import x\nfrom lib import alpha\n",
        },
    )
    assert import_problems(tmp_path) == [
        "gpu_proof/driver.py:2: gpu_proof imports stage script 'alpha' (move what it needs to scripts/lib, "
        "or run the stage as a program)",
        "gpu_proof/driver.py:4: imports 'lib.alpha', stage alpha's own (scripts/lib/alpha/): move what it shares up "
        "into scripts/lib",
        "scripts/beta.py:2: stage script imports stage script 'alpha' (move what it needs to scripts/lib, "
        "or run the stage as a program)",
        "scripts/lib/uses_alphas.py:1: imports 'lib.alpha.own', stage alpha's own (scripts/lib/alpha/): move what it "
        "shares up into scripts/lib",
        "scripts/lib/uses_stage.py:1: lib imports stage script 'beta' (move what it needs to scripts/lib, "
        "or run the stage as a program)",
        "import cycle in scripts/lib: lib.one -> lib.two -> lib.one",
    ]


def test_a_clean_tree_passes(tmp_path):
    write(
        tmp_path,
        {
            "rules/a.smk": 'rule a:\n    script:\n        "../scripts/alpha.py"\n',
            "scripts/alpha.py": "from lib.one import x\nfrom lib.alpha.own import z\n",
            "scripts/lib/one.py": "from lib.two import y\n",
            "scripts/lib/two.py": "import json\n",
            "scripts/lib/alpha/own.py": "from lib.one import x\n",
            "gpu_proof/driver.py": "from lib import one\n",
        },
    )
    assert import_problems(tmp_path) == []
