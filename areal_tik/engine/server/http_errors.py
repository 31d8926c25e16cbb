"""JSON replies for the rollout server, errors included.

Every reply is ``Content-Type: application/json`` (AReaL's client reads nothing else as
JSON). :func:`error_reply` is the one shape of an error: ``{"success": false, "message":
..., "error": {"message": ..., "type": ...}}`` (SGLang's generate errors carry ``error``,
its weight-update replies ``success``/``message``; both are there). The middleware turns
what a handler did not answer itself into such a reply: aiohttp's own HTTP errors (404,
405, 413, ...) keep their status, any other exception is a 500 with its one-line reason.
"""
from __future__ import annotations

import json
import logging

__all__ = ["JSON", "json_reply", "error_reply", "error_middleware"]

JSON = "application/json"
logger = logging.getLogger("areal_tik.server")
_TYPES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed", 409: "conflict",
          413: "too_large", 500: "engine_error"}


def json_reply(obj, status: int = 200):
    """``obj`` as a JSON response (NaN and infinities are refused by no client of ours: Python's
    ``json`` writes them as ``NaN``/``Infinity``, which AReaL's client reads back)."""
    from aiohttp import web  # lazy: keeps aiohttp out of this module's import
    return web.Response(text=json.dumps(obj), status=status, content_type=JSON)


def error_reply(message: str, status: int = 400):
    """An error reply with a one-line ``message``."""
    line = (str(message).splitlines() or ["error"])[0][:2000]
    return json_reply({"success": False, "message": line,
                       "error": {"message": line, "type": _TYPES.get(status, "error"), "code": status}},
                      status=status)


def error_middleware():
    """aiohttp middleware: a handler's uncaught exception or aiohttp HTTP error becomes an
    :func:`error_reply` (logged once, with its traceback for a 500)."""
    from aiohttp import web  # lazy: keeps aiohttp out of this module's import

    @web.middleware
    async def middleware(request, handler):
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return error_reply(f"{request.method} {request.path}: {e.reason}", status=e.status)
        except Exception as e:  # noqa: BLE001 - the server answers every request
            logger.exception("%s %s failed", request.method, request.path)
            return error_reply(f"{type(e).__name__}: {e}", status=500)

    return middleware
