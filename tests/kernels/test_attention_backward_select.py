"""CPU checks of the attention backward selector (kernels/attention_backward.py); its GPU paths are tested in
tests/kernels/test_cuda_attention_backward.py (both kernels against float64 autograd, selection, determinism)."""
import pytest
import torch

from areal_tik.kernels.attention import flash_backward as ab


def test_selector_on_cpu_tensors():
    q, k = torch.zeros(4, 8, 64, dtype=torch.bfloat16), torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    ok, why = ab.flash_backward_supported(q, k)
    assert not ok and "CUDA" in why
    assert ab.select_backward(q, k, "auto") == "triton"
    assert ab.select_backward(q, k, "triton") == "triton"
    with pytest.raises(RuntimeError, match="cannot run here: not a CUDA tensor"):
        ab.select_backward(q, k, "flash")
    with pytest.raises(ValueError, match="attention_backward"):
        ab.select_backward(q, k, "cudnn")
    assert ab.ATTN_BACKWARD in ab.BACKWARDS


def test_triton_backward_is_the_cpu_path(monkeypatch):
    """On CPU tensors the autograd backward goes to the Triton recompute whatever auto would prefer."""
    calls = []
    import areal_tik.kernels.attention.triton_backward as tb
    monkeypatch.setattr(tb, "varlen_backward", lambda *a: calls.append(len(a)) or (a[0], a[1], a[2]))
    q, k = torch.zeros(4, 8, 64), torch.zeros(4, 2, 64)
    out = ab.varlen_attention_backward(q, k, k, q, torch.zeros(4, 8), torch.tensor([0, 4]), 4, 0.125, 0.18, q)
    assert calls == [10] and out[0] is q


def test_describe_for_env():
    """`areal-tik env` reports the setting; without a GPU it says the selector is not used."""
    line = ab.describe()
    assert line.startswith(ab.ATTN_BACKWARD)
    if not torch.cuda.is_available():
        assert "no CUDA GPU" in line
    from areal_tik.cli import env as cli_env
    assert cli_env.collect()["attention_backward"] == line
