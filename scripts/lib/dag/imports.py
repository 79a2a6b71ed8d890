"""The project's own source files a stage script runs: its imports, followed through the project's packages, and the
data files those modules read.

rules/common.smk lists them as inputs of the rule that runs the script (`code_of`), so a change to shared code
reruns exactly the stages that import it. Snakemake's own code trigger covers only the script a rule names.
Standard library only: rules/common.smk imports it while the DAG is built.

A module that reads a file of the project's own (a template, a schema) names it in a module-level
`DATA_FILES = ("name", ...)`: string literals, each a path relative to the module's folder, which the module then
reads through it. They are read here from the module's source, never by importing it.
"""

import ast
import os
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
def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_bytes(), filename=str(path))  # once per process


@cache
def _imports(path: Path) -> tuple[tuple[int, str, tuple[str, ...]], ...]:
    """(level, module, imported names) of every import statement in the file, at any depth: stage scripts import
    lazily, inside functions."""
    found = []
    for node in _statements(_parsed(path).body):
        if isinstance(node, ast.Import):
            found += [(0, alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.level, node.module or "", tuple(alias.name for alias in node.names)))
    return tuple(found)


class DataFilesError(ValueError):
    """A DATA_FILES declaration that is not a tuple of string literals, or that names no file."""


@cache
def data_files(path: Path) -> tuple[Path, ...]:
    """The files a module's module-level `DATA_FILES` names, as paths beside the module's own (normalised, so a
    `../` stays relative to where the module was named from)."""
    for node in _parsed(path).body:
        if not isinstance(node, ast.Assign) or not any(
            isinstance(target, ast.Name) and target.id == "DATA_FILES" for target in node.targets
        ):
            continue
        value = node.value
        if not (
            isinstance(value, (ast.Tuple, ast.List))
            and all(isinstance(item, ast.Constant) and isinstance(item.value, str) for item in value.elts)
        ):
            raise DataFilesError(f"{path}:{node.lineno}: DATA_FILES must be a tuple of string literals")
        files = tuple(Path(os.path.normpath(path.parent / item.value)) for item in value.elts)
        missing = [str(file) for file in files if not file.is_file()]
        if missing:
            raise DataFilesError(f"{path}:{node.lineno}: DATA_FILES names {', '.join(missing)}, which is no file")
        return files
    return ()


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


def code_inputs(script: str | Path, packages: dict[str, str | Path]) -> list[Path]:
    """What a rule that runs `script` depends on besides the script itself: the project modules it imports
    (project_modules) and the data files the script and those modules declare (DATA_FILES), sorted."""
    modules = project_modules(script, packages)
    return sorted({*modules, *(file for module in [Path(script), *modules] for file in data_files(module))})
