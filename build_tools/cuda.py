"""Finds the CUDA toolchain for tequant's build: nvcc, the CUDA runtime and cuBLASLt.

Used by setup.py (to build cuda/*.cu and link cuBLASLt) and by the Makefile (to install the
nvidia-cublas wheel when the CUDA install lacks cuBLAS, as on CI). Not imported at run time.
Checked by every build: `make test` builds with CUDA wherever nvcc exists.

    python3 build_tools/cuda.py --missing-cublas   prints a pip requirement if cuBLAS is needed
                                                   but absent, nothing otherwise
    python3 build_tools/cuda.py                    prints what was found
"""
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys


def cuda_mode():
    """'auto', 'on' or 'off' from TEQUANT_CUDA (unset, 1, 0)."""
    value = os.environ.get("TEQUANT_CUDA", "").strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value in ("1", "on", "true"):
        return "on"
    if value in ("0", "off", "false"):
        return "off"
    raise SystemExit(f"TEQUANT_CUDA={value!r}: expected 0, 1 or unset")


def find_nvcc():
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def cuda_home(nvcc):
    """The toolkit root. nvcc may be a wrapper script, so ask nvcc itself (its TOP= line)."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home
    dry = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                         capture_output=True, text=True)
    match = re.search(r"^#\$ TOP=(.+)$", dry.stdout + dry.stderr, re.MULTILINE)
    if match:
        return os.path.realpath(match.group(1).strip())
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))


def nvcc_major(nvcc):
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"release (\d+)\.(\d+)", out)
    if not match:
        raise SystemExit(f"cannot read the CUDA version from `{nvcc} --version`:\n{out}")
    return int(match.group(1))


def _wheel_roots():
    """Folders of the pip 'nvidia' namespace package (nvidia-cublas and friends)."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or spec.submodule_search_locations is None:
        return []
    return list(spec.submodule_search_locations)


def find_cublaslt(home, major):
    """(include_dir, library_path) of cuBLASLt, or None. The toolkit first, then the wheel."""
    candidates = [(os.path.join(home, "include"), os.path.join(home, "lib64")),
                  (os.path.join(home, "targets", "x86_64-linux", "include"),
                   os.path.join(home, "targets", "x86_64-linux", "lib"))]
    for root in _wheel_roots():
        candidates.append((os.path.join(root, f"cu{major}", "include"),
                           os.path.join(root, f"cu{major}", "lib")))
        candidates.append((os.path.join(root, "cublas", "include"),
                           os.path.join(root, "cublas", "lib")))
    for include_dir, lib_dir in candidates:
        if not os.path.exists(os.path.join(include_dir, "cublasLt.h")):
            continue
        libs = sorted(glob.glob(os.path.join(lib_dir, f"libcublasLt.so.{major}*")))
        libs += sorted(glob.glob(os.path.join(lib_dir, "libcublasLt.so")))
        if libs:
            return include_dir, libs[0]
    return None


def cublas_requirement(major):
    return f"nvidia-cublas>={major},<{major + 1}" if major >= 13 else f"nvidia-cublas-cu{major}"


def main(argv):
    mode = cuda_mode()
    nvcc = find_nvcc() if mode != "off" else None
    if "--missing-cublas" in argv:
        if nvcc and find_cublaslt(cuda_home(nvcc), nvcc_major(nvcc)) is None:
            print(cublas_requirement(nvcc_major(nvcc)))
        return 0
    if not nvcc:
        print(f"TEQUANT_CUDA={mode}: no nvcc, CPU-only build")
        return 0
    home, major = cuda_home(nvcc), nvcc_major(nvcc)
    print(f"nvcc: {nvcc} (CUDA {major}), CUDA_HOME={home}, cuBLASLt: {find_cublaslt(home, major)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
