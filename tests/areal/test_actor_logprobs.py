"""The tik actor's log-prob/entropy hook for AReaL's loss (no trainer needed: the method on a stub)."""
import pytest

pytest.importorskip("areal.api")  # "areal" alone would find tests/areal itself (a namespace package)


def test_tik_entropy_comes_from_the_log_prob_pass():
    """The tik actor's (log-prob, entropy) for AReaL's training loss: the log-probs are exactly
    ``logprobs_from_logits`` of the bound ops with their autograd graph; the entropy (same pass, detached)
    equals -(p log p).sum of softmax(logits/T) to fp32 rounding."""
    import random
    import types

    import torch

    from areal_tik.areal.actor import TikFSDPPPOActor
    from areal_tik.dispatch import ops
    from areal_tik.dispatch.bound import bind
    g = torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))
    logits = (torch.randn(37, 300, generator=g) * 3).bfloat16().requires_grad_()
    labels = torch.randint(0, 300, (37,), generator=g)
    fake = types.SimpleNamespace(config=types.SimpleNamespace(temperature=0.7), tik_ops=bind())
    lp, ent = TikFSDPPPOActor._tik_logprobs(fake, logits, labels, entropy=True)
    assert torch.equal(lp.detach(), ops.logprobs_from_logits(logits.detach(), labels, 0.7))
    assert lp.grad_fn is not None and ent.grad_fn is None
    logp = torch.log_softmax(logits.detach().double() / 0.7, -1)
    want = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(ent.double(), want, rtol=1e-5, atol=1e-5)
    lp.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad.float()).all()


def test_digest_started_with_the_rollout_is_the_weights_digest(monkeypatch):
    """The rollout phase (``prepare_batch``) starts a background digest of the weights; the skip
    decision's ``own_digest`` returns exactly the synchronous digest of that version's weights,
    and a later version's digest follows changed weights."""
    import types

    import torch
    from areal.engine.fsdp_engine import FSDPPPOActor

    from areal_tik.areal.actor import TikFSDPPPOActor
    from areal_tik.layers.patch import patch_model
    from areal_tik.layers.weights_digest import model_digest
    from areal_tik.layers.models import build_model
    monkeypatch.setattr(FSDPPPOActor, "prepare_batch", lambda self, *a, **k: "batch")
    model = patch_model(build_model("tiny-qwen2", device="cpu", seed=3))
    actor = object.__new__(TikFSDPPPOActor)
    actor.model, actor.kernels, actor._digest_cache = model, "tik", None
    actor.config = types.SimpleNamespace(dtype="bfloat16")
    actor.set_version(1)
    assert getattr(actor, "_digest_pending", None) is None  # not at set_version (the stats commit follows it)
    assert actor.prepare_batch("loader") == "batch" and actor._digest_pending[0] == 1
    d1 = actor.own_digest()
    assert d1 == model_digest(model, dtype=torch.bfloat16) and actor._digest_pending is None
    actor._start_background_digest()
    assert actor._digest_pending is None  # this version's digest is known: nothing started
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    actor.set_version(2)
    actor.prepare_batch("loader")
    d2 = actor.own_digest()
    assert d2 == model_digest(model, dtype=torch.bfloat16) and d2 != d1
    actor._version = 3  # no rollout phase ran for this version: digested on the spot
    assert actor.own_digest() == d2


def test_actor_precompiles_its_compute_dtype_and_skips_unsafe_background_digests(monkeypatch):
    """The actor precompiles in ``config.dtype`` (not the fp32 masters' dtype); no background
    digest while the weights are offloaded; ``destroy`` ends the digest thread first."""
    import types

    import torch
    from areal.engine.fsdp_engine import FSDPPPOActor

    import areal_tik.layers.precompile as pc
    from areal_tik.areal.actor import TikFSDPPPOActor
    from areal_tik.areal.device_model import precompile_model
    seen = {}
    monkeypatch.setattr(pc, "precompile_linears", lambda model, **kw: seen.update(kw))
    actor = object.__new__(TikFSDPPPOActor)
    actor.model, actor.kernels, actor._digest_cache = torch.nn.Linear(2, 2), "tik", None
    actor.config = types.SimpleNamespace(dtype="bfloat16", mb_spec=types.SimpleNamespace(max_tokens_per_mb=4096))
    precompile_model(actor.model, actor.config, enabled=True)
    assert seen == {"max_tokens": 4096, "min_tokens": 64, "dtype": torch.bfloat16, "enabled": True}
    actor._version, actor.is_offload = 1, True
    actor._start_background_digest()
    assert getattr(actor, "_digest_pending", None) is None
    actor.is_offload = False
    actor._start_background_digest()
    assert actor._digest_pending[0] == 1
    monkeypatch.setattr(FSDPPPOActor, "destroy", lambda self: "destroyed")
    assert actor.destroy() == "destroyed" and actor._digest_pool is None and actor._digest_pending is None


def test_profiled_step_only_where_its_table_is_written(monkeypatch, tmp_path):
    """actor.tik.profile_step arms the profiler only in the process that writes the step log
    (rank 0 with --step-log): elsewhere nothing would ever stop it."""
    import types

    from areal.trainer.rl_trainer import PPOTrainer

    from areal_tik.areal.config import TikConfig
    from areal_tik.areal.trainer import TikPPOTrainer
    monkeypatch.setattr(PPOTrainer, "__init__", lambda self, *a, **k: None)
    cfg = types.SimpleNamespace(actor=types.SimpleNamespace(kernel_backend="tik", tik=TikConfig(profile_step=0)))
    monkeypatch.setenv("RANK", "0")
    assert TikPPOTrainer(cfg, step_log=None)._profile_step is None
    assert TikPPOTrainer(cfg, step_log=str(tmp_path / "s.jsonl"))._profile_step == 0
    monkeypatch.setenv("RANK", "1")
    assert TikPPOTrainer(cfg, step_log=str(tmp_path / "s.jsonl"))._profile_step is None
