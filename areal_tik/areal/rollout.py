"""The ``tik`` rollout engine (``areal_tik.areal.engines``): AReaL's SGLang client pointed at ``areal-tik serve``.

:class:`TikServerBackend` is AReaL's ``SGLangBackend`` (same HTTP requests and response
parsing) whose ``launch_server`` starts ``areal-tik serve`` instead of SGLang;
:class:`TikRemoteSGLangEngine` is ``RemoteSGLangEngine`` built on it. AReaL's
single-controller mode launches servers through ``launch_server``; SPMD mode connects to
``AREAL_LLM_SERVER_ADDRS``, which :func:`launch_local_server` fills for our entry point.

:func:`server_args` replaces ``SGLangConfig.build_args`` (which raises
``PackageNotFoundError: sglang`` on a machine without SGLang, even in SPMD mode); :func:`server_args_for` and
:func:`launch_for` are the engine's registry hooks (from an experiment config).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from typing import Any

from areal.api.cli_args import InferenceEngineConfig
from areal.engine.sglang_remote import RemoteSGLangEngine, SGLangBackend
from areal.infra import RemoteInfEngine
from areal.utils.network import find_free_ports

from areal_tik.areal.ports import private_port_draws
from areal_tik.settings import Settings

__all__ = ["TikServerBackend", "TikRemoteSGLangEngine", "server_args", "server_settings", "serve_cmd",
           "launch_local_server", "wait_healthy", "server_args_for", "launch_for"]


def server_args(model_path: str, settings: Settings, dtype: str = "bfloat16", seed: int = 0,
                device: str | None = None, context_length: int | None = None,
                max_running_requests: int | None = None, disable_cuda_graph: bool = False,
                cuda_graph_max_bs: int | None = None, disable_overlap_schedule: bool = False) -> dict[str, Any]:
    """The dict ``launch_server`` receives (AReaL adds ``host`` and ``port``); ``settings`` reach the
    server as flags (``Settings.server_flags``)."""
    args = {"model_path": model_path, "kernels": settings.kernels, "settings_flags": settings.server_flags(),
            "dtype": dtype, "random_seed": seed}
    if device:
        args["device"] = device
    if context_length:
        args["context_length"] = int(context_length)
    if max_running_requests:
        args["max_running_requests"] = int(max_running_requests)
    if disable_cuda_graph:
        args["disable_cuda_graph"] = True
    if cuda_graph_max_bs:
        args["cuda_graph_max_bs"] = int(cuda_graph_max_bs)
    if disable_overlap_schedule:
        args["disable_overlap_schedule"] = True
    return args


def server_settings(config) -> dict[str, Any]:
    """The server's settings from an AReaL experiment config, under SGLang's names: ``context_length``
    (``sglang.context_length``); ``max_running_requests`` (``sglang.max_running_requests``, else
    ``rollout.max_concurrent_rollouts``: what AReaL may send at once); ``disable_cuda_graph`` and
    ``cuda_graph_max_bs`` (``sglang.*``: no CUDA graphs at all; the largest decode batch captured);
    ``disable_overlap_schedule`` (``sglang.*``: no pipelined decode steps; AReaL's default, False, pipelines)."""
    sg, ro = getattr(config, "sglang", None), getattr(config, "rollout", None)
    mrr = getattr(sg, "max_running_requests", None) or getattr(ro, "max_concurrent_rollouts", None)
    return {"context_length": getattr(sg, "context_length", None), "max_running_requests": mrr,
            "disable_cuda_graph": bool(getattr(sg, "disable_cuda_graph", False)),
            "cuda_graph_max_bs": getattr(sg, "cuda_graph_max_bs", None),
            "disable_overlap_schedule": bool(getattr(sg, "disable_overlap_schedule", False))}


def serve_cmd(args: dict[str, Any]) -> list[str]:
    cmd = [sys.executable, "-m", "areal_tik.cli", "serve", "--model", str(args["model_path"]),
           "--host", str(args.get("host", "127.0.0.1")), "--port", str(args["port"]),
           "--dtype", str(args.get("dtype", "bfloat16")), "--seed", str(args.get("random_seed", 0)),
           *args.get("settings_flags", ["--kernels", str(args.get("kernels", "tik"))])]
    if args.get("device"):
        cmd += ["--device", str(args["device"])]
    if args.get("context_length"):
        cmd += ["--context-length", str(args["context_length"])]
    if args.get("max_running_requests"):
        cmd += ["--max-running-requests", str(args["max_running_requests"])]
    if args.get("disable_cuda_graph"):
        cmd += ["--disable-cuda-graph"]
    if args.get("cuda_graph_max_bs"):
        cmd += ["--cuda-graph-max-bs", str(args["cuda_graph_max_bs"])]
    if args.get("disable_overlap_schedule"):
        cmd += ["--disable-overlap-schedule"]
    return cmd


class TikServerBackend(SGLangBackend):
    """SGLang's request/response handling; the server launched is ``areal-tik serve``."""

    def launch_server(self, server_args: dict[str, Any]) -> subprocess.Popen:
        return subprocess.Popen(serve_cmd(server_args), env=os.environ.copy(), stdout=sys.stdout, stderr=sys.stdout)


class TikRemoteSGLangEngine(RemoteSGLangEngine):
    """``RemoteSGLangEngine`` whose local servers are ``areal-tik serve``."""

    def __init__(self, config: InferenceEngineConfig):
        private_port_draws()   # in a rollout worker: its server's port, apart from the run's seed
        self.config = config
        self._engine = RemoteInfEngine(config, TikServerBackend())


def wait_healthy(addr: str, timeout: float = 300.0, proc: subprocess.Popen | None = None,
                 what: str = "areal-tik serve") -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} before becoming healthy")
        try:
            with urllib.request.urlopen(f"http://{addr}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except Exception:  # noqa: BLE001
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{what} at {addr} not healthy after {timeout}s")


def launch_local_server(model_path: str, settings: Settings, port: int | None = None, host: str = "127.0.0.1",
                        dtype: str = "bfloat16", seed: int = 0, device: str | None = None,
                        log_path: str | None = None, timeout: float = 600.0,
                        env: dict | None = None, **sizing) -> tuple[subprocess.Popen, str]:
    """Start ``areal-tik serve`` as a child process and wait for ``/health``; return (proc, "host:port").
    ``sizing``: :func:`server_args`'s engine settings (what :func:`server_settings` reads from AReaL's config)."""
    if port is None:
        port = find_free_ports(1)[0]
    args = server_args(model_path, settings, dtype=dtype, seed=seed, device=device, **sizing)
    args.update(host=host, port=port)
    out = open(log_path, "ab") if log_path else None
    proc = subprocess.Popen(serve_cmd(args), env={**os.environ, **(env or {})},
                            stdout=out or sys.stdout, stderr=subprocess.STDOUT if out else sys.stderr)
    addr = f"{host}:{port}"
    try:
        wait_healthy(addr, timeout=timeout, proc=proc)
    except Exception:
        proc.terminate()
        raise
    return proc, addr


def server_args_for(config, settings: Settings, parallel=None) -> dict[str, Any]:
    """The registry's ``server_args`` hook: :func:`server_args` from an experiment config (the model dir, the
    actor's dtype, the seed, :func:`server_settings`)."""
    return server_args(config.sglang.model_path or config.actor.path, settings, dtype=config.actor.dtype,
                       seed=config.seed, **server_settings(config))


def launch_for(config, settings: Settings, log_dir: str) -> tuple[subprocess.Popen, str]:
    """The registry's ``launch`` hook: one ``areal-tik serve`` for the SPMD entry point, on
    ``settings.server_device``, logging to ``<log_dir>/tik_server.log``."""
    return launch_local_server(config.sglang.model_path or config.actor.path, settings, dtype=config.actor.dtype,
                               seed=config.seed, device=settings.server_device,
                               log_path=os.path.join(log_dir, "tik_server.log"), **server_settings(config))
