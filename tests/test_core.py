"""The core C library on its own, without Python in the way: tests/c/test_header.c must compile
as strict C99 and as C++ with nothing but <tequant/tequant.h>, and tests/c/test_status.c (status
strings, thread-local last error, descriptor and config checks, CPU-only device queries) is built
against csrc/core into tmp_path and run. Needs gcc (and g++ for the C++ case).
"""

import pathlib
import re
import shutil
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
INCLUDE = REPO / "csrc" / "include"
CORE = REPO / "csrc" / "core"
HEADER_TEST = REPO / "tests" / "c" / "test_header.c"
STATUS_TEST = REPO / "tests" / "c" / "test_status.c"
CORE_SOURCES = [CORE / f"{stem}.c" for stem in ("status", "tensor", "quant_config", "device")]

C99_FLAGS = ["-std=c99", "-pedantic", "-Wall", "-Wextra", "-Werror", f"-I{INCLUDE}", "-c"]
CXX_FLAGS = ["-std=c++17", "-pedantic", "-Wall", "-Wextra", "-Werror", "-x", "c++",
             f"-I{INCLUDE}", "-c"]
STATUS_FLAGS = ["-std=c11", "-Wall", "-Wextra", "-Werror", "-pthread", f"-I{INCLUDE}",
                f"-I{CORE}"]

GCC = shutil.which("gcc")
GXX = shutil.which("g++")
needs_gcc = pytest.mark.skipif(GCC is None, reason="gcc is not on PATH: the C tests need a C "
                               "compiler")
needs_gxx = pytest.mark.skipif(GXX is None, reason="g++ is not on PATH: the C++ header check "
                               "needs a C++ compiler")


def _run(cmd, **kwargs):
    """Runs cmd; on failure the assertion shows the command line and everything it printed."""
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300,
                          **kwargs)
    shown = " ".join(str(c) for c in cmd)
    assert proc.returncode == 0, (
        f"`{shown}` exited {proc.returncode}\n--- stdout ---\n{proc.stdout}\n"
        f"--- stderr ---\n{proc.stderr}")
    return proc


def test_header_test_includes_only_the_public_header():
    # The header check proves nothing if test_header.c pulls in what tequant.h forgot.
    includes = re.findall(r"^\s*#\s*include\s*(\S+)", HEADER_TEST.read_text(), re.MULTILINE)
    assert includes == ["<tequant/tequant.h>"], includes


@needs_gcc
def test_header_compiles_as_pedantic_c99(tmp_path):
    _run([GCC, *C99_FLAGS, HEADER_TEST, "-o", tmp_path / "test_header.o"])
    assert (tmp_path / "test_header.o").stat().st_size > 0


@needs_gcc
def test_c99_flags_really_reject_non_c99(tmp_path):
    # Negative control: the same flags must refuse a C11-only construct (an anonymous struct
    # member), or the check above would pass on a header that is not C99.
    bad = tmp_path / "not_c99.c"
    bad.write_text("#include <tequant/tequant.h>\n"
                   "struct tq_bad { struct { int a; }; tq_tensor t; };\n"
                   "int tq_bad_size(void);\n"
                   "int tq_bad_size(void) { return (int)sizeof(struct tq_bad); }\n")
    proc = subprocess.run([GCC, *C99_FLAGS, str(bad), "-o", str(tmp_path / "bad.o")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, "gcc -std=c99 -pedantic -Werror accepted an anonymous struct"
    assert "C99" in proc.stderr, proc.stderr


@needs_gxx
def test_header_compiles_as_cpp(tmp_path):
    _run([GXX, *CXX_FLAGS, HEADER_TEST, "-o", tmp_path / "test_header_cpp.o"])
    # extern "C": the API symbols the object refers to are not C++-mangled.
    nm = shutil.which("nm")
    if nm is not None:
        syms = _run([nm, "-u", tmp_path / "test_header_cpp.o"]).stdout
        assert re.search(r"\btq_tensor_check\b", syms), syms
        assert "_Z15tq_tensor_check" not in syms, syms


def _build_status(tmp_path, extra_flags=(), name="test_status"):
    exe = tmp_path / name
    _run([GCC, *STATUS_FLAGS, *extra_flags, STATUS_TEST, *CORE_SOURCES, "-lm", "-o", exe])
    return exe


def _check_status_output(proc):
    lines = proc.stdout.strip().splitlines()
    assert lines, f"test_status printed nothing\nstderr:\n{proc.stderr}"
    match = re.fullmatch(r"(\d+) passed, (\d+) failed", lines[-1])
    assert match, f"last line is not 'N passed, M failed':\n{proc.stdout}"
    n_passed, n_failed = int(match.group(1)), int(match.group(2))
    assert n_failed == 0, proc.stdout
    # A stub main() that checks nothing must not pass: the program has well over 100 checks.
    assert n_passed >= 100, proc.stdout
    assert not any(line.startswith("FAIL") for line in lines), proc.stdout


@needs_gcc
def test_status_program_passes(tmp_path):
    exe = _build_status(tmp_path)
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (
        f"test_status exited {proc.returncode}\n--- stdout ---\n{proc.stdout}\n"
        f"--- stderr ---\n{proc.stderr}")
    _check_status_output(proc)


@needs_gcc
def test_status_program_reports_failures_with_nonzero_exit(tmp_path):
    # The harness must be able to fail: against a core whose last error is a process-wide buffer
    # (not thread-local), the thread test fails and the program exits non-zero.
    src = (CORE / "status.c").read_text()
    assert "_Thread_local" in src, "status.c no longer uses _Thread_local; update this test"
    broken = tmp_path / "status_shared_buffer.c"
    broken.write_text(src.replace("_Thread_local", ""))
    sources = [broken if p.name == "status.c" else p for p in CORE_SOURCES]
    exe = tmp_path / "test_status_broken"
    _run([GCC, *STATUS_FLAGS, STATUS_TEST, *sources, "-lm", "-o", exe])
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, proc.stdout
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ passed, [1-9]\d* failed", last), proc.stdout
    assert "thread messages not separate" in proc.stdout, proc.stdout


def _sanitizers_work(tmp_path):
    probe = tmp_path / "probe.c"
    probe.write_text("int main(void) { return 0; }\n")
    proc = subprocess.run([GCC, "-fsanitize=address,undefined", str(probe), "-o",
                           str(tmp_path / "probe")], capture_output=True, text=True, timeout=120)
    return proc.returncode == 0


@needs_gcc
def test_status_program_under_asan_ubsan(tmp_path):
    if not _sanitizers_work(tmp_path):
        pytest.skip("gcc cannot link -fsanitize=address,undefined here (no libasan/libubsan)")
    exe = _build_status(tmp_path, ["-g", "-fsanitize=address,undefined",
                                   "-fno-sanitize-recover=all"], name="test_status_asan")
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300,
                          env={"ASAN_OPTIONS": "detect_leaks=1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, (
        f"test_status under ASan/UBSan exited {proc.returncode}\n--- stdout ---\n{proc.stdout}\n"
        f"--- stderr ---\n{proc.stderr}")
    _check_status_output(proc)


UPDATE_TEST = REPO / "tests" / "c" / "test_quantize_update.c"
ALL_CORE = sorted(CORE.glob("*.c")) + sorted((REPO / "csrc" / "ref").glob("*.c"))


def _run_update_program(tmp_path, sources, name):
    exe = tmp_path / name
    _run([GCC, *STATUS_FLAGS, "-ffp-contract=off", UPDATE_TEST, *sources, "-lm", "-o", exe])
    return subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)


@needs_gcc
def test_quantize_update_program_passes(tmp_path):
    """tq_quantize_args.update on the C references (the whole core, CPU-only): tests/c/
    test_quantize_update.c."""
    proc = _run_update_program(tmp_path, ALL_CORE, "test_quantize_update")
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    n_passed, n_failed = map(int, re.fullmatch(r"(\d+) passed, (\d+) failed",
                                               proc.stdout.strip().splitlines()[-1]).groups())
    assert n_failed == 0 and n_passed >= 150, proc.stdout


@needs_gcc
def test_quantize_update_program_fails_without_the_update(tmp_path):
    # Negative control: a core whose casts skip the update must fail the program.
    src = (CORE / "quantize.c").read_text()
    dropped = "return st != TQ_SUCCESS ? st : update_after(a, stream);"
    assert dropped in src, "quantize.c's tq_quantize_then_update changed; update this test"
    broken = tmp_path / "quantize.c"
    broken.write_text(src.replace(dropped, "(void)update_after; /* unused here */ return st;"))
    sources = [broken if p.name == "quantize.c" else p for p in ALL_CORE]
    proc = _run_update_program(tmp_path, sources, "test_quantize_update_broken")
    assert proc.returncode != 0, proc.stdout
    assert re.fullmatch(r"\d+ passed, [1-9]\d* failed", proc.stdout.strip().splitlines()[-1])
