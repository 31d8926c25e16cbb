"""Test setup shared by every test.

On a machine without a CUDA GPU, Triton kernels run in the CPU interpreter
(``TRITON_INTERPRET=1``, set here before anything imports triton) with the interpreter's
bf16 dot/sum fixed (``areal_tik.kernels._interpreter_fix``). Tests marked ``gpu`` are skipped
there and run on the device (``bench/gpu_check.sh``).
"""
import os

try:
    import torch
    _HAS_GPU = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_GPU = False

if not _HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] == "1":
        from areal_tik.kernels import _interpreter_fix
        _interpreter_fix.apply()

import pytest  # noqa: E402

HAS_GPU = _HAS_GPU


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run bench/gpu_check.sh on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return "cuda" if HAS_GPU else "cpu"


@pytest.fixture
def seed_rng(request):
    """A fresh, per-test but reproducible-on-failure random seed (printed on failure)."""
    import random
    seed = random.SystemRandom().randrange(2**31)
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    print(f"seed_rng: {seed}")  # captured; pytest shows it with the failure report
    return seed

