"""The project's own source files a stage script runs: its imports, followed through the project's packages.

rules/common.smk lists them as inputs of the rule that runs the script (`code_of`), so a change to shared code
reruns exactly the stages that import it. Snakemake's own code trigger covers only the script a rule names.
Standard library only: rules/common.smk imports it while the DAG is built.
"""

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path


def _statements(nodes: list) -> Iterator[ast.AST]:
    """Every statement, nested ones too (an import is one): expressions hold none, and walking them all (ast.walk)
    took most of the DAG's added build time."""
    for node in nodes:
        yield node
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            nested = getattr(node, field, None)
            if isinstance(nested, list):
                yield from _statements(nested)


@cache
def _imports(path: Path) -> tuple[tuple[int, str, tuple[str, ...]], ...]:
    """(level, module, imported names) of every import statement in the file, at any depth: stage scripts import
    lazily, inside functions. Parsed once per process."""
    found = []
    for node in _statements(ast.parse(path.read_bytes(), filename=str(path)).body):
        if isinstance(node, ast.Import):
            found += [(0, alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.level, node.module or "", tuple(alias.name for alias in node.names)))
    return tuple(found)


def _module_files(folder: Path, parts: list[str]) -> list[Path]:
    """The files importing the module at folder/parts executes: each package's __init__.py on the way and the
    module itself; nothing if it is not a project file (an attribute, or a module of another package)."""
    files = []
    for depth in range(len(parts) + 1):
        here = folder.joinpath(*parts[:depth])
        if (here / "__init__.py").is_file():
            files.append(here / "__init__.py")
        elif depth == len(parts) and here.with_suffix(".py").is_file():
            files.append(here.with_suffix(".py"))
        elif depth:  # not a package: what is left is no project module
            return []
    return files


def _resolve(importer: Path, level: int, module: str, names: tuple[str, ...], packages: dict[str, Path]):
    """The project files one import statement executes."""
    parts = module.split(".") if module else []
    if level:  # relative: from the importer's own package
        folder = importer.parent
        for _ in range(level - 1):
            folder = folder.parent
    elif parts and parts[0] in packages:
        folder, parts = packages[parts[0]], parts[1:]
    else:
        return []
    files = _module_files(folder, parts)
    if files or not parts:
        for name in names:  # `from lib import probe` imports the module lib.probe
            files += _module_files(folder, [*parts, name])
    return files


@cache
def _closure(script: Path, packages: tuple[tuple[str, Path], ...]) -> tuple[Path, ...]:
    table = dict(packages)
    seen: set[Path] = set()
    todo = [script]
    while todo:
        path = todo.pop()
        for level, module, names in _imports(path):
            for found in _resolve(path, level, module, names, table):
                if found not in seen:
                    seen.add(found)
                    todo.append(found)
    seen.discard(script)
    return tuple(sorted(seen))


def project_modules(script: str | Path, packages: dict[str, str | Path]) -> list[Path]:
    """Every file of the project's own packages (`packages`: top-level name -> its folder) that `script` imports,
    directly or through another, at module level or inside functions, sorted; not the script itself. A package's
    __init__.py counts: importing any of its modules runs it. Imports by a computed name are not seen."""
    table = tuple(sorted((name, Path(folder)) for name, folder in packages.items()))
    return list(_closure(Path(script), table))
