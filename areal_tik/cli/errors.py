"""User errors on the ``areal-tik`` command line: one clear line and exit status 2.

Subcommands check their arguments up front with the ``need_*`` helpers, which raise
:class:`UsageError` ("what is wrong; how to fix it") before anything slow starts.
:func:`run_command` runs a subcommand and turns a user error (``UsageError``, an
unsupported model, a missing file, a port in use) into ``areal-tik <cmd>: error: ...`` on
stderr and exit status 2; any other exception is one line and exit status 1. The
traceback is printed only with ``--debug``. No torch here.
"""
from __future__ import annotations

import errno
import math
import os
import socket
import sys
import traceback

from areal_tik.settings import SettingsError

__all__ = ["UsageError", "run_command", "need", "need_int", "need_float", "need_file", "need_model",
           "need_device", "need_port_free", "need_choices"]


class UsageError(Exception):
    """A bad command-line argument; the message says what is wrong and how to fix it."""


def need(cond: bool, message: str) -> None:
    """Raise :class:`UsageError` with ``message`` unless ``cond``."""
    if not cond:
        raise UsageError(message)


def need_int(flag: str, value, lo: int | None = None, hi: int | None = None, optional: bool = False) -> None:
    """``value`` is an int in ``[lo, hi]`` (or None when ``optional``)."""
    if value is None and optional:
        return
    if lo is not None and hi is not None:
        need(lo <= value <= hi, f"{flag} must be between {lo} and {hi}, got {value}")
    elif lo is not None:
        need(value >= lo, f"{flag} must be at least {lo}, got {value}")


def need_float(flag: str, value, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
               optional: bool = False) -> None:
    """``value`` is a finite float above ``lo`` (strictly when ``lo_open``) and at most ``hi``."""
    if value is None and optional:
        return
    need(math.isfinite(value), f"{flag} must be a finite number, got {value}")
    if lo is not None:
        ok = value > lo if lo_open else value >= lo
        need(ok, f"{flag} must be {'above' if lo_open else 'at least'} {lo:g}, got {value:g}")
    if hi is not None:
        need(value <= hi, f"{flag} must be at most {hi:g}, got {value:g}")


def need_file(flag: str, path: str) -> None:
    """``path`` is an existing regular file."""
    need(os.path.isfile(path), f"{flag} {path!r}: no such file" if not os.path.exists(path)
         else f"{flag} {path!r} is not a file")


def need_choices(flag: str, values: list, known) -> None:
    """Every one of ``values`` is in ``known`` (and there is at least one)."""
    need(bool(values), f"{flag} is empty; choose from {', '.join(known)}")
    bad = [v for v in values if v not in known]
    need(not bad, f"{flag}: unknown {', '.join(map(repr, bad))}; choose from {', '.join(known)}")


def need_model(flag: str, name: str) -> None:
    """``name`` is a model preset or an HF checkpoint directory (one with a config.json)."""
    from areal_tik.layers.models import PRESETS  # lazy: torch is heavy and every CLI command imports this module
    if name in PRESETS:
        return
    if os.path.isdir(name):
        need(os.path.isfile(os.path.join(name, "config.json")),
             f"{flag} {name!r} is a directory without config.json; give an HF model directory or a preset "
             f"({', '.join(sorted(PRESETS))})")
        return
    raise UsageError(f"{flag} {name!r} is neither a model preset nor a directory; presets: "
                     f"{', '.join(sorted(PRESETS))}")


def need_device(flag: str, device: str | None) -> None:
    """``device`` is None, ``cpu``, ``cuda`` or ``cuda:N`` for a GPU this machine has."""
    if device is None:
        return
    kind, _, index = device.partition(":")
    need(kind in ("cpu", "cuda") and (not index or (kind == "cuda" and index.isdigit())),
         f"{flag} {device!r} is not a device; use cpu, cuda or cuda:N")
    if kind == "cuda":
        import torch  # lazy: torch is heavy and every CLI command imports this module
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        need(n > 0, f"{flag} {device}: this machine has no CUDA GPU; use {flag} cpu")
        need(not index or int(index) < n, f"{flag} {device}: this machine has {n} GPU(s) (cuda:0..cuda:{n - 1})")


def need_port_free(host: str, port: int) -> None:
    """Nothing listens on ``host:port`` yet (checked by binding it once)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise UsageError(f"--host {host!r} cannot be resolved ({e.strerror or e}); use an address of this "
                         "machine, e.g. 127.0.0.1") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UsageError(f"port {port} on {host} is in use; pick another --port") from None
            raise UsageError(f"cannot listen on {host}:{port} ({e.strerror or e}); check --host and --port") from None


def _user_error(e: BaseException) -> str | None:
    """The one-line message of an exception that is the user's to fix, else None."""
    if isinstance(e, UsageError):
        return str(e)
    # lazy: torch is heavy and every CLI command imports this module
    from areal_tik.layers.patch import UnsupportedModelError
    if isinstance(e, UnsupportedModelError):
        return f"unsupported model: {e}"
    if isinstance(e, SettingsError):
        return str(e)
    if isinstance(e, (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)):
        return f"{e.strerror or e}: {e.filename}" if getattr(e, "filename", None) else str(e)
    if isinstance(e, OSError) and e.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
        return f"{e.strerror or e}; check --host and --port"
    return None


def run_command(func, args, prog: str, debug: bool = False) -> int:
    """Run ``func(args)``; its status, or 2 for a user error and 1 for any other exception
    (one line on stderr each; the traceback too with ``debug``). 130 on Ctrl-C."""
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except SystemExit as e:  # raise SystemExit("message"): the library's way to refuse a setting
        if not isinstance(e.code, str):
            raise
        if debug:
            traceback.print_exc()
        print(f"{prog}: error: {(e.code.splitlines() or [''])[0]}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - the command line reports every failure in one line
        if debug:
            traceback.print_exc()
        msg = _user_error(e)
        if msg is not None:
            print(f"{prog}: error: {msg.splitlines()[0] if msg else type(e).__name__}", file=sys.stderr)
            return 2
        line = (str(e).splitlines() or [""])[0]
        hint = "" if debug else " (run with --debug for the traceback)"
        print(f"{prog}: {type(e).__name__}: {line}{hint}", file=sys.stderr)
        return 1
