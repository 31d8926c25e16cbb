"""Fixtures of the engine tests."""
import pytest
import torch

import areal_tik.engine.model_runner as mr


@pytest.fixture
def graphs(monkeypatch):
    """Decode/prefill graphs on: real CUDA graphs on a GPU, emulated on a CPU (``EMULATE_GRAPHS_ON_CPU``: the
    warm-up before a capture runs for real, replay re-runs the forward on the static buffers)."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(mr, "EMULATE_GRAPHS_ON_CPU", True)
