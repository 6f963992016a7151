"""Builds ft_ops._C (the freetoken operator kernels) and installs ft_ops + freetoken_plugin.

CUDA sources are compiled only when the installed torch was built with CUDA and nvcc exists;
whether a GPU is visible does not matter (CI compiles the CUDA sources without one). Build without isolation so the
extension compiles against the torch already installed:
    pip install --no-build-isolation -e .
"""
import glob
import os
import shutil
import sys

from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))


def _nvcc_available() -> bool:
    if cpp_extension.CUDA_HOME and os.path.exists(os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")):
        return True
    return shutil.which("nvcc") is not None


def _want_cuda() -> bool:
    import torch

    if os.environ.get("FT_FORCE_CPU", "0") == "1":
        return False
    return torch.version.cuda is not None and _nvcc_available()


def _sources(pattern: str) -> list:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


# Link the C++ runtime dynamically, as torch does. A compiler that links libstdc++ statically
# (seen with the GPU image's /opt/gcc) puts a second copy of iostreams into _C; formatting an
# error message through that copy (TORCH_CHECK) then crashes the process.
LINK_ARGS = ["-fopenmp", "-l:libstdc++.so.6"] if sys.platform.startswith("linux") else ["-fopenmp"]


def _extension():
    sources = ["src/registration.cpp", "src/python_module.cpp"] + _sources("src/cpu/*.cpp")
    cxx_flags = ["-O3", "-fopenmp"]  # the C++ standard comes from torch's own flags
    if not _want_cuda():
        return cpp_extension.CppExtension(
            "ft_ops._C", sources, extra_compile_args={"cxx": cxx_flags}, extra_link_args=LINK_ARGS
        )
    # Hopper only (compute capability 9.0, which runs sm_90a code): a second sm_90 cubin would never
    # be loaded there and doubled the compile time of the largest sources.
    arch = os.environ.get("FT_CUDA_GENCODE", "-gencode=arch=compute_90a,code=sm_90a").split()
    nvcc_flags = ["-O3", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr"] + arch
    return cpp_extension.CUDAExtension(
        "ft_ops._C",
        sources + _sources("src/cuda/*.cu") + _sources("src/cuda/*.cpp"),
        extra_compile_args={"cxx": cxx_flags + ["-DFT_WITH_CUDA"], "nvcc": nvcc_flags},
        extra_link_args=LINK_ARGS,
    )


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
