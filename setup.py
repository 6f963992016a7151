"""Builds ft_ops._C (the freetoken operator kernels) and installs ft_ops + freetoken_plugin.

CUDA sources are compiled only when the installed torch was built with CUDA and nvcc exists;
whether a GPU is visible does not matter (DESIGN.md, conventions). Build without isolation so the
extension compiles against the torch already installed:
    pip install --no-build-isolation -e .
"""
import glob
import os
import shutil

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


def _extension():
    sources = ["src/registration.cpp", "src/python_module.cpp"] + _sources("src/cpu/*.cpp")
    cxx_flags = ["-O3", "-fopenmp"]  # the C++ standard comes from torch's own flags
    if not _want_cuda():
        return cpp_extension.CppExtension(
            "ft_ops._C", sources, extra_compile_args={"cxx": cxx_flags}, extra_link_args=["-fopenmp"]
        )
    arch = os.environ.get(
        "FT_CUDA_GENCODE",
        "-gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_90,code=sm_90",
    ).split()
    nvcc_flags = ["-O3", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr"] + arch
    return cpp_extension.CUDAExtension(
        "ft_ops._C",
        sources + _sources("src/cuda/*.cu") + _sources("src/cuda/*.cpp"),
        extra_compile_args={"cxx": cxx_flags + ["-DFT_WITH_CUDA"], "nvcc": nvcc_flags},
        extra_link_args=["-fopenmp"],
    )


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
