import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import base_image
from lib.base_image.elf_stubs import ExportedSymbol, build_stub, exported_symbols
from lib.stage import StageError

# A library like the CUDA ones: a SONAME, one version node, functions and a data object.
REAL_C = """
int real_table[64] = {1, 2, 3, 4};
int real_add(int a, int b) { return a + b + real_table[0]; }
int real_twice(int a) { return 2 * a; }
"""
REAL_MAP = "REAL_1 { global: real_add; real_twice; real_table; local: *; };"
# Links against it the way libtorch_cuda links cuBLAS: a call, and the address of its data taken at load time.
USER_C = """
extern int real_table[64];
int real_add(int, int);
int *user_table(void) { return &real_table[3]; }
int user_call(void) { return real_add(1, 2); }
"""


def compile_library(tmp: Path, name: str, source: str, *flags: str) -> Path:
    (tmp / f"{name}.c").write_text(source)
    out = tmp / name
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), f"{name}.c", *flags], cwd=tmp, check=True)
    return out


@pytest.fixture
def real(tmp_path) -> Path:
    (tmp_path / "real.map").write_text(REAL_MAP)
    return compile_library(
        tmp_path, "libreal.so.1", REAL_C, "-Wl,-soname,libreal.so.1", "-Wl,--version-script,real.map"
    )


def run_user(library_dir: Path, user: Path, call: str) -> subprocess.CompletedProcess:
    code = f"import ctypes; user = ctypes.CDLL({str(user)!r}); print(user.{call}())"
    env = {**os.environ, "LD_LIBRARY_PATH": str(library_dir)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)


def test_a_stand_in_exports_what_the_library_does_and_aborts_when_called(real, tmp_path):
    user = compile_library(tmp_path, "libuser.so", USER_C, str(real))
    assert run_user(tmp_path, user, "user_call").stdout.strip() == "4"  # the real one answers
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    symbols = build_stub(real, stubs / "libreal.so.1")
    assert symbols == [
        ExportedSymbol("real_add", "FUNC", 0, "REAL_1"),
        ExportedSymbol("real_table", "OBJECT", 256, "REAL_1"),
        ExportedSymbol("real_twice", "FUNC", 0, "REAL_1"),
    ]
    assert exported_symbols(stubs / "libreal.so.1") == symbols
    # a consumer linked against the real one loads against the stand-in; its data is there, zeroed
    assert run_user(stubs, user, "user_table").returncode == 0
    called = run_user(stubs, user, "user_call")
    assert called.returncode == -signal.SIGABRT
    assert "libreal.so.1 is a stand-in in this image (a CPU never calls it): real_add was called" in called.stderr
    # the same bytes when built again (image layers stay stable)
    build_stub(real, tmp_path / "again.so")
    assert (tmp_path / "again.so").read_bytes() == (stubs / "libreal.so.1").read_bytes()


def test_a_library_without_a_soname_has_no_stand_in(tmp_path):
    plain = compile_library(tmp_path, "libplain.so", "int plain(void) { return 1; }")
    with pytest.raises(StageError, match="has no SONAME"):
        build_stub(plain, tmp_path / "stub.so")
    assert not (tmp_path / "stub.so").exists()


def test_a_hidden_older_symbol_version_is_refused(tmp_path):
    (tmp_path / "two.map").write_text("OLD_1 { global: f; local: *; }; NEW_2 { global: f; } OLD_1;")
    source = (
        "int f_old(void) { return 1; }\nint f_new(void) { return 2; }\n"
        '__asm__(".symver f_old, f@OLD_1");\n__asm__(".symver f_new, f@@NEW_2");\n'
    )
    two = compile_library(tmp_path, "libtwo.so.1", source, "-Wl,-soname,libtwo.so.1", "-Wl,--version-script,two.map")
    with pytest.raises(StageError, match="non-default symbol version"):
        build_stub(two, tmp_path / "stub.so")


def test_the_base_stands_in_for_the_matching_libraries_only(real, tmp_path, capsys):
    site, copy = tmp_path / "site", tmp_path / "copy"
    (site / "nvidia" / "x" / "lib").mkdir(parents=True)
    (site / "nvidia" / "x" / "lib" / "libreal.so.1").write_bytes(real.read_bytes())
    (site / "nvidia" / "x" / "lib" / "libkept.so.1").write_bytes(b"kept")
    patterns = ("nvidia/x/lib/libreal.so.*", "nvidia/gone/lib/libgone.so.*")
    base_image.copy_site_packages(site, copy, patterns)
    saved = base_image.stand_in_libraries(site, copy, patterns)
    stand_in = copy / "nvidia" / "x" / "lib" / "libreal.so.1"
    assert saved == {"nvidia/x/lib/libreal.so.1": real.stat().st_size - stand_in.stat().st_size}
    assert exported_symbols(stand_in) == exported_symbols(real) and stand_in.read_bytes() != real.read_bytes()
    assert (copy / "nvidia" / "x" / "lib" / "libkept.so.1").read_bytes() == b"kept"
    assert "no nvidia/gone/lib/libgone.so.* in" in capsys.readouterr().out


def test_a_stand_in_that_exports_something_else_is_removed(real, tmp_path, monkeypatch):
    from lib.base_image import elf_stubs

    truth = elf_stubs.exported_symbols(real)
    monkeypatch.setattr(elf_stubs, "exported_symbols", lambda library: truth if library == real else truth[:1])
    with pytest.raises(StageError, match="does not export what it does.*real_table"):
        elf_stubs.build_stub(real, tmp_path / "stub.so")
    assert not (tmp_path / "stub.so").exists()
