"""The tik actor's log-prob/entropy hook for AReaL's loss (no trainer needed: the method on a stub)."""
import pytest

pytest.importorskip("areal")


def test_tik_entropy_comes_from_the_log_prob_pass():
    """The tik actor's (log-prob, entropy) for AReaL's training loss: the log-probs are exactly
    ``ops.logprobs_from_logits`` with their autograd graph; the entropy (same pass, detached)
    equals -(p log p).sum of softmax(logits/T) to fp32 rounding."""
    import random
    import types

    import torch

    from areal_tik import ops
    from areal_tik.areal.actor import TikFSDPPPOActor
    g = torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))
    logits = (torch.randn(37, 300, generator=g) * 3).bfloat16().requires_grad_()
    labels = torch.randint(0, 300, (37,), generator=g)
    fake = types.SimpleNamespace(config=types.SimpleNamespace(temperature=0.7))
    lp, ent = TikFSDPPPOActor._tik_logprobs(fake, logits, labels, entropy=True)
    assert torch.equal(lp.detach(), ops.logprobs_from_logits(logits.detach(), labels, 0.7))
    assert lp.grad_fn is not None and ent.grad_fn is None
    logp = torch.log_softmax(logits.detach().double() / 0.7, -1)
    want = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(ent.double(), want, rtol=1e-5, atol=1e-5)
    lp.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad.float()).all()
