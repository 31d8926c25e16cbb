"""The ``vllm`` rollout engine (``areal_tik.areal.engines``): AReaL's vLLM server (``rollout.backend: vllm:...``)
started as :mod:`areal_tik.areal.vllm_server`.

Two kinds of server, one command line each, both built from AReaL's own ``vLLMConfig.build_args``
(the ``vllm.*`` keys of the experiment config, tensor/pipeline sizes from the rollout allocation):

- **stock** (``actor.kernel_backend=default``): exactly AReaL's arguments, AReaL's worker extension;
- **tik** (``actor.kernel_backend=tik``): the same plus the tik plugin's engine arguments
  (``vllm_plugin.llm_kwargs(model_type)``: the tik architecture in ``hf_overrides``, the CUSTOM
  attention backend, 64-token pages, the compilation config) as vLLM CLI flags, and the tik worker
  extension, which reports the facts the skip rule checks.

Only the module changes (ours runs AReaL's server after aliasing what vLLM 0.24 moved).
:class:`TikVLLMBackend` / :class:`TikRemotevLLMEngine` are AReaL's vLLM client whose
``launch_server`` starts that module (AReaL's single-controller mode); :func:`launch_local_vllm_server`
starts it for the SPMD entry point. :func:`server_args_for`, :func:`launch_for` and :func:`check_tik_config` are
the engine's registry hooks (from an experiment config).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from areal.api import ModelAllocation
from areal.api.cli_args import InferenceEngineConfig, get_py_cmd, vLLMConfig
from areal.engine.vllm_remote import RemotevLLMEngine, VLLMBackend
from areal.infra import RemoteInfEngine
from areal.utils.network import find_free_ports

from areal_tik.areal.config import ConfigError
from areal_tik.areal.ports import private_port_draws
from areal_tik.areal.rollout import wait_healthy
from areal_tik.areal.vllm_info import TIK_WORKER_EXTENSION
from areal_tik.settings import BACKEND_ENV, Settings
from areal_tik.vllm_plugin import llm_kwargs

__all__ = ["SERVER_MODULE", "ENV_KEY", "model_type_of", "tik_engine_args", "vllm_server_args", "vllm_cmd",
           "server_env", "TikVLLMBackend", "TikRemotevLLMEngine", "launch_local_vllm_server", "server_args_for",
           "launch_for", "check_tik_config"]

SERVER_MODULE = "areal_tik.areal.vllm_server"
ENV_KEY = "areal_tik_env"   # server_args entry holding the server's environment additions (never a flag)


def model_type_of(model_path: str) -> str:
    """``model_type`` of an HF checkpoint directory (what picks the tik architecture)."""
    cfg = os.path.join(model_path, "config.json")
    try:
        with open(cfg) as f:
            return json.load(f)["model_type"]
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot read model_type from {cfg} ({type(e).__name__}: {e}); the tik vLLM server "
                         f"needs an HF checkpoint directory") from None


def tik_engine_args(model_type: str) -> dict[str, Any]:
    """``vllm_plugin.llm_kwargs(model_type)`` under vLLM's CLI names (dicts as JSON), plus the tik worker
    extension."""
    out: dict[str, Any] = {k: json.dumps(v, sort_keys=True) if isinstance(v, dict) else v
                           for k, v in llm_kwargs(model_type).items()}
    out["worker_extension_cls"] = TIK_WORKER_EXTENSION
    return out


def vllm_server_args(vllm_config, settings: Settings, tp_size: int = 1, pp_size: int = 1,
                     host: str | None = None, port: int | None = None,
                     pythonpath: str | None = None) -> dict[str, Any]:
    """The dict AReaL's ``launch_server`` receives (host and port added by AReaL when not given here):
    ``vLLMConfig.build_args`` unchanged for ``settings.kernels == "default"``; with ``tik`` also
    :func:`tik_engine_args` and, under :data:`ENV_KEY`, ``AREAL_TIK_BACKEND`` for the vLLM workers
    (they bind their ops from it). ``pythonpath`` (``actor.tik.server_pythonpath``) replaces the server
    process's ``PYTHONPATH``."""
    args = vLLMConfig.build_args(vllm_config=vllm_config, tp_size=tp_size, pp_size=pp_size, host=host, port=port)
    if pythonpath:
        args[ENV_KEY] = {"PYTHONPATH": str(pythonpath)}
    if settings.kernels == "tik":
        if tp_size != 1 or pp_size != 1:
            raise ValueError(f"the tik vLLM models run on one GPU per server; got tensor parallel {tp_size}, "
                             f"pipeline parallel {pp_size} (use rollout.backend vllm:dN)")
        args.update(tik_engine_args(model_type_of(vllm_config.model)))
        if settings.backend:
            args.setdefault(ENV_KEY, {})[BACKEND_ENV] = settings.backend
    return args


def vllm_cmd(args: dict[str, Any]) -> list[str]:
    """The server's command line: AReaL's flags (``get_py_cmd``) for our module, run by this interpreter."""
    cmd = get_py_cmd(SERVER_MODULE, {k: v for k, v in args.items() if k != ENV_KEY})
    return [sys.executable, *cmd[1:]]


def server_env(args: dict[str, Any], device: str | None = None, environ: dict | None = None) -> dict[str, str]:
    """The server's environment: ``environ`` (default: this process's) plus :data:`ENV_KEY`'s entries; a
    ``device`` ``cuda:N`` becomes ``CUDA_VISIBLE_DEVICES`` (the N-th visible GPU: vLLM takes its
    GPUs from that variable)."""
    env = dict(os.environ if environ is None else environ)
    env.update(args.get(ENV_KEY) or {})
    if device and device.startswith("cuda:"):
        idx = int(device.split(":", 1)[1])
        visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        if visible and idx >= len(visible):
            raise ValueError(f"server device {device}: only {len(visible)} GPU(s) in CUDA_VISIBLE_DEVICES")
        env["CUDA_VISIBLE_DEVICES"] = visible[idx] if visible else str(idx)
    return env


class TikVLLMBackend(VLLMBackend):
    """AReaL's vLLM request/response handling; the server launched is :data:`SERVER_MODULE`."""

    def launch_server(self, server_args: dict[str, Any]) -> subprocess.Popen:
        return subprocess.Popen(vllm_cmd(server_args), env=server_env(server_args), stdout=sys.stdout,
                                stderr=sys.stdout)


class TikRemotevLLMEngine(RemotevLLMEngine):
    """``RemotevLLMEngine`` whose local servers are :data:`SERVER_MODULE`."""

    def __init__(self, config: InferenceEngineConfig):
        private_port_draws()   # in a rollout worker: its server's port, apart from the run's seed
        self.config = config
        self._engine = RemoteInfEngine(config, TikVLLMBackend())


def launch_local_vllm_server(args: dict[str, Any], device: str | None = None, log_path: str | None = None,
                             timeout: float = 900.0) -> tuple[subprocess.Popen, str]:
    """Start the server of ``args`` (with ``host`` and ``port``) and wait for ``/health``; return (proc, addr)."""
    out = open(log_path, "ab") if log_path else None
    proc = subprocess.Popen(vllm_cmd(args), env=server_env(args, device),
                            stdout=out or sys.stdout, stderr=subprocess.STDOUT if out else sys.stderr)
    addr = f"{args['host']}:{args['port']}"
    try:
        wait_healthy(addr, timeout=timeout, proc=proc, what="the vLLM server")
    except BaseException:
        proc.terminate()
        raise
    return proc, addr


def _parallel(config):
    return ModelAllocation.from_str(config.rollout.backend, name="rollout").parallel


def server_args_for(config, settings: Settings, parallel=None, host: str | None = None,
                    port: int | None = None) -> dict[str, Any]:
    """The registry's ``server_args`` hook: :func:`vllm_server_args` from an experiment config (``vllm.*``, the
    rollout allocation's tensor/pipeline sizes, ``actor.tik.server_pythonpath``)."""
    par = parallel or _parallel(config)
    return vllm_server_args(config.vllm, settings, tp_size=par.tp_size, pp_size=par.pp_size, host=host, port=port,
                            pythonpath=config.actor.tik.server_pythonpath)


def launch_for(config, settings: Settings, log_dir: str) -> tuple[subprocess.Popen, str]:
    """The registry's ``launch`` hook: one vLLM server for the SPMD entry point, on ``actor.tik.server_device``
    (default: the trainer's GPU), logging to ``<log_dir>/vllm_server.log``."""
    args = server_args_for(config, settings, host="127.0.0.1", port=find_free_ports(1)[0])
    return launch_local_vllm_server(args, device=settings.server_device, log_path=os.path.join(log_dir, "vllm_server.log"),
                                    timeout=max(900.0, float(getattr(config.rollout, "setup_timeout", 0) or 0)))


def check_tik_config(config) -> None:
    """The registry's ``check_config`` hook, for ``actor.kernel_backend=tik``: one GPU per server (tensor and
    pipeline parallel 1), bf16 weights (what the trainer's digest assumes), no LoRA."""
    try:
        par = _parallel(config)
    except Exception as e:  # noqa: BLE001 - AReaL's parser has several error types
        raise ConfigError(f"rollout.backend {config.rollout.backend!r}: {e}") from None
    if par.tp_size != 1 or par.pp_size != 1:
        raise ConfigError(f"rollout.backend must be 'vllm:dN' (tensor and pipeline parallel 1) with "
                          f"actor.kernel_backend=tik: the tik vLLM models run on one GPU per server, got "
                          f"{config.rollout.backend!r}")
    v = config.vllm
    if str(v.dtype) != "bfloat16":
        raise ConfigError(f"vllm.dtype must be 'bfloat16' with actor.kernel_backend=tik (the tik vLLM models "
                          f"run bf16 weights, as the trainer's digest assumes), got {v.dtype!r}")
    if v.enable_lora:
        raise ConfigError("vllm.enable_lora must be false with actor.kernel_backend=tik")
