"""bench/probes/probe_load_paths.py's CUDA source compiles for sm_90a (nvcc -c, torch's types stubbed: the CPU wheel has no
CUDA headers), so a device call is not spent finding a typo in a probe; its CLI refuses a machine without sm_90."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bench", "probes"))

_STUB = """#include <cstdint>
#include <cuda_runtime.h>
#define TORCH_CHECK(c, ...) do { if (!(c)) throw 1; } while (0)
namespace at { struct Tensor { int64_t size(int) const { return 1; } void* data_ptr() const { return nullptr; }
  template <typename T> T* data_ptr() const { return nullptr; } }; }
namespace c10 { namespace cuda { inline cudaStream_t getCurrentCUDAStream() { return 0; } } }
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (compile check)")
def test_probe_source_compiles_for_sm90a(tmp_path):
    import probe_load_paths as p
    src = p._SRC.replace("#include <torch/extension.h>\n", "").replace("#include <c10/cuda/CUDAStream.h>\n", "")
    assert src != p._SRC and "probe_tma" in src and all(f"mode == {m}" in src or f"({m}, " in src for m in (0, 6))
    cu = tmp_path / "probe.cu"
    cu.write_text(_STUB + src)
    r = subprocess.run(["nvcc", "-c", str(cu), "-o", str(tmp_path / "probe.o"), "-std=c++17", "-O3",
                        "-gencode=arch=compute_90a,code=sm_90a"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert set(p.MODES) == {"cpasync", "bulk256", "bulk16k", "cpasync_L2_128B", "cpasync_L2_256B", "cpasync_srcsize",
                            "tma_box"}


def test_probe_refuses_without_sm90(tmp_path):
    import torch
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0):
        pytest.skip("an sm_90 GPU is present")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "probes", "probe_load_paths.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "needs an sm_90 GPU" in r.stderr
