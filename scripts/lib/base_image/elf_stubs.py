"""Stand-ins for shared libraries that a process links but never calls: a small ELF library with the same SONAME,
exporting the same symbols at the same versions, whose functions report the call on stderr and abort.

The tiny profile's CPU image needs them: PyPI's torch is the CUDA build, so `import torch` links cuBLAS, cuFFT,
NCCL and the rest (about 2 GB) even where no GPU exists, and a CPU server never calls into them. A stand-in keeps
the dynamic linker satisfied at 1-2 % of the size, and any call that does come is loud, never a silent wrong answer.
"""

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lib.stage import StageError


@dataclass(frozen=True)
class ExportedSymbol:
    name: str
    kind: str  # "FUNC" or "OBJECT"
    size: int  # bytes, for objects (0 for functions: a stand-in's are smaller)
    version: str | None  # its version node (`sym@@node`), None when the library has no versioning


# readelf --dyn-syms -W: "Num: Value Size Type Bind Vis Ndx Name", Name as "sym@@node" (default version), "sym@node"
# (a hidden older one) or "sym"; sizes of 100,000 bytes and more are printed in hex.
_SYMBOL_LINE = re.compile(
    r"^\s*\d+:\s+[0-9a-f]+\s+(?P<size>0x[0-9a-f]+|\d+)\s+(?P<kind>\w+)\s+(?P<bind>\w+)\s+\w+\s+(?P<ndx>\w+)\s+"
    r"(?P<name>\S+)$"
)


def _readelf(library: Path, *flags: str) -> str:
    result = subprocess.run(["readelf", "-W", *flags, str(library)], capture_output=True, text=True)
    if result.returncode != 0:
        raise StageError(f"readelf {' '.join(flags)} {library} failed: {result.stderr.strip()}")
    return result.stdout


def exported_symbols(library: Path) -> list[ExportedSymbol]:
    """The functions and objects `library` defines for others (not its version nodes' own ABS entries)."""
    symbols = []
    for line in _readelf(library, "--dyn-syms").splitlines():
        found = _SYMBOL_LINE.match(line)
        if not found or found["ndx"] in ("UND", "ABS") or found["bind"] == "LOCAL":
            continue
        if found["kind"] not in ("FUNC", "OBJECT"):
            raise StageError(f"{library} exports {found['name']} of type {found['kind']}: no stand-in for that kind")
        name, default, version = found["name"].partition("@@")
        if not default:
            if "@" in name:  # a hidden non-default version: callers bound to it would need .symver aliases
                raise StageError(f"{library} exports {name}, a non-default symbol version: no stand-in for it")
            version = None
        size = 0 if found["kind"] == "FUNC" else int(found["size"], 0)  # base 0: decimal, or hex with 0x
        symbols.append(ExportedSymbol(name, found["kind"], size, version))
    return sorted(set(symbols), key=lambda s: (s.version or "", s.name))


def soname(library: Path) -> str:
    found = re.search(r"\(SONAME\)\s+Library soname: \[(.+)\]", _readelf(library, "-d"))
    if not found:
        raise StageError(f"{library} has no SONAME: a stand-in could not take its place")
    return found[1]


def stub_sources(library_name: str, symbols: list[ExportedSymbol]) -> tuple[str, str]:
    """The C source of the stand-in and its linker version script (which also hides the helper)."""
    lines = [
        "#include <stdlib.h>",
        "#include <string.h>",
        "#include <unistd.h>",
        "static void stub_called(const char *symbol) {",
        f'    static const char what[] = "{library_name} is a stand-in in this image (a CPU never calls it): ";',
        "    write(2, what, sizeof what - 1);",
        "    write(2, symbol, strlen(symbol));",
        '    write(2, " was called\\n", 12);',
        "    abort();",
        "}",
    ]
    for number, symbol in enumerate(symbols):
        if symbol.kind == "FUNC":
            lines.append(f'void f{number}(void) __asm__("{symbol.name}");')
            lines.append(f'void f{number}(void) {{ stub_called("{symbol.name}"); }}')
        else:
            lines.append(
                f'char o{number}[{max(symbol.size, 1)}] __asm__("{symbol.name}") __attribute__((aligned(16)));'
            )
    nodes: dict[str | None, list[str]] = {}
    for symbol in symbols:
        nodes.setdefault(symbol.version, []).append(symbol.name)
    script = []
    for version, names in nodes.items():
        exported = "".join(f"    {name};\n" for name in names)
        script.append(f"{version or ''} {{\n  global:\n{exported}  local: *;\n}};\n")
    return "\n".join(lines) + "\n", "".join(script)


def build_stub(library: Path, out: Path) -> list[ExportedSymbol]:
    """Compile the stand-in of `library` to `out` (stripped: no build path in it, the same bytes on every host with
    the same compiler) and check that it exports what the library does. Returns those symbols."""
    missing_tools = [tool for tool in ("gcc", "readelf") if shutil.which(tool) is None]
    if missing_tools:
        raise StageError(f"{' and '.join(missing_tools)} not found: apt-get install gcc binutils")
    symbols = exported_symbols(library)
    if not symbols:
        raise StageError(f"{library} exports nothing: nothing to stand in for")
    name = soname(library)
    source, script = stub_sources(name, symbols)
    with tempfile.TemporaryDirectory(prefix="elf-stub-") as tmp:
        (Path(tmp) / "stub.c").write_text(source)
        (Path(tmp) / "stub.map").write_text(script)
        result = subprocess.run(
            ["gcc", "-shared", "-fPIC", "-O1", "-s", "-o", str(out.resolve()), "stub.c",
             f"-Wl,-soname,{name}", "-Wl,--version-script,stub.map"],
            cwd=tmp, capture_output=True, text=True,
        )  # fmt: skip
    if result.returncode != 0:
        out.unlink(missing_ok=True)
        raise StageError(f"compiling the stand-in for {library} failed:\n{result.stderr[-3000:]}")
    made, made_name = exported_symbols(out), soname(out)
    if made != symbols or made_name != name:
        out.unlink()
        differences = sorted(set(made) ^ set(symbols), key=lambda s: s.name)[:10]
        raise StageError(
            f"the stand-in for {library} ({made_name}) does not export what it does ({name}); "
            f"first differences: {differences}"
        )
    return symbols
