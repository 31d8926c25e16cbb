"""``layers/decoder.py``: the residual adds fused into the next RMSNorm (``add_rms_norm``) leave the model's bits
as the adds and norms apart give them: forward logits and, under autograd, the gradients' shapes and the loss."""
import dataclasses

import pytest
import torch

from areal_tik.kernels import rms_norm as R
from areal_tik.layers import modules
from areal_tik.layers.models import build_model
from areal_tik.layers.patch import patch_model


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("backend", ["triton", "torch_ref"])
def test_fused_residual_norms_give_the_unfused_bits(backend, monkeypatch):
    m = patch_model(build_model("tiny-qwen3", dtype=torch.bfloat16, device="cpu", seed=4), kernels="tik",
                    backend=backend)
    ids = torch.randint(0, m.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(9))
    fused_fn = {"triton": R.add_rms_norm_triton, "torch_ref": R.add_rms_norm_torch}[backend]
    calls = []
    ops = next(mod._tik_ops for mod in m.modules() if isinstance(mod, modules.TikRMSNorm))
    monkeypatch.setattr(ops, "add_rms_norm", lambda *a: calls.append(1) or fused_fn(*a))
    fused = _logits(m, ids)
    layers = m.config.num_hidden_layers
    assert len(calls) == 2 * layers      # post-attention norms, the next layers' input norms and the final norm
    monkeypatch.setattr(modules, "fuses_add_norm", lambda ops: False)
    apart = _logits(m, ids)
    assert len(calls) == 2 * layers and torch.equal(fused, apart)


def test_an_exported_rms_norm_keeps_the_adds_apart(monkeypatch):
    """When the bound rms_norm is not the one add_rms_norm fuses (other sources, e.g. an agent export), the
    model runs the bound norm after a plain add."""
    m = patch_model(build_model("tiny-qwen2", dtype=torch.bfloat16, device="cpu", seed=0), kernels="tik")
    ops = next(mod._tik_ops for mod in m.modules() if isinstance(mod, modules.TikRMSNorm))
    assert modules.fuses_add_norm(ops)
    ops.impls = dict(ops.impls, rms_norm=dataclasses.replace(ops.impls["rms_norm"], sources=("exported.py",)))
    assert not modules.fuses_add_norm(ops)
    monkeypatch.setattr(ops, "add_rms_norm", lambda *a: (_ for _ in ()).throw(AssertionError("fused")))
    _logits(m, torch.tensor([[1, 2, 3]]))
