"""actor.kernel_backend and actor.tik load through AReaL's own load_expr_config and fail at load time."""
import os

import pytest

from areal_tik.settings import Settings

pytest.importorskip("areal.api")  # "areal" alone would find tests/areal itself (a namespace package)

from areal_tik.areal.config import ConfigError, TikGRPOConfig, TikPPOActorConfig  # noqa: E402
from areal_tik.areal.train import load_config  # noqa: E402

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
    ("actor.tik.weight_transfer=nfs", "actor.tik.weight_transfer"),
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
    (["actor.weight_update_mode=awex"], "actor.weight_update_mode"),
    (["+gconfig.frequency_penalty=0.5"], "gconfig.frequency_penalty"),
])
def test_tik_inconsistencies_fail_at_load(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _load("actor.kernel_backend=tik", *overrides)
    _load("actor.kernel_backend=default", *overrides)  # AReaL as is: accepted


@pytest.mark.parametrize("kernels", ["tik", "default"])
def test_ipc_weight_transfer_needs_disk_mode_and_the_tik_server(kernels):
    """The shared buffer replaces the disk update's checkpoint; the areal-tik server and vLLM with the tik plugin
    read it, stock vLLM does not."""
    c = _load(f"actor.kernel_backend={kernels}", "actor.tik.weight_transfer=ipc", "actor.weight_update_mode=disk")
    assert c.actor.tik.weight_transfer == "ipc"
    with pytest.raises(ConfigError, match=r"actor\.tik\.weight_transfer=ipc .*weight_update_mode=disk"):
        _load(f"actor.kernel_backend={kernels}", "actor.tik.weight_transfer=ipc", "actor.weight_update_mode=xccl")
    vllm = (f"actor.kernel_backend={kernels}", "actor.tik.weight_transfer=ipc", "+actor.tik.rollout_engine=vllm",
            "rollout.backend=vllm:d1p1t1")
    if kernels == "tik":                 # vLLM with the tik plugin: its worker extension loads the buffer
        assert _load(*vllm).actor.tik.weight_transfer == "ipc"
    else:                                # stock vLLM has no such route
        with pytest.raises(ConfigError, match=r"loads the trainer's shared buffer"):
            _load(*vllm)


def test_server_settings_from_the_recipe():
    """The rollout server is sized from AReaL's own keys: sglang.context_length and
    sglang.max_running_requests, else rollout.max_concurrent_rollouts (AReaL sends a whole RL
    batch at once); the flags reach the server command line."""
    from areal_tik.areal.rollout import serve_cmd, server_args, server_settings
    grpo = os.path.join(os.path.dirname(RECIPE), "grpo_qwen2.5-1.5b_gsm8k.yaml")
    c = load_config(["--config", grpo, "stats_logger.fileroot=/tmp/areal_tik/test_cfg"])
    assert server_settings(c) == {"context_length": 2048, "max_running_requests": 256, "disable_cuda_graph": False,
                                  "cuda_graph_max_bs": None, "disable_overlap_schedule": False}
    cmd = serve_cmd({**server_args("/m", Settings(kernels="tik"), **server_settings(c)), "port": 1})
    assert "--disable-cuda-graph" not in cmd and "--cuda-graph-max-bs" not in cmd
    assert "--disable-overlap-schedule" not in cmd
    c = load_config(["--config", grpo, "stats_logger.fileroot=/tmp/areal_tik/test_cfg", "sglang.context_length=768",
                     "+sglang.max_running_requests=96", "+sglang.disable_cuda_graph=true", "+sglang.cuda_graph_max_bs=32",
                     "+sglang.disable_overlap_schedule=true"])
    assert server_settings(c) == {"context_length": 768, "max_running_requests": 96, "disable_cuda_graph": True,
                                  "cuda_graph_max_bs": 32, "disable_overlap_schedule": True}
    cmd = serve_cmd({**server_args("/m", Settings(kernels="tik"), **server_settings(c)), "port": 1})
    assert cmd[cmd.index("--context-length") + 1] == "768" and cmd[cmd.index("--max-running-requests") + 1] == "96"
    assert "--disable-cuda-graph" in cmd and cmd[cmd.index("--cuda-graph-max-bs") + 1] == "32"
    assert "--disable-overlap-schedule" in cmd


def test_server_cli_flags_size_the_engine():
    import argparse

    from areal_tik.cli import serve as cli_serve
    from areal_tik.engine.server import ServerConfig, build
    sub = argparse.ArgumentParser().add_subparsers()
    args = cli_serve.add_parser(sub).parse_args(["--model", "tiny-qwen2", "--max-running-requests", "7",
                                                 "--context-length", "100", "--mem-fraction", "0.25",
                                                 "--cuda-graph-max-bs", "4", "--prefill-graph-max-tokens", "512"])
    assert (args.max_running_requests, args.context_length, args.mem_fraction) == (7, 100, 0.25)
    assert (args.disable_cuda_graph, args.cuda_graph_max_bs, args.prefill_graph_max_tokens) == (False, 4, 512)
    server = build(ServerConfig(model="tiny-qwen2", max_running_requests=7, context_length=100, cuda_graph_max_bs=4,
                                prefill_graph_max_tokens=512), device="cpu")
    eng = server.worker.engine
    assert eng.config.max_num_seqs == 7 and eng.max_model_len == 100
    assert (eng.config.cuda_graph_max_bs, eng.config.prefill_graph_max_tokens, eng.config.enforce_eager) == (4, 512, False)
    eager = build(ServerConfig(model="tiny-qwen2", max_running_requests=2, disable_cuda_graph=True), device="cpu")
    from areal_tik.engine import EngineConfig
    assert eager.worker.engine.config.enforce_eager
    assert eager.worker.engine.config.prefill_graph_max_tokens == EngineConfig.prefill_graph_max_tokens
    assert ServerConfig(model="m").max_running_requests == 256   # a whole RL batch, not waves of 64


def test_xccl_layout_check(monkeypatch):
    """xccl on CUDA is NCCL: the rollout server may not share the trainer's GPU (cuda:0)."""
    import torch

    from areal_tik.areal.train import check_xccl_layout
    check_xccl_layout("disk", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for dev in (None, "cuda", "cuda:0"):
        with pytest.raises(SystemExit, match="actor.tik.server_device=cuda:1"):
            check_xccl_layout("xccl", dev)
    check_xccl_layout("xccl", "cuda:1")
    check_xccl_layout("disk", "cuda:0")
    with pytest.raises(SystemExit, match="only 2 GPU"):
        check_xccl_layout("xccl", "cuda:2")
    with pytest.raises(SystemExit, match="must be on a GPU"):
        check_xccl_layout("xccl", "cpu")


def test_critic_takes_the_actors_settings():
    """A critic without its own ``tik`` section gets the actor's, so the critic, built in the same
    trainer process after the actor, applies the same process settings (attention backward)."""
    from areal_tik.areal.device_model import settings_of
    ppo = os.path.join(os.path.dirname(RECIPE), "tiny_ppo.yaml")
    c = load_config(["--config", ppo, "actor.kernel_backend=tik", "actor.tik.attention_backward=triton"])
    assert c.critic.tik is c.actor.tik
    assert settings_of(c.critic, c.critic.kernel_backend) == settings_of(c.actor, "tik")
    assert settings_of(c.critic, "tik").attention_backward == "triton"


def test_actor_tik_backend_wins_over_the_environment(monkeypatch):
    """What the docs state: ``actor.tik.backend``, when set, is the backend; ``AREAL_TIK_BACKEND`` fills it only
    when the key is null."""
    from areal_tik.settings import BACKEND_ENV
    monkeypatch.setenv(BACKEND_ENV, "torch_ref")
    assert _load("actor.kernel_backend=tik", "actor.tik.backend=triton").actor.tik.settings("tik").backend == "triton"
    assert _load("actor.kernel_backend=tik").actor.tik.settings("tik").backend == "torch_ref"
    monkeypatch.delenv(BACKEND_ENV)
    assert _load("actor.kernel_backend=tik").actor.tik.settings("tik").backend is None


@pytest.mark.parametrize("recipe", sorted(f for f in os.listdir(os.path.dirname(RECIPE)) if f.endswith(".yaml")))
def test_every_recipe_works_in_a_folder_of_its_own(recipe):
    """Each recipe's fileroot is this run's own folder (``${tik_run_dir:}``) and its name_resolve records sit
    under it, so two runs of one experiment and trial at once never read or clear each other's records."""
    from areal_tik.areal.train import run_dir
    c = load_config(["--config", os.path.join(os.path.dirname(RECIPE), recipe)])
    assert c.cluster.fileroot == run_dir(), c.cluster.fileroot
    assert c.cluster.name_resolve.nfs_record_root == os.path.join(run_dir(), "name_resolve")
    assert c.stats_logger.fileroot == run_dir()
