"""actor.kernel_backend and actor.tik load through AReaL's own load_expr_config and fail at load time."""
import os

import pytest

pytest.importorskip("areal")

from areal_tik.areal.config import ConfigError, TikGRPOConfig, TikPPOActorConfig  # noqa: E402
from areal_tik.train import load_config  # noqa: E402

RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "tiny.yaml")
pytestmark = pytest.mark.areal


def _load(*overrides):
    return load_config(["--config", RECIPE, "stats_logger.fileroot=/tmp/areal_tik/test_cfg", *overrides])


def test_default_and_tik_load():
    c = _load()
    assert isinstance(c, TikGRPOConfig) and isinstance(c.actor, TikPPOActorConfig)
    assert c.actor.kernel_backend == "default"
    c = _load("actor.kernel_backend=tik", "actor.tik.audit_interval=5", "actor.tik.mismatch_policy=raise")
    assert c.actor.kernel_backend == "tik"
    assert c.actor.tik.audit_interval == 5 and c.actor.tik.mismatch_policy == "raise"
    assert c.tokenizer_path.endswith("tiny_tokenizer")


@pytest.mark.parametrize("override,key", [
    ("actor.kernel_backend=fast", "actor.kernel_backend"),
    ("actor.tik.mismatch_policy=ignore", "actor.tik.mismatch_policy"),
    ("actor.tik.audit_interval=-1", "actor.tik.audit_interval"),
])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(Exception) as ei:
        _load(override)
    assert key in str(ei.value) or key.split(".")[-1] in str(ei.value)


def test_unknown_key_fails():
    with pytest.raises(Exception) as ei:
        _load("actor.kernel_backnd=tik")
    assert "kernel_backnd" in str(ei.value)


@pytest.mark.parametrize("overrides,key", [
    (["actor.temperature=0.7"], "actor.temperature"),
    (["gconfig.greedy=true"], "gconfig.greedy"),
    (["actor.weight_update_mode=xccl"], "actor.weight_update_mode"),
    (["+gconfig.frequency_penalty=0.5"], "gconfig.frequency_penalty"),
])
def test_tik_inconsistencies_fail_at_load(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _load("actor.kernel_backend=tik", *overrides)
    _load("actor.kernel_backend=default", *overrides)  # AReaL as is: accepted
