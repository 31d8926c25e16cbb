"""Install areal-tik.

The pure-Python package installs everywhere. When a CUDA toolkit (nvcc) and a CUDA
build of torch are both present, the CUDA extension ``areal_tik.kernels.cuda._C`` is built from
``csrc/`` too (sm_80 and sm_90a); otherwise the build is skipped with a message and
``areal-tik env`` reports the cuda backend as unavailable (it can still be built just
in time from the sources on a GPU machine).
"""
import glob
import os
import shutil
import sys

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def cuda_extension():
    if os.environ.get("AREAL_TIK_SKIP_CUDA_BUILD"):
        print("areal-tik: AREAL_TIK_SKIP_CUDA_BUILD set, not building the CUDA extension", file=sys.stderr)
        return [], {}
    srcs = sorted(glob.glob(os.path.join("csrc", "*.cu")) + glob.glob(os.path.join("csrc", "*.cpp")))
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CUDAExtension
    except ImportError:
        print("areal-tik: torch not importable at build time; skipping the CUDA extension", file=sys.stderr)
        return [], {}
    why = None
    if not srcs:
        why = "no sources in csrc/"
    elif torch.version.cuda is None:
        why = f"torch {torch.__version__} is a CPU build"
    elif shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        why = "no CUDA toolkit (nvcc) found"
    if why:
        print(f"areal-tik: skipping the CUDA extension: {why}", file=sys.stderr)
        return [], {}
    gencode = ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a"]
    ext = CUDAExtension("areal_tik.kernels.cuda._C", srcs, extra_compile_args={"cxx": ["-O3"],
                                                                   "nvcc": ["-O3", "-std=c++17", *gencode]})
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = cuda_extension()

setup(
    name="areal-tik",
    version="0.1.0",
    description="Unified rollout/training kernels for AReaL: bitwise-equal log-probs, recompute skipped",
    long_description=open(os.path.join(HERE, "README.md")).read() if os.path.exists(os.path.join(HERE, "README.md")) else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["areal_tik", "areal_tik.*"]),
    package_data={"areal_tik": ["data/*", "data/**/*", "recipes/*.yaml", "kernels/**/*.json"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        "triton>=3.3",
        "numpy",
        "transformers>=4.50",
        "rich",
        "tqdm",
        "matplotlib",
    ],
    extras_require={
        "test": ["pytest", "hypothesis"],
        # rollout on vLLM with the tik kernels (areal_tik/vllm_plugin): the plugin is written for 0.24.0
        "vllm": ["vllm==0.24.0"],
    },
    entry_points={
        "console_scripts": ["areal-tik=areal_tik.cli:main"],
        # loaded by vLLM in each of its processes; registers the tik models and attention backend
        "vllm.general_plugins": ["areal_tik = areal_tik.vllm_plugin.register:register"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
