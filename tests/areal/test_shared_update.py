"""The trainer's side of ``actor.tik.weight_transfer: ipc`` (``areal/shared_update.py`` and the actor's disk-update
override) against a real areal-tik server (tiny-qwen2, CPU, in this process): the update pauses generation, the
server loads the trainer's weights cast to the compute dtype (its weights digest equals the trainer's
``model_digest``: what the skip rule compares), generation resumes also when a server refuses, and a refusal is
one line naming the server. The end-to-end run through AReaL's trainer is tests/areal/test_trainer_ab.py."""
from __future__ import annotations

import os
import sys
import types

import pytest
import torch

pytest.importorskip("areal.api")

from areal_tik.areal.actor import TikFSDPPPOActor  # noqa: E402
from areal_tik.areal.shared_update import SharedUpdate, SharedUpdateError, local_weights  # noqa: E402
from areal_tik.engine.server import ServerConfig, build  # noqa: E402
from areal_tik.layers.models import build_model  # noqa: E402
from areal_tik.layers.weights_digest import model_digest  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engine"))
from http_helpers import free_port, info, serving  # noqa: E402


@pytest.fixture(scope="module")
def addr():
    cfg = ServerConfig(model="tiny-qwen2", kernels="tik", port=free_port(), max_running_requests=4,
                       context_length=64, precompile=False)
    server = build(cfg, device="cpu")
    with serving(server) as a:
        yield a


def _trainer_model(seed):
    """tiny-qwen2 with fp32 master weights (as AReaL's trainer keeps them), moved off the served weights."""
    m = build_model("tiny-qwen2", dtype=torch.float32, seed=0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-2)
    return m


def _actor(model, addresses, events):
    re = types.SimpleNamespace(pause_generation=lambda: events.append("pause"),
                               continue_generation=lambda: events.append("continue"))
    return types.SimpleNamespace(tik_cfg=types.SimpleNamespace(weight_transfer="ipc", server_timeout=30.0),
                                 _shared_update=None, _compute_dtype=lambda: torch.bfloat16, rollout_engine=re,
                                 model=model, server_addresses=lambda: addresses)


def test_the_server_gets_the_trainers_weights_in_the_compute_dtype(addr):
    events = []
    actor = _actor(None, [addr], events)
    for seed in (1, 2):                      # the second update refills the same buffer
        model = actor.model = _trainer_model(seed)
        v0 = info(addr)["weight_version"]
        TikFSDPPPOActor._update_weights_from_disk(actor, meta=None)
        i = info(addr)
        assert i["weight_version"] == v0 + 1
        assert i["weights_digest"] == model_digest(model, dtype=torch.bfloat16), seed
    assert events == ["pause", "continue"] * 2
    other = _trainer_model(3)
    assert info(addr)["weights_digest"] != model_digest(other, dtype=torch.bfloat16)   # negative control


def test_generation_resumes_when_a_server_refuses(addr):
    events = []
    actor = _actor(_trainer_model(4), [f"127.0.0.1:{free_port()}"], events)    # nobody listens there
    with pytest.raises(SharedUpdateError, match="update_weights_from_ipc"):
        TikFSDPPPOActor._update_weights_from_disk(actor, meta=None)
    assert events == ["pause", "continue"]


def test_a_bigger_world_or_no_server_is_refused_in_one_line():
    m = _trainer_model(5)
    with pytest.raises(SharedUpdateError, match="world of one"):
        local_weights(m, world_size=2)
    with pytest.raises(SharedUpdateError, match="no rollout server"):
        SharedUpdate(torch.bfloat16).send(m, [])


def test_the_disk_path_stays_areals_without_ipc(monkeypatch):
    calls = []
    owner = next(k for k in TikFSDPPPOActor.__mro__[1:] if "_update_weights_from_disk" in vars(k))
    monkeypatch.setattr(owner, "_update_weights_from_disk", lambda self, meta: calls.append(meta))
    actor = object.__new__(TikFSDPPPOActor)          # no engine built: only the attribute the override reads
    actor.tik_cfg = types.SimpleNamespace(weight_transfer="areal")
    actor._update_weights_from_disk(meta="m")
    assert calls == ["m"]
