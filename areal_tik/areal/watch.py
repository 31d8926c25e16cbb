"""Ends a run whose rollout server died, with a message naming it, instead of letting it hang.

Seen on the CPU with AReaL 1.0.4 (2 trainer ranks, 2 ``areal-tik serve``, single-controller mode):
after one server is killed, its rollout worker's requests fail ("Failed after 3 retries"), AReaL
rejects those trajectories and then waits for a batch that never fills: no error, no progress
(still waiting minutes later). :class:`ServerWatch` polls every server's ``GET /health`` from the
trainer's process; a server with no successful answer for ``timeout`` seconds is declared dead and
``on_dead(addr, message)`` runs once (the trainer raises :class:`~areal_tik.areal.consensus.TikServerError`
in its main thread, and exits hard if the teardown does not finish within a grace period:
:func:`interrupt_main_with`).
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
import urllib.request
from typing import Callable

__all__ = ["ServerWatch", "Deadline", "probe_health", "dead_servers", "install_main_handler", "interrupt_main_with"]

logger = logging.getLogger("areal_tik.watch")


def probe_health(addr: str, timeout: float) -> str | None:
    """None if ``GET /health`` answers 200 within ``timeout`` seconds, else why not."""
    try:
        with urllib.request.urlopen(f"http://{addr}/health", timeout=timeout) as r:
            return None if r.status == 200 else f"HTTP {r.status}"
    except Exception as e:  # noqa: BLE001 - any failure to answer counts
        why = getattr(e, "reason", None) or e
        return f"{type(why).__name__}: {why}"


def dead_servers(addrs: list[str], timeout: float = 5.0,
                 probe: Callable[[str, float], str | None] = probe_health) -> dict[str, str]:
    """The servers that do not answer ``GET /health`` now, with why (one probe each)."""
    out = {}
    for a in addrs:
        err = probe(a, timeout)
        if err is not None:
            out[a] = err
    return out


class ServerWatch:
    """Polls ``addrs`` every ``interval`` seconds in a daemon thread; calls ``on_dead`` once, for the
    first server without a successful ``/health`` for ``timeout`` seconds (the timer starts at
    :meth:`start`, so a server must answer within ``timeout`` of it)."""

    def __init__(self, addrs: list[str], on_dead: Callable[[str, str], None], interval: float = 5.0,
                 timeout: float = 30.0, probe: Callable[[str, float], str | None] = probe_health):
        self.addrs = list(addrs)
        self.on_dead, self.interval, self.timeout, self.probe = on_dead, float(interval), float(timeout), probe
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.dead: str | None = None

    def start(self) -> "ServerWatch":
        if self.addrs and self.interval > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tik-server-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + self.timeout)

    def _run(self) -> None:
        last_ok = {a: time.monotonic() for a in self.addrs}
        last_err: dict[str, str] = {}
        while not self._stop.wait(self.interval):
            for a in self.addrs:
                err = self.probe(a, min(self.timeout, max(1.0, self.interval)))
                if self._stop.is_set():
                    return
                now = time.monotonic()
                if err is None:
                    last_ok[a] = now
                    continue
                last_err[a] = err
                if now - last_ok[a] >= self.timeout:
                    self.dead = a
                    msg = (f"rollout server {a} has not answered GET /health for {now - last_ok[a]:.0f} s (last: {err}); "
                           f"this run's servers are {', '.join(self.addrs)}. AReaL would wait for its rollouts "
                           f"forever: stopping the run (actor.tik.server_timeout={self.timeout:g} s, "
                           f"actor.tik.server_watch_interval={self.interval:g} s).")
                    logger.error(msg)
                    self.on_dead(a, msg)
                    return


_pending: list[BaseException] = []
_installed = False


def install_main_handler() -> bool:
    """From the main thread, once: SIGUSR2 then raises the exception :func:`interrupt_main_with` queued.
    False (nothing installed) elsewhere."""
    global _installed
    if threading.current_thread() is not threading.main_thread():
        return False

    def handler(signum, frame):
        if _pending:
            raise _pending.pop(0)
    signal.signal(signal.SIGUSR2, handler)
    _installed = True
    return True


class Deadline:
    """``with Deadline(seconds, what, cleanup):`` if the block is still running ``seconds`` later, log
    ``what``, run ``cleanup`` (e.g. kill this process's children) and exit the process with status 1.
    For teardowns that can hang on a dead peer (a gloo collective another rank never joins)."""

    def __init__(self, seconds: float, what: str, cleanup: Callable[[], None] | None = None):
        self.seconds, self.what, self.cleanup = float(seconds), what, cleanup
        self._done = threading.Event()

    def __enter__(self) -> "Deadline":
        threading.Thread(target=self._run, name="tik-deadline", daemon=True).start()
        return self

    def __exit__(self, *exc) -> bool:
        self._done.set()
        return False

    def _run(self) -> None:
        if self._done.wait(self.seconds):
            return
        logger.error("%s did not end within %.0f s; exiting now", self.what, self.seconds)
        try:
            if self.cleanup is not None:
                self.cleanup()
        except Exception as e:  # noqa: BLE001 - exiting anyway
            logger.error("cleanup before exiting failed: %s", e)
        finally:
            os._exit(1)


def interrupt_main_with(exc: BaseException, grace: float, cleanup: Callable[[], None] | None = None) -> None:
    """Raise ``exc`` in the main thread (a real SIGUSR2 to it, so a blocking wait there wakes up too; needs
    :func:`install_main_handler`); if the process is still alive ``grace`` seconds later (a teardown stuck
    on the dead server, or ``exc`` swallowed somewhere), run ``cleanup`` and exit with status 1."""
    Deadline(grace, f"the run (after: {exc})", cleanup).__enter__()
    if _installed:
        _pending.append(exc)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR2)
    else:
        logger.error("no handler in the main thread; the run ends in %.0f s", grace)
