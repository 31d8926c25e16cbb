"""Notice ``/generate`` clients that went away, so their requests stop costing engine time.

A client that times out (AReaL's does, then retries) or dies closes its connection; aiohttp
does not cancel the handler then (its ``handler_cancellation`` is off, and on it would cancel
every route, weight updates included). :class:`ClientWatch` looks at the connection of every
waiting ``/generate`` request instead: one sweep every ``interval_s`` seconds for all of them
(cheap at any number of requests: one attribute check each), and ``on_gone(key)`` is called
once for each whose connection is closed. The server passes a callback that aborts the
request in the engine (freeing its KV pages) or drops it from the requests held during a
pause, which ends its handler and frees its request id.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

__all__ = ["ClientWatch", "client_gone"]

logger = logging.getLogger("areal_tik.server")


def client_gone(request) -> bool:
    """True once the connection ``request`` arrived on is closed or closing."""
    transport = request.transport
    return transport is None or transport.is_closing()


class ClientWatch:
    """Requests whose clients are watched: ``add(key, request)`` while the reply is pending,
    ``discard(key)`` once it is sent. ``run()`` (a task on the server's event loop) sweeps them;
    everything here runs on that loop's thread. ``gone`` counts the clients found gone."""

    def __init__(self, on_gone: Callable[[Any], None], interval_s: float = 0.1):
        self.on_gone = on_gone
        self.interval_s = float(interval_s)
        self._watched: dict[Any, Any] = {}
        self.gone = 0

    def add(self, key, request) -> None:
        self._watched[key] = request

    def discard(self, key) -> None:
        self._watched.pop(key, None)

    def __len__(self) -> int:
        return len(self._watched)

    def sweep(self) -> int:
        """Call ``on_gone`` for every watched request whose client is gone (and stop watching
        it); the number found."""
        found = [k for k, r in self._watched.items() if client_gone(r)]
        for key in found:
            del self._watched[key]
            self.gone += 1
            try:
                self.on_gone(key)
            except Exception:  # noqa: BLE001 - the sweep goes on for the others
                logger.exception("ending the request of a client that went away failed")
        return len(found)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.sweep()
