"""``python -m areal_tik.areal.vllm_server <AReaL's vLLM server arguments>``: AReaL's vLLM server, run unchanged.

AReaL 1.0.4 starts ``python3 -m areal.engine.vllm_ext.areal_vllm_server <vLLM serve flags>``. This
module is that command with two additions, made before AReaL's server module runs:

1. :func:`areal_tik.areal.vllm_compat.install_aliases`: the four names AReaL imports from modules
   vLLM 0.24 no longer has (nothing happens on a vLLM that still has them);
2. a wrapper around ``vllm.entrypoints.openai.api_server.build_app`` (AReaL's own ``build_app``
   patch calls it) that adds ``GET``/``POST /get_server_info`` -- the facts the tik skip rule checks,
   asked from the vLLM workers by ``collective_rpc`` when they run the tik worker extension
   (:data:`~areal_tik.areal.vllm_info.TIK_WORKER_EXTENSION`), else a stock answer no skip accepts --,
   with that extension ``POST /update_weights_from_ipc`` (the trainer's shared buffer, ``actor.tik.weight_transfer:
   ipc``), and a middleware that counts AReaL's weight updates (:class:`~areal_tik.areal.vllm_info.WeightVersion`).

Then AReaL's server module runs as ``__main__`` (``runpy``), parsing the same argv. Its routes,
its ``/v1/completions`` wrapper and its weight-update endpoints are AReaL's.
"""
# no ``from __future__ import annotations``: FastAPI reads the endpoint's ``Request`` annotation as a class
import importlib
import importlib.metadata as md
import runpy
import sys

from areal_tik.areal.vllm_compat import install_aliases
from areal_tik.engine.server.config import LOOPBACK_HOSTS
from areal_tik.areal.vllm_info import (INFO_RPC, IPC_RPC, IPC_UPDATE, TIK_WORKER_EXTENSION, UPDATE_ROUTES,
                                      WeightVersion, server_info)

__all__ = ["AREAL_SERVER", "API_SERVER", "flag_value", "collect_info", "add_info_routes", "load_shared",
           "CountWeightUpdates", "hook_build_app", "main"]

AREAL_SERVER = "areal.engine.vllm_ext.areal_vllm_server"
API_SERVER = "vllm.entrypoints.openai.api_server"


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value of ``--flag X`` or ``--flag=X`` in ``argv`` (the last one wins, as in argparse)."""
    val = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            val = argv[i + 1]
        elif a.startswith(flag + "="):
            val = a.split("=", 1)[1]
    return val


def vllm_version() -> str | None:
    try:
        return md.version("vllm")
    except md.PackageNotFoundError:
        return None


async def collect_info(engine_client, *, ask_workers: bool, model_path: str, version: WeightVersion,
                       vllm_ver: str | None) -> dict:
    """The ``/get_server_info`` body; the workers are asked only when they run the tik extension
    (a stock worker has no such method)."""
    workers = list(await engine_client.collective_rpc(INFO_RPC)) if ask_workers else None
    return server_info(model_path=model_path, vllm_version=vllm_ver, weight_version=version.version,
                       workers=workers)


def add_info_routes(app, *, ask_workers: bool, model_path: str, version: WeightVersion) -> None:
    """``/get_server_info`` (GET and POST) and the weight-update counting middleware on vLLM's app."""
    # optional dependency (fastapi): imported only on this path
    from fastapi import Request
    from fastapi.responses import JSONResponse
    ver = vllm_version()

    async def get_server_info(raw_request: Request):
        info = await collect_info(raw_request.app.state.engine_client, ask_workers=ask_workers,
                                  model_path=model_path, version=version, vllm_ver=ver)
        return JSONResponse(info)

    app.add_api_route("/get_server_info", get_server_info, methods=["GET", "POST"])
    if ask_workers:
        async def update_weights_from_ipc(raw_request: Request):
            status, body = await load_shared(raw_request)
            return JSONResponse(body, status_code=status)
        app.add_api_route(IPC_UPDATE, update_weights_from_ipc, methods=["POST"])
    add_outer_middleware(app, CountWeightUpdates, version=version)


async def load_shared(raw_request) -> tuple[int, dict]:
    """``POST /update_weights_from_ipc`` on a tik vLLM server: loopback peers only; every worker loads the trainer's
    shared buffer (``IPC_RPC``), then the prefix cache is dropped (K/V of the old weights). ``(status, body)``."""
    client = getattr(raw_request, "client", None)
    host = getattr(client, "host", None)
    if host not in LOOPBACK_HOSTS:
        return 403, {"success": False, "message": f"{IPC_UPDATE} serves loopback peers only (got {host})"}
    try:
        body = await raw_request.json()
    except ValueError:
        return 400, {"success": False, "message": "the body is not JSON"}
    engine = raw_request.app.state.engine_client
    results = list(await engine.collective_rpc(IPC_RPC, args=(body,)))
    refused = [str(r[1]) for r in results if not (isinstance(r, (tuple, list)) and r and r[0])]
    if refused or not results:
        return 400, {"success": False, "message": f"{IPC_UPDATE}: {refused[0] if refused else 'no worker answered'}"}
    await engine.reset_prefix_cache()
    return 200, {"success": True, "message": "Succeeded to update model weights.", "workers": len(results)}


def add_outer_middleware(app, cls, **options) -> None:
    """``app.add_middleware(cls, **options)``, also on an app whose middleware stack is already built: vLLM
    0.24's ``build_app`` ends with the SageMaker bootstrap, which builds the stack, and Starlette then refuses
    ``add_middleware`` ("Cannot add middleware after an application has started"). There the middleware goes
    first in ``user_middleware`` (outermost, as ``add_middleware`` puts it) and the stack is rebuilt."""
    if getattr(app, "middleware_stack", None) is None:
        app.add_middleware(cls, **options)
        return
    from starlette.middleware import Middleware  # optional dependency (starlette): imported only on this path
    app.user_middleware.insert(0, Middleware(cls, **options))
    app.middleware_stack = app.build_middleware_stack()


class CountWeightUpdates:
    """ASGI middleware: the status of AReaL's weight-update and pause routes goes to ``version``; every other
    request passes straight through (nothing wraps the generation path)."""

    def __init__(self, app, version: WeightVersion):
        self.app, self.version = app, version

    async def __call__(self, scope, receive, send):
        path = scope.get("path") if scope.get("type") == "http" else None
        if path not in UPDATE_ROUTES:
            return await self.app(scope, receive, send)
        seen = {}

        async def send_status(message):
            if message.get("type") == "http.response.start":
                seen["status"] = int(message.get("status", 0))
            await send(message)

        await self.app(scope, receive, send_status)
        self.version.observe(path, seen.get("status", 0))


def hook_build_app(api_server, add) -> None:
    """Make ``api_server.build_app`` call ``add(app)`` on every app it builds (AReaL's server imports
    ``build_app`` when it runs, so it picks up this wrapper and wraps it in turn)."""
    original = api_server.build_app

    def build_app(*args, **kwargs):
        app = original(*args, **kwargs)
        add(app)
        return app

    build_app.__wrapped__ = original
    api_server.build_app = build_app


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    added = install_aliases()
    if added:
        print(f"areal-tik vllm_server: aliased for AReaL's server: {', '.join(added)}", file=sys.stderr, flush=True)
    ask = flag_value(argv, "--worker-extension-cls") == TIK_WORKER_EXTENSION
    model_path = flag_value(argv, "--model") or ""
    version = WeightVersion()
    hook_build_app(importlib.import_module(API_SERVER),
                   lambda app: add_info_routes(app, ask_workers=ask, model_path=model_path, version=version))
    sys.argv = [sys.argv[0], *argv]
    # alter_sys=False: __main__ stays this module, so a spawned vLLM process re-imports this one, not AReaL's
    runpy.run_module(AREAL_SERVER, run_name="__main__", alter_sys=False)


if __name__ == "__main__":  # pragma: no cover
    main()
