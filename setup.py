"""Builds tequant: the pure-Python package in python/tequant and the C extension tequant._C.

_C is compiled from csrc/ (C11, gcc, -Wall -Wextra -Werror, hidden visibility) and, when nvcc is
found (or TEQUANT_CUDA=1), from cuda/*.cu with nvcc for sm_90a plus compute_90 PTX, linked with
the static CUDA runtime and cuBLASLt. TEQUANT_CUDA=0 forces a CPU-only build. The extension
does not link libtorch or libpython-specific C++: it talks to torch through DLPack.
Tested by `make test` (tests/test_build.py checks that a machine with nvcc got a CUDA build).
"""
import concurrent.futures
import glob
import os
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "build_tools"))
import cuda as cuda_tools  # noqa: E402  (build_tools/cuda.py)

C_SOURCES = sorted(glob.glob("csrc/core/*.c") + glob.glob("csrc/ref/*.c") +
                   glob.glob("csrc/ext/*.c"))
CU_SOURCES = sorted(glob.glob("cuda/*.cu"))
C_FLAGS = ["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden",
           "-Wno-missing-field-initializers",
           # Quantization must round exactly like the CUDA kernels: no fused multiply-add.
           "-ffp-contract=off"]
# -fmad=false: a fused multiply-add rounds once where the C reference rounds twice, and
# quantized bits must equal the reference's (NUMERICS.md). Never --use_fast_math.
NVCC_FLAGS = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-fmad=false", "-Xcompiler",
              "-fPIC,-fvisibility=hidden,-Wall,-Wextra,-Werror",
              "-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_90,code=compute_90"]


def cuda_config():
    """None for a CPU-only build, else a dict of nvcc, include dirs and link arguments."""
    mode = cuda_tools.cuda_mode()
    if mode == "off":
        return None
    nvcc = cuda_tools.find_nvcc()
    if nvcc is None:
        if mode == "on":
            raise SystemExit("TEQUANT_CUDA=1 but nvcc was not found (set CUDA_HOME or PATH)")
        print("tequant: nvcc not found, building the CPU-only extension", file=sys.stderr)
        return None
    home, major = cuda_tools.cuda_home(nvcc), cuda_tools.nvcc_major(nvcc)
    found = cuda_tools.find_cublaslt(home, major)
    if found is None:
        raise SystemExit(
            f"nvcc (CUDA {major}) was found but cuBLASLt headers/libraries were not, neither in "
            f"{home} nor in an installed nvidia-cublas wheel. Install it with `python3 -m pip "
            f"install '{cuda_tools.cublas_requirement(major)}'` (make test does this), or build "
            f"CPU-only with TEQUANT_CUDA=0.")
    cublas_include, cublaslt_lib = found
    cuda_include = os.path.join(home, "include")
    cudart_static = None
    for lib_dir in (os.path.join(home, "lib64"), os.path.join(home, "targets", "x86_64-linux", "lib")):
        if os.path.exists(os.path.join(lib_dir, "libcudart_static.a")):
            cudart_static = os.path.join(lib_dir, "libcudart_static.a")
            break
    if cudart_static is None:
        raise SystemExit(f"libcudart_static.a not found under {home}")
    lib_dir = os.path.dirname(cublaslt_lib)
    link = [cudart_static, cublaslt_lib, "-ldl", "-lpthread", "-lrt", "-lstdc++",
            f"-Wl,-rpath,{lib_dir}",
            # When installed as a wheel beside nvidia-cublas in site-packages.
            f"-Wl,-rpath,$ORIGIN/../nvidia/cu{major}/lib"]
    return {"nvcc": nvcc, "include_dirs": [cuda_include, cublas_include], "link": link}


class BuildExt(build_ext):
    """Compiles cuda/*.cu with nvcc into objects that join the C extension's link."""

    cuda = None  # set below from cuda_config()

    def build_extension(self, ext):
        cfg = self.cuda
        if cfg is not None and CU_SOURCES:
            obj_dir = os.path.join(self.build_temp, "cuda")
            os.makedirs(obj_dir, exist_ok=True)
            includes = [f"-I{d}" for d in ["csrc/include", "csrc/core"] + cfg["include_dirs"]]
            headers = (glob.glob("csrc/include/tequant/*.h") + glob.glob("csrc/core/*.h")
                       + glob.glob("cuda/*.cuh"))
            newest_header = max((os.path.getmtime(h) for h in headers), default=0.0)
            jobs = []
            for src in CU_SOURCES:
                obj = os.path.join(obj_dir, os.path.basename(src) + ".o")
                ext.extra_objects.append(obj)
                # Rebuild only what changed: nvcc is slow and the kernels are independent.
                if (os.path.exists(obj) and os.path.getmtime(obj) > os.path.getmtime(src)
                        and os.path.getmtime(obj) > newest_header):
                    continue
                jobs.append([cfg["nvcc"], "-c", src, "-o", obj, "-DTQ_WITH_CUDA"] + includes
                            + NVCC_FLAGS)
            with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
                results = list(pool.map(
                    lambda cmd: subprocess.run(cmd, capture_output=True, text=True), jobs))
            for cmd, res in zip(jobs, results):
                print(" ".join(cmd))
                sys.stdout.write(res.stdout)
                sys.stderr.write(res.stderr)
            failed = [cmd[2] for cmd, res in zip(jobs, results) if res.returncode != 0]
            if failed:
                raise SystemExit(f"nvcc failed on {', '.join(failed)}")
        super().build_extension(ext)


def make_extension(cfg):
    include_dirs = ["csrc/include", "csrc/core"]
    macros, link = [], []
    if cfg is not None:
        include_dirs += cfg["include_dirs"]
        macros.append(("TQ_WITH_CUDA", "1"))
        link = cfg["link"]
    # depends: a changed kernel or header must relink _C even when no .c file changed.
    depends = (CU_SOURCES + glob.glob("cuda/*.cuh") + glob.glob("csrc/include/tequant/*.h")
               + glob.glob("csrc/*/*.h"))
    return Extension("tequant._C", sources=C_SOURCES, include_dirs=include_dirs,
                     define_macros=macros, extra_compile_args=C_FLAGS, extra_link_args=link,
                     depends=depends)


BuildExt.cuda = cuda_config()
setup(ext_modules=[make_extension(BuildExt.cuda)], cmdclass={"build_ext": BuildExt})
